/* backend.h - the op table every compute backend (CPU, CUDA) implements.
 *
 * The forward pass is written once, as a graph of these primitive ops per step (graph.h), which
 * a backend runs through graph_run or the generic executor. Activations are fp32 arrays in
 * backend memory ("device pointers"; plain host pointers on the CPU). Weights are
 * described by exl_linear_src (format/linear_src.h: pointers into the mapped files) and
 * turned into a backend-owned exl_linear, which may repack them once. */
#ifndef EXL_BACKEND_H
#define EXL_BACKEND_H

#include "backend/graph.h"
#include "exl.h"
#include "format/linear_src.h"

#include <stdint.h>

/* exl_linear (backend-owned weights), exl_vector, the step's batch and graph: graph.h */

/* ---- the op table */

/* The interface version of the op table and exl_backend, which libexl_cuda.so reports
 * (exl_backend_cuda_abi) and the core checks before using it: bump on any change to them. */
#define EXL_BACKEND_ABI 22

typedef struct exl_backend exl_backend;

/* Writes a HOST bitset of rows x exl_mask_words(vocab) words: bit (id % 32) of word id / 32 of a row
 * set keeps that logit (mask_logits). */
typedef exl_status (*exl_logit_mask_fn)(void *user, uint32_t *mask, int32_t rows);

static inline int32_t exl_mask_words(int32_t vocab) { return (vocab + 31) / 32; }

/* One row's settings for the sample op: generator/sampler.h's, for the settings that need no state across tokens.
 * The row's logit edits are edits[first_edit ..]: n_bias biases (added in order: id, v = bias), then n_penalized
 * distinct ids of the penalty window (v = its count there), then n_banned ids that become -inf. */
typedef struct exl_sample_params {
    float temperature; /* <= 0: the argmax */
    int32_t top_k;     /* 0: off */
    float top_p, min_p, typical_p;
    float repetition_penalty, frequency_penalty, presence_penalty;
    int32_t first_edit, n_bias, n_penalized, n_banned;
    int32_t want_logprob; /* the chosen token's log-probability under the unedited logits */
    double u;             /* a uniform number in [0, 1) from the row's random stream */
    double u_next;        /* sample_queue, chained: the stream's number after u */
} exl_sample_params;

typedef struct exl_logit_edit {
    int32_t id;
    float v;
} exl_logit_edit;

typedef struct exl_sample_result {
    int32_t id;       /* -1: every logit is -inf */
    int32_t n_kept;   /* candidates left after the filters: u was used only when more than one */
    float logprob;    /* when asked */
    int32_t reserved; /* keeps the struct 16 bytes on every side of the ABI */
} exl_sample_result;

/* The sample op's weights are fixed point, W = (uint64_t)(exp((l - max) / T) * 2^shift + 0.5), so that sums are
 * exact and equal on every backend: shift leaves room for a whole vocabulary of weights up to 1 in 63 bits, and at
 * most 52 keeps w * 2^shift + 0.5 exact in a double. */
static inline int exl_sample_shift(int32_t vocab) {
    int bits = 0;
    while ((1ll << bits) < vocab)
        bits++;
    return 63 - bits < 52 ? 63 - bits : 52;
}

