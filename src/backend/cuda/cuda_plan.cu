/* cuda_plan.cu - a step's graph (graph.h) compiled into this backend's launches.
 *
 * Runs of nodes the model builds become one launch each where a fused kernel exists:
 *   rmsnorm into h, then 1-3 matmuls of h (h dead after them)     -> a fused matmul with the norm
 *   glu of g and u, then a matmul of g (g dead after it)           -> a fused matmul with the GLU
 *   1-3 matmuls of one input; a matmul that accumulates            -> a fused matmul (residual add: accumulate)
 *   rope q, rope k, kv_store, then attention over them             -> rope_attention (q and k dead after it where
 *                                                                     the one-launch kernel takes it, which leaves
 *                                                                     them unrotated); without attention rope_kv_store
 *   all_reduce of y, then x += y (tensor parallelism's residual)   -> one launch where the push all-reduce takes it
 *                                                                     (cuda_comm.cu), y written too
 *   gather_cols into y, then x += y (the same, o_proj by columns)  -> one launch where the push gather takes it
 * A buffer is dead after a node when it is no graph output and the next node to touch it overwrites it whole
 * without reading it (or none does). Then, over the launches, what the kernels can do with what the graph says:
 *   - slot order: a GEMV computing gate and up that only the next launch reads, a GEMV of the GLU and down_proj,
 *     stores them in down_proj's slot order, which that one then reads as consecutive rows; the same for the
 *     one-launch decode attention and the o_proj GEMV after it;
 *   - split sums without a merge (decode steps): a GEMV whose outputs the GEMV before it can zero (no launch in
 *     between touches them) has them zeroed there and adds its split sums onto them with atomics;
 *   - KV L2 prefetch (decode steps): the GEMV before an attention asks L2 for the cache rows it will read;
 *   - LoRA (one-row decode steps): a lora node beside the GEMV of its projections is folded into it (first, so that
 *     the passes above see the launches as without adapters); with EXL_CUDA_LORA_OVERLAP, a lora node of the batch
 *     path is handed to the matmul beside it, its shrink on a second stream while the matmul runs (last).
 * A plan holds its own copy of the graph (nodes field by field, the batch's device side), which its launches
 * refer to and which cuda_graph.cu compares with the next steps' graphs. */
#include "backend/cuda/cuda_internal.h"

#include <stdlib.h>
#include <string.h>

/* ---- the graph's copy */

exl_batch exl_cuda_device_batch(const exl_batch *b) {
    exl_batch d;
    memset(&d, 0, sizeof d);
    d.n_rows = b->n_rows, d.n_seqs = b->n_seqs, d.max_q = b->max_q;
    d.max_kv = (b->max_kv + EXL_CUDA_KV_BUCKET - 1) / EXL_CUDA_KV_BUCKET * EXL_CUDA_KV_BUCKET;
    d.d_seqs = b->d_seqs, d.d_ids = b->d_ids, d.d_pos = b->d_pos, d.d_slots = b->d_slots;
    d.d_page_tables = b->d_page_tables;
    d.kv = b->kv;
    return d;
}

