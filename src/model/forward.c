/* forward.c - the transformer forward pass, written once against the backend op table. */
#include "model/forward_internal.h"
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <stdint.h>
#include <string.h>


int32_t exl_model_max_rows(const exl_model *m) { return m->fs.max_rows; }


static exl_status alloc_buf(exl_model *m, void **p, size_t bytes) {
    *p = m->be->ops->alloc(m->be, bytes);
    return *p ? EXL_OK : exl_fail_prefix(EXL_ERR_NOMEM, "forward buffers");
}

/* Steps fall back to half as many tokens while the forward buffers do not fit, down to this. */
#define MIN_STEP_ROWS 64

/* The buffers for steps of R tokens (the page tables and the logits grow on demand). */
static exl_status alloc_rows(exl_model *m, size_t R) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    const size_t f = sizeof(float);
    const size_t qw = (size_t)c->n_heads * c->head_dim, kvw = (size_t)c->n_kv_heads * c->head_dim;
    EXL_TRY(alloc_buf(m, (void **)&s->x, R * c->hidden_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->h, R * c->hidden_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->q, R * qw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->k, R * kvw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->v, R * kvw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->attn, R * qw * f));
    EXL_TRY(alloc_buf(m, (void **)&s->gate, R * c->intermediate_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->up, R * c->intermediate_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->sel, R * c->hidden_size * f));
    EXL_TRY(alloc_buf(m, (void **)&s->inv_freq, (size_t)m->rot_dim / 2 * f));
    s->max_rows = (int32_t)R;
    s->rope_seq_len = -1;
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
    void *bufs[] = {s->x,  s->h,  s->q,   s->k,      s->v,     s->attn,
                    s->gate, s->up, s->sel, s->logits, s->table, s->inv_freq};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            be->ops->free(be, bufs[i]);
    exl_free(s->host_table);
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

static exl_status update_rope(exl_model *m, int32_t seq_len) {
    exl_forward_scratch *s = &m->fs;
    /* Only dynamic NTK scaling depends on the length, and only beyond max_pos. */
    if (m->cfg.rope.type != EXL_ROPE_DYNAMIC || seq_len < m->cfg.max_pos)
        seq_len = m->cfg.max_pos;
    if (s->rope_seq_len == seq_len)
        return EXL_OK;
    float inv_freq[512];
    exl_rope_frequencies(&m->cfg, m->rot_dim, seq_len, inv_freq, &s->rope_attn_factor);
    s->rope_seq_len = seq_len;
    return m->be->ops->upload(m->be, s->inv_freq, inv_freq, (size_t)m->rot_dim / 2 * sizeof(float));
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

static exl_status check_steps(const exl_model *m, const exl_kv_cache *cache, const exl_seq_step *steps,
                              int32_t n_seqs, int32_t *rows, int32_t *pages, int32_t *n_logits) {
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
                     .d_page_tables = s->page_tables};
    return update_rope(m, max_kv);
}

/* out[i] (+)= xin · W[i] as described for exl_matmul_fused: the backend's fused op, or the
 * unfused ops through the scratch buffer h (which must not be x, up or an output), always with a
 * hook (which sees each xin before its matmul). */
static exl_status matmul_fused(exl_model *m, const exl_matmul_fused *f, const exl_layer_hook *hook) {
    const exl_backend_ops *op = m->be->ops;
    exl_backend *be = m->be;
    exl_forward_scratch *s = &m->fs;
    if (op->matmul_fused && !hook) {
        op->matmul_fused(be, f);
        return EXL_OK;
    }
    const float *xin = f->x;
    int32_t in = f->in_features;
    if (f->norm) {
        op->rmsnorm(be, s->h, f->x, f->norm, f->rows, in, f->eps);
        xin = s->h;
    } else if (f->up) { /* in place: x is the forward's own gate buffer */
        op->glu(be, s->gate, f->up, f->rows, in, f->act); /* f->x is s->gate */
    }
    for (int32_t i = 0; i < f->n; i++) {
        if (hook && hook->fn)
            EXL_TRY(hook->fn(hook->user, hook->layer, f->w[i], xin, f->rows));
        if (f->accumulate) {
            op->matmul(be, s->h, xin, f->w[i], f->rows);
            op->add(be, f->out[i], s->h, (int64_t)f->rows * f->out_features[i]);
        } else {
            op->matmul(be, f->out[i], xin, f->w[i], f->rows);
        }
    }
    return EXL_OK;
}

