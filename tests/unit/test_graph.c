/* test_graph.c - a step as a graph (backend/graph.h) on the CPU: the decoder layers run one graph each
 * (exl_model_layer_forward, through the generic executor with a hook on every linear's input) give exl_model_forward's
 * logits bit for bit, the hook sees each linear's input; the nodes' declared reads and writes; the executor's
 * refusal of an accumulating matmul without a tmp buffer. */
#include "base/error.h"
#include "model/model.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

typedef struct hook_log {
    int calls;
    const float *x[8]; /* the inputs of the current layer's linears, in order */
    int32_t layer, rows, bad_layer;
} hook_log;

static exl_status log_linear(void *user, int32_t layer, const exl_linear *w, const float *x, int32_t rows) {
    hook_log *h = user;
    if (layer != h->layer || rows != h->rows || !w)
        h->bad_layer = 1;
    h->x[h->calls++ % 8] = x;
    return EXL_OK;
}

/* the step st on m's cache c the graph way: embedding, each layer through exl_model_layer_forward with the hook,
 * the head; the logits of every row into out */
static void forward_by_layers(exl_model *m, exl_kv_cache *c, const exl_seq_step *st, float *out, int *ok) {
    exl_backend *be = m->be;
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *cfg = &m->cfg;
    int32_t rows = st->n_new;
    *ok = 0;
    be->ops->embed(be, s->x, m->embed, st->ids, rows, m->embed_scale);
    for (int32_t li = 0; li < cfg->n_layers; li++) {
        hook_log h = {.layer = li, .rows = rows};
        REQUIRE_OK(exl_model_layer_forward(m, &m->layers[li], li, c, st, 1, log_linear, &h));
        CHECK(h.calls == 7 && !h.bad_layer);
        /* q, k, v of the normed x; o of the attention; gate, up of the normed x; down of the GLU */
        CHECK(h.x[0] == s->h && h.x[1] == s->h && h.x[2] == s->h && h.x[3] == s->attn);
        CHECK(h.x[4] == s->h && h.x[5] == s->h && h.x[6] == s->gate);
    }
    be->ops->rmsnorm(be, s->h, s->x, m->final_norm, rows, cfg->hidden_size, (float)cfg->rms_eps);
    be->ops->matmul(be, out, s->h, m->head, rows);
    *ok = 1;
}

EXL_TEST(layer_graphs_equal_the_forward) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *m;
    REQUIRE_OK(exl_model_load(exl_test_shared("models/rand-qwen2"), &p, &m));
    exl_kv_cache *c[2];
    REQUIRE_OK(exl_kv_cache_init(m, 1, 16, 16, 16, &c[0]));
    REQUIRE_OK(exl_kv_cache_init(m, 1, 16, 16, 16, &c[1]));
    const int32_t vocab = m->cfg.vocab_size, page = 0, ids[8] = {5, 17, 3, 99, 42, 7, 1, 250};
    float *want = malloc((size_t)7 * vocab * sizeof(float)), *got = malloc((size_t)7 * vocab * sizeof(float));
    /* a 7-token prompt, then one decode step */
    for (int step = 0; step < 2; step++) {
        exl_seq_step st = {ids + (step ? 7 : 0), step ? 1 : 7, step ? 7 : 0, &page, 1, 2};
        int ok;
        REQUIRE_OK(exl_model_forward(m, c[0], &st, 1, want));
        forward_by_layers(m, c[1], &st, got, &ok);
        REQUIRE(ok);
        CHECK_MSG(!memcmp(want, got, (size_t)st.n_new * vocab * sizeof(float)), "step %d: logits differ", step);
    }
    free(want);
    free(got);
    exl_kv_cache_free(m, c[0]);
    exl_kv_cache_free(m, c[1]);
    exl_model_free(m);
}

EXL_TEST(node_access) {
    float a[64], b[64], c[64];
    exl_node mm = {.op = EXL_OP_MATMUL, .matmul = {a, b, NULL, 2, 8, 4, 1}};
    exl_node_access x = exl_node_access_of(&mm, 0);
    CHECK(x.n_reads == 2 && x.reads[0].p == b && x.reads[0].n == 16 && x.reads[1].p == a && x.reads[1].n == 8);
    CHECK(x.n_writes == 1 && x.writes[0].p == a && x.writes[0].n == 8);
    mm.matmul.accumulate = 0;
    x = exl_node_access_of(&mm, 0);
    CHECK(x.n_reads == 1 && x.n_writes == 1);
    exl_node kv = {.op = EXL_OP_KV_STORE, .kv_store = {NULL, NULL, b, c, 6}};
    x = exl_node_access_of(&kv, 3); /* the batch's rows */
    CHECK(x.n_reads == 2 && x.reads[0].n == 18 && x.reads[1].p == c && x.n_writes == 0);
    exl_node at = {.op = EXL_OP_ATTENTION, .attention = {a, b, c, c, NULL, NULL, {4, 2, 8, 16, 0, 1.0f, 0.0f}}};
    x = exl_node_access_of(&at, 2);
    CHECK(x.n_reads == 3 && x.reads[0].n == 64 && x.reads[1].n == 32 && x.n_writes == 1 && x.writes[0].n == 64);
    CHECK(exl_spans_overlap((exl_span){a, 8}, (exl_span){a + 7, 1}) &&
          !exl_spans_overlap((exl_span){a, 8}, (exl_span){a + 8, 4}));
}

EXL_TEST(accumulate_needs_tmp) {
    exl_backend *be;
    REQUIRE_OK(exl_backend_cpu_init(1, &be));
    float x[4] = {1, 2, 3, 4}, out[4] = {0};
    exl_graph g = {0};
    exl_graph_reset(&g, NULL);
    exl_node n = {.op = EXL_OP_MATMUL, .tag = {3, EXL_PART_DOWN}, .matmul = {out, x, NULL, 1, 4, 4, 1}};
    REQUIRE_OK(exl_graph_add(&g, &n));
    CHECK(exl_graph_exec(be, &g, NULL, NULL) == EXL_ERR_ARG && strstr(exl_last_error(), "layer 3"));
    exl_graph_free(&g);
    be->ops->destroy(be);
}
