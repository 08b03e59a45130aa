/* quant_util.h - test helpers for quantized layers: random EXL2 / GPTQ layers packed from
 * known codes with their expected dense matrix, and the fused kernel checked against it. */
#ifndef EXL_TEST_QUANT_UTIL_H
#define EXL_TEST_QUANT_UTIL_H

#include "backend/backend.h"

#include <stdint.h>

/* An EXL2 layer: groups of bits[g] x rows[g] in permuted-row order, random codes,
 * scale codes, maxima, permutation and (if with_bias) bias. W is the expected matrix. */
typedef struct tq_exl2 {
    int64_t K, N, Np;
    int32_t G, Q;
    int32_t *q_weight, *q_invperm, *q_scale;
    uint16_t *q_scale_max, *bias;
    int16_t *q_groups;
    float *W; /* [K, N] */
} tq_exl2;

int tq_exl2_make(tq_exl2 *t, int64_t K, int64_t N, int32_t G, const int32_t *bits, const int32_t *rows, int with_bias,
                 uint32_t seed);
void tq_exl2_src(const tq_exl2 *t, exl_linear_src *src);
void tq_exl2_free(tq_exl2 *t);

/* A GPTQ layer. group_size -1: one group. g_idx_mode 0: none, 1: k / group_size,
 * 2: act-order (a random permutation of the rows, AutoGPTQ style), 3: random groups
 * (unsorted runs of any length). sym: zeros at the midpoint. v2: zeros stored as is. */
typedef struct tq_gptq {
    int bits, v2;
    int64_t K, N;
    int32_t G, group_size;
    int32_t *qweight, *qzeros, *g_idx;
    uint16_t *scales;
    float *W;
} tq_gptq;

int tq_gptq_make(tq_gptq *t, int bits, int64_t K, int64_t N, int32_t group_size, int g_idx_mode, int sym, int v2,
                 uint32_t seed);
void tq_gptq_src(const tq_gptq *t, exl_linear_src *src);
void tq_gptq_free(tq_gptq *t);

/* The worst relative L2 error, over rows and over every CPU instruction set this machine
 * has, of the backend's x·W + b against a double-precision x·W_expected + b, for `rows`
 * random activation rows. Negative (with a test failure recorded) if the layer fails to load. */
double tq_kernel_err(const exl_linear_src *src, const float *W, const float *bias, int rows, uint32_t seed);

#endif
