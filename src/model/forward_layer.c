/* forward_layer.c - one decoder layer over a step's hidden states, optionally with a hook on each linear's input. */
#include "model/model.h"

#include "base/error.h"

exl_status exl_model_layer_forward(exl_model *m, const exl_layer *layer, int32_t li, exl_kv_cache *cache,
                                   const exl_seq_step *steps, int32_t n_seqs, exl_linear_hook hook, void *user) {
    if (li < 0 || li >= m->cfg.n_layers)
        return exl_fail(EXL_ERR_ARG, "layer_forward: layer %d of %d", li, m->cfg.n_layers);
    int32_t n_logits;
    EXL_TRY(exl_model_begin_step(m, cache, steps, n_seqs, 0, &n_logits));
    exl_graph *g = &m->fs.graph;
    EXL_TRY(exl_model_layer_graph(m, layer, li, cache, g));
    EXL_TRY(exl_graph_output(g, m->fs.x, (int64_t)m->fs.batch.n_rows * m->cfg.hidden_size));
    return exl_model_run_graph(m, g, hook, user);
}
