/* job.c - a job's life outside the step: checked and copied from exl_job_params, kept
 * in priority-ordered lists, its pages released or cut back, and freed. */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <string.h>

#define MAX_TOP_LOGPROBS 20

/* ---------------------------------------------------------------- lists */

static int before(const exl_job *a, const exl_job *b) {
    return a->priority > b->priority || (a->priority == b->priority && a->order < b->order);
}

int exl_job_list_reserve(exl_job_list *l, int32_t n) {
    if (n <= l->cap)
        return 0;
    int32_t cap = l->cap ? l->cap : 16;
    while (cap < n)
        cap *= 2;
    exl_job **v = exl_realloc(l->v, (size_t)cap * sizeof *v);
    if (!v)
        return -1;
    l->v = v;
    l->cap = cap;
    return 0;
}

void exl_job_list_insert(exl_job_list *l, exl_job *j) {
    int32_t i = l->n;
    while (i > 0 && before(j, l->v[i - 1])) {
        l->v[i] = l->v[i - 1];
        i--;
    }
    l->v[i] = j;
    l->n++;
}

void exl_job_list_remove(exl_job_list *l, exl_job *j) {
    for (int32_t i = 0; i < l->n; i++)
        if (l->v[i] == j) {
            memmove(l->v + i, l->v + i + 1, (size_t)(l->n - i - 1) * sizeof *l->v);
            l->n--;
            return;
        }
}

void exl_job_list_free(exl_job_list *l) {
    exl_free(l->v);
    *l = (exl_job_list){0};
}

/* ---------------------------------------------------------------- checking the request */

static exl_status check_sampling(const exl_sampling *s, int32_t vocab) {
    if (!(s->temperature >= 0) || !isfinite(s->temperature))
        return exl_fail(EXL_ERR_ARG, "job: temperature must be a finite number >= 0");
    if (s->top_k < 0)
        return exl_fail(EXL_ERR_ARG, "job: top_k must be >= 0");
    if (!(s->top_p > 0 && s->top_p <= 1) || !(s->typical_p > 0 && s->typical_p <= 1) ||
        !(s->tfs_z > 0 && s->tfs_z <= 1))
        return exl_fail(EXL_ERR_ARG, "job: top_p, typical_p and tfs_z must be in (0, 1]");
    if (!(s->min_p >= 0 && s->min_p <= 1))
        return exl_fail(EXL_ERR_ARG, "job: min_p must be in [0, 1]");
    if (s->mirostat != 0 && s->mirostat != 2)
        return exl_fail(EXL_ERR_ARG, "job: mirostat must be 0 (off) or 2 (Mirostat v2), not %d", s->mirostat);
    if (s->mirostat &&
        (!(s->mirostat_tau > 0) || !(s->mirostat_eta >= 0) || !isfinite(s->mirostat_tau) || !isfinite(s->mirostat_eta)))
        return exl_fail(EXL_ERR_ARG, "job: mirostat needs tau > 0 and eta >= 0");
    if (!(s->repetition_penalty > 0) || !isfinite(s->repetition_penalty) || !isfinite(s->frequency_penalty) ||
        !isfinite(s->presence_penalty))
        return exl_fail(EXL_ERR_ARG, "job: penalties must be finite (repetition_penalty > 0)");
    if (s->penalty_range < 0)
        return exl_fail(EXL_ERR_ARG, "job: penalty_range must be >= 0");
    if (s->n_logit_bias < 0 || (s->n_logit_bias > 0 && !s->logit_bias))
        return exl_fail(EXL_ERR_ARG, "job: bad logit_bias list");
    for (int32_t i = 0; i < s->n_logit_bias; i++)
        if (s->logit_bias[i].id < 0 || s->logit_bias[i].id >= vocab || isnan(s->logit_bias[i].bias) ||
            s->logit_bias[i].bias == INFINITY)
            return exl_fail(EXL_ERR_ARG, "job: logit_bias entry %d (token %d) is invalid", i, s->logit_bias[i].id);
    return EXL_OK;
}

