/* test_generator_admit.c - jobs that arrive together start together: every job submitted before a step (or while
 * the one before ran) is in that step and has its first token after it, also when they share a short cached prefix
 * that is recomputed rather than copied (EXL_PREFIX_COPY_MIN); outputs equal the same jobs run alone. */
#include "gen_util.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

enum { N_JOBS = 8, PROMPT = 12, NEW = 6 };

static exl_job_params sampled_job(const int32_t *ids, int32_t n, uint64_t seed) {
    exl_job_params p = exl_job_default_params();
    p.ids = ids;
    p.n_ids = n;
    p.sampling.temperature = 0.8f;
    p.sampling.top_p = 0.95f;
    p.sampling.seed = seed;
    p.max_new_tokens = NEW;
    p.ignore_eos = 1;
    return p;
}

/* One step; got[i] += the tokens job ids[i] received in it. */
static exl_status step_count(exl_generator *g, const uint64_t *ids, int32_t n, int32_t *got) {
    const exl_gen_event *ev;
    int32_t n_ev;
    exl_status st = exl_generator_step(g, &ev, &n_ev);
    for (int32_t e = 0; e < n_ev; e++)
        for (int32_t i = 0; i < n; i++)
            if (ev[e].job == ids[i])
                got[i] += ev[e].n_ids;
    return st;
}

/* The first job alone in a step, then the other seven submitted (as if while it ran): all seven have their first
 * token after the next step; then each job's tokens equal those of the job run alone. */
static void run_arrivals(exl_model *m, const exl_tokenizer *tok, int32_t page_size) {
    static int32_t prompts[N_JOBS][PROMPT];
    for (int32_t i = 0; i < N_JOBS; i++) /* two prompts: later jobs find the first jobs' pages cached */
        gu_random_ids(5 + (uint64_t)(i % 2), prompts[i], PROMPT, 2048);
    exl_generator *g = gu_generator(m, tok, 64, page_size, 0);
    REQUIRE(g);
    exl_job_params p[N_JOBS];
    uint64_t ids[N_JOBS];
    int32_t got[N_JOBS] = {0};
    for (int32_t i = 0; i < N_JOBS; i++)
        p[i] = sampled_job(prompts[i], PROMPT, 100 + (uint64_t)i);
    REQUIRE_OK(exl_generator_submit(g, &p[0], &ids[0]));
    REQUIRE_OK(exl_generator_submit(g, &p[1], &ids[1]));
    REQUIRE_OK(step_count(g, ids, 2, got));
    CHECK_MSG(got[0] == 1 && got[1] == 1, "the first two jobs' first step gave %d and %d tokens", got[0], got[1]);
    for (int32_t i = 2; i < N_JOBS; i++)
        REQUIRE_OK(exl_generator_submit(g, &p[i], &ids[i]));
    REQUIRE_OK(step_count(g, ids, N_JOBS, got));
    for (int32_t i = 2; i < N_JOBS; i++)
        CHECK_MSG(got[i] == 1,
                  "page size %d: job %d, submitted while the step before ran, has %d tokens after the next", page_size,
                  i, got[i]);
    CHECK(got[0] == 2 && got[1] == 2);
    while (exl_generator_pending(g) > 0)
        REQUIRE_OK(step_count(g, ids, N_JOBS, got));
    exl_generator_free(g);

    /* the same jobs again, the seven late ones together: each alone for its tokens */
    gu_result *together = calloc(N_JOBS, sizeof *together), *alone = calloc(1, sizeof *alone);
    REQUIRE(together && alone);
    g = gu_generator(m, tok, 64, page_size, 0);
    REQUIRE(g);
    REQUIRE_OK(gu_run(g, p, 2, together));
    REQUIRE_OK(gu_run(g, p + 2, N_JOBS - 2, together + 2));
    exl_generator_stats st;
    exl_generator_stats_get(g, &st);
    CHECK_MSG(st.prefix_hit_tokens > 0, "page size %d: no prefix was reused", page_size);
    exl_generator_free(g);
    for (int32_t i = 0; i < N_JOBS; i++) {
        exl_generator_params gp = exl_generator_default_params();
        gp.prefix_cache = 0;
        REQUIRE_OK(exl_generator_init(m, tok, &gp, &g));
        memset(alone, 0, sizeof *alone);
        REQUIRE_OK(gu_run(g, &p[i], 1, alone));
        exl_generator_free(g);
        CHECK_MSG(together[i].n_ids == NEW && alone->n_ids == NEW &&
                      !memcmp(together[i].ids, alone->ids, NEW * sizeof alone->ids[0]),
                  "page size %d: job %d's tokens differ from the job run alone", page_size, i);
    }
    free(together);
    free(alone);
}

EXL_TEST(arrivals_start_together) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    run_arrivals(m, tok, 8);  /* of 11 tokens to find: a whole page shared, 3 copied */
    run_arrivals(m, tok, 64); /* 11 copied */
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* A cached partial page shorter than EXL_PREFIX_COPY_MIN is recomputed: nothing is copied, the whole pages are still
 * shared, and the tokens are those of the job run alone. */
EXL_TEST(short_partial_prefix_recomputed) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    static int32_t prompt[80];
    gu_random_ids(9, prompt, 80, 2048);
    const char *old = getenv("EXL_PREFIX_COPY_MIN");
    char *saved = old ? strdup(old) : NULL;
    for (int pass = 0; pass < 2; pass++) {
        setenv("EXL_PREFIX_COPY_MIN", pass ? "1" : "16", 1);
        exl_generator *g = gu_generator(m, tok, 16, 32, 0);
        REQUIRE(g);
        gu_result *res = calloc(3, sizeof *res);
        REQUIRE(res);
        exl_job_params a = sampled_job(prompt, 72, 7), b = sampled_job(prompt, 80, 8);
        REQUIRE_OK(gu_run(g, &a, 1, &res[0]));
        REQUIRE_OK(gu_run(g, &b, 1, &res[1])); /* 64 tokens in 2 whole pages, 8 in a partial one */
        exl_generator_stats st;
        exl_generator_stats_get(g, &st);
        exl_generator_free(g);
        CHECK_MSG(st.pages_shared == 2 && st.pages_copied == (pass ? 1 : 0) && res[1].n_cached == (pass ? 72 : 64),
                  "EXL_PREFIX_COPY_MIN=%s: %lld pages shared, %lld copied, %d prompt tokens cached", pass ? "1" : "16",
                  (long long)st.pages_shared, (long long)st.pages_copied, res[1].n_cached);
        exl_generator_params gp = exl_generator_default_params();
        gp.prefix_cache = 0;
        REQUIRE_OK(exl_generator_init(m, tok, &gp, &g));
        REQUIRE_OK(gu_run(g, &b, 1, &res[2]));
        exl_generator_free(g);
        CHECK_MSG(res[1].n_ids == NEW && !memcmp(res[1].ids, res[2].ids, NEW * sizeof res[1].ids[0]),
                  "pass %d: the job on the cached prefix differs from the job run alone", pass);
        free(res);
    }
    if (saved)
        setenv("EXL_PREFIX_COPY_MIN", saved, 1);
    else
        unsetenv("EXL_PREFIX_COPY_MIN");
    free(saved);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}
