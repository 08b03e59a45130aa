/* test_generator_cache.c - the paged KV cache under the generator: a shared 1000-token
 * prefix is not recomputed, cancelling frees pages, a pool too small for all jobs still
 * completes them through preemption, jobs share pages while running, and a rewind into
 * a shared page copies it instead of writing into it. Outputs are always compared with
 * the same jobs run alone. */
#include "gen_util.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

static exl_job_params greedy_job(const int32_t *ids, int32_t n, int32_t max_new) {
    exl_job_params p = exl_job_default_params();
    p.ids = ids;
    p.n_ids = n;
    p.sampling.temperature = 0;
    p.max_new_tokens = max_new;
    p.ignore_eos = 1;
    return p;
}

static void check_same(const gu_result *a, const gu_result *b, const char *what) {
    CHECK_MSG(a->n_ids == b->n_ids && !memcmp(a->ids, b->ids, (size_t)a->n_ids * sizeof a->ids[0]),
              "%s: outputs differ (%d vs %d tokens)", what, a->n_ids, b->n_ids);
}

/* res = params run alone in a fresh generator without the prefix cache */
static void run_alone(exl_model *m, const exl_tokenizer *tok, const exl_job_params *p, gu_result *res) {
    exl_generator_params gp = exl_generator_default_params();
    gp.prefix_cache = 0;
    exl_generator *g;
    if (exl_generator_init(m, tok, &gp, &g) != EXL_OK || gu_run(g, p, 1, res) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "alone: %s", exl_last_error());
    exl_generator_free(g);
}

EXL_TEST(shared_prefix_not_recomputed) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("rand-llama", &tok);
    REQUIRE(m);
    static int32_t prompt[1010];
    gu_random_ids(7, prompt, 1010, 2048);
    exl_generator *g = gu_generator(m, tok, 16, 256, 0);
    REQUIRE(g);
    gu_result *res = calloc(4, sizeof *res);
    exl_job_params a = greedy_job(prompt, 1000, 4), b = greedy_job(prompt, 1010, 4), c = greedy_job(prompt, 1000, 4);
    exl_generator_stats s0, s1, s2;
    REQUIRE_OK(gu_run(g, &a, 1, &res[0]));
    exl_generator_stats_get(g, &s0);
    CHECK(s0.tokens_computed == 1000 + 3 && s0.prefix_hit_tokens == 0);
    CHECK(s0.pages_used == 0 && s0.pages_cached == 4);
    REQUIRE_OK(gu_run(g, &b, 1, &res[1]));
    exl_generator_stats_get(g, &s1);
    CHECK_MSG(s1.tokens_computed - s0.tokens_computed == 10 + 3, "second job computed %lld tokens",
              (long long)(s1.tokens_computed - s0.tokens_computed));
    CHECK(s1.prefix_hit_tokens - s0.prefix_hit_tokens == 1000);
    CHECK(s1.pages_shared == 3 && s1.pages_copied == 1);
    CHECK(res[1].n_cached == 1000);
    REQUIRE_OK(gu_run(g, &c, 1, &res[2])); /* the same prompt again: only its last token is fed */
    exl_generator_stats_get(g, &s2);
    CHECK(s2.tokens_computed - s1.tokens_computed == 1 + 3);
    check_same(&res[2], &res[0], "repeated prompt");
    run_alone(m, tok, &b, &res[3]);
    check_same(&res[1], &res[3], "job on a cached prefix");
    free(res);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(cancel_frees_pages) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    exl_generator *g = gu_generator(m, tok, 8, 16, 0);
    REQUIRE(g);
    static int32_t prompt[60];
    gu_random_ids(3, prompt, 60, 2048);
    exl_job_params p = greedy_job(prompt, 60, 60);
    uint64_t running, waiting;
    REQUIRE_OK(exl_generator_submit(g, &p, &running));
    const exl_gen_event *ev;
    int32_t n;
    for (int i = 0; i < 5; i++)
        REQUIRE_OK(exl_generator_step(g, &ev, &n));
    exl_generator_stats st;
    exl_generator_stats_get(g, &st);
    CHECK(st.pages_used == 4 && st.jobs_running == 1); /* 60 + 4 tokens fed */
    REQUIRE_OK(exl_generator_submit(g, &p, &waiting));
    REQUIRE_OK(exl_generator_cancel(g, running));
    REQUIRE_OK(exl_generator_cancel(g, waiting));
    REQUIRE_OK(exl_generator_step(g, &ev, &n));
    CHECK(n == 2);
    for (int32_t i = 0; i < n; i++) {
        CHECK(ev[i].finish == EXL_FINISH_CANCELLED);
        CHECK(ev[i].n_generated == (ev[i].job == running ? 5 : 0));
    }
    exl_generator_stats_get(g, &st);
    CHECK(st.pages_used == 0 && st.jobs_running == 0 && st.jobs_waiting == 0);
    CHECK(st.pages_free + st.pages_cached == 8);
    CHECK(exl_generator_pending(g) == 0);
    CHECK(exl_generator_cancel(g, running) == EXL_ERR_ARG);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* 8 jobs needing ~34 pages of 16 slots share 8 pages: preemption, with and without
 * the prefix cache to resume from. */