/* n copied field by field into zeroed memory, so that equal nodes are equal bytes */
static exl_node canonical(const exl_node *n) {
    exl_node c;
    memset(&c, 0, sizeof c);
    c.op = n->op;
    c.tag.layer = n->tag.layer, c.tag.part = n->tag.part;
    switch (n->op) {
    case EXL_OP_EMBED: {
        const exl_embed_node &a = n->embed;
        exl_embed_node &o = c.embed;
        o.out = a.out, o.table = a.table, o.ids = a.ids, o.rows = a.rows, o.width = a.width, o.scale = a.scale;
        break;
    }
    case EXL_OP_RMSNORM: {
        const exl_rmsnorm_node &a = n->rmsnorm;
        exl_rmsnorm_node &o = c.rmsnorm;
        o.out = a.out, o.x = a.x, o.w = a.w, o.rows = a.rows, o.width = a.width, o.eps = a.eps;
        break;
    }
    case EXL_OP_MATMUL: {
        const exl_matmul_node &a = n->matmul;
        exl_matmul_node &o = c.matmul;
        o.out = a.out, o.x = a.x, o.w = a.w, o.rows = a.rows, o.in_features = a.in_features;
        o.out_features = a.out_features, o.accumulate = a.accumulate;
        break;
    }
    case EXL_OP_ROPE: {
        const exl_rope_node &a = n->rope;
        exl_rope_node &o = c.rope;
        o.x = a.x, o.pos = a.pos, o.inv_freq = a.inv_freq, o.rows = a.rows, o.n_heads = a.n_heads;
        o.head_dim = a.head_dim, o.rot_dim = a.rot_dim, o.attn_factor = a.attn_factor;
        break;
    }
    case EXL_OP_KV_STORE: {
        const exl_kv_store_node &a = n->kv_store;
        exl_kv_store_node &o = c.kv_store;
        o.k_cache = a.k_cache, o.v_cache = a.v_cache, o.k = a.k, o.v = a.v, o.width = a.width;
        break;
    }
    case EXL_OP_ATTENTION: {
        const exl_attention_node &a = n->attention;
        exl_attention_node &o = c.attention;
        o.out = a.out, o.q = a.q, o.k = a.k, o.v = a.v, o.k_cache = a.k_cache, o.v_cache = a.v_cache;
        o.shape.n_heads = a.shape.n_heads, o.shape.n_kv_heads = a.shape.n_kv_heads;
        o.shape.head_dim = a.shape.head_dim, o.shape.page_size = a.shape.page_size;
        o.shape.sliding_window = a.shape.sliding_window, o.shape.scale = a.shape.scale;
        o.shape.softcap = a.shape.softcap;
        break;
    }
    case EXL_OP_GLU: {
        const exl_glu_node &a = n->glu;
        exl_glu_node &o = c.glu;
        o.x = a.x, o.up = a.up, o.rows = a.rows, o.width = a.width, o.act = a.act;
        break;
    }
    case EXL_OP_ADD: c.add.x = n->add.x, c.add.y = n->add.y, c.add.n = n->add.n; break;
    case EXL_OP_GATHER_ROWS: {
        const exl_gather_rows_node &a = n->gather_rows;
        exl_gather_rows_node &o = c.gather_rows;
        o.out = a.out, o.x = a.x, o.idx = a.idx, o.n = a.n, o.width = a.width, o.x_rows = a.x_rows;
        break;
    }
    case EXL_OP_COPY_COLS: {
        const exl_copy_cols_node &a = n->copy_cols;
        exl_copy_cols_node &o = c.copy_cols;
        o.out = a.out, o.x = a.x, o.rows = a.rows, o.width = a.width, o.x_width = a.x_width, o.col = a.col;
        break;
    }
    case EXL_OP_SOFTCAP: c.softcap.x = n->softcap.x, c.softcap.n = n->softcap.n, c.softcap.cap = n->softcap.cap; break;
    case EXL_OP_ROW_GATE: {
        const exl_row_gate_node &a = n->row_gate;
        exl_row_gate_node &o = c.row_gate;
        o.x = a.x, o.g = a.g, o.rows = a.rows, o.width = a.width;
        break;
    }
    case EXL_OP_MOE_ROUTE: {
        const exl_moe_route_node &a = n->moe_route;
        exl_moe_route_node &o = c.moe_route;
        o.weights = a.weights, o.ids = a.ids, o.logits = a.logits, o.rows = a.rows, o.n_experts = a.n_experts;
        o.top_k = a.top_k, o.renormalize = a.renormalize;
        break;
    }
    case EXL_OP_MOE_EXPERTS: {
        const exl_moe_experts_node &a = n->moe_experts;
        exl_moe_experts_node &o = c.moe_experts;
        o.out = a.out, o.x = a.x, o.ids = a.ids, o.weights = a.weights, o.experts = a.experts, o.rows = a.rows;
        o.width = a.width, o.ffn = a.ffn, o.n_experts = a.n_experts, o.top_k = a.top_k, o.act = a.act;
        o.xs = a.xs, o.gate = a.gate, o.up = a.up, o.slots = a.slots;
        break;
    }
    case EXL_OP_ALL_REDUCE: c.all_reduce.x = n->all_reduce.x, c.all_reduce.n = n->all_reduce.n; break;
    case EXL_OP_GATHER_COLS: {
        const exl_gather_cols_node &a = n->gather_cols;
        exl_gather_cols_node &o = c.gather_cols;
        o.out = a.out, o.x = a.x, o.cols = a.cols, o.rows = a.rows, o.out_width = a.out_width;
        o.n_ranks = a.n_ranks, o.rank = a.rank, o.tmp = a.tmp;
        break;
    }
    case EXL_OP_LORA: {
        const exl_lora_node &a = n->lora;
        exl_lora_node &o = c.lora;
        for (int32_t i = 0; i < EXL_LORA_MAX_OUT; i++)
            o.out[i] = a.out[i], o.factors[i] = a.factors[i], o.out_features[i] = a.out_features[i];
        o.norm = a.norm, o.up = a.up, o.eps = a.eps, o.act = a.act;
        o.n_out = a.n_out, o.x = a.x, o.row_uses = a.row_uses, o.use_row = a.use_row, o.use_slot = a.use_slot;
        o.use_scale = a.use_scale, o.by_adapter = a.by_adapter, o.t = a.t, o.rows = a.rows,
        o.in_features = a.in_features, o.n_uses = a.n_uses;
        o.max_rank = a.max_rank;
        break;
    }
    }
    return c;
}

int exl_cuda_plan_matches(const exl_cuda_plan *p, const exl_graph *g) {
    if (p->n_nodes != g->n_nodes || p->has_batch != (g->batch != NULL))
        return 0;
    if (g->batch) {
        exl_batch d = exl_cuda_device_batch(g->batch);
        if (memcmp(&d, &p->batch, sizeof d))
            return 0;
    }
    for (int32_t i = 0; i < g->n_nodes; i++) {
        exl_node c = canonical(&g->nodes[i]);
        if (memcmp(&c, &p->nodes[i], sizeof c))
            return 0;
    }
    return 1;
}

/* ---- compiling */

typedef struct compiler {
    exl_cuda_backend *cb;
    const exl_graph *g;
    exl_cuda_plan *p;
    int32_t batch_rows;
    int zero_normed; /* untouched_of: EXL_CUDA_ZERO_NORMED, default 1 */
} compiler;

static exl_span span(const float *p, int64_t n) {
    exl_span s = {p, n};
    return s;
}

/* 1 if w covers s */
static int covers(exl_span w, exl_span s) { return w.p <= s.p && s.p + s.n <= w.p + w.n; }

/* 1 if s is dead after node i (see the top) */
static int dead_after(const compiler *c, int32_t i, exl_span s) {
    for (int32_t o = 0; o < c->g->n_outputs; o++)
        if (exl_spans_overlap(c->g->outputs[o], s))
            return 0;
    for (int32_t j = i + 1; j < c->p->n_nodes; j++) {
        exl_node_access a = exl_node_access_of(&c->p->nodes[j], c->batch_rows);
        for (int32_t r = 0; r < a.n_reads; r++)
            if (exl_spans_overlap(a.reads[r], s))
                return 0;
        for (int32_t w = 0; w < a.n_writes; w++)
            if (covers(a.writes[w], s))
                return 1;
    }
    return 1;
}

