/* layer_graph.c - one decoder layer as graph nodes (backend/graph.h), for every architecture exl runs.
 *
 * Attention: q, k, v (three linears, or Phi-3's fused qkv_proj and its parts copied out), per-head RMSNorm of q and
 * k (Qwen3, Gemma 3), the rope of the layer's type, the KV store, attention with the layer's window, score scale
 * (1/sqrt(query_pre_attn_scalar) for Gemma 2/3) and soft-cap (Gemma 2), o_proj added to the residual, or normed
 * first (Gemma 2/3's post-attention norm). MLP: gate, up (or the fused gate_up_proj's halves), GLU, down, added to
 * the residual or normed first (post-feed-forward norm); or a mixture of experts: router, routes, the experts, and
 * Qwen2-MoE's shared expert scaled by its sigmoid gate. Buffers are the step's (m->fs): x the residual stream, h the
 * normed input of each half and its output before a post-norm.
 *
 * On a rank of a tensor-parallel model (tp.h) the same nodes run over the rank's heads and MLP columns; o_proj and
 * down_proj give partial sums that an all_reduce adds up before the residual (or o_proj's output columns are
 * gathered, for layers whose o_proj splits by output), and a mixture of experts sums every expert's part so. */
#include "model/model.h"
#include "model/tp.h"

#include "base/error.h"
#include "model/lora.h"

#include <math.h>

/* ---- one node each */

static exl_status rmsnorm(exl_graph *g, int32_t li, exl_part part, float *out, const float *x, const exl_vector *w,
                          int32_t rows, int32_t width, double eps) {
    const exl_node n = {.op = EXL_OP_RMSNORM, .tag = {li, part}, .rmsnorm = {out, x, w, rows, width, (float)eps}};
    return exl_graph_add(g, &n);
}

static exl_status matmul(exl_graph *g, int32_t li, exl_part part, float *out, const float *x, const exl_linear *w,
                         int32_t rows, int32_t in, int32_t out_features, int32_t accumulate) {
    const exl_node n = {.op = EXL_OP_MATMUL,
                        .tag = {li, part},
                        .matmul = {out, x, w, rows, in, out_features, accumulate}};
    return exl_graph_add(g, &n);
}

/* the LoRA updates of one projection (model/lora.h) of input x, or of x normed (norm, eps) */
static exl_status lora(exl_model *m, exl_graph *g, int32_t li, exl_lora_proj p, const exl_linear *w, float *out,
                       int32_t out_features, const float *x, int32_t in, const exl_vector *norm, double eps) {
    const exl_lora_input input = {x, in, norm, (float)eps, NULL, 0};
    return exl_lora_nodes(m, g, li, 1, &p, &w, &out, &out_features, &input);
}

/* columns [col, col + width) of x (rows of x_width) into out */
static exl_status copy_cols(exl_graph *g, int32_t li, exl_part part, float *out, const float *x, int32_t rows,
                            int32_t width, int32_t x_width, int32_t col) {
    const exl_node n = {.op = EXL_OP_COPY_COLS, .tag = {li, part}, .copy_cols = {out, x, rows, width, x_width, col}};
    return exl_graph_add(g, &n);
}

static exl_status add(exl_graph *g, int32_t li, exl_part part, float *x, const float *y, int64_t n) {
    const exl_node a = {.op = EXL_OP_ADD, .tag = {li, part}, .add = {x, y, n}};
    return exl_graph_add(g, &a);
}

/* ---- tensor parallelism */

/* the rank's split of its layers: NULL on one device and in a layer split (whose ranks hold whole layers) */
static const exl_tp_rank *tp_rank(const exl_model *m) { return m->tp && !m->tp->split ? &m->tp->ranks[m->rank] : NULL; }

static exl_status all_reduce(exl_model *m, exl_graph *g, int32_t li, exl_part part, float *x, int64_t n) {
    if (m->tp->no_comm)
        return EXL_OK;
    const exl_node a = {.op = EXL_OP_ALL_REDUCE, .tag = {li, part}, .all_reduce = {x, n}};
    return exl_graph_add(g, &a);
}

