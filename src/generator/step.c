/* step.c - one generator step: take in submitted and cancelled jobs, run the scheduled
 * tokens through the model, sample for the jobs whose last token was fed, and report. */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- finishing */

exl_status exl_gen_finish(exl_generator *g, exl_job *j, exl_finish_reason why, const char *error) {
    if (error)
        j->error = exl_strdup(error);
    exl_status st = exl_job_text_finish(g, j);
    exl_job_release_pages(g, j);
    exl_job_list_remove(j->state == EXL_JOB_RUNNING ? &g->running : &g->waiting, j);
    exl_job_list_insert(&g->done, j);
    j->state = EXL_JOB_DONE;
    j->finish = why;
    g->stats.jobs_finished++;
    return st;
}

/* ---------------------------------------------------------------- sampling one job */

int exl_gen_is_stop(const exl_generator *g, const exl_job *j, int32_t id) {
    for (int32_t i = 0; i < j->n_stop_ids; i++)
        if (j->stop_ids[i] == id)
            return 1;
    for (int32_t i = 0; !j->ignore_eos && i < g->n_eos; i++)
        if (g->eos[i] == id)
            return 1;
    return 0;
}

/* Log-probabilities under the model's own distribution (the raw logits). */
static void record_logprobs(exl_generator *g, exl_job *j, const float *raw, int32_t id, int32_t k) {
    float m = -INFINITY;
    for (int32_t i = 0; i < g->vocab; i++)
        m = raw[i] > m ? raw[i] : m;
    double sum = 0;
    for (int32_t i = 0; i < g->vocab; i++)
        sum += exp((double)raw[i] - m);
    float lse = m + (float)log(sum);
    j->lp[k] = raw[id] - lse;
    if (!j->top_logprobs)
        return;
    exl_token_logprob *top = j->top + (size_t)k * j->top_logprobs;
    int32_t n = 0;
    for (int32_t i = 0; i < g->vocab; i++) { /* insertion into the running top list */
        if (n == j->top_logprobs && raw[i] <= top[n - 1].logprob)
            continue;
        int32_t at = n < j->top_logprobs ? n++ : n - 1;
        while (at > 0 && top[at - 1].logprob < raw[i]) {
            top[at] = top[at - 1];
            at--;
        }
        top[at] = (exl_token_logprob){i, raw[i]};
    }
    for (int32_t i = 0; i < n; i++)
        top[i].logprob -= lse;
}

static exl_status ban(exl_job *j, int32_t pos, int32_t id) {
    int32_t n = 0;
    for (int32_t i = 0; i < j->n_bans; i++) /* bans further on belonged to another context */
        if (j->ban_pos[i] <= pos) {
            j->ban_pos[n] = j->ban_pos[i];
            j->ban_id[n++] = j->ban_id[i];
        }
    j->n_bans = n;
    if (n == j->cap_bans) {
        int32_t cap = n ? 2 * n : 8;
        int32_t *p = exl_realloc(j->ban_pos, (size_t)cap * sizeof *p);
        if (p)
            j->ban_pos = p;
        int32_t *q = p ? exl_realloc(j->ban_id, (size_t)cap * sizeof *q) : NULL;
        if (!q)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        j->ban_id = q;
        j->cap_bans = cap;
    }
    j->ban_pos[n] = pos;
    j->ban_id[n] = id;
    j->n_bans++;
    return EXL_OK;
}

/* A banned string appeared from generated token k on: take it back and ban it there. */
static exl_status rewind_job(exl_generator *g, exl_job *j, int32_t k) {
    int32_t pos = j->n_prompt + k;
    EXL_TRY(ban(j, pos, j->tokens[pos]));
    j->rng.mu = j->mu_hist[k];
    g->stats.tokens_generated -= j->n_tokens - pos;
    g->stats.rewinds++;
    EXL_TRY(exl_job_text_rewind(g, j, k));
    return exl_job_truncate(g, j, pos);
}

/* How many of the largest logits the job's next token needs when that is all it needs (see
 * exl_sampler_head_size); 0 when it needs all of them: log-probabilities, a ban at this
 * position, stop tokens still suppressed. */
static int32_t head_size(const exl_generator *g, const exl_job *j) {
    if (j->logprobs || j->top_logprobs || j->n_tokens - j->n_prompt < j->min_new)
        return 0;
    for (int32_t i = 0; i < j->n_bans; i++)
        if (j->ban_pos[i] == j->n_tokens)
            return 0;
    return exl_sampler_head_size(&j->sampling, g->vocab, g->head_max);
}

