/* kernels_avx512.c - AVX-512 inner loops (compiled with -mavx512f/bw/vl/dq). */
#include "backend/cpu/kernels.h"

#include <immintrin.h>

static inline __m512 load_f32(const float *p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
static inline __m512 load_f16(const uint16_t *p, __mmask16 m) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

/* Two accumulators per row; the tail uses masked loads, so no scalar remainder. */
#define DEFINE_DOT(name, wtype, loadv)                                                             \
    static void name(const float *x, int64_t ldx, int nr, const wtype *w, int64_t k, float *out) { \
        __m512 a0[EXL_CPU_MAX_NR], a1[EXL_CPU_MAX_NR];                                             \
        for (int r = 0; r < nr; r++)                                                               \
            a0[r] = a1[r] = _mm512_setzero_ps();                                                   \
        int64_t i = 0;                                                                             \
        for (; i + 32 <= k; i += 32) {                                                             \
            __m512 w0 = loadv(w + i, 0xffff), w1 = loadv(w + i + 16, 0xffff);                      \
            for (int r = 0; r < nr; r++) {                                                         \
                a0[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + i), w0, a0[r]);              \
                a1[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + i + 16), w1, a1[r]);         \
            }                                                                                      \
        }                                                                                          \
        for (; i < k; i += 16) {                                                                   \
            __mmask16 m = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);      \
            __m512 w0 = loadv(w + i, m);                                                           \
            for (int r = 0; r < nr; r++)                                                           \
                a0[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + r * ldx + i), w0, a0[r]);     \
        }                                                                                          \
        for (int r = 0; r < nr; r++)                                                               \
            out[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));                            \
    }

DEFINE_DOT(dot_f32, float, load_f32)
DEFINE_DOT(dot_f16, uint16_t, load_f16)
DEFINE_DOT(dot_bf16, uint16_t, load_bf16)

/* NR rows x EXL_CPU_NC columns: the weights are loaded once per NR rows and the
 * activations once per EXL_CPU_NC columns. Each (row, column) sum is accumulated exactly
 * as DEFINE_DOT does it (two accumulators over 32-wide steps, the tail masked into the
 * first), so the block and dot kernels give bit-identical results. */
#define UNROLL _Pragma("GCC unroll 4")
#define DEFINE_BLOCK(name, wtype, loadv)                                                                        \
    static inline __attribute__((always_inline)) void name##_nr(int NR, const float *x, int64_t ldx,            \
                                                                const wtype *const *w, int64_t k, float *out) { \
        __m512 a0[EXL_CPU_MAX_NR][EXL_CPU_NC], a1[EXL_CPU_MAX_NR][EXL_CPU_NC];                                  \
        UNROLL for (int r = 0; r < NR; r++) UNROLL for (int c = 0; c < EXL_CPU_NC; c++)                         \
            a0[r][c] = a1[r][c] = _mm512_setzero_ps();                                                          \
        int64_t i = 0;                                                                                          \
        for (; i + 32 <= k; i += 32) {                                                                          \
            __m512 w0[EXL_CPU_NC], w1[EXL_CPU_NC];                                                              \
            UNROLL for (int c = 0; c < EXL_CPU_NC; c++) {                                                       \
                w0[c] = loadv(w[c] + i, 0xffff);                                                                \
                w1[c] = loadv(w[c] + i + 16, 0xffff);                                                           \
            }                                                                                                   \
            UNROLL for (int r = 0; r < NR; r++) {                                                               \
                __m512 x0 = _mm512_loadu_ps(x + r * ldx + i), x1 = _mm512_loadu_ps(x + r * ldx + i + 16);       \
                UNROLL for (int c = 0; c < EXL_CPU_NC; c++) {                                                   \
                    a0[r][c] = _mm512_fmadd_ps(x0, w0[c], a0[r][c]);                                            \
                    a1[r][c] = _mm512_fmadd_ps(x1, w1[c], a1[r][c]);                                            \
                }                                                                                               \
            }                                                                                                   \
        }                                                                                                       \
        for (; i < k; i += 16) {                                                                                \
            __mmask16 m = k - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k - i)) - 1);                   \
            __m512 w0[EXL_CPU_NC];                                                                              \
            UNROLL for (int c = 0; c < EXL_CPU_NC; c++) w0[c] = loadv(w[c] + i, m);                             \
            UNROLL for (int r = 0; r < NR; r++) {                                                               \
                __m512 x0 = _mm512_maskz_loadu_ps(m, x + r * ldx + i);                                          \
                UNROLL for (int c = 0; c < EXL_CPU_NC; c++) a0[r][c] = _mm512_fmadd_ps(x0, w0[c], a0[r][c]);    \
            }                                                                                                   \
        }                                                                                                       \
        UNROLL for (int r = 0; r < NR; r++) UNROLL for (int c = 0; c < EXL_CPU_NC; c++)                         \
            out[r * EXL_CPU_NC + c] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r][c], a1[r][c]));                  \
    }                                                                                                           \
    static void name(const float *x, int64_t ldx, int nr, const wtype *const *w, int64_t k, float *out) {       \
        switch (nr) {                                                                                           \
        case 1: name##_nr(1, x, ldx, w, k, out); break;                                                         \
        case 2: name##_nr(2, x, ldx, w, k, out); break;                                                         \
        case 3: name##_nr(3, x, ldx, w, k, out); break;                                                         \
        default: name##_nr(4, x, ldx, w, k, out); break;                                                        \
        }                                                                                                       \
    }

DEFINE_BLOCK(block_f32, float, load_f32)
DEFINE_BLOCK(block_f16, uint16_t, load_f16)
DEFINE_BLOCK(block_bf16, uint16_t, load_bf16)

/* The empty asm hides the product from the compiler, which would otherwise fuse it with the add under -mfma */
static void axpy_f32(float *y, float a, const float *x, int32_t n) {
    __m512 va = _mm512_set1_ps(a);
    for (int32_t i = 0; i < n; i += 16) {
        __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1);
        __m512 p = _mm512_mul_ps(va, _mm512_maskz_loadu_ps(m, x + i));
        __asm__("" : "+v"(p));
        _mm512_mask_storeu_ps(y + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i), p));
    }
}

const exl_cpu_kernels exl_cpu_kernels_avx512 = {"avx512",  dot_f32,   dot_f16,    dot_bf16,
                                                block_f32, block_f16, block_bf16, axpy_f32};
