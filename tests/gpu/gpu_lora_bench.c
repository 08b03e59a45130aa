/* gpu_lora_bench.c - what LoRA adapters cost the CUDA decode: a random-weight model of Llama-2-7B's shape (EXL2,
 * 4-bit layers, 6-bit head, as gpu_bench's) decoded greedily as the generator does (each step's token chosen on the
 * device and fed to the next, queued ahead), with random rank-R adapters on all seven projections of every layer:
 *   batch 1:  no adapter, then one adapter (the model's set);
 *   batch 32: 32 sequences with no adapter, then spread over 4 adapters (sequence i uses adapter i % 4), all in
 *             the same steps (the gathered lora op);
 * each case through every path the environment selects (the variants below: the default first, then each other one
 * with its variables set and every cached CUDA graph dropped, so that the steps are compiled and captured anew):
 *   default            one-row steps: the updates folded into the GEMV launch (cuda_lora_fold.cuh: side blocks where
 *                      its blocks add atomically, every 7B GEMV but layer 0's q/k/v; else the in-block fold), no lora
 *                      launch; 32 uses: the batch path (cuda_lora_batch.cu), each group's shrink on a second stream
 *                      beside the matmul it goes with, the expand after it (cuda_lora_overlap.cu, r2-lora6);
 *   overlap 0          EXL_CUDA_LORA_OVERLAP=0: the batch path's shrink after the matmul, on the same stream;
 *   launches           EXL_CUDA_LORA_GEMV=0 EXL_CUDA_LORA_BATCH=0 (r2-lora2's paths): one row: the fused lora launch,
 *                      one a group; 32 uses: shrink and expand a use at a time, two launches a group.
 * Prints a markdown table: tokens/s without and with adapters, and their ratio; then the logits of one step through
 * the default paths and the overlap modes against the launches' (at this model's shapes, which test_gpu's small
 * fixtures do not reach: several runs a dot product, chunks of 8 uses of one adapter).
 *
 * --only32 1: the batch-32 cases alone, through the path the environment selects (none set: the default; e.g.
 * EXL_CUDA_LORA_OVERLAP=0), for a profiler or a quick A/B (no batch 1, no variants, no logits).
 * --only32 2: the batch-32 cases through every variant, and their logits (no batch 1).
 *
 * usage: gpu_lora_bench [--layers N] [--rank R] [--ctx C] [--steps S] [--only32 1|2] */
#include "model/lora.h"
#include "model/model.h"

#include "base/alloc.h"
#include "base/half.h"
#include "quant_gen.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EK(call)                                                                  \
    do {                                                                          \
        if ((call) != EXL_OK) {                                                   \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, exl_last_error()); \
            exit(1);                                                              \
        }                                                                         \
    } while (0)

enum { H = 4096, F = 11008, V = 32000, BATCH = 32, N_ADAPTERS = 4, WARM = 4, STEPS = 64 };

static uint64_t rng = 0x5eed1ab5c0ffee11ull;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* ---- the model */

static uint16_t *dense_pool; /* random fp16 values for the embedding table */

static void exl2_linear(exl_model *m, int bits, int64_t K, int64_t N, exl_linear **out) {
    int n_groups = (int)(K / 128), b[256], r[256];
    for (int i = 0; i < n_groups; i++)
        b[i] = bits, r[i] = 128;
    qgen g;
    memset(&g, 0, sizeof g);
    qgen_exl2(&g, (int32_t)K, (int32_t)N, n_groups, b, r, &rng);
    EK(m->be->ops->linear_init(m->be, &g.src, out));
    qgen_free(&g);
}

