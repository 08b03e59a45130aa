/* qkernels_q8_avx512.c - the decode fast path of qkernels.h: a group of packed codes against
 * int8-quantized activations with AVX-512 VNNI (vpdpbusd: four u8 codes times four s8
 * activations summed into each 32-bit column lane), 16 columns a vector, 64 a tile.
 *
 * Codes are taken uncentered (0 .. 2^b - 1, unsigned bytes) 32 stream rows (b words) at a
 * time; each group of four rows becomes one dword of four code bytes per column. For b = 4
 * the two nibble planes of a word are those dwords (rows 0,2,4,6 and 1,3,5,7), otherwise
 * the four b-bit fields are spread to bytes with shifts. The activations come in the same
 * order (exl_cpu_q8_order), so one broadcast dword of activations meets each code dword.
 * A group's integer sum is exact; only the activations' rounding to int8 is approximate:
 *
 *   acc[r][i] += scale[i] * dx[r] * (sum xq * code - (2^(b-1) + zero[i]) * sum xq) */
#include "backend/cpu/qkernels.h"

#include <immintrin.h>

#define Q8_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define Q8_INLINE static inline __attribute__((always_inline)) Q8_TARGET
#define Q8_NV 4 /* vectors per 64-column tile */
#define Q8_NR 4 /* activation rows per pass */

/* Code bytes of the four rows 4d .. 4d+3 of a 32-row chunk (b words in w). */
Q8_INLINE __m512i q8_dword(const __m512i *w, int d, int B) {
    if (B == 8)
        return w[d];
    if (B == 4) {
        __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
        return d & 1 ? _mm512_and_si512(_mm512_srli_epi32(w[d >> 1], 4), nib) : _mm512_and_si512(w[d >> 1], nib);
    }
    int p = 4 * B * d, i = p >> 5, s = p & 31;
    __m512i v = _mm512_srli_epi32(w[i], (unsigned)s);
    if (s + 4 * B > 32)
        v = _mm512_or_si512(v, _mm512_slli_epi32(w[i + 1], (unsigned)(32 - s)));
    int m = (1 << B) - 1;
    __m512i r = _mm512_and_si512(v, _mm512_set1_epi32(m));
    /* byte k = field k: r | (v << k(8-b)) & (m << 8k), as one ternary op (A | B & C) */
    r = _mm512_ternarylogic_epi32(r, _mm512_slli_epi32(v, (unsigned)(8 - B)), _mm512_set1_epi32(m << 8), 0xF8);
    r = _mm512_ternarylogic_epi32(r, _mm512_slli_epi32(v, (unsigned)(16 - 2 * B)), _mm512_set1_epi32(m << 16), 0xF8);
    return _mm512_ternarylogic_epi32(r, _mm512_slli_epi32(v, (unsigned)(24 - 3 * B)), _mm512_set1_epi32(m << 24), 0xF8);
}

Q8_INLINE void q8_group(int B, int NR, const exl_qgroup *g, const int32_t *words, int64_t ld, const __mmask16 *m,
                        const int8_t *xq, int64_t ldxq, const float *dx, const int32_t *xsum, const float *scale,
                        const float *zero, float *acc, int64_t lda) {
    __m512i isum[Q8_NR][Q8_NV];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
#pragma GCC unroll 4
        for (int v = 0; v < Q8_NV; v++)
            isum[r][v] = _mm512_setzero_si512();
    const int32_t *w = words + (g->bit0 >> 5) * ld;
    for (int64_t row = 0; row < g->n_rows; row += 32, w += B * ld) {
#pragma GCC unroll 8
        for (int c = 0; c < B; c++)
            __builtin_prefetch(w + (2 * B + c) * ld), __builtin_prefetch(w + (2 * B + c) * ld + 32);
        int32_t xd[Q8_NR][8];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++)
            __builtin_memcpy(xd[r], xq + r * ldxq + row, 32);
#pragma GCC unroll 4
        for (int v = 0; v < Q8_NV; v++) {
            __m512i wv[8];
#pragma GCC unroll 8
            for (int c = 0; c < B; c++)
                wv[c] = _mm512_maskz_loadu_epi32(m[v], w + c * ld + v * 16);
#pragma GCC unroll 8
            for (int d = 0; d < 8; d++) {
                __m512i u = q8_dword(wv, d, B);
#pragma GCC unroll 4
                for (int r = 0; r < NR; r++)
                    isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], u, _mm512_set1_epi32(xd[r][d]));
            }
        }
    }
    float mid = (float)(1 << (B - 1));
