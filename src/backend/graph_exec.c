/* graph_exec.c - the generic executor: a step's graph node by node through a backend's primitive ops. */
#include "backend/backend.h"

#include "base/alloc.h"
#include "base/error.h"

static exl_status run_matmul(exl_backend *be, const exl_graph *g, const exl_node *node) {
    const exl_matmul_node *m = &node->matmul;
    if (!m->accumulate) {
        be->ops->matmul(be, m->out, m->x, m->w, m->rows);
        return EXL_OK;
    }
    int64_t n = (int64_t)m->rows * m->out_features;
    if (!g->tmp || g->tmp_floats < n || g->tmp == m->x || g->tmp == m->out)
        return exl_fail(EXL_ERR_ARG,
                        "graph: layer %d: an accumulating matmul of %lld floats without a tmp buffer "
                        "for it",
                        node->tag.layer, (long long)n);
    be->ops->matmul(be, g->tmp, m->x, m->w, m->rows);
    be->ops->add(be, m->out, g->tmp, n);
    return EXL_OK;
}

/* Under a hook, each expert's linears are shown the rows routed to it: their inputs are computed here expert by
 * expert (gathered rows, act(gate) * up for the down projection) before the node itself runs as usual. */
static exl_status hook_experts(exl_backend *be, const exl_moe_experts_node *n, int32_t layer, exl_linear_hook hook,
                               void *user) {
    int64_t choices = (int64_t)n->rows * n->top_k;
    int32_t *ids = exl_malloc((size_t)choices * sizeof(int32_t)), *idx = exl_malloc((size_t)choices * sizeof(int32_t));
    exl_status st = ids && idx ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK)
        st = be->ops->download(be, ids, n->ids, (size_t)choices * sizeof(int32_t));
    for (int32_t e = 0; st == EXL_OK && e < n->n_experts; e++) {
        int32_t count = 0;
        for (int64_t i = 0; i < choices; i++)
            if (ids[i] == e)
                idx[count++] = (int32_t)(i / n->top_k);
        if (!count)
            continue;
        const exl_expert *x = &n->experts[e];
        st = be->ops->upload(be, n->slots, idx, (size_t)count * sizeof(int32_t));
        if (st == EXL_OK) {
            be->ops->gather_rows(be, n->xs, n->x, n->slots, count, n->width);
            st = hook(user, layer, x->gate, n->xs, count);
        }
        if (st == EXL_OK)
            st = hook(user, layer, x->up, n->xs, count);
        if (st == EXL_OK) {
            be->ops->matmul(be, n->gate, n->xs, x->gate, count);
            be->ops->matmul(be, n->up, n->xs, x->up, count);
            be->ops->glu(be, n->gate, n->up, count, n->ffn, n->act);
            st = hook(user, layer, x->down, n->gate, count);
        }
    }
    exl_free(ids);
    exl_free(idx);
    return st;
}

exl_status exl_graph_exec(exl_backend *be, const exl_graph *g, exl_linear_hook hook, void *user) {
    const exl_backend_ops *op = be->ops;
    for (int32_t i = 0; i < g->n_nodes; i++) {
        const exl_node *n = &g->nodes[i];
        switch (n->op) {
        case EXL_OP_EMBED:
            op->embed(be, n->embed.out, n->embed.table, n->embed.ids, n->embed.rows, n->embed.scale);
            break;
        case EXL_OP_RMSNORM:
            op->rmsnorm(be, n->rmsnorm.out, n->rmsnorm.x, n->rmsnorm.w, n->rmsnorm.rows, n->rmsnorm.width,
                        n->rmsnorm.eps);
            break;
        case EXL_OP_MATMUL:
            if (hook)
                EXL_TRY(hook(user, n->tag.layer, n->matmul.w, n->matmul.x, n->matmul.rows));
            EXL_TRY(run_matmul(be, g, n));
            break;
        case EXL_OP_ROPE:
            op->rope(be, n->rope.x, n->rope.pos, n->rope.rows, n->rope.n_heads, n->rope.head_dim, n->rope.rot_dim,
                     n->rope.inv_freq, n->rope.attn_factor);
            break;
        case EXL_OP_KV_STORE:
        case EXL_OP_ATTENTION:
            if (!g->batch)
                return exl_fail(EXL_ERR_ARG, "graph: layer %d: kv_store or attention in a graph without a batch",
                                n->tag.layer);
            if (n->op == EXL_OP_KV_STORE)
                op->kv_store(be, n->kv_store.k_cache, n->kv_store.v_cache, n->kv_store.k, n->kv_store.v, g->batch,
                             n->kv_store.width);
            else
                op->attention(be, n->attention.out, n->attention.q, n->attention.k, n->attention.v,
                              n->attention.k_cache, n->attention.v_cache, g->batch, &n->attention.shape);
            break;
        case EXL_OP_GLU: op->glu(be, n->glu.x, n->glu.up, n->glu.rows, n->glu.width, n->glu.act); break;
        case EXL_OP_ADD: op->add(be, n->add.x, n->add.y, n->add.n); break;
        case EXL_OP_GATHER_ROWS:
            op->gather_rows(be, n->gather_rows.out, n->gather_rows.x, n->gather_rows.idx, n->gather_rows.n,
                            n->gather_rows.width);
            break;
        case EXL_OP_COPY_COLS:
            op->copy_cols(be, n->copy_cols.out, n->copy_cols.x, n->copy_cols.rows, n->copy_cols.width,
                          n->copy_cols.x_width, n->copy_cols.col);
            break;
        case EXL_OP_SOFTCAP: op->softcap(be, n->softcap.x, n->softcap.n, n->softcap.cap); break;
        case EXL_OP_ROW_GATE:
            op->row_gate(be, n->row_gate.x, n->row_gate.g, n->row_gate.rows, n->row_gate.width);
            break;
        case EXL_OP_MOE_ROUTE: op->moe_route(be, &n->moe_route); break;
        case EXL_OP_MOE_EXPERTS:
            if (hook)
                EXL_TRY(hook_experts(be, &n->moe_experts, n->tag.layer, hook, user));
            op->moe_experts(be, &n->moe_experts);
            break;
        case EXL_OP_ALL_REDUCE:
        case EXL_OP_GATHER_COLS:
            if (!op->all_reduce || !op->gather_cols)
                return exl_fail(EXL_ERR_UNSUPPORTED, "graph: the %s backend has no collectives (tensor parallelism)",
                                be->name);
            if (n->op == EXL_OP_ALL_REDUCE)
                op->all_reduce(be, n->all_reduce.x, n->all_reduce.n);
            else
                op->gather_cols(be, &n->gather_cols);
            break;
        case EXL_OP_LORA: op->lora(be, &n->lora); break;
        }
    }
    return EXL_OK;
}
