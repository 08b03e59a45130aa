/* kernels_scalar.c - portable reference versions of the CPU inner loops. */
#include "backend/cpu/kernels.h"

#include "base/half.h"

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

const exl_cpu_kernels exl_cpu_kernels_scalar = {"scalar", dot_f32, dot_f16, dot_bf16,
                                                NULL,     NULL,    NULL,    exl_cpu_axpy_f32_scalar};
