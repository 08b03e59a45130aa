/* gpu_bench.c - batch-1 decode and prefill speed of random-weight models of real shapes
 * (Llama-2-7B: hidden 4096, 32 layers, 32 heads, ffn 11008, vocab 32000) on the CUDA
 * backend, against the device's own copy bandwidth and fp16 GEMM rate measured in the
 * same run. The weights are generated in memory (EXL2 / GPTQ in their file layouts) and
 * the model is driven through the real forward pass (exl_model_forward). Per matrix shape (stderr): the time and
 * bandwidth of decode rows 1, 2, 4, 5, 8, 16, 32, 64 (and the ratio to one row) and the time and tensor-core rate of
 * prompt rows; then whole decode steps of 1-32 sequences (t/s, ms a step, the step's cost against one row) and one
 * sequence's verification steps of 1-16 rows at context 128 and 2048 (us, ratio to one row at that context).
 *
 * usage: gpu_bench [fp16|exl2|gptq|exl2-8b|moe ...] [--layers N] [--bits B] [--profile] [--prefill-only]
 *        [--kernels-only] [--sample-only]
 *        (default: exl2 gptq fp16 exl2-8b; moe: a mixture of experts of Qwen3-30B-A3B's shape, see moe_bench)
 * --bits: the EXL2 layers' code width, 2-8 (default 4; the head is 6 bits).
 * --profile: only a 128-token prompt and 3 decode steps of the first kind (for ncu).
 * --prefill-only: only the prefill columns (for an A/B of EXL_CUDA_EXACT_PREFILL=1, the ~22-bit prompt path).
 * --kernels-only: only the per-matrix times (for an A/B of a setting, e.g. EXL_CUDA_QMMA_WIDE_A=0: the head's
 *   5-16 rows on cuda_qmma.cu).
 * --sample-only: only the sample op's lines (also printed first in a full run): top-p 0.95 at temperature 0.8 on
 *   1, 16 and 64 rows of 32000 and one of 128256, beside greedy argmax on the same rows; then other settings.
 * GPU_BENCH_REPS=N: launches of a matrix a timed run (default 200; 1 under ncu), and no prompt rows. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/half.h"
#include "quant_gen.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CK(call)                                                                        \
    do {                                                                                \
        cudaError_t e_ = (call);                                                        \
        if (e_ != cudaSuccess) {                                                        \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                                    \
        }                                                                               \
    } while (0)
#define EK(call)                                                                  \
    do {                                                                          \
        if ((call) != EXL_OK) {                                                   \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, exl_last_error()); \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

static uint64_t rng = 0x1234567887654321ull;
static int exl2_bits = 4; /* --bits */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int cmp_f(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* ---- the two ceilings */

static double copy_bandwidth(void) {
    size_t bytes = (size_t)2 << 30;
    void *a, *b;
    CK(cudaMalloc(&a, bytes));
    CK(cudaMalloc(&b, bytes));
    CK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    float ms[10];
    for (int i = -2; i < 10; i++) {
        cudaEventRecord(e0, 0);
        CK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, 0));
        cudaEventRecord(e1, 0);
        CK(cudaEventSynchronize(e1));
        if (i >= 0)
            cudaEventElapsedTime(&ms[i], e0, e1);
    }
    qsort(ms, 10, sizeof ms[0], cmp_f);
    cudaFree(a), cudaFree(b);
    return 2.0 * bytes / (ms[5] * 1e-3);
}

