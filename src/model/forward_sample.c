/* forward_sample.c - a forward step whose tokens are sampled where the logits lie (the backend's sample op), masked
 * first for constrained decoding: one token per row comes back instead of a vocabulary of logits; or queued ahead of
 * the host (sample_queue), its tokens left where the next step reads them, as forward_ahead.c's argmax. */
#include "model/model.h"

#include "base/error.h"

#include <string.h>

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

/* the sample op run at once where the backend cannot queue it: ticket and results as sample_queue's */
static exl_status sample_on_host(exl_model *m, int32_t n, const exl_sample_params *params, const exl_logit_edit *edits,
                                 int32_t n_edits, int chained, int64_t *ticket) {
    exl_forward_scratch *s = &m->fs;
    exl_sample_params p[EXL_ARGMAX_ROWS] = {{0}};
    const exl_sample_result *last = s->host_sample[(s->host_sample_issued + EXL_ARGMAX_KEEP - 1) % EXL_ARGMAX_KEEP];
    for (int32_t r = 0; r < n; r++) {
        p[r] = params[r];
        if (chained && last[r].n_kept > 1)
            p[r].u = p[r].u_next;
    }
    int32_t slot = (int32_t)(s->host_sample_issued % EXL_ARGMAX_KEEP);
    EXL_TRY(m->be->ops->sample(m->be, s->host_sample[slot], s->logits, n, m->cfg.vocab_size, p, edits, n_edits));
    for (int32_t r = 0; r < n; r++)
        s->host_fed[r] = s->host_sample[slot][r].id < 0 ? 0 : s->host_sample[slot][r].id;
    if (m->be->ops->argmax) /* the next step reads fed tokens where the argmax op leaves them */
        EXL_TRY(m->be->ops->upload(m->be, s->table, s->host_fed, (size_t)n * sizeof(int32_t)));
    s->host_sample_rows[slot] = n;
    *ticket = s->host_sample_issued++;
    return EXL_OK;
}

exl_status exl_model_forward_sample_ahead(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                          const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits,
                                          int chained, int64_t *ticket) {
    const exl_backend_ops *op = m->be->ops;
    *ticket = -1;
    if (!op->sample)
        return exl_fail(EXL_ERR_UNSUPPORTED, "the %s backend cannot sample", m->be->name);
    for (int32_t i = 0, rows = 0; i < n_seqs; i++)
        if ((rows += exl_seq_step_logit_rows(&steps[i])) > EXL_ARGMAX_ROWS)
            return exl_fail(EXL_ERR_ARG, "forward_sample_ahead: more than %d rows want a token", EXL_ARGMAX_ROWS);
    int32_t n;
    EXL_TRY(exl_model_forward_to_logits(m, cache, steps, n_seqs, 1, &n));
    if (n < 1)
        return exl_fail(EXL_ERR_ARG, "forward_sample_ahead: no row wants a token");
    if (op->sample_queue && op->argmax) { /* the next step reads fed tokens where the argmax op leaves them */
        *ticket = op->sample_queue(m->be, m->fs.table, m->fs.logits, n, m->cfg.vocab_size, params, edits, n_edits,
                                   chained);
        if (*ticket < 0)
            return EXL_ERR_DEVICE;
    } else {
        EXL_TRY(sample_on_host(m, n, params, edits, n_edits, chained, ticket));
    }
    m->fs.fed_rows = n;
    return EXL_OK;
}

exl_status exl_model_sample_wait(exl_model *m, int64_t ticket, exl_sample_result *out, int32_t n) {
    if (m->be->ops->sample_queue && m->be->ops->argmax)
        return m->be->ops->sample_wait(m->be, ticket, out, n);
    exl_forward_scratch *s = &m->fs;
    if (ticket < 0 || ticket >= s->host_sample_issued || s->host_sample_issued - ticket > EXL_ARGMAX_KEEP)
        return exl_fail(EXL_ERR_ARG, "sample_wait: ticket %lld is not among the last %d of %lld", (long long)ticket,
                        EXL_ARGMAX_KEEP, (long long)s->host_sample_issued);
    int32_t slot = (int32_t)(ticket % EXL_ARGMAX_KEEP);
    if (n != s->host_sample_rows[slot])
        return exl_fail(EXL_ERR_ARG, "sample_wait: ticket %lld has %d rows, not %d", (long long)ticket,
                        s->host_sample_rows[slot], n);
    memcpy(out, s->host_sample[slot], (size_t)n * sizeof *out);
    return EXL_OK;
}