static void rope_kv_store(exl_model *m, exl_kv_cache *cache, int li, const exl_batch *b, const exl_attn_shape *sh) {
    const exl_backend_ops *op = m->be->ops;
    exl_backend *be = m->be;
    exl_forward_scratch *s = &m->fs;
    if (op->rope_kv_store) {
        op->rope_kv_store(be, s->q, s->k, s->v, cache->k[li], cache->v[li], b, sh, m->rot_dim, s->inv_freq,
                          s->rope_attn_factor);
        return;
    }
    int32_t rows = b->n_rows;
    op->rope(be, s->q, b->d_pos, rows, sh->n_heads, sh->head_dim, m->rot_dim, s->inv_freq, s->rope_attn_factor);
    op->rope(be, s->k, b->d_pos, rows, sh->n_kv_heads, sh->head_dim, m->rot_dim, s->inv_freq, s->rope_attn_factor);
    op->kv_store(be, cache->k[li], cache->v[li], s->k, s->v, b, sh->n_kv_heads * sh->head_dim);
}

/* The attention block of layer li: x += o(attention(rope(q, k), v)) of the normed x. */
static exl_status attention_block(exl_model *m, const exl_layer *l, exl_kv_cache *cache, int li, const exl_batch *b,
                                  const exl_layer_hook *hook) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    int32_t rows = b->n_rows, hid = c->hidden_size, ffn = c->intermediate_size;
    int32_t qw = c->n_heads * c->head_dim, kvw = c->n_kv_heads * c->head_dim;
    int32_t decode = b->max_q == 1; /* see exl_matmul_fused.decode */
    exl_attn_shape shape = {c->n_heads, c->n_kv_heads, c->head_dim, cache->page_size, c->sliding_window,
                            1.0f / sqrtf((float)c->head_dim)};

    exl_matmul_fused qkv = {.rows = rows, .n = 3, .in_features = hid, .out_features = {qw, kvw, kvw},
                            .x = s->x, .norm = l->attn_norm, .eps = (float)c->rms_eps, .decode = decode,
                            .w = {l->q, l->k, l->v}, .out = {s->q, s->k, s->v}, .out_zero = decode && li > 0};
    if (decode) { /* the cache rows the attention reads next, for the backend to start loading */
        qkv.kv.k_cache = cache->k[li];
        qkv.kv.v_cache = cache->v[li];
        qkv.kv.seqs = b->d_seqs;
        qkv.kv.page_tables = b->d_page_tables;
        qkv.kv.n_seqs = b->n_seqs;
        qkv.kv.page_size = cache->page_size;
        qkv.kv.width = kvw;
    }
    EXL_TRY(matmul_fused(m, &qkv, hook));
    if (m->be->ops->rope_attention && !hook) {
        m->be->ops->rope_attention(m->be, s->attn, s->q, s->k, s->v, cache->k[li], cache->v[li], b, &shape,
                                   m->rot_dim, s->inv_freq, s->rope_attn_factor, l->o);
    } else {
        rope_kv_store(m, cache, li, b, &shape);
        m->be->ops->attention(m->be, s->attn, s->q, s->k, s->v, cache->k[li], cache->v[li], b, &shape);
    }
    exl_matmul_fused o = {.rows = rows, .n = 1, .in_features = qw, .out_features = {hid}, .x = s->attn,
                          .accumulate = 1, .decode = decode, .w = {l->o}, .out = {s->x}};
    if (decode)
        o.clear[0] = s->gate, o.clear[1] = s->up, o.n_clear[0] = o.n_clear[1] = (int64_t)rows * ffn;
    return matmul_fused(m, &o, hook);
}

