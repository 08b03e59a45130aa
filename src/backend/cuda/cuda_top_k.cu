/* cuda_top_k.cu - the k largest logits of each row, selected where the logits are, so a
 * sampler that only needs them never downloads a whole vocabulary.
 *
 * One block per row. A radix select over order-preserving 32-bit keys finds the k-th largest
 * key T in four 8-bit passes (shared histogram); then the keys above T are taken, and the ties
 * at T in id order until k, and the k are sorted (larger first, lower id first among equals:
 * the sampler's order, generator/sampler.c). Exact: the result equals a full sort's head. */
#include "backend/cuda/cuda_internal.h"

#define TOPK_THREADS 256

/* larger float <=> larger key (finite values and infinities) */
__device__ __forceinline__ uint32_t order_key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__global__ void __launch_bounds__(TOPK_THREADS)
    top_k_kernel(int32_t *ids, float *vals, const float *logits, int32_t vocab, int32_t k) {
    exl_pdl_start();
    __shared__ unsigned hist[256];
    __shared__ uint32_t s_prefix;
    __shared__ int s_need, s_count, s_taken, s_warp[TOPK_THREADS / 32];
    __shared__ int32_t cand[EXL_TOP_K_MAX];
    const float *x = logits + (int64_t)blockIdx.x * vocab;
    const int tid = threadIdx.x;

    /* radix select: after the passes, s_prefix is the key of the k-th largest value and
     * s_need how many values with exactly that key belong to the top k */
    uint32_t prefix = 0, mask = 0;
    if (tid == 0)
        s_need = k;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = tid; b < 256; b += TOPK_THREADS)
            hist[b] = 0;
        __syncthreads();
        for (int32_t i = tid; i < vocab; i += TOPK_THREADS) {
            uint32_t key = order_key(x[i]);
            if ((key & mask) == prefix)
                atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            int need = s_need, cum = 0, b = 255;
            for (; b > 0; b--) {
                if (cum + (int)hist[b] >= need)
                    break;
                cum += (int)hist[b];
            }
            s_need = need - cum;
            s_prefix = prefix | (uint32_t)b << shift;
        }
        __syncthreads();
        prefix = s_prefix;
        mask |= 255u << shift;
    }
    const uint32_t T = prefix;
    const int ties = s_need, above = k - ties;

    /* the values above T, in any order */
    if (tid == 0)
        s_count = 0, s_taken = 0;
    __syncthreads();
    for (int32_t i = tid; i < vocab; i += TOPK_THREADS)
        if (order_key(x[i]) > T)
            cand[atomicAdd(&s_count, 1)] = i;
    __syncthreads();
    /* the ties at T, lowest ids first: tiles of consecutive ids, ranked within the tile */
    for (int32_t base = 0; base < vocab && s_taken < ties; base += TOPK_THREADS) {
        int32_t i = base + tid;
        bool tie = i < vocab && order_key(x[i]) == T;
        unsigned ballot = __ballot_sync(0xffffffffu, tie);
        int lane = tid % 32, warp = tid / 32;
        if (lane == 0)
            s_warp[warp] = __popc(ballot);
        __syncthreads();
        int rank = __popc(ballot & ((1u << lane) - 1)), tile = 0;
        for (int w = 0; w < TOPK_THREADS / 32; w++) {
            rank += w < warp ? s_warp[w] : 0;
            tile += s_warp[w];
        }
        int taken = s_taken;
        if (tie && taken + rank < ties)
            cand[above + taken + rank] = i;
        __syncthreads();
        if (tid == 0)
            s_taken = taken + tile;
        __syncthreads();
    }

    /* sort: each candidate's place is the number of candidates before it */
    if (tid < k) {
        int32_t id = cand[tid];
        float v = x[id];
        int place = 0;
        for (int j = 0; j < k; j++) {
            int32_t oj = cand[j];
            float ov = x[oj];
            place += ov > v || (ov == v && oj < id);
        }
        ids[(int64_t)blockIdx.x * k + place] = id;
        vals[(int64_t)blockIdx.x * k + place] = v;
    }
}

exl_status exl_cuda_top_k(exl_backend *be, int32_t *ids, float *vals, const float *logits, int32_t rows, int32_t vocab,
                          int32_t k) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (k < 1 || k > EXL_TOP_K_MAX || k > vocab)
        return exl_cuda_fail(EXL_ERR_ARG, "top_k: k = %d is outside 1 .. %d", k,
                             vocab < EXL_TOP_K_MAX ? vocab : EXL_TOP_K_MAX);
    exl_cuda_graph_finish(cb);
    size_t n = (size_t)rows * k;
    if (!exl_cuda_ensure(cb, &cb->top_k_buf, &cb->top_k_bytes, n * (sizeof(int32_t) + sizeof(float)), "top-k results"))
        return exl_cuda_take_sticky(cb);
    int32_t *d_ids = (int32_t *)cb->top_k_buf;
    float *d_vals = (float *)(d_ids + n);
    exl_cuda_launch(cb, top_k_kernel, dim3((unsigned)rows), dim3(TOPK_THREADS), 0, d_ids, d_vals, logits, vocab, k);
    exl_cuda_check_launch(cb, "top-k");
    CUDA_CHECK(cudaMemcpyAsync(ids, d_ids, n * sizeof(int32_t), cudaMemcpyDeviceToHost, cb->stream), "top-k ids");
    CUDA_CHECK(cudaMemcpyAsync(vals, d_vals, n * sizeof(float), cudaMemcpyDeviceToHost, cb->stream), "top-k values");
    CUDA_CHECK(cudaStreamSynchronize(cb->stream), "top-k");
    return exl_cuda_take_sticky(cb);
}
