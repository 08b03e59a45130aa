/* qkernels_avx2.c - the fused quantized group kernel with AVX2 (8 columns a vector, a
 * 32-column tile, two activation rows a call; compiled with -mavx2 -mfma -mf16c). */
#include "backend/cpu/qkernels.h"

#include "base/half.h"

#include <immintrin.h>

#define VL 8
#define QNR 2
typedef __m256i vint;
typedef __m256 vflt;
typedef __m256i vmask;
#define VMASK(n) _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))
#define VI_LOADM(p, m) _mm256_maskload_epi32((const int *)(p), m)
#define VI_SRL(v, s) _mm256_srli_epi32(v, (int)(s))
#define VI_SLL(v, s) _mm256_slli_epi32(v, (int)(s))
#define VI_SRA(v, s) _mm256_srai_epi32(v, (int)(s))
#define VI_XOR(a, b) _mm256_xor_si256(a, b)
#define VI_SUB(a, b) _mm256_sub_epi32(a, b)
#define VI_AND(a, b) _mm256_and_si256(a, b)
#define VI_OR(a, b) _mm256_or_si256(a, b)
#define VI_SET1(a) _mm256_set1_epi32(a)
#define VF_CVT(v) _mm256_cvtepi32_ps(v)
#define VF_SET1(a) _mm256_set1_ps(a)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
#define VF_SUB(a, b) _mm256_sub_ps(a, b)
#define VF_ZERO _mm256_setzero_ps()
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VF_STORE(p, v) _mm256_storeu_ps(p, v)
#define QKERNEL_NAME avx2
#include "backend/cpu/qkernels_impl.h"

static void f16_to_f32(const uint16_t *src, float *dst, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++)
        dst[i] = exl_f16_to_f32(src[i]);
}

const exl_cpu_qkernels exl_cpu_qkernels_avx2 = {"avx2",     QTILE, QNR,  q_group_any,
                                                f16_to_f32, NULL,  NULL, exl_cpu_exl2_scales_scalar};