/* The head the step's sampling jobs need (the largest of theirs), or 0 if one needs all logits. */
static int32_t step_head_size(const exl_generator *g) {
    int32_t k = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        if (!g->steps[s].want_logits)
            continue;
        int32_t kj = g->steps[s].want_logits == 1 || g->step_jobs[s]->spec.q_row < 0 ? head_size(g, g->step_jobs[s])
                                                                                     : 0; /* q: the full p */
        if (!kj)
            return 0;
        k = kj > k ? kj : k;
    }
    return k;
}

void exl_gen_prepare_logits(const exl_generator *g, const exl_job *j, float *logits) {
    int32_t pos = j->n_tokens;
    for (int32_t i = 0; i < j->n_bans; i++)
        if (j->ban_pos[i] == pos)
            logits[j->ban_id[i]] = -INFINITY;
    if (pos - j->n_prompt < j->min_new)
        for (int32_t id = 0; id < g->vocab; id++)
            if (exl_gen_is_stop(g, j, id))
                logits[id] = -INFINITY;
}

static exl_status accept_token(exl_generator *g, exl_job *j, int32_t row, int32_t id);

/* The next token from the full logits (modified), from the head (ids, vals sorted), or (all NULL) from the
 * backend's sample op; row: the job's row of logits in the step (its mask's, when constrained). */
static exl_status sample_job(exl_generator *g, exl_job *j, int32_t row, float *logits, const int32_t *ids,
                             const float *vals) {
    int32_t k = j->n_tokens - j->n_prompt;
    float *raw = NULL;
    if (logits && (j->logprobs || j->top_logprobs)) {
        raw = g->raw;
        memcpy(raw, logits, (size_t)g->vocab * sizeof *raw);
    }
    if (logits)
        exl_gen_prepare_logits(g, j, logits);
    j->mu_hist[k] = j->rng.mu;
    int32_t id = logits
                     ? exl_sampler_sample(&j->sampling, &j->rng, logits, g->vocab, j->tokens, j->n_tokens, &g->scratch)
                 : ids ? exl_sampler_sample_head(&j->sampling, &j->rng, ids, vals, &g->scratch)
                       : exl_gen_dsample_take(g, j, row);
    if (raw && id >= 0)
        record_logprobs(g, j, raw, id, k);
    return accept_token(g, j, row, id);
}

/* Append the sampled token (-1: none could be) and see what follows: the job's end, a banned string. */
static exl_status accept_token(exl_generator *g, exl_job *j, int32_t row, int32_t id) {
    if (id < 0 || (j->constraint && !exl_gen_constraint_allows(g, row, id)))
        return exl_gen_finish(g, j, EXL_FINISH_ERROR, "every token is banned at this position");
    return exl_gen_take_token(g, j, id);
}

exl_status exl_gen_take_token(exl_generator *g, exl_job *j, int32_t id) {
    int32_t k = j->n_tokens - j->n_prompt;
    j->tokens[j->n_tokens++] = id;
    g->stats.tokens_generated++;
    if (!j->t_first) {
        j->t_first = exl_gen_now();
        j->step_first = g->trace.step;
    }
    if (exl_gen_is_stop(g, j, id)) {
        j->stop_token = id;
        return exl_gen_finish(g, j, EXL_FINISH_STOP, NULL);
    }
    int32_t banned_at;
    EXL_TRY(exl_job_text_update(g, j, &banned_at));
    if (banned_at >= 0)
        return rewind_job(g, j, banned_at);
    if (j->stop_string)
        return exl_gen_finish(g, j, EXL_FINISH_STOP, NULL);
    if (j->constraint) /* ends the job where the output is complete or the length is reached */
        return exl_gen_constraint_advance(g, j, id);
    if (k + 1 >= j->max_new)
        return exl_gen_finish(g, j, EXL_FINISH_LENGTH, NULL);
    return EXL_OK;
}

/* ---------------------------------------------------------------- events */

