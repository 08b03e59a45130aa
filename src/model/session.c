/* session.c - the public single-sequence API: a KV cache of its own, eval in chunks. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"

/* Tokens a step when every token's logits are wanted: the forward keeps chunk x vocab floats of
 * logits (with a 128k vocabulary, 512 tokens are 256 MB) */
#define ALL_LOGITS_CHUNK 512

#define SESSION_PAGE_SIZE 256

struct exl_session {
    exl_model *model;
    exl_kv_cache *cache;
    int32_t *pages;
    int32_t n_pages, max_tokens, length;
};

exl_status exl_session_init(exl_model *model, int32_t max_tokens, exl_session **out) {
    return exl_session_init_cache(model, max_tokens, 16, 16, out);
}

exl_status exl_session_init_cache(exl_model *model, int32_t max_tokens, int32_t k_bits, int32_t v_bits,
                                  exl_session **out) {
    *out = NULL;
    if (max_tokens < 1)
        return exl_fail(EXL_ERR_ARG, "session: max_tokens must be positive");
    exl_session *s = exl_calloc(1, sizeof *s);
    if (!s)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    s->model = model;
    s->max_tokens = max_tokens;
    s->n_pages = (max_tokens + SESSION_PAGE_SIZE - 1) / SESSION_PAGE_SIZE;
    s->pages = exl_malloc((size_t)s->n_pages * sizeof *s->pages);
    exl_status st = s->pages ? exl_kv_cache_init(model, s->n_pages, SESSION_PAGE_SIZE, k_bits, v_bits, &s->cache)
                             : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st != EXL_OK) {
        exl_session_free(s);
        return st;
    }
    for (int32_t i = 0; i < s->n_pages; i++)
        s->pages[i] = i;
    *out = s;
    return EXL_OK;
}

void exl_session_free(exl_session *s) {
    if (!s)
        return;
    exl_kv_cache_free(s->model, s->cache);
    exl_free(s->pages);
    exl_free(s);
}

void exl_session_reset(exl_session *s) { s->length = 0; }

int32_t exl_session_length(const exl_session *s) { return s->length; }

exl_status exl_session_eval(exl_session *s, const int32_t *ids, int32_t n, float *logits, float *last_logits) {
    if (n < 1)
        return exl_fail(EXL_ERR_ARG, "session: nothing to evaluate");
    if ((int64_t)s->length + n > s->max_tokens)
        return exl_fail(EXL_ERR_ARG, "session: %d tokens would exceed its capacity of %d", s->length + n,
                        s->max_tokens);
    int32_t vocab = s->model->cfg.vocab_size;
    int32_t chunk = exl_model_max_rows(s->model);
    if (logits && chunk > ALL_LOGITS_CHUNK)
        chunk = ALL_LOGITS_CHUNK;
    for (int32_t done = 0; done < n; done += chunk) {
        int32_t m = n - done < chunk ? n - done : chunk;
        int last_chunk = done + m == n;
        exl_seq_step step = {ids + done, m, s->length, s->pages, s->n_pages, 0};
        float *dst = NULL;
        if (logits) {
            step.want_logits = 2;
            dst = logits + (int64_t)done * vocab;
        } else if (last_logits && last_chunk) {
            step.want_logits = 1;
            dst = last_logits;
        }
        EXL_TRY(exl_model_forward(s->model, s->cache, &step, 1, dst));
        s->length += m;
    }
    if (logits && last_logits)
        for (int32_t i = 0; i < vocab; i++)
            last_logits[i] = logits[(int64_t)(n - 1) * vocab + i];
    return EXL_OK;
}
