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

/* ---- attention over fp16 keys and values */

static inline __mmask16 head_mask(int32_t hd, int32_t d) {
    return hd - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (hd - d)) - 1);
}

/* Lane i of the result = the sum of v[i]'s 16 lanes: pairs of vectors summed lane-wise, then halves of what is left */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 s8[8], s4[4], s2[2];
    for (int i = 0; i < 8; i++) /* per 128 bits: [a0+a2, b0+b2, a1+a3, b1+b3] */
        s8[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) /* per 128 bits: four keys' partial sums */
        s4[i] = _mm512_add_ps(_mm512_shuffle_ps(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s8[2 * i], s8[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 2; i++) /* 128-bit quarters: [A01, A23, B01, B23] */
        s2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s4[2 * i], s4[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Each key converted once for the NH heads; its per-head partial sums wait in part until the block's 16 are summed */
static inline __attribute__((always_inline)) void scores_nh(int NH, const float *q, const uint16_t *const *k, int n,
                                                            int32_t hd, float *s) {
    __m512 part[EXL_CPU_HEADS][EXL_CPU_KEYS];
    for (int i = 0; i < EXL_CPU_KEYS; i++) {
        __m512 a[EXL_CPU_HEADS];
        UNROLL for (int h = 0; h < NH; h++) a[h] = _mm512_setzero_ps();
        for (int32_t d = 0; i < n && d < hd; d += 16) {
            __mmask16 m = head_mask(hd, d);
            __m512 kv = load_f16(k[i] + d, m);
            UNROLL for (int h = 0; h < NH; h++)
                a[h] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + (int64_t)h * hd + d), kv, a[h]);
        }
        UNROLL for (int h = 0; h < NH; h++) part[h][i] = a[h];
    }
    for (int h = 0; h < NH; h++)
        _mm512_storeu_ps(s + h * EXL_CPU_KEYS, sum_lanes16(part[h]));
}

static void scores_f16(const float *q, int nh, const uint16_t *const *k, int n, int32_t hd, float *s) {
    switch (nh) {
    case 1: scores_nh(1, q, k, n, hd, s); break;
    case 2: scores_nh(2, q, k, n, hd, s); break;
    case 3: scores_nh(3, q, k, n, hd, s); break;
    case 4: scores_nh(4, q, k, n, hd, s); break;
    case 5: scores_nh(5, q, k, n, hd, s); break;
    case 6: scores_nh(6, q, k, n, hd, s); break;
    case 7: scores_nh(7, q, k, n, hd, s); break;
    default: scores_nh(8, q, k, n, hd, s); break;
    }
}

/* exp(x) = 2^n e^r with n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts) within +-0.35, e^r by its Taylor
 * polynomial to r^6 (relative error under 2e-7); inputs clamped to where the result is a normal fp32 */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

static float exp_sum(float *x, float m, int n) {
    __m512 sum = _mm512_setzero_ps(), vm = _mm512_set1_ps(m);
    for (int i = 0; i < n; i += 16) {
        __mmask16 k = head_mask(n, i);
        __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));
        _mm512_mask_storeu_ps(x + i, k, e);
        sum = _mm512_mask_add_ps(sum, k, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
}

/* The NH heads' sums for 16 of the head's dims stay in registers while the block's keys go by */
static inline __attribute__((always_inline)) void values_nh(int NH, float *acc, const float *corr, const float *p,
                                                            const uint16_t *const *v, int n, int32_t hd) {
    for (int32_t d = 0; d < hd; d += 16) {
        __mmask16 m = head_mask(hd, d);
        __m512 a[EXL_CPU_HEADS];
        UNROLL for (int h = 0; h < NH; h++)
            a[h] = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + (int64_t)h * hd + d), _mm512_set1_ps(corr[h]));
        for (int i = 0; i < n; i++) {
            __m512 x = load_f16(v[i] + d, m);
            UNROLL for (int h = 0; h < NH; h++)
                a[h] = _mm512_fmadd_ps(_mm512_set1_ps(p[h * EXL_CPU_KEYS + i]), x, a[h]);
        }
        UNROLL for (int h = 0; h < NH; h++) _mm512_mask_storeu_ps(acc + (int64_t)h * hd + d, m, a[h]);
    }
}

static void values_f16(float *acc, int nh, const float *corr, const float *p, const uint16_t *const *v, int n,
                       int32_t hd) {
    switch (nh) {
    case 1: values_nh(1, acc, corr, p, v, n, hd); break;
    case 2: values_nh(2, acc, corr, p, v, n, hd); break;
    case 3: values_nh(3, acc, corr, p, v, n, hd); break;
    case 4: values_nh(4, acc, corr, p, v, n, hd); break;
    case 5: values_nh(5, acc, corr, p, v, n, hd); break;
    case 6: values_nh(6, acc, corr, p, v, n, hd); break;
    case 7: values_nh(7, acc, corr, p, v, n, hd); break;
    default: values_nh(8, acc, corr, p, v, n, hd); break;
    }
}

const exl_cpu_kernels exl_cpu_kernels_avx512 = {"avx512",   dot_f32,  dot_f16,    dot_bf16, block_f32, block_f16,
                                                block_bf16, axpy_f32, scores_f16, exp_sum,  values_f16};