static double gemm_rate(void) {
    int n = 8192;
    uint16_t *a, *b; /* fp16 */
    float *c;
    CK(cudaMalloc((void **)&a, (size_t)n * n * 2));
    CK(cudaMalloc((void **)&b, (size_t)n * n * 2));
    CK(cudaMalloc((void **)&c, (size_t)n * n * 4));
    uint16_t *h = malloc((size_t)n * n * 2);
    for (size_t i = 0; i < (size_t)n * n; i++)
        h[i] = exl_f32_to_f16(qg_uniform(&rng) - 0.5f);
    CK(cudaMemcpy(a, h, (size_t)n * n * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(b, h, (size_t)n * n * 2, cudaMemcpyHostToDevice));
    free(h);
    cublasHandle_t hd;
    cublasCreate(&hd);
    const float one = 1, zero = 0;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0), cudaEventCreate(&e1);
    float ms[5];
    for (int i = -2; i < 5; i++) {
        cudaEventRecord(e0, 0);
        cublasGemmEx(hd, CUBLAS_OP_T, CUBLAS_OP_N, n, n, n, &one, a, CUDA_R_16F, n, b, CUDA_R_16F, n, &zero, c,
                     CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        cudaEventRecord(e1, 0);
        CK(cudaEventSynchronize(e1));
        if (i >= 0)
            cudaEventElapsedTime(&ms[i], e0, e1);
    }
    qsort(ms, 5, sizeof ms[0], cmp_f);
    cublasDestroy(hd);
    cudaFree(a), cudaFree(b), cudaFree(c);
    return 2.0 * n * n * (double)n / (ms[2] * 1e-3);
}

/* ---- a random model */

typedef struct {
    const char *kind;
    int32_t layers;
    double file_bytes;   /* weight bytes a token reads, in the file format (head included, embedding row not) */
    double device_bytes; /* what the kernels stream */
} model_info;

static uint16_t *dense_pool; /* random fp16 values, reused for every dense matrix */
static size_t dense_pool_n;

static void linear(exl_model *m, model_info *mi, const char *kind, int head, int64_t K, int64_t N, exl_linear **out) {
    exl_linear_src src = {0};
    qgen g;
    memset(&g, 0, sizeof g);
    if (!strcmp(kind, "fp16")) {
        src.kind = EXL_LINEAR_DENSE;
        src.in_features = K;
        src.out_features = N;
        src.dense = (exl_dense_src){EXL_DTYPE_F16, dense_pool};
        src.name = "dense";
        mi->file_bytes += K * N * 2.0;
        mi->device_bytes += K * N * 2.0;
    } else if (!strcmp(kind, "exl2")) {
        int bits = head ? 6 : exl2_bits, n_groups = (int)(K / 128);
        int b[256], r[256];
        for (int i = 0; i < n_groups; i++)
            b[i] = bits, r[i] = 128;
        qgen_exl2(&g, (int32_t)K, (int32_t)N, n_groups, b, r, &rng);
        src = g.src;
        double np = g.src.exl2.n_padded;
        mi->file_bytes += K * np * bits / 8.0 + n_groups * (np / 2.0 + 2 + 4) + K * 4.0;
        mi->device_bytes += K * np * bits / 8.0 + n_groups * (np * 2.0) + K * 4.0;
    } else {
        qgen_gptq(&g, (int32_t)K, (int32_t)N, 4, 128, 0, 1, &rng);
        src = g.src;
        int G = (int)(K / 128);
        mi->file_bytes += K * N / 2.0 + G * (N * 2.0 + N / 2.0);
        mi->device_bytes += K * N / 2.0 + G * (N * 4.0) + K * 4.0;
    }
    EK(m->be->ops->linear_init(m->be, &src, out));
    qgen_free(&g);
}

/* "exl2-8b": Llama-3-8B's shape (8 KV heads, ffn 14336, vocab 128256), else Llama-2-7B's */
static int is_8b(const char *kind) { return !strcmp(kind, "exl2-8b"); }

static exl_model *build_model(const char *kind, int32_t n_layers, model_info *mi) {
    exl_model *m = exl_calloc(1, sizeof *m);
    exl_hf_config *c = &m->cfg;
    const int big = is_8b(kind);
    if (big)
        kind = "exl2";
    c->arch = EXL_ARCH_LLAMA;
    snprintf(c->model_type, sizeof c->model_type, "llama");
    c->vocab_size = big ? 128256 : 32000, c->hidden_size = 4096, c->intermediate_size = big ? 14336 : 11008;
    c->n_layers = n_layers;
    c->n_heads = 32, c->n_kv_heads = big ? 8 : 32, c->head_dim = 128, c->max_pos = 8192;
    c->rms_eps = 1e-5;
    c->rope.type = EXL_ROPE_DEFAULT;
    c->rope.theta = big ? 500000 : 10000;
    c->rope.factor = 1;
    c->rope.partial_rotary_factor = 1;
    c->act = EXL_ACT_SILU;
    c->bos_token_id = 1;
    m->rot_dim = 128;
    m->embed_scale = 1;
    EK(exl_backend_init(EXL_DEVICE_CUDA, 0, &m->be));
    memset(mi, 0, sizeof *mi);
    mi->kind = kind;
    mi->layers = n_layers;
    int64_t H = 4096, F = c->intermediate_size, KV = (int64_t)c->n_kv_heads * 128, V = c->vocab_size;
    exl_linear_src es = {0};
    es.kind = EXL_LINEAR_DENSE;
    es.in_features = H;
    es.out_features = V;
    es.dense = (exl_dense_src){EXL_DTYPE_F16, dense_pool};
    es.name = "embed";
    EK(m->be->ops->linear_init(m->be, &es, &m->embed));
    uint16_t ones[4096];
    for (int i = 0; i < 4096; i++)
        ones[i] = exl_f32_to_f16(0.9f + 0.2f * qg_uniform(&rng));
    exl_dense_src ns = {EXL_DTYPE_F16, ones};
    EK(m->be->ops->vector_init(m->be, &ns, H, 0, &m->final_norm));
    m->layers = exl_calloc((size_t)n_layers, sizeof *m->layers);
    for (int i = 0; i < n_layers; i++) {
        exl_layer *l = &m->layers[i];
        EK(m->be->ops->vector_init(m->be, &ns, H, 0, &l->attn_norm));
        EK(m->be->ops->vector_init(m->be, &ns, H, 0, &l->mlp_norm));
        linear(m, mi, kind, 0, H, H, &l->q);
        linear(m, mi, kind, 0, H, KV, &l->k);
        linear(m, mi, kind, 0, H, KV, &l->v);
        linear(m, mi, kind, 0, H, H, &l->o);
        linear(m, mi, kind, 0, H, F, &l->gate);
        linear(m, mi, kind, 0, H, F, &l->up);
        linear(m, mi, kind, 0, F, H, &l->down);
    }
    /* EXL2 quantizes the head (6 bits here); GPTQ checkpoints keep it fp16 */
    linear(m, mi, !strcmp(kind, "exl2") ? "exl2" : "fp16", 1, H, V, &m->head);
    EK(exl_model_alloc_forward(m));
    return m;
}

/* ---- timing the forward pass */

/* Greedy decode as the generator runs it (generator/ahead.c): each step's token chosen on the
 * device and fed to the next step, which is queued before the host waits for the token before
 * it. Steps from position ctx; tokens/s over `steps` steps. */
static double decode_ahead_speed(exl_model *m, exl_kv_cache *cache, int32_t *pages, int32_t n_pages, int32_t ctx) {
    enum { WARM = 4, STEPS = 64 };
    int64_t t[WARM + STEPS + 1];
    int32_t first = 100, tok;
    exl_seq_step st = {&first, 1, ctx, pages, n_pages, 1};
    EK(exl_model_forward_argmax(m, cache, &st, 1, &t[0]));
    double t0 = 0;
    for (int i = 1; i <= WARM + STEPS; i++) {
        st = (exl_seq_step){NULL, 1, ctx + i, pages, n_pages, 1};
        EK(exl_model_forward_argmax(m, cache, &st, 1, &t[i]));
        EK(exl_model_argmax_wait(m, t[i - 1], &tok, 1));
        if (i == WARM)
            t0 = now(); /* step WARM - 1 is done: WARM .. WARM + STEPS are still to come */
    }
    EK(exl_model_argmax_wait(m, t[WARM + STEPS], &tok, 1));
    return (STEPS + 1) / (now() - t0);
}

/* Decode with the logits of every step brought to the host (exl_model_forward). */
static double decode_speed(exl_model *m, exl_kv_cache *cache, int32_t *pages, int32_t n_pages, int32_t ctx,
                           float *logits) {
    int32_t ids[256];
    for (int i = 0; i < 256; i++)
        ids[i] = (int32_t)(qg_next(&rng) % 32000);
    for (int32_t done = 0; done < ctx; done += 256) {
        int32_t n = ctx - done < 256 ? ctx - done : 256;
        exl_seq_step st = {ids, n, done, pages, n_pages, 1};
        EK(exl_model_forward(m, cache, &st, 1, logits));
    }
    const int steps = 64;
    double t0 = 0;
    for (int i = -4; i < steps; i++) {
        if (i == 0)
            t0 = now();
        exl_seq_step st = {ids + (i & 63) + 4, 1, ctx + i + 4, pages, n_pages, 1};
        EK(exl_model_forward(m, cache, &st, 1, logits));
    }
    return steps / (now() - t0);
}

/* a prompt of `tokens` tokens fed as the generator feeds it: pieces of the model's step size */
static double prefill_speed(exl_model *m, exl_kv_cache *cache, int32_t *pages, int32_t n_pages, float *logits,
                            int32_t tokens) {
    const int32_t piece = exl_model_max_rows(m) < 2048 ? exl_model_max_rows(m) : 2048;
    int32_t *ids = malloc((size_t)tokens * sizeof *ids);
    for (int i = 0; i < tokens; i++)
        ids[i] = (int32_t)(qg_next(&rng) % 32000);
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double t0 = now();
        for (int32_t done = 0; done < tokens; done += piece) {
            int32_t n = tokens - done < piece ? tokens - done : piece;
            exl_seq_step st = {ids + done, n, done, pages, n_pages, done + n == tokens};
            EK(exl_model_forward(m, cache, &st, 1, logits));
        }
        double tps = tokens / (now() - t0);
        if (tps > best)
            best = tps;
    }
    free(ids);
    return best;
}

