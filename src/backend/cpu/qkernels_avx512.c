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

const exl_cpu_qkernels exl_cpu_qkernels_avx512 = {
    "avx512", QTILE, QNR, q_group_any, f16_to_f32, exl_cpu_q8_group_avx512, exl_cpu_q8_quantize_avx512};