#pragma GCC unroll 4
    for (int v = 0; v < Q8_NV; v++) {
        __m512 sc = _mm512_loadu_ps(scale + v * 16),
               z = _mm512_add_ps(_mm512_loadu_ps(zero + v * 16), _mm512_set1_ps(mid));
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float *o = acc + r * lda + v * 16;
            __m512 s = _mm512_fnmadd_ps(z, _mm512_set1_ps((float)xsum[r]), _mm512_cvtepi32_ps(isum[r][v]));
            _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_mul_ps(sc, _mm512_set1_ps(dx[r])), s, _mm512_loadu_ps(o)));
        }
    }
}

#define Q8_WIDTHS(NR)                                                                                                \
    static Q8_TARGET void q8_group_nr##NR(const exl_qgroup *g, const int32_t *words, int64_t ld, const __mmask16 *m, \
                                          const int8_t *xq, int64_t ldxq, const float *dx, int64_t lddx,             \
                                          const int32_t *xsum, const float *scale, const float *zero, float *acc,    \
                                          int64_t lda) {                                                             \
        float d[NR];                                                                                                 \
        int32_t s[NR];                                                                                               \
        for (int r = 0; r < NR; r++)                                                                                 \
            d[r] = dx[r * lddx], s[r] = xsum[r * lddx];                                                              \
        switch (g->bits) {                                                                                           \
        case 2: q8_group(2, NR, g, words, ld, m, xq, ldxq, d, s, scale, zero, acc, lda); break;                      \
        case 3: q8_group(3, NR, g, words, ld, m, xq, ldxq, d, s, scale, zero, acc, lda); break;                      \
        case 4: q8_group(4, NR, g, words, ld, m, xq, ldxq, d, s, scale, zero, acc, lda); break;                      \
        case 5: q8_group(5, NR, g, words, ld, m, xq, ldxq, d, s, scale, zero, acc, lda); break;                      \
        case 6: q8_group(6, NR, g, words, ld, m, xq, ldxq, d, s, scale, zero, acc, lda); break;                      \
        default: q8_group(8, NR, g, words, ld, m, xq, ldxq, d, s, scale, zero, acc, lda); break;                     \
        }                                                                                                            \
    }

Q8_WIDTHS(1)
Q8_WIDTHS(2)
Q8_WIDTHS(4)

Q8_TARGET void exl_cpu_q8_group_avx512(const exl_qgroup *g, const int32_t *words, int64_t ld, int width,
                                       const int8_t *xq, int64_t ldxq, const float *dx, const int32_t *xsum,
                                       int64_t lddx, int nr, const float *scale, const float *zero, float *acc,
                                       int64_t lda) {
    __mmask16 m[Q8_NV];
    for (int v = 0; v < Q8_NV; v++) {
        int n = width - v * 16;
        m[v] = n >= 16 ? (__mmask16)0xffff : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
    }
    int r = 0;
    for (; r + 4 <= nr; r += 4)
        q8_group_nr4(g, words, ld, m, xq + r * ldxq, ldxq, dx + r * lddx, lddx, xsum + r * lddx, scale, zero,
                     acc + r * lda, lda);
    for (; r + 2 <= nr; r += 2)
        q8_group_nr2(g, words, ld, m, xq + r * ldxq, ldxq, dx + r * lddx, lddx, xsum + r * lddx, scale, zero,
                     acc + r * lda, lda);
    for (; r < nr; r++)
        q8_group_nr1(g, words, ld, m, xq + r * ldxq, ldxq, dx + r * lddx, lddx, xsum + r * lddx, scale, zero,
                     acc + r * lda, lda);
}

/* One group's activations to int8: gathered through perm (for 4-bit groups in exl_cpu_q8_order,
 * by permuting the gather's indices), rounded to nearest even. */
Q8_TARGET void exl_cpu_q8_quantize_avx512(const float *x, const int32_t *perm, int64_t n, int bits, int8_t *dst,
                                          float *dx, int32_t *xsum) {
    const __m512i order4 = _mm512_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
    const __m512 abs_mask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
    __m512 mx = _mm512_setzero_ps();
    for (int64_t k = 0; k < n; k += 16)
        mx = _mm512_max_ps(mx, _mm512_and_ps(abs_mask, _mm512_i32gather_ps(_mm512_loadu_si512(perm + k), x, 4)));
    float amax = _mm512_reduce_max_ps(mx);
    __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < n; k += 16) {
        __m512i idx = _mm512_loadu_si512(perm + k);
        if (bits == 4)
            idx = _mm512_permutexvar_epi32(order4, idx);
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_i32gather_ps(idx, x, 4), inv));
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128((__m128i *)(dst + k), _mm512_cvtepi32_epi8(q));
    }
    *dx = amax / 127.0f;
    *xsum = _mm512_reduce_add_epi32(sum);
}
