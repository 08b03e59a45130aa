/* cuda_internal.h - the CUDA backend's private types, error plumbing and helpers.
 *
 * Ops in the table return void, and kernels run asynchronously, so the backend keeps a
 * sticky error: the first failure (a launch error, an unsupported shape, a failed
 * scratch allocation) is recorded and returned by the next synchronize/download.
 * Messages reach the core's exl_last_error() through the callback that registry.c
 * hands over (exl_backend_cuda_set_error_sink); this library has no error state of its own. */
#ifndef EXL_CUDA_INTERNAL_H
#define EXL_CUDA_INTERNAL_H

#include "backend/backend.h"

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors */

/* Record a message through the core's error sink and return st. */
exl_status exl_cuda_fail(exl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define EXL_TRY(expr)                    \
    do {                                 \
        exl_status exl_try_st_ = (expr); \
        if (exl_try_st_ != EXL_OK)       \
            return exl_try_st_;          \
    } while (0)

/* the plan of a step's graph, and its CUDA graph (cuda_plan.cu, cuda_graph.cu) */
typedef struct exl_cuda_plan exl_cuda_plan;
/* a layer's experts as the grouped kernels read them (cuda_moe.cu) */
typedef struct exl_cuda_moe_table exl_cuda_moe_table;

typedef struct exl_cuda_comm exl_cuda_comm; /* tensor parallelism's NCCL communicators (cuda_comm.cu) */

/* Decode-sized steps of this many shapes keep their CUDA graphs (cuda_graph.cu): speculative decoding alternates a
 * draft's catch-up step (1 .. K + 1 tokens) with its one-token steps, and a target's verification steps take the K
 * that acceptance leaves; each shape is captured once, not at every change. */
#define EXL_CUDA_GRAPH_CACHE 8

/* a decode step kept with its CUDA graph (cuda_graph.cu) */
typedef struct exl_cuda_step_graph {
    exl_cuda_plan *plan; /* the step the CUDA graph exec holds */
    cudaGraphExec_t exec;
    int valid;     /* exec holds plan's launches, then the tail's argmax if set */
    uint64_t used; /* graph_clock when a step last ran it */
    struct {
        int32_t *ids;
        const float *logits;
        int32_t rows, vocab;
        int set, seen; /* seen: the step in flight has called it as the cached one did */
    } tail;
} exl_cuda_step_graph;

typedef struct exl_cuda_backend {
    exl_backend base;
    int device;
    exl_cuda_comm *comm; /* the ranks' communicator, or NULL */
    int32_t rank;
    int n_sms;
    int sm_major;               /* compute capability, major */
    int pdl;                    /* programmatic dependent launch (sm_90+): see exl_cuda_launch */
    int deterministic;          /* EXL_CUDA_DETERMINISTIC=1: split-K sums added in a fixed order (cuda_qgemv.cu) */
    int prefill_attention_fp32; /* EXL_CUDA_PREFILL_ATTENTION=fp32: prompts' attention on CUDA cores
                                 * (cuda_attention.cu), not on tensor cores */
    int moe_host_routes;        /* EXL_CUDA_MOE_DEVICE=0: every mixture of experts waits for its routes on the
                                 * host, as prompts do (cuda_moe.cu), decode steps too (never captured then) */
    int32_t dequant_rows;       /* quantized matmuls of this many rows go through cuda_qgemm.cu */
    int qrows;                  /* which of cuda_qmma.cu's decode steps go to cuda_qrows.cu (EXL_CUDA_QROWS_*) */
    int exact_prefill;          /* EXL_CUDA_EXACT_PREFILL=1: many-row matmuls of prompt rows keep ~22 bits (activations
                                 * and decoded weights as fp16 hi + lo, cuda_matmul.cu); 0: plain fp16 */
    cudaStream_t stream;
    cublasHandle_t cublas;
    exl_status sticky; /* first asynchronous failure, EXL_OK if none */
    char sticky_msg[512];
    /* scratch, grown on demand (never inside a steady decode loop) */
    void *scratch; /* fp16 activations (hi and lo parts) for the many-row paths */
    size_t scratch_bytes;
    float *gemv_partial; /* split-K partial sums of the GEMV kernels */
    size_t gemv_partial_bytes;
    float *gemv_normed; /* the input of GEMV-A normed by a launch of its own (cuda_qgemv_a.cuh) */
    size_t gemv_normed_bytes;
    unsigned *gemv_counters; /* per column tile arrival counters (self-resetting) */
    size_t gemv_counter_count;
    void *lora_fold; /* LoRA updates folded into a GEMV: a counter, then partial sums (self-resetting) */
    size_t lora_fold_bytes;
    void *lora_sums; /* the lora op's batch path (cuda_lora_batch.cu): a counter (self-resetting), then partial sums */
    size_t lora_sums_bytes;
    /* the lora op's shrink beside a matmul (cuda_lora_overlap.cu): a second stream and its fork and join events
     * (created at the first fork), and the node whose shrink was forked onto it and not yet expanded (or NULL) */
    cudaStream_t lora_side;
    cudaEvent_t lora_fork, lora_join;
    const exl_lora_node *lora_forked;
    float *attn_partial; /* split-K partials of decode attention */
    size_t attn_partial_bytes;
    __half *dequant; /* quantized weights decoded to fp16 hi and lo for cuBLAS (cuda_qgemm.cu) */
    size_t dequant_bytes;
    float *gemm_parts; /* the stacked products of both activation parts (exl_cuda_gemm_parts) */
    size_t gemm_parts_bytes;
    float *fused_scratch; /* the unfused path of a fused matmul: normed input, products */
    size_t fused_scratch_bytes;
    void *top_k_buf; /* top_k results: ids, then values */
    size_t top_k_bytes;
    void *sample_buf; /* the sample op's results, settings, edits (cuda_sample.cu) */
    size_t sample_bytes;
    void *mask_buf; /* mask_logits' bitsets (cuda_mask.cu) */
    size_t mask_bytes;
    /* greedy tokens for decode ahead of the host (cuda_argmax.cu) */
    int32_t *argmax_ring;                     /* page-locked, mapped: [EXL_ARGMAX_KEEP][EXL_ARGMAX_ROWS] results */
    unsigned *argmax_state;                   /* device: argmax launches so far, blocks done in the current one */
    cudaEvent_t argmax_done[EXL_ARGMAX_KEEP]; /* recorded after the launch holding each ticket */
    int32_t argmax_rows[EXL_ARGMAX_KEEP];
    int64_t argmax_issued, argmax_marked; /* tickets handed out; of those, with their event recorded */
    /* sampled tokens for decode ahead of the host (cuda_sample.cu: sample_queue) */
    exl_sample_result *sample_ring;           /* page-locked, mapped: [EXL_ARGMAX_KEEP][EXL_ARGMAX_ROWS] results */
    int32_t *sample_kept;                     /* device: each row's n_kept in the last queued launch */
    cudaEvent_t sample_done[EXL_ARGMAX_KEEP]; /* recorded after the launch holding each ticket */
    int32_t sample_rows[EXL_ARGMAX_KEEP];
    int64_t sample_issued;
    /* steps (cuda_graph.cu): graph_run compiles a step's graph into a plan; the plans of the last few decode-sized
     * steps of different shapes are kept with their CUDA graphs, each replayed when a step's graph equals its plan */
    int step_state; /* idle, replay (a cached step matched), capture */
    int graphs_off; /* EXL_CUDA_GRAPHS=0, or after a graph API failure */
    exl_cuda_step_graph step_graphs[EXL_CUDA_GRAPH_CACHE];
    int32_t step_graph;    /* the entry the step in flight replays or is captured into */
    uint64_t graph_clock;  /* steps run so far (the entries' last use) */
    exl_cuda_plan *direct; /* steps run launch by launch (prompts) */
    /* mixture of experts (cuda_moe.cu): the routes of a prompt step on the host; each layer's experts as a device
     * table of their matrices; the device path's groups */
    int32_t *moe_host;
    size_t moe_host_count;
    exl_cuda_moe_table *moe_tables;
    int32_t n_moe_tables, cap_moe_tables;
    int32_t *moe_groups;
    size_t moe_groups_bytes;
    /* host_gemm staging (cuda_host_gemm.cu) */
    float *host_gemm_buf;
    size_t host_gemm_bytes;
} exl_cuda_backend;

static inline exl_cuda_backend *exl_cuda(exl_backend *be) { return (exl_cuda_backend *)be; }

/* A kernel that asks for more than 48 KiB of shared memory must opt in on each device it runs on (tensor
 * parallelism: one backend a device, one rank a thread). `allowed` is the call site's table (static, zeroed): the
 * bytes granted so far on each device. False (with CUDA's error left for the caller) if the device refuses. */
#define EXL_CUDA_MAX_DEVICES 64
static inline bool exl_cuda_smem_opt_in(const exl_cuda_backend *cb, const void *kernel, size_t smem,
                                        size_t (&allowed)[EXL_CUDA_MAX_DEVICES]) {
    if (smem <= 48 * 1024)
        return true;
    const bool cached = cb->device >= 0 && cb->device < EXL_CUDA_MAX_DEVICES;
    if (cached && allowed[cb->device] >= smem)
        return true;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess)
        return false;
    if (cached)
        allowed[cb->device] = smem;
    return true;
}

