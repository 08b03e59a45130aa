/* test_layer_forward.c - the forward pass one decoder layer at a time (model.h: exl_model_embed_step,
 * exl_model_layer_forward, exl_model_head_input), which the quantizer runs its calibration through, against the
 * whole forward (exl_model_forward) and Hugging Face's logits, on the CPU:
 *
 *   - the embeddings, each layer and the head's input give the same logits as the whole forward (bit for bit:
 *     the CPU backend has no fused ops) and stay within 1e-4 (relative L2) of transformers' at every stored
 *     position of sequence a;
 *   - the same sequence in two steps (the second through the cache) gives the same hidden states;
 *   - a layer run as its attention block alone, then its MLP block alone, equals the layer;
 *   - the hook sees every linear of every layer in order (q, k, v, o, gate, up, down; the head as layer n_layers),
 *     with the step's rows, and q, k and v the same input. */
#include "model/model.h"
#include "ref_util.h"
#include "test.h"

#include "io/safetensors.h"

#include <stdlib.h>
#include <string.h>

#define MAX_CALLS 64

typedef struct calls {
    int n;
    int32_t layer[MAX_CALLS];
    const exl_linear *w[MAX_CALLS];
    int32_t rows[MAX_CALLS];
    float first[MAX_CALLS]; /* x[0] of each call */
    float *head_in;         /* the head's input rows, copied */
    int64_t hidden;
    const exl_linear *head;
} calls;

static exl_status record(void *user, int32_t layer, const exl_linear *w, const float *x, int32_t rows) {
    calls *c = user;
    if (c->n < MAX_CALLS) {
        c->layer[c->n] = layer;
        c->w[c->n] = w;
        c->rows[c->n] = rows;
        c->first[c->n] = x[0];
        c->n++;
    }
    if (w == c->head && c->head_in)
        memcpy(c->head_in, x, (size_t)rows * (size_t)c->hidden * sizeof(float)); /* the CPU: host memory */
    return EXL_OK;
}

/* The layers of m over the step `st` (hidden states in m->fs.x), through `cache`. */
static int run_layers(exl_model *m, exl_kv_cache *cache, const exl_seq_step *st, calls *c) {
    for (int32_t l = 0; l < m->cfg.n_layers; l++)
        if (exl_model_layer_forward(m, &m->layers[l], l, cache, st, 1, c ? record : NULL, c) != EXL_OK)
            return 0;
    return 1;
}

