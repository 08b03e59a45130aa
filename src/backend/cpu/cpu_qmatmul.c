/* cpu_qmatmul.c - out = x·W + b for EXL2 / GPTQ weights, straight from the packed codes.
 *
 * Threads split the output columns in kernel tiles (in halves or quarters of a tile where
 * whole tiles are fewer than twice the threads: decode's small matrices). Activation rows go in blocks of
 * QROWS; a thread's columns go in blocks whose accumulators fit QACC floats (all of a
 * thread's columns at decode). Per block the groups are walked in order and, within a
 * group, the tiles left to right: a thread reads each stream row of the group along its
 * columns, so its weight reads are a few sequential streams rather than one jump of a
 * whole row per load. Per (group, tile) the scales and zeros are decoded once and the ISA
 * kernel (qkernels.h) accumulates the group into the block. Each output is the sum of
 * its groups in order, whatever the block, so rows do not depend on their batch. */
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_quant.h"

#include "base/alloc.h"
#include "format/qstream.h"

#include <string.h>

#define QROWS 64  /* activation rows accumulated per pass over the weights */
#define QACC 8192 /* floats of accumulators per thread: [rows][block columns] */
/* Up to this many activation rows (decode), each thread quantizes them to int8 itself, into its own copy: a few
 * hundred nanoseconds against a second fork-join per matmul */
#define Q8_OWN_ROWS 4

typedef struct {
    const exl_cpu_qkernels *qk;
    float *out;
    const float *x;
    const exl_linear *w;
    int32_t rows;
    int8_t *xq; /* the int8 path (cpu_qact.c), or NULL */
    float *dx;
    int32_t *xsum;
    size_t own_stride; /* > 0: task i quantizes into xq, dx and xsum moved by i * own_stride bytes */
} qmatmul_job;

/* scale[i] and zero[i] of group g for columns n0 + i, i < width (0 beyond); zeros are
 * relative to the code midpoint 2^(b-1), as the kernels take them. */
static void group_params(const exl_linear *w, const exl_cpu_qkernels *qk, const exl_qgroup *grp, int64_t n0, int width,
                         float *scale, float *zero) {
    const exl_linear_src *s = &w->src;
    int tile = qk->tile;
    if (s->kind == EXL_LINEAR_EXL2) {
        /* eight 4-bit scale codes a word (exl_exl2_scale_code, hoisted) */
        const float *lut = w->q->lut + (int64_t)grp->g * 16;
        const uint32_t *codes = (const uint32_t *)s->exl2.q_scale + (int64_t)grp->g * (s->exl2.n_padded / 8);
        qk->exl2_scales(lut, codes, n0, width, scale);
        memset(zero, 0, (size_t)width * sizeof *zero);
    } else {
        const exl_gptq_src *q = &s->gptq;
        int64_t N = s->out_features;
        const int32_t *zrow = q->qzeros + (int64_t)grp->g * (N * q->bits / 32);
        int32_t mid = 1 << (q->bits - 1);
        qk->f16_to_f32(q->scales + (int64_t)grp->g * N + n0, scale, width);
        int32_t off = q->zero_offset - mid;
        if (32 % q->bits == 0) { /* codes never straddle words: exl_qstream_get, hoisted */
            const uint32_t *zw = (const uint32_t *)zrow;
            uint32_t mask = (1u << q->bits) - 1u;
            for (int i = 0; i < width; i++) {
                uint64_t bit = (uint64_t)(n0 + i) * (uint64_t)q->bits;
                zero[i] = (float)((int32_t)((zw[bit >> 5] >> (bit & 31)) & mask) + off);
            }
        } else {
            for (int i = 0; i < width; i++)
                zero[i] = (float)((int32_t)exl_qstream_get(zrow, 1, (n0 + i) * q->bits, q->bits) + off);
        }
    }
    for (int i = width; i < tile; i++)
        scale[i] = zero[i] = 0.0f;
}