EXL_TEST(preemption_completes_every_job) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("rand-llama", &tok);
    REQUIRE(m);
    enum { N = 8 };
    static int32_t prompts[N][40];
    exl_job_params p[N];
    gu_result *alone = calloc(N, sizeof *alone), *tight = calloc(N, sizeof *tight);
    for (int i = 0; i < N; i++) {
        gu_random_ids(50 + i, prompts[i], 10 + 4 * i, 2048);
        p[i] = greedy_job(prompts[i], 10 + 4 * i, 30);
        p[i].priority = i % 3;
        run_alone(m, tok, &p[i], &alone[i]);
    }
    for (int cache = 0; cache < 2; cache++) {
        exl_generator_params gp = exl_generator_default_params();
        gp.n_pages = 8;
        gp.page_size = 16;
        gp.prefix_cache = cache;
        exl_generator *g;
        REQUIRE_OK(exl_generator_init(m, tok, &gp, &g));
        memset(tight, 0, N * sizeof *tight);
        REQUIRE_OK(gu_run(g, p, N, tight));
        exl_generator_stats st;
        exl_generator_stats_get(g, &st);
        CHECK_MSG(st.preemptions > 0, "no preemption with prefix cache %d", cache);
        CHECK(st.jobs_finished == N && st.pages_used == 0);
        for (int i = 0; i < N; i++) {
            CHECK(tight[i].finish == EXL_FINISH_LENGTH);
            check_same(&tight[i], &alone[i], cache ? "preempted (prefix cache)" : "preempted (recomputed)");
        }
        exl_generator_free(g);
    }
    free(alone);
    free(tight);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* Jobs with a common 300-token prefix admitted while the first runs share its pages. */
EXL_TEST(running_jobs_share_pages) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    enum { N = 4 };
    static int32_t prompts[N][320];
    exl_job_params p[N];
    gu_result *alone = calloc(N, sizeof *alone), *shared = calloc(N, sizeof *shared);
    for (int i = 0; i < N; i++) {
        gu_random_ids(9, prompts[i], 300, 2048);
        gu_random_ids(90 + i, prompts[i] + 300, 20, 2048);
        p[i] = greedy_job(prompts[i], 300 + 5 * i, 16);
        run_alone(m, tok, &p[i], &alone[i]);
    }
    exl_generator *g = gu_generator(m, tok, 32, 32, 0);
    REQUIRE(g);
    uint64_t first;
    REQUIRE_OK(exl_generator_submit(g, &p[0], &first));
    const exl_gen_event *ev;
    int32_t n;
    REQUIRE_OK(exl_generator_step(g, &ev, &n)); /* 256 tokens of its prompt */
    REQUIRE_OK(exl_generator_step(g, &ev, &n)); /* the rest and its first token */
    REQUIRE(n == 1);
    REQUIRE_OK(gu_run(g, p + 1, N - 1, shared + 1)); /* also finishes the first */
    exl_generator_stats st;
    exl_generator_stats_get(g, &st);
    CHECK(st.pages_shared >= 3 * 9);
    CHECK(exl_generator_pending(g) == 0 && first);
    for (int i = 1; i < N; i++) {
        CHECK(shared[i].n_cached >= 288);
        check_same(&shared[i], &alone[i], "job sharing pages");
    }
    exl_generator_free(g);
    free(alone);
    free(shared);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* Append events to res[0] or res[1] by job id. */
