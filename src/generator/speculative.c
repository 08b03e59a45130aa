/* speculative.c - speculative decoding: which jobs draft, their drafts added to the step, verification of the
 * model's rows against them (exact: greedy gives plain decoding's tokens, sampling its distribution), rollback by
 * page bookkeeping, and the adaptive draft length.
 *
 * Verification, row i of a job's step (the logits after its first i drafts):
 *   - a draft that is a point mass (n-gram, or any draft of a greedy job): the token is drawn from row i exactly
 *     as plain decoding draws it, and the draft is accepted when they are equal. For q a point mass at d this is
 *     speculative sampling itself: d is accepted with probability p(d) = min(1, p(d)/q(d)), and otherwise the
 *     token comes from p without d, which is max(0, p - q) normalized. It draws as plain decoding does, so a
 *     seeded job gives plain decoding's tokens.
 *   - a draft d the draft model sampled from q: accepted when u < p(d) / q(d) (u uniform from the job's stream),
 *     else the token is drawn from max(0, p - q) normalized.
 * The first row whose token is not the draft ends the job's step; when every draft is accepted the last row gives
 * one more token. Each token goes through exl_gen_take_token as in plain decoding (stop tokens, stop and banned
 * strings, length), which may end or rewind the job; verification then stops.
 *
 * Adaptive k (unless params.draft_fixed): a job starts at draft_tokens; a step whose drafts were all accepted
 * raises k by one (up to draft_tokens), a step with a rejection lowers it by one (down to 1). */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"

#include <string.h>

exl_status exl_spec_init(exl_generator *g) {
    const exl_generator_params *p = &g->params;
    if (p->draft_tokens < 0 || p->draft_tokens > EXL_MAX_DRAFT_TOKENS || p->ngram < 0)
        return exl_fail(EXL_ERR_ARG, "generator: draft_tokens must be in 0..%d and ngram >= 0", EXL_MAX_DRAFT_TOKENS);
    if (p->draft_tokens == 0)
        return EXL_OK;
    if (!p->draft_model && !p->ngram)
        return exl_fail(EXL_ERR_ARG, "generator: draft_tokens needs a draft model or ngram");
    exl_spec *sp = exl_calloc(1, sizeof *sp);
    if (!sp)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    g->spec = sp;
    sp->max_k = p->draft_tokens;
    sp->ngram = p->ngram;
    sp->fixed = p->draft_fixed != 0;
    if (p->draft_model)
        EXL_TRY(exl_draft_model_init(g));
    return exl_draft_oracle_init(sp);
}

void exl_spec_free(exl_generator *g) {
    exl_spec *sp = g->spec;
    if (!sp)
        return;
    exl_draft_model_free(sp);
    exl_free(sp->q);
    exl_free(sp->jobs);
    exl_free(sp->d_steps);
    exl_free(sp->d_pos);
    exl_free(sp->d_rows);
    exl_free(sp->d_idx);
    exl_free(sp->d_head_ids);
    exl_free(sp->d_head_vals);
    exl_free(sp->oracle);
    exl_free(sp);
    g->spec = NULL;
}

void exl_spec_job_init(const exl_generator *g, exl_job *j, const exl_job_params *p) {
    j->spec = (exl_spec_job){.q_row = -1};
    if (!g->spec || p->no_draft || p->constraint || p->logprobs || p->top_logprobs || p->sampling.mirostat)
        return;
    j->spec.enabled = 1;
    j->spec.k = g->spec->max_k;
    exl_sampling s = p->sampling;
    s.seed ^= 0xd1b54a32d192ed03ull; /* the draft's own stream, seeded with the job */
    exl_sampler_init(&j->spec.rng, &s);
}

/* ---------------------------------------------------------------- planning */

static int grow_buf(void **buf, int32_t *cap, int32_t need, size_t elem) {
    if (need <= *cap)
        return 0;
    int32_t n = *cap ? *cap : 8;
    while (n < need)
        n *= 2;
    void *p = exl_realloc(*buf, (size_t)n * elem);
    if (!p)
        return -1;
    *buf = p;
    *cap = n;
    return 0;
}

/* Pages for positions [0, end) of job j, taken while any is free or cached (never preempting): the
 * positions covered. Their parent hash is set once the tokens are final (set_parents). */
static int32_t take_pages(exl_generator *g, exl_job *j, int32_t end) {
    int32_t ps = g->pool.page_size;
    while (j->n_pages * ps < end) {
        int32_t page = exl_page_pool_take(&g->pool, 0);
        if (page < 0)
            break;
        j->pages[j->n_pages++] = page;
    }
    return j->n_pages * ps < end ? j->n_pages * ps : end;
}