static exl_status check_params(const exl_generator *g, const exl_job_params *p) {
    if ((p->ids == NULL) == (p->text == NULL))
        return exl_fail(EXL_ERR_ARG, "job: give the prompt as either ids or text");
    if (p->ids && p->n_ids < 1)
        return exl_fail(EXL_ERR_ARG, "job: the prompt is empty");
    for (int32_t i = 0; p->ids && i < p->n_ids; i++)
        if (p->ids[i] < 0 || p->ids[i] >= g->vocab)
            return exl_fail(EXL_ERR_ARG, "job: prompt token %d at position %d is outside the vocabulary (0..%d)",
                            p->ids[i], i, g->vocab - 1);
    if (p->max_new_tokens < 1 || p->min_new_tokens < 0)
        return exl_fail(EXL_ERR_ARG, "job: max_new_tokens must be >= 1 and min_new_tokens >= 0");
    if (p->n_stop_ids < 0 || (p->n_stop_ids > 0 && !p->stop_ids))
        return exl_fail(EXL_ERR_ARG, "job: bad stop_ids list");
    for (int32_t i = 0; i < p->n_stop_ids; i++)
        if (p->stop_ids[i] < 0 || p->stop_ids[i] >= g->vocab)
            return exl_fail(EXL_ERR_ARG, "job: stop token %d is outside the vocabulary", p->stop_ids[i]);
    const char *const *lists[2] = {p->stop_strings, p->banned_strings};
    int32_t counts[2] = {p->n_stop_strings, p->n_banned_strings};
    for (int k = 0; k < 2; k++) {
        if (counts[k] < 0 || (counts[k] > 0 && !lists[k]))
            return exl_fail(EXL_ERR_ARG, "job: bad %s list", k ? "banned_strings" : "stop_strings");
        for (int32_t i = 0; i < counts[k]; i++)
            if (!lists[k][i] || !lists[k][i][0])
                return exl_fail(EXL_ERR_ARG, "job: %s entry %d is empty", k ? "banned_strings" : "stop_strings", i);
    }
    if (p->constraint && p->n_banned_strings)
        return exl_fail(EXL_ERR_ARG, "job: banned_strings cannot be combined with a constraint");
    if (p->top_logprobs < 0 || p->top_logprobs > MAX_TOP_LOGPROBS)
        return exl_fail(EXL_ERR_ARG, "job: top_logprobs must be in 0..%d", MAX_TOP_LOGPROBS);
    return check_sampling(&p->sampling, g->vocab);
}

/* ---------------------------------------------------------------- create / free */

static int copy_strings(exl_string_set *set, const char *const *src, int32_t n) {
    if (n == 0)
        return 0;
    set->s = exl_calloc((size_t)n, sizeof *set->s);
    set->len = exl_calloc((size_t)n, sizeof *set->len);
    if (!set->s || !set->len)
        return -1;
    for (set->n = 0; set->n < n; set->n++) {
        if (!(set->s[set->n] = exl_strdup(src[set->n])))
            return -1;
        set->len[set->n] = strlen(src[set->n]);
    }
    return 0;
}

static void free_strings(exl_string_set *set) {
    for (int32_t i = 0; i < set->n; i++)
        exl_free(set->s[i]);
    exl_free(set->s);
    exl_free(set->len);
}