static int is_gemv(const compiler *c, const exl_cuda_plan_item *l) {
    return l->kind == EXL_CUDA_RUN_MATMUL && exl_cuda_qgemv_takes(c->cb, &l->mm);
}

/* The buffer a GEMV launch with its input's norm fused never touches: the norm's output, which its matmuls read in
 * the graph but the kernel computes from the norm's input as it gathers (dead after the launch: try_norm). So the
 * launch can zero it for a later GEMV (tensor parallelism's o_proj and down_proj write their partial sums there
 * before the all-reduce). EXL_CUDA_ZERO_NORMED=0 counts it as touched (the A/B). */
static exl_span untouched_of(const compiler *c, const exl_cuda_plan_item *l) {
    exl_span none = {NULL, 0};
    if (!c->zero_normed || l->kind != EXL_CUDA_RUN_MATMUL || !l->mm.norm || !is_gemv(c, l))
        return none;
    for (int32_t j = l->node; j < l->node + l->n_nodes; j++) {
        const exl_node *n = &c->p->nodes[j];
        if (n->op == EXL_OP_RMSNORM)
            return span(n->rmsnorm.out, (int64_t)n->rmsnorm.rows * n->rmsnorm.width);
    }
    return none;
}

/* 1 if a node of launch l reads or writes s (as the launch runs them) */
static int touches(const compiler *c, const exl_cuda_plan_item *l, exl_span s) {
    const exl_span skip = untouched_of(c, l);
    for (int32_t j = l->node; j < l->node + l->n_nodes; j++) {
        exl_node_access a = exl_node_access_of(&c->p->nodes[j], c->batch_rows);
        for (int32_t r = 0; r < a.n_reads; r++)
            if (exl_spans_overlap(a.reads[r], s) && !(skip.n && covers(skip, a.reads[r])))
                return 1;
        for (int32_t w = 0; w < a.n_writes; w++)
            if (exl_spans_overlap(a.writes[w], s) && !(skip.n && covers(skip, a.writes[w])))
                return 1;
    }
    return 0;
}

static exl_cuda_plan_item *add_launch(compiler *c, exl_cuda_item_kind kind, int32_t node, int32_t n_nodes) {
    exl_cuda_plan *p = c->p;
    if (p->n_launches == p->cap_launches) {
        int32_t cap = p->cap_launches ? 2 * p->cap_launches : 256;
        exl_cuda_plan_item *l = (exl_cuda_plan_item *)realloc(p->launches, (size_t)cap * sizeof *l);
        if (!l)
            return NULL;
        p->launches = l;
        p->cap_launches = cap;
    }
    exl_cuda_plan_item *l = &p->launches[p->n_launches++];
    memset(l, 0, sizeof *l);
    l->kind = kind, l->node = node, l->n_nodes = n_nodes;
    return l;
}

/* a fused matmul launch of nodes [node, node + n_nodes) whose last k are matmuls of rows over in inputs */
static exl_cuda_plan_item *add_matmul(compiler *c, int32_t node, int32_t n_nodes, int32_t k, int32_t rows, int32_t in) {
    exl_cuda_plan_item *l = add_launch(c, EXL_CUDA_RUN_MATMUL, node, n_nodes);
    if (!l)
        return NULL;
    exl_cuda_fused_mm *f = &l->mm;
    f->rows = rows, f->n = k, f->in_features = in;
    f->decode = c->p->has_batch && c->p->batch.max_q == 1;
    for (int32_t i = 0; i < k; i++) {
        const exl_matmul_node *m = &c->p->nodes[node + n_nodes - k + i].matmul;
        f->w[i] = m->w, f->out[i] = m->out, f->out_features[i] = m->out_features;
    }
    return l;
}

/* the matmuls from node j on that may join one launch over x (rows, in): at most max, none accumulating, their
 * outputs apart from each other and from the spans in avoid */
static int32_t matmul_run(const compiler *c, int32_t j, const float *x, int32_t rows, int32_t in, int32_t max,
                          const exl_span *avoid, int n_avoid) {
    exl_span outs[3];
    int32_t k = 0;
    for (; k < max && j + k < c->p->n_nodes; k++) {
        const exl_node *n = &c->p->nodes[j + k];
        if (n->op != EXL_OP_MATMUL)
            break;
        const exl_matmul_node *m = &n->matmul;
        if (m->x != x || m->rows != rows || m->in_features != in || m->accumulate)
            break;
        exl_span o = span(m->out, (int64_t)rows * m->out_features);
        int clash = 0;
        for (int a = 0; a < n_avoid; a++)
            clash |= exl_spans_overlap(o, avoid[a]);
        for (int32_t e = 0; e < k; e++)
            clash |= exl_spans_overlap(o, outs[e]);
        if (clash)
            break;
        outs[k] = o;
    }
    return k;
}

/* rmsnorm then the matmuls of its output: nodes taken (0: the pattern does not apply) */
static int32_t try_norm(compiler *c, int32_t i, int *oom) {
    const exl_rmsnorm_node *r = &c->p->nodes[i].rmsnorm;
    exl_span avoid[2] = {span(r->out, (int64_t)r->rows * r->width), span(r->x, (int64_t)r->rows * r->width)};
    int32_t k = matmul_run(c, i + 1, r->out, r->rows, r->width, 3, avoid, 2);
    if (k == 0 || !dead_after(c, i + k, avoid[0]))
        return 0;
    exl_cuda_plan_item *l = add_matmul(c, i, k + 1, k, r->rows, r->width);
    if (!l)
        return *oom = 1, 0;
    l->mm.x = r->x, l->mm.norm = r->w, l->mm.eps = r->eps;
    return k + 1;
}

