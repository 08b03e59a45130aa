/* exl2_quant.c - EXL2 recipes: group layout, storage bits and the ExLlamaV2 tensors.
 *
 * A recipe lists bit widths (descending) with the proportion of rows each gets and a
 * group size per width. Rows are in act-order, so the most important rows get the most
 * bits; each width but the last takes ceil(prop·K / gs) whole groups, the last the rest,
 * which is how ExLlamaV2's own files are laid out (e.g. 5/4 bits at 0.1/0.9 with groups
 * of 64 over 256 rows: one 5-bit group, three 4-bit groups). */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "format/quant.h"

#include <math.h>
#include <string.h>

exl_status exl_exl2_layout(const exl_qz_opt *o, int64_t K, exl_qz_layout *out) {
    memset(out, 0, sizeof *out);
    if (K % 32)
        return exl_fail(EXL_ERR_UNSUPPORTED, "EXL2 needs input features in multiples of 32 (got %lld)", (long long)K);
    int64_t rows_w[EXL_QZ_MAX_WIDTHS], left = K, G = 0;
    for (int32_t w = 0; w < o->n; w++) {
        if (w + 1 == o->n)
            rows_w[w] = left;
        else {
            int64_t r = (int64_t)ceil(o->prop[w] * (double)K / o->gs[w] - 1e-9) * o->gs[w];
            rows_w[w] = r < left ? r : left;
        }
        left -= rows_w[w];
        G += (rows_w[w] + o->gs[w] - 1) / o->gs[w];
    }
    out->bits = exl_malloc((size_t)G * sizeof(int32_t));
    out->rows = exl_malloc((size_t)G * sizeof(int32_t));
    if (!out->bits || !out->rows) {
        exl_qz_layout_free(out);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    for (int32_t w = 0; w < o->n; w++)
        for (int64_t r = 0; r < rows_w[w]; r += o->gs[w]) {
            out->bits[out->n_groups] = o->bits[w];
            out->rows[out->n_groups++] = (int32_t)(rows_w[w] - r < o->gs[w] ? rows_w[w] - r : o->gs[w]);
        }
    return EXL_OK;
}

double exl_exl2_opt_bits(const exl_qz_opt *o, int64_t K, int64_t N) {
    double bits = 32.0 * (double)K;
    int64_t left = K;
    for (int32_t w = 0; w < o->n; w++) {
        int64_t r = w + 1 == o->n ? left : (int64_t)ceil(o->prop[w] * (double)K / o->gs[w] - 1e-9) * o->gs[w];
        r = r < left ? r : left;
        left -= r;
        int64_t groups = (r + o->gs[w] - 1) / o->gs[w];
        bits += (double)r * o->bits[w] * (double)N + (double)groups * (48.0 + 4.0 * (double)N);
    }
    return bits;
}

void exl_exl2_tensors_free(exl_exl2_tensors *t) {
    exl_free(t->q_weight);
    exl_free(t->q_invperm);
    exl_free(t->q_scale);
    exl_free(t->q_scale_max);
    exl_free(t->q_groups);
    memset(t, 0, sizeof *t);
}

exl_status exl_exl2_tensors_make(const exl_qz_result *r, const exl_qz_layout *l, exl_exl2_tensors *t) {
    memset(t, 0, sizeof *t);
    int64_t K = r->K, N = r->N;
    t->G = l->n_groups;
    t->Np = (int32_t)((N + 31) / 32 * 32);
    t->Q = exl_exl2_q_rows(l->bits, l->rows, l->n_groups);
    t->q_weight = exl_malloc((size_t)t->Q * t->Np * sizeof(int32_t));
    t->q_invperm = exl_malloc((size_t)K * sizeof(int32_t));
    t->q_scale = exl_malloc((size_t)t->G * (t->Np / 8) * sizeof(int32_t));
    t->q_scale_max = exl_malloc((size_t)t->G * sizeof(uint16_t));
    t->q_groups = exl_malloc((size_t)t->G * 2 * sizeof(int16_t));
    if (!t->q_weight || !t->q_invperm || !t->q_scale || !t->q_scale_max || !t->q_groups) {
        exl_exl2_tensors_free(t);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    exl_exl2_pack(K, N, l->n_groups, l->bits, l->rows, r->codes, r->scale_codes, t->q_weight, t->q_scale, t->q_groups);
    for (int64_t i = 0; i < K; i++)
        t->q_invperm[r->perm[i]] = (int32_t)i;
    memcpy(t->q_scale_max, r->scale_max, (size_t)t->G * sizeof(uint16_t));
    return EXL_OK;
}
