/* kernels_avx2.c - AVX2 + FMA + F16C inner loops (compiled with -mavx2 -mfma -mf16c). */
#include "backend/cpu/kernels.h"

#include "base/half.h"

#include <immintrin.h>
#include <stddef.h>

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline __m256 load_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline float one_f32(float v) { return v; }

/* Two accumulators per row hide FMA latency; the tail is scalar. */
#define DEFINE_DOT(name, wtype, loadv, load1)                                                      \
    static void name(const float *x, int64_t ldx, int nr, const wtype *w, int64_t k, float *out) { \
        __m256 a0[EXL_CPU_MAX_NR], a1[EXL_CPU_MAX_NR];                                             \
        for (int r = 0; r < nr; r++)                                                               \
            a0[r] = a1[r] = _mm256_setzero_ps();                                                   \
        int64_t i = 0;                                                                             \
        for (; i + 16 <= k; i += 16) {                                                             \
            __m256 w0 = loadv(w + i), w1 = loadv(w + i + 8);                                       \
            for (int r = 0; r < nr; r++) {                                                         \
                a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i), w0, a0[r]);              \
                a1[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i + 8), w1, a1[r]);          \
            }                                                                                      \
        }                                                                                          \
        for (; i + 8 <= k; i += 8) {                                                               \
            __m256 w0 = loadv(w + i);                                                              \
            for (int r = 0; r < nr; r++)                                                           \
                a0[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i), w0, a0[r]);              \
        }                                                                                          \
        for (int r = 0; r < nr; r++) {                                                             \
            float s = hsum256(_mm256_add_ps(a0[r], a1[r]));                                        \
            for (int64_t j = i; j < k; j++)                                                        \
                s += x[r * ldx + j] * load1(w[j]);                                                 \
            out[r] = s;                                                                            \
        }                                                                                          \
    }

DEFINE_DOT(dot_f32, float, load_f32, one_f32)
DEFINE_DOT(dot_f16, uint16_t, load_f16, exl_f16_to_f32)
DEFINE_DOT(dot_bf16, uint16_t, load_bf16, exl_bf16_to_f32)

/* fp16 attention: the portable loops (the fp16 cache is the default only with AVX-512, cpu_backend.c) */
const exl_cpu_kernels exl_cpu_kernels_avx2 = {"avx2",
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
