/* forward.c - the transformer forward pass: each step's tables, and its graph of generic ops (backend/graph.h):
 * the embedding, the decoder layers (layer_graph.c) and the head, which the backend runs. */
#include "model/model.h"
#include "model/tp.h"

#include "base/alloc.h"
#include "base/error.h"
#include "model/lora.h"

#include <stdint.h>
#include <string.h>

int32_t exl_model_max_rows(const exl_model *m) { return m->fs.max_rows; }

static exl_status alloc_buf(exl_model *m, void **p, size_t bytes) {
    *p = m->be->ops->alloc(m->be, bytes);
    return *p ? EXL_OK : exl_fail_prefix(EXL_ERR_NOMEM, "forward buffers");
}

/* Steps fall back to half as many tokens while the forward buffers do not fit, down to this. */
#define MIN_STEP_ROWS 64

/* 1 if the sliding layers have a rope of their own (Gemma 3): a table each. The ropes are compared as bytes, which
 * the config reader makes well defined (it clears each before filling it in). */
static int sliding_rope_differs(const exl_hf_config *c) {
    int sliding = 0;
    for (int32_t i = 0; i < c->n_layers; i++)
        sliding |= c->layers[i].sliding;
    return sliding && memcmp(&c->rope, &c->rope_sliding, sizeof c->rope) != 0;
}

/* The mixture-of-experts buffers for steps of R tokens. */
static exl_status alloc_moe(exl_model *m, size_t R) {
    exl_forward_scratch *s = &m->fs;
    const exl_moe_config *e = &m->cfg.moe;
    const size_t f = sizeof(float), pairs = R * (size_t)e->top_k;
    EXL_TRY(alloc_buf(m, (void **)&s->router, R * (size_t)e->n_experts * f));
    EXL_TRY(alloc_buf(m, (void **)&s->route_weights, pairs * f));
    EXL_TRY(alloc_buf(m, (void **)&s->route_ids, pairs * sizeof(int32_t)));
    EXL_TRY(alloc_buf(m, (void **)&s->moe_xs, pairs * (size_t)m->cfg.hidden_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->moe_gate, pairs * (size_t)e->expert_ffn * f));
    EXL_TRY(alloc_buf(m, (void **)&s->moe_up, pairs * (size_t)e->expert_ffn * f));
    return alloc_buf(m, (void **)&s->moe_slots, 2 * pairs * sizeof(int32_t));
}

/* The buffers for steps of R tokens (the page tables and the logits grow on demand). */
static exl_status alloc_rows(exl_model *m, size_t R) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    const size_t f = sizeof(float);
    const size_t qw = (size_t)c->n_heads * c->head_dim, kvw = (size_t)c->n_kv_heads * c->head_dim;
    /* the dense MLPs' (where some layer has one) and the shared expert's */
    size_t ffn = c->moe.n_moe_layers < c->n_layers ? (size_t)c->intermediate_size : 1;
    ffn = ffn > (size_t)c->moe.shared_ffn ? ffn : (size_t)c->moe.shared_ffn;
    EXL_TRY(alloc_buf(m, (void **)&s->x, R * c->hidden_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->h, R * c->hidden_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->q, R * qw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->k, R * kvw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->v, R * kvw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->attn, R * qw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->gate, R * ffn * f));
    EXL_TRY(alloc_buf(m, (void **)&s->up, R * ffn * f));
    EXL_TRY(alloc_buf(m, (void **)&s->sel, R * c->hidden_size * f));
    if (c->fused_qkv || c->fused_gate_up)
        EXL_TRY(alloc_buf(m, (void **)&s->fused, R * (qw + 2 * kvw > 2 * ffn ? qw + 2 * kvw : 2 * ffn) * f));
    if (c->moe.n_moe_layers > 0)
        EXL_TRY(alloc_moe(m, R));
    for (int t = 0; t < (sliding_rope_differs(c) ? 2 : 1); t++) {
        EXL_TRY(alloc_buf(m, (void **)&s->rope[t].inv_freq, (size_t)m->rot_dim / 2 * f));
        s->rope[t].seq_len = -1;
    }
    s->max_rows = (int32_t)R;
    return EXL_OK;
}