static void qmatmul_task(void *p, int ti, int tn) {
    qmatmul_job own = *(const qmatmul_job *)p, *j = &own;
    const exl_cpu_qkernels *qk = j->qk;
    const exl_linear *w = j->w;
    const exl_cpu_qmat *q = w->q;
    int64_t K = w->src.in_features, N = w->src.out_features;
    int tile = qk->tile, unit = tile;
    while (unit >= 32 && (N + unit - 1) / unit < 2L * tn) /* too few tiles for the threads: share narrower units */
        unit /= 2;
    long u0, u1;
    exl_split_range((N + unit - 1) / unit, ti, tn, 1, &u0, &u1);
    int64_t cb = (int64_t)u0 * unit, ce = (int64_t)u1 * unit < N ? (int64_t)u1 * unit : N; /* this task's columns */
    if (j->own_stride && cb < ce) {
        size_t at = (size_t)ti * j->own_stride;
        own.xq = (int8_t *)((char *)own.xq + at);
        own.dx = (float *)((char *)own.dx + at);
        own.xsum = (int32_t *)((char *)own.xsum + at);
        exl_cpu_q8_quantize(qk, q, j->x, K, j->rows, own.xq, own.dx, own.xsum, 0, 1);
    }
    float acc[QACC], scale[EXL_QTILE_MAX], zero[EXL_QTILE_MAX];
    for (int32_t rb = 0; rb < j->rows; rb += QROWS) {
        int nrows = j->rows - rb < QROWS ? j->rows - rb : QROWS;
        const float *xb = j->x + (int64_t)rb * K;
        int64_t span = (int64_t)(QACC / (nrows * tile)) * tile; /* columns per block: acc holds [nrows][span] */
        for (int64_t c0 = cb; c0 < ce; c0 += span) {
            int ncols = (int)(ce - c0 < span ? ce - c0 : span);
            long nt = (ncols + tile - 1) / tile;
            int cols = (int)(nt * tile); /* acc rows are cols floats apart */
            memset(acc, 0, (size_t)nrows * (size_t)cols * sizeof(float));
            for (int32_t g = 0; g < q->n_groups; g++) {
                const exl_qgroup *grp = &q->groups[g];
                for (long t = 0; t < nt; t++) {
                    int64_t n0 = c0 + t * tile;
                    int width = ce - n0 < tile ? (int)(ce - n0) : tile;
                    group_params(w, qk, grp, n0, width, scale, zero);
                    if (j->xq && exl_cpu_q8_group_ok(grp)) {
                        int64_t xr = (int64_t)rb * q->n_groups + g;
                        qk->group_q8(grp, q->words + n0, q->ld, width, j->xq + (int64_t)rb * K + grp->row0, K,
                                     j->dx + xr, j->xsum + xr, q->n_groups, nrows, scale, zero, acc + t * tile, cols);
                        continue;
                    }
                    for (int r = 0; r < nrows; r += qk->max_nr) {
                        int nr = nrows - r < qk->max_nr ? nrows - r : qk->max_nr;
                        qk->group(grp, q->words + n0, q->ld, width, q->perm, xb + (int64_t)r * K, K, nr, scale, zero,
                                  acc + (int64_t)r * cols + t * tile, cols);
                    }
                }
            }
            for (int r = 0; r < nrows; r++) {
                float *o = j->out + (int64_t)(rb + r) * N + c0;
                for (int i = 0; i < ncols; i++)
                    o[i] = acc[r * cols + i] + (w->bias ? w->bias[c0 + i] : 0.0f);
            }
        }
    }
}

static void quantize_task(void *p, int ti, int tn) {
    const qmatmul_job *j = p;
    exl_cpu_q8_quantize(j->qk, j->w->q, j->x, j->w->src.in_features, j->rows, j->xq, j->dx, j->xsum, ti, tn);
}

/* Bytes of one copy of rows of w's int8 activations with their steps and sums (xq, dx, xsum; each xq_bytes). */
static size_t q8_bytes(const exl_linear *w, int32_t rows, size_t *xq_bytes) {
    int64_t K = w->src.in_features, n = (int64_t)rows * w->q->n_groups;
    *xq_bytes = ((size_t)(rows * K) + 63) & ~(size_t)63;
    return (*xq_bytes + (size_t)n * 8 + 63) & ~(size_t)63;
}

