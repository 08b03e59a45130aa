/* cuda_halves.h - the CUDA backend's layout of 3- and 5-bit codes, host side in plain C (the
 * packer in cuda_quant.cu and tests/unit/test_cuda_halves.c use it).
 *
 * The file's stream puts a 32-row chunk's row t at bit t b. The device decodes a pair of slots
 * (2p, 2p + 1) = rows (p, p + 16) at once, in one shift and one lop3 when the pair's two codes
 * lie at the same place in the two 16-bit halves of one word: pairs 0-14 sit 16 / b to a half
 * (pair p in word p / (16 / b), at bit (p % (16 / b)) b of each half), pair 15 in the top bit of
 * each half of the b words (bit k of its codes in word k). decode_chunk (cuda_qdecode.cuh) and
 * the tensor-core kernel read this layout. */
#ifndef EXL_CUDA_HALVES_H
#define EXL_CUDA_HALVES_H

#include <stdint.h>

static inline int exl_halves_layout(int b) { return b == 3 || b == 5; }

/* the code of slot `slot` (pair slot / 2, its low half if even) into a chunk's words wd[b] */
static inline void exl_halves_place(uint32_t *wd, int b, int slot, uint32_t code) {
    int p = slot / 2, h = (slot % 2) * 16, k = 16 / b;
    if (p < b * k) {
        wd[p / k] |= code << (h + (p % k) * b);
        return;
    }
    for (int i = 0; i < b; i++)
        wd[i] |= ((code >> i) & 1u) << (h + 15);
}

/* len (< 32) bits from bit pos of the stream s (the word after pos's readable) */
static inline uint32_t exl_stream_bits(const uint32_t *s, int pos, int len) {
    uint64_t v = ((uint64_t)s[(pos >> 5) + 1] << 32 | s[pos >> 5]) >> (pos & 31);
    return (uint32_t)v & ((1u << len) - 1);
}

/* One column of a whole chunk: its b words of the file's stream st (st[b] readable, any value)
 * into wd[b], as exl_halves_place would put them code by code: word u's halves are stream bits
 * 15u.. and 16b + 15u.. (15 each), its bits 15 and 31 bit u of rows 15 and 31. Inlined with a
 * literal b, ~9x faster than code by code (a 3-bit 7B model's load would feel that: ~15 s). */
static inline __attribute__((always_inline)) void exl_halves_from_stream(int b, const uint32_t *st, uint32_t *wd) {
    for (int u = 0; u < b; u++)
        wd[u] = exl_stream_bits(st, 15 * u, 15) | exl_stream_bits(st, 16 * b + 15 * u, 15) << 16 |
                exl_stream_bits(st, 15 * b + u, 1) << 15 | exl_stream_bits(st, 31 * b + u, 1) << 31;
}

#endif
