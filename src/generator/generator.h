/* generator.h - internals of the generator shared by its files: jobs, the generator,
 * and the functions that pass them between scheduling, stepping and text handling.
 *
 * A job's sequence is tokens[0..n_tokens): the prompt followed by what was sampled.
 * The first n_cached of them have K/V in the job's pages; every step feeds some of
 * the rest, and when a step feeds the last token its logits yield the next token.
 * Prefill, decode and the recompute after a preemption are the same thing. */
#ifndef EXL_GENERATOR_GENERATOR_H
#define EXL_GENERATOR_GENERATOR_H

#include <pthread.h>
#include <stdio.h>

#include "base/str.h"
#include "constrain/constraint.h"
#include "constrain/token_trie.h"
#include "exl.h"
#include "generator/page_pool.h"
#include "generator/sampler.h"
#include "generator/speculative.h"
#include "generator/stop_strings.h"
#include "model/lora.h"
#include "model/model.h"

typedef enum exl_job_state { EXL_JOB_WAITING, EXL_JOB_RUNNING, EXL_JOB_DONE } exl_job_state;

typedef struct exl_job {
    uint64_t id, order; /* order: submission sequence, breaks priority ties */
    void *user;
    int32_t priority;
    exl_job_state state;
    int cancel;      /* set by exl_generator_cancel (under the generator's mutex) */
    int cancel_seen; /* the step's copy of it */

    /* settings (copied from exl_job_params) */
    exl_sampling sampling;
    exl_logit_bias *logit_bias; /* the job's own copy, which sampling.logit_bias points to */
    int32_t max_new, min_new;
    int32_t *stop_ids, n_stop_ids;
    int ignore_eos;
    exl_string_set stop, banned;
    int logprobs;
    int32_t top_logprobs;

    /* the sequence and its cache pages */
    int32_t *tokens, n_tokens, n_prompt, cap_tokens;
    int32_t n_cached, n_cached_prompt;
    int32_t *pages, n_pages, cap_pages;
    exl_lora_set lora; /* the adapters it runs with (the model's set at submission when it names none) */
    uint64_t root;     /* the parent hash of its first page: EXL_HASH_ROOT, mixed with the adapters' hash */
    uint64_t *chain;   /* chain hash through page i, known for i < n_chain */
    int32_t n_chain;
    int32_t step_tokens; /* tokens fed in the current step */

    /* sampling state; per generated token: Mirostat's mu before it, log-probabilities */
    exl_sampler_state rng;
    float *mu_hist, *lp;
    exl_token_logprob *top;
    int32_t *ban_pos, *ban_id, n_bans, cap_bans; /* tokens banned at a position (rewinds) */

    /* constrained output (constrained.c): the matcher state after the tokens so far */
    exl_constraint *constraint; /* a reference, or NULL */
    int32_t cstate;
    int cstarted; /* text the grammar forces before any token was written */

    /* text */
    exl_detokenizer *detok;
    int detok_ready;    /* primed; 0 after a failed restart */
    exl_str held;       /* decoded text not emitted yet */
    int64_t emitted;    /* bytes of completion text emitted */
    int64_t *text_end;  /* per generated token: bytes of text decoded through it */
    int32_t n_reported; /* generated tokens handed out in events */

    /* how it ended */
    exl_finish_reason finish;
    int32_t stop_token;
    const char *stop_string;
    char *error;

    exl_str ev_text; /* this step's event text */

    exl_spec_job spec; /* speculative decoding (speculative.c) */
    /* when it was submitted, admitted, had its first token (exl_gen_now; 0: not yet), at which steps (trace.c) */
    double t_submit, t_admit, t_first;
    int64_t step_admit, step_first;
    int traced; /* its trace line is written */
} exl_job;

/* A growable list of job pointers. */
typedef struct exl_job_list {
    exl_job **v;
    int32_t n, cap;
} exl_job_list;

/* Greedy decode ahead of the host (ahead.c): the next step queued on the device, feeding the
 * tokens its argmax picks, before the host has seen them. */
typedef enum exl_gen_ahead_mode {
    EXL_AHEAD_NONE,
    EXL_AHEAD_GREEDY,  /* the step's tokens are its argmax */
    EXL_AHEAD_SAMPLED, /* sampled by the backend's sample op (device_sample.c) */
} exl_gen_ahead_mode;

