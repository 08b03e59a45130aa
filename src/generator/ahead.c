/* ahead.c - greedy and sampled decode that keeps the device busy between steps.
 *
 * When every job of a step picks its next token as the plain argmax of its logits, the step
 * ends in the model's argmax (exl_model_forward_argmax), and before the host waits for those
 * tokens the next step is queued behind it, feeding them straight from the device. The host then
 * samples, streams and plans while the device computes. The queued step is kept only when the
 * next plan is exactly that step: the same jobs, each feeding the token it just got at the same
 * position; anything else (a job arriving, finishing, cancelled, rewound) waits for it and drops
 * it. Dropping needs no repair: the K/V it wrote is that of the argmax token at a position the
 * job had not committed, in a page the job already held, and later steps run after it.
 *
 * Steps whose jobs all sample on the device (device_sample.c) run ahead the same way, the sample op in place of the
 * argmax: the queued step feeds the tokens the op drew and draws its own with both numbers its jobs' random streams
 * may be at (the op picks by what the step before kept, on the device), so the tokens are those of steps run one by
 * one. Jobs whose next settings depend on the token being drawn (penalties) are left out. */
#include "generator/generator.h"

#include "base/error.h"

#include <stdlib.h>
#include <string.h>

int exl_gen_greedy_at(const exl_generator *g, const exl_job *j, int32_t pos) {
    if (j->spec.enabled) /* a drafting job's next step depends on the host's drafts (speculative.c) */
        return 0;
    if (j->constraint || j->logprobs || j->top_logprobs || pos - j->n_prompt < j->min_new) /* grammar: masks */
        return 0;
    for (int32_t i = 0; i < j->n_bans; i++)
        if (j->ban_pos[i] == pos)
            return 0;
    return exl_sampler_head_size(&j->sampling, g->vocab, 1) == 1;
}

static int greedy_step(const exl_generator *g) {
    int32_t rows = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        const exl_job *j = g->step_jobs[s];
        if (!g->steps[s].want_logits)
            continue;
        if (g->steps[s].want_logits != 1 || !exl_gen_greedy_at(g, j, j->n_tokens) || ++rows > EXL_ARGMAX_ROWS)
            return 0;
    }
    return rows > 0;
}

/* Whether job j's token at pos can be picked ahead in mode. */
static int ahead_at(exl_generator *g, const exl_job *j, int32_t pos, exl_gen_ahead_mode mode) {
    return mode == EXL_AHEAD_GREEDY ? exl_gen_greedy_at(g, j, pos) : exl_gen_dsample_ahead_at(g, j);
}

static int sampled_step(exl_generator *g) {
    int32_t rows = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        const exl_job *j = g->step_jobs[s];
        if (!g->steps[s].want_logits)
            continue;
        if (g->steps[s].want_logits != 1 || !exl_gen_dsample_ahead_at(g, j) || ++rows > EXL_ARGMAX_ROWS)
            return 0;
    }
    return rows > 0;
}

exl_gen_ahead_mode exl_gen_ahead_step_mode(exl_generator *g) {
    if (greedy_step(g))
        return EXL_AHEAD_GREEDY;
    return g->ahead.enabled && g->ahead.sampled_enabled && sampled_step(g) ? EXL_AHEAD_SAMPLED : EXL_AHEAD_NONE;
}

static int ahead_is_plan(exl_generator *g) {
    const exl_gen_ahead *a = &g->ahead;
    if (g->n_step != a->n)
        return 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        const exl_job *j = g->step_jobs[s];
        const exl_seq_step *st = &g->steps[s];
        int32_t p = a->pos[s];
        if (j->id != a->job[s] || st->n_new != 1 || st->n_past != p || st->want_logits != 1 ||
            j->tokens[p] != a->tok[s] || j->pages[p / g->pool.page_size] != a->page[s] ||
            !ahead_at(g, j, j->n_tokens, a->mode))
            return 0;
    }
    return 1;
}

int64_t exl_gen_ahead_take(exl_generator *g) {
    if (g->ahead.ticket < 0)
        return -1;
    if (!ahead_is_plan(g)) {
        exl_gen_ahead_drop(g);
        g->ahead.dropped++;
        return -1;
    }
    g->ahead.kept++;
    int64_t t = g->ahead.ticket;
    g->ahead.ticket = -1;
    return t;
}

