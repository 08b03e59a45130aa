/* cuda_kv_side.cuh - one side (keys or values) of a KV cache layer as the CUDA kernels read it, fp16 rows or
 * quantized slots (backend/kv_quant.h), and the group rotation its codes are stored in: shared by the quantized-cache
 * kernels (cuda_kv_quant.cu) and the tensor-core prompt attention that reads either (cuda_attention.cu). */
#ifndef EXL_CUDA_KV_SIDE_CUH
#define EXL_CUDA_KV_SIDE_CUH

#include "backend/cuda/cuda_internal.h"
#include "backend/kv_quant.h"

#define FULL 0xffffffffu

/* One side of a cache layer as the kernels read it: fp16 rows (bits 16) or quantized slots. */
typedef struct qk_side {
    unsigned char *base;
    int64_t slot_bytes;
    int32_t codes_bytes, bits;
} qk_side;

static inline qk_side side_of(const void *cache, int32_t bits, int32_t group, int32_t width) {
    qk_side s;
    s.base = (unsigned char *)(uintptr_t)cache;
    s.bits = exl_kv_quantized(bits) ? bits : 16;
    s.slot_bytes = (int64_t)exl_kv_slot_bytes(width, s.bits, group, sizeof(__half));
    s.codes_bytes = s.bits < 16 ? (int32_t)exl_kv_codes_bytes(width, s.bits) : 0;
    return s;
}

/* x of each lane becomes the Hadamard rotation over its group of g lanes (g = 16 or 32, its own inverse) */
__device__ __forceinline__ float hadamard_lanes(float x, int g) {
    const int lane = threadIdx.x % 32;
    for (int len = 1; len < g; len <<= 1) {
        const float p = __shfl_xor_sync(FULL, x, len);
        x = lane & len ? p - x : x + p;
    }
    return x * (1.0f / sqrtf((float)g));
}

/* code i (compile time) of BITS packed little-endian in the words w */
template <int BITS, int N>
__device__ __forceinline__ float qk_code(const uint32_t (&w)[N], int i) {
    const int bit = i * BITS, at = bit / 32, sh = bit % 32;
    uint32_t x = w[at] >> sh;
    if (sh + BITS > 32)
        x |= w[at + 1] << (32 - sh);
    return (float)(x & ((1u << BITS) - 1));
}

/* Merge the block's warps' online-softmax states (max wm, sum wl, unnormalised acc rows of
 * wacc with stride ws) for (row, head) rh: the output itself with one split, else the
 * split's partial (max, sum, acc) for the combine kernel. After a __syncthreads. Shared by the decode kernels
 * of cuda_attention.cu and cuda_kv_quant.cu. */
__device__ __forceinline__ void merge_warps(float *out, float *partial, const float *wm, const float *wl,
                                            const float *wacc, int ws, int hd, int64_t rh, int split) {
    const int n_warps = blockDim.x / 32;
    float bm = -INFINITY;
    for (int w = 0; w < n_warps; w++)
        bm = fmaxf(bm, wm[w]);
    float bl = 0.0f;
    for (int w = 0; w < n_warps; w++)
        bl += wm[w] == -INFINITY ? 0.0f : wl[w] * __expf(wm[w] - bm);
    float *pp = partial + (rh * gridDim.y + split) * (hd + 2);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < n_warps; w++)
            a += wm[w] == -INFINITY ? 0.0f : wacc[w * ws + d] * __expf(wm[w] - bm);
        if (gridDim.y == 1)
            out[rh * hd + d] = bl > 0.0f ? a / bl : 0.0f;
        else
            pp[2 + d] = a;
    }
    if (gridDim.y > 1 && threadIdx.x == 0) {
        pp[0] = bm;
        pp[1] = bl;
    }
}

/* Prompt attention on tensor cores (cuda_attention.cu) with either side quantized: head_dim 64 or 128, groups of 32,
 * sm_80+; 0 when the shape is not one it takes (the caller uses its own kernel). */
int exl_cuda_prefill_tc_quant(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v,
                              const qk_side &ks, const qk_side &vs, const exl_batch *b, const exl_attn_shape *sh);

#endif