/* time one matmul of `rows` rows alone, 200 back to back in one graph (up to 64 rows its first run is captured
 * into a CUDA graph, which the timed run replays), for the efficiency of each shape; decode: the rows are decode
 * tokens (a batch of max_q 1), whose activations may be rounded to fp16, else prompt rows (kept to ~22 bits) */
static double matmul_us(exl_model *m, const exl_linear *w, int64_t K, int64_t N, int32_t rows, int decode) {
    const char *reps_env = getenv("GPU_BENCH_REPS"); /* e.g. 1 under ncu: one launch a run */
    const int REPS = reps_env && atoi(reps_env) > 0 ? atoi(reps_env) : 200;
    exl_backend *be = m->be;
    float *x = be->ops->alloc(be, rows * K * 4), *y = be->ops->alloc(be, rows * N * 4);
    float *hx = malloc(rows * K * 4);
    for (int64_t i = 0; i < rows * K; i++)
        hx[i] = qg_uniform(&rng) - 0.5f;
    EK(be->ops->upload(be, x, hx, rows * K * 4));
    exl_batch b = {.n_rows = rows, .n_seqs = rows, .max_q = 1};
    exl_graph g = {0};
    exl_graph_reset(&g, decode ? &b : NULL);
    const exl_node n = {.op = EXL_OP_MATMUL,
                        .tag = {-1, EXL_PART_OTHER},
                        .matmul = {y, x, w, rows, (int32_t)K, (int32_t)N, 0}};
    for (int i = 0; i < REPS; i++)
        EK(exl_graph_add(&g, &n));
    EK(exl_graph_output(&g, y, rows * N));
    EK(be->ops->graph_run(be, &g));
    EK(be->ops->synchronize(be));
    double t0 = now();
    EK(be->ops->graph_run(be, &g));
    EK(be->ops->synchronize(be));
    double us = (now() - t0) / REPS * 1e6;
    exl_graph_free(&g);
    be->ops->free(be, x), be->ops->free(be, y);
    free(hx);
    return us;
}

/* ---- a mixture of experts of Qwen3-30B-A3B's shape ("moe"): 48 layers, hidden 2048, 32 q / 4 KV heads of 128 with
 * q/k norms, 128 experts of ffn 768 of which 8 a token (renormalized), vocab 151936; EXL2 linears of --bits (4:
 * 4.0 bpw and the scales) with a 6-bit head, the router fp16. One random matrix of each shape is generated and
 * loaded as every layer's and expert's (its own copy on the device each), so the model builds in seconds. */

enum { MOE_H = 2048, MOE_Q = 4096, MOE_KV = 512, MOE_E = 128, MOE_K = 8, MOE_F = 768, MOE_V = 151936 };

/* bytes of an EXL2 matrix in the file (as linear() counts them) */
static double exl2_file_bytes(int64_t K, int64_t N, int bits) {
    const double np = (double)((N + 31) / 32 * 32);
    return K * np * bits / 8.0 + K / 128 * (np / 2.0 + 2 + 4) + K * 4.0;
}

static void exl2_src(qgen *g, int64_t K, int64_t N, int bits) {
    int b[256], r[256], n_groups = (int)(K / 128);
    for (int i = 0; i < n_groups; i++)
        b[i] = bits, r[i] = 128;
    qgen_exl2(g, (int32_t)K, (int32_t)N, n_groups, b, r, &rng);
}

