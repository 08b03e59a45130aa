/* forward_masked.c - a forward step whose logits are masked where they lie (the backend's
 * mask_logits op) before they come back, whole or as their head, for constrained decoding. */
#include "model/model.h"

#include "base/error.h"

exl_status exl_model_forward_masked(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    exl_logit_mask_fn fill, void *user, uint32_t *masks, int32_t k, int32_t *ids,
                                    float *vals, float *logits) {
    const exl_backend_ops *op = m->be->ops;
    int32_t vocab = m->cfg.vocab_size;
    if (!op->mask_logits)
        return exl_fail(EXL_ERR_UNSUPPORTED, "the %s backend cannot mask logits", m->be->name);
    if (k && (k < 1 || k > exl_model_top_k_max(m)))
        return exl_fail(EXL_ERR_ARG, "exl_model_forward_masked: k = %d, the backend takes 1 .. %d", k,
                        exl_model_top_k_max(m));
    int32_t n_logits;
    EXL_TRY(exl_model_forward_to_logits(m, cache, steps, n_seqs, 0, &n_logits));
    if (n_logits > 0) {
        EXL_TRY(op->mask_logits(m->be, m->fs.logits, n_logits, vocab, masks, fill, user));
        if (k)
            EXL_TRY(op->top_k(m->be, ids, vals, m->fs.logits, n_logits, vocab, k));
        else
            EXL_TRY(op->download(m->be, logits, m->fs.logits, (size_t)n_logits * vocab * sizeof(float)));
    }
    return op->synchronize(m->be);
}
