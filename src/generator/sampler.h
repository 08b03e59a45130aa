/* sampler.h - drawing the next token of one job from its fp32 logits, on the CPU.
 *
 * Three stages; where the settings need only the head of the distribution (greedy, top-k
 * and what follows it), a backend selects the head on the device and exl_sampler_sample_head
 * finishes with the same result as on the full logits:
 *   exl_sampler_process  logit bias and penalties, in place on the logits;
 *   exl_sampler_filter   temperature, softmax and the filters -> weighted candidates;
 *   exl_sampler_draw     one draw from the job's own random stream (xoshiro256**),
 *                        plus the Mirostat update.
 * Nothing here depends on other jobs, which is what makes results batch-invariant. */
#ifndef EXL_GENERATOR_SAMPLER_H
#define EXL_GENERATOR_SAMPLER_H

#include <stdint.h>

#include "exl.h"

typedef struct exl_sampler_state {
    uint64_t rng[4];
    float mu; /* Mirostat's running surprise bound */
} exl_sampler_state;

typedef struct exl_candidate {
    int32_t id;
    float p; /* unnormalized weight after the filters */
} exl_candidate;

/* Per-thread work space for a vocabulary (reused by every job). */
typedef struct exl_sampler_scratch {
    int32_t vocab;
    exl_candidate *cand;  /* [vocab] */
    exl_candidate *order; /* [vocab] */
    int32_t *counts;      /* [vocab], zero between calls */
} exl_sampler_scratch;

exl_status exl_sampler_scratch_init(exl_sampler_scratch *s, int32_t vocab);
void exl_sampler_scratch_free(exl_sampler_scratch *s);

/* Seed the random stream from p->seed and reset Mirostat. */
void exl_sampler_init(exl_sampler_state *st, const exl_sampling *p);
/* A uniform double in [0, 1). */
double exl_sampler_uniform(exl_sampler_state *st);

/* Logit bias, then repetition / frequency / presence penalties over the last
 * penalty_range tokens of history (all of it when 0). */
void exl_sampler_process(const exl_sampling *p, float *logits, int32_t vocab, const int32_t *history, int32_t n_history,
                         exl_sampler_scratch *s);
/* Temperature, softmax and the filters; the survivors are s->cand[0..n) with weights
 * (not normalized). Greedy (temperature 0) leaves the argmax alone. Returns n, 0 when
 * every token is banned (-inf). */
int32_t exl_sampler_filter(const exl_sampling *p, const exl_sampler_state *st, const float *logits, int32_t vocab,
                           exl_sampler_scratch *s);
/* Draw one of s->cand[0..n) in proportion to its weight and update Mirostat's mu. */
int32_t exl_sampler_draw(const exl_sampling *p, exl_sampler_state *st, const exl_sampler_scratch *s, int32_t n);
/* All three stages on logits (modified); -1 when every token is banned. */
int32_t exl_sampler_sample(const exl_sampling *p, exl_sampler_state *st, float *logits, int32_t vocab,
                           const int32_t *history, int32_t n_history, exl_sampler_scratch *s);
/* How many of the largest logits these settings look at, when that is all they need: 1 for
 * greedy, top_k for top-k (up to max_k, below vocab) and the filters after it, with no logit
 * bias, penalties or Mirostat; 0 when they need the full logits. */
int32_t exl_sampler_head_size(const exl_sampling *p, int32_t vocab, int32_t max_k);
/* exl_sampler_sample from the head alone: ids and vals, the k >= exl_sampler_head_size
 * largest logits sorted larger first, lower id first among equals. Same token, same
 * random-stream use as exl_sampler_sample on the full logits. */
int32_t exl_sampler_sample_head(const exl_sampling *p, exl_sampler_state *st, const int32_t *ids, const float *vals,
                                exl_sampler_scratch *s);

#endif
