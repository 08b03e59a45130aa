/* cuda_moe.cu - mixture of experts on the GPU, a first version: correct, not yet fast.
 *
 * moe_route: a thread a row picks its top_k experts and their softmax weights. moe_experts waits for the routes
 * (a download: a step with experts is never captured into a CUDA graph, cuda_plan.cu), sorts the (row, choice)
 * pairs by expert on the host, gathers each expert's rows together, runs each chosen expert's gate, up, GLU and
 * down as ordinary matmuls over its rows, and adds every row's weighted outputs to it. Decode thus reads only the
 * chosen experts' weights, but with a host round trip and four launches an expert; a fast version would route on
 * the device and run all chosen experts of a step in one grouped GEMV / GEMM launch (expert offsets from a device
 * prefix sum), which a CUDA graph can then hold. */
#include "backend/cuda/cuda_internal.h"

#include <stdlib.h>

#define ROUTE_THREADS 128
#define ROW_THREADS 256

/* ---- moe_route */

__global__ void moe_route_kernel(float *weights, int32_t *ids, const float *logits, int32_t rows, int32_t n_experts,
                                 int32_t top_k, int32_t renormalize) {
    exl_pdl_start();
    const int32_t r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows)
        return;
    const float *l = logits + (int64_t)r * n_experts;
    int32_t *id = ids + (int64_t)r * top_k;
    float *w = weights + (int64_t)r * top_k;
    /* larger first, lower id first among equals; a NaN comes after every number; every id is a valid one */
    for (int32_t j = 0; j < top_k; j++) {
        int32_t best = -1;
        for (int32_t e = 0; e < n_experts; e++) {
            bool taken = false;
            for (int32_t t = 0; t < j && !taken; t++)
                taken = id[t] == e;
            if (!taken && (best < 0 || l[e] > l[best] || (l[best] != l[best] && l[e] == l[e])))
                best = e;
        }
        id[j] = best;
    }
    const float mx = l[id[0]];
    float sum = 0.0f, chosen = 0.0f;
    for (int32_t e = 0; e < n_experts; e++)
        sum += expf(l[e] - mx);
    for (int32_t j = 0; j < top_k; j++) {
        w[j] = expf(l[id[j]] - mx) / sum;
        chosen += w[j];
    }
    for (int32_t j = 0; renormalize && j < top_k; j++)
        w[j] /= chosen;
}

void exl_cuda_run_moe_route(exl_backend *be, const exl_moe_route_node *n) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n->rows < 1)
        return;
    exl_cuda_launch(cb, moe_route_kernel, dim3((unsigned)((n->rows + ROUTE_THREADS - 1) / ROUTE_THREADS)),
                    dim3(ROUTE_THREADS), 0, n->weights, n->ids, n->logits, n->rows, n->n_experts, n->top_k,
                    n->renormalize);
    exl_cuda_check_launch(cb, "moe route");
}

/* ---- moe_experts */

/* out[r] += sum over r's choices j of weights[r, j] * ys[pair_slot[r, j]] */
__global__ void moe_combine_kernel(float *out, const float *ys, const float *weights, const int32_t *pair_slot,
                                   int32_t width, int32_t top_k) {
    exl_pdl_start();
    const int32_t r = blockIdx.y;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int32_t j = 0; j < top_k; j++) {
            const int32_t s = pair_slot[(int64_t)r * top_k + j];
            if (s >= 0)
                acc += weights[(int64_t)r * top_k + j] * ys[(int64_t)s * width + i];
        }
        out[(int64_t)r * width + i] += acc;
    }
}

/* the host's copy of the routes and the sorted pairs: ids, slot_row, pair_slot, slot_expert of pairs each */
static int32_t *host_tables(exl_cuda_backend *cb, int64_t pairs) {
    size_t need = 4 * (size_t)pairs;
    if (need > cb->moe_host_count) {
        int32_t *p = (int32_t *)realloc(cb->moe_host, need * sizeof *p);
        if (!p) {
            exl_cuda_set_sticky(cb, EXL_ERR_NOMEM, "out of host memory routing a mixture of experts");
            return NULL;
        }
        cb->moe_host = p;
        cb->moe_host_count = need;
    }
    return cb->moe_host;
}

void exl_cuda_run_moe_experts(exl_backend *be, const exl_moe_experts_node *n) {
    exl_cuda_backend *cb = exl_cuda(be);
    const int64_t pairs = (int64_t)n->rows * n->top_k;
    int32_t *h = pairs > 0 ? host_tables(cb, pairs) : NULL;
    if (!h)
        return;
    int32_t *ids = h, *slot_row = h + pairs, *pair_slot = h + 2 * pairs, *slot_expert = h + 3 * pairs;
    cudaError_t e = cudaMemcpyAsync(ids, n->ids, (size_t)pairs * sizeof(int32_t), cudaMemcpyDeviceToHost, cb->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cb->stream);
    if (e != cudaSuccess) {
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: reading the experts' routes: %s", cudaGetErrorString(e));
        return;
    }
    int64_t s = 0;
    for (int32_t x = 0; x < n->n_experts; x++)
        for (int64_t p = 0; p < pairs; p++)
            if (ids[p] == x) {
                slot_row[s] = (int32_t)(p / n->top_k), slot_expert[s] = x;
                pair_slot[p] = (int32_t)s++;
            }
    for (int64_t p = 0; p < pairs; p++) /* an id outside the experts (none from moe_route) adds nothing */
        if (ids[p] < 0 || ids[p] >= n->n_experts)
            pair_slot[p] = -1;
    /* slot_row then pair_slot, as the node's slots; pageable memory: the copy is staged before this returns */
    e = cudaMemcpyAsync(n->slots, slot_row, 2 * (size_t)pairs * sizeof(int32_t), cudaMemcpyHostToDevice, cb->stream);
    if (e != cudaSuccess) {
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: the experts' row tables: %s", cudaGetErrorString(e));
        return;
    }
    exl_cuda_run_gather_rows(be, n->xs, n->x, n->slots, (int32_t)s, n->width);
    for (int64_t first = 0, end; first < s; first = end) {
        const exl_expert *x = &n->experts[slot_expert[first]];
        for (end = first + 1; end < s && slot_expert[end] == slot_expert[first];)
            end++;
        const int32_t count = (int32_t)(end - first);
        float *xs = n->xs + first * n->width, *gate = n->gate + first * n->ffn, *up = n->up + first * n->ffn;
        exl_cuda_run_matmul(be, gate, xs, x->gate, count);
        exl_cuda_run_matmul(be, up, xs, x->up, count);
        exl_cuda_run_glu(be, gate, up, count, n->ffn, n->act);
        exl_cuda_run_matmul(be, xs, gate, x->down, count); /* the slots' outputs where their inputs were */
    }
    dim3 grid((unsigned)((n->width + ROW_THREADS - 1) / ROW_THREADS), (unsigned)n->rows);
    exl_cuda_launch(cb, moe_combine_kernel, grid, dim3(ROW_THREADS), 0, n->out, (const float *)n->xs, n->weights,
                    (const int32_t *)n->slots + pairs, n->width, n->top_k);
    exl_cuda_check_launch(cb, "moe combine");
}