exl_status exl_model_alloc_forward(exl_model *m) {
    for (int32_t rows = m->be->step_rows;; rows /= 2) {
        exl_status st = alloc_rows(m, (size_t)rows);
        if (st == EXL_OK)
            return EXL_OK;
        exl_model_free_forward(m);
        if (st != EXL_ERR_NOMEM || rows / 2 < MIN_STEP_ROWS)
            return st;
    }
}

void exl_model_free_forward(exl_model *m) {
    exl_backend *be = m->be;
    exl_forward_scratch *s = &m->fs;
    void *bufs[] = {s->x,
                    s->h,
                    s->q,
                    s->k,
                    s->v,
                    s->attn,
                    s->gate,
                    s->up,
                    s->sel,
                    s->logits,
                    s->table,
                    s->rope[0].inv_freq,
                    s->rope[1].inv_freq,
                    s->fused,
                    s->router,
                    s->route_weights,
                    s->route_ids,
                    s->moe_xs,
                    s->moe_gate,
                    s->moe_up,
                    s->moe_slots};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            be->ops->free(be, bufs[i]);
    exl_free(s->host_table);
    exl_graph_free(&s->graph);
    exl_model_free_ahead(m);
    memset(s, 0, sizeof *s);
}

/* *buf (backend memory of *have elements of elem bytes) for at least need elements: doubled, at
 * most cap */
static exl_status grow(exl_model *m, void **buf, int32_t *have, int32_t need, int32_t cap, size_t elem) {
    if (need <= *have)
        return EXL_OK;
    int32_t n = need > 2 * *have ? need : 2 * *have;
    n = n < cap ? n : cap;
    if (*buf)
        m->be->ops->free(m->be, *buf);
    *buf = NULL;
    *have = 0;
    EXL_TRY(alloc_buf(m, buf, (size_t)n * elem));
    *have = n;
    return EXL_OK;
}

/* The step tables for `ints` int32s (and their host copy), the logits for n_logits rows: most
 * steps want one row a sequence, so they grow rather than being sized for max_rows. */
static exl_status ensure_scratch(exl_model *m, int32_t ints, int32_t n_logits) {
    exl_forward_scratch *s = &m->fs;
    if (ints > s->table_cap) {
        exl_free(s->host_table);
        s->host_table = NULL;
        EXL_TRY(grow(m, (void **)&s->table, &s->table_cap, ints, INT32_MAX, sizeof(int32_t)));
        if (!(s->host_table = exl_malloc((size_t)s->table_cap * sizeof(int32_t)))) {
            s->table_cap = 0;
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        }
    }
    return grow(m, (void **)&s->logits, &s->max_logit_rows, n_logits, s->max_rows,
                (size_t)m->cfg.vocab_size * sizeof(float));
}

/* int32s of a step's tables (build_batch) */
static int32_t table_ints(int32_t rows, int32_t n_seqs, int32_t n_pages) {
    return 4 * rows + n_seqs * (int32_t)(sizeof(exl_attn_seq) / sizeof(int32_t)) + n_pages;
}

/* The sequence length that rope r's table is computed for, for steps whose longest sequence has seq_len tokens:
 * only dynamic NTK scaling (beyond max_pos) and longrope (short or long factors) depend on it. */
static int32_t rope_table_len(const exl_hf_config *c, const exl_rope_config *r, int32_t seq_len) {
    if (r->type == EXL_ROPE_DYNAMIC && seq_len > c->max_pos)
        return seq_len;
    if (r->type == EXL_ROPE_LONGROPE)
        return seq_len > r->original_max_pos ? r->original_max_pos + 1 : r->original_max_pos;
    return c->max_pos;
}

static exl_status update_rope(exl_model *m, int32_t seq_len) {
    for (int t = 0; t < 2; t++) {
        exl_rope_table *rt = &m->fs.rope[t];
        const exl_rope_config *r = t ? &m->cfg.rope_sliding : &m->cfg.rope;
        int32_t len = rope_table_len(&m->cfg, r, seq_len);
        if (!rt->inv_freq || rt->seq_len == len)
            continue;
        float inv_freq[512];
        exl_rope_frequencies(&m->cfg, r, m->rot_dim, len, inv_freq, &rt->attn_factor);
        rt->seq_len = len;
        EXL_TRY(m->be->ops->upload(m->be, rt->inv_freq, inv_freq, (size_t)m->rot_dim / 2 * sizeof(float)));
    }
    return EXL_OK;
}

