/* cuda_lora_batch.cuh - the lora op's batch path (cuda_lora_batch.cu) and its scratch, which cuda_lora_overlap.cu
 * shares */
#ifndef EXL_CUDA_LORA_BATCH_CUH
#define EXL_CUDA_LORA_BATCH_CUH

#include "backend/cuda/cuda_internal.h"

/* The batch path's scratch for node n: a counter (self-resetting) in 256 bytes, then t [n_uses * n_out * max_rank]
 * and ss [n_uses] floats, all zero between launches (the expand clears them in its last block). 0: no memory (the
 * backend's sticky error says so). */
int exl_cuda_lora_scratch(exl_cuda_backend *cb, const exl_lora_node *n, float **t, float **ss, unsigned **sync);

/* 1 unless EXL_CUDA_LORA_BATCH=0 (then steps of more uses than the fused path takes go through the split path; read
 * at each call, as the other paths' switches) */
int exl_cuda_lora_batch_on(void);

/* 1 if the op may take node n through the batch path: its by_adapter given, ranks up to 256, at most 256 uses (the
 * op's own choice: exl_cuda_lora_batch_takes, cuda_lora.cu) */
int exl_cuda_lora_batch_fits(const exl_lora_node *n);
int exl_cuda_lora_batch_takes(const exl_cuda_backend *cb, const exl_lora_node *n);

/* The batch path for node n (exl_cuda_lora_batch_fits): the shrink, then the expand on the backend's stream
 * (failures: the sticky error). */
void exl_cuda_lora_batch(exl_cuda_backend *cb, const exl_lora_node *n);
/* Its two launches apart, into the scratch exl_cuda_lora_scratch gave (t, ss, sync): the shrink on stream, with
 * programmatic dependent launch where pdl is set (exl_cuda_launch_on); the expand on the backend's stream with it,
 * t and ss zero after it. */
void exl_cuda_lora_batch_shrink(exl_cuda_backend *cb, const exl_lora_node *n, float *t, float *ss, cudaStream_t stream,
                                int pdl);
void exl_cuda_lora_batch_expand(exl_cuda_backend *cb, const exl_lora_node *n, float *t, float *ss, unsigned *sync);

#endif
