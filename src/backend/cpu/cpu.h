/* cpu.h - the CPU backend's private types shared by its files. */
#ifndef EXL_CPU_H
#define EXL_CPU_H

#include "backend/backend.h"
#include "backend/cpu/kernels.h"
#include "backend/cpu/qkernels.h"
#include "base/threads.h"

/* Tokens per forward step (exl_backend.step_rows): larger steps gain little on the CPU and
 * would hold a decode waiting behind a long prompt piece for seconds */
#define EXL_CPU_STEP_ROWS 512

typedef struct exl_cpu_backend {
    exl_backend base;
    exl_pool *pool;
    const exl_cpu_kernels *k;
    const exl_cpu_qkernels *qk; /* same ISA as k */
    int q8;                     /* quantized matmuls with int8 activations (qk->group_q8; not EXL_CPU_ACT=fp32) */
    int kv16;                   /* the KV cache in fp16 (cpu_attention_f16.c), else fp32: kv_elem_bytes says which */
    void *q8_scratch;           /* their int8 activations, steps and sums (cpu_qmatmul.c), grown as needed */
    size_t q8_scratch_bytes;
    struct exl_host_comm *comm; /* tensor parallelism: the ranks' communicator (cpu_comm.c), or NULL */
    int32_t rank;
    void *sample_scratch; /* the sample op's per-thread candidates and rows (cpu_sample.c) */
    size_t sample_bytes;
} exl_cpu_backend;

struct exl_linear {
    exl_linear_src src;     /* weights stay in the mapped files */
    float *bias;            /* fp32 copy, or NULL */
    struct exl_cpu_qmat *q; /* EXL2 / GPTQ view (cpu_quant.h), NULL when dense */
};

struct exl_vector {
    float *v;
};

static inline exl_cpu_backend *exl_cpu(exl_backend *be) { return (exl_cpu_backend *)be; }

/* x·W + b for EXL2 / GPTQ weights (cpu_qmatmul.c) */
void exl_cpu_qmatmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows);
/* Up to EXL_CPU_FUSED_MATMULS decode matmuls of one input x (q, k, v; gate, up) as one job of the pool, each with
 * the results of exl_cpu_qmatmul, where exl_cpu_qmatmul_fusable says yes for each (cpu_graph.c) */
#define EXL_CPU_FUSED_MATMULS 3
int exl_cpu_qmatmul_fusable(exl_backend *be, const exl_linear *w, int32_t rows);
void exl_cpu_qmatmul_many(exl_backend *be, float *const *outs, const float *x, const exl_linear *const *ws, int n,
                          int32_t rows);
exl_status exl_cpu_graph_run(exl_backend *be, const exl_graph *g);
void exl_cpu_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows);
void exl_cpu_embed(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows, float scale);
void exl_cpu_rmsnorm(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                     float eps);
void exl_cpu_rope(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                  int32_t rot_dim, const float *inv_freq, float attn_factor);
void exl_cpu_kv_store(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v, const exl_batch *b,
                      int32_t kv_width);
void exl_cpu_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v, const void *k_cache,
                       const void *v_cache, const exl_batch *b, const exl_attn_shape *shape);
/* kv_store and attention for a cache with a quantized side (cpu_kv_quant.c) */
void exl_cpu_kv_store_quant(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                            const exl_batch *b, int32_t kv_width);
void exl_cpu_attention_quant(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                             const void *k_cache, const void *v_cache, const exl_batch *b, const exl_attn_shape *shape);
/* kv_store and attention for the fp16 cache (cpu_attention_f16.c) */
void exl_cpu_kv_store_f16(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                          const exl_batch *b, int32_t kv_width);
void exl_cpu_attention_f16(exl_backend *be, float *out, const float *q, const void *k_cache, const void *v_cache,
                           const exl_batch *b, const exl_attn_shape *shape);
void exl_cpu_glu(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act);
void exl_cpu_add(exl_backend *be, float *x, const float *y, int64_t n);
void exl_cpu_gather_rows(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n, int32_t width);
void exl_cpu_copy_cols(exl_backend *be, float *out, const float *x, int32_t rows, int32_t width, int32_t x_width,
                       int32_t col);
void exl_cpu_softcap(exl_backend *be, float *x, int64_t n, float cap);
void exl_cpu_row_gate(exl_backend *be, float *x, const float *g, int32_t rows, int32_t width);
/* tensor parallelism's collectives (cpu_comm.c) */
exl_status exl_cpu_comm_init(exl_backend *const *ranks, int32_t n);
void exl_cpu_comm_abort(exl_backend *be, int resume);
void exl_cpu_all_reduce(exl_backend *be, float *x, int64_t n);
void exl_cpu_gather_cols(exl_backend *be, const exl_gather_cols_node *n);
/* mixture of experts (cpu_moe.c) */
void exl_cpu_moe_route(exl_backend *be, const exl_moe_route_node *n);
void exl_cpu_moe_experts(exl_backend *be, const exl_moe_experts_node *n);
/* LoRA updates (cpu_lora.c) */
void exl_cpu_lora(exl_backend *be, const exl_lora_node *n);
/* backend.h's host_gemm (cpu_host_gemm.c) */
exl_status exl_cpu_host_gemm(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                             const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                             int64_t ldc);
/* constrained decoding's logit masks (cpu_mask.c) */
exl_status exl_cpu_mask_logits(exl_backend *be, float *logits, int32_t rows, int32_t vocab, uint32_t *mask,
                               exl_logit_mask_fn fill, void *user);
/* backend.h's sample op, the reference for every backend (cpu_sample.c) */
exl_status exl_cpu_sample(exl_backend *be, exl_sample_result *out, float *logits, int32_t rows, int32_t vocab,
                          const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits);

#endif