/* Room for the step's jobs in the spec's lists and for rows of logits in g->logits. */
static exl_status reserve(exl_generator *g, int32_t jobs, int32_t logit_rows) {
    exl_spec *sp = g->spec;
    int32_t cap = sp->cap_jobs;
    if (grow_buf((void **)&sp->jobs, &cap, jobs, sizeof *sp->jobs) ||
        (cap = sp->cap_jobs, grow_buf((void **)&sp->d_steps, &cap, jobs, sizeof *sp->d_steps)) ||
        (cap = sp->cap_jobs, grow_buf((void **)&sp->d_pos, &cap, jobs, sizeof *sp->d_pos)) ||
        (cap = sp->cap_jobs, grow_buf((void **)&sp->d_rows, &cap, jobs, sizeof *sp->d_rows)) ||
        (cap = sp->cap_jobs, grow_buf((void **)&sp->d_idx, &cap, jobs, sizeof *sp->d_idx)) ||
        (cap = sp->cap_jobs, grow_buf((void **)&sp->d_head_ids, &cap, jobs, sizeof *sp->d_head_ids)) ||
        (cap = sp->cap_jobs, grow_buf((void **)&sp->d_head_vals, &cap, jobs, sizeof *sp->d_head_vals)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    sp->cap_jobs = cap;
    if (logit_rows > g->cap_logit_rows) {
        size_t rows = (size_t)logit_rows, head = (size_t)(g->head_max ? g->head_max : 1);
        float *l = exl_realloc(g->logits, rows * g->vocab * sizeof *l);
        if (l)
            g->logits = l;
        int32_t *hi = l ? exl_realloc(g->head_ids, rows * head * sizeof *hi) : NULL;
        if (hi)
            g->head_ids = hi;
        float *hv = hi ? exl_realloc(g->head_vals, rows * head * sizeof *hv) : NULL;
        if (!hv)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        g->head_vals = hv;
        g->cap_logit_rows = logit_rows;
    }
    return EXL_OK;
}

exl_status exl_spec_plan(exl_generator *g) {
    exl_spec *sp = g->spec;
    /* a step queued ahead (ahead.c) feeds plain decode steps: take it as planned; constrained rows need one
     * mask per row */
    if (!sp || g->ahead.ticket >= 0 || exl_gen_step_constrained(g))
        return EXL_OK;
    int32_t budget = g->params.max_batch_tokens, rows = 0, n_model = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        budget -= g->steps[s].n_new;
        rows += exl_seq_step_logit_rows(&g->steps[s]);
    }
    EXL_TRY(reserve(g, g->n_step, 0));
    sp->n_q_rows = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        exl_job *j = g->step_jobs[s];
        exl_seq_step *st = &g->steps[s];
        j->spec.n_draft = 0;
        j->spec.from_model = 0;
        j->spec.q_row = -1;
        if (!j->spec.enabled || st->want_logits != 1 || st->n_new != 1 || st->n_past != j->n_tokens - 1)
            continue;
        int32_t T = j->n_tokens, k = j->spec.k;
        int32_t left = j->max_new - (T - j->n_prompt) - 1; /* the step yields one token besides the drafts */
        k = k < left ? k : left;
        k = k < budget ? k : budget;
        if (k <= 0)
            continue;
        k = take_pages(g, j, T + k) - T;
        int32_t n = sp->ngram && k > 0 ? exl_draft_ngram(j->tokens, T, sp->ngram, k, j->tokens + T) : 0;
        if (n == 0 && k > 0 && sp->draft) {
            j->spec.from_model = 1;
            sp->jobs[n_model++] = j;
            n = k;
        }
        while (j->n_pages > st->n_pages && (j->n_pages - 1) * g->pool.page_size >= T + n)
            exl_page_pool_release(&g->pool, j->pages[--j->n_pages]); /* taken for drafts that did not come */
        st->n_pages = j->n_pages;
        j->spec.n_draft = n;
        budget -= n;
    }
    if (n_model > 0)
        EXL_TRY(exl_draft_model_propose(g, sp->jobs, n_model));
    for (int32_t s = 0; s < g->n_step; s++) {
        exl_job *j = g->step_jobs[s];
        if (!j->spec.n_draft)
            continue;
        if (sp->oracle)
            exl_draft_oracle_apply(sp, j, g->vocab);
        g->steps[s].n_new = 1 + j->spec.n_draft;
        g->steps[s].want_logits = 2;
        j->step_tokens = 1 + j->spec.n_draft;
        rows += j->spec.n_draft;
    }
    return reserve(g, g->n_step, rows);
}

/* ---------------------------------------------------------------- verification */

