/* calib_run.c - the calibration rows through the model one decoder layer at a time (the model's own forward,
 * model.h's exl_model_layer_forward), their hidden states kept on the host between layers.
 *
 * A step takes whole sequences, as many as fit the model's step rows, or one piece of a sequence longer than
 * that: its later pieces see the earlier ones through the paged cache, as a long prompt would. Each sequence of
 * a step has its own pages; the cache holds one layer's keys and values at a time (every layer's slots are
 * allocated, the layer being run is the one written). Candidates of a block that share linears are scored step by
 * step, each after the one before it over the same rows, without the graph nodes whose outputs are still there. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

#define PAGE_SIZE 64

exl_status exl_qz_runner_init(exl_qz_runner *r, exl_model *m, int32_t n_seqs, int32_t length) {
    memset(r, 0, sizeof *r);
    const exl_hf_config *c = &m->cfg;
    int32_t max_rows = exl_model_max_rows(m);
    r->m = m;
    r->n_seqs = n_seqs;
    r->length = length;
    r->seqs_per_step = length <= max_rows ? max_rows / length : 1;
    r->seqs_per_step = r->seqs_per_step < n_seqs ? r->seqs_per_step : n_seqs;
    r->piece = length <= max_rows ? length : max_rows;
    r->pages_per_seq = (length + PAGE_SIZE - 1) / PAGE_SIZE;
    int64_t widest = c->hidden_size, qw = (int64_t)c->n_heads * c->head_dim;
    widest = qw > widest ? qw : widest;
    widest = c->intermediate_size > widest ? c->intermediate_size : widest;
    r->pages = exl_malloc((size_t)r->seqs_per_step * r->pages_per_seq * sizeof *r->pages);
    r->steps = exl_calloc((size_t)r->seqs_per_step, sizeof *r->steps);
    r->buf = exl_malloc((size_t)max_rows * (size_t)widest * sizeof *r->buf);
    r->zeros = exl_calloc((size_t)r->piece, sizeof *r->zeros);
    if (!r->pages || !r->steps || !r->buf || !r->zeros) {
        exl_qz_runner_free(r);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    for (int32_t i = 0; i < r->seqs_per_step * r->pages_per_seq; i++)
        r->pages[i] = i;
    exl_status st = exl_kv_cache_init(m, r->seqs_per_step * r->pages_per_seq, PAGE_SIZE, 16, 16, &r->cache);
    if (st != EXL_OK)
        exl_qz_runner_free(r);
    return st;
}

void exl_qz_runner_free(exl_qz_runner *r) {
    if (r->cache)
        exl_kv_cache_free(r->m, r->cache);
    exl_free(r->pages);
    exl_free(r->steps);
    exl_free(r->buf);
    exl_free(r->zeros);
    memset(r, 0, sizeof *r);
}

/* What a step does with its sequences (r->steps[0 .. n_seqs)), whose hidden states are rows row0 .. row0 + rows of
 * the calibration's. */
typedef exl_status (*step_fn)(exl_qz_runner *r, void *ctx, int32_t n_seqs, int64_t row0, int32_t rows);

/* Every step in order: sequences in order, each sequence's pieces in order; ids NULL: token 0 everywhere (a layer
 * reads hidden states, not tokens). */
static exl_status each_step(exl_qz_runner *r, const int32_t *ids, step_fn fn, void *ctx) {
    for (int32_t s0 = 0; s0 < r->n_seqs; s0 += r->seqs_per_step) {
        int32_t ns = r->n_seqs - s0 < r->seqs_per_step ? r->n_seqs - s0 : r->seqs_per_step;
        for (int32_t off = 0; off < r->length; off += r->piece) {
            int32_t n = r->length - off < r->piece ? r->length - off : r->piece;
            for (int32_t i = 0; i < ns; i++)
                r->steps[i] = (exl_seq_step){.ids = ids ? ids + (int64_t)(s0 + i) * r->length + off : r->zeros,
                                             .n_new = n,
                                             .n_past = off,
                                             .pages = r->pages + (int64_t)i * r->pages_per_seq,
                                             .n_pages = r->pages_per_seq};
            /* several sequences a step only when each is whole: their rows follow each other */
            EXL_TRY(fn(r, ctx, ns, (int64_t)s0 * r->length + off, ns * n));
            if (r->tick)
                r->tick(r->tick_user);
        }
    }
    return EXL_OK;
}