/* Record the first asynchronous failure; later ones are dropped. */
void exl_cuda_set_sticky(exl_cuda_backend *cb, exl_status st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Return (and clear) the sticky error as a status with its message. */
exl_status exl_cuda_take_sticky(exl_cuda_backend *cb);
/* Check the last launch; records a sticky error on failure and returns 0. */
int exl_cuda_check_launch(exl_cuda_backend *cb, const char *what);
/* Grow a device buffer to at least `bytes` (contents lost). 0 on failure (sticky set). */
int exl_cuda_ensure(exl_cuda_backend *cb, void **buf, size_t *have, size_t bytes, const char *what);
/* A cudaMalloc that fails with a clear out-of-memory message. */
exl_status exl_cuda_malloc(void **p, size_t bytes, const char *what);

#define CUDA_CHECK(call, what)                                                                                     \
    do {                                                                                                           \
        cudaError_t e_ = (call);                                                                                   \
        if (e_ != cudaSuccess)                                                                                     \
            return exl_cuda_fail(e_ == cudaErrorMemoryAllocation ? EXL_ERR_NOMEM : EXL_ERR_DEVICE, "CUDA: %s: %s", \
                                 what, cudaGetErrorString(e_));                                                    \
    } while (0)

#define CUBLAS_CHECK_STICKY(cb, call, what)                                                             \
    do {                                                                                                \
        cublasStatus_t s_ = (call);                                                                     \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                \
            exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "cuBLAS: %s: %s", what, cublasGetStatusString(s_)); \
    } while (0)

/* ---- weights */

/* A quantized matrix (EXL2 or GPTQ) repacked for this backend:
 * rows are grouped in chunks of 32 ("slots"), each chunk one bit width and one scale group;
 * codes of a chunk are a little-endian bit stream down each column (exl_qw_col: where a
 * column's words lie), except at 3 and 5 bits (a pair's codes in the two halves of a word,
 * cuda_halves.h), the values in the pair order of exl_cuda_slot_of(); the activations
 * are gathered into slot order through slot_src (-1 = padding, read as 0).
 * W[slot, n] = (code - zero) * scale[group, n]. */