/* every rank's x [rows, its columns of cols] side by side into out [rows, cols[n]] */
static exl_status gather_cols(exl_model *m, exl_graph *g, int32_t li, exl_part part, float *out, const float *x,
                              int32_t rows, const int32_t *cols, float *tmp) {
    int32_t n = m->tp->n;
    if (m->tp->no_comm)
        return EXL_OK;
    const exl_node a = {.op = EXL_OP_GATHER_COLS,
                        .tag = {li, part},
                        .gather_cols = {out, x, cols, rows, cols[n], n, m->rank, tmp}};
    return exl_graph_add(g, &a);
}

/* the width of the layer's MLP on this model (its rank's part) */
static int32_t mlp_width(const exl_model *m, int32_t li, int32_t full) {
    const exl_tp_rank *r = tp_rank(m);
    return r ? r->layers[li].ffn : full;
}

/* x += y, or with a post-norm x += norm(y) (y normed in place) */
static exl_status residual(exl_model *m, exl_graph *g, int32_t li, exl_part norm_part, exl_part add_part, float *y,
                           const exl_vector *post_norm) {
    int32_t rows = g->batch->n_rows, hid = m->cfg.hidden_size;
    if (post_norm)
        EXL_TRY(rmsnorm(g, li, norm_part, y, y, post_norm, rows, hid, m->cfg.rms_eps));
    return add(g, li, add_part, m->fs.x, y, (int64_t)rows * hid);
}

/* ---- attention */

static exl_status qkv_nodes(exl_model *m, const exl_layer *l, int32_t li, exl_graph *g) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    int32_t rows = g->batch->n_rows, hid = c->hidden_size;
    int32_t qw = c->n_heads * c->head_dim, kvw = c->n_kv_heads * c->head_dim, all = qw + 2 * kvw;
    if (!l->qkv) {
        EXL_TRY(matmul(g, li, EXL_PART_Q, s->q, s->h, l->q, rows, hid, qw, 0));
        EXL_TRY(matmul(g, li, EXL_PART_K, s->k, s->h, l->k, rows, hid, kvw, 0));
        EXL_TRY(matmul(g, li, EXL_PART_V, s->v, s->h, l->v, rows, hid, kvw, 0));
        const exl_lora_proj p[3] = {EXL_LORA_Q, EXL_LORA_K, EXL_LORA_V};
        const exl_linear *const w[3] = {l->q, l->k, l->v};
        float *const out[3] = {s->q, s->k, s->v};
        const int32_t widths[3] = {qw, kvw, kvw};
        /* from the residual stream, normed on the way: the norm stays fused into the matmuls */
        const exl_lora_input input = {s->x, hid, l->attn_norm, (float)c->rms_eps, NULL, 0};
        return exl_lora_nodes(m, g, li, 3, p, w, out, widths, &input);
    }
    EXL_TRY(matmul(g, li, EXL_PART_QKV, s->fused, s->h, l->qkv, rows, hid, all, 0));
    EXL_TRY(lora(m, g, li, EXL_LORA_QKV, l->qkv, s->fused, all, s->x, hid, l->attn_norm, c->rms_eps));
    EXL_TRY(copy_cols(g, li, EXL_PART_Q, s->q, s->fused, rows, qw, all, 0));
    EXL_TRY(copy_cols(g, li, EXL_PART_K, s->k, s->fused, rows, kvw, all, qw));
    return copy_cols(g, li, EXL_PART_V, s->v, s->fused, rows, kvw, all, qw + kvw);
}

