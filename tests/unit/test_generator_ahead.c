/* test_generator_ahead.c - greedy decode queued ahead of the host (generator/ahead.c,
 * model/forward_ahead.c): the same tokens with it on and off while jobs join, stop, are
 * cancelled, sample, want log-probabilities and cross pages; the model's fed chain against
 * plain forwards; misuse refused with a message. */
#include "gen_util.h"
#include "generator/generator.h"
#include "model/model.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

typedef struct sched_job {
    int submit_at, cancel_at; /* generator steps; cancel_at -1: never */
    exl_job_params p;
} sched_job;

static void take_event(const exl_gen_event *ev, gu_result *res, int n) {
    gu_result *r = res;
    while (r < res + n && r->id != ev->job)
        r++;
    if (r == res + n)
        return;
    for (int32_t k = 0; k < ev->n_ids && r->n_ids < GU_MAX_IDS; k++)
        r->ids[r->n_ids++] = ev->ids[k];
    if (ev->finish) {
        r->finish = ev->finish;
        r->stop_token = ev->stop_token;
    }
}

/* Run the jobs, each submitted (and maybe cancelled) at its step, with decode ahead on or off. */
static void run_schedule(int ahead, exl_model *m, exl_tokenizer *tok, const sched_job *jobs, int n, gu_result *res,
                         exl_gen_ahead *stats) {
    setenv("EXL_DECODE_AHEAD", ahead ? "1" : "0", 1);
    exl_generator *g = gu_generator(m, tok, 64, 16, 0); /* pages of 16: many page crossings */
    unsetenv("EXL_DECODE_AHEAD");
    unsetenv("EXL_SAMPLED_AHEAD");
    if (!g)
        return;
    for (int step = 0;; step++) {
        int later = 0;
        for (int i = 0; i < n; i++) {
            if (jobs[i].submit_at == step && exl_generator_submit(g, &jobs[i].p, &res[i].id) != EXL_OK)
                exl_test_failed(__FILE__, __LINE__, "submit: %s", exl_last_error());
            if (jobs[i].cancel_at == step)
                exl_generator_cancel(g, res[i].id);
            later |= jobs[i].submit_at > step;
        }
        if (!later && exl_generator_pending(g) == 0)
            break;
        const exl_gen_event *ev;
        int32_t n_ev;
        if (exl_generator_step(g, &ev, &n_ev) != EXL_OK) {
            exl_test_failed(__FILE__, __LINE__, "step %d: %s", step, exl_last_error());
            break;
        }
        for (int32_t e = 0; e < n_ev; e++)
            take_event(&ev[e], res, n);
    }
    *stats = g->ahead;
    exl_generator_free(g);
}

static exl_job_params greedy(const char *text, int32_t max_new) {
    exl_job_params p = exl_job_default_params();
    p.text = text;
    p.sampling.temperature = 0;
    p.max_new_tokens = max_new;
    return p;
}

EXL_TEST(same_tokens_with_and_without_decode_ahead) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    static const char *const stops[] = {" the"};
    enum { N = 8 };
    sched_job jobs[N] = {
        {0, -1, greedy("Once upon a time", 120)},      /* alone at first, then with others */
        {0, -1, greedy("Tom had a red ball", 25)},     /* ends on its length */
        {5, -1, greedy("The sun", 60)},                /* joins while the others decode */
        {12, -1, greedy("A cat and a dog", 20)},       /* sampled, below */
        {3, 20, greedy("She was happy because", 100)}, /* cancelled */
        {30, -1, greedy("Lily", 40)},                  /* min_new: not argmax alone at first */
        {40, -1, greedy("Ben and Mia", 12)},           /* log-probabilities: never argmax alone */
        {45, -1, greedy("One day", 70)},               /* a stop string */
    };
    jobs[3].p.sampling.temperature = 0.8f;
    jobs[3].p.sampling.top_k = 40;
    jobs[3].p.sampling.seed = 11;
    jobs[5].p.min_new_tokens = 10;
    jobs[6].p.logprobs = 1;
    jobs[7].p.stop_strings = stops;
    jobs[7].p.n_stop_strings = 1;
    gu_result *on = calloc(N, sizeof *on), *off = calloc(N, sizeof *off), *alone_on = calloc(1, sizeof *on),
              *alone_off = calloc(1, sizeof *off);
    exl_gen_ahead st_on, st_off, st_alone;
    run_schedule(1, m, tok, jobs, N, on, &st_on);
    run_schedule(0, m, tok, jobs, N, off, &st_off);
    run_schedule(1, m, tok, jobs, 1, alone_on, &st_alone);
    run_schedule(0, m, tok, jobs, 1, alone_off, &st_off);
    for (int i = 0; i < N; i++) {
        CHECK_MSG(on[i].n_ids == off[i].n_ids && !memcmp(on[i].ids, off[i].ids, sizeof on[i].ids[0] * on[i].n_ids),
                  "job %d: %d tokens ahead, %d without", i, on[i].n_ids, off[i].n_ids);
        CHECK_MSG(on[i].finish == off[i].finish && on[i].finish != EXL_FINISH_NONE, "job %d: finish %d vs %d", i,
                  on[i].finish, off[i].finish);
    }
    CHECK(on[4].finish == EXL_FINISH_CANCELLED && on[1].finish == EXL_FINISH_LENGTH && on[1].n_ids == 25);
    CHECK(alone_on->n_ids == alone_off->n_ids &&
          !memcmp(alone_on->ids, alone_off->ids, sizeof alone_on->ids[0] * alone_on->n_ids));
    /* queued steps were used, and some dropped (joins, ends, the cancel) */
    CHECK_MSG(st_on.kept > 50 && st_on.dropped >= 2, "kept %lld, dropped %lld", (long long)st_on.kept,
              (long long)st_on.dropped);
    CHECK_MSG(st_alone.kept >= alone_on->n_ids - 2 - 120 / 16, "alone: kept %lld of %d tokens",
              (long long)st_alone.kept, alone_on->n_ids);
    CHECK(st_off.kept == 0 && st_off.dropped == 0);
    free(on);
    free(off);
    free(alone_on);
    free(alone_off);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