typedef struct exl_qmatrix {
    int32_t n_chunks, n_pad, n_groups, word_rows;
    uint32_t *qw;      /* [n_pad / EXL_QW_TILE][word_rows][EXL_QW_TILE]: column tiles one after another */
    int4 *chunks;      /* [n_chunks]: word row, bits, group, 0 */
    __half *scales;    /* [n_groups, n_pad] */
    __half *zeros;     /* [n_groups, n_pad] (GPTQ) or NULL (EXL2: zero = 2^(bits-1)) */
    int32_t *slot_src; /* [n_chunks * 32] */
    int32_t *slot_of;  /* [in]: the slot of each input row, where the slots are exactly the rows
                          * (in % 32 == 0), else NULL: a GLU producer may store in that order */
} exl_qmatrix;

/* Columns of a tile of qw. The words of a tile lie together, row after row, so that a kernel
 * reading a tile's columns over a range of chunks streams one contiguous piece of memory. */
#define EXL_QW_TILE 256

#ifdef __CUDACC__
/* word row 0 of column col; word row w is EXL_QW_TILE words further per row */
__device__ __forceinline__ const uint32_t *exl_qw_col(const exl_qmatrix &q, int col) {
    return q.qw + (int64_t)(col / EXL_QW_TILE) * q.word_rows * EXL_QW_TILE + col % EXL_QW_TILE;
}
#endif

struct exl_linear {
    exl_linear_kind kind;
    int32_t in, out;
    __half *w;     /* dense: [out, in] fp16 */
    exl_qmatrix q; /* quantized */
    float *bias;   /* [out] or NULL */
};

struct exl_vector {
    float *v;
};

/* Host: the slot (0..31) a row of a 32-row chunk of `bits` goes to, so that decoded pairs
 * land on consecutive slots (see cuda_quant.cu). */
int exl_cuda_slot_of(int bits, int row);

exl_status exl_cuda_qmatrix_init(exl_cuda_backend *cb, const exl_linear_src *src, exl_qmatrix *q);
void exl_cuda_qmatrix_free(exl_qmatrix *q);

/* ---- launchers: what a step's plan (cuda_plan.cu) and the op table's entries (cuda_graph.cu) run, directly or
 * inside a CUDA graph capture */

/* A matmul with its neighbours in the decoder layer fused, the compiled form of a run of graph nodes
 * (cuda_plan.cu):
 *   xin = norm ? rmsnorm(x) * norm : up ? act(x) * up : x        (act as in glu)
 *   out[i] = xin · W[i] + b[i], or out[i] += ... when accumulate (not with norm), for i < n */
typedef struct exl_cuda_fused_mm {
    int32_t rows, n;
    int32_t in_features, out_features[3]; /* of the linears, for the unfused path */
    const float *x;                       /* [rows, in] */
    const exl_vector *norm;               /* or NULL */
    float eps;
    const float *up; /* [rows, in], or NULL */
    int32_t act;
    int32_t accumulate;
    int32_t decode;         /* 1: the rows are tokens of decode steps, whose xin may be rounded to fp16 (as
                             * the GEMV does for any few rows); 0: keep xin's precision (prompts, compared with
                             * reference logits) */
    const exl_linear *w[3]; /* all with the same in_features */
    float *out[3];          /* [rows, out_features of w[i]]; never x or up */
    /* Split sums without a merge (the GEMV only; the plan sets them where the GEMV takes both launches):
     * clear[i] (n_clear[i] floats) is set to zero by this launch once the ops before it are done, for a later
     * one whose outputs they are; out_zeroed: an earlier launch zeroed each out[i] for this one, which may add
     * its split sums onto them. */
    float *clear[3];
    int64_t n_clear[3];
    int32_t out_zeroed;
    /* Slot order (exl_qmatrix.slot_of; the GEMV only): out_map: output column c goes to out_map[c] (gate and
     * up stored in the order of the matrix they feed, which reads them with x_slots); x_slots: x (and up)
     * are in w[0]'s slot order, as a producer stored them. */
    const int32_t *out_map;
    int32_t x_slots;
    /* kv (decode steps; k_cache NULL: none): the cache rows the attention after this launch reads, keys 0 ..
     * n_kv - 1 of each of the step's sequences (device tables, rows of width halves at their pages' slots),
     * which the GEMV asks L2 for while it multiplies */
    struct {
        const void *k_cache, *v_cache;
        const exl_attn_seq *seqs;
        const int32_t *page_tables;
        int32_t n_seqs, page_size, width;
    } kv;
    /* lora (one row, the GEMV only; NULL: none): the node's updates added to these outputs by this launch, where
     * exl_cuda_qgemv_lora_fits (the plan folds it, cuda_plan.cu) */
    const exl_lora_node *lora;
} exl_cuda_fused_mm;

void exl_cuda_run_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows);
/* a fused matmul; the unfused path needs fused_scratch_need() floats of fused_scratch */
void exl_cuda_run_matmul_fused(exl_backend *be, const exl_cuda_fused_mm *f);
size_t exl_cuda_fused_scratch_need(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f);
/* The fused quantized GEMV (cuda_qgemv.cu): 1 if it takes f (few rows, quantized weights
 * of one input width), which exl_cuda_qgemv_fused then launches. */
int exl_cuda_qgemv_takes(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f);
/* at backend creation: the kernels' launch attributes (not allowed inside a graph capture) */
void exl_cuda_qgemv_init(const exl_cuda_backend *cb);
void exl_cuda_qgemv_fused(exl_cuda_backend *cb, const exl_cuda_fused_mm *f);
/* 1 if the one-row GEMV that takes f can add n's updates to f's outputs as well (cuda_lora_fold.cuh) */
int exl_cuda_qgemv_lora_fits(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f, const exl_lora_node *n);
/* The order in which a producer may store the input of a later matmul of rows over w with in_features width,
 * so that the GEMV that takes it reads consecutive rows (w's slot_of), or NULL. */
