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
 * call, as the other paths' switches; default: off until measured); returns 2 or 3 (3: a row's only use adds its
 * update with a load and a store, not atomically), else 0. */
int exl_cuda_lora_batch_on(void);

/* The batch path for node n (its by_adapter given, ranks up to 256, at most 256 uses; plain: as
 * EXL_CUDA_LORA_BATCH=3): 1 if it ran (or failed with the sticky error set), 0 if n is not for it. */
int exl_cuda_lora_batch(exl_cuda_backend *cb, const exl_lora_node *n, int plain);

#endif