static void add_event(exl_generator *g, exl_job *j) {
    int32_t n_gen = j->n_tokens - j->n_prompt, final = n_gen;
    if (j->banned.n && j->state != EXL_JOB_DONE)
        while (final > j->n_reported && j->text_end[final - 1] > j->emitted)
            final--;
    if (final == j->n_reported && !j->ev_text.len && j->state != EXL_JOB_DONE)
        return;
    int32_t r = j->n_reported, ntop = j->top_logprobs;
    g->events[g->n_events] = (exl_gen_event){
        .job = j->id,
        .user = j->user,
        .text = j->ev_text.data ? j->ev_text.data : "",
        .text_len = j->ev_text.len,
        .ids = j->tokens + j->n_prompt + r,
        .n_ids = final - r,
        .logprobs = j->logprobs ? j->lp + r : NULL,
        .top_logprobs = ntop ? j->top + (size_t)r * ntop : NULL,
        .n_top_logprobs = ntop,
        .finish = j->state == EXL_JOB_DONE ? j->finish : EXL_FINISH_NONE,
        .stop_token = j->stop_token,
        .stop_string = j->stop_string,
        .n_prompt_tokens = j->n_prompt,
        .n_cached_tokens = j->n_cached_prompt,
        .n_generated = n_gen,
        .error = j->error,
        .n_draft_proposed = j->spec.proposed,
        .n_draft_accepted = j->spec.accepted,
    };
    g->event_jobs[g->n_events++] = j;
    j->n_reported = final;
}

/* ---------------------------------------------------------------- the step */

/* Take in what other threads did since the last step (under the mutex). */
static exl_status take_inbox(exl_generator *g) {
    pthread_mutex_lock(&g->mu);
    exl_gen_trace_begin(g, g->inbox.n);
    int32_t n = g->alive.n;
    exl_status st = EXL_OK;
    if (exl_job_list_reserve(&g->waiting, n) || exl_job_list_reserve(&g->running, n) ||
        exl_job_list_reserve(&g->done, n) || exl_gen_reserve_events(g, n))
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == EXL_OK && i < g->inbox.n; i++) {
        g->inbox.v[i]->state = EXL_JOB_WAITING;
        exl_job_list_insert(&g->waiting, g->inbox.v[i]);
    }
    if (st == EXL_OK)
        g->inbox.n = 0;
    for (int32_t i = 0; i < g->alive.n; i++)
        g->alive.v[i]->cancel_seen = g->alive.v[i]->cancel;
    pthread_mutex_unlock(&g->mu);
    return st;
}

/* Make this step's outcome visible to other threads (under the mutex). */
static void publish(exl_generator *g) {
    pthread_mutex_lock(&g->mu);
    for (int32_t i = 0; i < g->done.n; i++)
        exl_job_list_remove(&g->alive, g->done.v[i]);
    g->stats.jobs_waiting = g->waiting.n;
    g->stats.jobs_running = g->running.n;
    g->stats.pages_total = g->pool.n_pages;
    g->stats.pages_free = g->pool.n_free;
    g->stats.pages_cached = g->pool.n_cached;
    g->stats.pages_used = g->pool.n_pages - g->pool.n_free - g->pool.n_cached;
    g->stats.jobs_submitted = g->published.jobs_submitted; /* counted by submit */
    g->published = g->stats;
    pthread_mutex_unlock(&g->mu);
}