typedef struct exl_gen_ahead {
    int enabled;             /* EXL_DECODE_AHEAD: 0 off, 1 on; default on where the backend has an argmax op */
    int sampled_enabled;     /* EXL_SAMPLED_AHEAD: sampled steps too (default on; 0 off) */
    exl_gen_ahead_mode mode; /* of the queued step */
    int64_t ticket;          /* of the queued step's argmax; -1: none queued */
    int32_t n;               /* its sequences, one per row of the step before, in order */
    uint64_t job[EXL_ARGMAX_ROWS];
    int32_t pos[EXL_ARGMAX_ROWS], page[EXL_ARGMAX_ROWS];
    int32_t tok[EXL_ARGMAX_ROWS]; /* the token each feeds, once the step before's are back */
    exl_seq_step steps[EXL_ARGMAX_ROWS];
    int32_t ids[EXL_ARGMAX_ROWS]; /* the current step's tokens (greedy or sampled ahead) */
    int64_t kept, dropped;        /* queued steps that were the next plan, and that were not */
} exl_gen_ahead;

/* The step trace (trace.c), on when EXL_STEP_TRACE names a file. */
typedef struct exl_gen_trace {
    FILE *f;                 /* NULL: off */
    int64_t step;            /* steps begun */
    double begin, planned;   /* the current step's times */
    int32_t inbox, admitted; /* jobs it took in, and admitted */
    int64_t copied0;         /* stats.pages_copied when it began */
    int64_t dropped0;        /* ahead.dropped after the last plan */
    char ahead;              /* its queued-ahead step: 'k' kept, 'd' dropped, 'n' none */
} exl_gen_trace;

/* Sampling on the backend (device_sample.c): the step's rows' settings, edits and results. */
typedef struct exl_gen_dsample {
    int checked, enabled;      /* EXL_DEVICE_SAMPLING: 0 off; default on where the backend has a sample op */
    exl_sample_params *params; /* [max_jobs] */
    exl_sample_result *out;    /* [max_jobs] */
    exl_logit_edit *edits;
    int32_t n_edits, cap_edits;
} exl_gen_dsample;

struct exl_generator {
    exl_model *model;
    const exl_tokenizer *tok;
    exl_generator_params params;
    int32_t vocab;
    int32_t eos[24], n_eos; /* model config and tokenizer eos ids */
    exl_kv_cache *cache;
    exl_page_pool pool;

    /* shared with submitting threads, under mu */
    pthread_mutex_t mu;
    exl_job_list inbox; /* submitted, not yet seen by a step */
    exl_job_list alive; /* every job not finished */
    uint64_t next_id;
    exl_generator_stats published;

    /* the stepping thread's own */
    exl_job_list waiting; /* by priority, then submission order */
    exl_job_list running; /* same order: the last one is preempted first */
    exl_job_list done;    /* finished in the last step, freed in the next */
    exl_generator_stats stats;
    exl_seq_step *steps;
    exl_job **step_jobs;
    const exl_lora_set **step_sets; /* the step's jobs' adapters */
    int32_t n_step;
    float *logits;     /* [max_jobs, vocab] */
    int32_t head_max;  /* largest head the model selects on its device (0: none) */
    int32_t *head_ids; /* [max_jobs, head_max]: the largest logits, when a step needs no more */
    float *head_vals;
    float *raw;            /* [vocab]: a job's logits before processing (log-probabilities) */
    exl_gen_event *events; /* at most one per job alive */
    exl_job **event_jobs;  /* the job of each event */
    int32_t n_events, cap_events;
    exl_sampler_scratch scratch;
    exl_gen_ahead ahead;
    exl_gen_dsample dsample;
    /* constrained decoding (constrained.c), set up when a constrained job first comes */
    exl_token_trie *trie; /* the vocabulary's byte strings */
    uint32_t *masks;      /* [max_jobs, exl_mask_words(vocab)]: the step's logit masks */

