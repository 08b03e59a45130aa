/* layer_run.h - one decoder layer on the host, in fp32, on a batch of hidden states.
 *
 * The quantizer (quant/) runs the model layer by layer over its calibration rows and
 * needs the inputs of every linear, and the outputs of a block computed with trial
 * weights. The forward pass (forward.c) runs whole steps over a paged KV cache on a
 * backend with the model's own weights; this file is the small host-side counterpart:
 * plain fp32 arrays, weights as W[k, n] (in x out), n_seqs independent causal sequences
 * of seq_len tokens each (positions 0..seq_len-1), so T = n_seqs * seq_len rows.
 * Work is split over an exl_pool. The composition (norm, q/k/v, attention, o, residual,
 * norm, gate/up, act, down, residual) is left to the caller so it can capture any input.
 * With `accel` set (a backend with host_gemm), matmuls of at least EXL_HOST_GEMM_MIN_WORK
 * multiply-adds run there; the rest, and everything when it is NULL, on the CPU. */
#ifndef EXL_MODEL_LAYER_RUN_H
#define EXL_MODEL_LAYER_RUN_H

#include "backend/backend.h"
#include "base/threads.h"
#include "io/hf_config.h"
#include "io/weights.h"

#include <stdint.h>

typedef struct exl_lrun {
    const exl_hf_config *cfg;
    exl_pool *pool;
    int32_t n_seqs, seq_len;
    int32_t rot_dim;
    float *cos, *sin; /* [seq_len, rot_dim / 2], attention factor applied */
    float *scores;    /* per-thread attention scratch, seq_len * (head_dim + 4) floats each */
    exl_backend *accel; /* host_gemm for the big matmuls, or NULL (the CPU); set after init, not owned */
} exl_lrun;

/* What these pieces cannot run of a config ("qwen3 models", "longrope rotary embeddings", ...), written to gap;
 * empty when they run it: Llama-style layers (Llama, Mistral, Qwen2, Gemma) with one window for all layers and a
 * rope whose frequencies depend on the sequence length at most as dynamic scaling does. */
void exl_lrun_gap(const exl_hf_config *c, char *gap, size_t size);
exl_status exl_lrun_init(exl_lrun *r, const exl_hf_config *cfg, exl_pool *pool, int32_t n_seqs, int32_t seq_len);
void exl_lrun_free(exl_lrun *r);
static inline int64_t exl_lrun_rows(const exl_lrun *r) { return (int64_t)r->n_seqs * r->seq_len; }

/* out[t] = x[t] * w / rms(x[t]); w already includes Gemma's +1 (see exl_lrun_load_norm). */
void exl_lrun_rmsnorm(const exl_lrun *r, float *out, const float *x, const float *w, int64_t rows);
/* out[rows, N] = x[rows, K] · W[K, N] (+ bias[N] when not NULL). Fails only on the accelerator. */
exl_status exl_lrun_matmul(const exl_lrun *r, float *out, const float *x, const float *W, const float *bias,
                           int64_t rows, int64_t K, int64_t N);
/* RoPE on q [T, heads*hd] and k [T, kv_heads*hd] in place, then causal (GQA, sliding window)
 * attention of each sequence: out [T, heads*hd]. */
void exl_lrun_attention(const exl_lrun *r, float *out, float *q, float *k, const float *v);
/* gate = act(gate) * up over n values. */
void exl_lrun_glu(const exl_lrun *r, float *gate, const float *up, int64_t n);
/* out[t] = embed[ids[t]] * scale (Gemma: sqrt(hidden)) for T ids. */
exl_status exl_lrun_embed(const exl_lrun *r, const exl_weights *w, const int32_t *ids, float *out);

/* ---- weights read from the files as fp32 */

/* A [N, K] (Hugging Face) float tensor as W[K, N]; *W is allocated. */
exl_status exl_lrun_load_linear(const exl_weights *w, const char *name, int64_t K, int64_t N, float **W);
/* A float vector of n values (a bias or a norm); plus `add` to each. *v is allocated. */
exl_status exl_lrun_load_vector(const exl_weights *w, const char *name, int64_t n, float add, float **v);
/* The norm weight with Gemma's (1 + w). */
exl_status exl_lrun_load_norm(const exl_lrun *r, const exl_weights *w, const char *name, float **v);
/* Element i of a float tensor as fp32. */
float exl_lrun_elem(const exl_st_tensor *t, int64_t i);

#endif