static void check_model(const char *name) {
    char dir[1024], ref_path[1024], nm[256];
    snprintf(dir, sizeof dir, "%s", exl_test_shared(name));
    snprintf(nm, sizeof nm, "reference/%s.logits.safetensors", strrchr(name, '/') + 1);
    snprintf(ref_path, sizeof ref_path, "%s", exl_test_shared(nm));
    exl_st_file *ref;
    REQUIRE_OK(exl_st_open(ref_path, &ref));
    const exl_st_tensor *ids = exl_st_find(ref, "ids_a"), *want = exl_st_find(ref, "logits_a");
    if (!ids) { /* tinystories names its sequences 0, 1, 2 */
        ids = exl_st_find(ref, "ids_0");
        want = exl_st_find(ref, "logits_0");
    }
    REQUIRE(ids && want);
    int32_t T = (int32_t)ids->shape[0];
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    exl_model *m;
    REQUIRE_OK(exl_model_load(dir, &mp, &m));
    int64_t H = m->cfg.hidden_size, V = m->cfg.vocab_size;
    exl_kv_cache *cache;
    REQUIRE_OK(exl_kv_cache_init(m, 4, 64, &cache));
    int32_t pages[4] = {0, 1, 2, 3};
    exl_seq_step st = {.ids = ids->data, .n_new = T, .n_past = 0, .pages = pages, .n_pages = 4, .want_logits = 2};
    REQUIRE(T <= 4 * 64 && T >= 4);
    float *whole = malloc((size_t)(T * V) * sizeof(float)), *mine = malloc((size_t)(T * V) * sizeof(float));
    float *x_one = malloc((size_t)(T * H) * sizeof(float)), *x_two = malloc((size_t)(T * H) * sizeof(float));
    float *x_split = malloc((size_t)(T * H) * sizeof(float));
    calls c = {.hidden = H, .head = m->head, .head_in = malloc((size_t)(T * H) * sizeof(float))};
    REQUIRE(whole && mine && x_one && x_two && x_split && c.head_in);
    REQUIRE_OK(exl_model_forward(m, cache, &st, 1, whole));

    /* layer by layer in one step, the hook recording */
    st.want_logits = 0;
    REQUIRE_OK(exl_model_embed_step(m, cache, &st, 1));
    REQUIRE(run_layers(m, cache, &st, &c));
    memcpy(x_one, m->fs.x, (size_t)(T * H) * sizeof(float));
    REQUIRE_OK(exl_model_head_input(m, cache, &st, 1, record, &c));
    REQUIRE(c.n == 7 * m->cfg.n_layers + 1);
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        const exl_layer *ly = &m->layers[l];
        const exl_linear *order[7] = {ly->q, ly->k, ly->v, ly->o, ly->gate, ly->up, ly->down};
        for (int i = 0; i < 7; i++) {
            int k = 7 * l + i;
            CHECK_MSG(c.layer[k] == l && c.w[k] == order[i] && c.rows[k] == T,
                      "%s: hook call %d: layer %d, linear %d of the layer's, %d rows", name, k, c.layer[k], i,
                      c.rows[k]);
        }
        CHECK(c.first[7 * l] == c.first[7 * l + 1] && c.first[7 * l] == c.first[7 * l + 2]);
        CHECK(c.first[7 * l + 4] == c.first[7 * l + 5]);
    }
    CHECK(c.layer[c.n - 1] == m->cfg.n_layers && c.w[c.n - 1] == m->head);
    float *logits = m->be->ops->alloc(m->be, (size_t)(T * V) * sizeof(float));
    REQUIRE(logits);
    m->be->ops->matmul(m->be, logits, c.head_in, m->head, T);
    memcpy(mine, logits, (size_t)(T * V) * sizeof(float));
    m->be->ops->free(m->be, logits);
    CHECK_MSG(!memcmp(mine, whole, (size_t)(T * V) * sizeof(float)),
              "%s: layer by layer differs from the whole forward (rel err %.3e)", name,
              ref_rel_err(mine, whole, T * V));
    double worst = 0;
    for (int32_t t = 0; t < T; t++) {
        double e = ref_rel_err(mine + (int64_t)t * V, (const float *)want->data + (int64_t)t * V, V);
        worst = e > worst ? e : worst;
    }
    printf("    %s: layer by layer vs transformers, max rel err %.2e\n", name, worst);
    CHECK_MSG(worst <= 1e-4, "%s: layer by layer differs from the reference: %.3e", name, worst);

    /* two steps, the second through the cache */
    int32_t half = T / 2;
    exl_seq_step s1 = st, s2 = st;
    s1.n_new = half;
    s2.ids = (const int32_t *)ids->data + half;
    s2.n_new = T - half;
    s2.n_past = half;
    for (int32_t l = -1; l < m->cfg.n_layers; l++) { /* -1: the embeddings */
        for (int piece = 0; piece < 2; piece++) {
            const exl_seq_step *sp = piece ? &s2 : &s1;
            float *x = x_two + (piece ? (int64_t)half * H : 0);
            if (l >= 0) {
                memcpy(m->fs.x, x, (size_t)(sp->n_new * H) * sizeof(float));
                REQUIRE_OK(exl_model_layer_forward(m, &m->layers[l], l, cache, sp, 1, NULL, NULL));
            } else {
                REQUIRE_OK(exl_model_embed_step(m, cache, sp, 1));
            }
            memcpy(x, m->fs.x, (size_t)(sp->n_new * H) * sizeof(float));
        }
    }
    double e2 = ref_rel_err(x_two, x_one, T * H);
    CHECK_MSG(e2 <= 1e-6, "%s: two steps through the cache differ from one: %.3e", name, e2);

    /* each layer as its attention block, then its MLP block */
    REQUIRE_OK(exl_model_embed_step(m, cache, &st, 1));
    for (int32_t l = 0; l < m->cfg.n_layers; l++) {
        exl_layer attn = m->layers[l], mlp = m->layers[l];
        attn.mlp_norm = NULL;
        mlp.attn_norm = NULL;
        REQUIRE_OK(exl_model_layer_forward(m, &attn, l, cache, &st, 1, NULL, NULL));
        REQUIRE_OK(exl_model_layer_forward(m, &mlp, l, cache, &st, 1, NULL, NULL));
    }
    memcpy(x_split, m->fs.x, (size_t)(T * H) * sizeof(float));
    CHECK_MSG(!memcmp(x_split, x_one, (size_t)(T * H) * sizeof(float)), "%s: the blocks apart differ from the layers",
              name);

    free(whole), free(mine), free(x_one), free(x_two), free(x_split), free(c.head_in);
    exl_kv_cache_free(m, cache);
    exl_model_free(m);
    exl_st_close(ref);
}

EXL_TEST(layer_forward_llama) { check_model("models/rand-llama"); }
EXL_TEST(layer_forward_qwen2) { check_model("models/rand-qwen2"); }
EXL_TEST(layer_forward_gemma) { check_model("models/rand-gemma"); }
EXL_TEST(layer_forward_tinystories) { check_model("models/tinystories-656k"); }
