/* cuda_mask.cu - the mask_logits op: the queued step is launched first, the host fills the mask
 * while the device computes, then the bitset is copied up and one thread per logit clears the
 * logits whose bit is unset, so the top-k and argmax that follow read masked logits. */
#include "backend/cuda/cuda_internal.h"

#define MASK_THREADS 256

__global__ void __launch_bounds__(MASK_THREADS)
    mask_logits_kernel(float *logits, const uint32_t *mask, int32_t vocab, int32_t words) {
    exl_pdl_start();
    int32_t i = blockIdx.x * MASK_THREADS + threadIdx.x;
    if (i >= vocab)
        return;
    const uint32_t *m = mask + (int64_t)blockIdx.y * words;
    if (!((m[i >> 5] >> (i & 31)) & 1u))
        logits[(int64_t)blockIdx.y * vocab + i] = -INFINITY;
}

exl_status exl_cuda_mask_logits(exl_backend *be, float *logits, int32_t rows, int32_t vocab, uint32_t *mask,
                                exl_logit_mask_fn fill, void *user) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb); /* the step runs while the host fills the mask */
    EXL_TRY(fill(user, mask, rows));
    int32_t words = exl_mask_words(vocab);
    size_t bytes = (size_t)rows * (size_t)words * sizeof(uint32_t);
    if (!exl_cuda_ensure(cb, &cb->mask_buf, &cb->mask_bytes, bytes, "logit masks"))
        return exl_cuda_take_sticky(cb);
    /* from pageable memory: staged before the call returns, so the host may reuse mask */
    CUDA_CHECK(cudaMemcpyAsync(cb->mask_buf, mask, bytes, cudaMemcpyHostToDevice, cb->stream), "logit masks");
    dim3 grid((unsigned)((vocab + MASK_THREADS - 1) / MASK_THREADS), (unsigned)rows);
    exl_cuda_launch(cb, mask_logits_kernel, grid, dim3(MASK_THREADS), 0, logits, (const uint32_t *)cb->mask_buf, vocab,
                    words);
    exl_cuda_check_launch(cb, "logit masks");
    return exl_cuda_take_sticky(cb);
}