/* Where a step's token ids are: from the host (in steps), or fed from the last argmax step. */
enum { FED_NONE, FED_DEVICE, FED_HOST };

/* A fed step: all its sequences or none, one token each, one per row of the argmax step. */
static exl_status check_fed(const exl_model *m, const exl_seq_step *steps, int32_t n_seqs, int *fed) {
    int any = n_seqs > 0 && !steps[0].ids;
    *fed = !any ? FED_NONE : m->be->ops->argmax ? FED_DEVICE : FED_HOST;
    for (int32_t i = 0; i < n_seqs; i++) {
        if ((steps[i].ids == NULL) != any)
            return exl_fail(EXL_ERR_ARG, "forward: sequences %d and 0 differ in where their tokens come from", i);
        if (*fed && steps[i].n_new != 1)
            return exl_fail(EXL_ERR_ARG, "forward: sequence %d takes its token from the device but has %d new", i,
                            steps[i].n_new);
    }
    if (*fed && n_seqs != m->fs.fed_rows)
        return exl_fail(EXL_ERR_ARG, "forward: %d sequences take device tokens, the step before chose %d", n_seqs,
                        m->fs.fed_rows);
    return EXL_OK;
}

static exl_status check_steps(const exl_model *m, const exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                              int32_t *rows, int32_t *pages, int32_t *n_logits) {
    *rows = *pages = *n_logits = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        const exl_seq_step *st = &steps[i];
        int64_t total = (int64_t)st->n_past + st->n_new;
        if (st->n_new < 1 || st->n_past < 0)
            return exl_fail(EXL_ERR_ARG, "forward: sequence %d has no new tokens", i);
        if (total > (int64_t)st->n_pages * cache->page_size)
            return exl_fail(EXL_ERR_ARG, "forward: sequence %d needs %lld cache slots but its pages hold %lld", i,
                            (long long)total, (long long)st->n_pages * cache->page_size);
        for (int32_t p = 0; p < st->n_pages; p++)
            if (st->pages[p] < 0 || st->pages[p] >= cache->n_pages)
                return exl_fail(EXL_ERR_ARG, "forward: sequence %d uses page %d outside the cache", i, st->pages[p]);
        for (int32_t t = 0; st->ids && t < st->n_new; t++)
            if (st->ids[t] < 0 || st->ids[t] >= m->cfg.vocab_size)
                return exl_fail(EXL_ERR_ARG, "token id %d is outside the vocabulary (0..%d)", st->ids[t],
                                m->cfg.vocab_size - 1);
        *rows += st->n_new;
        *pages += st->n_pages;
        *n_logits += exl_seq_step_logit_rows(st);
    }
    if (*rows > exl_model_max_rows(m))
        return exl_fail(EXL_ERR_ARG, "forward: %d tokens in one step (at most %d)", *rows, exl_model_max_rows(m));
    return EXL_OK;
}

/* fed: the token ids come from the last argmax step (left in table by the backend's op, or
 * picked on the host) */