static void collect(gu_result *res, const exl_gen_event *ev, int32_t n) {
    for (int32_t e = 0; e < n; e++) {
        gu_result *x = ev[e].job == res[0].id ? &res[0] : &res[1];
        memcpy(x->ids + x->n_ids, ev[e].ids, (size_t)ev[e].n_ids * sizeof *ev[e].ids);
        x->n_ids += ev[e].n_ids;
    }
}

/* A banned string makes a job rewind into a page another job shares: the page must be
 * copied (the other job's output stays exact) and the banned job continues correctly. */
EXL_TEST(rewind_copies_shared_page) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    static const int32_t prompt[6] = {1, 80, 147, 201, 282, 57}; /* "Once upon a time" */
    gu_result *r = calloc(5, sizeof *r);
    exl_job_params p1 = greedy_job(prompt, 6, 20);
    run_alone(m, tok, &p1, &r[0]);
    REQUIRE(r[0].n_ids == 20);
    /* ban the text of generated tokens 4..7 (decoded in context) */
    int32_t all[32];
    memcpy(all, prompt, sizeof prompt);
    memcpy(all + 6, r[0].ids, 20 * sizeof *all);
    char *t4, *t8;
    REQUIRE_OK(exl_tokenizer_decode(tok, all, 6 + 4, 1, &t4));
    REQUIRE_OK(exl_tokenizer_decode(tok, all, 6 + 8, 1, &t8));
    const char *banned[1] = {t8 + strlen(t4)};
    p1.banned_strings = banned;
    p1.n_banned_strings = 1;
    exl_job_params p3 = greedy_job(all, 16, 10); /* the prompt and 10 of job 1's tokens */
    run_alone(m, tok, &p1, &r[1]);
    run_alone(m, tok, &p3, &r[2]);
    CHECK(!strstr(r[1].text, banned[0]));
    CHECK(r[1].n_ids == 20 && !memcmp(r[1].ids, r[0].ids, 4 * sizeof *r[0].ids));

    exl_generator *g = gu_generator(m, tok, 16, 4, 0);
    REQUIRE(g);
    REQUIRE_OK(exl_generator_submit(g, &p1, &r[3].id));
    const exl_gen_event *ev;
    int32_t n;
    for (int i = 0; i < 7; i++) { /* job 1 has sampled tokens 0..6: pages 0..2 are full */
        REQUIRE_OK(exl_generator_step(g, &ev, &n));
        collect(r + 3, ev, n);
    }
    exl_generator_stats s0, s1;
    exl_generator_stats_get(g, &s0);
    REQUIRE_OK(exl_generator_submit(g, &p3, &r[4].id));
    while (exl_generator_pending(g) > 0) {
        REQUIRE_OK(exl_generator_step(g, &ev, &n));
        collect(r + 3, ev, n);
    }
    exl_generator_stats_get(g, &s1);
    CHECK(s1.rewinds - s0.rewinds >= 1);
    CHECK(s1.pages_shared - s0.pages_shared == 3);
    CHECK_MSG(s1.pages_copied - s0.pages_copied >= 1, "the shared page was not copied");
    check_same(&r[3], &r[1], "banned job rewinding into a shared page");
    check_same(&r[4], &r[2], "job sharing the rewound page");
    exl_generator_free(g);
    exl_string_free(t4);
    exl_string_free(t8);
    free(r);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}
