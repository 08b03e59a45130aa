/* cpu_qprep.c - turn a validated EXL2 / GPTQ source into the CPU's column-stream view.
 *
 * EXL2: groups in q_groups order, perm = the inverse of q_invperm, a 16-entry scale table
 * per group. GPTQ: groups of group_size rows, or the runs of equal g_idx; when g_idx is
 * not sorted (act-order), the rows are sorted by group once here: qweight is repacked in
 * that order (the same size as the file's) and perm gathers the activations to match. */
#include "backend/cpu/cpu_quant.h"

#include "base/alloc.h"
#include "base/error.h"
#include "format/exl2.h"
#include "format/qstream.h"

#include <string.h>

static exl_status exl2_prep(const exl_linear_src *src, exl_cpu_qmat *q) {
    const exl_exl2_src *e = &src->exl2;
    int64_t K = src->in_features;
    q->words = e->q_weight;
    q->ld = e->n_padded;
    q->n_groups = e->n_groups;
    q->groups = exl_malloc((size_t)e->n_groups * sizeof *q->groups);
    q->lut = exl_malloc((size_t)e->n_groups * 16 * sizeof *q->lut);
    if (!q->groups || !q->lut)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int64_t k = 0; k < K; k++)
        q->perm[e->q_invperm[k]] = (int32_t)k;
    for (exl_exl2_group g = EXL_EXL2_WALK; exl_exl2_next_group(e, &g);) {
        q->groups[g.index] = (exl_qgroup){g.index, g.bits, g.row, g.n_rows, g.q_row * 32};
        for (uint32_t c = 0; c < 16; c++)
            q->lut[g.index * 16 + c] = exl_exl2_scale(e->q_scale_max[g.index], c);
    }
    return EXL_OK;
}

/* Groups as the runs of equal group index along the kernel rows. */
static exl_status gptq_runs(exl_cpu_qmat *q, const int32_t *group_of_row, int64_t K, int bits) {
    int32_t n = 0;
    for (int64_t r = 0; r < K; r++)
        n += r == 0 || group_of_row[r] != group_of_row[r - 1];
    q->groups = exl_malloc((size_t)n * sizeof *q->groups);
    if (!q->groups)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    q->n_groups = 0;
    for (int64_t r = 0; r < K; r++) {
        if (r == 0 || group_of_row[r] != group_of_row[r - 1])
            q->groups[q->n_groups++] = (exl_qgroup){group_of_row[r], bits, r, 0, r * bits};
        q->groups[q->n_groups - 1].n_rows++;
    }
    return EXL_OK;
}

static exl_status gptq_prep(const exl_linear_src *src, exl_cpu_qmat *q) {
    const exl_gptq_src *s = &src->gptq;
    int64_t K = src->in_features, N = src->out_features;
    int b = s->bits;
    q->words = s->qweight;
    q->ld = N;
    int32_t *grp = exl_malloc((size_t)K * sizeof *grp); /* group of each kernel row */
    if (!grp)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    int sorted = 1;
    for (int64_t k = 0; k < K; k++) {
        q->perm[k] = (int32_t)k;
        grp[k] = s->g_idx ? s->g_idx[k] : (int32_t)(k / s->group_size);
        sorted &= k == 0 || grp[k] >= grp[k - 1];
    }
    exl_status st = EXL_OK;
    if (!sorted) { /* stable counting sort of the rows by group */
        int64_t *start = exl_calloc((size_t)s->n_groups + 1, sizeof *start);
        q->repacked = exl_malloc_aligned((size_t)(K * b / 32) * (size_t)N * sizeof *q->repacked);
        if (!start || !q->repacked) {
            exl_free(start);
            exl_free(grp);
            return exl_fail(EXL_ERR_NOMEM, "out of memory repacking %s", src->name ? src->name : "GPTQ weights");
        }
        for (int64_t k = 0; k < K; k++)
            start[s->g_idx[k] + 1]++;
        for (int32_t g = 0; g < s->n_groups; g++)
            start[g + 1] += start[g];
        for (int64_t k = 0; k < K; k++)
            q->perm[start[s->g_idx[k]]++] = (int32_t)k;
        exl_free(start);
        memset(q->repacked, 0, (size_t)(K * b / 32) * (size_t)N * sizeof *q->repacked);
        for (int64_t r = 0; r < K; r++) {
            int64_t k = q->perm[r];
            grp[r] = s->g_idx[k];
            for (int64_t n = 0; n < N; n++)
                exl_qstream_put(q->repacked + n, N, r * b, b, exl_qstream_get(s->qweight + n, N, k * b, b));
        }
        q->words = q->repacked;
    }
    st = gptq_runs(q, grp, K, b);
    exl_free(grp);
    return st;
}

void exl_cpu_qmat_free(exl_cpu_qmat *q) {
    if (!q)
        return;
    exl_free(q->groups);
    exl_free(q->perm);
    exl_free_aligned(q->repacked);
    exl_free(q->lut);
    exl_free(q);
}

exl_status exl_cpu_qmat_init(const exl_linear_src *src, exl_cpu_qmat **out) {
    exl_cpu_qmat *q = exl_calloc(1, sizeof *q);
    if (!q || !(q->perm = exl_malloc((size_t)src->in_features * sizeof *q->perm))) {
        exl_free(q);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    exl_status st = src->kind == EXL_LINEAR_EXL2 ? exl2_prep(src, q) : gptq_prep(src, q);
    if (st != EXL_OK) {
        exl_cpu_qmat_free(q);
        return st;
    }
    *out = q;
    return EXL_OK;
}
