/* cpu_qact.c - activations quantized to int8 for the int8 path of cpu_qmatmul.c: per
 * activation row and per group of the matrix, a step dx = max |x| / 127 over the group's rows
 * and xq = round(x / dx), gathered through the matrix's row permutation into the order the
 * int8 kernel reads them (exl_cpu_q8_order), with the sum of xq that corrects for zero points;
 * the (row, group) pairs split over the threads, each group by the ISA's quantize_q8. */
#include "backend/cpu/cpu_quant.h"

#include "base/threads.h"

void exl_cpu_q8_quantize(const exl_cpu_qkernels *qk, const exl_cpu_qmat *q, const float *x, int64_t K, int32_t rows,
                         int8_t *xq, float *dx, int32_t *xsum, int part, int parts) {
    void (*quantize)(const float *, const int32_t *, int64_t, int, int8_t *, float *, int32_t *) = qk->quantize_q8;
    long i0, i1;
    exl_split_range((long)rows * q->n_groups, part, parts, 1, &i0, &i1);
    for (long it = i0; it < i1; it++) {
        int32_t r = (int32_t)(it / q->n_groups), gi = (int32_t)(it % q->n_groups);
        const float *xr = x + (int64_t)r * K;
        const exl_qgroup *g = &q->groups[gi];
        if (!exl_cpu_q8_group_ok(g))
            continue;
        int64_t at = (int64_t)r * q->n_groups + gi;
        quantize(xr, q->perm + g->row0, g->n_rows, g->bits, xq + (int64_t)r * K + g->row0, &dx[at], &xsum[at]);
    }
}