/* Rows row0 .. row0 + rows of the host's hidden states x to the forward's (m->fs.x), and back. */
static exl_status upload_rows(exl_qz_runner *r, const float *x, int64_t row0, int32_t rows) {
    size_t width = (size_t)r->m->cfg.hidden_size;
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    exl_status st = r->m->be->ops->upload(r->m->be, r->m->fs.x, x + (size_t)row0 * width,
                                          (size_t)rows * width * sizeof(float));
    exl_qz_prof_leave();
    return st;
}

static exl_status download_rows(exl_qz_runner *r, float *x, int64_t row0, int32_t rows) {
    size_t width = (size_t)r->m->cfg.hidden_size;
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    exl_status st = r->m->be->ops->download(r->m->be, x + (size_t)row0 * width, r->m->fs.x,
                                            (size_t)rows * width * sizeof(float));
    exl_qz_prof_leave();
    return st;
}

static exl_status embed_step(exl_qz_runner *r, void *ctx, int32_t n_seqs, int64_t row0, int32_t rows) {
    EXL_TRY(exl_model_embed_step(r->m, r->cache, r->steps, n_seqs));
    return download_rows(r, ctx, row0, rows);
}

exl_status exl_qz_run_embed(exl_qz_runner *r, const int32_t *ids, float *x) { return each_step(r, ids, embed_step, x); }

typedef struct layer_ctx {
    const exl_layer *layer;
    int32_t li;
    const float *x_in;
    float *x_out;
    exl_linear_hook hook;
    void *user;
} layer_ctx;

static exl_status layer_step(exl_qz_runner *r, void *ctx, int32_t n_seqs, int64_t row0, int32_t rows) {
    const layer_ctx *c = ctx;
    EXL_TRY(upload_rows(r, c->x_in, row0, rows));
    EXL_TRY(exl_model_layer_forward(r->m, c->layer, c->li, r->cache, r->steps, n_seqs, c->hook, c->user));
    return c->x_out ? download_rows(r, c->x_out, row0, rows) : EXL_OK;
}

exl_status exl_qz_run_layer(exl_qz_runner *r, const exl_layer *layer, int32_t li, const float *x_in, float *x_out,
                            exl_linear_hook hook, void *user) {
    layer_ctx c = {layer, li, x_in, x_out, hook, user};
    return each_step(r, NULL, layer_step, &c);
}

typedef struct err_ctx {
    const exl_layer *layer;
    int32_t li;
    const float *x_in, *ref;
    double *err;
} err_ctx;

static exl_status err_step(exl_qz_runner *r, void *ctx, int32_t n_seqs, int64_t row0, int32_t rows) {
    const err_ctx *c = ctx;
    exl_backend *be = r->m->be;
    int32_t width = r->m->cfg.hidden_size;
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    be->ops->copy_cols(be, r->m->fs.x, c->x_in + row0 * width, rows, width, width, 0);
    exl_qz_prof_leave();
    EXL_TRY(exl_model_layer_forward(r->m, c->layer, c->li, r->cache, r->steps, n_seqs, NULL, NULL));
    exl_qz_prof_enter(EXL_QZ_PROF_ACCURACY);
    exl_status st = be->ops->sq_dist(be, r->m->fs.x, c->ref + row0 * width, (int64_t)rows * width, c->err);
    exl_qz_prof_leave();
    return st;
}

exl_status exl_qz_run_layer_err(exl_qz_runner *r, const exl_layer *layer, int32_t li, const float *x_in,
                                const float *ref, double *err) {
    err_ctx c = {layer, li, x_in, ref, err};
    return each_step(r, NULL, err_step, &c);
}

/* ---- candidates that share linears, step by step */

/* What node n of g reads and writes; an accumulating matmul writes the graph's tmp too (the generic executor's). */
static exl_node_access node_access(const exl_graph *g, const exl_node *n) {
    exl_node_access a = exl_node_access_of(n, g->batch ? g->batch->n_rows : 0);
    if (n->op == EXL_OP_MATMUL && n->matmul.accumulate && g->tmp) {
        a.writes[a.n_writes].p = g->tmp;
        a.writes[a.n_writes++].n = (int64_t)n->matmul.rows * n->matmul.out_features;
    }
    return a;
}

static int writes_to(const exl_node_access *a, exl_span s) {
    for (int32_t i = 0; i < a->n_writes; i++)
        if (exl_spans_overlap(a->writes[i], s))
            return 1;
    return 0;
}

/* Whether node n computes its writes from its reads alone (a matmul: with one of the linears same[0 .. n_same), whose
 * weights are those of the run before). */