/* glu then a matmul of its output */
static int32_t try_glu(compiler *c, int32_t i, int *oom) {
    const exl_glu_node *u = &c->p->nodes[i].glu;
    if (i + 1 >= c->p->n_nodes || c->p->nodes[i + 1].op != EXL_OP_MATMUL)
        return 0;
    const exl_matmul_node *m = &c->p->nodes[i + 1].matmul;
    exl_span g = span(u->x, (int64_t)u->rows * u->width), up = span(u->up, (int64_t)u->rows * u->width);
    exl_span o = span(m->out, (int64_t)m->rows * m->out_features);
    if (m->x != u->x || m->rows != u->rows || m->in_features != u->width || exl_spans_overlap(o, g) ||
        exl_spans_overlap(o, up) || !dead_after(c, i + 1, g))
        return 0;
    exl_cuda_plan_item *l = add_matmul(c, i, 2, 1, u->rows, u->width);
    if (!l)
        return *oom = 1, 0;
    l->mm.x = u->x, l->mm.up = u->up, l->mm.act = u->act, l->mm.accumulate = m->accumulate;
    return 2;
}

/* matmuls of one input, or one that accumulates */
static int32_t try_matmuls(compiler *c, int32_t i, int *oom) {
    const exl_matmul_node *m = &c->p->nodes[i].matmul;
    exl_span x = span(m->x, (int64_t)m->rows * m->in_features);
    int32_t k = m->accumulate ? 1 : matmul_run(c, i, m->x, m->rows, m->in_features, 3, &x, 1);
    k = k > 0 ? k : 1; /* one whose output overlaps its input, against the graph's rules: as it is */
    exl_cuda_plan_item *l = add_matmul(c, i, k, k, m->rows, m->in_features);
    if (!l)
        return *oom = 1, 0;
    l->mm.x = m->x, l->mm.accumulate = m->accumulate;
    return k;
}

/* rope q, rope k, kv_store (, attention) */
static int32_t try_rope(compiler *c, int32_t i, int *oom) {
    const exl_cuda_plan *p = c->p;
    if (!p->has_batch || i + 2 >= p->n_nodes || p->nodes[i + 1].op != EXL_OP_ROPE ||
        p->nodes[i + 2].op != EXL_OP_KV_STORE)
        return 0;
    const exl_rope_node *q = &p->nodes[i].rope, *k = &p->nodes[i + 1].rope;
    const exl_kv_store_node *kv = &p->nodes[i + 2].kv_store;
    const int32_t rows = p->batch.n_rows;
    if (q->pos != p->batch.d_pos || k->pos != p->batch.d_pos || q->rows != rows || k->rows != rows ||
        q->inv_freq != k->inv_freq || q->rot_dim != k->rot_dim || q->head_dim != k->head_dim ||
        q->attn_factor != k->attn_factor || k->x != kv->k || kv->width != k->n_heads * k->head_dim ||
        exl_spans_overlap(span(q->x, (int64_t)rows * q->n_heads * q->head_dim), span(k->x, (int64_t)rows * kv->width)))
        return 0;
    int32_t n = 3;
    exl_cuda_item_kind kind = EXL_CUDA_RUN_ROPE_KV_STORE;
    if (i + 3 < p->n_nodes && p->nodes[i + 3].op == EXL_OP_ATTENTION) {
        const exl_attention_node *a = &p->nodes[i + 3].attention;
        const int fuses = exl_cuda_rope_attention_fuses(c->cb, &p->batch, &a->shape, q->rot_dim);
        if (a->q == q->x && a->k == kv->k && a->v == kv->v && a->k_cache == kv->k_cache && a->v_cache == kv->v_cache &&
            a->shape.n_heads == q->n_heads && a->shape.n_kv_heads == k->n_heads && a->shape.head_dim == q->head_dim &&
            (!fuses || (dead_after(c, i + 3, span(q->x, (int64_t)rows * q->n_heads * q->head_dim)) &&
                        dead_after(c, i + 3, span(k->x, (int64_t)rows * kv->width)))))
            n = 4, kind = EXL_CUDA_RUN_ROPE_ATTENTION;
    }
    if (!add_launch(c, kind, i, n))
        return *oom = 1, 0;
    return n;
}

/* all_reduce of y, then x += y */
static int32_t try_all_reduce(compiler *c, int32_t i, int *oom) {
    const exl_all_reduce_node *r = &c->p->nodes[i].all_reduce;
    if (i + 1 >= c->p->n_nodes || c->p->nodes[i + 1].op != EXL_OP_ADD)
        return 0;
    const exl_add_node *a = &c->p->nodes[i + 1].add;
    if (a->y != r->x || a->n != r->n || exl_spans_overlap(span(a->x, a->n), span(r->x, r->n)))
        return 0;
    if (!add_launch(c, EXL_CUDA_RUN_ALL_REDUCE_ADD, i, 2))
        return *oom = 1, 0;
    return 2;
}

/* gather_cols into y, then x += y */
static int32_t try_gather(compiler *c, int32_t i, int *oom) {
    const exl_gather_cols_node *g = &c->p->nodes[i].gather_cols;
    if (i + 1 >= c->p->n_nodes || c->p->nodes[i + 1].op != EXL_OP_ADD)
        return 0;
    const exl_add_node *a = &c->p->nodes[i + 1].add;
    const int64_t n = (int64_t)g->rows * g->out_width;
    if (a->y != g->out || a->n != n || exl_spans_overlap(span(a->x, a->n), span(g->out, n)))
        return 0;
    if (!add_launch(c, EXL_CUDA_RUN_GATHER_ADD, i, 2))
        return *oom = 1, 0;
    return 2;
}