const int32_t *exl_cuda_slot_order(const exl_linear *w, int32_t rows, int32_t width);
/* out[rows, out] (+)= xin · w + b on tensor cores for a quantized w (cuda_qmma.cu); xin is x,
 * or exl_cuda_activate(x, act) * up when up is not NULL (fp32 [rows, in]), multiplied as fp16
 * hi + lo (parts 2) or hi alone (parts 1); uses scratch */
void exl_cuda_qmma(exl_cuda_backend *cb, float *out, const float *x, const float *up, int act, const exl_linear *w,
                   int32_t rows, int accumulate, int parts);
/* The same for rows <= EXL_CUDA_QROWS_MAX_ROWS, hi alone, in one launch (cuda_qrows.cu): 1 if it took the matmul,
 * 0 to leave it to exl_cuda_qmma. Which matmuls exl_cuda_qmma offers it (EXL_CUDA_QROWS, read at backend start):
 * AUTO (unset) up to EXL_CUDA_QROWS_AUTO_ROWS rows of a matrix with EXL_CUDA_QROWS_AUTO_WIDTH or more inputs or
 * outputs, where it measured faster on an H100 (7B gate/up/down at 5-8 rows: gate 24.2 -> 19.7 us; q_proj-shaped
 * matrices and 9-16 rows slower: bench/RESULTS.md); ALL (=1) every one up to 16 rows (tests); OFF (=0) none. */
#define EXL_CUDA_QROWS_MAX_ROWS 16
#define EXL_CUDA_QROWS_AUTO_ROWS 8
#define EXL_CUDA_QROWS_AUTO_WIDTH 8192
enum { EXL_CUDA_QROWS_OFF, EXL_CUDA_QROWS_AUTO, EXL_CUDA_QROWS_ALL };
int exl_cuda_qrows(exl_cuda_backend *cb, float *out, const float *x, const float *up, int act, const exl_linear *w,
                   int32_t rows, int accumulate);
/* f's matmuls (quantized, of one input width; its norm or GLU applied to x, not both) through weights decoded to
 * fp16 and cuBLAS (cuda_qgemm.cu): the many-row path from cb->dequant_rows rows (EXL_CUDA_DEQUANT_ROWS, default
 * EXL_CUDA_DEQUANT_ROWS_DEFAULT). The activations are multiplied as fp16 hi + lo (parts 2) or hi alone (parts 1);
 * the weights are decoded as hi + lo with cb->exact_prefill, else as plain fp16. Uses scratch, dequant and
 * gemm_parts. */
#define EXL_CUDA_DEQUANT_ROWS_DEFAULT 96
/* Tokens per forward step (exl_backend.step_rows): a prompt of 2048 tokens in one step decodes
 * each quantized matrix once for cuBLAS instead of four times (prefill 2048: 5596 -> 6938
 * tok/s on H100 against 512-token steps, bench/RESULTS.md) */
#define EXL_CUDA_STEP_ROWS 2048
void exl_cuda_qgemm(exl_cuda_backend *cb, const exl_cuda_fused_mm *f, int parts);
/* Products of fp16 weights with the activations' two fp16 parts (cuda_matmul.cu). xh holds hi
 * then lo, each [rows, K]. The weights W are hi (+ lo / EXL_CUDA_LO_SCALE when lo is not NULL:
 * the decoded quantized weights, exact to ~22 bits), each fp16 [n, ld] row-major (trans = 1,
 * dense weights as stored) or [K, ld] row-major (trans = 0, decoded by cuda_qgemm.cu).
 * xparts 1 multiplies hi alone (the rows of decode steps).
 * gemm_parts: out[rows, ldo] (+)= x · W (+ bias): up to EXL_CUDA_STACK_ROWS rows the products
 * hi·W.hi, lo·W.hi (one GEMM: W.hi read once) and hi·W.lo are stacked (exl_cuda_gemm_stacked)
 * and exl_cuda_parts_sum adds them; beyond, each GEMM accumulates into out.
 * gemm_stacked: gemm_parts [*parts * rows, n] = those products (1 to 3), returned (NULL on
 * failure). parts_sum: out[r, j] (+)= sum of the parts' c[p * rows + r, j] (+ bias[j]); c NULL:
 * out += bias. */
#define EXL_CUDA_STACK_ROWS 256
#define EXL_CUDA_LO_SCALE 4096.0f
typedef struct exl_cuda_f16w {
    const __half *hi, *lo;
    int trans;
    int64_t ld;
} exl_cuda_f16w;
void exl_cuda_gemm_parts(exl_cuda_backend *cb, float *out, int64_t ldo, const __half *xh, int32_t xparts, int32_t rows,
                         int32_t K, const exl_cuda_f16w *w, int32_t n, const float *bias, int accumulate);
float *exl_cuda_gemm_stacked(exl_cuda_backend *cb, const __half *xh, int32_t xparts, int32_t rows, int32_t K,
                             const exl_cuda_f16w *w, int32_t n, int *parts);
void exl_cuda_parts_sum(exl_cuda_backend *cb, float *out, int64_t ldo, const float *c, int64_t ldc, int32_t n,
                        int32_t rows, int parts, const float *bias, int accumulate);
/* xin = norm ? rmsnorm(x) * norm : up ? act(x) * up : x (fp32 [rows, width]) as fp16 hi [rows, width] at dst and,
 * with parts 2, lo = fp16(xin - hi) [rows, width] after it (cuda_split_half.cu) */