typedef struct moe_bytes {
    double attn, router, expert, head; /* a layer's attention and router, one expert (gate, up, down), the head */
} moe_bytes;

static exl_model *build_moe(int32_t n_layers, moe_bytes *mb) {
    exl_model *m = exl_calloc(1, sizeof *m);
    exl_hf_config *c = &m->cfg;
    c->arch = EXL_ARCH_QWEN3_MOE;
    snprintf(c->model_type, sizeof c->model_type, "qwen3_moe");
    c->vocab_size = MOE_V, c->hidden_size = MOE_H, c->intermediate_size = 6144, c->n_layers = n_layers;
    c->n_heads = 32, c->n_kv_heads = 4, c->head_dim = 128, c->max_pos = 40960;
    c->rms_eps = 1e-6;
    c->rope.type = EXL_ROPE_DEFAULT;
    c->rope.theta = 1e6;
    c->rope.factor = 1;
    c->rope.partial_rotary_factor = 1;
    c->rope_sliding = c->rope;
    c->act = EXL_ACT_SILU;
    c->qk_norm = 1;
    c->bos_token_id = 1;
    c->moe = (exl_moe_config){MOE_E, MOE_K, MOE_F, 1, 0, n_layers};
    for (int i = 0; i < n_layers; i++)
        c->layers[i].moe = 1;
    m->rot_dim = 128;
    m->embed_scale = 1;
    EK(exl_backend_init(EXL_DEVICE_CUDA, 0, &m->be));
    exl_backend *be = m->be;
    exl_linear_src es = {0};
    es.kind = EXL_LINEAR_DENSE;
    es.in_features = MOE_H, es.out_features = MOE_V;
    es.dense = (exl_dense_src){EXL_DTYPE_F16, dense_pool};
    es.name = "embed";
    EK(be->ops->linear_init(be, &es, &m->embed));
    es.out_features = MOE_E, es.name = "router";
    uint16_t ones[MOE_H];
    for (int i = 0; i < MOE_H; i++)
        ones[i] = exl_f32_to_f16(0.9f + 0.2f * qg_uniform(&rng));
    exl_dense_src ns = {EXL_DTYPE_F16, ones};
    EK(be->ops->vector_init(be, &ns, MOE_H, 0, &m->final_norm));
    const int bits = exl2_bits;
    enum { Q, KV, O, GU, DOWN, N_SHAPES };
    static const int64_t shape[N_SHAPES][2] = {
        {MOE_H, MOE_Q}, {MOE_H, MOE_KV}, {MOE_Q, MOE_H}, {MOE_H, MOE_F}, {MOE_F, MOE_H}};
    qgen g[N_SHAPES];
    for (int i = 0; i < N_SHAPES; i++)
        exl2_src(&g[i], shape[i][0], shape[i][1], bits);
    m->layers = exl_calloc((size_t)n_layers, sizeof *m->layers);
    for (int i = 0; i < n_layers; i++) {
        exl_layer *l = &m->layers[i];
        EK(be->ops->vector_init(be, &ns, MOE_H, 0, &l->attn_norm));
        EK(be->ops->vector_init(be, &ns, MOE_H, 0, &l->mlp_norm));
        EK(be->ops->vector_init(be, &ns, 128, 0, &l->q_norm));
        EK(be->ops->vector_init(be, &ns, 128, 0, &l->k_norm));
        EK(be->ops->linear_init(be, &g[Q].src, &l->q));
        EK(be->ops->linear_init(be, &g[KV].src, &l->k));
        EK(be->ops->linear_init(be, &g[KV].src, &l->v));
        EK(be->ops->linear_init(be, &g[O].src, &l->o));
        EK(be->ops->linear_init(be, &es, &l->router));
        l->experts = exl_calloc(MOE_E, sizeof *l->experts);
        for (int e = 0; e < MOE_E; e++) {
            EK(be->ops->linear_init(be, &g[GU].src, &l->experts[e].gate));
            EK(be->ops->linear_init(be, &g[GU].src, &l->experts[e].up));
            EK(be->ops->linear_init(be, &g[DOWN].src, &l->experts[e].down));
        }
    }
    for (int i = 0; i < N_SHAPES; i++)
        qgen_free(&g[i]);
    exl2_src(&g[0], MOE_H, MOE_V, 6);
    EK(be->ops->linear_init(be, &g[0].src, &m->head));
    qgen_free(&g[0]);
    mb->attn = exl2_file_bytes(MOE_H, MOE_Q, bits) + 2 * exl2_file_bytes(MOE_H, MOE_KV, bits) +
               exl2_file_bytes(MOE_Q, MOE_H, bits);
    mb->router = (double)MOE_H * MOE_E * 2;
    mb->expert = 2 * exl2_file_bytes(MOE_H, MOE_F, bits) + exl2_file_bytes(MOE_F, MOE_H, bits);
    mb->head = exl2_file_bytes(MOE_H, MOE_V, 6);
    EK(exl_model_alloc_forward(m));
    return m;
}

/* Greedy decode of n_seqs sequences a step, each step's tokens chosen on the device and fed to the next (as
 * decode_ahead_speed), after a prompt of ctx tokens each; generated tokens/s over all sequences. */
