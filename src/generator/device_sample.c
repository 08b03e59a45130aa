/* device_sample.c - a step's tokens sampled by the backend's sample op, where the logits lie: per row the job's
 * settings, its logit edits (bias, penalties over its history, bans) and one uniform number from its own random
 * stream go down, one token (and its log-probability when asked) comes back. The random stream advances only when
 * the op drew from more than one candidate, as exl_sampler_draw does, so a seed gives the same tokens either way.
 *
 * EXL_DEVICE_SAMPLING=0 turns it off (every sampled step then brings its logits to the host); on by default
 * wherever the backend has a sample op. */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

static int enabled(exl_generator *g) {
    exl_gen_dsample *d = &g->dsample;
    if (!d->checked) {
        const char *e = getenv("EXL_DEVICE_SAMPLING");
        d->enabled = g->model->be->ops->sample != NULL && (!e || strcmp(e, "0") != 0);
        d->checked = 1;
    }
    return d->enabled;
}

/* Whether the op covers job j's next token: settings without state across tokens (Mirostat) or an order of their
 * own (tail-free), and no distribution to report. */
static int covers(const exl_job *j) {
    return j->sampling.mirostat != 2 && j->sampling.tfs_z >= 1.0f && !j->top_logprobs;
}

int exl_gen_dsample_step(exl_generator *g) {
    if (!enabled(g))
        return 0;
    int32_t rows = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        if (!g->steps[s].want_logits)
            continue;
        if (g->steps[s].want_logits != 1 || !covers(g->step_jobs[s]))
            return 0;
        rows++;
    }
    return rows > 0;
}

static exl_status reserve_edits(exl_gen_dsample *d, int64_t n) {
    if (n <= d->cap_edits)
        return EXL_OK;
    if (n > INT32_MAX)
        return exl_fail(EXL_ERR_ARG, "too many logit edits in one step");
    int64_t cap = d->cap_edits ? 2 * (int64_t)d->cap_edits : 1024;
    cap = cap < n ? n : cap > INT32_MAX ? INT32_MAX : cap;
    exl_logit_edit *e = exl_realloc(d->edits, (size_t)cap * sizeof *e);
    if (!e)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    d->edits = e;
    d->cap_edits = (int32_t)cap;
    return EXL_OK;
}

static void add_edit(exl_gen_dsample *d, int32_t id, float v) { d->edits[d->n_edits++] = (exl_logit_edit){id, v}; }

/* Row `row`'s settings and edits for job j's token at pos (in the order exl_sampler_process and sample_job use): its
 * next one, or the one after where exl_gen_dsample_ahead_at holds. */
static exl_status prepare_row(exl_generator *g, exl_job *j, int32_t row, int32_t pos) {
    exl_gen_dsample *d = &g->dsample;
    const exl_sampling *sp = &j->sampling;
    int32_t k = pos - j->n_prompt;
    const int32_t *hist = j->tokens;
    int32_t n_hist = j->n_tokens;
    int penalize = sp->repetition_penalty != 1.0f || sp->frequency_penalty != 0.0f || sp->presence_penalty != 0.0f;
    if (!penalize)
        n_hist = 0;
    else if (sp->penalty_range > 0 && n_hist > sp->penalty_range) {
        hist += n_hist - sp->penalty_range;
        n_hist = sp->penalty_range;
    }
    int32_t n_stop = k < j->min_new ? j->n_stop_ids + (j->ignore_eos ? 0 : g->n_eos) : 0;
    EXL_TRY(reserve_edits(d, (int64_t)d->n_edits + sp->n_logit_bias + n_hist + j->n_bans + n_stop));
    exl_sampler_state rng = j->rng; /* the draw the op may use; taken from the job's stream once it did */
    exl_sample_params *p = &d->params[row];
    *p = (exl_sample_params){
        .temperature = sp->temperature,
        .top_k = sp->top_k,
        .top_p = sp->top_p,
        .min_p = sp->min_p,
        .typical_p = sp->typical_p,
        .repetition_penalty = sp->repetition_penalty,
        .frequency_penalty = sp->frequency_penalty,
        .presence_penalty = sp->presence_penalty,
        .first_edit = d->n_edits,
        .want_logprob = j->logprobs != 0,
        .u = exl_sampler_uniform(&rng),
    };
    p->u_next = exl_sampler_uniform(&rng);
    for (int32_t i = 0; i < sp->n_logit_bias; i++)
        add_edit(d, sp->logit_bias[i].id, sp->logit_bias[i].bias);
    p->n_bias = d->n_edits - p->first_edit;
    int32_t *counts = g->scratch.counts; /* zero between uses */
    for (int32_t i = 0; i < n_hist; i++)
        counts[hist[i]]++;
    for (int32_t i = 0; i < n_hist; i++)
        if (counts[hist[i]]) { /* at its first occurrence */
            add_edit(d, hist[i], (float)counts[hist[i]]);
            counts[hist[i]] = 0;
        }
    p->n_penalized = d->n_edits - p->first_edit - p->n_bias;
    for (int32_t i = 0; i < j->n_bans; i++)
        if (j->ban_pos[i] == pos)
            add_edit(d, j->ban_id[i], 0);
    for (int32_t i = 0; i < n_stop; i++) {
        int32_t id = i < j->n_stop_ids ? j->stop_ids[i] : g->eos[i - j->n_stop_ids];
        if (id >= 0 && id < g->vocab) /* as sample_job, which bans the stop ids among the logits */
            add_edit(d, id, 0);
    }
    p->n_banned = d->n_edits - p->first_edit - p->n_bias - p->n_penalized;
    return EXL_OK;
}