static exl_job_params sampled(const char *text, int32_t max_new, float temperature, uint64_t seed) {
    exl_job_params p = greedy(text, max_new);
    p.sampling.temperature = temperature;
    p.sampling.seed = seed;
    return p;
}

/* Sampled steps queued ahead (the default where decode runs ahead; EXL_SAMPLED_AHEAD=0 turns it off) give the
 * tokens of sampled steps run one by one, for the same seeds, while jobs join, end on a stop string or their length,
 * are cancelled, or use penalties (left out of it). */
EXL_TEST(sampled_decode_ahead_same_tokens) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    static const char *const stops[] = {" the"}, *const banned[] = {" and"};
    enum { N = 8 };
    sched_job jobs[N] = {
        {0, -1, sampled("Once upon a time", 90, 0.8f, 1)},      /* top-p 0.95: alone at first */
        {0, -1, sampled("Tom had a red ball", 30, 1.0f, 2)},    /* min-p; ends on its length */
        {4, -1, sampled("The sun", 100, 0.7f, 3)},              /* a stop string mid-run */
        {40, -1, sampled("A cat and a dog", 20, 0.9f, 4)},      /* repetition penalty: not ahead */
        {2, -1, sampled("She was happy because", 60, 0.8f, 5)}, /* top-k + top-p, log-probabilities, a ban */
        {20, -1, sampled("Lily", 50, 1.2f, 6)},                 /* typical, min_new */
        {3, 25, sampled("Ben and Mia", 100, 0.8f, 7)},          /* cancelled */
        {70, -1, sampled("One day", 30, 0.8f, 8)},              /* presence penalty, joins late */
    };
    jobs[0].p.sampling.top_p = 0.95f;
    jobs[1].p.sampling.min_p = 0.05f;
    jobs[2].p.sampling.top_p = 0.9f;
    jobs[2].p.stop_strings = stops;
    jobs[2].p.n_stop_strings = 1;
    jobs[3].p.sampling.repetition_penalty = 1.2f;
    jobs[4].p.sampling.top_k = 20, jobs[4].p.sampling.top_p = 0.95f, jobs[4].p.logprobs = 1;
    jobs[4].p.banned_strings = banned, jobs[4].p.n_banned_strings = 1;  /* rewinds, then bans at a position */
    jobs[5].p.sampling.typical_p = 0.9f, jobs[5].p.min_new_tokens = 10; /* stop ids banned ahead too */
    jobs[6].p.sampling.top_p = 0.95f;
    jobs[7].p.sampling.presence_penalty = 0.5f;
    gu_result *on = calloc(N, sizeof *on), *off = calloc(N, sizeof *off), *alone_on = calloc(1, sizeof *on),
              *alone_off = calloc(1, sizeof *off);
    exl_gen_ahead st_on, st_off, st_alone;
    setenv("EXL_SAMPLED_AHEAD", "1", 1); /* run_schedule unsets it once the generator has read it */
    run_schedule(1, m, tok, jobs, N, on, &st_on);
    setenv("EXL_SAMPLED_AHEAD", "0", 1);
    run_schedule(1, m, tok, jobs, N, off, &st_off);
    setenv("EXL_SAMPLED_AHEAD", "0", 1);
    run_schedule(1, m, tok, jobs, 1, alone_off, &st_off);
    run_schedule(1, m, tok, jobs, 1, alone_on, &st_alone); /* unset: on by default */
    for (int i = 0; i < N; i++) {
        CHECK_MSG(on[i].n_ids == off[i].n_ids && !memcmp(on[i].ids, off[i].ids, sizeof on[i].ids[0] * on[i].n_ids),
                  "job %d: %d tokens ahead, %d without, or other tokens", i, on[i].n_ids, off[i].n_ids);
        CHECK_MSG(on[i].finish == off[i].finish && on[i].finish != EXL_FINISH_NONE, "job %d: finish %d vs %d", i,
                  on[i].finish, off[i].finish);
    }
    CHECK(on[1].finish == EXL_FINISH_LENGTH && on[1].n_ids == 30);
    CHECK(on[2].finish == EXL_FINISH_STOP && on[2].n_ids < 100);
    CHECK(on[6].finish == EXL_FINISH_CANCELLED);
    CHECK(alone_on->n_ids == alone_off->n_ids &&
          !memcmp(alone_on->ids, alone_off->ids, sizeof alone_on->ids[0] * alone_on->n_ids));
    CHECK_MSG(st_on.kept > 20 && st_on.dropped >= 2, "kept %lld, dropped %lld", (long long)st_on.kept,
              (long long)st_on.dropped);
    CHECK_MSG(st_alone.kept >= alone_on->n_ids - 2 - 90 / 16, "alone: kept %lld of %d tokens", (long long)st_alone.kept,
              alone_on->n_ids);
    CHECK(st_off.kept == 0 && st_off.dropped == 0);
    free(on);
    free(off);
    free(alone_on);
    free(alone_off);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

