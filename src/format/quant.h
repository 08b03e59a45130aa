/* quant.h - EXL2 and GPTQ weights: find and validate the tensors of one quantized linear
 * layer, dequantize it (reference), pack known codes into it (tests, tools) and count its
 * bits. The codes lie in column bit streams (format/qstream.h); EXL2's groups and scales
 * are format/exl2.h's.
 *
 * Weights are W[k, n] with k < in_features (K), n < out_features (N); y = x·W. */
#ifndef EXL_FORMAT_QUANT_H
#define EXL_FORMAT_QUANT_H

#include "format/exl2.h"
#include "format/linear_src.h"
#include "format/qstream.h"
#include "io/hf_config.h"
#include "io/weights.h"

#include <stdint.h>

/* ---- loading (detects nothing: the caller has seen <prefix>.q_weight or .qweight) */

/* Find <prefix>.q_weight, q_invperm, q_scale, q_scale_max, q_groups, check them (see
 * exl_exl2_check) and fill src->exl2. */
exl_status exl_exl2_load(const exl_weights *w, const char *prefix, exl_linear_src *src);
/* Find <prefix>.qweight, qzeros, scales, g_idx (optional), check them against the
 * quantization config q (bits, group_size, checkpoint_format) and fill src->gptq. */
exl_status exl_gptq_load(const exl_weights *w, const exl_quant_config *q, const char *prefix, exl_linear_src *src);

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
    double bits;             /* storage bits by the formats' counting rule (docs/formats.md) */
    int64_t weights;         /* in_features * out_features */
    int64_t rows_by_bits[9]; /* input rows coded with b bits, b = 0..8 (0: unquantized) */
} exl_quant_stats;

/* EXL2: codes + 16 bits per group max scale + 32 bits per group entry + 4 bits per (group,
 * column) scale + 32 bits per q_invperm row. GPTQ: codes + 16-bit scale and b-bit zero per
 * (group, column) + 32 bits per g_idx row when present. Dense: 8 * dtype size per weight. */
void exl_linear_stats(const exl_linear_src *src, exl_quant_stats *out);

#endif
