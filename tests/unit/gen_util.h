/* gen_util.h - helpers for the generator tests: load a model with its tokenizer, run a
 * set of jobs to completion and collect what their events reported. */
#ifndef EXL_TEST_GEN_UTIL_H
#define EXL_TEST_GEN_UTIL_H

#include "exl.h"

#define GU_MAX_IDS 1024

typedef struct gu_result {
    uint64_t id;
    int32_t ids[GU_MAX_IDS];
    int32_t n_ids;
    char text[16384];
    size_t text_len;
    float lp[GU_MAX_IDS];
    exl_token_logprob top[GU_MAX_IDS * 4];
    exl_finish_reason finish;
    int32_t stop_token;
    char stop_string[64];
    int32_t n_cached, n_events, n_generated;
    int split_char; /* an event's text ended inside a UTF-8 character */
} gu_result;

/* Load models/<name> from the shared directory on the CPU, with its tokenizer. */
exl_model *gu_load(const char *name, exl_tokenizer **tok);
/* Submit params[0..n), step until no job is pending, fill res[0..n) (calloc'd by the
 * caller); events of other jobs are skipped. */
exl_status gu_run(exl_generator *g, const exl_job_params *params, int n, gu_result *res);
/* Deterministic pseudo-random token ids in [3, vocab), with BOS (1) first. */
void gu_random_ids(uint64_t seed, int32_t *ids, int32_t n, int32_t vocab);
/* A generator over model/tok with the given cache shape (0 = default). */
exl_generator *gu_generator(exl_model *m, const exl_tokenizer *tok, int32_t n_pages, int32_t page_size,
                            int32_t max_batch_tokens);

#endif
