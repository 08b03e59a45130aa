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

static void dense_task(void *p, int ti, int tn) {
    const matmul_job *j = p;
    const exl_linear_src *s = &j->w->src;
    const exl_cpu_kernels *k = j->be->k;
    int64_t K = s->in_features, N = s->out_features;
    long n0, n1;
    exl_split_range(N, ti, tn, 8, &n0, &n1);
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

void exl_cpu_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows) {
    if (w->src.kind != EXL_LINEAR_DENSE) {
        exl_cpu_qmatmul(be, out, x, w, rows);
        return;
    }
    matmul_job j = {exl_cpu(be), out, x, w, rows};
    exl_pool_run_work(exl_cpu(be)->pool, dense_task, &j, rows * w->src.in_features * w->src.out_features);
}
