/* forward_layer.c - parts of a step run on their own, for the quantizer: one decoder layer over a step's hidden
 * states (optionally with a hook on each linear's input), the step's embeddings, its rows' head input. */
#include "model/model.h"

#include "base/error.h"

exl_status exl_model_layer_forward(exl_model *m, const exl_layer *layer, int32_t li, exl_kv_cache *cache,
                                   const exl_seq_step *steps, int32_t n_seqs, exl_linear_hook hook, void *user) {
    if (li < 0 || li >= m->cfg.n_layers)
        return exl_fail(EXL_ERR_ARG, "layer_forward: layer %d of %d", li, m->cfg.n_layers);
    if (m->tp) /* its graph's collectives would wait for the other ranks, which run no such layer */
        return exl_fail(EXL_ERR_UNSUPPORTED, "layer_forward: not on a tensor-parallel model (--tp)");
    int32_t n_logits;
    EXL_TRY(exl_model_begin_step(m, cache, steps, n_seqs, 0, &n_logits));
    exl_graph *g = &m->fs.graph;
    EXL_TRY(exl_model_layer_graph(m, layer, li, cache, g));
    EXL_TRY(exl_graph_output(g, m->fs.x, (int64_t)m->fs.batch.n_rows * m->cfg.hidden_size));
    return exl_model_run_graph(m, g, hook, user);
}

exl_status exl_model_embed_step(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs) {
    int32_t n_logits;
    if (m->tp)
        return exl_fail(EXL_ERR_UNSUPPORTED, "embed_step: not on a tensor-parallel model (--tp)");
    EXL_TRY(exl_model_begin_step(m, cache, steps, n_seqs, 0, &n_logits));
    exl_forward_scratch *s = &m->fs;
    int32_t rows = s->batch.n_rows, hid = m->cfg.hidden_size;
    const exl_node embed = {.op = EXL_OP_EMBED,
                            .tag = {-1, EXL_PART_EMBED},
                            .embed = {s->x, m->embed, s->batch.d_ids, rows, hid, m->embed_scale}};
    EXL_TRY(exl_graph_add(&s->graph, &embed));
    EXL_TRY(exl_graph_output(&s->graph, s->x, (int64_t)rows * hid));
    return exl_model_run_graph(m, &s->graph, NULL, NULL);
}

exl_status exl_model_head_input(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                exl_linear_hook hook, void *user) {
    int32_t n_logits;
    EXL_TRY(exl_model_begin_step(m, cache, steps, n_seqs, 0, &n_logits));
    exl_forward_scratch *s = &m->fs;
    int32_t rows = s->batch.n_rows, hid = m->cfg.hidden_size;
    const exl_node norm = {.op = EXL_OP_RMSNORM,
                           .tag = {-1, EXL_PART_FINAL_NORM},
                           .rmsnorm = {s->h, s->x, m->final_norm, rows, hid, (float)m->cfg.rms_eps}};
    EXL_TRY(exl_graph_add(&s->graph, &norm));
    EXL_TRY(exl_graph_output(&s->graph, s->h, (int64_t)rows * hid));
    EXL_TRY(exl_model_run_graph(m, &s->graph, NULL, NULL));
    return hook(user, m->cfg.n_layers, m->head, s->h, rows);
}