/* ---- what the launches can do with what the graph says (see the top) */

static const exl_attention_node *attention_of(const compiler *c, const exl_cuda_plan_item *l) {
    if (l->kind == EXL_CUDA_RUN_ROPE_ATTENTION)
        return &c->p->nodes[l->node + 3].attention;
    if (l->kind == EXL_CUDA_RUN_NODE && c->p->nodes[l->node].op == EXL_OP_ATTENTION)
        return &c->p->nodes[l->node].attention;
    return NULL;
}

/* the GEMV before each attention asks L2 for its cache rows */
static void plan_kv_prefetch(compiler *c) {
    const exl_batch *b = &c->p->batch;
    for (int32_t i = 1; i < c->p->n_launches; i++) {
        const exl_attention_node *a = attention_of(c, &c->p->launches[i]);
        int32_t j = i - 1;
        while (j > 0 && c->p->launches[j].kind != EXL_CUDA_RUN_MATMUL)
            j--;
        exl_cuda_plan_item *g = &c->p->launches[j];
        if (!a || !is_gemv(c, g) || g->mm.kv.k_cache || exl_cuda_kv_quantized(b)) /* rows of fp16 only */
            continue;
        g->mm.kv.k_cache = a->k_cache, g->mm.kv.v_cache = a->v_cache;
        g->mm.kv.seqs = b->d_seqs, g->mm.kv.page_tables = b->d_page_tables, g->mm.kv.n_seqs = b->n_seqs;
        g->mm.kv.page_size = a->shape.page_size, g->mm.kv.width = a->shape.n_kv_heads * a->shape.head_dim;
    }
}

/* producers that store their outputs in the slot order of the GEMV after them, which reads only those */
static void plan_slot_order(compiler *c) {
    for (int32_t i = 0; i + 1 < c->p->n_launches; i++) {
        exl_cuda_plan_item *pr = &c->p->launches[i], *co = &c->p->launches[i + 1];
        if (co->kind != EXL_CUDA_RUN_MATMUL || co->mm.n != 1 || co->mm.norm || !is_gemv(c, co))
            continue;
        const int32_t *order = exl_cuda_slot_order(co->mm.w[0], co->mm.rows, co->mm.in_features);
        const int32_t last = co->node + co->n_nodes - 1;
        const int64_t n = (int64_t)co->mm.rows * co->mm.in_features;
        if (!order)
            continue;
        if (pr->kind == EXL_CUDA_RUN_MATMUL) { /* gate and up for the GLU and down_proj */
            const exl_cuda_fused_mm *f = &pr->mm;
            if (f->n == 2 && !f->up && f->rows == co->mm.rows && f->out[0] == co->mm.x && f->out[1] == co->mm.up &&
                f->out_features[0] == co->mm.in_features && f->out_features[1] == co->mm.in_features &&
                is_gemv(c, pr) && dead_after(c, last, span(f->out[0], n)) && dead_after(c, last, span(f->out[1], n)))
                pr->mm.out_map = order, co->mm.x_slots = 1;
        } else if (pr->kind == EXL_CUDA_RUN_ROPE_ATTENTION) { /* the attention output for o_proj */
            const exl_attention_node *a = attention_of(c, pr);
            const int32_t rot = c->p->nodes[pr->node].rope.rot_dim;
            if (!co->mm.up && co->mm.x == a->out && co->mm.rows == c->p->batch.n_rows &&
                exl_cuda_rope_attention_fuses(c->cb, &c->p->batch, &a->shape, rot) &&
                dead_after(c, last, span(a->out, n)))
                pr->out_order = order, co->mm.x_slots = 1;
        }
    }
}

/* one-row lora nodes folded into the GEMV of their projections right before them (q/k/v, o, gate/up) or right after
 * (down_proj's, whose GLU input is read before the GLU), which then adds their updates itself (cuda_lora_fold.cuh):
 * their launches leave the plan, and the GEMV's nodes take them in, so that the passes below see the launches beside
 * each other as without adapters */
static void plan_lora_fold(compiler *c) {
    exl_cuda_plan *p = c->p;
    int32_t kept = 0;
    for (int32_t i = 0; i < p->n_launches; i++) {
        exl_cuda_plan_item *l = &p->launches[i];
        if (l->kind == EXL_CUDA_RUN_NODE && p->nodes[l->node].op == EXL_OP_LORA) {
            const exl_lora_node *n = &p->nodes[l->node].lora;
            exl_cuda_plan_item *prev = kept > 0 ? &p->launches[kept - 1] : NULL;
            exl_cuda_plan_item *next = i + 1 < p->n_launches ? &p->launches[i + 1] : NULL;
            if (prev && prev->kind == EXL_CUDA_RUN_MATMUL && !prev->mm.lora && prev->node + prev->n_nodes == l->node &&
                exl_cuda_qgemv_lora_fits(c->cb, &prev->mm, n)) {
                prev->mm.lora = n, prev->n_nodes++;
                continue;
            }
            if (next && next->kind == EXL_CUDA_RUN_MATMUL && !next->mm.lora && next->node == l->node + 1 &&
                exl_cuda_qgemv_lora_fits(c->cb, &next->mm, n)) {
                next->mm.lora = n, next->node--, next->n_nodes++;
                continue;
            }
        }
        if (kept != i)
            p->launches[kept] = *l;
        kept++;
    }
    p->n_launches = kept;
}

