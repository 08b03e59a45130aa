/* test_generator_text.c - what jobs stream: stop strings across token boundaries, stop
 * tokens and eos ids, min_new_tokens, banned strings, streamed text equal to a full
 * decode (never a split character), and log-probabilities. */
#include "gen_util.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* tinystories greedy after "Once upon a time" (the transformers reference):
 * ", a little girl named Lily lived in a small house with her mom, dad, ..." */
static const int32_t once[6] = {1, 80, 147, 201, 282, 57};

typedef struct fixture {
    exl_model *m;
    exl_tokenizer *tok;
    exl_generator *g;
    gu_result *r;
} fixture;

static int setup(fixture *f, const char *model) {
    f->m = gu_load(model, &f->tok);
    f->g = f->m ? gu_generator(f->m, f->tok, 0, 0, 0) : NULL;
    f->r = calloc(4, sizeof *f->r);
    return f->g != NULL;
}

static void teardown(fixture *f) {
    free(f->r);
    exl_generator_free(f->g);
    exl_tokenizer_free(f->tok);
    exl_model_free(f->m);
}

static exl_job_params once_greedy(int32_t max_new) {
    exl_job_params p = exl_job_default_params();
    p.ids = once;
    p.n_ids = 6;
    p.sampling.temperature = 0;
    p.max_new_tokens = max_new;
    return p;
}

static void run_one(fixture *f, const exl_job_params *p, gu_result *r) {
    memset(r, 0, sizeof *r);
    if (gu_run(f->g, p, 1, r) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "run: %s", exl_last_error());
    r->text[r->text_len] = 0;
}

EXL_TEST(stop_strings) {
    fixture f;
    REQUIRE(setup(&f, "tinystories-656k"));
    static const struct {
        const char *stops[2];
        const char *text, *which;
    } cases[] = {
        {{"le gi", NULL}, ", a litt", "le gi"}, /* across the "little" / "girl" tokens */
        {{"Lily", NULL}, ", a little girl named ", "Lily"},
        {{"house", "girl"}, ", a little ", "girl"}, /* the earliest match wins */
        {{"zebra", NULL}, NULL, NULL},              /* never matches: runs to length */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_job_params p = once_greedy(48);
        p.stop_strings = cases[i].stops;
        p.n_stop_strings = cases[i].stops[1] ? 2 : 1;
        run_one(&f, &p, f.r);
        if (cases[i].text) {
            CHECK_MSG(!strcmp(f.r->text, cases[i].text), "stop %s: got '%s'", cases[i].stops[0], f.r->text);
            CHECK(f.r->finish == EXL_FINISH_STOP && !strcmp(f.r->stop_string, cases[i].which));
            CHECK(f.r->n_ids < 10);
        } else {
            CHECK(f.r->finish == EXL_FINISH_LENGTH && f.r->n_ids == 48 && !f.r->stop_string[0]);
            CHECK(!strncmp(f.r->text, ", a little girl named Lily lived in a small house", 49));
        }
    }
    teardown(&f);
}

EXL_TEST(stop_tokens_and_min_new) {
    fixture f;
    REQUIRE(setup(&f, "tinystories-656k"));
    exl_job_params p = once_greedy(48);
    int32_t stop = 1049; /* the 4th greedy token */
    p.stop_ids = &stop;
    p.n_stop_ids = 1;
    run_one(&f, &p, f.r);
    CHECK(f.r->finish == EXL_FINISH_STOP && f.r->stop_token == 1049);
    CHECK(f.r->n_ids == 4 && f.r->ids[3] == 1049);
    int32_t all[9];
    memcpy(all, once, sizeof once);
    memcpy(all + 6, f.r->ids, 3 * sizeof *all);
    char *full, *pre;
    REQUIRE_OK(exl_tokenizer_decode(f.tok, all, 9, 1, &full));
    REQUIRE_OK(exl_tokenizer_decode(f.tok, all, 6, 1, &pre));
    CHECK_MSG(!strcmp(f.r->text, full + strlen(pre)), "text before the stop token: '%s'", f.r->text);
    exl_string_free(full);
    exl_string_free(pre);

    /* eos (id 2 in config.json) pushed to the top: stops at once; ignore_eos / min_new hold it off */
    exl_logit_bias bias = {2, 100.0f};
    p = once_greedy(8);
    p.sampling.logit_bias = &bias;
    p.sampling.n_logit_bias = 1;
    run_one(&f, &p, f.r);
    CHECK(f.r->finish == EXL_FINISH_STOP && f.r->stop_token == 2 && f.r->n_ids == 1 && f.r->text_len == 0);
    p.min_new_tokens = 3;
    run_one(&f, &p, f.r);
    CHECK(f.r->finish == EXL_FINISH_STOP && f.r->n_ids == 4 && f.r->ids[3] == 2);
    p.min_new_tokens = 0;
    p.ignore_eos = 1;
    run_one(&f, &p, f.r);
    CHECK(f.r->finish == EXL_FINISH_LENGTH && f.r->n_ids == 8);
    teardown(&f);
}