/* The MLP block of layer li: x += down(act(gate) * up) of the normed x. */
static exl_status mlp_block(exl_model *m, const exl_layer *l, int li, const exl_batch *b, int32_t n_logits,
                            const exl_layer_hook *hook) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    int32_t rows = b->n_rows, hid = c->hidden_size, ffn = c->intermediate_size;
    int32_t qw = c->n_heads * c->head_dim, kvw = c->n_kv_heads * c->head_dim;
    int32_t decode = b->max_q == 1;
    EXL_TRY(matmul_fused(m,
                         &(exl_matmul_fused){.rows = rows, .n = 2, .in_features = hid, .out_features = {ffn, ffn},
                                             .x = s->x, .norm = l->mlp_norm, .eps = (float)c->rms_eps,
                                             .decode = decode, .w = {l->gate, l->up}, .out = {s->gate, s->up},
                                             .out_zero = decode, .feeds = l->down},
                         hook));
    exl_matmul_fused down = {.rows = rows, .n = 1, .in_features = ffn, .out_features = {hid}, .x = s->gate,
                             .up = s->up, .act = (int32_t)c->act, .accumulate = 1, .decode = decode,
                             .w = {l->down}, .out = {s->x}};
    if (decode && li + 1 < c->n_layers) {
        down.clear[0] = s->q, down.clear[1] = s->k, down.clear[2] = s->v;
        down.n_clear[0] = (int64_t)rows * qw, down.n_clear[1] = down.n_clear[2] = (int64_t)rows * kvw;
    } else if (decode && n_logits > 0) {
        down.clear[0] = s->logits, down.n_clear[0] = (int64_t)n_logits * c->vocab_size;
    }
    return matmul_fused(m, &down, hook);
}

/* One decoder layer. In decode steps each op that adds into the residual also clears the
 * buffers a later op will fill (exl_matmul_fused.clear): o_proj the MLP's gate and up, down_proj
 * the next layer's q, k and v, or the last one the logits (n_logits rows), so that a backend
 * may add split sums onto them instead of merging. */
exl_status exl_model_run_layer(exl_model *m, const exl_layer *l, exl_kv_cache *cache, int li, const exl_batch *b,
                               int32_t n_logits, const exl_layer_hook *hook) {
    if (l->q)
        EXL_TRY(attention_block(m, l, cache, li, b, hook));
    return l->gate ? mlp_block(m, l, li, b, n_logits, hook) : EXL_OK;
}

exl_status exl_model_step_batch(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs, int ahead,
                                exl_batch *b, int32_t *n_logits) {
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
    m->fs.fed_rows = 0; /* this step's table replaces them */
    return build_batch(m, cache, steps, n_seqs, rows, n_pages, fed, b);
}

exl_status exl_model_forward_to_logits(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                       int ahead, int32_t *n_logits) {
    exl_batch b;
    EXL_TRY(exl_model_step_batch(m, cache, steps, n_seqs, ahead, &b, n_logits));
    const exl_backend_ops *op = m->be->ops;
    exl_forward_scratch *s = &m->fs;
    op->embed(m->be, s->x, m->embed, b.d_ids, b.n_rows, m->embed_scale);
    for (int i = 0; i < m->cfg.n_layers; i++)
        EXL_TRY(exl_model_run_layer(m, &m->layers[i], cache, i, &b, *n_logits, NULL));
    if (*n_logits > 0) {
        op->gather_rows(m->be, s->sel, s->x, s->logit_rows, *n_logits, m->cfg.hidden_size);
        EXL_TRY(matmul_fused(m,
                             &(exl_matmul_fused){.rows = *n_logits, .n = 1, .in_features = m->cfg.hidden_size,
                                                 .out_features = {m->cfg.vocab_size}, .x = s->sel,
                                                 .norm = m->final_norm, .eps = (float)m->cfg.rms_eps,
                                                 .decode = b.max_q == 1, .w = {m->head}, .out = {s->logits},
                                                 .out_zero = b.max_q == 1 && m->cfg.n_layers > 0},
                             NULL));
    }
    return EXL_OK;
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
