/* forward_sample.c - a forward step whose tokens are sampled where the logits lie (the backend's sample op), masked
 * first for constrained decoding: one token per row comes back instead of a vocabulary of logits. */
#include "model/model.h"

#include "base/error.h"

exl_status exl_model_forward_sample(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    exl_logit_mask_fn fill, void *user, uint32_t *masks,
                                    const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits,
                                    exl_sample_result *out) {
    const exl_backend_ops *op = m->be->ops;
    int32_t vocab = m->cfg.vocab_size;
    if (!op->sample)
        return exl_fail(EXL_ERR_UNSUPPORTED, "the %s backend cannot sample", m->be->name);
    if (fill && !op->mask_logits)
        return exl_fail(EXL_ERR_UNSUPPORTED, "the %s backend cannot mask logits", m->be->name);
    int32_t n_logits;
    EXL_TRY(exl_model_forward_to_logits(m, cache, steps, n_seqs, 0, &n_logits));
    if (n_logits > 0) {
        if (fill)
            EXL_TRY(op->mask_logits(m->be, m->fs.logits, n_logits, vocab, masks, fill, user));
        EXL_TRY(op->sample(m->be, out, m->fs.logits, n_logits, vocab, params, edits, n_edits));
    }
    return op->synchronize(m->be);
}