static exl_status attention_nodes(exl_model *m, const exl_layer *l, int32_t li, const exl_kv_cache *cache,
                                  exl_graph *g) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    const exl_batch *b = g->batch;
    int32_t rows = b->n_rows, hid = c->hidden_size, hd = c->head_dim;
    int32_t qw = c->n_heads * hd, kvw = c->n_kv_heads * hd;
    EXL_TRY(rmsnorm(g, li, EXL_PART_ATTN_NORM, s->h, s->x, l->attn_norm, rows, hid, c->rms_eps));
    EXL_TRY(qkv_nodes(m, l, li, g));
    if (l->q_norm) {
        EXL_TRY(rmsnorm(g, li, EXL_PART_Q_NORM, s->q, s->q, l->q_norm, rows * c->n_heads, hd, c->rms_eps));
        EXL_TRY(rmsnorm(g, li, EXL_PART_K_NORM, s->k, s->k, l->k_norm, rows * c->n_kv_heads, hd, c->rms_eps));
    }
    const exl_rope_table *rt = &s->rope[c->layers[li].sliding && s->rope[1].inv_freq];
    double scalar = c->query_pre_attn_scalar > 0 ? c->query_pre_attn_scalar : hd;
    exl_attn_shape shape = {c->n_heads,
                            c->n_kv_heads,
                            hd,
                            cache->page_size,
                            c->layers[li].sliding_window,
                            1.0f / sqrtf((float)scalar),
                            (float)c->attn_softcap};
    const exl_node nodes[] = {
        {.op = EXL_OP_ROPE,
         .tag = {li, EXL_PART_ROPE_Q},
         .rope = {s->q, b->d_pos, rt->inv_freq, rows, c->n_heads, hd, m->rot_dim, rt->attn_factor}},
        {.op = EXL_OP_ROPE,
         .tag = {li, EXL_PART_ROPE_K},
         .rope = {s->k, b->d_pos, rt->inv_freq, rows, c->n_kv_heads, hd, m->rot_dim, rt->attn_factor}},
        {.op = EXL_OP_KV_STORE,
         .tag = {li, EXL_PART_KV_STORE},
         .kv_store = {cache->k[li], cache->v[li], s->k, s->v, kvw}},
        {.op = EXL_OP_ATTENTION,
         .tag = {li, EXL_PART_ATTENTION},
         .attention = {s->attn, s->q, s->k, s->v, cache->k[li], cache->v[li], shape}},
    };
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++)
        EXL_TRY(exl_graph_add(g, &nodes[i]));
    const exl_tp_rank *r = tp_rank(m);
    if (r && r->layers[li].o_gather) { /* o_proj by output columns over every rank's heads */
        const exl_tp *tp = m->tp;
        int32_t part = tp->hidden_cols[m->rank + 1] - tp->hidden_cols[m->rank];
        EXL_TRY(gather_cols(m, g, li, EXL_PART_ATTN_REDUCE, r->wide, s->attn, rows, tp->attn_cols, r->partial));
        EXL_TRY(matmul(g, li, EXL_PART_O, r->part, r->wide, l->o, rows, tp->attn_cols[tp->n], part, 0));
        EXL_TRY(gather_cols(m, g, li, EXL_PART_ATTN_REDUCE, s->h, r->part, rows, tp->hidden_cols, r->partial));
        return residual(m, g, li, EXL_PART_POST_ATTN_NORM, EXL_PART_ATTN_RESIDUAL, s->h, l->post_attn_norm);
    }
    if (r) { /* the ranks' partial sums added up */
        EXL_TRY(matmul(g, li, EXL_PART_O, s->h, s->attn, l->o, rows, qw, hid, 0));
        EXL_TRY(all_reduce(m, g, li, EXL_PART_ATTN_REDUCE, s->h, (int64_t)rows * hid));
        return residual(m, g, li, EXL_PART_POST_ATTN_NORM, EXL_PART_ATTN_RESIDUAL, s->h, l->post_attn_norm);
    }
    if (!l->post_attn_norm) {
        EXL_TRY(matmul(g, li, EXL_PART_O, s->x, s->attn, l->o, rows, qw, hid, 1));
        return lora(m, g, li, EXL_LORA_O, l->o, s->x, hid, s->attn, qw, NULL, 0);
    }
    EXL_TRY(matmul(g, li, EXL_PART_O, s->h, s->attn, l->o, rows, qw, hid, 0));
    EXL_TRY(lora(m, g, li, EXL_LORA_O, l->o, s->h, hid, s->attn, qw, NULL, 0));
    return residual(m, g, li, EXL_PART_POST_ATTN_NORM, EXL_PART_ATTN_RESIDUAL, s->h, l->post_attn_norm);
}

