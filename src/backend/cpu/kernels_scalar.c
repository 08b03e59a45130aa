/* kernels_scalar.c - portable reference versions of the CPU inner loops. */
#include "backend/cpu/kernels.h"

#include "base/half.h"

#include <math.h>
#include <stddef.h>
#include <string.h>

#define DEFINE_DOT(name, wtype, load)                                                                   \
    static void name(const float *x, int64_t ldx, int nr, const wtype *w, int64_t k, float *out) {      \
        for (int r = 0; r < nr; r++) {                                                                  \
            const float *xr = x + r * ldx;                                                              \
            float acc[8] = {0};                                                                         \
            int64_t i = 0;                                                                              \
            for (; i + 8 <= k; i += 8)                                                                  \
                for (int j = 0; j < 8; j++)                                                             \
                    acc[j] += xr[i + j] * load(w[i + j]);                                               \
            for (; i < k; i++)                                                                          \
                acc[0] += xr[i] * load(w[i]);                                                           \
            out[r] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])); \
        }                                                                                               \
    }

#define LOAD_F32(v) (v)
DEFINE_DOT(dot_f32, float, LOAD_F32)
DEFINE_DOT(dot_f16, uint16_t, exl_f16_to_f32)
DEFINE_DOT(dot_bf16, uint16_t, exl_bf16_to_f32)

/* compiled without FMA, so the compiler cannot fuse the multiply and the add */
void exl_cpu_axpy_f32_scalar(float *y, float a, const float *x, int32_t n) {
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) { /* eight at a time: -O2 turns the block into vector code */
        float t[8];
        for (int u = 0; u < 8; u++)
            t[u] = y[i + u] + a * x[i + u];
        memcpy(y + i, t, sizeof t);
    }
    for (; i < n; i++)
        y[i] += a * x[i];
}

void exl_cpu_scores_f16_scalar(const float *q, int nh, const uint16_t *const *k, int n, int32_t hd, float *s) {
    for (int i = 0; i < n; i++)
        for (int h = 0; h < nh; h++)
            dot_f16(q + (int64_t)h * hd, hd, 1, k[i], hd, s + h * EXL_CPU_KEYS + i);
}

float exl_cpu_exp_sum_scalar(float *x, float m, int n) {
    float sum = 0;
    for (int i = 0; i < n; i++) {
        x[i] = expf(x[i] - m);
        sum += x[i];
    }
    return sum;
}

void exl_cpu_values_f16_scalar(float *acc, int nh, const float *corr, const float *p, const uint16_t *const *v, int n,
                               int32_t hd) {
    for (int h = 0; h < nh; h++) {
        float *a = acc + (int64_t)h * hd;
        for (int32_t d = 0; d < hd; d++) {
            float sum = a[d] * corr[h];
            for (int i = 0; i < n; i++)
                sum += p[h * EXL_CPU_KEYS + i] * exl_f16_to_f32(v[i][d]);
            a[d] = sum;
        }
    }
}

const exl_cpu_kernels exl_cpu_kernels_scalar = {"scalar",
                                                dot_f32,
                                                dot_f16,
                                                dot_bf16,
                                                NULL,
                                                NULL,
                                                NULL,
                                                exl_cpu_axpy_f32_scalar,
                                                exl_cpu_scores_f16_scalar,
                                                exl_cpu_exp_sum_scalar,
                                                exl_cpu_values_f16_scalar};