static exl_model *build_model(int32_t n_layers) {
    exl_model *m = exl_calloc(1, sizeof *m);
    exl_hf_config *c = &m->cfg;
    c->arch = EXL_ARCH_LLAMA;
    snprintf(c->model_type, sizeof c->model_type, "llama");
    c->vocab_size = V, c->hidden_size = H, c->intermediate_size = F, c->n_layers = n_layers;
    c->n_heads = 32, c->n_kv_heads = 32, c->head_dim = 128, c->max_pos = 4096;
    c->rms_eps = 1e-5;
    c->rope.type = EXL_ROPE_DEFAULT;
    c->rope.theta = 10000;
    c->rope.factor = 1;
    c->rope.partial_rotary_factor = 1;
    c->act = EXL_ACT_SILU;
    c->bos_token_id = 1;
    m->rot_dim = 128;
    m->embed_scale = 1;
    EK(exl_backend_init(EXL_DEVICE_CUDA, 0, &m->be));
    dense_pool = malloc((size_t)V * H * 2);
    for (size_t i = 0; i < (size_t)V * H; i++)
        dense_pool[i] = exl_f32_to_f16((qg_uniform(&rng) - 0.5f) * 0.04f);
    exl_linear_src es = {.kind = EXL_LINEAR_DENSE, .in_features = H, .out_features = V, .name = "embed"};
    es.dense = (exl_dense_src){EXL_DTYPE_F16, dense_pool};
    EK(m->be->ops->linear_init(m->be, &es, &m->embed));
    uint16_t ones[H];
    for (int i = 0; i < H; i++)
        ones[i] = exl_f32_to_f16(0.9f + 0.2f * qg_uniform(&rng));
    exl_dense_src ns = {EXL_DTYPE_F16, ones};
    EK(m->be->ops->vector_init(m->be, &ns, H, 0, &m->final_norm));
    m->layers = exl_calloc((size_t)n_layers, sizeof *m->layers);
    for (int i = 0; i < n_layers; i++) {
        exl_layer *l = &m->layers[i];
        EK(m->be->ops->vector_init(m->be, &ns, H, 0, &l->attn_norm));
        EK(m->be->ops->vector_init(m->be, &ns, H, 0, &l->mlp_norm));
        exl2_linear(m, 4, H, H, &l->q);
        exl2_linear(m, 4, H, H, &l->k);
        exl2_linear(m, 4, H, H, &l->v);
        exl2_linear(m, 4, H, H, &l->o);
        exl2_linear(m, 4, H, F, &l->gate);
        exl2_linear(m, 4, H, F, &l->up);
        exl2_linear(m, 4, F, H, &l->down);
    }
    exl2_linear(m, 6, H, V, &m->head);
    EK(exl_model_alloc_forward(m));
    return m;
}

/* a random adapter of rank r on q, k, v, o, gate, up and down of every layer (exl_lora_install) */
static exl_lora *random_adapter(exl_model *m, int32_t r, int k) {
    static const exl_lora_proj projs[7] = {EXL_LORA_Q,    EXL_LORA_K,  EXL_LORA_V,   EXL_LORA_O,
                                           EXL_LORA_GATE, EXL_LORA_UP, EXL_LORA_DOWN};
    static const int32_t ins[7] = {H, H, H, H, H, H, F}, outs[7] = {H, H, H, H, F, F, H};
    const int32_t n = m->cfg.n_layers * EXL_LORA_N_PROJ;
    exl_lora *lo = exl_calloc(1, sizeof *lo);
    char name[32];
    snprintf(name, sizeof name, "random-r%d-%d", (int)r, k);
    lo->m = m;
    lo->dir = exl_strdup(name);
    lo->rank = exl_calloc((size_t)n, sizeof *lo->rank);
    lo->in = exl_calloc((size_t)n, sizeof *lo->in);
    lo->at = exl_calloc((size_t)n, sizeof *lo->at);
    size_t floats = 0;
    for (int32_t li = 0; li < m->cfg.n_layers; li++)
        for (int p = 0; p < 7; p++) {
            int32_t i = li * EXL_LORA_N_PROJ + projs[p];
            lo->rank[i] = r, lo->in[i] = ins[p], lo->at[i] = floats;
            floats += (size_t)r * (size_t)(ins[p] + outs[p]);
        }
    float *host = malloc(floats * sizeof *host);
    for (size_t i = 0; i < floats; i++)
        host[i] = (qg_uniform(&rng) - 0.5f) * 0.02f;
    exl_lora *out;
    EK(exl_lora_install(lo, host, floats, &out));
    free(host);
    return out;
}