static exl_status alloc_job(exl_generator *g, const exl_job_params *p, const int32_t *ids, int32_t n_ids, exl_job *j) {
    int32_t ps = g->params.page_size;
    int64_t capacity = (int64_t)g->params.n_pages * ps;
    if ((int64_t)n_ids + p->max_new_tokens > capacity)
        return exl_fail(EXL_ERR_ARG, "job: %d prompt tokens + %d new tokens exceed the cache (%lld tokens)", n_ids,
                        p->max_new_tokens, (long long)capacity);
    size_t cap = (size_t)n_ids + (size_t)p->max_new_tokens, max_new = (size_t)p->max_new_tokens;
    j->cap_tokens = (int32_t)cap;
    j->cap_pages = (int32_t)((cap + (size_t)ps - 1) / (size_t)ps);
    j->tokens = exl_malloc(cap * sizeof *j->tokens);
    j->pages = exl_malloc((size_t)j->cap_pages * sizeof *j->pages);
    j->chain = exl_malloc((size_t)j->cap_pages * sizeof *j->chain);
    j->mu_hist = exl_malloc(max_new * sizeof *j->mu_hist);
    j->lp = exl_malloc(max_new * sizeof *j->lp);
    j->text_end = exl_malloc(max_new * sizeof *j->text_end);
    if (p->top_logprobs)
        j->top = exl_malloc(max_new * (size_t)p->top_logprobs * sizeof *j->top);
    if (p->n_stop_ids)
        j->stop_ids = exl_malloc((size_t)p->n_stop_ids * sizeof *j->stop_ids);
    if (p->sampling.n_logit_bias)
        j->logit_bias = exl_malloc((size_t)p->sampling.n_logit_bias * sizeof *j->logit_bias);
    if (!j->tokens || !j->pages || !j->chain || !j->mu_hist || !j->lp || !j->text_end || (p->top_logprobs && !j->top) ||
        (p->n_stop_ids && !j->stop_ids) || (p->sampling.n_logit_bias && !j->logit_bias) ||
        copy_strings(&j->stop, p->stop_strings, p->n_stop_strings) ||
        copy_strings(&j->banned, p->banned_strings, p->n_banned_strings))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    memcpy(j->tokens, ids, (size_t)n_ids * sizeof *ids);
    if (p->n_stop_ids)
        memcpy(j->stop_ids, p->stop_ids, (size_t)p->n_stop_ids * sizeof *j->stop_ids);
    if (p->sampling.n_logit_bias)
        memcpy(j->logit_bias, p->sampling.logit_bias, (size_t)p->sampling.n_logit_bias * sizeof *j->logit_bias);
    j->sampling.logit_bias = j->logit_bias;
    return EXL_OK;
}

exl_status exl_job_create(exl_generator *g, const exl_job_params *p, exl_job **out) {
    *out = NULL;
    EXL_TRY(check_params(g, p));
    exl_lora_set lora;
    EXL_TRY(exl_lora_job_set(g->model, p->lora, p->n_lora, &lora));
    int32_t *enc = NULL, n_enc = 0;
    const int32_t *ids = p->ids;
    int32_t n_ids = p->n_ids;
    if (p->text) {
        EXL_TRY(exl_tokenizer_encode(g->tok, p->text, strlen(p->text), p->add_special != 0, &enc, &n_enc));
        for (int32_t i = 0; i < n_enc; i++)
            if (enc[i] >= g->vocab) {
                exl_ids_free(enc);
                return exl_fail(EXL_ERR_ARG, "job: the tokenizer gave token %d, outside the model's vocabulary",
                                enc[i]);
            }
        ids = enc;
        n_ids = n_enc;
        if (n_ids < 1) {
            exl_ids_free(enc);
            return exl_fail(EXL_ERR_ARG, "job: the prompt is empty");
        }
    }
    exl_job *j = exl_calloc(1, sizeof *j);
    exl_status st = j ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK) {
        j->sampling = p->sampling;
        j->sampling.logit_bias = NULL;
        j->lora = lora;
        exl_lora_set_hold(&j->lora, 1);
        uint64_t h = exl_lora_set_hash(&lora);
        j->root = h ? (EXL_HASH_ROOT ^ h) | 1 : EXL_HASH_ROOT;
        st = alloc_job(g, p, ids, n_ids, j);
    }
    exl_ids_free(enc);
    if (st == EXL_OK) {
        j->user = p->user;
        j->priority = p->priority;
        j->max_new = p->max_new_tokens;
        j->min_new = p->min_new_tokens;
        j->n_stop_ids = p->n_stop_ids;
        j->ignore_eos = p->ignore_eos != 0;
        j->logprobs = p->logprobs != 0;
        j->top_logprobs = p->top_logprobs;
        j->n_tokens = j->n_prompt = n_ids;
        j->stop_token = -1;
        if (p->constraint) {
            j->constraint = exl_constraint_ref(p->constraint);
            j->cstate = p->constraint->matcher.start;
        }
        exl_sampler_init(&j->rng, &j->sampling);
        exl_spec_job_init(g, j, p);
        st = exl_job_text_init(g, j);
    }
    if (st != EXL_OK) {
        exl_job_free(j);
        return st;
    }
    *out = j;
    return EXL_OK;
}