/* Speculative sampling of a draft d drawn from q: d, or a token from max(0, p - q) normalized. */
static int32_t sample_against(exl_generator *g, exl_job *j, float *logits, const float *q, int32_t d) {
    exl_sampler_scratch *sc = &g->scratch;
    exl_sampler_process(&j->sampling, logits, g->vocab, j->tokens, j->n_tokens, sc);
    int32_t n = exl_sampler_filter(&j->sampling, &j->rng, logits, g->vocab, sc);
    if (n <= 0)
        return -1;
    exl_candidate *c = sc->cand;
    double total = 0, pd = 0;
    for (int32_t i = 0; i < n; i++)
        total += c[i].p;
    for (int32_t i = 0; i < n; i++)
        if (c[i].id == d)
            pd = c[i].p / total;
    if (exl_sampler_uniform(&j->rng) * q[d] < pd)
        return d;
    int32_t m = 0; /* the residual's support */
    for (int32_t i = 0; i < n; i++) {
        float r = (float)(c[i].p / total) - q[c[i].id];
        if (r > 0)
            c[m++] = (exl_candidate){c[i].id, r};
    }
    return m ? exl_sampler_draw(&j->sampling, &j->rng, sc, m) : d; /* none: p == q, d stands */
}

/* Pages taken for drafts get their parent hash once the tokens before them are final: those from *page on that
 * start at or before position `final` (the job's tokens before it are plain decoding's). */
static void set_parents(exl_generator *g, exl_job *j, int32_t *page, int32_t final) {
    int32_t ps = g->pool.page_size;
    for (; *page < j->n_pages && *page * ps <= final; ++*page)
        g->pool.parent[j->pages[*page]] = exl_job_parent_hash(j, ps, *page);
}

/* Cut job j back to its tokens after verification. Chain hashes computed while the drafts stood in the sequence
 * are dropped from the first position whose token may have changed; the pages taken for drafts that the job
 * keeps get their parent hash. */
static exl_status roll_back(exl_generator *g, exl_job *j, int32_t first_changed, int32_t *page) {
    int32_t ps = g->pool.page_size;
    if (j->n_chain > first_changed / ps)
        j->n_chain = first_changed / ps;
    EXL_TRY(exl_job_truncate(g, j, j->n_tokens));
    set_parents(g, j, page, j->n_tokens);
    return EXL_OK;
}

exl_status exl_spec_verify(exl_generator *g, exl_job *j, const exl_seq_step *st, float *logits, int32_t head,
                           const int32_t *ids, const float *vals) {
    exl_spec *sp = g->spec;
    int32_t T = j->n_tokens, k = st->n_new - 1, ps = g->pool.page_size;
    int32_t new_page = (T + ps - 1) / ps; /* pages taken for the drafts start here */
    int32_t drafts[EXL_MAX_DRAFT_TOKENS], accepted = 0;
    memcpy(drafts, j->tokens + T, (size_t)k * sizeof *drafts);
    const float *q = j->spec.q_row >= 0 ? sp->q + (size_t)j->spec.q_row * g->vocab : NULL;
    exl_status st_ = EXL_OK;
    for (int32_t i = 0; i <= k; i++) {
        j->mu_hist[j->n_tokens - j->n_prompt] = j->rng.mu;
        int32_t id;
        if (!logits) { /* the head suffices for these settings (as in plain decoding) */
            id = exl_sampler_sample_head(&j->sampling, &j->rng, ids + (size_t)i * head, vals + (size_t)i * head,
                                         &g->scratch);
        } else {
            float *row = logits + (size_t)i * g->vocab;
            exl_gen_prepare_logits(g, j, row);
            id = i < k && q
                     ? sample_against(g, j, row, q + (size_t)i * g->vocab, drafts[i])
                     : exl_sampler_sample(&j->sampling, &j->rng, row, g->vocab, j->tokens, j->n_tokens, &g->scratch);
        }
        if (id < 0) {
            st_ = exl_gen_finish(g, j, EXL_FINISH_ERROR, "every token is banned at this position");
            break;
        }
        int agree = i < k && id == drafts[i];
        accepted += agree;
        set_parents(g, j, &new_page, T + i); /* the tokens before T + i are final */
        st_ = exl_gen_take_token(g, j, id);
        if (st_ != EXL_OK || !agree || j->state == EXL_JOB_DONE || j->n_tokens != T + i + 1)
            break; /* rejected, or the job ended or rewound */
    }
    j->spec.proposed += k;
    j->spec.accepted += accepted;
    g->stats.draft_proposed += k;
    g->stats.draft_accepted += accepted;
    if (!sp->fixed)
        j->spec.k = accepted == k ? (j->spec.k < sp->max_k ? j->spec.k + 1 : sp->max_k)
                                  : (j->spec.k > 1 ? j->spec.k - 1 : 1);
    if (j->state == EXL_JOB_DONE)
        return st_;
    /* rollback: the cache keeps what the accepted tokens wrote; K/V past them is dropped with its pages or
     * overwritten by later steps (no copies: the pages written are the job's own) */
    exl_status rb = roll_back(g, j, T + accepted < j->n_tokens ? T + accepted : j->n_tokens, &new_page);
    return st_ != EXL_OK ? st_ : rb;
}
