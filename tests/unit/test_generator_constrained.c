/* test_generator_constrained.c - jobs with a constraint: sampled JSON that always parses and
 * validates (TinyStories' vocabulary lacks braces and brackets: the grammar writes them), grammars
 * that end with or without an end token, the length limit, constrained and free jobs in one batch,
 * log-probabilities, and what cannot be combined. */
#include "gen_util.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char BOUNDED[] =
    "{\"type\": \"object\", \"properties\": {"
    "\"name\": {\"type\": \"string\", \"maxLength\": 12},"
    "\"age\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 99},"
    "\"colors\": {\"type\": \"array\", \"items\": {\"enum\": [\"red\", \"green\", \"blue\"]}, \"maxItems\": 3},"
    "\"happy\": {\"type\": \"boolean\"}},"
    "\"required\": [\"name\", \"age\", \"colors\", \"happy\"], \"additionalProperties\": false}";

static exl_constraint *compile(exl_constraint_kind kind, const char *src) {
    exl_constraint *c = NULL;
    if (exl_constraint_compile(kind, src, strlen(src), &c) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "compile: %s", exl_last_error());
    return c;
}

/* Code points of a UTF-8 string. */
static int n_chars(const char *s) {
    int n = 0;
    for (; *s; s++)
        n += ((unsigned char)*s & 0xc0) != 0x80;
    return n;
}

/* Does doc validate against BOUNDED? */
static int valid_bounded(const char *doc, char *why, size_t cap) {
    cJSON *o = cJSON_Parse(doc);
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name"), *age = cJSON_GetObjectItemCaseSensitive(o, "age");
    const cJSON *colors = cJSON_GetObjectItemCaseSensitive(o, "colors");
    const cJSON *happy = cJSON_GetObjectItemCaseSensitive(o, "happy");
    const char *bad = !cJSON_IsObject(o)                                         ? "not an object"
                      : cJSON_GetArraySize(o) != 4                               ? "keys"
                      : !cJSON_IsString(name) || n_chars(name->valuestring) > 12 ? "name"
                      : !cJSON_IsNumber(age) || age->valuedouble != floor(age->valuedouble) || age->valuedouble < 1 ||
                              age->valuedouble > 99
                          ? "age"
                      : !cJSON_IsArray(colors) || cJSON_GetArraySize(colors) > 3 ? "colors"
                      : !cJSON_IsBool(happy)                                     ? "happy"
                                                                                 : NULL;
    for (const cJSON *c = cJSON_IsArray(colors) ? colors->child : NULL; c && !bad; c = c->next)
        if (!cJSON_IsString(c) ||
            (strcmp(c->valuestring, "red") && strcmp(c->valuestring, "green") && strcmp(c->valuestring, "blue")))
            bad = "a color";
    snprintf(why, cap, "%s", bad ? bad : "");
    cJSON_Delete(o);
    return !bad;
}