static exl_status build_batch(exl_model *m, const exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                              int32_t rows, int32_t n_pages, int fed, exl_batch *b) {
    _Static_assert(sizeof(exl_attn_seq) % sizeof(int32_t) == 0, "exl_attn_seq is int32s");
    exl_forward_scratch *s = &m->fs;
    /* where each table goes, the same in table and host_table */
    int32_t *h = s->host_table;
    const size_t at_pos = (size_t)rows, at_slots = 2 * (size_t)rows, at_logit_rows = 3 * (size_t)rows,
                 at_seqs = 4 * (size_t)rows,
                 at_pages = at_seqs + (size_t)n_seqs * sizeof(exl_attn_seq) / sizeof(int32_t);
    int32_t *ids = h, *pos = h + at_pos, *slots = h + at_slots, *logit_rows = h + at_logit_rows;
    exl_attn_seq *seqs = (exl_attn_seq *)(h + at_seqs);
    int32_t *page_tables = h + at_pages;
    int32_t row = 0, page = 0, lr = 0, max_q = 0, max_kv = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        const exl_seq_step *st = &steps[i];
        seqs[i] = (exl_attn_seq){row, st->n_new, st->n_past + st->n_new, page};
        memcpy(page_tables + page, st->pages, (size_t)st->n_pages * sizeof(int32_t));
        for (int32_t t = 0; t < st->n_new; t++) {
            int32_t p = st->n_past + t;
            ids[row + t] = st->ids ? st->ids[t] : 0;
            pos[row + t] = p;
            slots[row + t] = st->pages[p / cache->page_size] * cache->page_size + p % cache->page_size;
            if (st->want_logits == 2 || (st->want_logits == 1 && t == st->n_new - 1))
                logit_rows[lr++] = row + t;
        }
        row += st->n_new;
        page += st->n_pages;
        max_q = st->n_new > max_q ? st->n_new : max_q;
        max_kv = seqs[i].n_kv > max_kv ? seqs[i].n_kv : max_kv;
    }
    /* one copy for all of them: each copy costs the GPU a few microseconds between steps; fed
     * ids the device chose stay where its argmax put them */
    size_t skip = fed == FED_DEVICE ? (size_t)rows : 0;
    if (fed == FED_HOST)
        memcpy(ids, s->host_fed, (size_t)rows * sizeof(int32_t));
    EXL_TRY(m->be->ops->upload(m->be, s->table + skip, h + skip,
                               ((size_t)table_ints(rows, n_seqs, n_pages) - skip) * sizeof(int32_t)));
    s->ids = s->table, s->pos = s->table + at_pos, s->slots = s->table + at_slots;
    s->logit_rows = s->table + at_logit_rows, s->seqs = (exl_attn_seq *)(s->table + at_seqs);
    s->page_tables = s->table + at_pages;
    *b = (exl_batch){.n_rows = rows,
                     .n_seqs = n_seqs,
                     .max_q = max_q,
                     .max_kv = max_kv,
                     .seqs = seqs,
                     .pos = pos,
                     .slots = slots,
                     .d_seqs = s->seqs,
                     .d_ids = s->ids,
                     .d_pos = s->pos,
                     .d_slots = s->slots,
                     .d_page_tables = s->page_tables,
                     .kv = cache->fmt};
    return update_rope(m, max_kv);
}

/* ---- the step's graph (backend/graph.h) */

exl_status exl_model_begin_step(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs, int ahead,
                                int32_t *n_logits) {
    int32_t rows, n_pages;
    int fed;
    EXL_TRY(check_fed(m, steps, n_seqs, &fed));
    EXL_TRY(check_steps(m, cache, steps, n_seqs, &rows, &n_pages, n_logits));
    int32_t ints = table_ints(rows, n_seqs, n_pages);
    int32_t next = table_ints(*n_logits, *n_logits, n_pages + *n_logits); /* a row each, a page more */
    if (ahead && next > ints)
        ints = next;
    if (fed == FED_DEVICE && ints > m->fs.table_cap) {
        /* the table moves: take the fed ids along through the host (a wait, once per doubling) */
        EXL_TRY(m->be->ops->download(m->be, m->fs.host_fed, m->fs.table, (size_t)rows * sizeof(int32_t)));
        fed = FED_HOST;
    }
    EXL_TRY(ensure_scratch(m, ints, *n_logits));
    exl_forward_scratch *s = &m->fs;
    s->fed_rows = 0; /* this step's table replaces them */
    EXL_TRY(build_batch(m, cache, steps, n_seqs, rows, n_pages, fed, &s->batch));
    EXL_TRY(exl_lora_begin_step(m, steps, n_seqs, rows));
    exl_graph_reset(&s->graph, &s->batch);
    s->graph.tmp = s->h; /* free while o_proj and down_proj run, the residual adds */
    s->graph.tmp_floats = (int64_t)s->max_rows * m->cfg.hidden_size;
    return EXL_OK;
}

exl_status exl_model_run_graph(exl_model *m, const exl_graph *g, exl_linear_hook hook, void *user) {
    if (!hook && m->be->ops->graph_run)
        return m->be->ops->graph_run(m->be, g);
    return exl_graph_exec(m->be, g, hook, user);
}

