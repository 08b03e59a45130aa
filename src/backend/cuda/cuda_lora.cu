/* cuda_lora.cu - the lora op (graph.h): gathered low-rank updates, Punica / S-LoRA style, for 1-3 projections of one
 * input in two launches whatever the mix of adapters in the step:
 *   shrink  one block per (use, projection and rank index): t[u, o, j] = scale_u * x'[row_u] · A_o,slot(u)[j], a
 *           block-wide dot product over the input features (ranks past the adapter's own give 0), x' the input
 *           normed or through the GLU on the way where the node says so (the matmuls beside then keep their
 *           fusions with the norm and the GLU);
 *   expand  one thread per (row, output column of the projections side by side): out_o[r, c] += sum over r's uses u,
 *           j < rank of t[u, o, j] * Bt_o[j, c], reading Bt's rows along the columns (coalesced), every use of a row
 *           in one thread (no atomics: the result does not depend on the order blocks run in). */
#include "backend/cuda/cuda_internal.h"

#define SHRINK_THREADS 256
#define EXPAND_THREADS 256

/* the block's sum of v (every thread gets it) */
__device__ __forceinline__ float block_sum(float v, float *warp_sums) {
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads(); /* warp_sums may still be read from a sum before */
    if ((threadIdx.x & 31) == 0)
        warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < SHRINK_THREADS / 32; w++)
        total += warp_sums[w];
    return total;
}

/* norm_w: the norm's weights on the device when the node has a norm */
__global__ void __launch_bounds__(SHRINK_THREADS) lora_shrink_kernel(exl_lora_node n, const float *norm_w) {
    exl_pdl_start();
    __shared__ float warp_sums[SHRINK_THREADS / 32];
    const int32_t u = blockIdx.x, o = blockIdx.y / n.max_rank, j = blockIdx.y % n.max_rank;
    float *t = n.t + ((int64_t)u * n.n_out + o) * n.max_rank + j;
    const exl_lora_factors f = n.factors[o][n.use_slot[u]];
    if (j >= f.rank) {
        if (threadIdx.x == 0)
            *t = 0.0f;
        return;
    }
    const int64_t row = (int64_t)n.use_row[u] * n.in_features;
    const float *xr = n.x + row, *a = f.a + (int64_t)j * n.in_features;
    float s = 0.0f, ss = 0.0f;
    for (int32_t i = threadIdx.x; i < n.in_features; i += SHRINK_THREADS) {
        float v = xr[i];
        if (norm_w) {
            ss += v * v;
            v *= norm_w[i];
        } else if (n.up) {
            v = exl_cuda_activate(v, n.act) * n.up[row + i];
        }
        s += v * a[i];
    }
    float total = block_sum(s, warp_sums);
    if (norm_w)
        total *= rsqrtf(block_sum(ss, warp_sums) / n.in_features + n.eps);
    if (threadIdx.x == 0)
        *t = total * n.use_scale[u];
}

__global__ void __launch_bounds__(EXPAND_THREADS) lora_expand_kernel(exl_lora_node n) {
    exl_pdl_start();
    const int32_t r = blockIdx.y;
    int32_t c = blockIdx.x * EXPAND_THREADS + threadIdx.x, o = 0;
    while (o < n.n_out && c >= n.out_features[o])
        c -= n.out_features[o++];
    if (o >= n.n_out)
        return;
    const int32_t width = n.out_features[o];
    float acc = 0.0f;
    for (int32_t u = n.row_uses[r]; u < n.row_uses[r + 1]; u++) {
        const exl_lora_factors f = n.factors[o][n.use_slot[u]];
        const float *tu = n.t + ((int64_t)u * n.n_out + o) * n.max_rank;
        for (int32_t j = 0; j < f.rank; j++)
            acc += tu[j] * f.bt[(int64_t)j * width + c];
    }
    n.out[o][(int64_t)r * width + c] += acc;
}

void exl_cuda_run_lora(exl_backend *be, const exl_lora_node *n) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n->n_uses < 1 || n->rows < 1 || n->n_out < 1 || n->max_rank < 1)
        return;
    int32_t total = 0;
    for (int32_t o = 0; o < n->n_out; o++)
        total += n->out_features[o];
    exl_cuda_launch(cb, lora_shrink_kernel, dim3((unsigned)n->n_uses, (unsigned)(n->n_out * n->max_rank)),
                    dim3(SHRINK_THREADS), 0, *n, (const float *)(n->norm ? n->norm->v : NULL));
    exl_cuda_check_launch(cb, "lora shrink");
    dim3 grid((unsigned)((total + EXPAND_THREADS - 1) / EXPAND_THREADS), (unsigned)n->rows);
    exl_cuda_launch(cb, lora_expand_kernel, grid, dim3(EXPAND_THREADS), 0, *n);
    exl_cuda_check_launch(cb, "lora expand");
}