void exl_job_free(exl_job *j) {
    if (!j)
        return;
    exl_lora_set_hold(&j->lora, -1);
    exl_free(j->tokens);
    exl_free(j->pages);
    exl_free(j->chain);
    exl_free(j->mu_hist);
    exl_free(j->lp);
    exl_free(j->top);
    exl_free(j->text_end);
    exl_free(j->stop_ids);
    exl_free(j->logit_bias);
    exl_free(j->ban_pos);
    exl_free(j->ban_id);
    free_strings(&j->stop);
    free_strings(&j->banned);
    exl_detokenizer_free(j->detok);
    exl_str_free(&j->held);
    exl_str_free(&j->ev_text);
    exl_free(j->error);
    exl_constraint_free(j->constraint);
    exl_free(j);
}

/* ---------------------------------------------------------------- pages */

uint64_t exl_job_parent_hash(exl_job *j, int32_t page_size, int32_t i) {
    while (j->n_chain < i) {
        int32_t k = j->n_chain;
        uint64_t parent = k ? j->chain[k - 1] : j->root;
        j->chain[k] = exl_prefix_hash(parent, j->tokens + (size_t)k * page_size, page_size);
        j->n_chain++;
    }
    return i ? j->chain[i - 1] : j->root;
}

void exl_job_release_pages(exl_generator *g, exl_job *j) {
    while (j->n_pages > 0)
        exl_page_pool_release(&g->pool, j->pages[--j->n_pages]);
    j->n_cached = 0;
}

exl_status exl_job_truncate(exl_generator *g, exl_job *j, int32_t n) {
    exl_page_pool *pool = &g->pool;
    int32_t ps = pool->page_size;
    j->n_tokens = n;
    if (j->n_chain > n / ps)
        j->n_chain = n / ps;
    if (j->n_cached > n - 1) /* the last token is fed again for its logits */
        j->n_cached = n - 1;
    int32_t pi = j->n_cached / ps, off = j->n_cached % ps;
    int32_t keep = off ? pi + 1 : pi;
    while (j->n_pages > keep)
        exl_page_pool_release(pool, j->pages[--j->n_pages]);
    if (!off || pi >= j->n_pages)
        return EXL_OK;
    int32_t page = j->pages[pi];
    if (pool->ref[page] == 1) {
        exl_page_pool_truncate(pool, page, off);
        return EXL_OK;
    }
    /* shared with another job: continue in a copy of its first `off` slots */
    int32_t copy = exl_page_pool_take(pool, pool->parent[page]);
    if (copy < 0) { /* no page to spare: start over (the prefix cache still has it) */
        exl_job_release_pages(g, j);
        return EXL_OK;
    }
    exl_status st = exl_kv_cache_copy_page(g->model, g->cache, page, copy, off);
    if (st != EXL_OK) {
        exl_page_pool_release(pool, copy);
        return st;
    }
    memcpy(pool->tokens + (size_t)copy * ps, pool->tokens + (size_t)page * ps, (size_t)off * sizeof *pool->tokens);
    pool->n_valid[copy] = off;
    exl_page_pool_release(pool, page);
    j->pages[pi] = copy;
    g->stats.pages_copied++;
    return EXL_OK;
}