/* GEMVs whose outputs the GEMV before them zeroes */
static void plan_zeroing(compiler *c) {
    for (int32_t i = 1; i < c->p->n_launches; i++) {
        exl_cuda_plan_item *w = &c->p->launches[i];
        if (!is_gemv(c, w) || w->mm.accumulate)
            continue;
        exl_span outs[3];
        for (int k = 0; k < w->mm.n; k++)
            outs[k] = span(w->mm.out[k], (int64_t)w->mm.rows * w->mm.out_features[k]);
        for (int32_t j = i - 1; j >= 0; j--) {
            exl_cuda_plan_item *z = &c->p->launches[j];
            int touched = 0;
            for (int k = 0; k < w->mm.n; k++)
                touched |= touches(c, z, outs[k]);
            if (touched)
                break;
            if (!is_gemv(c, z))
                continue;
            int free_slots = 0;
            for (int k = 0; k < 3; k++)
                free_slots += z->mm.clear[k] == NULL;
            if (free_slots >= w->mm.n) {
                for (int k = 0, s = 0; k < w->mm.n; k++, s++) {
                    while (z->mm.clear[s])
                        s++;
                    z->mm.clear[s] = (float *)outs[k].p, z->mm.n_clear[s] = outs[k].n;
                }
                w->mm.out_zeroed = 1;
            }
            break;
        }
    }
}

/* 1 if matmul launch m's kernels write into s: its outputs, the spans it zeroes for a later GEMV, and x where the GLU
 * of dense weights is computed in place (cuda_matmul.cu); a fused norm's or GLU's output is never stored (dead after
 * the launch: try_norm, try_glu) */
static int matmul_writes(const exl_cuda_plan_item *m, exl_span s) {
    const exl_cuda_fused_mm *f = &m->mm;
    int dense = 0;
    for (int k = 0; k < f->n; k++) {
        dense |= f->w[k]->kind == EXL_LINEAR_DENSE;
        if (exl_spans_overlap(span(f->out[k], (int64_t)f->rows * f->out_features[k]), s))
            return 1;
    }
    for (int k = 0; k < 3; k++)
        if (f->clear[k] && exl_spans_overlap(span(f->clear[k], f->n_clear[k]), s))
            return 1;
    return f->up && dense && exl_spans_overlap(span(f->x, (int64_t)f->rows * f->in_features), s);
}

/* 1 if lora node n may be added after matmul launch m instead of before it: m neither reads nor zeroes n's outputs,
 * and where it writes them it adds onto them */
static int lora_commutes(const exl_cuda_plan_item *m, const exl_lora_node *n) {
    const exl_cuda_fused_mm *f = &m->mm;
    const int64_t in = (int64_t)f->rows * f->in_features;
    for (int32_t o = 0; o < n->n_out; o++) {
        const exl_span s = span(n->out[o], (int64_t)n->rows * n->out_features[o]);
        if (exl_spans_overlap(span(f->x, in), s) || (f->up && exl_spans_overlap(span(f->up, in), s)))
            return 0;
        for (int k = 0; k < 3; k++)
            if (f->clear[k] && exl_spans_overlap(span(f->clear[k], f->n_clear[k]), s))
                return 0;
        for (int k = 0; k < f->n && !f->accumulate; k++)
            if (exl_spans_overlap(span(f->out[k], (int64_t)f->rows * f->out_features[k]), s))
                return 0;
    }
    return 1;
}

/* 1 if launch m is a matmul that can take lora node n beside it: the shrink, reading n's input while m runs */
static int lora_beside(const exl_cuda_plan_item *m, const exl_lora_node *n) {
    const int64_t len = (int64_t)n->rows * n->in_features;
    return m->kind == EXL_CUDA_RUN_MATMUL && !m->side_lora && !m->mm.lora && !matmul_writes(m, span(n->x, len)) &&
           !(n->up && matmul_writes(m, span(n->up, len)));
}

/* lora nodes of the batch path handed to the matmul launch beside them (exl_cuda_lora_overlaps): the one right before
 * (the projections' own: the node's launch stays after it, as the expand), else the one right after, whose outputs
 * the node's updates may be added after instead (down_proj's, adding onto the residual); their launches leave the
 * plan. After the other passes, which see the plan as without it. */
static void plan_lora_overlap(compiler *c) {
    exl_cuda_plan *p = c->p;
    int32_t kept = 0;
    for (int32_t i = 0; i < p->n_launches; i++) {
        exl_cuda_plan_item *l = &p->launches[i];
        if (l->kind == EXL_CUDA_RUN_NODE && p->nodes[l->node].op == EXL_OP_LORA &&
            exl_cuda_lora_overlaps(c->cb, &p->nodes[l->node].lora)) {
            const exl_lora_node *n = &p->nodes[l->node].lora;
            exl_cuda_plan_item *prev = kept > 0 ? &p->launches[kept - 1] : NULL;
            exl_cuda_plan_item *next = i + 1 < p->n_launches ? &p->launches[i + 1] : NULL;
            if (prev && prev->node + prev->n_nodes == l->node && lora_beside(prev, n)) {
                prev->side_lora = n, prev->n_nodes++;
                continue;
            }
            if (next && next->node == l->node + 1 && lora_beside(next, n) && lora_commutes(next, n)) {
                next->side_lora = n, next->node--, next->n_nodes++;
                continue;
            }
        }
        if (kept != i)
            p->launches[kept] = *l;
        kept++;
    }
    p->n_launches = kept;
}

