/* cpu_matmul.c - out = x·W + b on the CPU, threads split the output features; quantized
 * weights go to cpu_qmatmul.c. */
#include "backend/cpu/cpu.h"

typedef struct {
    exl_cpu_backend *be;
    float *out;
    const float *x;
    const exl_linear *w;
    int32_t rows;
} matmul_job;

/* Column by column with the dot_* kernels, EXL_CPU_MAX_NR rows at a time. */
static void dense_dot(const matmul_job *j, long n0, long n1) {
    const exl_linear_src *s = &j->w->src;
    const exl_cpu_kernels *k = j->be->k;
    int64_t K = s->in_features, N = s->out_features;
    float acc[EXL_CPU_MAX_NR];
    for (int32_t r0 = 0; r0 < j->rows; r0 += EXL_CPU_MAX_NR) {
        int nr = j->rows - r0 < EXL_CPU_MAX_NR ? j->rows - r0 : EXL_CPU_MAX_NR;
        const float *xr = j->x + (int64_t)r0 * K;
        for (long n = n0; n < n1; n++) {
            switch (s->dense.dtype) {
            case EXL_DTYPE_F16: k->dot_f16(xr, K, nr, (const uint16_t *)s->dense.data + n * K, K, acc); break;
            case EXL_DTYPE_BF16: k->dot_bf16(xr, K, nr, (const uint16_t *)s->dense.data + n * K, K, acc); break;
            default: k->dot_f32(xr, K, nr, (const float *)s->dense.data + n * K, K, acc); break;
            }
            float b = j->w->bias ? j->w->bias[n] : 0.0f;
            for (int r = 0; r < nr; r++)
                j->out[(int64_t)(r0 + r) * N + n] = acc[r] + b;
        }
    }
}

/* EXL_CPU_NC columns at a time with the block kernels (same results as dense_dot), all
 * rows against them while their weights are in cache; a last partial block repeats its
 * last column (result dropped). */
static void dense_block(const matmul_job *j, long n0, long n1) {
    const exl_linear_src *s = &j->w->src;
    const exl_cpu_kernels *k = j->be->k;
    int64_t K = s->in_features, N = s->out_features;
    size_t esize = s->dense.dtype == EXL_DTYPE_F32 ? 4 : 2;
    float acc[EXL_CPU_MAX_NR * EXL_CPU_NC];
    for (long n = n0; n < n1; n += EXL_CPU_NC) {
        int nc = n1 - n < EXL_CPU_NC ? (int)(n1 - n) : EXL_CPU_NC;
        const void *w[EXL_CPU_NC];
        for (int c = 0; c < EXL_CPU_NC; c++)
            w[c] = (const char *)s->dense.data + (size_t)(n + (c < nc ? c : nc - 1)) * (size_t)K * esize;
        for (int32_t r0 = 0; r0 < j->rows; r0 += EXL_CPU_MAX_NR) {
            int nr = j->rows - r0 < EXL_CPU_MAX_NR ? j->rows - r0 : EXL_CPU_MAX_NR;
            const float *xr = j->x + (int64_t)r0 * K;
            switch (s->dense.dtype) {
            case EXL_DTYPE_F16: k->block_f16(xr, K, nr, (const uint16_t *const *)w, K, acc); break;
            case EXL_DTYPE_BF16: k->block_bf16(xr, K, nr, (const uint16_t *const *)w, K, acc); break;
            default: k->block_f32(xr, K, nr, (const float *const *)w, K, acc); break;
            }
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < nc; c++)
                    j->out[(int64_t)(r0 + r) * N + n + c] = acc[r * EXL_CPU_NC + c] +
                                                            (j->w->bias ? j->w->bias[n + c] : 0.0f);
        }
    }
}

static void dense_task(void *p, int ti, int tn) {
    const matmul_job *j = p;
    long n0, n1;
    exl_split_range(j->w->src.out_features, ti, tn, 8, &n0, &n1);
    /* one row streams each column once either way: dot_* keeps that stream sequential */
    if (j->be->k->block_f16 && j->rows > 1)
        dense_block(j, n0, n1);
    else
        dense_dot(j, n0, n1);
}

void exl_cpu_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows) {
    if (w->src.kind != EXL_LINEAR_DENSE) {
        exl_cpu_qmatmul(be, out, x, w, rows);
        return;
    }
    matmul_job j = {exl_cpu(be), out, x, w, rows};
    exl_pool_run_work(exl_cpu(be)->pool, dense_task, &j, rows * w->src.in_features * w->src.out_features);
}
