/* speculative.h - speculative decoding in the generator (docs/speculative.md): a decoding job proposes tokens
 * (n-gram lookup in its own context, or a draft model), the model checks them all in the step's one forward, and
 * what it rejected is rolled back by page bookkeeping alone.
 *
 * A drafting job's decode step feeds its last token and its k drafts (want_logits 2). The drafts sit in
 * tokens[n_tokens .. n_tokens + k) during the step, past n_tokens; verification takes the model's token row by
 * row exactly as plain decoding would, stops at the first that differs from the draft, and cuts the sequence back
 * (exl_job_truncate), so the cache holds the K/V of the accepted tokens only as far as anything reads it. */
#ifndef EXL_GENERATOR_SPECULATIVE_H
#define EXL_GENERATOR_SPECULATIVE_H

#include <stdint.h>

#include "exl.h"
#include "generator/sampler.h"
#include "model/model.h"

struct exl_job;

/* A job's drafting state. */
typedef struct exl_spec_job {
    int enabled;                /* the job drafts (see exl_spec_job_init) */
    int32_t k;                  /* tokens to propose in its next decode step (adaptive) */
    int32_t n_draft;            /* this step's drafts */
    int from_model;             /* this step's drafts came from the draft model */
    int32_t q_row;              /* sampled drafts: the first of their rows in exl_spec.q, else -1 */
    exl_sampler_state rng;      /* the draft model's draws (sampled jobs) */
    int32_t proposed, accepted; /* totals, reported in events */
} exl_spec_job;

/* The generator's drafting state. */
typedef struct exl_spec {
    int32_t max_k, ngram, fixed;
    /* the draft model: its KV cache has the target's page geometry and is indexed by the same page ids, so the
     * jobs' page tables serve both; per page, the draft's own record of what its slots hold (a page's draft K/V
     * is valid for a job whose chain hash before the page is d_parent and whose tokens match d_tokens) */
    exl_model *draft;
    exl_kv_cache *cache;
    int32_t draft_vocab;
    uint64_t *d_parent;
    int32_t *d_valid, *d_tokens;
    float *d_logits; /* [cap_d_rows, draft_vocab] */
    int32_t cap_d_rows;
    float *row; /* [vocab]: one draft row in the target's vocabulary */
    /* sampled drafts' distributions, [cap_q_rows, vocab] */
    float *q;
    int32_t n_q_rows, cap_q_rows;
    /* the step's drafting jobs and the draft model's steps over them */
    struct exl_job **jobs;
    exl_seq_step *d_steps;
    int32_t *d_pos, *d_rows, *d_idx;
    int32_t *d_head_ids; /* a draft step's argmaxes (its top-1) */
    float *d_head_vals;
    int32_t cap_jobs;
    /* test-only (draft_oracle.c): proposals replaced to agree with a known output at a set rate */
    double oracle_alpha;
    int32_t *oracle, n_oracle;
    exl_sampler_state oracle_rng;
} exl_spec;

/* ---- speculative.c */
/* With params.draft_tokens > 0: the drafting state (the draft model's cache included). */
exl_status exl_spec_init(exl_generator *g);
void exl_spec_free(exl_generator *g);
/* A new job: whether it drafts (the generator drafts, it did not opt out, nothing it asks for needs plain steps). */
void exl_spec_job_init(const exl_generator *g, struct exl_job *j, const exl_job_params *p);
/* After planning: each drafting job that decodes proposes up to its k tokens within the step's token budget and
 * the pages free now; its step then feeds them too, with logits for every row. */
exl_status exl_spec_plan(exl_generator *g);
/* After the forward: take the job's tokens from its step's rows of logits (logits [1 + drafts, vocab], modified), or
 * when logits is NULL from the head of each row (ids, vals [1 + drafts, head]), accepting drafts while the model
 * agrees; then roll back the rest and adapt k. */
exl_status exl_spec_verify(exl_generator *g, struct exl_job *j, const exl_seq_step *st, float *logits, int32_t head,
                           const int32_t *ids, const float *vals);

/* ---- draft_ngram.c */
/* The k tokens that followed the latest earlier occurrence of the last n (ngram down to 1) of tokens[0..n_tokens)
 * into out, read on into the drafts themselves where the sequence ends first (a repeating pattern); returns k, or
 * 0 when nothing matches. */
int32_t exl_draft_ngram(const int32_t *tokens, int32_t n_tokens, int32_t ngram, int32_t k, int32_t *out);

/* ---- draft_model.c */
exl_status exl_draft_model_init(exl_generator *g);
void exl_draft_model_free(exl_spec *sp);
/* Draft jobs[0..n) with the draft model: each j->spec.n_draft tokens after its sequence into tokens[n_tokens..),
 * first bringing the draft's cache up to the sequence; sampled jobs' distributions into their q rows. */
exl_status exl_draft_model_propose(exl_generator *g, struct exl_job **jobs, int32_t n);

/* ---- draft_oracle.c (test-only, EXL_SPEC_TEST_ORACLE / EXL_SPEC_TEST_ALPHA, see there) */
exl_status exl_draft_oracle_init(exl_spec *sp);
/* Replace each of the job's greedy drafts, with probability alpha by the known output's token at its position,
 * else by another token. */
void exl_draft_oracle_apply(exl_spec *sp, struct exl_job *j, int32_t vocab);

#endif
