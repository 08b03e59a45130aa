/* forward_ahead.c - greedy decode steps that run ahead of the host.
 *
 * A step ends in an argmax of its logits rows. On a backend with an argmax op (CUDA) the token
 * ids are written into the token table where the next step reads them and come back to the host
 * later, so the caller can queue step n + 1 before it waits for step n's tokens and the device
 * never idles between steps. Elsewhere (the CPU) the step runs at once and the argmax is taken
 * here, with the same results and the same calls. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <string.h>

/* the lowest index of the largest value above -inf, -1 if none (as the backends' argmax op) */
static int32_t host_argmax(const float *x, int32_t n) {
    int32_t best = -1;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > -INFINITY && (best < 0 || x[i] > x[best]))
            best = i;
    return best;
}

/* the argmax of each of n rows of logits, taken on the host: ticket and results as the op's */
static exl_status argmax_on_host(exl_model *m, int32_t n, int64_t *ticket) {
    exl_forward_scratch *s = &m->fs;
    int32_t vocab = m->cfg.vocab_size;
    if (n > s->host_logit_rows) {
        float *p = exl_realloc(s->host_logits, (size_t)n * vocab * sizeof(float));
        if (!p)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        s->host_logits = p;
        s->host_logit_rows = n;
    }
    EXL_TRY(m->be->ops->download(m->be, s->host_logits, s->logits, (size_t)n * vocab * sizeof(float)));
    *ticket = s->host_argmax_issued++;
    int32_t slot = (int32_t)(*ticket % EXL_ARGMAX_KEEP);
    for (int32_t r = 0; r < n; r++) {
        int32_t id = host_argmax(s->host_logits + (size_t)r * vocab, vocab);
        s->host_argmax[slot][r] = id;
        s->host_fed[r] = id < 0 ? 0 : id;
    }
    s->host_argmax_rows[slot] = n;
    return EXL_OK;
}

exl_status exl_model_forward_argmax(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    int64_t *ticket) {
    *ticket = -1;
    int32_t n;
    for (int32_t i = 0, rows = 0; i < n_seqs; i++)
        if ((rows += exl_seq_step_logit_rows(&steps[i])) > EXL_ARGMAX_ROWS)
            return exl_fail(EXL_ERR_ARG, "forward_argmax: more than %d rows want a token", EXL_ARGMAX_ROWS);
    EXL_TRY(exl_model_forward_to_logits(m, cache, steps, n_seqs, 1, &n));
    if (n < 1)
        return exl_fail(EXL_ERR_ARG, "forward_argmax: no row wants a token");
    if (m->be->ops->argmax) {
        *ticket = m->be->ops->argmax(m->be, m->fs.table, m->fs.logits, n, m->cfg.vocab_size);
        if (*ticket < 0)
            return EXL_ERR_DEVICE;
    } else {
        EXL_TRY(argmax_on_host(m, n, ticket));
    }
    m->fs.fed_rows = n;
    return EXL_OK;
}

exl_status exl_model_argmax_wait(exl_model *m, int64_t ticket, int32_t *ids, int32_t n) {
    if (m->be->ops->argmax_wait)
        return m->be->ops->argmax_wait(m->be, ticket, ids, n);
    exl_forward_scratch *s = &m->fs;
    if (ticket < 0 || ticket >= s->host_argmax_issued || s->host_argmax_issued - ticket > EXL_ARGMAX_KEEP)
        return exl_fail(EXL_ERR_ARG, "argmax_wait: ticket %lld is not among the last %d of %lld", (long long)ticket,
                        EXL_ARGMAX_KEEP, (long long)s->host_argmax_issued);
    int32_t slot = (int32_t)(ticket % EXL_ARGMAX_KEEP);
    if (n != s->host_argmax_rows[slot])
        return exl_fail(EXL_ERR_ARG, "argmax_wait: ticket %lld has %d rows, not %d", (long long)ticket,
                        s->host_argmax_rows[slot], n);
    memcpy(ids, s->host_argmax[slot], (size_t)n * sizeof(int32_t));
    return EXL_OK;
}

void exl_model_free_ahead(exl_model *m) {
    exl_free(m->fs.host_logits);
    m->fs.host_logits = NULL;
    m->fs.host_logit_rows = 0;
}
