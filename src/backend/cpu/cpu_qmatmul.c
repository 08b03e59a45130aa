/* cpu_qmatmul.c - out = x·W + b for EXL2 / GPTQ weights, straight from the packed codes.
 *
 * Threads split the output columns in kernel tiles. Per tile, activation rows go in
 * blocks of QROWS; per (tile, group) the scales and zeros of the tile's columns are
 * decoded once and the ISA kernel (qkernels.h) accumulates the group into the block. */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_quant.h"

#include "quant/quant.h"

#include <string.h>

#define QROWS 64 /* activation rows accumulated per pass over a tile's weights */

typedef struct {
    const exl_cpu_qkernels *qk;
    float *out;
    const float *x;
    const exl_linear *w;
    int32_t rows;
} qmatmul_job;

/* scale[i] and zero[i] of group g for columns n0 + i, i < width (0 beyond); zeros are
 * relative to the code midpoint 2^(b-1), as the kernels take them. */
static void group_params(const exl_linear *w, const exl_cpu_qkernels *qk, const exl_qgroup *grp, int64_t n0,
                         int width, float *scale, float *zero) {
    const exl_linear_src *s = &w->src;
    int tile = qk->tile;
    if (s->kind == EXL_LINEAR_EXL2) {
        const float *lut = w->q->lut + (int64_t)grp->g * 16;
        for (int i = 0; i < width; i++) {
            scale[i] = lut[exl_exl2_scale_code(&s->exl2, grp->g, n0 + i)];
            zero[i] = 0.0f;
        }
    } else {
        const exl_gptq_src *q = &s->gptq;
        int64_t N = s->out_features;
        const int32_t *zrow = q->qzeros + (int64_t)grp->g * (N * q->bits / 32);
        int32_t mid = 1 << (q->bits - 1);
        qk->f16_to_f32(q->scales + (int64_t)grp->g * N + n0, scale, width);
        for (int i = 0; i < width; i++)
            zero[i] = (float)((int32_t)exl_qstream_get(zrow, 1, (n0 + i) * q->bits, q->bits) + q->zero_offset - mid);
    }
    for (int i = width; i < tile; i++)
        scale[i] = zero[i] = 0.0f;
}

static void qmatmul_task(void *p, int ti, int tn) {
    const qmatmul_job *j = p;
    const exl_cpu_qkernels *qk = j->qk;
    const exl_linear *w = j->w;
    const exl_cpu_qmat *q = w->q;
    int64_t K = w->src.in_features, N = w->src.out_features;
    int tile = qk->tile;
    long t0, t1;
    exl_split_range((N + tile - 1) / tile, ti, tn, 1, &t0, &t1);
    float acc[QROWS * EXL_QTILE_MAX], scale[EXL_QTILE_MAX], zero[EXL_QTILE_MAX];
    for (long t = t0; t < t1; t++) {
        int64_t n0 = (int64_t)t * tile;
        int width = N - n0 < tile ? (int)(N - n0) : tile;
        for (int32_t rb = 0; rb < j->rows; rb += QROWS) {
            int nrows = j->rows - rb < QROWS ? j->rows - rb : QROWS;
            const float *xb = j->x + (int64_t)rb * K;
            memset(acc, 0, (size_t)nrows * tile * sizeof(float));
            for (int32_t g = 0; g < q->n_groups; g++) {
                const exl_qgroup *grp = &q->groups[g];
                group_params(w, qk, grp, n0, width, scale, zero);
                for (int r = 0; r < nrows; r += qk->max_nr) {
                    int nr = nrows - r < qk->max_nr ? nrows - r : qk->max_nr;
                    qk->group(grp, q->words + n0, q->ld, width, q->perm, xb + (int64_t)r * K, K, nr, scale, zero,
                              acc + r * tile);
                }
            }
            for (int r = 0; r < nrows; r++) {
                float *o = j->out + (int64_t)(rb + r) * N + n0;
                for (int i = 0; i < width; i++)
                    o[i] = acc[r * tile + i] + (w->bias ? w->bias[n0 + i] : 0.0f);
            }
        }
    }
}

void exl_cpu_qmatmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows) {
    qmatmul_job j = {exl_cpu(be)->qk, out, x, w, rows};
    exl_pool_run(exl_cpu(be)->pool, qmatmul_task, &j);
}
