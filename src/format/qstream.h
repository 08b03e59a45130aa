/* qstream.h - the column bit streams both quantized formats store their codes in.
 *
 * EXL2 and GPTQ store, for each output column n, the codes of the input rows as one
 * little-endian bit stream down the column: word i of the stream is element [i, n] of an
 * int32 matrix whose row stride is the number of columns (N' for EXL2, N for GPTQ), and
 * the code of stream row j occupies bits [j*b, (j+1)*b), straddling two words when b does
 * not divide 32. AutoGPTQ's 3-bit packing is exactly this stream: per 32 rows three words,
 * rows 0-9 at bits 3j of word 0, row 10 split (low 2 bits at bits 30-31 of word 0, high
 * bit at bit 0 of word 1), rows 11-20 at bits 1+3(j-11) of word 1, row 21 split (low bit
 * at bit 31 of word 1, high 2 bits at bits 0-1 of word 2), rows 22-31 at bits 2+3(j-22)
 * of word 2. GPTQ qzeros use the same stream along a row of columns (column n at bit n*b). */
#ifndef EXL_FORMAT_QSTREAM_H
#define EXL_FORMAT_QSTREAM_H

#include <stdint.h>

/* The b-bit code at stream bit `bit` of the column whose first word is col[0] and whose
 * words are `ld` int32 apart. */
static inline uint32_t exl_qstream_get(const int32_t *col, int64_t ld, int64_t bit, int b) {
    int64_t w = bit >> 5;
    int s = (int)(bit & 31);
    uint64_t v = (uint32_t)col[w * ld];
    if (s + b > 32)
        v |= (uint64_t)(uint32_t)col[(w + 1) * ld] << 32;
    return (uint32_t)(v >> s) & ((1u << b) - 1u);
}

/* OR a b-bit code into the stream (the words must start zeroed). */
static inline void exl_qstream_put(int32_t *col, int64_t ld, int64_t bit, int b, uint32_t code) {
    int64_t w = bit >> 5;
    int s = (int)(bit & 31);
    uint64_t v = (uint64_t)(code & ((1u << b) - 1u)) << s;
    col[w * ld] = (int32_t)((uint32_t)col[w * ld] | (uint32_t)v);
    if (s + b > 32)
        col[(w + 1) * ld] = (int32_t)((uint32_t)col[(w + 1) * ld] | (uint32_t)(v >> 32));
}

#endif