typedef struct exl_backend_ops {
    void (*destroy)(exl_backend *be);

    /* memory: NULL / non-OK with a message on failure */
    void *(*alloc)(exl_backend *be, size_t bytes);
    void (*free)(exl_backend *be, void *p);
    exl_status (*upload)(exl_backend *be, void *dst, const void *src, size_t bytes);
    exl_status (*download)(exl_backend *be, void *dst, const void *src, size_t bytes);
    exl_status (*synchronize)(exl_backend *be);

    /* weights */
    exl_status (*linear_init)(exl_backend *be, const exl_linear_src *src, exl_linear **out);
    void (*linear_free)(exl_backend *be, exl_linear *w);
    /* fp32 vector of n values from a dense source, plus `add` to each (Gemma's 1 + w) */
    exl_status (*vector_init)(exl_backend *be, const exl_dense_src *src, int64_t n, float add, exl_vector **out);
    void (*vector_free)(exl_backend *be, exl_vector *v);

    /* ops: all pointers are backend memory; x, out are [rows, width] fp32 */
    /* out[r] = table[ids[r]] * scale, where table is a dense linear of [vocab, width] */
    void (*embed)(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows, float scale);
    /* out may be x */
    void (*rmsnorm)(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                    float eps);
    /* out = x · W + b; x is [rows, in], out is [rows, out] */
    void (*matmul)(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows);
    /* rotary embedding in place on [rows, n_heads, head_dim], NeoX (rotate-half) layout;
     * inv_freq holds rot_dim / 2 frequencies, cos and sin are multiplied by attn_factor */
    void (*rope)(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                 int32_t rot_dim, const float *inv_freq, float attn_factor);
    /* write rows of k and v ([rows, n_kv_heads * head_dim]) to their cache slots, in b's kv format */
    void (*kv_store)(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v, const exl_batch *b,
                     int32_t kv_width);
    /* causal attention of each sequence's new queries over its paged cache; k and v are the new
     * rows' keys (after rope) and values ([rows, n_kv_heads * head_dim], fp32, already stored),
     * which a backend whose cache is coarser than fp32 may read instead of their cached copies */
    void (*attention)(exl_backend *be, float *out, const float *q, const float *k, const float *v, const void *k_cache,
                      const void *v_cache, const exl_batch *b, const exl_attn_shape *shape);
    /* gate = act(gate) * up over [rows, width] */
    void (*glu)(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act);
    /* x += y over n values */
    void (*add)(exl_backend *be, float *x, const float *y, int64_t n);
    /* out[i] = x[idx[i]] for rows of width */
    void (*gather_rows)(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n, int32_t width);
    /* out[r] = x[r, col .. col + width - 1] for rows of x_width */
    void (*copy_cols)(exl_backend *be, float *out, const float *x, int32_t rows, int32_t width, int32_t x_width,
                      int32_t col);
    /* x = cap * tanh(x / cap) over n values */
    void (*softcap)(exl_backend *be, float *x, int64_t n, float cap);
    /* x[r] *= sigmoid(g[r]) over rows of width */
    void (*row_gate)(exl_backend *be, float *x, const float *g, int32_t rows, int32_t width);
    /* the experts of each row and their weights (graph.h: moe_route) */
    void (*moe_route)(exl_backend *be, const exl_moe_route_node *n);
    /* the chosen experts' outputs, weighted, added to out (graph.h: moe_experts); a backend whose matmuls need
     * the row counts on the host may wait for the routes here */
    void (*moe_experts)(exl_backend *be, const exl_moe_experts_node *n);

    /* Optional: run a step's graph (graph.h), compiled as the backend sees fit; NULL: the generic executor
     * (exl_graph_exec) runs it through the ops above. Failures of the ops themselves surface as the ops'
     * do (the next synchronize or download); an error returned here is one of the graph itself. */
    exl_status (*graph_run)(exl_backend *be, const exl_graph *g);

    /* For host-side work such as the quantizer (every backend has it: the CPU computes it with its
     * kernels and threads). On HOST pointers, fp32, row-major as cblas_sgemm: C = alpha·op(A)·op(B)
     * + beta·C with op(A) [M, K] (A is [M, lda], or with trans_a [K, lda]), op(B) [K, N] (B is
     * [K, ldb], or with trans_b [N, ldb]), C [M, ldc]. A device backend stages the data through its
     * own memory; every backend computes in strict fp32 (no reduced precision: results agree up to
     * fp32 rounding) and returns when C is written. With beta 0, C is not read. */
    exl_status (*host_gemm)(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                            const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                            int64_t ldc);
    /* Optional: the k (1 <= k <= EXL_TOP_K_MAX, k <= vocab) largest of each row of logits
     * [rows, vocab] (backend memory), sorted larger first and lower id first among equals, into
     * HOST arrays ids and vals [rows, k]; returns when they are written. For samplers that need
     * only the head of the distribution: the logits stay where they are. NULL on the CPU. */
    exl_status (*top_k)(exl_backend *be, int32_t *ids, float *vals, const float *logits, int32_t rows, int32_t vocab,
                        int32_t k);
    /* Optional (NULL on the CPU, where the model picks greedy tokens on the host): decode that
     * runs ahead of the host. argmax is a step op: for each of rows (1 .. EXL_ARGMAX_ROWS) rows of
     * logits [rows, vocab], the lowest index of the row's largest value above -inf (-1 where
     * there is none) goes to ids[r] (backend memory; 0 in place of -1), so that the next step may
     * read it as its token before the host has seen it, and is kept for argmax_wait. Returns the
     * call's ticket (>= 0), or -1 with a message. argmax_wait launches what is pending, waits
     * until the argmax of that ticket is done (not for work queued after it) and copies its rows
     * results (-1 kept) to HOST ids; only the last EXL_ARGMAX_KEEP tickets can be waited on. */
    int64_t (*argmax)(exl_backend *be, int32_t *ids, const float *logits, int32_t rows, int32_t vocab);
    exl_status (*argmax_wait)(exl_backend *be, int64_t ticket, int32_t *ids, int32_t rows);
    /* Optional (NULL on the CPU, whose memory is the host's): the device memory free now and in all, as far as
     * this process may use it (a limit set for testing counts as the device's size). */
    exl_status (*memory)(exl_backend *be, size_t *free_bytes, size_t *total_bytes);
    /* Constrained decoding: logits [rows, vocab] (backend memory) whose bit in the row's mask is clear
     * become -inf. The backend first starts the work queued before (so the device computes while the
     * host works), then calls fill(user, mask, rows) for the HOST bitset `mask` (room for rows x
     * exl_mask_words(vocab) words), then copies it to the device and applies it there; it returns once
     * `mask` may be reused. Samplers that read only the head (top_k) then see the masked logits. */
    exl_status (*mask_logits)(exl_backend *be, float *logits, int32_t rows, int32_t vocab, uint32_t *mask,
                              exl_logit_mask_fn fill, void *user);

    /* Tensor parallelism (docs/parallel.md). comm_init, called on ranks[0] from one thread: the n backends (of
     * this kind, one per device, rank k = ranks[k]) join one communicator that their all_reduce and gather_cols
     * then use; the communicator goes with the last of them destroyed. abort: a rank failed between
     * collectives: the others' waits end (the results are garbage) until the next comm_init or a call with
     * resume set. The collectives are step ops (graph.h: all_reduce, gather_cols) that every rank runs in the
     * same order, each from its own thread. */
    exl_status (*comm_init)(exl_backend *const *ranks, int32_t n);
    void (*comm_abort)(exl_backend *be, int resume);
    void (*all_reduce)(exl_backend *be, float *x, int64_t n);
    void (*gather_cols)(exl_backend *be, const exl_gather_cols_node *n);

    /* Sampling where the logits are: for each of rows rows of logits [rows, vocab] (backend memory, edited in
     * place), params[r] (HOST) and its edits (HOST, n_edits in all), one token into out[r] (HOST); returns when out
     * is written. The result is defined exactly (the CPU's, backend/cpu/cpu_sample.c, is the reference), so every
     * backend picks the same token up to the rounding of exp. */
    exl_status (*sample)(exl_backend *be, exl_sample_result *out, float *logits, int32_t rows, int32_t vocab,
                         const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits);

    /* gathered low-rank adapter updates added to a linear's output (graph.h: lora) */
    void (*lora)(exl_backend *be, const exl_lora_node *n);

    /* The quantizer's trial weights. A dense linear's weights replaced by src (HOST, the dtype and shape the linear
     * was made with), in order with the work queued before: the CPU reads src from then on (keep it), a device
     * copies it (src may be reused when the call returns). */
    exl_status (*linear_set_dense)(exl_backend *be, exl_linear *w, const exl_dense_src *src);
    /* *acc (HOST) += the sum over i < n of (a[i] - b[i])², in double; returns when *acc is written. */
    exl_status (*sq_dist)(exl_backend *be, const float *a, const float *b, int64_t n, double *acc);
    /* host_gemm's product on backend memory (the quantizer's GPTQ updates where the rows stay on the device), in
     * order with the other work, strict fp32 */
    exl_status (*gemm)(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
    /* Optional (NULL on the CPU): sampled decode that runs ahead of the host, as argmax is to greedy decode. The
     * sample op's result for rows (1 .. EXL_ARGMAX_ROWS) rows, queued without waiting: each row's token goes to
     * ids[r] (backend memory, 0 in place of -1) for the next step to read, and its result is kept for sample_wait.
     * chained: row r's uniform is params[r].u where row r of the last sample_queue kept at most one candidate, else
     * params[r].u_next (the host, which has not seen that result, gives both). params and edits may be reused when
     * the call returns. Returns the call's ticket (>= 0), or -1 with a message. sample_wait waits for that ticket's
     * results (not for work queued after it) and copies them to HOST out; only the last EXL_ARGMAX_KEEP tickets can
     * be waited on. */
    int64_t (*sample_queue)(exl_backend *be, int32_t *ids, float *logits, int32_t rows, int32_t vocab,
                            const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits, int chained);
    exl_status (*sample_wait)(exl_backend *be, int64_t ticket, exl_sample_result *out, int32_t rows);

    /* Optional (NULL on the CPU, whose threads run the host's version in convert/gptq.c): GPTQ with EXL2 scales on
     * backend memory, in order with the other work; both give the host's results up to the order of a double sum.
     * qz_exl2_scales: the scales of one group of rows x N weights W (row r at W + r·N) with bits-bit codes, chosen
     * as format/exl2.h's EXL_EXL2_SCALE_* describe: each column's 4-bit code to scale_codes[N], the group's fp16
     * maximum to *scale_max, each column's scale and zero point (2^(bits-1)) to scale[N] and zero[N].
     * qz_rows: the rows of a GPTQ block, W [rows <= 128, N] (row i at W + i·N) rounded in order, row i with
     * column n's scale and zero to codes[i·N + n] and the dequantized value back into W, its error (w - q) / U[i, i]
     * to E[i·N + n] and spread into the block's later rows j as w_j -= U[i, j]·e (U[i, j] at U + i·ldu + j). */
    exl_status (*qz_exl2_scales)(exl_backend *be, const float *W, int64_t N, int32_t rows, int32_t bits,
                                 uint8_t *scale_codes, uint16_t *scale_max, float *scale, float *zero);
    exl_status (*qz_rows)(exl_backend *be, float *W, const float *U, int64_t ldu, int64_t N, int32_t rows,
                          const float *scale, const float *zero, int32_t bits, uint8_t *codes, float *E);

    /* Optional (NULL on the CPU): the rest of the quantizer's GPTQ on the device (convert/gptq.c).
     * qz_factor: with A [K, K] = H[perm[K-1-i], perm[K-1-j]] + damp·I (H HOST fp32 [K, K] symmetric, perm HOST [K])
     * and L its lower Cholesky factor (A = L·Lᵀ, in double), U [K, K] (backend memory, fp32) receives
     * U[K-1-i, K-1-j] = (L⁻¹)[i, j] for j <= i, 0 elsewhere: the upper factor of the permuted, damped H⁻¹ (UᵀU).
     * *ok = 0 (U unwritten) where A is not positive definite (a pivot not > 0); returns when *ok is known.
     * qz_set_trial: a dense linear's weights (made by linear_init: in K, out N) from backend memory W [K, N] whose
     * row r is input feature perm[r] (perm: backend memory, [K]), in order with the work queued before. */
    exl_status (*qz_factor)(exl_backend *be, float *U, const float *H, const int32_t *perm, int64_t K, double damp,
                            int *ok);
    exl_status (*qz_set_trial)(exl_backend *be, exl_linear *w, const float *W, const int32_t *perm);
} exl_backend_ops;

#define EXL_ARGMAX_ROWS 64 /* the most rows of one argmax */
#define EXL_ARGMAX_KEEP 8  /* argmax results kept for argmax_wait */

#define EXL_TOP_K_MAX 64 /* the largest k of top_k */

struct exl_backend {
    const exl_backend_ops *ops;
    const char *name;
    size_t kv_elem_bytes; /* bytes per cached K/V value at full precision (backend/kv_quant.h) */
    int32_t step_rows;    /* tokens a forward step takes at most (its scratch buffers are sized for it) */
};

/* The CPU backend (always available). n_threads <= 0: one per core. */
exl_status exl_backend_cpu_init(int n_threads, exl_backend **out);
/* The CPU backend's worker threads, for host-side work beside it (the quantizer's), so that two pools do not
 * compete for the cores; NULL for any other backend. */
struct exl_pool *exl_backend_cpu_pool(exl_backend *be);
/* The backend for a device request: CUDA when asked for (error if unusable) or when
 * AUTO finds a usable GPU, else the CPU. */
exl_status exl_backend_init(exl_device device, int n_threads, exl_backend **out);
/* As exl_backend_init for device ordinal `ordinal` of its kind (tensor parallelism: call it from the thread that
 * will use the backend; a GPU backend makes its device that thread's current one). The CPU has one device
 * whatever the ordinal. */
exl_status exl_backend_init_ordinal(exl_device device, int ordinal, int n_threads, exl_backend **out);

#endif