static double decode_ahead_batch(exl_model *m, exl_kv_cache *cache, int32_t n_seqs, int32_t ctx, float *logits) {
    enum { WARM = 4, STEPS = 64, MAX_SEQS = 64, MAX_CTX = 128 };
    int32_t pages[MAX_SEQS], ids[MAX_SEQS * MAX_CTX], tok[MAX_SEQS];
    exl_seq_step st[MAX_SEQS];
    memset(st, 0, sizeof st); /* the compiler cannot tell n_seqs > 0 */
    int64_t t[WARM + STEPS + 1];
    for (int i = 0; i < ctx * n_seqs && i < MAX_SEQS * MAX_CTX; i++)
        ids[i] = (int32_t)(qg_next(&rng) % 32000);
    for (int32_t s = 0; s < n_seqs; s++) {
        pages[s] = s;
        st[s] = (exl_seq_step){ids + (int64_t)s * ctx, ctx, 0, &pages[s], 1, 1};
    }
    const int32_t per_step = exl_model_max_rows(m) / ctx > 0 ? exl_model_max_rows(m) / ctx : 1; /* prompts a step */
    for (int32_t s = 0; s < n_seqs; s += per_step)
        EK(exl_model_forward(m, cache, st + s, n_seqs - s < per_step ? n_seqs - s : per_step, logits));
    for (int32_t s = 0; s < n_seqs; s++)
        st[s] = (exl_seq_step){ids + s, 1, ctx, &pages[s], 1, 1};
    EK(exl_model_forward_argmax(m, cache, st, n_seqs, &t[0]));
    double t0 = 0;
    for (int i = 1; i <= WARM + STEPS; i++) {
        for (int32_t s = 0; s < n_seqs; s++)
            st[s] = (exl_seq_step){NULL, 1, ctx + i, &pages[s], 1, 1};
        EK(exl_model_forward_argmax(m, cache, st, n_seqs, &t[i]));
        EK(exl_model_argmax_wait(m, t[i - 1], tok, n_seqs));
        if (i == WARM)
            t0 = now();
    }
    EK(exl_model_argmax_wait(m, t[WARM + STEPS], tok, n_seqs));
    return (double)n_seqs * (STEPS + 1) / (now() - t0);
}

/* The time of a step that verifies `rows` tokens of one sequence after a prompt of ctx tokens (speculative decoding's
 * target pass: rows at consecutive positions, every row's logits to the host), each step from the same position (as
 * after a rejection of every draft token); microseconds a step. */
static double verify_step_us(exl_model *m, exl_kv_cache *cache, int32_t *pages, int32_t n_pages, int32_t ctx,
                             int32_t rows, float *logits) {
    enum { WARM = 4, STEPS = 32 };
    int32_t ids[256];
    for (int i = 0; i < 256; i++)
        ids[i] = (int32_t)(qg_next(&rng) % 32000);
    for (int32_t done = 0; done < ctx; done += 256) { /* the context, in pieces of 256 tokens */
        exl_seq_step st = {ids, ctx - done < 256 ? ctx - done : 256, done, pages, n_pages, 0};
        EK(exl_model_forward(m, cache, &st, 1, NULL));
    }
    double t0 = 0;
    for (int i = 0; i < WARM + STEPS; i++) {
        if (i == WARM)
            t0 = now();
        exl_seq_step st = {ids, rows, ctx, pages, n_pages, 2};
        EK(exl_model_forward(m, cache, &st, 1, logits));
    }
    return (now() - t0) / STEPS * 1e6;
}

/* the expected number of distinct experts a step of `tokens` tokens reads, each choosing MOE_K of MOE_E at random */
static double moe_active(int tokens) {
    double none = 1;
    for (int i = 0; i < tokens; i++)
        none *= 1.0 - (double)MOE_K / MOE_E;
    return MOE_E * (1 - none);
}

static void moe_bench(int32_t n_layers, double bw, double tflops, float *logits) {
    moe_bytes mb;
    double t0 = now();
    exl_model *m = build_moe(n_layers, &mb);
    const double load_s = now() - t0;
    int32_t n_pages = 16, pages[16];
    for (int i = 0; i < n_pages; i++)
        pages[i] = i;
    exl_kv_cache *cache;
    EK(exl_kv_cache_init(m, n_pages, 256, 16, 16, &cache));
    const double d128 = decode_speed(m, cache, pages, n_pages, 128, logits);
    const double a128 = decode_ahead_speed(m, cache, pages, n_pages, 132);
    const double pre = prefill_speed(m, cache, pages, n_pages, logits, 2048);
    const double b16 = decode_ahead_batch(m, cache, 16, 128, logits);
    /* bytes a step reads: every layer's attention and router, the experts its tokens chose, the head */
    const double step1 = n_layers * (mb.attn + mb.router + MOE_K * mb.expert) + mb.head;
    const double step16 = n_layers * (mb.attn + mb.router + moe_active(16) * mb.expert) + mb.head;
    const double bound1 = bw / step1, bound16 = 16 * bw / step16;
    /* prefill: 2 flops a weight a token, of the active ones (attention, router, 8 experts, head) */
    const double active = n_layers *
                              ((double)MOE_H * (MOE_Q * 2 + MOE_KV * 2) + MOE_H * MOE_E + MOE_K * 3.0 * MOE_H * MOE_F) +
                          (double)MOE_H * MOE_V;
    const char *md = getenv("EXL_CUDA_MOE_DEVICE"), *gr = getenv("EXL_CUDA_GRAPHS");
    const char *label = md && !strcmp(md, "0")   ? "routes on the host"
                        : gr && !strcmp(gr, "0") ? "device, no CUDA graphs"
                                                 : "device, CUDA graphs";
    printf("\n| MoE (Qwen3-30B-A3B shape), %d layers, EXL2 %d-bit, head 6 | GB/token batch 1 | decode t/s ctx 128 | "
           "greedy ahead ctx 128 | bound t/s | greedy ahead of bound | batch 16 GB/step | batch 16 t/s | bound t/s | "
           "of bound | prefill 2048 t/s | of tensor-core bound |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n",
           n_layers, exl2_bits);
    printf("| %s | %.3f | %.1f | %.1f | %.0f | %.1f%% | %.3f | %.1f | %.0f | %.1f%% | %.0f | %.1f%% |\n", label,
           step1 / 1e9, d128, a128, bound1, 100 * a128 / bound1, step16 / 1e9, b16, bound16, 100 * b16 / bound16, pre,
           100 * pre / (tflops / (2 * active)));
    fprintf(stderr,
            "moe: load %.1f s; a token reads %.1f MB of attention, %.1f MB of routers, %.1f MB of experts (%d of %d a "
            "layer), %.1f MB of head; a 16-token step %.1f experts a layer on average\n",
            load_s, n_layers * mb.attn / 1e6, n_layers * mb.router / 1e6, n_layers * MOE_K * mb.expert / 1e6, MOE_K,
            MOE_E, mb.head / 1e6, moe_active(16));
    exl_kv_cache_free(m, cache);
    exl_model_free(m);
}