static void json_for_seeds(const char *model) {
    exl_tokenizer *tok;
    exl_model *m = gu_load(model, &tok);
    REQUIRE(m);
    exl_generator *g = gu_generator(m, tok, 0, 0, 0);
    exl_constraint *c = compile(EXL_CONSTRAINT_JSON_SCHEMA, BOUNDED);
    gu_result *r = calloc(8, sizeof *r);
    REQUIRE(g && c && r);
    exl_job_params p[8];
    for (int i = 0; i < 8; i++) { /* one batch of 8 seeds at temperature 1 */
        p[i] = exl_job_default_params();
        p[i].text = "Once upon a time";
        p[i].max_new_tokens = 400;
        p[i].constraint = c;
        p[i].sampling.temperature = 1.0f;
        p[i].sampling.seed = (uint64_t)i + 1;
    }
    REQUIRE_OK(gu_run(g, p, 8, r));
    exl_constraint_free(c);
    for (int i = 0; i < 8; i++) {
        char why[64];
        r[i].text[r[i].text_len] = 0;
        CHECK_MSG(r[i].finish == EXL_FINISH_STOP && valid_bounded(r[i].text, why, sizeof why),
                  "%s seed %d (%s, %s): %s", model, i + 1, exl_finish_reason_str(r[i].finish), why, r[i].text);
    }
    free(r);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(json_schema_sampled_always_validates) {
    json_for_seeds("tinystories-656k");
    json_for_seeds("rand-llama");
}

typedef struct fixture {
    exl_model *m;
    exl_tokenizer *tok;
    exl_generator *g;
    gu_result *r;
} fixture;

static int setup(fixture *f) {
    f->m = gu_load("tinystories-656k", &f->tok);
    f->g = f->m ? gu_generator(f->m, f->tok, 0, 0, 0) : NULL;
    f->r = calloc(4, sizeof *f->r);
    return f->g && f->r;
}

static void teardown(fixture *f) {
    free(f->r);
    exl_generator_free(f->g);
    exl_tokenizer_free(f->tok);
    exl_model_free(f->m);
}

static exl_job_params job(exl_constraint *c, uint64_t seed, int32_t max_new) {
    exl_job_params p = exl_job_default_params();
    p.text = "Once upon a time";
    p.constraint = c;
    p.sampling.seed = seed;
    p.max_new_tokens = max_new;
    return p;
}

EXL_TEST(ends_with_eos_where_the_grammar_may_end) {
    fixture f;
    REQUIRE(setup(&f));
    /* open-ended: end-of-sequence ends it, allowed only once a letter was written (biased up, it
     * comes at once then, never before), or the length */
    exl_constraint *c = compile(EXL_CONSTRAINT_REGEX, "[a-z ,]*[a-z]+\\.?");
    REQUIRE(c);
    const exl_logit_bias eos_up = {2, 50.0f};
    int saw_eos = 0;
    for (uint64_t seed = 1; seed <= 8; seed++) {
        exl_job_params p = job(c, seed, 120);
        p.sampling.logit_bias = &eos_up;
        p.sampling.n_logit_bias = 1;
        REQUIRE_OK(gu_run(f.g, &p, 1, f.r));
        gu_result *r = f.r;
        r->text[r->text_len] = 0;
        size_t n = strspn(r->text, "abcdefghijklmnopqrstuvwxyz ,.");
        int ended = r->finish == EXL_FINISH_STOP && r->stop_token == 2;
        CHECK_MSG(n == r->text_len && strcspn(r->text, "abcdefghijklmnopqrstuvwxyz") < n &&
                      (ended || r->finish == EXL_FINISH_LENGTH),
                  "seed %d: %s %s", (int)seed, exl_finish_reason_str(r->finish), r->text);
        saw_eos |= ended;
        memset(r, 0, sizeof *r);
    }
    CHECK_MSG(saw_eos, "no run ended with end-of-sequence");
    exl_constraint_free(c);
    teardown(&f);
}

EXL_TEST(forced_text_and_immediate_end) {
    fixture f;
    REQUIRE(setup(&f));
    /* no token spells a brace: the grammar writes "{}" and the job ends there */
    exl_constraint *c = compile(EXL_CONSTRAINT_GBNF, "root ::= \"{\" \"}\"\n");
    REQUIRE(c);
    exl_job_params p = job(c, 1, 20);
    p.logprobs = 1;
    p.top_logprobs = 2;
    REQUIRE_OK(gu_run(f.g, &p, 1, f.r));
    f.r->text[f.r->text_len] = 0;
    CHECK_MSG(!strcmp(f.r->text, "{}") && f.r->finish == EXL_FINISH_STOP && f.r->stop_token == -1, "%s (%s)", f.r->text,
              exl_finish_reason_str(f.r->finish));
    CHECK(f.r->n_ids >= 1 && f.r->lp[0] == 0.0f); /* forced: probability 1 */
    exl_constraint_free(c);
    /* a grammar that matches only the empty string ends before any token */
    c = compile(EXL_CONSTRAINT_GBNF, "root ::= \"\"\n");
    REQUIRE(c);
    memset(f.r, 0, sizeof *f.r);
    p = job(c, 1, 20);
    REQUIRE_OK(gu_run(f.g, &p, 1, f.r));
    CHECK(f.r->text_len == 0 && f.r->n_ids == 0 && f.r->finish == EXL_FINISH_STOP);
    exl_constraint_free(c);
    teardown(&f);
}

EXL_TEST(length_limit_and_batch_neighbours) {
    fixture f;
    REQUIRE(setup(&f));
    exl_constraint *c = compile(EXL_CONSTRAINT_REGEX, "(ab)+c");
    REQUIRE(c);
    /* a free job alone, then next to constrained ones: the masks touch only their own rows */
    exl_job_params free_job = job(NULL, 5, 24);
    REQUIRE_OK(gu_run(f.g, &free_job, 1, &f.r[0]));
    exl_job_params ps[3] = {job(c, 1, 7), free_job, job(c, 2, 7)};
    REQUIRE_OK(gu_run(f.g, ps, 3, &f.r[1]));
    CHECK(f.r[1 + 1].text_len == f.r[0].text_len && !memcmp(f.r[2].text, f.r[0].text, f.r[0].text_len));
    for (int i = 1; i <= 3; i += 2) {
        f.r[i].text[f.r[i].text_len] = 0;
        int ok = 1; /* (ab)* prefix cut by the 7-token limit, or complete */
        for (size_t k = 0; k < f.r[i].text_len; k++)
            ok &= f.r[i].text[k] == (k + 1 == f.r[i].text_len && f.r[i].finish == EXL_FINISH_STOP ? 'c'
                                     : k % 2                                                      ? 'b'
                                                                                                  : 'a');
        CHECK_MSG(ok && f.r[i].n_ids <= 7, "%s (%s)", f.r[i].text, exl_finish_reason_str(f.r[i].finish));
    }
    exl_constraint_free(c);
    teardown(&f);
}

EXL_TEST(greedy_constrained_and_refusals) {
    fixture f;
    REQUIRE(setup(&f));
    exl_constraint *c = compile(EXL_CONSTRAINT_GBNF, "root ::= (\"Lily\" | \"Tom\") \" went \" [a-z]{1,8} \".\"\n");
    REQUIRE(c);
    exl_job_params p = job(c, 0, 40);
    p.sampling.temperature = 0; /* greedy: the best allowed token each step */
    REQUIRE_OK(gu_run(f.g, &p, 1, f.r));
    f.r->text[f.r->text_len] = 0;
    CHECK_MSG((!strncmp(f.r->text, "Lily went ", 10) || !strncmp(f.r->text, "Tom went ", 9)) &&
                  f.r->text[f.r->text_len - 1] == '.' && f.r->finish == EXL_FINISH_STOP,
              "%s", f.r->text);
    const char *ban[] = {"x"};
    p.banned_strings = ban;
    p.n_banned_strings = 1;
    uint64_t id;
    CHECK(exl_generator_submit(f.g, &p, &id) == EXL_ERR_ARG && strstr(exl_last_error(), "banned_strings"));
    exl_constraint_free(c);
    teardown(&f);
}