EXL_TEST(banned_strings) {
    fixture f;
    REQUIRE(setup(&f, "tinystories-656k"));
    const char *banned[] = {"Lily", "Spot"};
    exl_job_params p = once_greedy(48);
    p.banned_strings = banned;
    p.n_banned_strings = 2;
    run_one(&f, &p, f.r);
    exl_generator_stats st;
    exl_generator_stats_get(f.g, &st);
    CHECK(st.rewinds >= 1);
    CHECK_MSG(!strstr(f.r->text, "Lily") && !strstr(f.r->text, "Spot"), "banned text came out: %s", f.r->text);
    CHECK(!strncmp(f.r->text, ", a little girl named ", 22));
    CHECK(f.r->n_ids == 48 && f.r->finish == EXL_FINISH_LENGTH);
    /* the reported ids decode (after the prompt) to the reported text */
    int32_t all[64];
    memcpy(all, once, sizeof once);
    memcpy(all + 6, f.r->ids, (size_t)f.r->n_ids * sizeof *all);
    char *full, *pre;
    REQUIRE_OK(exl_tokenizer_decode(f.tok, all, 6 + f.r->n_ids, 1, &full));
    REQUIRE_OK(exl_tokenizer_decode(f.tok, all, 6, 1, &pre));
    CHECK(!strcmp(full + strlen(pre), f.r->text));
    exl_string_free(full);
    exl_string_free(pre);
    teardown(&f);
}

/* Random-ish sampling on a random model emits many byte tokens: the streamed chunks
 * must never split a character and must add up to the full decode. */
EXL_TEST(streamed_text_equals_decode) {
    fixture f;
    REQUIRE(setup(&f, "rand-llama"));
    for (int k = 0; k < 3; k++) {
        exl_job_params p = exl_job_default_params();
        p.ids = once;
        p.n_ids = k == 0 ? 1 : 6;
        p.sampling.temperature = 1.5f;
        p.sampling.seed = 11 + (uint64_t)k;
        p.max_new_tokens = 200;
        p.ignore_eos = 1;
        if (k == 2) { /* with a stop string that never matches, text is held and released */
            static const char *stops[] = {"\xe4\xb8\x80\xe4\xb8\x80\xe4\xb8\x80", "@@@@"};
            p.stop_strings = stops;
            p.n_stop_strings = 2;
        }
        run_one(&f, &p, f.r);
        REQUIRE(f.r->n_ids == 200);
        int32_t all[256];
        memcpy(all, once, (size_t)p.n_ids * sizeof *all);
        memcpy(all + p.n_ids, f.r->ids, 200 * sizeof *all);
        char *full, *pre;
        REQUIRE_OK(exl_tokenizer_decode(f.tok, all, p.n_ids + 200, 1, &full));
        REQUIRE_OK(exl_tokenizer_decode(f.tok, all, p.n_ids, 1, &pre));
        CHECK_MSG(!strcmp(full + strlen(pre), f.r->text), "case %d: streamed text differs from decode", k);
        CHECK(!f.r->split_char);
        CHECK(f.r->n_events > 50);
        exl_string_free(full);
        exl_string_free(pre);
    }
    teardown(&f);
}

EXL_TEST(logprobs) {
    fixture f;
    REQUIRE(setup(&f, "tinystories-656k"));
    exl_job_params p = once_greedy(16);
    p.logprobs = 1;
    p.top_logprobs = 3;
    p.sampling.repetition_penalty = 1.3f; /* logprobs describe the model, not the processed logits */
    run_one(&f, &p, f.r);
    REQUIRE(f.r->n_ids == 16);
    for (int32_t i = 0; i < 16; i++) {
        const exl_token_logprob *t = f.r->top + i * 4;
        CHECK(t[0].logprob >= t[1].logprob && t[1].logprob >= t[2].logprob && t[0].logprob <= 0);
        CHECK(expf(t[0].logprob) + expf(t[1].logprob) + expf(t[2].logprob) <= 1.0001f);
        CHECK(f.r->lp[i] <= t[0].logprob + 1e-6f);
    }
    /* the first token against a session's logits */
    exl_session *s;
    REQUIRE_OK(exl_session_init(f.m, 16, &s));
    float logits[2048];
    REQUIRE_OK(exl_session_eval(s, once, 6, NULL, logits));
    double m = -INFINITY, sum = 0;
    for (int i = 0; i < 2048; i++)
        m = logits[i] > m ? logits[i] : m;
    for (int i = 0; i < 2048; i++)
        sum += exp(logits[i] - m);
    double want = logits[f.r->ids[0]] - m - log(sum);
    CHECK_MSG(fabs(f.r->lp[0] - want) < 1e-4, "logprob %f vs %f", f.r->lp[0], want);
    CHECK(f.r->top[0].id == f.r->ids[0]); /* no penalty yet on the first token: greedy = top */
    exl_session_free(s);
    teardown(&f);
}