/* ---- timing */

static int steps = STEPS; /* timed steps (--steps: fewer for a profiler) */

/* n sequences (pages[i] each), ctx tokens of prompt in the cache, then `steps` greedy steps fed on the device;
 * sets: each sequence's adapters (NULL: the model's set). Tokens/s over all sequences. */
static double decode_rate(exl_model *m, exl_kv_cache *cache, const int32_t *pages, int32_t n, int32_t ctx,
                          const exl_lora_set *const *sets) {
    exl_seq_step st[BATCH];
    int32_t ids[BATCH], toks[BATCH];
    int64_t t[WARM + STEPS + 1];
    for (int32_t i = 0; i < n; i++) {
        ids[i] = 100 + i;
        st[i] = (exl_seq_step){
            .ids = &ids[i], .n_new = 1, .n_past = ctx, .pages = &pages[i], .n_pages = 1, .want_logits = 1};
    }
    exl_lora_step_sets(m, sets, sets ? n : 0);
    EK(exl_model_forward_argmax(m, cache, st, n, &t[0]));
    double t0 = 0;
    for (int s = 1; s <= WARM + steps; s++) {
        for (int32_t i = 0; i < n; i++)
            st[i].ids = NULL, st[i].n_past = ctx + s;
        exl_lora_step_sets(m, sets, sets ? n : 0);
        EK(exl_model_forward_argmax(m, cache, st, n, &t[s]));
        EK(exl_model_argmax_wait(m, t[s - 1], toks, n));
        if (s == WARM)
            t0 = now();
    }
    EK(exl_model_argmax_wait(m, t[WARM + steps], toks, n));
    return (double)n * (steps + 1) / (now() - t0);
}

/* every cached CUDA graph dropped (a buffer freed does it), so that the next steps are compiled anew */
static void fresh_graphs(exl_model *m) {
    void *p = m->be->ops->alloc(m->be, 256);
    if (p)
        m->be->ops->free(m->be, p);
}

/* the paths compared: environment variables set for each (NULL: none) */
typedef struct variant {
    const char *name;
    const char *env[3][2];
} variant;

static const variant variants[] = {
    {"default", {{NULL, NULL}}},
    {"EXL_CUDA_LORA_OVERLAP=0 (batch path, shrink after the matmul)", {{"EXL_CUDA_LORA_OVERLAP", "0"}}},
    {"EXL_CUDA_LORA_GEMV=0 EXL_CUDA_LORA_BATCH=0 (lora launches, r2-lora2)",
     {{"EXL_CUDA_LORA_GEMV", "0"}, {"EXL_CUDA_LORA_BATCH", "0"}}},
};

/* the largest difference of one step's logits (n sequences at position ctx, each with its set: NULL the model's)
 * between the default paths with variable var set to val (var NULL: none) and the lora launches
 * (EXL_CUDA_LORA_GEMV=0 EXL_CUDA_LORA_BATCH=0), relative to the largest logit; *argmax_diff: the sequences whose
 * argmax differs */