    int32_t cap_logit_rows; /* rows of logits (speculative steps may need more than max_jobs) */
    exl_spec *spec;         /* speculative decoding (speculative.c); NULL when off */
    /* a partly matching prefix page shorter than this is recomputed, not copied (EXL_PREFIX_COPY_MIN; default 1
     * where the cache is host memory, PREFIX_COPY_MIN_DEVICE tokens elsewhere: scheduler.c) */
    int32_t prefix_copy_min;
    exl_gen_trace trace;
};

/* ---- job lists (job.c) */
/* Make room for n jobs in all (-1 on allocation failure); then inserts cannot fail. */
int exl_job_list_reserve(exl_job_list *l, int32_t n);
/* Insert in order: priority descending, then submission order (room must be reserved). */
void exl_job_list_insert(exl_job_list *l, exl_job *j);
void exl_job_list_remove(exl_job_list *l, exl_job *j);
void exl_job_list_free(exl_job_list *l);

/* ---- jobs (job.c) */
exl_status exl_job_create(exl_generator *g, const exl_job_params *p, exl_job **out);
void exl_job_free(exl_job *j);
/* The chain hash of the tokens before page i (EXL_HASH_ROOT for i == 0). */
uint64_t exl_job_parent_hash(exl_job *j, int32_t page_size, int32_t i);
/* Drop the job's pages, last first (they stay cached for later prefix hits). */
void exl_job_release_pages(exl_generator *g, exl_job *j);
/* Cut the sequence back to n tokens (n >= n_prompt), copying a shared page it would
 * write into. */
exl_status exl_job_truncate(exl_generator *g, exl_job *j, int32_t n);

/* ---- greedy and sampled decode ahead of the host (ahead.c) */
void exl_gen_ahead_init(exl_generator *g);
/* Whether job j's token at position pos is the plain argmax of its logits. */
int exl_gen_greedy_at(const exl_generator *g, const exl_job *j, int32_t pos);
/* After planning: the ticket of the queued step when it is exactly the planned one, else -1
 * (a queued step that is not is waited for and dropped: its cache writes are harmless). */
int64_t exl_gen_ahead_take(exl_generator *g);
/* How the planned step can run ahead: greedy, sampled or not at all. */
exl_gen_ahead_mode exl_gen_ahead_step_mode(exl_generator *g);
/* The planned step in that mode (ticket >= 0: already queued), the next one queued behind it, its tokens back in
 * ahead.ids (and, sampled, its results in dsample.out). */
exl_status exl_gen_ahead_run(exl_generator *g, int64_t ticket, exl_gen_ahead_mode mode);
/* The current step's tokens are back in ahead.ids: they are what the queued step feeds. */
void exl_gen_ahead_fed(exl_generator *g);
/* Wait for a queued step and forget it (before the cache or its pages go). */
void exl_gen_ahead_drop(exl_generator *g);

/* ---- sampling on the backend (device_sample.c) */
/* Whether the backend's sample op takes every row of the planned step (one row per job, settings it covers). */
int exl_gen_dsample_step(exl_generator *g);
/* Run the planned step, its rows sampled on the backend (masked first where a job is constrained). */
exl_status exl_gen_dsample_forward(exl_generator *g);
/* Whether job j's tokens can be sampled ahead: covered, and nothing of the host's that the token before changes
 * (penalties, masks, Mirostat's state, drafts). */
int exl_gen_dsample_ahead_at(exl_generator *g, const exl_job *j);
/* The steps (one per g->step_jobs[s]) queued with exl_model_forward_sample_ahead; next: each samples the token after
 * the one the queued step before it is drawing (chained on that step). */
exl_status exl_gen_dsample_queue(exl_generator *g, const exl_seq_step *steps, int next, int64_t *ticket);
/* The results of ticket's rows into dsample.out, their tokens into ahead.ids. */
exl_status exl_gen_dsample_wait(exl_generator *g, int64_t ticket, int32_t rows);
/* Job j's token from row `row` of the step just run (-1: every token banned); its random stream and
 * log-probability brought up to date. */
int32_t exl_gen_dsample_take(exl_generator *g, exl_job *j, int32_t row);
void exl_gen_dsample_free(exl_generator *g);

/* ---- text (job_text.c) */
/* Prime the job's detokenizer with the end of its prompt (for spacing). */
exl_status exl_job_text_init(exl_generator *g, exl_job *j);
/* After a token was appended: decode it, look for stop and banned strings, move the
 * text that is final into ev_text. *banned_at receives the generated-token index to
 * rewind to when a banned string appeared (else -1). */