void exl_cuda_split_half(exl_cuda_backend *cb, __half *dst, const float *x, const exl_vector *norm, float eps,
                         const float *up, int act, int32_t rows, int32_t width, int parts);
void exl_cuda_run_embed(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows,
                        float scale);
void exl_cuda_run_rmsnorm(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                          float eps);
void exl_cuda_run_rope(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                       int32_t rot_dim, const float *inv_freq, float attn_factor);
void exl_cuda_run_kv_store(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                           const exl_batch *b, int32_t kv_width);
/* at backend creation: the decode attention kernels' attributes (not allowed inside a graph capture) */
void exl_cuda_attention_init(void);
void exl_cuda_run_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                            const void *k_cache, const void *v_cache, const exl_batch *b, const exl_attn_shape *shape);
void exl_cuda_run_glu(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act);
void exl_cuda_run_add(exl_backend *be, float *x, const float *y, int64_t n);
void exl_cuda_run_gather_rows(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n,
                              int32_t width);
void exl_cuda_run_copy_cols(exl_backend *be, float *out, const float *x, int32_t rows, int32_t width, int32_t x_width,
                            int32_t col);
void exl_cuda_run_softcap(exl_backend *be, float *x, int64_t n, float cap);
void exl_cuda_run_row_gate(exl_backend *be, float *x, const float *g, int32_t rows, int32_t width);
/* mixture of experts (cuda_moe.cu): moe_experts of a decode-sized step (exl_cuda_moe_on_device, and not a prompt
 * piece) runs on the device alone, in launches a CUDA graph can hold; prompts wait for their routes on the host */
void exl_cuda_run_moe_route(exl_backend *be, const exl_moe_route_node *n);
void exl_cuda_run_moe_experts(exl_backend *be, const exl_moe_experts_node *n, int prompt);
int exl_cuda_moe_on_device(const exl_cuda_backend *cb, const exl_moe_experts_node *n);
void exl_cuda_moe_free(exl_cuda_backend *cb);
/* A step's (row, choice) pairs grouped by expert (cuda_moe.cu): group g is expert expert[g] (-1: no group), its
 * slots start[g] .. start[g] + count[g] - 1; a slot's row and pair (row * top_k + choice) */
typedef struct exl_cuda_moe_groups {
    const int32_t *expert, *start, *count; /* [n_groups] */
    const int32_t *slot_row, *slot_pair;   /* [pairs] */
    int32_t n_groups, pairs, rows, n_experts;
} exl_cuda_moe_groups;
/* One grouped GEMV launch (cuda_moe_gemv.cu): for each group's slots, out[i][slot] = xin · W_i of the group's
 * expert (+ bias), for its matrices role0 .. role0 + n_roles - 1 (0 gate, 1 up, 2 down; gate and up together);
 * xin = x[slot_row[slot]], or act(x[slot]) * up[slot] when up is set. With pair_weight, out[0] is the layer's
 * output instead, [rows, out], and each slot's product times its pair's weight is added to its row. */
typedef struct exl_cuda_moe_launch {
    const exl_cuda_moe_groups *groups;
    const exl_linear *mats;  /* the device table: [n_experts][3] */
    const exl_linear *first; /* host: expert 0's matrix role0 (every expert's has its kind and shape) */
    int32_t role0, n_roles;
    const float *x, *up;
    int32_t act;
    float *out[2];
    const float *pair_weight;
    int32_t n_chunks;   /* quantized: the most input chunks of any expert's matrix of the launch */
    int32_t out_zeroed; /* out[] is zero: the input may be split over blocks whose sums are added atomically */
} exl_cuda_moe_launch;
void exl_cuda_moe_gemv(exl_cuda_backend *cb, const exl_cuda_moe_launch *l);
/* LoRA updates (cuda_lora.cu) */
void exl_cuda_run_lora(exl_backend *be, const exl_lora_node *n);
/* 1 if the plan may fold one-row lora nodes into their GEMVs (EXL_CUDA_LORA_GEMV, default 1; not with
 * EXL_CUDA_DETERMINISTIC) */
int exl_cuda_lora_fold_on(const exl_cuda_backend *cb);
/* The batch path's shrink beside a matmul (cuda_lora_overlap.cu; EXL_CUDA_LORA_OVERLAP=1, 2 or 3, default off):
 * overlaps: 1 if the switch is on and the op takes n through the batch path, so that the plan may hand n to a matmul
 * beside it (cuda_plan.cu); fork (before that matmul's launches): n's shrink on the second stream; join (after them):
 * n's expand on the backend's stream once the shrink is done, or the whole op where fork did not fork; side_close:
 * the backend's stream waits for the second (a capture ending between fork and join); side_free: at destroy. */
int exl_cuda_lora_overlaps(const exl_cuda_backend *cb, const exl_lora_node *n);
void exl_cuda_lora_fork(exl_cuda_backend *cb, const exl_lora_node *n);
void exl_cuda_lora_join(exl_cuda_backend *cb, const exl_lora_node *n);
void exl_cuda_lora_side_close(exl_cuda_backend *cb);
void exl_cuda_lora_side_free(exl_cuda_backend *cb);
void exl_cuda_run_rope_kv_store(exl_backend *be, float *q, float *k, const float *v, void *k_cache, void *v_cache,
                                const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim, const float *inv_freq,
                                float attn_factor);
/* A cache with a quantized side (cuda_kv_quant.cu; backend/kv_quant.h): 1 when the batch's is, and its KV store
 * (after the rope of q and k, or without) and attention, which kv_store, rope_kv_store and attention hand it. */
