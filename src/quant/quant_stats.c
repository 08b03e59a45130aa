/* quant_stats.c - storage bits and the mix of code widths of one linear layer (`exl info`). */
#include "quant/quant.h"

#include <string.h>

void exl_linear_stats(const exl_linear_src *src, exl_quant_stats *out) {
    int64_t K = src->in_features, N = src->out_features;
    memset(out, 0, sizeof *out);
    out->weights = K * N;
    switch (src->kind) {
    case EXL_LINEAR_EXL2: {
        const exl_exl2_src *e = &src->exl2;
        double bits = 0;
        for (int32_t g = 0; g < e->n_groups; g++) {
            int b = e->q_groups[2 * g];
            int64_t start = e->q_groups[2 * g + 1];
            int64_t end = g + 1 < e->n_groups ? e->q_groups[2 * g + 3] : e->q_rows;
            int64_t rows = (end - start) * 32 / b;
            out->rows_by_bits[b] += rows;
            bits += (double)rows * b * N + 16 + 32 + 4.0 * N;
        }
        out->bits = bits + 32.0 * K;
        break;
    }
    case EXL_LINEAR_GPTQ: {
        const exl_gptq_src *q = &src->gptq;
        out->rows_by_bits[q->bits] = K;
        out->bits = (double)K * N * q->bits + (double)q->n_groups * N * (16 + q->bits) + (q->g_idx ? 32.0 * K : 0);
        break;
    }
    default:
        out->rows_by_bits[0] = K;
        out->bits = (double)K * N * 8 * (double)exl_dtype_size(src->dense.dtype);
        break;
    }
}