exl_status exl_model_forward_to_logits(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                       int ahead, int32_t *n_logits) {
    if (m->tp)
        return exl_tp_forward_to_logits(m, cache, steps, n_seqs, ahead, n_logits);
    return exl_model_step_to_logits(m, cache, steps, n_seqs, ahead, n_logits);
}

exl_status exl_model_step_to_logits(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    int ahead, int32_t *n_logits) {
    EXL_TRY(exl_model_begin_step(m, cache, steps, n_seqs, ahead, n_logits));
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    exl_graph *g = &s->graph;
    int32_t rows = s->batch.n_rows, hid = c->hidden_size, n = *n_logits;
    const exl_node embed = {.op = EXL_OP_EMBED,
                            .tag = {-1, EXL_PART_EMBED},
                            .embed = {s->x, m->embed, s->batch.d_ids, rows, hid, m->embed_scale}};
    EXL_TRY(exl_graph_add(g, &embed));
    for (int32_t i = 0; i < c->n_layers; i++)
        EXL_TRY(exl_model_layer_graph(m, &m->layers[i], i, cache, g));
    if (n > 0) {
        const exl_node head[] = {
            {.op = EXL_OP_GATHER_ROWS,
             .tag = {-1, EXL_PART_LOGIT_ROWS},
             .gather_rows = {s->sel, s->x, s->logit_rows, n, hid, rows}},
            {.op = EXL_OP_RMSNORM,
             .tag = {-1, EXL_PART_FINAL_NORM},
             .rmsnorm = {s->h, s->sel, m->final_norm, n, hid, (float)c->rms_eps}},
            {.op = EXL_OP_MATMUL,
             .tag = {-1, EXL_PART_HEAD},
             .matmul = {s->logits, s->h, m->head, n, hid, c->vocab_size, 0}},
        };
        for (size_t i = 0; i < sizeof head / sizeof head[0] - (m->tp != NULL); i++)
            EXL_TRY(exl_graph_add(g, &head[i]));
        if (m->tp) /* this rank's slice of the vocabulary, then every rank's */
            EXL_TRY(exl_tp_head_nodes(m, n, g));
        if (c->final_softcap > 0) {
            const exl_node cap = {.op = EXL_OP_SOFTCAP,
                                  .tag = {-1, EXL_PART_LOGIT_SOFTCAP},
                                  .softcap = {s->logits, (int64_t)n * c->vocab_size, (float)c->final_softcap}};
            EXL_TRY(exl_graph_add(g, &cap));
        }
        EXL_TRY(exl_graph_output(g, s->logits, (int64_t)n * c->vocab_size));
    }
    return exl_model_run_graph(m, g, NULL, NULL);
}

exl_status exl_model_forward(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                             float *logits) {
    int32_t n_logits;
    EXL_TRY(exl_model_forward_to_logits(m, cache, steps, n_seqs, 0, &n_logits));
    const exl_backend_ops *op = m->be->ops;
    if (n_logits > 0)
        EXL_TRY(op->download(m->be, logits, m->fs.logits, (size_t)n_logits * m->cfg.vocab_size * sizeof(float)));
    return op->synchronize(m->be);
}

int32_t exl_model_top_k_max(const exl_model *m) {
    if (!m->be->ops->top_k)
        return 0;
    return m->cfg.vocab_size < EXL_TOP_K_MAX ? m->cfg.vocab_size : EXL_TOP_K_MAX;
}

exl_status exl_model_forward_top_k(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                   int32_t k, int32_t *ids, float *vals) {
    if (k < 1 || k > exl_model_top_k_max(m))
        return exl_fail(EXL_ERR_ARG, "exl_model_forward_top_k: k = %d, the backend takes 1 .. %d", k,
                        exl_model_top_k_max(m));
    int32_t n_logits;
    EXL_TRY(exl_model_forward_to_logits(m, cache, steps, n_seqs, 0, &n_logits));
    if (n_logits > 0)
        EXL_TRY(m->be->ops->top_k(m->be, ids, vals, m->fs.logits, n_logits, m->cfg.vocab_size, k));
    return m->be->ops->synchronize(m->be);
}