static int repeatable(const exl_node *n, const exl_qz_cand *c) {
    switch (n->op) {
    case EXL_OP_RMSNORM:
    case EXL_OP_ROPE:
    case EXL_OP_GLU:
    case EXL_OP_COPY_COLS: return 1;
    case EXL_OP_MATMUL:
        for (int32_t i = 0; !n->matmul.accumulate && i < c->n_same; i++)
            if (n->matmul.w == c->same[i])
                return 1;
        return 0;
    default: return 0;
    }
}

/* Every skipped node of acc[0 .. n) that writes into span s runs after all. */
static int run_writers(exl_span s, int32_t n, const exl_node_access *acc, uint8_t *skip) {
    int changed = 0;
    for (int32_t j = 0; j < n; j++)
        if (skip[j] && writes_to(&acc[j], s))
            skip[j] = 0, changed = 1;
    return changed;
}

/* The nodes of g (candidate c's graph over a step, run right after the candidate before it over the same step, both
 * from the step's input `input`) that need not run: skip[i] set, the count returned. A node is the same as in the
 * run before when it is repeatable and everything it reads was written before it, in the graph, by such nodes (or
 * not at all: the input, restored before each run, which none of them writes). Of those, a node is skipped where the
 * buffers still hold what the run before left, which is what the whole graph leaves (by induction: the first run of
 * a step is whole): every node writing into the same memory is skipped too (nothing that runs changes it), and a node
 * that runs and reads it is the last to see it (nothing writes it from that node on). Nodes that break either run
 * after all, until none does. */
static int32_t shared_nodes(const exl_graph *g, exl_span input, const exl_qz_cand *c, exl_node_access *acc,
                            uint8_t *skip) {
    int32_t n = g->n_nodes, count = 0;
    for (int32_t i = 0; i < n; i++) {
        acc[i] = node_access(g, &g->nodes[i]);
        int same = repeatable(&g->nodes[i], c) && !writes_to(&acc[i], input);
        for (int32_t r = 0; same && r < acc[i].n_reads; r++)
            for (int32_t j = 0; same && j < i; j++)
                same = skip[j] || !writes_to(&acc[j], acc[i].reads[r]);
        skip[i] = (uint8_t)same;
    }
    for (int changed = 1; changed;) {
        changed = 0;
        for (int32_t i = 0; i < n; i++) {
            if (skip[i])
                continue;
            for (int32_t w = 0; w < acc[i].n_writes; w++)
                changed |= run_writers(acc[i].writes[w], n, acc, skip);
            for (int32_t r = 0; r < acc[i].n_reads; r++) {
                int later = 0;
                for (int32_t j = i; j < n && !later; j++)
                    later = writes_to(&acc[j], acc[i].reads[r]);
                if (later)
                    changed |= run_writers(acc[i].reads[r], n, acc, skip);
            }
        }
    }
    for (int32_t i = 0; i < n; i++)
        count += skip[i];
    return count;
}

typedef struct errs_ctx {
    exl_qz_cand *c;
    int32_t n, li;
    const float *x_in, *ref;
    exl_node_access *acc;
    uint8_t *skip;
    int32_t cap;
} errs_ctx;

/* Candidate j's graph over the step (its buffers as the candidate before left them) without the nodes that need not
 * run (none for the first). */
static exl_status shared_forward(exl_qz_runner *r, errs_ctx *c, int32_t j, int32_t n_seqs, int32_t rows) {
    exl_model *m = r->m;
    if (!j)
        return exl_model_layer_forward(m, &c->c[j].layer, c->li, r->cache, r->steps, n_seqs, NULL, NULL);
    int32_t n_logits;
    exl_graph *g = &m->fs.graph;
    EXL_TRY(exl_model_begin_step(m, r->cache, r->steps, n_seqs, 0, &n_logits));
    EXL_TRY(exl_model_layer_graph(m, &c->c[j].layer, c->li, r->cache, g));
    exl_span input = {m->fs.x, (int64_t)rows * m->cfg.hidden_size};
    EXL_TRY(exl_graph_output(g, input.p, input.n));
    if (g->n_nodes > c->cap) {
        exl_free(c->acc);
        exl_free(c->skip);
        c->cap = 0;
        c->acc = exl_malloc((size_t)g->n_nodes * sizeof *c->acc);
        c->skip = exl_malloc((size_t)g->n_nodes);
        if (!c->acc || !c->skip)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        c->cap = g->n_nodes;
    }
    if (!shared_nodes(g, input, &c->c[j], c->acc, c->skip))
        return exl_model_run_graph(m, g, NULL, NULL);
    int32_t kept = 0;
    for (int32_t i = 0; i < g->n_nodes; i++)
        if (!c->skip[i])
            g->nodes[kept++] = g->nodes[i];
    g->n_nodes = kept;
    exl_qz_prof_enter(EXL_QZ_PROF_SHARED);
    exl_status st = exl_model_run_graph(m, g, NULL, NULL);
    exl_qz_prof_leave();
    return st;
}