int exl_cuda_kv_quantized(const exl_batch *b);
void exl_cuda_run_kv_store_quant(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                                 const exl_batch *b, int32_t kv_width);
void exl_cuda_run_rope_kv_store_quant(exl_backend *be, float *q, float *k, const float *v, void *k_cache, void *v_cache,
                                      const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim,
                                      const float *inv_freq, float attn_factor);
void exl_cuda_run_attention_quant(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                                  const void *k_cache, const void *v_cache, const exl_batch *b,
                                  const exl_attn_shape *sh);
/* rope_kv_store, then attention: one launch (which leaves q and k as they were) where
 * exl_cuda_rope_attention_fuses, for decode steps of one new token a sequence, with the output stored in
 * out_order (exl_cuda_slot_order of the matmul it feeds) when that is not NULL; else the two launches */
int exl_cuda_rope_attention_fuses(const exl_cuda_backend *cb, const exl_batch *b, const exl_attn_shape *sh,
                                  int32_t rot_dim);
void exl_cuda_run_rope_attention(exl_backend *be, float *out, float *q, float *k, const float *v, void *k_cache,
                                 void *v_cache, const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim,
                                 const float *inv_freq, float attn_factor, const int32_t *out_order);

/* Largest row count of a step captured as a CUDA graph: decode steps of up to 64 sequences
 * (captured 16-64-job generator steps ran 3-11% faster than launched one by one,
 * bench/RESULTS.md); prompt pieces, which attention marks, run directly. */
#define EXL_CUDA_GRAPH_MAX_ROWS 64
/* Largest row count the quantized GEMV takes (cuda_qgemv.cu): 1-4 rows on CUDA cores (qgemv_kernel), and a single
 * wide matrix (the head) at 5-16 rows on tensor cores (GEMV-A, cuda_qgemv_a.cuh); other matrices of 5+ rows go to
 * cuda_qmma.cu, which beat the GEMVs on tensor cores there on an H100 (bench/RESULTS.md "decode of 2-16 rows"). */
#define EXL_CUDA_QGEMV_MAX_ROWS 16
/* Decode-sized steps: every sequence with at most EXL_CUDA_DECODE_MAX_Q new tokens (any number of rows), or at most
 * EXL_CUDA_VERIFY_MAX_Q (speculative decoding's verification, a draft's K + 1 tokens) in a step of at most
 * EXL_CUDA_VERIFY_MAX_ROWS rows. They are captured as CUDA graphs (cuda_plan.cu's graphable) and take the decode
 * attention kernels (cuda_attention.cu, cuda_kv_quant.cu), a block a (row, head): each row scores its own keys, the
 * causal mask inside the new tokens, and sizes nothing by the tokens a sequence, so 16 are as good as 4 there; but
 * each row reads its sequence's context again (through L2), so a step of R verification rows costs the attention of
 * R one-token sequences, which the row bound keeps at a decode step's. Longer pieces (prompts) and more rows of
 * pieces take the prompt kernels, which read a tile of keys once for 16-64 queries, and run launch by launch. */
#define EXL_CUDA_DECODE_MAX_Q 4
#define EXL_CUDA_VERIFY_MAX_Q 16
#define EXL_CUDA_VERIFY_MAX_ROWS EXL_CUDA_GRAPH_MAX_ROWS
static inline int exl_cuda_prompt_piece(const exl_batch *b) {
    return b->max_q > EXL_CUDA_DECODE_MAX_Q &&
           (b->max_q > EXL_CUDA_VERIFY_MAX_Q || b->n_rows > EXL_CUDA_VERIFY_MAX_ROWS);
}
/* decode attention sizes its splits for max_kv rounded up to this, so a captured step can
 * be replayed for the next tokens */
#define EXL_CUDA_KV_BUCKET 256

/* the op table's entries (cuda_graph.cu): each ends the step in flight (exl_cuda_graph_finish), then launches */
void exl_cuda_embed(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows,
                    float scale);
void exl_cuda_rmsnorm(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                      float eps);
void exl_cuda_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows);
void exl_cuda_rope(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                   int32_t rot_dim, const float *inv_freq, float attn_factor);
void exl_cuda_kv_store(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                       const exl_batch *b, int32_t kv_width);
void exl_cuda_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                        const void *k_cache, const void *v_cache, const exl_batch *b, const exl_attn_shape *shape);
void exl_cuda_glu(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act);
void exl_cuda_add(exl_backend *be, float *x, const float *y, int64_t n);
void exl_cuda_gather_rows(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n, int32_t width);
exl_status exl_cuda_sq_dist(exl_backend *be, const float *a, const float *b, int64_t n, double *acc);
exl_status exl_cuda_gemm(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc);
exl_status exl_cuda_qz_exl2_scales(exl_backend *be, const float *W, int64_t N, int32_t rows, int32_t bits,
                                   uint8_t *scale_codes, uint16_t *scale_max, float *scale, float *zero);
exl_status exl_cuda_qz_rows(exl_backend *be, float *W, const float *U, int64_t ldu, int64_t N, int32_t rows,
                            const float *scale, const float *zero, int32_t bits, uint8_t *codes, float *E);
exl_status exl_cuda_qz_factor(exl_backend *be, float *U, const float *H, const int32_t *perm, int64_t K, double damp,
                              int *ok);
exl_status exl_cuda_qz_set_trial(exl_backend *be, exl_linear *w, const float *W, const int32_t *perm);
void exl_cuda_copy_cols(exl_backend *be, float *out, const float *x, int32_t rows, int32_t width, int32_t x_width,
                        int32_t col);
