/* qkernels_scalar.c - the portable fused quantized group kernel (one column a "vector",
 * a 4-column tile, four activation rows a call). */
#include "backend/cpu/qkernels.h"

#include "base/half.h"

#define VL 1
#define QNR 4
typedef int32_t vint;
typedef float vflt;
typedef int vmask;
#define VMASK(n) ((n) > 0)
#define VI_LOADM(p, m) ((m) ? *(p) : 0)
#define VI_SRL(v, s) ((int32_t)((uint32_t)(v) >> (s)))
#define VI_SLL(v, s) ((int32_t)((uint32_t)(v) << (s)))
#define VI_SRA(v, s) ((v) >> (s))
#define VI_XOR(a, b) ((a) ^ (b))
#define VI_SUB(a, b) ((a) - (b))
#define VI_AND(a, b) ((a) & (b))
#define VI_OR(a, b) ((a) | (b))
#define VI_SET1(a) ((int32_t)(a))
#define VF_CVT(v) ((float)(v))
#define VF_SET1(a) (a)
#define VF_FMA(a, b, c) ((a) * (b) + (c))
#define VF_MUL(a, b) ((a) * (b))
#define VF_SUB(a, b) ((a) - (b))
#define VF_ZERO 0.0f
#define VF_LOAD(p) (*(p))
#define VF_STORE(p, v) (*(p) = (v))
#define QKERNEL_NAME scalar
#include "backend/cpu/qkernels_impl.h"

static void f16_to_f32(const uint16_t *src, float *dst, int n) {
    for (int i = 0; i < n; i++)
        dst[i] = exl_f16_to_f32(src[i]);
}

const exl_cpu_qkernels exl_cpu_qkernels_scalar = {"scalar",   QTILE, QNR,  q_group_any,
                                                  f16_to_f32, NULL,  NULL, exl_cpu_exl2_scales_scalar};
