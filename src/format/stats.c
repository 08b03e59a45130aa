/* stats.c - storage bits and the mix of code widths of one linear layer (`exl info`). */
#include "format/quant.h"

#include <string.h>

void exl_linear_stats(const exl_linear_src *src, exl_quant_stats *out) {
    int64_t K = src->in_features, N = src->out_features;
    memset(out, 0, sizeof *out);
    out->weights = K * N;
    switch (src->kind) {
    case EXL_LINEAR_EXL2: {
        const exl_exl2_src *e = &src->exl2;
        double bits = 0;
        for (exl_exl2_group g = EXL_EXL2_WALK; exl_exl2_next_group(e, &g);) {
            out->rows_by_bits[g.bits] += g.n_rows;
            bits += (double)g.n_rows * g.bits * N + 16 + 32 + 4.0 * N;
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