static int node_rows(const exl_node *n, int32_t batch_rows) {
    switch (n->op) {
    case EXL_OP_EMBED: return n->embed.rows;
    case EXL_OP_RMSNORM: return n->rmsnorm.rows;
    case EXL_OP_MATMUL: return n->matmul.rows;
    case EXL_OP_ROPE: return n->rope.rows;
    case EXL_OP_GLU: return n->glu.rows;
    case EXL_OP_GATHER_ROWS: return n->gather_rows.n;
    case EXL_OP_COPY_COLS: return n->copy_cols.rows;
    case EXL_OP_ROW_GATE: return n->row_gate.rows;
    case EXL_OP_MOE_ROUTE: return n->moe_route.rows;
    case EXL_OP_MOE_EXPERTS: return n->moe_experts.rows;
    case EXL_OP_GATHER_COLS: return n->gather_cols.rows;
    case EXL_OP_ADD:
    case EXL_OP_ALL_REDUCE:
    case EXL_OP_SOFTCAP: return 0;
    default: return batch_rows;
    }
}

/* a step with prompt pieces (exl_cuda_prompt_piece: more new tokens in a sequence than a decode or verification
 * step has) */
static int prompt_piece(const exl_cuda_plan *p) { return p->has_batch && exl_cuda_prompt_piece(&p->batch); }

/* a decode-sized step: at most EXL_CUDA_GRAPH_MAX_ROWS rows, no prompt pieces (which the attention marks, run
 * directly; verification steps of up to EXL_CUDA_VERIFY_MAX_Q tokens a sequence are captured, and a step of the same
 * K + 1 rows, context within the same EXL_CUDA_KV_BUCKET, matches it: exl_cuda_plan_matches), its mixtures of
 * experts on the device alone */
static int graphable(const exl_cuda_backend *cb, const exl_cuda_plan *p) {
    for (int32_t i = 0; i < p->n_nodes; i++) {
        const exl_node *n = &p->nodes[i];
        if (node_rows(n, p->batch.n_rows) > EXL_CUDA_GRAPH_MAX_ROWS || (n->op == EXL_OP_ATTENTION && prompt_piece(p)) ||
            (n->op == EXL_OP_MOE_EXPERTS && (prompt_piece(p) || !exl_cuda_moe_on_device(cb, &n->moe_experts))))
            return 0;
    }
    return 1;
}

exl_status exl_cuda_plan_compile(exl_cuda_backend *cb, const exl_graph *g, exl_cuda_plan *p) {
    p->n_nodes = p->n_launches = 0;
    if (g->n_nodes > p->cap_nodes) {
        exl_node *n = (exl_node *)realloc(p->nodes, (size_t)g->n_nodes * sizeof *n);
        if (!n)
            return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory compiling a step");
        p->nodes = n;
        p->cap_nodes = g->n_nodes;
    }
    p->has_batch = g->batch != NULL;
    if (g->batch)
        p->batch = exl_cuda_device_batch(g->batch);
    else
        memset(&p->batch, 0, sizeof p->batch);
    for (int32_t i = 0; i < g->n_nodes; i++) {
        p->nodes[i] = canonical(&g->nodes[i]);
        const exl_op op = p->nodes[i].op;
        if ((op == EXL_OP_KV_STORE || op == EXL_OP_ATTENTION) && !g->batch)
            return exl_cuda_fail(EXL_ERR_ARG, "graph: layer %d: kv_store or attention in a graph without a batch",
                                 p->nodes[i].tag.layer);
    }
    p->n_nodes = g->n_nodes;
    p->graphable = graphable(cb, p);
    const char *zero_normed = getenv("EXL_CUDA_ZERO_NORMED");
    compiler c = {cb, g, p, p->batch.n_rows, !zero_normed || strcmp(zero_normed, "0")};
    int oom = 0;
    for (int32_t i = 0; i < p->n_nodes && !oom;) {
        int32_t taken = 0;
        switch (p->nodes[i].op) {
        case EXL_OP_RMSNORM: taken = try_norm(&c, i, &oom); break;
        case EXL_OP_GLU: taken = try_glu(&c, i, &oom); break;
        case EXL_OP_MATMUL: taken = try_matmuls(&c, i, &oom); break;
        case EXL_OP_ROPE: taken = try_rope(&c, i, &oom); break;
        case EXL_OP_ALL_REDUCE: taken = try_all_reduce(&c, i, &oom); break;
        case EXL_OP_GATHER_COLS: taken = try_gather(&c, i, &oom); break;
        default: break;
        }
        if (!taken && !oom) {
            if (!add_launch(&c, EXL_CUDA_RUN_NODE, i, 1))
                oom = 1;
            taken = 1;
        }
        i += taken;
    }
    if (oom) {
        p->n_nodes = p->n_launches = 0;
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory compiling a step");
    }
    if (p->has_batch && p->batch.max_q == 1 && exl_cuda_lora_fold_on(cb))
        plan_lora_fold(&c);
    if (p->has_batch && p->batch.max_q == 1) { /* decode steps */
        plan_kv_prefetch(&c);
        if (!cb->deterministic)
            plan_zeroing(&c);
    }
    plan_slot_order(&c);
    plan_lora_overlap(&c);
    return EXL_OK;
}

/* ---- running */