static exl_status errs_step(exl_qz_runner *r, void *ctx, int32_t n_seqs, int64_t row0, int32_t rows) {
    errs_ctx *c = ctx;
    exl_backend *be = r->m->be;
    int32_t width = r->m->cfg.hidden_size;
    for (int32_t j = 0; j < c->n; j++) {
        exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
        be->ops->copy_cols(be, r->m->fs.x, c->x_in + row0 * width, rows, width, width, 0);
        exl_qz_prof_leave();
        EXL_TRY(shared_forward(r, c, j, n_seqs, rows));
        exl_qz_prof_enter(EXL_QZ_PROF_ACCURACY);
        exl_status st = be->ops->sq_dist(be, r->m->fs.x, c->ref + row0 * width, (int64_t)rows * width, &c->c[j].err);
        exl_qz_prof_leave();
        EXL_TRY(st);
    }
    return EXL_OK;
}

exl_status exl_qz_run_layer_errs(exl_qz_runner *r, exl_qz_cand *c, int32_t n, int32_t li, const float *x_in,
                                 const float *ref) {
    if (r->piece < r->length) { /* a step's attention reads the pieces before it: candidates one after another */
        for (int32_t j = 0; j < n; j++)
            EXL_TRY(exl_qz_run_layer_err(r, &c[j].layer, li, x_in, ref, &c[j].err));
        return EXL_OK;
    }
    errs_ctx e = {c, n, li, x_in, ref, NULL, NULL, 0};
    exl_status st = each_step(r, NULL, errs_step, &e);
    exl_free(e.acc);
    exl_free(e.skip);
    return st;
}

typedef struct head_ctx {
    const float *x;
    exl_linear_hook hook;
    void *user;
} head_ctx;

static exl_status head_step(exl_qz_runner *r, void *ctx, int32_t n_seqs, int64_t row0, int32_t rows) {
    const head_ctx *c = ctx;
    EXL_TRY(upload_rows(r, c->x, row0, rows));
    return exl_model_head_input(r->m, r->cache, r->steps, n_seqs, c->hook, c->user);
}

exl_status exl_qz_run_head(exl_qz_runner *r, const float *x, exl_linear_hook hook, void *user) {
    head_ctx c = {x, hook, user};
    return each_step(r, NULL, head_step, &c);
}

/* Whether a linear's inputs are summed into its Hessian where they are: on a backend with a gemm that is not the CPU
 * (EXL_QUANT_DEVICE_HESSIAN=0: brought to the host first, as before). */
static int on_device(exl_backend *be) {
    const char *env = getenv("EXL_QUANT_DEVICE_HESSIAN");
    return !exl_backend_cpu_pool(be) && be->ops->gemm && !(env && !strcmp(env, "0"));
}

exl_status exl_qz_capture_inputs(void *user, int32_t layer, const exl_linear *w, const float *x, int32_t rows) {
    exl_qz_capture *c = user;
    exl_backend *be = c->r->m->be;
    for (int32_t i = 0; i < c->n; i++) {
        if (w != c->w[i] || !c->h[i])
            continue;
        exl_qz_prof_enter(EXL_QZ_PROF_HESSIAN);
        size_t width = (size_t)c->h[i]->K;
        exl_status st = EXL_OK;
        if (on_device(be) && w != c->keep_w) { /* the rows stay where they are */
            st = exl_hessian_add_on(c->h[i], x, rows, be);
            exl_qz_prof_leave();
            EXL_TRY(st);
            continue;
        }
        st = be->ops->download(be, c->r->buf, x, (size_t)rows * width * sizeof(float));
        if (st == EXL_OK && w == c->keep_w) {
            memcpy(c->keep + (size_t)c->kept * width, c->r->buf, (size_t)rows * width * sizeof(float));
            c->kept += rows;
        }
        if (st == EXL_OK)
            st = exl_hessian_add(c->h[i], c->r->buf, rows, be);
        exl_qz_prof_leave();
        EXL_TRY(st);
    }
    return EXL_OK;
}
