/* quant.h - EXL2 and GPTQ weight layouts: find and validate the tensors of one quantized
 * linear layer, describe it as column bit streams, dequantize it (reference), pack known
 * codes into it (tests, tools) and count its bits.
 *
 * Both formats store, for each output column n, the codes of the input rows as one
 * little-endian bit stream down the column: word i of the stream is element [i, n] of an
 * int32 matrix whose row stride is the number of columns (N' for EXL2, N for GPTQ), and
 * the code of stream row j occupies bits [j*b, (j+1)*b), straddling two words when b does
 * not divide 32. AutoGPTQ's 3-bit packing is exactly this stream: per 32 rows three words,
 * rows 0-9 at bits 3j of word 0, row 10 split (low 2 bits at bits 30-31 of word 0, high
 * bit at bit 0 of word 1), rows 11-20 at bits 1+3(j-11) of word 1, row 21 split (low bit
 * at bit 31 of word 1, high 2 bits at bits 0-1 of word 2), rows 22-31 at bits 2+3(j-22)
 * of word 2. GPTQ qzeros use the same stream along a row of columns (column n at bit n*b).
 *
 * Weights are W[k, n] with k < in_features (K), n < out_features (N); y = x·W. */
#ifndef EXL_QUANT_QUANT_H
#define EXL_QUANT_QUANT_H

#include "backend/backend.h"
#include "base/half.h"
#include "io/hf_config.h"
#include "io/weights.h"

#include <stdint.h>

/* ---- bit streams */

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

/* EXL2 scale of a (group, column): fp16(fp16(max / 256) * (code + 1)^2), code the 4-bit
 * scale code; every product is exact in fp32 before the final rounding to fp16. */
static inline float exl_exl2_scale(uint16_t scale_max, uint32_t code) {
    float m = exl_f16_to_f32(exl_f32_to_f16(exl_f16_to_f32(scale_max) / 256.0f));
    float c = (float)(code + 1);
    return exl_f16_to_f32(exl_f32_to_f16(m * c * c));
}

/* The 4-bit EXL2 scale code of (group g, column n); q_scale rows hold n_padded / 8 words. */
static inline uint32_t exl_exl2_scale_code(const exl_exl2_src *e, int64_t g, int64_t n) {
    return ((uint32_t)e->q_scale[g * (e->n_padded / 8) + n / 8] >> (4 * (n % 8))) & 15u;
}

/* ---- loading (detects nothing: the caller has seen <prefix>.q_weight or .qweight) */

/* Find <prefix>.q_weight, q_invperm, q_scale, q_scale_max, q_groups, check them (see
 * exl_exl2_check) and fill src->exl2. */
exl_status exl_exl2_load(const exl_weights *w, const char *prefix, exl_linear_src *src);
/* Find <prefix>.qweight, qzeros, scales, g_idx (optional), check them against the
 * quantization config q (bits, group_size, checkpoint_format) and fill src->gptq. */
exl_status exl_gptq_load(const exl_weights *w, const exl_quant_config *q, const char *prefix,
                         exl_linear_src *src);

/* Validate the contents of an EXL2 / GPTQ source whose array sizes already match its
 * fields (in_features, out_features, q_rows, n_groups, ...): bit widths, group layout,
 * permutation, group indices. Errors name src->name. */
exl_status exl_exl2_check(const exl_linear_src *src);
exl_status exl_gptq_check(const exl_linear_src *src);

/* ---- reference dequantization: w[k * out_features + n] = W[k, n] (fp32) */

exl_status exl_linear_dequant(const exl_linear_src *src, float *w);

/* ---- packing known codes (tests and the random model writer) */

/* EXL2: K rows in n_groups groups taken in permuted-row order; group g has bits[g] and
 * rows[g] rows. codes[r * N + n] is the b-bit code of permuted row r, scale_codes[g * N + n]
 * the 4-bit scale code. Writes q_weight [exl_exl2_q_rows, N'] (zeroed here), q_scale
 * [n_groups, N'/8] and q_groups [2 * n_groups]; N' = N rounded up to 32. */
int32_t exl_exl2_q_rows(const int32_t *bits, const int32_t *rows, int32_t n_groups);
void exl_exl2_pack(int64_t K, int64_t N, int32_t n_groups, const int32_t *bits, const int32_t *rows,
                   const uint8_t *codes, const uint8_t *scale_codes, int32_t *q_weight, int32_t *q_scale,
                   int16_t *q_groups);
/* GPTQ: codes[k * N + n] (original row order), zeros[g * N + n] as stored. Writes qweight
 * [K * bits / 32, N] and qzeros [G, N * bits / 32], zeroed here. */
void exl_gptq_pack(int bits, int64_t K, int64_t N, int32_t n_groups, const uint8_t *codes, const uint8_t *zeros,
                   int32_t *qweight, int32_t *qzeros);

/* ---- statistics (`exl info`) */

typedef struct exl_quant_stats {
    double bits;          /* storage bits by the formats' counting rule (docs/formats.md) */
    int64_t weights;      /* in_features * out_features */
    int64_t rows_by_bits[9]; /* input rows coded with b bits, b = 0..8 (0: unquantized) */
} exl_quant_stats;

/* EXL2: codes + 16 bits per group max scale + 32 bits per group entry + 4 bits per (group,
 * column) scale + 32 bits per q_invperm row. GPTQ: codes + 16-bit scale and b-bit zero per
 * (group, column) + 32 bits per g_idx row when present. Dense: 8 * dtype size per weight. */
void exl_linear_stats(const exl_linear_src *src, exl_quant_stats *out);

#endif