void exl_cuda_softcap(exl_backend *be, float *x, int64_t n, float cap);
void exl_cuda_row_gate(exl_backend *be, float *x, const float *g, int32_t rows, int32_t width);
void exl_cuda_moe_route(exl_backend *be, const exl_moe_route_node *n);
void exl_cuda_moe_experts(exl_backend *be, const exl_moe_experts_node *n);
void exl_cuda_lora(exl_backend *be, const exl_lora_node *n);
exl_status exl_cuda_graph_run(exl_backend *be, const exl_graph *g);
exl_status exl_cuda_top_k(exl_backend *be, int32_t *ids, float *vals, const float *logits, int32_t rows, int32_t vocab,
                          int32_t k);
int64_t exl_cuda_argmax(exl_backend *be, int32_t *ids, const float *logits, int32_t rows, int32_t vocab);
exl_status exl_cuda_argmax_wait(exl_backend *be, int64_t ticket, int32_t *ids, int32_t rows);
exl_status exl_cuda_mask_logits(exl_backend *be, float *logits, int32_t rows, int32_t vocab, uint32_t *mask,
                                exl_logit_mask_fn fill, void *user);
exl_status exl_cuda_sample(exl_backend *be, exl_sample_result *out, float *logits, int32_t rows, int32_t vocab,
                           const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits);
int64_t exl_cuda_sample_queue(exl_backend *be, int32_t *ids, float *logits, int32_t rows, int32_t vocab,
                              const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits,
                              int chained);
exl_status exl_cuda_sample_wait(exl_backend *be, int64_t ticket, exl_sample_result *out, int32_t rows);
void exl_cuda_sample_free(exl_cuda_backend *cb);

/* ---- argmax (cuda_argmax.cu) */

/* The ring and state the argmax op writes, allocated once (outside any capture); 0 on failure
 * (message set). */
int exl_cuda_argmax_ready(exl_cuda_backend *cb);
void exl_cuda_run_argmax(exl_backend *be, int32_t *ids, const float *logits, int32_t rows, int32_t vocab);
/* after a launch at a synchronisation point: record the events of the tickets issued since */
void exl_cuda_argmax_mark(exl_cuda_backend *cb);
void exl_cuda_argmax_free(exl_cuda_backend *cb);

/* ---- a step's plan (cuda_plan.cu): the launches that run a graph, with this backend's fusions */

typedef enum exl_cuda_item_kind {
    EXL_CUDA_RUN_NODE,           /* one node as it is */
    EXL_CUDA_RUN_MATMUL,         /* matmuls with their norm, GLU or residual add: mm */
    EXL_CUDA_RUN_ROPE_KV_STORE,  /* rope q, rope k, kv_store */
    EXL_CUDA_RUN_ROPE_ATTENTION, /* rope q, rope k, kv_store, attention; out_order as in exl_cuda_run_rope_attention */
    EXL_CUDA_RUN_ALL_REDUCE_ADD, /* all_reduce of y, then x += y (exl_cuda_run_all_reduce_add) */
    EXL_CUDA_RUN_GATHER_ADD,     /* gather_cols into y, then x += y (exl_cuda_run_gather_cols_add) */
} exl_cuda_item_kind;

typedef struct exl_cuda_plan_item {
    exl_cuda_item_kind kind;
    int32_t node, n_nodes; /* the plan's nodes it runs */
    exl_cuda_fused_mm mm;
    const int32_t *out_order;
    /* a matmul's: a lora node of the batch path whose shrink runs on the second stream while the matmul does, its
     * expand right after (exl_cuda_lora_fork, _join), or NULL */
    const exl_lora_node *side_lora;
} exl_cuda_plan_item;

struct exl_cuda_plan {
    exl_node *nodes; /* the graph's, each copied field by field into zeroed memory (compared as bytes) */
    int32_t n_nodes, cap_nodes;
    exl_batch batch; /* the graph's, device side only, max_kv rounded up to EXL_CUDA_KV_BUCKET */
    int32_t has_batch;
    exl_cuda_plan_item *launches;
    int32_t n_launches, cap_launches;
    int32_t graphable; /* a decode-sized step, which may be captured into a CUDA graph */
};

/* the device side of a batch as the launches read it: host pointers cleared, max_kv rounded up to
 * EXL_CUDA_KV_BUCKET (so that a captured step can be replayed for the next tokens) */
exl_batch exl_cuda_device_batch(const exl_batch *b);
/* Compile g into p (its earlier contents replaced); a failure (out of host memory) leaves p empty. */
exl_status exl_cuda_plan_compile(exl_cuda_backend *cb, const exl_graph *g, exl_cuda_plan *p);
/* 1 if p was compiled from a graph equal to g (the same nodes, the same batch on the device side) */
int exl_cuda_plan_matches(const exl_cuda_plan *p, const exl_graph *g);
void exl_cuda_plan_run(exl_cuda_backend *cb, const exl_cuda_plan *p);
void exl_cuda_plan_free(exl_cuda_plan *p);

/* ---- steps and their CUDA graphs (cuda_graph.cu) */

/* End the step at a synchronisation point: launch what was captured or matched. */
void exl_cuda_graph_finish(exl_cuda_backend *cb);

/* tensor parallelism (cuda_comm.cu): the op table's entries, the launches a plan makes of the collectives' nodes,
 * and the communicator's reference that a backend drops when destroyed */
exl_status exl_cuda_comm_init(exl_backend *const *ranks, int32_t n);
void exl_cuda_comm_abort(exl_backend *be, int resume);
void exl_cuda_all_reduce(exl_backend *be, float *x, int64_t n);
void exl_cuda_gather_cols(exl_backend *be, const exl_gather_cols_node *n);
void exl_cuda_run_all_reduce(exl_backend *be, float *x, int64_t n);
void exl_cuda_run_gather_cols(exl_backend *be, const exl_gather_cols_node *n);
void exl_cuda_comm_release(exl_cuda_backend *cb);
/* an all_reduce node and the add of its result to x that follows it (cuda_plan.cu): x += the sum too */
void exl_cuda_run_all_reduce_add(exl_backend *be, float *sum, int64_t n, float *x);
/* a gather_cols node and the add of its output to x [rows * out_width] that follows it: x += the gathered rows */
void exl_cuda_run_gather_cols_add(exl_backend *be, const exl_gather_cols_node *g, float *x);