exl_status exl_job_text_update(exl_generator *g, exl_job *j, int32_t *banned_at);
/* Rewind to generated token k (banned string): rebuild the detokenizer and held text. */
exl_status exl_job_text_rewind(exl_generator *g, exl_job *j, int32_t k);
/* Text the grammar forced in: the last n_ids tokens (just appended) stand for bytes[0..n). */
exl_status exl_job_text_force(exl_generator *g, exl_job *j, const char *bytes, size_t n, int32_t n_ids);
/* The job ends: emit what is held (up to a stop string if one matched). */
exl_status exl_job_text_finish(exl_generator *g, exl_job *j);

/* ---- scheduling (scheduler.c) */
/* The scheduler's settings from the environment (EXL_PREFIX_COPY_MIN). */
void exl_sched_init(exl_generator *g);
/* Admit waiting jobs, split the token budget, take pages (preempting as needed);
 * fills g->steps / g->step_jobs / g->n_step. */
exl_status exl_sched_plan(exl_generator *g);
/* After a successful forward: record the fed tokens in their pages. */
void exl_sched_commit(exl_generator *g);

/* ---- the generator (generator.c) */
/* Room for n events (-1 on allocation failure). */
int exl_gen_reserve_events(exl_generator *g, int32_t n);

/* ---- constrained output (constrained.c) */
/* Whether a row of this step samples for a constrained job. */
int exl_gen_step_constrained(const exl_generator *g);
/* Before a constrained job's first step: the trie and masks (built once), then the text the grammar
 * forces before the model can write anything. The job may end (complete, or failed). */
exl_status exl_gen_constraint_start(exl_generator *g, exl_job *j);
/* exl_logit_mask_fn over the step's rows (user: the generator). */
exl_status exl_gen_fill_masks(void *user, uint32_t *masks, int32_t rows);
/* Whether the step's mask of logit row `row` (a constrained job's) allows token id. */
int exl_gen_constraint_allows(const exl_generator *g, int32_t row, int32_t id);
/* After token id (not an end token) was appended and its text taken in: advance the grammar, end
 * the job where the output is complete and nothing may follow, write the text it forces where no
 * token can go on. */
exl_status exl_gen_constraint_advance(exl_generator *g, exl_job *j, int32_t id);

/* ---- warmup (warmup.c) */
/* On a GPU, one throwaway prompt step before the first job (the backend's one-time setup of many-row steps). */
exl_status exl_gen_warmup(exl_generator *g);

/* ---- the step trace (trace.c) */
/* CLOCK_MONOTONIC seconds. */
double exl_gen_now(void);
/* Open the trace file EXL_STEP_TRACE names, if any (a failure is reported on stderr, the trace stays off). */
void exl_gen_trace_open(exl_generator *g);
void exl_gen_trace_close(exl_generator *g);
/* The step begins, having taken in `inbox` submitted jobs. */
void exl_gen_trace_begin(exl_generator *g, int32_t inbox);
/* The step is planned (ticket: exl_gen_ahead_take's). */
void exl_gen_trace_planned(exl_generator *g, int64_t ticket);
/* The step ended: its line, and those of jobs that had their first token or ended. */
void exl_gen_trace_end(exl_generator *g);
/* ---- stepping (step.c) */
/* Whether id ends job j: its stop ids, and the eos ids unless it ignores them. */
int exl_gen_is_stop(const exl_generator *g, const exl_job *j, int32_t id);
/* Before sampling job j's next token from its full logits: the tokens banned at that position and, before
 * min_new_tokens, the stop tokens set to -inf. */
void exl_gen_prepare_logits(const exl_generator *g, const exl_job *j, float *logits);
/* Append the job's chosen next token id and apply what follows from it: a stop token, stop or banned strings
 * (a rewind), the grammar, the length limit; the job may end. */
exl_status exl_gen_take_token(exl_generator *g, exl_job *j, int32_t id);
/* End a job: text flushed, pages released, final event queued, moved to g->done. */
exl_status exl_gen_finish(exl_generator *g, exl_job *j, exl_finish_reason why, const char *error);

#endif
