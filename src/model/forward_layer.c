/* forward_layer.c - the forward pass one decoder layer at a time (model.h), for the quantizer: the real layer
 * (forward.c's) over a step's hidden states, with the model's weights or candidates, a hook on its linears' inputs. */
#include "model/forward_internal.h"
#include "model/model.h"

#include "base/error.h"

exl_status exl_model_embed_step(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs) {
    exl_batch b;
    int32_t n_logits;
    EXL_TRY(exl_model_step_batch(m, cache, steps, n_seqs, 0, &b, &n_logits));
    m->be->ops->embed(m->be, m->fs.x, m->embed, b.d_ids, b.n_rows, m->embed_scale);
    return EXL_OK;
}

exl_status exl_model_layer_forward(exl_model *m, const exl_layer *layer, int32_t li, exl_kv_cache *cache,
                                   const exl_seq_step *steps, int32_t n_seqs, exl_linear_hook hook, void *user) {
    exl_batch b;
    int32_t n_logits;
    if (li < 0 || li >= m->cfg.n_layers)
        return exl_fail(EXL_ERR_ARG, "exl_model_layer_forward: layer %d of %d", li, m->cfg.n_layers);
    EXL_TRY(exl_model_step_batch(m, cache, steps, n_seqs, 0, &b, &n_logits));
    exl_layer_hook h = {hook, user, li};
    return exl_model_run_layer(m, layer, cache, li, &b, 0, &h);
}

exl_status exl_model_head_input(exl_model *m, int32_t rows, exl_linear_hook hook, void *user) {
    if (rows < 0 || rows > exl_model_max_rows(m))
        return exl_fail(EXL_ERR_ARG, "exl_model_head_input: %d rows (at most %d)", rows, exl_model_max_rows(m));
    exl_forward_scratch *s = &m->fs;
    m->be->ops->rmsnorm(m->be, s->h, s->x, m->final_norm, rows, m->cfg.hidden_size, (float)m->cfg.rms_eps);
    return hook(user, m->cfg.n_layers, m->head, s->h, rows);
}