/* ---- the MLP */

/* a gated MLP of width ffn over h = norm(x) (e: separate gate and up, or gate_up fused) into out: added to it, or
 * overwriting it */
static exl_status gated_mlp(exl_model *m, const exl_expert *e, const exl_linear *gate_up, const exl_vector *norm,
                            int32_t li, int32_t ffn, float *out, int32_t accumulate, exl_graph *g) {
    exl_forward_scratch *s = &m->fs;
    int32_t rows = g->batch->n_rows, hid = m->cfg.hidden_size;
    const double eps = m->cfg.rms_eps;
    if (gate_up) {
        EXL_TRY(matmul(g, li, EXL_PART_GATE_UP, s->fused, s->h, gate_up, rows, hid, 2 * ffn, 0));
        EXL_TRY(lora(m, g, li, EXL_LORA_GATE_UP, gate_up, s->fused, 2 * ffn, s->x, hid, norm, eps));
        EXL_TRY(copy_cols(g, li, EXL_PART_GATE, s->gate, s->fused, rows, ffn, 2 * ffn, 0));
        EXL_TRY(copy_cols(g, li, EXL_PART_UP, s->up, s->fused, rows, ffn, 2 * ffn, ffn));
    } else {
        EXL_TRY(matmul(g, li, EXL_PART_GATE, s->gate, s->h, e->gate, rows, hid, ffn, 0));
        EXL_TRY(matmul(g, li, EXL_PART_UP, s->up, s->h, e->up, rows, hid, ffn, 0));
        const exl_lora_proj p[2] = {EXL_LORA_GATE, EXL_LORA_UP};
        const exl_linear *const w[2] = {e->gate, e->up};
        float *const outs[2] = {s->gate, s->up};
        const int32_t widths[2] = {ffn, ffn};
        const exl_lora_input input = {s->x, hid, norm, (float)eps, NULL, 0}; /* the norm stays fused */
        EXL_TRY(exl_lora_nodes(m, g, li, 2, p, w, outs, widths, &input));
    }
    /* down_proj's updates added to the residual before the GLU, through it on the way (the GLU stays fused into
     * down_proj); where down_proj overwrites out, after it */
    const exl_lora_input glu_in = {s->gate, ffn, NULL, 0, s->up, m->cfg.act}, plain = {s->gate, ffn, NULL, 0, NULL, 0};
    float *const down_out[1] = {out};
    const exl_lora_proj down[1] = {EXL_LORA_DOWN};
    const exl_linear *const down_w[1] = {e->down};
    if (accumulate)
        EXL_TRY(exl_lora_nodes(m, g, li, 1, down, down_w, down_out, &hid, &glu_in));
    const exl_node glu = {.op = EXL_OP_GLU, .tag = {li, EXL_PART_GLU}, .glu = {s->gate, s->up, rows, ffn, m->cfg.act}};
    EXL_TRY(exl_graph_add(g, &glu));
    EXL_TRY(matmul(g, li, EXL_PART_DOWN, out, s->gate, e->down, rows, ffn, hid, accumulate));
    return accumulate ? EXL_OK : exl_lora_nodes(m, g, li, 1, down, down_w, down_out, &hid, &plain);
}

/* a rank's expert sums: added up over the ranks, then to the residual */
static exl_status reduce_moe(exl_model *m, exl_graph *g, int32_t li, float *sum) {
    int64_t n = (int64_t)g->batch->n_rows * m->cfg.hidden_size;
    EXL_TRY(all_reduce(m, g, li, EXL_PART_MLP_REDUCE, sum, n));
    return add(g, li, EXL_PART_MLP_RESIDUAL, m->fs.x, sum, n);
}

