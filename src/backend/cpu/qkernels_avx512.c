/* qkernels_avx512.c - the fused quantized group kernel with AVX-512 (16 columns a vector,
 * a 64-column tile, four activation rows a call; compiled with -mavx512f/bw/vl/dq). */
#include "backend/cpu/qkernels.h"

#include <immintrin.h>

#define VL 16
#define QNR 4
typedef __m512i vint;
typedef __m512 vflt;
typedef __mmask16 vmask;
#define VMASK(n) ((n) >= 16 ? (__mmask16)0xffff : (n) <= 0 ? (__mmask16)0 : (__mmask16)((1u << (n)) - 1))
#define VI_LOADM(p, m) _mm512_maskz_loadu_epi32(m, p)
#define VI_SRL(v, s) _mm512_srli_epi32(v, (unsigned)(s))
#define VI_SLL(v, s) _mm512_slli_epi32(v, (unsigned)(s))
#define VI_SRA(v, s) _mm512_srai_epi32(v, (unsigned)(s))
#define VI_XOR(a, b) _mm512_xor_si512(a, b)
#define VI_SUB(a, b) _mm512_sub_epi32(a, b)
#define VI_AND(a, b) _mm512_and_si512(a, b)
#define VI_OR(a, b) _mm512_or_si512(a, b)
#define VI_SET1(a) _mm512_set1_epi32(a)
#define VI_ANDOR(a, m, o) _mm512_ternarylogic_epi32(a, VI_SET1(m), VI_SET1(o), 0xEA) /* (a & m) | o */
#define VF_CVT(v) _mm512_cvtepi32_ps(v)
#define VF_BITS(v) _mm512_castsi512_ps(v)
#define VF_SET1(a) _mm512_set1_ps(a)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
#define VF_SUB(a, b) _mm512_sub_ps(a, b)
#define VF_ZERO _mm512_setzero_ps()
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_STORE(p, v) _mm512_storeu_ps(p, v)
#define QKERNEL_NAME avx512
#include "backend/cpu/qkernels_impl.h"

static void f16_to_f32(const uint16_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
    }
}

/* 16 columns a step: eight code bytes split into low and high nibbles, interleaved back into column order, widened
 * to lane indices into the 16-float table */
static void exl2_scales(const float *lut, const uint32_t *codes, int64_t n0, int width, float *scale) {
    __m512 table = _mm512_loadu_ps(lut);
    const uint8_t *bytes = (const uint8_t *)codes + n0 / 2;
    __m128i nibble = _mm_set1_epi8(15);
    int i = 0;
    for (; i + 16 <= width; i += 16) {
        __m128i v = _mm_loadl_epi64((const __m128i *)(bytes + i / 2));
        __m128i lo = _mm_and_si128(v, nibble), hi = _mm_and_si128(_mm_srli_epi16(v, 4), nibble);
        _mm512_storeu_ps(scale + i, _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table));
    }
    exl_cpu_exl2_scales_scalar(lut, codes, n0 + i, width - i, scale + i);
}

const exl_cpu_qkernels exl_cpu_qkernels_avx512 = {
    "avx512", QTILE, QNR, q_group_any, f16_to_f32, exl_cpu_q8_group_avx512, exl_cpu_q8_quantize_avx512, exl2_scales};