static void run_node(exl_cuda_backend *cb, const exl_cuda_plan *p, const exl_node *n) {
    exl_backend *be = &cb->base;
    switch (n->op) {
    case EXL_OP_EMBED:
        exl_cuda_run_embed(be, n->embed.out, n->embed.table, n->embed.ids, n->embed.rows, n->embed.scale);
        break;
    case EXL_OP_RMSNORM:
        exl_cuda_run_rmsnorm(be, n->rmsnorm.out, n->rmsnorm.x, n->rmsnorm.w, n->rmsnorm.rows, n->rmsnorm.width,
                             n->rmsnorm.eps);
        break;
    case EXL_OP_ROPE:
        exl_cuda_run_rope(be, n->rope.x, n->rope.pos, n->rope.rows, n->rope.n_heads, n->rope.head_dim, n->rope.rot_dim,
                          n->rope.inv_freq, n->rope.attn_factor);
        break;
    case EXL_OP_KV_STORE:
        exl_cuda_run_kv_store(be, n->kv_store.k_cache, n->kv_store.v_cache, n->kv_store.k, n->kv_store.v, &p->batch,
                              n->kv_store.width);
        break;
    case EXL_OP_ATTENTION:
        exl_cuda_run_attention(be, n->attention.out, n->attention.q, n->attention.k, n->attention.v,
                               n->attention.k_cache, n->attention.v_cache, &p->batch, &n->attention.shape);
        break;
    case EXL_OP_GLU: exl_cuda_run_glu(be, n->glu.x, n->glu.up, n->glu.rows, n->glu.width, n->glu.act); break;
    case EXL_OP_ADD: exl_cuda_run_add(be, n->add.x, n->add.y, n->add.n); break;
    case EXL_OP_GATHER_ROWS:
        exl_cuda_run_gather_rows(be, n->gather_rows.out, n->gather_rows.x, n->gather_rows.idx, n->gather_rows.n,
                                 n->gather_rows.width);
        break;
    case EXL_OP_COPY_COLS:
        exl_cuda_run_copy_cols(be, n->copy_cols.out, n->copy_cols.x, n->copy_cols.rows, n->copy_cols.width,
                               n->copy_cols.x_width, n->copy_cols.col);
        break;
    case EXL_OP_SOFTCAP: exl_cuda_run_softcap(be, n->softcap.x, n->softcap.n, n->softcap.cap); break;
    case EXL_OP_ROW_GATE:
        exl_cuda_run_row_gate(be, n->row_gate.x, n->row_gate.g, n->row_gate.rows, n->row_gate.width);
        break;
    case EXL_OP_MOE_ROUTE: exl_cuda_run_moe_route(be, &n->moe_route); break;
    case EXL_OP_MOE_EXPERTS: exl_cuda_run_moe_experts(be, &n->moe_experts, prompt_piece(p)); break;
    case EXL_OP_ALL_REDUCE: exl_cuda_run_all_reduce(be, n->all_reduce.x, n->all_reduce.n); break;
    case EXL_OP_GATHER_COLS: exl_cuda_run_gather_cols(be, &n->gather_cols); break;
    case EXL_OP_LORA: exl_cuda_run_lora(be, &n->lora); break;
    case EXL_OP_MATMUL: /* compiled into EXL_CUDA_RUN_MATMUL launches, always */
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "internal: a matmul node left out of the plan's matmuls");
        break;
    }
}

void exl_cuda_plan_run(exl_cuda_backend *cb, const exl_cuda_plan *p) {
    exl_backend *be = &cb->base;
    for (int32_t i = 0; i < p->n_launches; i++) {
        const exl_cuda_plan_item *l = &p->launches[i];
        const exl_node *n = &p->nodes[l->node];
        switch (l->kind) {
        case EXL_CUDA_RUN_NODE: run_node(cb, p, n); break;
        case EXL_CUDA_RUN_MATMUL: {
            if (l->side_lora)
                exl_cuda_lora_fork(cb, l->side_lora);
            size_t need = exl_cuda_fused_scratch_need(cb, &l->mm) * sizeof(float);
            if (!need ||
                exl_cuda_ensure(cb, (void **)&cb->fused_scratch, &cb->fused_scratch_bytes, need, "matmul scratch"))
                exl_cuda_run_matmul_fused(be, &l->mm);
            if (l->side_lora)
                exl_cuda_lora_join(cb, l->side_lora);
            break;
        }
        case EXL_CUDA_RUN_ROPE_KV_STORE: {
            const exl_rope_node *q = &n[0].rope, *k = &n[1].rope;
            const exl_kv_store_node *kv = &n[2].kv_store;
            exl_attn_shape sh;
            memset(&sh, 0, sizeof sh);
            sh.n_heads = q->n_heads, sh.n_kv_heads = k->n_heads, sh.head_dim = q->head_dim;
            exl_cuda_run_rope_kv_store(be, q->x, k->x, kv->v, kv->k_cache, kv->v_cache, &p->batch, &sh, q->rot_dim,
                                       q->inv_freq, q->attn_factor);
            break;
        }
        case EXL_CUDA_RUN_ROPE_ATTENTION: {
            const exl_rope_node *q = &n[0].rope, *k = &n[1].rope;
            const exl_kv_store_node *kv = &n[2].kv_store;
            const exl_attention_node *a = &n[3].attention;
            exl_cuda_run_rope_attention(be, a->out, q->x, k->x, kv->v, kv->k_cache, kv->v_cache, &p->batch, &a->shape,
                                        q->rot_dim, q->inv_freq, q->attn_factor, l->out_order);
            break;
        }
        case EXL_CUDA_RUN_ALL_REDUCE_ADD:
            exl_cuda_run_all_reduce_add(be, n[0].all_reduce.x, n[0].all_reduce.n, n[1].add.x);
            break;
        case EXL_CUDA_RUN_GATHER_ADD: exl_cuda_run_gather_cols_add(be, &n[0].gather_cols, n[1].add.x); break;
        }
    }
}

void exl_cuda_plan_free(exl_cuda_plan *p) {
    free(p->nodes);
    free(p->launches);
    memset(p, 0, sizeof *p);
}
