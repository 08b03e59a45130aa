/* cuda_lora.cu - the lora op (graph.h): gathered low-rank updates, Punica / S-LoRA style, in two launches whatever
 * the mix of adapters in the step:
 *   shrink  one block per (use, rank index): t[u, j] = scale_u * x[row_u] · A_slot(u)[j], a block-wide dot product
 *           over the input features (ranks past the adapter's own give 0);
 *   expand  one thread per (row, output column): out[r, c] += sum over r's uses u, j < rank of t[u, j] * Bt[j, c],
 *           reading Bt's rows along the columns (coalesced), every use of a row in one thread (no atomics: the
 *           result does not depend on the order blocks run in). */
#include "backend/cuda/cuda_internal.h"

#define SHRINK_THREADS 256
#define EXPAND_THREADS 256

__global__ void __launch_bounds__(SHRINK_THREADS)
    lora_shrink_kernel(float *t, const float *x, const exl_lora_factors *factors, const int32_t *use_row,
                       const int32_t *use_slot, const float *use_scale, int32_t in, int32_t max_rank) {
    exl_pdl_start();
    const int32_t u = blockIdx.x, j = blockIdx.y;
    const exl_lora_factors f = factors[use_slot[u]];
    if (j >= f.rank) {
        if (threadIdx.x == 0)
            t[(int64_t)u * max_rank + j] = 0.0f;
        return;
    }
    const float *xr = x + (int64_t)use_row[u] * in, *a = f.a + (int64_t)j * in;
    float s = 0.0f;
    for (int32_t i = threadIdx.x; i < in; i += SHRINK_THREADS)
        s += xr[i] * a[i];
    for (int off = 16; off > 0; off >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, off);
    __shared__ float warp_sums[SHRINK_THREADS / 32];
    if ((threadIdx.x & 31) == 0)
        warp_sums[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < SHRINK_THREADS / 32; w++)
            total += warp_sums[w];
        t[(int64_t)u * max_rank + j] = total * use_scale[u];
    }
}

__global__ void __launch_bounds__(EXPAND_THREADS)
    lora_expand_kernel(float *out, const float *t, const exl_lora_factors *factors, const int32_t *row_uses,
                       const int32_t *use_slot, int32_t out_features, int32_t max_rank) {
    exl_pdl_start();
    const int32_t r = blockIdx.y, c = blockIdx.x * EXPAND_THREADS + threadIdx.x;
    if (c >= out_features)
        return;
    float acc = 0.0f;
    for (int32_t u = row_uses[r]; u < row_uses[r + 1]; u++) {
        const exl_lora_factors f = factors[use_slot[u]];
        const float *tu = t + (int64_t)u * max_rank;
        for (int32_t j = 0; j < f.rank; j++)
            acc += tu[j] * f.bt[(int64_t)j * out_features + c];
    }
    out[(int64_t)r * out_features + c] += acc;
}

void exl_cuda_run_lora(exl_backend *be, const exl_lora_node *n) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n->n_uses < 1 || n->rows < 1)
        return;
    exl_cuda_launch(cb, lora_shrink_kernel, dim3((unsigned)n->n_uses, (unsigned)n->max_rank), dim3(SHRINK_THREADS), 0,
                    n->t, n->x, n->factors, n->use_row, n->use_slot, n->use_scale, n->in_features, n->max_rank);
    exl_cuda_check_launch(cb, "lora shrink");
    dim3 grid((unsigned)((n->out_features + EXPAND_THREADS - 1) / EXPAND_THREADS), (unsigned)n->rows);
    exl_cuda_launch(cb, lora_expand_kernel, grid, dim3(EXPAND_THREADS), 0, n->out, (const float *)n->t, n->factors,
                    n->row_uses, n->use_slot, n->out_features, n->max_rank);
    exl_cuda_check_launch(cb, "lora expand");
}
