/* cuda_argmax.cu - greedy tokens chosen on the GPU, for decode that runs ahead of the host.
 *
 * The argmax op is a step op like the others (recorded, captured into the decode graph): one
 * block per row finds the lowest index of the row's largest logit and writes it to the caller's
 * device ids (the next step's token table, so that step can be queued before the host has seen
 * the token) and to a ring of results in page-locked, mapped host memory. The ring slot comes
 * from a launch counter kept on the device, so a replayed graph writes the next slot each time;
 * the host numbers its calls the same way (tickets) and waits for one through an event recorded
 * right after the launch that holds it, never for work queued later. */
#include "backend/cuda/cuda_internal.h"

#include <math.h>

#define ARGMAX_THREADS 1024

/* (v, i) beats (bv, bi): a value above -inf, larger, or equal with a lower index */
__device__ __forceinline__ bool beats(float v, int32_t i, float bv, int32_t bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

__global__ void __launch_bounds__(ARGMAX_THREADS)
    argmax_kernel(int32_t *ids, int32_t *ring, unsigned *state, const float *logits, int32_t vocab) {
    exl_pdl_start();
    __shared__ float s_v[ARGMAX_THREADS / 32];
    __shared__ int32_t s_i[ARGMAX_THREADS / 32];
    const float *x = logits + (int64_t)blockIdx.x * vocab;
    float bv = -INFINITY;
    int32_t bi = -1;
    for (int32_t i = threadIdx.x; i < vocab; i += ARGMAX_THREADS) { /* rising i: ties keep the first */
        float v = x[i];
        if (v > bv)
            bv = v, bi = i;
    }
    for (int off = 16; off; off >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        int32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (beats(ov, oi, bv, bi))
            bv = ov, bi = oi;
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0)
        s_v[warp] = bv, s_i[warp] = bi;
    __syncthreads();
    if (threadIdx.x != 0)
        return;
    for (int w = 1; w < ARGMAX_THREADS / 32; w++)
        if (beats(s_v[w], s_i[w], bv, bi))
            bv = s_v[w], bi = s_i[w];
    unsigned launch = state[0];
    ids[blockIdx.x] = bi < 0 ? 0 : bi;
    ring[(launch % EXL_ARGMAX_KEEP) * EXL_ARGMAX_ROWS + blockIdx.x] = bi;
    __threadfence(); /* every block read the counter before the last one moves it on */
    if (atomicAdd(&state[1], 1u) == gridDim.x - 1) {
        state[1] = 0;
        state[0] = launch + 1;
    }
}

int exl_cuda_argmax_ready(exl_cuda_backend *cb) {
    if (cb->argmax_ring)
        return 1;
    exl_cuda_graph_flush(cb); /* no allocation inside a capture */
    cudaError_t e = cudaHostAlloc((void **)&cb->argmax_ring, sizeof(int32_t) * EXL_ARGMAX_KEEP * EXL_ARGMAX_ROWS,
                                  cudaHostAllocMapped);
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&cb->argmax_state, 2 * sizeof(unsigned));
    if (e == cudaSuccess)
        e = cudaMemsetAsync(cb->argmax_state, 0, 2 * sizeof(unsigned), cb->stream);
    for (int i = 0; i < EXL_ARGMAX_KEEP && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&cb->argmax_done[i], cudaEventDisableTiming);
    if (e != cudaSuccess) {
        cudaGetLastError();
        exl_cuda_argmax_free(cb);
        exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: setting up greedy tokens on the GPU: %s", cudaGetErrorString(e));
        return 0;
    }
    return 1;
}

void exl_cuda_argmax_free(exl_cuda_backend *cb) {
    for (int i = 0; i < EXL_ARGMAX_KEEP; i++)
        if (cb->argmax_done[i])
            cudaEventDestroy(cb->argmax_done[i]), cb->argmax_done[i] = NULL;
    cudaFreeHost(cb->argmax_ring);
    cudaFree(cb->argmax_state);
    cb->argmax_ring = NULL;
    cb->argmax_state = NULL;
}

void exl_cuda_run_argmax(exl_backend *be, int32_t *ids, const float *logits, int32_t rows, int32_t vocab) {
    exl_cuda_backend *cb = exl_cuda(be);
    int32_t *ring = NULL;
    if (cudaHostGetDevicePointer((void **)&ring, cb->argmax_ring, 0) != cudaSuccess) {
        cudaGetLastError();
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: argmax results are not mapped for the GPU");
        return;
    }
    exl_cuda_launch(cb, argmax_kernel, dim3((unsigned)rows), dim3(ARGMAX_THREADS), 0, ids, ring, cb->argmax_state,
                    logits, vocab);
    exl_cuda_check_launch(cb, "argmax");
}

void exl_cuda_argmax_mark(exl_cuda_backend *cb) {
    for (; cb->argmax_marked < cb->argmax_issued; cb->argmax_marked++) {
        cudaError_t e = cudaEventRecord(cb->argmax_done[cb->argmax_marked % EXL_ARGMAX_KEEP], cb->stream);
        if (e != cudaSuccess)
            exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: argmax event: %s", cudaGetErrorString(e));
    }
}

exl_status exl_cuda_argmax_wait(exl_backend *be, int64_t ticket, int32_t *ids, int32_t rows) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb);
    if (ticket < 0 || ticket >= cb->argmax_issued || cb->argmax_issued - ticket > EXL_ARGMAX_KEEP)
        return exl_cuda_fail(EXL_ERR_ARG, "argmax_wait: ticket %lld is not among the last %d of %lld",
                             (long long)ticket, EXL_ARGMAX_KEEP, (long long)cb->argmax_issued);
    int slot = (int)(ticket % EXL_ARGMAX_KEEP);
    if (rows != cb->argmax_rows[slot])
        return exl_cuda_fail(EXL_ERR_ARG, "argmax_wait: ticket %lld has %d rows, not %d", (long long)ticket,
                             cb->argmax_rows[slot], rows);
    CUDA_CHECK(cudaEventSynchronize(cb->argmax_done[slot]), "waiting for greedy tokens");
    EXL_TRY(exl_cuda_take_sticky(cb));
    const volatile int32_t *r = cb->argmax_ring + slot * EXL_ARGMAX_ROWS;
    for (int32_t i = 0; i < rows; i++)
        ids[i] = r[i];
    return EXL_OK;
}
