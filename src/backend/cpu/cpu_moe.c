/* cpu_moe.c - mixture of experts on the CPU: each row's experts from its router logits, and the experts run on
 * the rows that chose them (gathered expert by expert, so each expert's matmuls take all its rows at once). */
#include "backend/cpu/cpu.h"

#include <math.h>
#include <string.h>

/* ---- moe_route */

/* the top_k largest of row l (n values) into ids, larger first, lower id first among equals; a NaN comes
 * after every number; every id is a valid one */
static void top_ids(const float *l, int32_t n, int32_t k, int32_t *ids) {
    for (int32_t j = 0; j < k; j++) {
        int32_t best = -1;
        for (int32_t e = 0; e < n; e++) {
            int taken = 0;
            for (int32_t t = 0; t < j && !taken; t++)
                taken = ids[t] == e;
            if (!taken && (best < 0 || l[e] > l[best] || (l[best] != l[best] && l[e] == l[e])))
                best = e;
        }
        ids[j] = best;
    }
}

void exl_cpu_moe_route(exl_backend *be, const exl_moe_route_node *n) {
    for (int32_t r = 0; r < n->rows; r++) {
        const float *l = n->logits + (int64_t)r * n->n_experts;
        int32_t *ids = n->ids + (int64_t)r * n->top_k;
        float *w = n->weights + (int64_t)r * n->top_k;
        top_ids(l, n->n_experts, n->top_k, ids);
        float mx = l[ids[0]], sum = 0, chosen = 0;
        for (int32_t e = 0; e < n->n_experts; e++)
            sum += expf(l[e] - mx);
        for (int32_t j = 0; j < n->top_k; j++) {
            w[j] = expf(l[ids[j]] - mx) / sum;
            chosen += w[j];
        }
        for (int32_t j = 0; n->renormalize && j < n->top_k; j++)
            w[j] /= chosen;
    }
}

/* ---- moe_experts */

void exl_cpu_moe_experts(exl_backend *be, const exl_moe_experts_node *n) {
    const int64_t pairs = (int64_t)n->rows * n->top_k;
    int32_t *slot_row = n->slots, *pair_slot = n->slots + pairs; /* a slot's row; a (row, choice) pair's slot */
    for (int64_t p = 0; p < pairs; p++)
        pair_slot[p] = -1;
    int64_t s = 0;
    for (int32_t e = 0; e < n->n_experts; e++) {
        int64_t first = s;
        for (int64_t p = 0; p < pairs; p++)
            if (n->ids[p] == e) {
                slot_row[s] = (int32_t)(p / n->top_k);
                pair_slot[p] = (int32_t)s++;
            }
        int32_t count = (int32_t)(s - first);
        if (!count)
            continue;
        float *xs = n->xs + first * n->width, *gate = n->gate + first * n->ffn, *up = n->up + first * n->ffn;
        exl_cpu_gather_rows(be, xs, n->x, slot_row + first, count, n->width);
        exl_cpu_matmul(be, gate, xs, n->experts[e].gate, count);
        exl_cpu_matmul(be, up, xs, n->experts[e].up, count);
        exl_cpu_glu(be, gate, up, count, n->ffn, n->act);
        exl_cpu_matmul(be, xs, gate, n->experts[e].down, count); /* the slots' outputs where their inputs were */
    }
    for (int64_t p = 0; p < pairs; p++) {
        if (pair_slot[p] < 0)
            continue;
        const float *y = n->xs + (int64_t)pair_slot[p] * n->width;
        const float w = n->weights[p];
        float *o = n->out + p / n->top_k * n->width;
        for (int32_t i = 0; i < n->width; i++)
            o[i] += w * y[i];
    }
}