static exl_status prepare_rows(exl_generator *g, const exl_seq_step *steps, int next) {
    exl_gen_dsample *d = &g->dsample;
    if (!d->params) {
        d->params = exl_malloc((size_t)g->params.max_jobs * sizeof *d->params);
        d->out = exl_malloc((size_t)g->params.max_jobs * sizeof *d->out);
        if (!d->params || !d->out)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    d->n_edits = 0;
    int32_t row = 0;
    for (int32_t s = 0; s < g->n_step; s++)
        if (steps[s].want_logits)
            EXL_TRY(prepare_row(g, g->step_jobs[s], row++, g->step_jobs[s]->n_tokens + next));
    return EXL_OK;
}

exl_status exl_gen_dsample_forward(exl_generator *g) {
    exl_gen_dsample *d = &g->dsample;
    EXL_TRY(prepare_rows(g, g->steps, 0));
    int constrained = exl_gen_step_constrained(g);
    return exl_model_forward_sample(g->model, g->cache, g->steps, g->n_step, constrained ? exl_gen_fill_masks : NULL, g,
                                    g->masks, d->params, d->edits, d->n_edits, d->out);
}

/* Bans at pos and min_new's stop bans are known before the token at pos - 1 is (a rewind, which adds bans, changes
 * the tokens, and the queued step is dropped); the penalty window is not. */
int exl_gen_dsample_ahead_at(exl_generator *g, const exl_job *j) {
    const exl_sampling *sp = &j->sampling;
    if (!enabled(g) || !covers(j) || sp->mirostat || j->spec.enabled || j->constraint)
        return 0;
    return sp->repetition_penalty == 1.0f && sp->frequency_penalty == 0.0f && sp->presence_penalty == 0.0f;
}

/* Rows of a queued step sample with prepare_row's u, the job's next number, or u_next where the step before drew
 * from more than one candidate and so used the next number (exl_gen_dsample_take advances the stream then). */
exl_status exl_gen_dsample_queue(exl_generator *g, const exl_seq_step *steps, int next, int64_t *ticket) {
    exl_gen_dsample *d = &g->dsample;
    EXL_TRY(prepare_rows(g, steps, next));
    return exl_model_forward_sample_ahead(g->model, g->cache, steps, g->n_step, d->params, d->edits, d->n_edits, next,
                                          ticket);
}

exl_status exl_gen_dsample_wait(exl_generator *g, int64_t ticket, int32_t rows) {
    exl_gen_dsample *d = &g->dsample;
    EXL_TRY(exl_model_sample_wait(g->model, ticket, d->out, rows));
    for (int32_t r = 0; r < rows; r++)
        g->ahead.ids[r] = d->out[r].id;
    return EXL_OK;
}

int32_t exl_gen_dsample_take(exl_generator *g, exl_job *j, int32_t row) {
    const exl_sample_result *r = &g->dsample.out[row];
    if (r->n_kept > 1)
        exl_sampler_uniform(&j->rng); /* the op used the stream's next number */
    if (j->logprobs && r->id >= 0)
        j->lp[j->n_tokens - j->n_prompt] = r->logprob;
    return r->id;
}

void exl_gen_dsample_free(exl_generator *g) {
    exl_free(g->dsample.params);
    exl_free(g->dsample.out);
    exl_free(g->dsample.edits);
    g->dsample = (exl_gen_dsample){0};
}