/* ---- the sample op: top-p 0.95 at temperature 0.8 (the server's common setting) on rows of near-Gaussian logits
 * (sd ~1.3, as the random-weight models' heads give), against greedy argmax on the same rows. "queued": back to back
 * through sample_queue / argmax, the last one waited for (the device's time when that exceeds the host's launch
 * cost); "a call": the synchronous op (copies in and out, a wait) */

static double sample_queued_us(exl_backend *be, int32_t *ids, float *logits, int32_t rows, int32_t vocab,
                               const exl_sample_params *params, int greedy, int reps) {
    exl_sample_result res[EXL_ARGMAX_ROWS];
    int32_t host_ids[EXL_ARGMAX_ROWS];
    int64_t ticket = -1;
    double t0 = now();
    for (int i = 0; i < reps; i++) {
        ticket = greedy ? be->ops->argmax(be, ids, logits, rows, vocab)
                        : be->ops->sample_queue(be, ids, logits, rows, vocab, params, NULL, 0, 0);
        if (ticket < 0) {
            fprintf(stderr, "sample bench: %s\n", exl_last_error());
            exit(1);
        }
    }
    EK(greedy ? be->ops->argmax_wait(be, ticket, host_ids, rows) : be->ops->sample_wait(be, ticket, res, rows));
    return (now() - t0) / reps * 1e6;
}

static void sample_bench(void) {
    exl_backend *be;
    EK(exl_backend_init(EXL_DEVICE_CUDA, 0, &be));
    const size_t n = (size_t)EXL_ARGMAX_ROWS * 32000 > 128256 ? (size_t)EXL_ARGMAX_ROWS * 32000 : 128256;
    float *h = malloc(n * sizeof *h);
    for (size_t i = 0; i < n; i++)
        h[i] = (qg_uniform(&rng) + qg_uniform(&rng) + qg_uniform(&rng) + qg_uniform(&rng) - 2.0f) * 2.25f;
    float *logits = be->ops->alloc(be, n * sizeof *h);
    int32_t *ids = be->ops->alloc(be, EXL_ARGMAX_ROWS * sizeof *ids);
    if (!logits || !ids) {
        fprintf(stderr, "sample bench: %s\n", exl_last_error());
        exit(1);
    }
    EK(be->ops->upload(be, logits, h, n * sizeof *h));
    exl_sample_params params[EXL_ARGMAX_ROWS];
    for (int r = 0; r < EXL_ARGMAX_ROWS; r++)
        params[r] = (exl_sample_params){
            .temperature = 0.8f, .top_p = 0.95f, .typical_p = 1, .repetition_penalty = 1, .u = qg_uniform(&rng)};
    const struct { int32_t rows, vocab; } cases[] = {{1, 32000}, {16, 32000}, {64, 32000}, {1, 128256}};
    enum { REPS = 200 };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int32_t rows = cases[c].rows, vocab = cases[c].vocab;
        exl_sample_result res[EXL_ARGMAX_ROWS];
        sample_queued_us(be, ids, logits, rows, vocab, params, 0, 10); /* warm up */
        sample_queued_us(be, ids, logits, rows, vocab, params, 1, 10);
        double t0 = now();
        for (int i = 0; i < REPS; i++)
            EK(be->ops->sample(be, res, logits, rows, vocab, params, NULL, 0));
        double call_us = (now() - t0) / REPS * 1e6;
        double queued_us = sample_queued_us(be, ids, logits, rows, vocab, params, 0, REPS);
        double greedy_us = sample_queued_us(be, ids, logits, rows, vocab, params, 1, REPS);
        printf("sample op: %d x %d, top-p 0.95 t 0.8: %.1f us queued, %.1f us a call; greedy argmax %.1f us queued\n",
               rows, vocab, queued_us, call_us, greedy_us);
    }
    /* the other settings the server accepts, queued, on 1 and 64 rows of 32000 */
    const struct {
        const char *name;
        float temperature, top_p, min_p, typical_p;
        int32_t top_k;
    } settings[] = {{"t 0.8 alone", 0.8f, 1, 0, 1, 0},
                    {"top-k 50", 0.8f, 1, 0, 1, 50},
                    {"min-p 0.05", 0.8f, 1, 0.05f, 1, 0},
                    {"top-k 40 + top-p 0.9 + min-p 0.05", 0.8f, 0.9f, 0.05f, 1, 40},
                    {"typical 0.9", 0.8f, 1, 0, 0.9f, 0},
                    {"top-p 0.95 + typical 0.9", 0.8f, 0.95f, 0, 0.9f, 0}};
    for (int32_t rows = 1; rows <= EXL_ARGMAX_ROWS; rows += EXL_ARGMAX_ROWS - 1) {
        printf("sample op: %d x 32000, other settings, us queued:", rows);
        for (size_t k = 0; k < sizeof settings / sizeof settings[0]; k++) {
            exl_sample_params sp[EXL_ARGMAX_ROWS];
            for (int32_t r = 0; r < rows; r++)
                sp[r] = (exl_sample_params){.temperature = settings[k].temperature,
                                            .top_k = settings[k].top_k,
                                            .top_p = settings[k].top_p,
                                            .min_p = settings[k].min_p,
                                            .typical_p = settings[k].typical_p,
                                            .repetition_penalty = 1,
                                            .u = params[r].u};
            sample_queued_us(be, ids, logits, rows, 32000, sp, 0, 10);
            printf("%s %s %.1f", k ? "," : "", settings[k].name,
                   sample_queued_us(be, ids, logits, rows, 32000, sp, 0, REPS));
        }
        printf("\n");
    }
    fflush(stdout);
    be->ops->free(be, logits);
    be->ops->free(be, ids);
    be->ops->destroy(be);
    free(h);
}