/* The backend's int8 scratch grown to bytes; 0 if memory is short (the exact path then). */
static int q8_scratch(exl_cpu_backend *cpu, size_t bytes) {
    if (bytes > cpu->q8_scratch_bytes) {
        exl_free_aligned(cpu->q8_scratch);
        cpu->q8_scratch = exl_malloc_aligned(bytes);
        cpu->q8_scratch_bytes = cpu->q8_scratch ? bytes : 0;
    }
    return cpu->q8_scratch != NULL;
}

/* j's int8 activations at base: xq, then the steps, then the sums */
static void q8_place(qmatmul_job *j, char *base, size_t xq_bytes) {
    int64_t n = (int64_t)j->rows * j->w->q->n_groups;
    j->xq = (int8_t *)base, j->dx = (float *)(base + xq_bytes), j->xsum = (int32_t *)(base + xq_bytes + n * 4);
}

void exl_cpu_qmatmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows) {
    exl_cpu_backend *cpu = exl_cpu(be);
    qmatmul_job j = {cpu->qk, out, x, w, rows, NULL, NULL, NULL, 0};
    if (cpu->q8) { /* int8 activations in the backend's scratch; if memory is short, the exact path */
        size_t xq_bytes, one = q8_bytes(w, rows, &xq_bytes);
        int own = rows <= Q8_OWN_ROWS && exl_pool_size(cpu->pool) > 1;
        if (q8_scratch(cpu, own ? one * (size_t)exl_pool_size(cpu->pool) : one)) {
            q8_place(&j, cpu->q8_scratch, xq_bytes);
            if (own)
                j.own_stride = one;
            else
                exl_pool_run_work(cpu->pool, quantize_task, &j, rows * w->src.in_features * 8);
        }
    }
    exl_pool_run(cpu->pool, qmatmul_task, &j);
}

typedef struct {
    qmatmul_job jobs[EXL_CPU_FUSED_MATMULS];
    int n;
} qmatmul_many_job;

static void qmatmul_many_task(void *p, int ti, int tn) {
    const qmatmul_many_job *m = p;
    for (int i = 0; i < m->n; i++)
        qmatmul_task((void *)(uintptr_t)&m->jobs[i], ti, tn);
}

int exl_cpu_qmatmul_fusable(exl_backend *be, const exl_linear *w, int32_t rows) {
    exl_cpu_backend *cpu = exl_cpu(be);
    return w->src.kind != EXL_LINEAR_DENSE && cpu->q8 && rows <= Q8_OWN_ROWS && exl_pool_size(cpu->pool) > 1;
}

void exl_cpu_qmatmul_many(exl_backend *be, float *const *outs, const float *x, const exl_linear *const *ws, int n,
                          int32_t rows) {
    exl_cpu_backend *cpu = exl_cpu(be);
    qmatmul_many_job m = {.n = n};
    size_t xq_bytes[EXL_CPU_FUSED_MATMULS], stride = 0;
    for (int i = 0; i < n; i++) { /* one stride for all: a thread's copy for one matrix never reaches the next's */
        size_t one = q8_bytes(ws[i], rows, &xq_bytes[i]);
        stride = one > stride ? one : stride;
    }
    if (!q8_scratch(cpu, stride * (size_t)exl_pool_size(cpu->pool))) {
        for (int i = 0; i < n; i++)
            exl_cpu_qmatmul(be, outs[i], x, ws[i], rows);
        return;
    }
    for (int i = 0; i < n; i++) {
        m.jobs[i] = (qmatmul_job){cpu->qk, outs[i], x, ws[i], rows, NULL, NULL, NULL, stride};
        q8_place(&m.jobs[i], cpu->q8_scratch, xq_bytes[i]);
    }
    exl_pool_run(cpu->pool, qmatmul_many_task, &m);
}