static exl_status run_step(exl_generator *g) {
    for (int32_t i = g->waiting.n - 1; i >= 0; i--)
        if (g->waiting.v[i]->cancel_seen)
            EXL_TRY(exl_gen_finish(g, g->waiting.v[i], EXL_FINISH_CANCELLED, NULL));
    for (int32_t i = g->waiting.n - 1; i >= 0; i--) { /* new constrained jobs: what the grammar forces first */
        exl_job *j = g->waiting.v[i];
        if (j->constraint && !j->cstarted && exl_gen_constraint_start(g, j) != EXL_OK && j->state != EXL_JOB_DONE)
            EXL_TRY(exl_gen_finish(g, j, EXL_FINISH_ERROR, exl_last_error()));
    }
    for (int32_t i = g->running.n - 1; i >= 0; i--)
        if (g->running.v[i]->cancel_seen)
            EXL_TRY(exl_gen_finish(g, g->running.v[i], EXL_FINISH_CANCELLED, NULL));
    EXL_TRY(exl_sched_plan(g));
    /* drafting jobs' decode rows carry their drafts */
    EXL_TRY(exl_spec_plan(g));
    int64_t ticket = exl_gen_ahead_take(g); /* >= 0: the planned step was queued in the last one */
    exl_gen_trace_planned(g, ticket);
    if (!g->n_step)
        return EXL_OK;
    double t0 = exl_gen_now();
    exl_gen_ahead_mode ahead = ticket >= 0 ? g->ahead.mode : exl_gen_ahead_step_mode(g); /* the device runs ahead */
    int greedy = ahead == EXL_AHEAD_GREEDY;                                              /* the device picks */
    int on_backend = ahead == EXL_AHEAD_SAMPLED || (!greedy && exl_gen_dsample_step(g)); /* the backend samples */
    int32_t head = greedy || on_backend ? 0 : step_head_size(g); /* > 0: only the head of each row comes back */
    exl_status st;
    exl_lora_step_sets(g->model, g->step_sets, g->n_step);
    if (ahead) {
        st = exl_gen_ahead_run(g, ticket, ahead);
    } else if (on_backend) {
        st = exl_gen_dsample_forward(g);
    } else if (exl_gen_step_constrained(g)) { /* the masks are filled while the device runs */
        st = exl_model_forward_masked(g->model, g->cache, g->steps, g->n_step, exl_gen_fill_masks, g, g->masks, head,
                                      g->head_ids, g->head_vals, g->logits);
    } else {
        st = head ? exl_model_forward_top_k(g->model, g->cache, g->steps, g->n_step, head, g->head_ids, g->head_vals)
                  : exl_model_forward(g->model, g->cache, g->steps, g->n_step, g->logits);
    }
    exl_lora_step_sets(g->model, NULL, 0); /* for a forward that did not run (queued ahead, or failed) */
    double t1 = exl_gen_now();
    g->stats.seconds_forward += t1 - t0;
    if (st != EXL_OK) {
        char msg[512];
        snprintf(msg, sizeof msg, "%s", exl_last_error());
        exl_gen_ahead_drop(g);
        for (int32_t s = 0; s < g->n_step; s++)
            exl_gen_finish(g, g->step_jobs[s], EXL_FINISH_ERROR, msg);
        return exl_fail(st, "%s", msg);
    }
    if (ahead)
        exl_gen_ahead_fed(g);
    g->stats.steps++;
    exl_sched_commit(g);
    int32_t row = 0;
    const float no_val = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        exl_job *j = g->step_jobs[s];
        if (!g->steps[s].want_logits)
            continue;
        size_t at = (size_t)row * (head ? head : g->vocab);
        exl_status js = g->steps[s].want_logits == 2 ? exl_spec_verify(g, j, &g->steps[s], head ? NULL : g->logits + at,
                                                                       head, g->head_ids + at, g->head_vals + at)
                        : greedy                     ? sample_job(g, j, row, NULL, g->ahead.ids + row, &no_val)
                        : on_backend                 ? sample_job(g, j, row, NULL, NULL, NULL)
                        : head                       ? sample_job(g, j, row, NULL, g->head_ids + at, g->head_vals + at)
                                                     : sample_job(g, j, row, g->logits + at, NULL, NULL);
        row += exl_seq_step_logit_rows(&g->steps[s]);
        if (js != EXL_OK && j->state != EXL_JOB_DONE) /* never leave a job without its next token */
            exl_gen_finish(g, j, EXL_FINISH_ERROR, exl_last_error());
        st = st == EXL_OK ? js : st;
    }
    g->stats.seconds_sampling += exl_gen_now() - t1;
    return st;
}

exl_status exl_generator_step(exl_generator *g, const exl_gen_event **events, int32_t *n_events) {
    if (!g || !events || !n_events)
        return exl_fail(EXL_ERR_ARG, "exl_generator_step: NULL argument");
    *events = NULL;
    *n_events = 0;
    /* last step's events are consumed: forget their text, free finished jobs */
    for (int32_t i = 0; i < g->n_events; i++)
        exl_str_clear(&g->event_jobs[i]->ev_text);
    for (int32_t i = 0; i < g->done.n; i++)
        exl_job_free(g->done.v[i]);
    g->done.n = 0;
    g->n_events = 0;
    g->n_step = 0;
    EXL_TRY(take_inbox(g));
    exl_status st = run_step(g);
    for (int32_t s = 0; s < g->n_step; s++)
        if (g->step_jobs[s]->state != EXL_JOB_DONE)
            add_event(g, g->step_jobs[s]);
    for (int32_t i = 0; i < g->done.n; i++)
        add_event(g, g->done.v[i]);
    publish(g);
    exl_gen_trace_end(g);
    *events = g->events;
    *n_events = g->n_events;
    return st;
}