static double paths_differ(exl_model *m, exl_kv_cache *cache, const int32_t *pages, int32_t n, int32_t ctx,
                           const exl_lora_set *const *sets, const char *var, const char *val, int *argmax_diff) {
    float *lg[2];
    exl_seq_step st[BATCH];
    int32_t ids[BATCH];
    for (int k = 0; k < 2; k++) {
        if (k == 0)
            setenv("EXL_CUDA_LORA_GEMV", "0", 1), setenv("EXL_CUDA_LORA_BATCH", "0", 1);
        else if (var)
            setenv(var, val, 1);
        fresh_graphs(m);
        for (int32_t i = 0; i < n; i++) {
            ids[i] = 100 + i;
            st[i] = (exl_seq_step){
                .ids = &ids[i], .n_new = 1, .n_past = ctx, .pages = &pages[i], .n_pages = 1, .want_logits = 1};
        }
        lg[k] = malloc((size_t)n * V * sizeof(float));
        exl_lora_step_sets(m, sets, sets ? n : 0);
        EK(exl_model_forward(m, cache, st, n, lg[k]));
        unsetenv("EXL_CUDA_LORA_GEMV"), unsetenv("EXL_CUDA_LORA_BATCH");
        if (var)
            unsetenv(var);
    }
    double worst = 0, top = 0;
    *argmax_diff = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t a0 = 0, a1 = 0;
        for (int32_t v = 0; v < V; v++) {
            const float x = lg[0][(int64_t)i * V + v], y = lg[1][(int64_t)i * V + v];
            worst = fabs(x - y) > worst ? fabs(x - y) : worst;
            top = fabs(x) > top ? fabs(x) : top;
            a0 = x > lg[0][(int64_t)i * V + a0] ? v : a0;
            a1 = y > lg[1][(int64_t)i * V + a1] ? v : a1;
        }
        *argmax_diff += a0 != a1;
    }
    free(lg[0]), free(lg[1]);
    return top > 0 ? worst / top : worst;
}

/* the prompts: ctx tokens in each of n sequences */
static void prefill(exl_model *m, exl_kv_cache *cache, const int32_t *pages, int32_t n, int32_t ctx) {
    int32_t *ids = malloc((size_t)ctx * sizeof *ids);
    float *logits = malloc((size_t)V * sizeof *logits);
    for (int32_t i = 0; i < ctx; i++)
        ids[i] = (int32_t)(qg_next(&rng) % V);
    for (int32_t s = 0; s < n; s++) {
        exl_seq_step st = {.ids = ids, .n_new = ctx, .n_past = 0, .pages = &pages[s], .n_pages = 1, .want_logits = 1};
        EK(exl_model_forward(m, cache, &st, 1, logits));
    }
    free(ids);
    free(logits);
}