/* Once the planned step is queued: queue the next one behind it when every job of this step will go on decoding
 * alone in the same mode, within the pages it holds. */
static void ahead_queue(exl_generator *g, exl_gen_ahead_mode mode) {
    exl_gen_ahead *a = &g->ahead;
    int32_t ps = g->pool.page_size;
    if (!a->enabled || g->waiting.n || g->running.n != g->n_step || g->n_step > EXL_ARGMAX_ROWS)
        return;
    for (int32_t s = 0; s < g->n_step; s++) {
        const exl_job *j = g->step_jobs[s];
        int32_t p = g->steps[s].n_past + g->steps[s].n_new; /* where the token coming back goes */
        if (g->steps[s].want_logits != 1 || p != j->n_tokens || p >= j->n_pages * ps ||
            p - j->n_prompt + 1 >= j->max_new || !ahead_at(g, j, p + 1, mode))
            return;
        a->steps[s] = (exl_seq_step){NULL, 1, p, j->pages, j->n_pages, 1};
        a->job[s] = j->id;
        a->pos[s] = p;
        a->page[s] = j->pages[p / ps];
    }
    int64_t t;
    exl_lora_step_sets(g->model, g->step_sets, g->n_step);
    exl_status st = mode == EXL_AHEAD_GREEDY ? exl_model_forward_argmax(g->model, g->cache, a->steps, g->n_step, &t)
                                             : exl_gen_dsample_queue(g, a->steps, 1, &t);
    exl_lora_step_sets(g->model, NULL, 0);
    if (st != EXL_OK)
        return; /* the step is only an early start: the planned one reports real failures */
    a->ticket = t;
    a->n = g->n_step;
    a->mode = mode;
}

exl_status exl_gen_ahead_run(exl_generator *g, int64_t ticket, exl_gen_ahead_mode mode) {
    int32_t rows = 0;
    for (int32_t s = 0; s < g->n_step; s++)
        rows += g->steps[s].want_logits != 0;
    if (ticket < 0)
        EXL_TRY(mode == EXL_AHEAD_GREEDY ? exl_model_forward_argmax(g->model, g->cache, g->steps, g->n_step, &ticket)
                                         : exl_gen_dsample_queue(g, g->steps, 0, &ticket));
    ahead_queue(g, mode);
    return mode == EXL_AHEAD_GREEDY ? exl_model_argmax_wait(g->model, ticket, g->ahead.ids, rows)
                                    : exl_gen_dsample_wait(g, ticket, rows);
}

void exl_gen_ahead_fed(exl_generator *g) {
    exl_gen_ahead *a = &g->ahead;
    if (a->ticket >= 0)
        memcpy(a->tok, a->ids, (size_t)a->n * sizeof *a->tok);
}

void exl_gen_ahead_drop(exl_generator *g) {
    exl_gen_ahead *a = &g->ahead;
    if (a->ticket < 0)
        return;
    int32_t ids[EXL_ARGMAX_ROWS];
    exl_sample_result res[EXL_ARGMAX_ROWS];
    if (a->mode == EXL_AHEAD_GREEDY) /* a failure shows again in the next step */
        exl_model_argmax_wait(g->model, a->ticket, ids, a->n);
    else
        exl_model_sample_wait(g->model, a->ticket, res, a->n);
    a->ticket = -1;
}

void exl_gen_ahead_init(exl_generator *g) {
    /* on by default where steps run asynchronously (a backend argmax op); on the CPU a queued
     * step is only computed early, and wasted when dropped: EXL_DECODE_AHEAD=1 forces it (tests) */
    const char *e = getenv("EXL_DECODE_AHEAD");
    g->ahead.enabled = e && *e ? strcmp(e, "0") != 0 : g->model->be->ops->argmax != NULL;
    /* sampled steps too, unless EXL_SAMPLED_AHEAD=0 (test_gpu's sampling group holds the CUDA path to steps that
     * wait for their tokens; CTest the generator's logic) */
    e = getenv("EXL_SAMPLED_AHEAD");
    g->ahead.sampled_enabled = !(e && *e && strcmp(e, "0") == 0);
    g->ahead.ticket = -1;
}