static int32_t argmax_of(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        b = x[i] > x[b] ? i : b;
    return b;
}

/* The model's fed chain (each step queued before the last one's token is read) gives the tokens
 * of plain forwards with the argmax taken here; misuse is refused. */
EXL_TEST(model_fed_chain_matches_plain_forwards) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("rand-llama", &tok);
    REQUIRE(m);
    int32_t vocab = m->cfg.vocab_size, ps = 16;
    exl_kv_cache *cache;
    REQUIRE_OK(exl_kv_cache_init(m, 8, ps, 16, 16, &cache));
    enum { PROMPT = 21, STEPS = 40 };
    int32_t prompt[PROMPT], pages[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    gu_random_ids(5, prompt, PROMPT, vocab);
    int32_t want[STEPS + 1], got[STEPS + 1];
    float *logits = malloc((size_t)vocab * sizeof *logits);
    /* plain */
    int32_t seq[PROMPT + STEPS + 1];
    memcpy(seq, prompt, sizeof prompt);
    exl_seq_step st = {prompt, PROMPT, 0, pages, 2, 1};
    REQUIRE_OK(exl_model_forward(m, cache, &st, 1, logits));
    for (int i = 0; i <= STEPS; i++) {
        want[i] = seq[PROMPT + i] = argmax_of(logits, vocab);
        if (i == STEPS)
            break;
        int32_t n = PROMPT + i + 1;
        st = (exl_seq_step){&seq[PROMPT + i], 1, PROMPT + i, pages, (n + ps - 1) / ps, 1};
        REQUIRE_OK(exl_model_forward(m, cache, &st, 1, logits));
    }
    /* fed, one step ahead */
    int64_t t[STEPS + 1];
    st = (exl_seq_step){prompt, PROMPT, 0, pages, 2, 1};
    REQUIRE_OK(exl_model_forward_argmax(m, cache, &st, 1, &t[0]));
    for (int i = 1; i <= STEPS; i++) {
        int32_t n = PROMPT + i;
        st = (exl_seq_step){NULL, 1, PROMPT + i - 1, pages, (n + ps - 1) / ps, 1};
        REQUIRE_OK(exl_model_forward_argmax(m, cache, &st, 1, &t[i]));
        REQUIRE_OK(exl_model_argmax_wait(m, t[i - 1], &got[i - 1], 1));
    }
    REQUIRE_OK(exl_model_argmax_wait(m, t[STEPS], &got[STEPS], 1));
    CHECK(!memcmp(got, want, sizeof want));

    /* misuse */
    int32_t id;
    CHECK(exl_model_argmax_wait(m, t[STEPS - EXL_ARGMAX_KEEP], &id, 1) == EXL_ERR_ARG); /* too old */
    CHECK(exl_model_argmax_wait(m, t[STEPS], &id, 2) == EXL_ERR_ARG);                   /* wrong rows */
    CHECK(exl_model_argmax_wait(m, t[STEPS] + 1, &id, 1) == EXL_ERR_ARG);               /* not issued */
    exl_seq_step two[2] = {{NULL, 1, PROMPT + STEPS, pages, 4, 1}, {NULL, 1, 0, pages + 4, 1, 1}};
    CHECK(exl_model_forward_argmax(m, cache, two, 2, &t[0]) == EXL_ERR_ARG); /* the step before chose 1 */
    CHECK(strstr(exl_last_error(), "chose 1") != NULL);
    two[1].ids = prompt;
    CHECK(exl_model_forward_argmax(m, cache, two, 2, &t[0]) == EXL_ERR_ARG); /* mixed sources */
    st = (exl_seq_step){prompt, 2, PROMPT + STEPS, pages, 4, 1};
    REQUIRE_OK(exl_model_forward(m, cache, &st, 1, logits)); /* a plain step: nothing fed after it */
    st = (exl_seq_step){NULL, 1, PROMPT + STEPS + 2, pages, 4, 1};
    CHECK(exl_model_forward(m, cache, &st, 1, logits) == EXL_ERR_ARG);
    free(logits);
    exl_kv_cache_free(m, cache);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* The model's sampled chain (each step queued, drawing with u or u_next by what the step before kept, before the
 * last one's token is read) gives the tokens of plain sampled forwards with the stream moved on here; misuse is
 * refused. */
EXL_TEST(model_sampled_chain_matches_plain_forwards) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    int32_t ps = 16;
    exl_kv_cache *cache;
    REQUIRE_OK(exl_kv_cache_init(m, 8, ps, 16, 16, &cache));
    enum { PROMPT = 6, STEPS = 40 };
    int32_t prompt[PROMPT] = {1, 400, 300, 200, 100, 50}, pages[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    double us[STEPS + 2];
    for (int i = 0; i < STEPS + 2; i++)
        us[i] = (double)((i * 7919 + 13) % 1000) / 1000.0;
    exl_sample_params p = {.temperature = 0.9f, .top_p = 0.8f, .typical_p = 1, .repetition_penalty = 1};
    int32_t want[STEPS + 1], got[STEPS + 1], seq[PROMPT + STEPS + 1];
    memcpy(seq, prompt, sizeof prompt);
    int used = 0, ui = 0, drew = 0;
    /* plain */
    exl_seq_step st = {prompt, PROMPT, 0, pages, 1, 1};
    for (int i = 0; i <= STEPS; i++) {
        exl_sample_result r;
        p.u = us[ui];
        REQUIRE_OK(exl_model_forward_sample(m, cache, &st, 1, NULL, NULL, NULL, &p, NULL, 0, &r));
        ui += r.n_kept > 1;
        drew += r.n_kept > 1;
        want[i] = seq[PROMPT + i] = r.id < 0 ? 0 : r.id;
        int32_t n = PROMPT + i + 1;
        st = (exl_seq_step){&seq[PROMPT + i], 1, PROMPT + i, pages, (n + ps - 1) / ps, 1};
    }
    /* queued, one step ahead */
    int64_t t[STEPS + 1];
    exl_sample_result r;
    st = (exl_seq_step){prompt, PROMPT, 0, pages, 1, 1};
    p.u = us[0], p.u_next = us[1];
    REQUIRE_OK(exl_model_forward_sample_ahead(m, cache, &st, 1, &p, NULL, 0, 0, &t[0]));
    for (int i = 1; i <= STEPS + 1; i++) {
        if (i <= STEPS) {
            int32_t n = PROMPT + i;
            st = (exl_seq_step){NULL, 1, PROMPT + i - 1, pages, (n + ps - 1) / ps, 1};
            p.u = us[used], p.u_next = us[used + 1]; /* the stream as far as the steps read back moved it */
            REQUIRE_OK(exl_model_forward_sample_ahead(m, cache, &st, 1, &p, NULL, 0, 1, &t[i]));
        }
        REQUIRE_OK(exl_model_sample_wait(m, t[i - 1], &r, 1));
        got[i - 1] = r.id < 0 ? 0 : r.id;
        used += r.n_kept > 1;
    }
    CHECK(!memcmp(got, want, sizeof want));
    CHECK_MSG(used == ui && drew > 0 && drew <= STEPS, "stream at %d, not %d (%d draws)", used, ui, drew);
    CHECK(exl_model_sample_wait(m, t[STEPS - EXL_ARGMAX_KEEP], &r, 1) == EXL_ERR_ARG); /* too old */
    CHECK(exl_model_sample_wait(m, t[STEPS], &r, 2) == EXL_ERR_ARG);                   /* wrong rows */
    CHECK(exl_model_sample_wait(m, t[STEPS] + 1, &r, 1) == EXL_ERR_ARG);               /* not issued */
    exl_kv_cache_free(m, cache);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}