int main(int argc, char **argv) {
    int32_t n_layers = 32, rank = 16, ctx = 128, only32 = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--layers"))
            n_layers = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--rank"))
            rank = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--ctx"))
            ctx = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps"))
            steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--only32"))
            only32 = atoi(argv[i + 1]);
    }
    if (n_layers < 1 || rank < 1 || rank > 256 || ctx < 1 || ctx + WARM + STEPS + 2 > 256 || steps < 1 ||
        steps > STEPS) {
        fprintf(stderr, "gpu_lora_bench: --layers >= 1, --rank 1..256, --ctx 1..%d, --steps 1..%d\n",
                256 - WARM - STEPS - 2, STEPS);
        return 2;
    }
    exl_model *m = build_model(n_layers);
    int32_t pages[BATCH];
    for (int i = 0; i < BATCH; i++)
        pages[i] = i;
    exl_kv_cache *cache;
    EK(exl_kv_cache_init(m, BATCH, 256, 16, 16, &cache)); /* a page of 256 tokens a sequence */
    prefill(m, cache, pages, BATCH, ctx);

    double base1 = only32 ? 0 : decode_rate(m, cache, pages, 1, ctx, NULL);
    double base32 = decode_rate(m, cache, pages, BATCH, ctx, NULL);
    exl_lora *adapters[N_ADAPTERS];
    for (int k = 0; k < N_ADAPTERS; k++)
        adapters[k] = random_adapter(m, rank, k);
    exl_lora_use one = {adapters[0], 1.0f};
    exl_lora_set sets[N_ADAPTERS];
    const exl_lora_set *per_seq[BATCH];
    for (int k = 0; k < N_ADAPTERS; k++)
        sets[k] = (exl_lora_set){.uses = {{adapters[k], 1.0f}}, .n = 1};
    for (int i = 0; i < BATCH; i++)
        per_seq[i] = &sets[i % N_ADAPTERS];
    if (only32 == 1) {
        const double lora = decode_rate(m, cache, pages, BATCH, ctx, per_seq);
        static const char *const vars[] = {"EXL_CUDA_LORA_BATCH", "EXL_CUDA_LORA_OVERLAP", "EXL_CUDA_LORA_FUSED_USES",
                                           "EXL_CUDA_DETERMINISTIC"};
        char path[256] = "";
        for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
            const char *v = getenv(vars[i]);
            if (v && *v)
                snprintf(path + strlen(path), sizeof path - strlen(path), "%s%s=%s", *path ? " " : "", vars[i], v);
        }
        printf("batch %d, path %s: no adapter %.1f t/s, %d adapters %.1f t/s, ratio %.3f\n", BATCH,
               *path ? path : "default", base32, N_ADAPTERS, lora, lora / base32);
        return 0;
    }
    enum { N_VARIANTS = sizeof variants / sizeof variants[0] };
    double lora1[N_VARIANTS], lora32[N_VARIANTS];
    for (int v = 0; v < N_VARIANTS; v++) {
        for (int e = 0; e < 3; e++)
            if (variants[v].env[e][0])
                setenv(variants[v].env[e][0], variants[v].env[e][1], 1);
        fresh_graphs(m);
        lora1[v] = 0;
        if (!only32) {
            EK(exl_model_set_lora(m, &one, 1));
            lora1[v] = decode_rate(m, cache, pages, 1, ctx, NULL);
            EK(exl_model_set_lora(m, NULL, 0));
            fresh_graphs(m);
        }
        lora32[v] = decode_rate(m, cache, pages, BATCH, ctx, per_seq);
        for (int e = 0; e < 3; e++)
            if (variants[v].env[e][0])
                unsetenv(variants[v].env[e][0]);
    }
    fresh_graphs(m);
    double again1 = only32 ? 0 : decode_rate(m, cache, pages, 1, ctx, NULL); /* the base again: clocks' drift */
    double again32 = decode_rate(m, cache, pages, BATCH, ctx, NULL);

    printf("| %d layers, EXL2 4-bit, rank-%d adapters on q,k,v,o,gate,up,down, ctx %d | no adapter t/s | "
           "adapters t/s | ratio |\n|---|---|---|---|\n",
           n_layers, rank, ctx);
    for (int v = 0; v < N_VARIANTS; v++) {
        if (!only32)
            printf("| batch 1, one adapter, %s | %.1f | %.1f | %.3f (overhead %.1f%%) |\n", variants[v].name, base1,
                   lora1[v], lora1[v] / base1, 100 * (base1 / lora1[v] - 1));
        printf("| batch %d, %d adapters (sequence i: adapter i %% %d), %s | %.1f | %.1f | %.3f |\n", BATCH, N_ADAPTERS,
               N_ADAPTERS, variants[v].name, base32, lora32[v], lora32[v] / base32);
    }
    printf("(without adapters again, after them: batch 1 %.1f t/s, batch %d %.1f t/s)\n", again1, BATCH, again32);
    int diff1, diff32, diff0;
    if (!only32) {
        EK(exl_model_set_lora(m, &one, 1));
        const double e1 = paths_differ(m, cache, pages, 1, ctx, NULL, NULL, NULL, &diff1);
        EK(exl_model_set_lora(m, NULL, 0));
        printf("logits of one step at batch 1, the default (the fold) against EXL_CUDA_LORA_GEMV=0 "
               "EXL_CUDA_LORA_BATCH=0 (largest difference over the largest logit; argmax differing): %.2e (%d)\n",
               e1, diff1);
    }
    const double e32 = paths_differ(m, cache, pages, BATCH, ctx, per_seq, NULL, NULL, &diff32);
    const double e0 = paths_differ(m, cache, pages, BATCH, ctx, per_seq, "EXL_CUDA_LORA_OVERLAP", "0", &diff0);
    printf("logits of one step at batch %d, the batch path against EXL_CUDA_LORA_GEMV=0 EXL_CUDA_LORA_BATCH=0 (as "
           "above): default (overlap 1) %.2e (%d of %d), EXL_CUDA_LORA_OVERLAP=0 %.2e (%d of %d)\n",
           BATCH, e32, diff32, BATCH, e0, diff0, BATCH);
    return 0;
}
