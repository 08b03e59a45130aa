/* cuda_async.cuh - 16-byte copies from global to shared memory, asynchronous (cp.async) from sm_80 on, shared by
 * the quantized matmuls that stage their operands in shared memory (cuda_qmma.cu, cuda_qrows.cu, GEMV-A). A copy is
 * visible to the thread that issued it after exl_cp_wait<N> leaves at most N of its committed groups in flight, and
 * to the rest of the block after a __syncthreads() past that; below sm_80 the copy is a plain load and store. */
#ifndef EXL_CUDA_ASYNC_CUH
#define EXL_CUDA_ASYNC_CUH

#include <cuda_runtime.h>

/* the shared-window address of p, as cp.async takes it */
__device__ __forceinline__ unsigned exl_smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

/* 16 bytes from src (global, 16-byte aligned) to dst (a shared-window address), through L2 only */
__device__ __forceinline__ void exl_cp16(unsigned dst, const void *src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
#else
    unsigned v0, v1, v2, v3;
    asm volatile("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v0), "=r"(v1), "=r"(v2), "=r"(v3) : "l"(src));
    asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};" ::"r"(dst), "r"(v0), "r"(v1), "r"(v2), "r"(v3));
#endif
}

/* the thread's copies since the last commit become one group */
__device__ __forceinline__ void exl_cp_commit(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

/* wait until at most N of the thread's committed groups are still in flight */
template <int N>
__device__ __forceinline__ void exl_cp_wait(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

#endif