int main(int argc, char **argv) {
    const char *kinds[8];
    int n_kinds = 0, n_layers = 0; /* 0: the shape's own (32, or 48 for moe) */
    int profile = 0, prefill_only = 0, kernels_only = 0, sample_only = 0, header = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            n_layers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--bits") && i + 1 < argc)
            exl2_bits = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--profile"))
            profile = 1;
        else if (!strcmp(argv[i], "--prefill-only"))
            prefill_only = 1;
        else if (!strcmp(argv[i], "--kernels-only"))
            kernels_only = 1;
        else if (!strcmp(argv[i], "--sample-only"))
            sample_only = 1;
        else if (n_kinds < 8)
            kinds[n_kinds++] = argv[i];
    }
    if (exl2_bits < 2 || exl2_bits > 8 || exl2_bits == 7) {
        fprintf(stderr, "gpu_bench: --bits must be 2, 3, 4, 5, 6 or 8\n");
        return 2;
    }
    if (!n_kinds)
        kinds[0] = "exl2", kinds[1] = "gptq", kinds[2] = "fp16", kinds[3] = "exl2-8b", n_kinds = 4;
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    if (sample_only) {
        printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
        sample_bench();
        return 0;
    }
    double bw = copy_bandwidth(), tflops = gemm_rate();
    printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
    printf("copy bandwidth (device-to-device, read+write): %.0f GB/s\n", bw / 1e9);
    printf("fp16 GEMM 8192^3 (cuBLAS, fp32 accumulate): %.0f TFLOP/s\n", tflops / 1e12);
    if (!profile && !prefill_only && !kernels_only)
        sample_bench();
    dense_pool_n = (size_t)128256 * 4096; /* the largest embedding table */
    dense_pool = malloc(dense_pool_n * 2);
    for (size_t i = 0; i < dense_pool_n; i++)
        dense_pool[i] = exl_f32_to_f16((qg_uniform(&rng) - 0.5f) * 0.04f);
    float *logits = malloc((size_t)256 * 128256 * 4);
    const char *exact = getenv("EXL_CUDA_EXACT_PREFILL");
    printf("prompt matmuls: %s\n", exact && strcmp(exact, "0") ? "~22 bits (EXL_CUDA_EXACT_PREFILL=1)" : "fp16");
    for (int k = 0; k < n_kinds; k++) {
        if (!strcmp(kinds[k], "moe")) {
            moe_bench(n_layers ? n_layers : 48, bw, tflops, logits);
            continue;
        }
        if (!header++)
            printf("\n| model | GB/token (file) | decode t/s ctx 128 | ctx 2048 | greedy ahead ctx 128 | ctx 2048 | "
                   "bound t/s | of bound (128) | greedy ahead of bound (128) | prefill 512 t/s | 2048 | 8192 | 2048 of "
                   "tensor-core bound (GEMM rate) | (990 TFLOP/s) |\n"
                   "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        model_info mi;
        double t0 = now();
        const int32_t layers = n_layers ? n_layers : 32;
        exl_model *m = build_model(kinds[k], layers, &mi);
        double load_s = now() - t0;
        int32_t n_pages = 33, pages[33]; /* 8192 tokens and a page */
        for (int i = 0; i < n_pages; i++)
            pages[i] = i;
        exl_kv_cache *cache;
        EK(exl_kv_cache_init(m, n_pages, 256, 16, 16, &cache));
        if (profile) { /* a 128-token prompt and 3 decode steps, for a profiler */
            int32_t ids[128] = {0};
            exl_seq_step st = {ids, 128, 0, pages, n_pages, 1};
            EK(exl_model_forward(m, cache, &st, 1, logits));
            for (int i = 0; i < 3; i++) {
                exl_seq_step d = {ids + i, 1, 128 + i, pages, n_pages, 1};
                EK(exl_model_forward(m, cache, &d, 1, logits));
            }
            return 0;
        }
        double d128 = 0, d2048 = 0, a128 = 0, a2048 = 0;
        if (!prefill_only && !kernels_only) {
            d128 = decode_speed(m, cache, pages, n_pages, 128, logits);
            d2048 = decode_speed(m, cache, pages, n_pages, 2048, logits);
            a128 = decode_ahead_speed(m, cache, pages, n_pages, 132);
            a2048 = decode_ahead_speed(m, cache, pages, n_pages, 2052);
        }
        double pre512 = 0, pre = 0, pre8k = 0;
        if (!kernels_only) {
            pre512 = prefill_speed(m, cache, pages, n_pages, logits, 512);
            pre = prefill_speed(m, cache, pages, n_pages, logits, 2048);
            pre8k = prefill_speed(m, cache, pages, n_pages, logits, 8192);
        }
        double bound = bw / mi.file_bytes;
        const exl_hf_config *c = &m->cfg;
        double kvw = (double)c->n_kv_heads * c->head_dim;
        double params = layers * (2.0 * 4096 * 4096 + 2.0 * 4096 * kvw + 3.0 * 4096 * c->intermediate_size) +
                        4096.0 * c->vocab_size;
        /* the matmuls' FLOPs only (attention not counted) */
        double pre_bound = tflops / (2 * params), pre_bound_990 = 990e12 / (2 * params);
        printf("| %s, %d layers | %.2f | %.1f | %.1f | %.1f | %.1f | %.0f | %.1f%% | %.1f%% | %.0f | %.0f | %.0f | "
               "%.1f%% | %.1f%% |\n",
               kinds[k], layers, mi.file_bytes / 1e9, d128, d2048, a128, a2048, bound, 100 * d128 / bound,
               100 * a128 / bound, pre512, pre, pre8k, 100 * pre / pre_bound, 100 * pre / pre_bound_990);
        fflush(stdout);
        if (prefill_only) {
            exl_kv_cache_free(m, cache);
            exl_model_free(m);
            continue;
        }
        fprintf(stderr, "%s: load %.1f s, device bytes/token %.2f GB\n", kinds[k], load_s, mi.device_bytes / 1e9);
        /* per-shape GEMV efficiency (one op, back to back, no forward overhead) */
        struct {
            const char *name;
            const exl_linear *w;
            int64_t K, N;
        } shapes[4] = {{"q_proj 4096x4096", m->layers[0].q, 4096, 4096},
                       {"gate_proj 4096x11008", m->layers[0].gate, 4096, 11008},
                       {"down_proj 11008x4096", m->layers[0].down, 11008, 4096},
                       {"head 4096x32000", m->head, 4096, 32000}};
        for (int s = 0; s < (is_8b(kinds[k]) ? 0 : 4); s++) {
            double us = matmul_us(m, shapes[s].w, shapes[s].K, shapes[s].N, 1, 0);
            int head = s == 3;
            const char *kk = head && strcmp(kinds[k], "exl2") ? "fp16" : kinds[k];
            /* bytes of that one matrix, as streamed by the kernel */
            double bytes;
            if (!strcmp(kk, "fp16"))
                bytes = shapes[s].K * shapes[s].N * 2.0;
            else if (!strcmp(kk, "exl2"))
                bytes = shapes[s].K * shapes[s].N * (head ? 6 : 4) / 8.0 + shapes[s].K / 128 * shapes[s].N * 2.0;
            else
                bytes = shapes[s].K * shapes[s].N / 2.0 + shapes[s].K / 128 * shapes[s].N * 4.0;
            fprintf(stderr, "  %-22s %8.1f us  %6.0f GB/s  (%.0f%% of copy)", shapes[s].name, us, bytes / us / 1e3,
                    100 * bytes / (us * 1e-6) / bw);
            /* prompt rows (prefill chunks): time and tensor-core rate */
            const int32_t many[5] = {16, 32, 64, 256, 1024};
            for (int i = 0; i < (getenv("GPU_BENCH_REPS") ? 0 : 5); i++) {
                int32_t rows = many[i];
                double t = matmul_us(m, shapes[s].w, shapes[s].K, shapes[s].N, rows, 0);
                fprintf(stderr, "  | %d rows %.1f us %.0f TFLOP/s", rows, t,
                        2.0 * rows * shapes[s].K * shapes[s].N / t / 1e6);
            }
            /* decode rows (batched decode, speculative verification): the weights are read once for all of them */
            fprintf(stderr, "\n  %-22s as decode rows:", "");
            const int32_t dec[8] = {1, 2, 4, 5, 8, 16, 32, 64};
            double one = 0;
            for (int i = 0; i < 8; i++) {
                double t = matmul_us(m, shapes[s].w, shapes[s].K, shapes[s].N, dec[i], 1);
                one = i == 0 ? t : one;
                fprintf(stderr, "  | %d: %.1f us %.0f GB/s %.2fx", dec[i], t, bytes / t / 1e3, t / one);
            }
            fprintf(stderr, "\n");
        }
        /* whole decode steps of 1-16 rows, ctx 128: n sequences a step (the generator's batches; greedy, tokens
         * chosen on the device) and one sequence's K + 1 tokens (speculative decoding's verification step) */
        if (!is_8b(kinds[k])) {
            const int32_t seqs[6] = {1, 2, 4, 8, 16, 32}, verify[7] = {1, 2, 3, 5, 8, 9, 16};
            double one = 0;
            fprintf(stderr, "  %s decode steps of n sequences, ctx 128:", kinds[k]);
            for (int i = 0; i < 6; i++) {
                const double tps = decode_ahead_batch(m, cache, seqs[i], 128, logits);
                one = i == 0 ? tps : one;
                fprintf(stderr, "  | %d: %.1f t/s %.3f ms/step %.2fx", seqs[i], tps, 1e3 * seqs[i] / tps,
                        one * seqs[i] / tps);
            }
            /* captured as decode steps (cuda_internal.h: EXL_CUDA_VERIFY_MAX_Q), the same K + 1 replaying */
            const int32_t vctx[2] = {128, 2048};
            for (int v = 0; v < 2; v++) {
                fprintf(stderr, "\n  %s verification steps of one sequence, K + 1 rows, ctx %d:", kinds[k], vctx[v]);
                for (int i = 0; i < 7; i++) {
                    const double us = verify_step_us(m, cache, pages, n_pages, vctx[v], verify[i], logits);
                    one = i == 0 ? us : one;
                    fprintf(stderr, "  | %d: %.1f us %.2fx", verify[i], us, us / one);
                }
            }
            fprintf(stderr, "\n");
        }
        exl_kv_cache_free(m, cache);
        exl_model_free(m);
    }
    return 0;
}
