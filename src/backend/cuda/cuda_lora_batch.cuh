/* cuda_lora_batch.cuh - the lora op's batch path (cuda_lora_batch.cu) and the scratch it shares with the SGMV path
 * (cuda_lora.cu) */
#ifndef EXL_CUDA_LORA_BATCH_CUH
#define EXL_CUDA_LORA_BATCH_CUH

#include "backend/cuda/cuda_internal.h"

/* The by-adapter paths' scratch for node n: 64 counters (self-resetting; the SGMV path uses 0 and 1, the batch path
 * 2), then t [n_uses * n_out * max_rank] and ss [n_uses] floats, all zero between launches (whoever adds to them
 * clears them in its last block). 0: no memory (the backend's sticky error says so). */
int exl_cuda_lora_scratch(exl_cuda_backend *cb, const exl_lora_node *n, float **t, float **ss, unsigned **sync);

/* EXL_CUDA_LORA_BATCH=2 or 3: steps of more uses than the fused path takes go through the batch path (read at each
 * call, as the other paths' switches; default 2); returns 2 or 3 (3: a row's only use adds its
 * update with a load and a store, not atomically), else 0. */
int exl_cuda_lora_batch_on(void);

/* 1 if the op may take node n through the batch path: its by_adapter given, ranks up to 256, at most 256 uses (the
 * op's own choice: exl_cuda_lora_batch_takes, cuda_lora.cu) */
int exl_cuda_lora_batch_fits(const exl_lora_node *n);
int exl_cuda_lora_batch_takes(const exl_cuda_backend *cb, const exl_lora_node *n);

/* The batch path for node n (exl_cuda_lora_batch_fits; plain: as EXL_CUDA_LORA_BATCH=3): the shrink, then the expand
 * on the backend's stream (failures: the sticky error). */
void exl_cuda_lora_batch(exl_cuda_backend *cb, const exl_lora_node *n, int plain);
/* Its two launches apart, into the scratch exl_cuda_lora_scratch gave (t, ss, sync): the shrink on stream, with
 * programmatic dependent launch where pdl is set (exl_cuda_launch_on), the expand on the backend's stream with it. */
void exl_cuda_lora_batch_shrink(exl_cuda_backend *cb, const exl_lora_node *n, float *t, float *ss, cudaStream_t stream,
                                int pdl);
void exl_cuda_lora_batch_expand(exl_cuda_backend *cb, const exl_lora_node *n, float *t, float *ss, unsigned *sync,
                                int plain);

#endif
