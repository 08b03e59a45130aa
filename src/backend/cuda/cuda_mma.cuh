/* cuda_mma.cuh - the warp-level tensor-core instructions the kernels share: fp16 m16n8k16
 * mma with fp32 accumulation, and ldmatrix loads of its fragments from shared memory. */
#ifndef EXL_CUDA_MMA_CUH
#define EXL_CUDA_MMA_CUH

#include "backend/cuda/cuda_internal.h"

/* c += a · b for one m16n8k16 tile (two m16n8k8 before sm_80). */
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a2), "r"(a3), "r"(b1));
#endif
}

/* the same with the A fragment as an array */
__device__ __forceinline__ void mma16816a(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    mma16816(c, a[0], a[1], a[2], a[3], b0, b1);
}

/* Four 8x8 fp16 matrices from shared memory (lane l gives the address of row l % 8 of matrix
 * l / 8), as mma fragments; Trans: each matrix transposed (sm_75+). */
#define EXL_LDSM_X4(op) \
    asm volatile(op " {%0,%1,%2,%3}, [%4];\n" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a))
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const __half *p) {
#if __CUDA_ARCH__ >= 750
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    if constexpr (Trans)
        EXL_LDSM_X4("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16");
    else
        EXL_LDSM_X4("ldmatrix.sync.aligned.m8n8.x4.shared.b16");
#endif
}
#undef EXL_LDSM_X4

#endif
