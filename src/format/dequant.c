/* dequant.c - reference dequantization of EXL2, GPTQ and dense sources to fp32.
 *
 * Written for clarity, one weight at a time, straight from docs/formats.md: the tests
 * hold the fused CPU kernels and the packers against it. */
#include "format/quant.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"

static exl_status exl2_dequant(const exl_linear_src *src, float *w) {
    const exl_exl2_src *e = &src->exl2;
    int64_t K = src->in_features, N = src->out_features, Np = e->n_padded;
    /* row_of[r]: the input row k whose weights are permuted row r */
    int32_t *row_of = exl_malloc((size_t)K * sizeof *row_of);
    if (!row_of)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int64_t k = 0; k < K; k++)
        row_of[e->q_invperm[k]] = (int32_t)k;
    for (exl_exl2_group g = EXL_EXL2_WALK; exl_exl2_next_group(e, &g);) {
        const int32_t *words = e->q_weight + g.q_row * Np;
        for (int64_t j = 0; j < g.n_rows; j++) {
            float *out = w + (int64_t)row_of[g.row + j] * N;
            for (int64_t n = 0; n < N; n++) {
                int32_t q = (int32_t)exl_qstream_get(words + n, Np, j * g.bits, g.bits);
                out[n] = (float)(q - (1 << (g.bits - 1))) * exl_exl2_column_scale(e, g.index, n);
            }
        }
    }
    exl_free(row_of);
    return EXL_OK;
}

static void gptq_dequant(const exl_linear_src *src, float *w) {
    const exl_gptq_src *q = &src->gptq;
    int64_t K = src->in_features, N = src->out_features;
    int b = q->bits;
    for (int64_t k = 0; k < K; k++) {
        int64_t g = q->g_idx ? q->g_idx[k] : k / q->group_size;
        const int32_t *zrow = q->qzeros + g * (N * b / 32);
        for (int64_t n = 0; n < N; n++) {
            int32_t code = (int32_t)exl_qstream_get(q->qweight + n, N, k * b, b);
            int32_t zero = (int32_t)exl_qstream_get(zrow, 1, n * b, b) + q->zero_offset;
            w[k * N + n] = (float)(code - zero) * exl_f16_to_f32(q->scales[g * N + n]);
        }
    }
}

static void dense_dequant(const exl_linear_src *src, float *w) {
    int64_t K = src->in_features, N = src->out_features;
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            int64_t i = n * K + k;
            float v;
            switch (src->dense.dtype) {
            case EXL_DTYPE_F16: v = exl_f16_to_f32(((const uint16_t *)src->dense.data)[i]); break;
            case EXL_DTYPE_BF16: v = exl_bf16_to_f32(((const uint16_t *)src->dense.data)[i]); break;
            default: v = ((const float *)src->dense.data)[i]; break;
            }
            w[k * N + n] = v;
        }
}

exl_status exl_linear_dequant(const exl_linear_src *src, float *w) {
    switch (src->kind) {
    case EXL_LINEAR_EXL2: return exl2_dequant(src, w);
    case EXL_LINEAR_GPTQ: gptq_dequant(src, w); return EXL_OK;
    default: dense_dequant(src, w); return EXL_OK;
    }
}