/* the push all-reduce between GPUs with peer access (cuda_allreduce.cu): each rank's receive buffer (two sets of
 * one slot of max_floats a rank, allocated on its device) and round counts (EXL_CUDA_PUSH_BLOCKS, on its device) */
#define EXL_CUDA_PUSH_MAX_RANKS 16
#define EXL_CUDA_PUSH_BLOCKS 32
typedef struct exl_cuda_push {
    float *recv[EXL_CUDA_PUSH_MAX_RANKS];
    unsigned *rounds[EXL_CUDA_PUSH_MAX_RANKS];
    unsigned long long *trace[EXL_CUDA_PUSH_MAX_RANKS]; /* EXL_TP_PUSH_TRACE=1 (cuda_allreduce.cu), else NULL */
    unsigned cycles_per_bin[EXL_CUDA_PUSH_MAX_RANKS];
    int64_t max_floats; /* a multiple of 4 */
} exl_cuda_push;
/* rank's buffers, on the current device */
exl_status exl_cuda_push_alloc(exl_cuda_push *p, int32_t rank, int32_t n_ranks, int64_t max_floats);
void exl_cuda_push_free(exl_cuda_push *p, int32_t n_ranks);
/* x [n] = the sum over the ranks (n <= max_floats), in rank order; resid (NULL: none) += that sum */
void exl_cuda_push_all_reduce(exl_cuda_backend *cb, const exl_cuda_push *p, int32_t n_ranks, float *x, float *resid,
                              int64_t n);
/* g's gather through the same buffers (g->n_ranks of them, rows * out_width <= max_floats, every rank at least one
 * column, g->out apart from g->x and resid): each rank's columns stored into every peer's receive buffer, read from
 * its own; resid (NULL: none) += the gathered rows */
void exl_cuda_push_gather(exl_cuda_backend *cb, const exl_cuda_push *p, const exl_gather_cols_node *g, float *resid);
/* Something that cannot be captured (a buffer growing) is about to happen inside a step:
 * launch what was captured so far, drop the cached graph, run the rest of the step directly. */
void exl_cuda_graph_flush(exl_cuda_backend *cb);
/* Finish the step and drop the cached graph (memory it refers to is being freed). */
void exl_cuda_graph_forget(exl_cuda_backend *cb);
void exl_cuda_graph_free(exl_cuda_backend *cb);

/* ---- host_gemm (cuda_host_gemm.cu): the op-table entry */

exl_status exl_cuda_host_gemm(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                              const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                              int64_t ldc);

#ifdef __cplusplus
}
#endif

/* Programmatic dependent launch. A kernel started by exl_cuda_launch may run while the
 * kernel before it finishes: up to exl_pdl_wait() it may only read constant data (weights,
 * tables) and shared memory; after it, everything the earlier kernels wrote is visible.
 * exl_pdl_trigger() lets the next kernel start its own prologue. Both are no-ops before
 * sm_90 and for kernels launched without the attribute. EXL_CUDA_PDL=0 turns it off. */
__device__ __forceinline__ void exl_pdl_wait(void) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void exl_pdl_trigger(void) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
/* let the next kernel start, then wait for the earlier ones (at the top of a kernel, or after
 * a prologue that reads only constant data) */
__device__ __forceinline__ void exl_pdl_start(void) {
    exl_pdl_trigger();
    exl_pdl_wait();
}

/* The gate activation of a GLU: act 0 silu, 1 gelu (tanh), 2 gelu (erf) */
__device__ __forceinline__ float exl_cuda_activate(float g, int act) {
    if (act == 0)
        return g / (1.0f + expf(-g));
    if (act == 1)
        return 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    return 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
}

/* The sum of v over the block in double, in a fixed order (a run repeats its result): blockDim.x a power of two, sh
 * that many doubles; a caller reusing sh syncs before the next call. */
__device__ __forceinline__ double exl_block_sum_f64(double v, double *sh) {
    sh[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s)
            sh[threadIdx.x] += sh[threadIdx.x + s];
        __syncthreads();
    }
    return sh[0];
}

/* Launch kernel k on stream, with programmatic dependent launch where the GPU has it and pdl is set (0: a full
 * dependency on the work before, as a kernel right after a fork of streams may want) */
template <typename... P, typename... A>
static inline void exl_cuda_launch_on(exl_cuda_backend *cb, cudaStream_t stream, int pdl, void (*k)(P...), dim3 grid,
                                      dim3 block, size_t smem, A &&...args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[1];
    unsigned n = 0;
    if (cb->pdl && pdl) {
        at[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[n++].val.programmaticStreamSerializationAllowed = 1;
    }
    cfg.attrs = at;
    cfg.numAttrs = n;
    cudaLaunchKernelEx(&cfg, k, static_cast<A &&>(args)...);
}

/* Launch kernel k on the backend's stream, with programmatic dependent launch where the
 * GPU has it; k must call exl_pdl_wait() before it touches memory other kernels write. */
template <typename... P, typename... A>
static inline void exl_cuda_launch(exl_cuda_backend *cb, void (*k)(P...), dim3 grid, dim3 block, size_t smem,
                                   A &&...args) {
    exl_cuda_launch_on(cb, cb->stream, 1, k, grid, block, smem, static_cast<A &&>(args)...);
}

#endif