/* router, routes, the experts added to x; Qwen2-MoE's shared expert, scaled by the sigmoid of its gate, after */
static exl_status moe_nodes(exl_model *m, const exl_layer *l, int32_t li, exl_graph *g) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    const exl_moe_config *e = &c->moe;
    int32_t rows = g->batch->n_rows, hid = c->hidden_size;
    const exl_tp_rank *r = tp_rank(m);
    /* on a rank: each expert's part into a zeroed sum, which the ranks add up before the residual */
    float *out = r ? r->partial : s->x;
    if (r)
        EXL_TRY(copy_cols(g, li, EXL_PART_EXPERTS, out, r->zeros, rows, hid, hid, 0));
    EXL_TRY(matmul(g, li, EXL_PART_ROUTER, s->router, s->h, l->router, rows, hid, e->n_experts, 0));
    const exl_node nodes[] = {
        {.op = EXL_OP_MOE_ROUTE,
         .tag = {li, EXL_PART_ROUTE},
         .moe_route = {s->route_weights, s->route_ids, s->router, rows, e->n_experts, e->top_k, e->norm_topk_prob}},
        {.op = EXL_OP_MOE_EXPERTS,
         .tag = {li, EXL_PART_EXPERTS},
         .moe_experts = {out, s->h, s->route_ids, s->route_weights, l->experts, rows, hid,
                         mlp_width(m, li, e->expert_ffn), e->n_experts, e->top_k, c->act, s->moe_xs, s->moe_gate,
                         s->moe_up, s->moe_slots}},
    };
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++)
        EXL_TRY(exl_graph_add(g, &nodes[i]));
    if (!l->shared_gate)
        return r ? reduce_moe(m, g, li, out) : EXL_OK;
    /* the router's logits are spent: its buffer takes the shared expert's gate, h its output once the MLP is past
     * reading it */
    EXL_TRY(matmul(g, li, EXL_PART_SHARED_GATE, s->router, s->h, l->shared_gate, rows, hid, 1, 0));
    EXL_TRY(gated_mlp(m, &l->shared, NULL, NULL, li, e->shared_ffn, s->h, 0, g));
    const exl_node gate = {.op = EXL_OP_ROW_GATE,
                           .tag = {li, EXL_PART_SHARED_GATE},
                           .row_gate = {s->h, s->router, rows, hid}};
    EXL_TRY(exl_graph_add(g, &gate));
    EXL_TRY(add(g, li, EXL_PART_MLP_RESIDUAL, out, s->h, (int64_t)rows * hid));
    return r ? reduce_moe(m, g, li, out) : EXL_OK;
}

static exl_status mlp_nodes(exl_model *m, const exl_layer *l, int32_t li, exl_graph *g) {
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    EXL_TRY(rmsnorm(g, li, EXL_PART_MLP_NORM, s->h, s->x, l->mlp_norm, g->batch->n_rows, c->hidden_size, c->rms_eps));
    if (c->layers[li].moe)
        return moe_nodes(m, l, li, g);
    const exl_expert mlp = {l->gate, l->up, l->down};
    int32_t ffn = mlp_width(m, li, c->intermediate_size);
    if (!l->post_mlp_norm && !tp_rank(m))
        return gated_mlp(m, &mlp, l->gate_up, l->mlp_norm, li, ffn, s->x, 1, g);
    EXL_TRY(gated_mlp(m, &mlp, l->gate_up, l->mlp_norm, li, ffn, s->h, 0, g));
    if (tp_rank(m))
        EXL_TRY(all_reduce(m, g, li, EXL_PART_MLP_REDUCE, s->h, (int64_t)g->batch->n_rows * c->hidden_size));
    return residual(m, g, li, EXL_PART_POST_MLP_NORM, EXL_PART_MLP_RESIDUAL, s->h, l->post_mlp_norm);
}

exl_status exl_model_layer_graph(exl_model *m, const exl_layer *l, int32_t li, const exl_kv_cache *cache,
                                 exl_graph *g) {
    if (l->attn_norm) /* a block without its input norm is left out (the quantizer runs one block at a time) */
        EXL_TRY(attention_nodes(m, l, li, cache, g));
    return l->mlp_norm ? mlp_nodes(m, l, li, g) : EXL_OK;
}
