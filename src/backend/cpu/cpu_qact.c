/* cpu_qact.c - activations quantized to int8 for the decode fast path of cpu_qmatmul.c: per
 * activation row and per group of the matrix, a step dx = max |x| / 127 over the group's rows
 * and xq = round(x / dx), gathered through the matrix's row permutation into the order the
 * int8 kernel reads them (exl_cpu_q8_order), with the sum of xq that corrects for zero points. */
#include "backend/cpu/cpu_quant.h"

#include <math.h>

void exl_cpu_q8_quantize(const exl_cpu_qmat *q, const float *x, int64_t K, int32_t rows, int8_t *xq, float *dx,
                         int32_t *xsum) {
    for (int32_t r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * K;
        for (int32_t gi = 0; gi < q->n_groups; gi++) {
            const exl_qgroup *g = &q->groups[gi];
            if (!exl_cpu_q8_group_ok(g))
                continue;
            const int32_t *perm = q->perm + g->row0;
            float amax = 0.0f;
            for (int64_t k = 0; k < g->n_rows; k++)
                amax = fmaxf(amax, fabsf(xr[perm[k]]));
            float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            int8_t *dst = xq + (int64_t)r * K + g->row0;
            int32_t sum = 0;
            for (int64_t k = 0; k < g->n_rows; k++) {
                int v = (int)nearbyintf(xr[perm[k]] * inv);
                dst[(k & ~31) + exl_cpu_q8_order(g->bits, (int)(k & 31))] = (int8_t)v;
                sum += v;
            }
            dx[(int64_t)r * q->n_groups + gi] = amax / 127.0f;
            xsum[(int64_t)r * q->n_groups + gi] = sum;
        }
    }
}
