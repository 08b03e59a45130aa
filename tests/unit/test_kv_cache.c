/* test_kv_cache.c - the KV cache as sessions, the generator and the commands use it: bytes per token of each
 * format, sizing from memory, a job on a cached prefix of a quantized cache reads exactly what was stored (the
 * same tokens as a session computing that prefix in the same steps), copied pages keep their bytes, preemption
 * with a quantized cache completes every job, exl perplexity --chunk with each cache format within the issue's
 * bounds, and one-line errors for bad widths and sizes. */
#include "gen_util.h"
#include "generator/generator.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Run a shell command; returns its exit code and captures stdout+stderr. */
static int run(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static int count_lines(const char *s) {
    int n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

EXL_TEST(token_bytes_of_each_format) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok); /* 2 layers, 4 KV heads of 16: rows of 64 */
    REQUIRE(m);
    static const struct {
        int32_t k, v;
        int64_t bytes;
    } want[] = {
        {16, 16, 2 * (256 + 256)},                        /* fp32 on the CPU */
        {0, 0, 2 * (256 + 256)},   {8, 8, 2 * (80 + 80)}, /* 64 codes + 4 scales of 2, to 16 */
        {6, 6, 2 * (64 + 64)},                            /* 48 + 8 */
        {4, 4, 2 * (48 + 48)},                            /* 32 + 8 */
        {8, 4, 2 * (80 + 48)},     {16, 4, 2 * (256 + 48)},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        int64_t b;
        REQUIRE_OK(exl_cache_token_bytes(m, want[i].k, want[i].v, &b));
        CHECK_MSG(b == want[i].bytes, "K%d/V%d: %lld bytes a token, want %lld", want[i].k, want[i].v, (long long)b,
                  (long long)want[i].bytes);
    }
    int64_t b;
    CHECK(exl_cache_token_bytes(m, 5, 16, &b) == EXL_ERR_ARG && strstr(exl_last_error(), "5 bits per key"));
    CHECK(exl_cache_token_bytes(m, 4, 32, &b) == EXL_ERR_ARG && strstr(exl_last_error(), "32 bits per value"));
    exl_session *s = NULL;
    CHECK(exl_session_init_cache(m, 64, 3, 3, &s) == EXL_ERR_ARG && !s);
    exl_model_free(m);
    exl_tokenizer_free(tok);
}

/* On the CPU: a quarter of the RAM the weights leave, at most 4 GiB; a generator of n_pages 0 takes that. */
EXL_TEST(sizing_from_memory) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    int64_t t16, t4, b16, b4;
    REQUIRE_OK(exl_cache_fit_tokens(m, 16, 16, 0, &t16));
    REQUIRE_OK(exl_cache_fit_tokens(m, 4, 4, 0, &t4));
    REQUIRE_OK(exl_cache_token_bytes(m, 16, 16, &b16));
    REQUIRE_OK(exl_cache_token_bytes(m, 4, 4, &b4));
    CHECK(t16 > 0 && t16 * b16 <= ((int64_t)4 << 30));
    CHECK_MSG(t4 >= t16 * 5, "4-bit: %lld tokens, 16-bit: %lld", (long long)t4, (long long)t16);
    CHECK(exl_cache_fit_tokens(m, 16, 16, 1.5f, &t16) == EXL_ERR_ARG);
    exl_generator_params gp = exl_generator_default_params();
    gp.n_pages = 0;
    gp.page_size = 1 << 16;
    gp.cache_k_bits = gp.cache_v_bits = 4;
    exl_generator *g = NULL;
    REQUIRE_OK(exl_generator_init(m, tok, &gp, &g));
    CHECK(g->params.n_pages == (int32_t)(t4 >> 16) && g->pool.n_pages == g->params.n_pages);
    exl_generator_free(g);
    exl_model_free(m);
    exl_tokenizer_free(tok);
}

static exl_job_params greedy_job(const int32_t *ids, int32_t n, int32_t max_new) {
    exl_job_params p = exl_job_default_params();
    p.ids = ids;
    p.n_ids = n;
    p.sampling.temperature = 0;
    p.max_new_tokens = max_new;
    p.ignore_eos = 1;
    return p;
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        b = x[i] > x[b] ? i : b;
    return b;
}

/* A job whose first 200 tokens another job left in a quantized cache (3 pages shared, 1 copied) generates what a
 * session does that computes those tokens in the steps the generator took (64 tokens at most), then the job's own
 * 10, then one token a step: the pages hold what was stored, bit for bit. */
EXL_TEST(prefix_reuse_reads_stored_quantized_kv) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("rand-llama", &tok);
    REQUIRE(m);
    enum { STEP = 64, A = 200, B = 210 };
    static int32_t prompt[B];
    gu_random_ids(11, prompt, B, 2048);
    static const int32_t formats[][2] = {{4, 4}, {8, 6}};
    float *logits = malloc(2048 * sizeof *logits);
    gu_result *res = calloc(2, sizeof *res);
    REQUIRE(logits && res);
    for (size_t f = 0; f < sizeof formats / sizeof formats[0]; f++) {
        exl_generator_params gp = exl_generator_default_params();
        gp.n_pages = 16;
        gp.page_size = STEP;
        gp.max_batch_tokens = STEP;
        gp.cache_k_bits = formats[f][0], gp.cache_v_bits = formats[f][1];
        exl_generator *g;
        REQUIRE_OK(exl_generator_init(m, tok, &gp, &g));
        exl_job_params a = greedy_job(prompt, A, 4), b = greedy_job(prompt, B, 4);
        memset(res, 0, 2 * sizeof *res);
        REQUIRE_OK(gu_run(g, &a, 1, &res[0]));
        REQUIRE_OK(gu_run(g, &b, 1, &res[1]));
        exl_generator_stats st;
        exl_generator_stats_get(g, &st);
        CHECK(res[1].n_cached == A && st.pages_shared == 3 && st.pages_copied == 1);
        exl_generator_free(g);

        exl_session *s;
        REQUIRE_OK(exl_session_init_cache(m, B + 4, formats[f][0], formats[f][1], &s));
        for (int32_t at = 0; at < A; at += STEP)
            REQUIRE_OK(exl_session_eval(s, prompt + at, A - at < STEP ? A - at : STEP, NULL, NULL));
        REQUIRE_OK(exl_session_eval(s, prompt + A, B - A, NULL, logits));
        int32_t want[4];
        for (int i = 0; i < 4; i++) {
            want[i] = argmax(logits, 2048);
            if (i < 3)
                REQUIRE_OK(exl_session_eval(s, &want[i], 1, NULL, logits));
        }
        exl_session_free(s);
        CHECK_MSG(res[1].n_ids == 4 && !memcmp(res[1].ids, want, sizeof want),
                  "K%d/V%d: the job on the cached prefix made %d %d %d %d, the session %d %d %d %d", formats[f][0],
                  formats[f][1], res[1].ids[0], res[1].ids[1], res[1].ids[2], res[1].ids[3], want[0], want[1], want[2],
                  want[3]);
    }
    free(res);
    free(logits);
    exl_model_free(m);
    exl_tokenizer_free(tok);
}

/* exl_kv_cache_copy_page copies whole quantized slots: codes and scales. */
EXL_TEST(copy_page_keeps_quantized_slots) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    exl_kv_cache *c;
    REQUIRE_OK(exl_kv_cache_init(m, 3, 8, 6, 4, &c));
    CHECK(c->k_slot_bytes == 64 && c->v_slot_bytes == 48);
    int32_t ids[12], pages[2] = {2, 0};
    gu_random_ids(5, ids, 12, 2048);
    exl_seq_step step = {ids, 12, 0, pages, 2, 0};
    REQUIRE_OK(exl_model_forward(m, c, &step, 1, NULL));
    REQUIRE_OK(exl_kv_cache_copy_page(m, c, 2, 1, 6));
    for (int32_t l = 0; l < c->n_layers; l++) {
        const unsigned char *k = c->k[l], *v = c->v[l];
        CHECK(!memcmp(k + 8 * 64, k + 2 * 8 * 64, 6 * 64) && memcmp(k + 8 * 64, k + 2 * 8 * 64, 7 * 64));
        CHECK(!memcmp(v + 8 * 48, v + 2 * 8 * 48, 6 * 48) && memcmp(v + 8 * 48, v + 2 * 8 * 48, 7 * 48));
    }
    exl_kv_cache_free(m, c);
    exl_model_free(m);
    exl_tokenizer_free(tok);
}

/* 8 jobs needing ~34 pages of 16 slots share 8 pages of a 4-bit cache: preempted, they all complete. */
EXL_TEST(preemption_with_quantized_cache) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("rand-llama", &tok);
    REQUIRE(m);
    enum { N = 8 };
    static int32_t prompts[N][40];
    exl_job_params p[N];
    for (int i = 0; i < N; i++) {
        gu_random_ids(50 + i, prompts[i], 10 + 4 * i, 2048);
        p[i] = greedy_job(prompts[i], 10 + 4 * i, 30);
        p[i].priority = i % 3;
    }
    gu_result *res = calloc(N, sizeof *res);
    REQUIRE(res);
    for (int cache = 0; cache < 2; cache++) {
        exl_generator_params gp = exl_generator_default_params();
        gp.n_pages = 8;
        gp.page_size = 16;
        gp.prefix_cache = cache;
        gp.cache_k_bits = gp.cache_v_bits = 4;
        exl_generator *g;
        REQUIRE_OK(exl_generator_init(m, tok, &gp, &g));
        memset(res, 0, N * sizeof *res);
        REQUIRE_OK(gu_run(g, p, N, res));
        exl_generator_stats st;
        exl_generator_stats_get(g, &st);
        CHECK_MSG(st.preemptions > 0, "no preemption with prefix cache %d", cache);
        CHECK(st.jobs_finished == N && st.pages_used == 0);
        for (int i = 0; i < N; i++)
            CHECK(res[i].finish == EXL_FINISH_LENGTH && res[i].n_ids == 30);
        exl_generator_free(g);
    }
    free(res);
    exl_model_free(m);
    exl_tokenizer_free(tok);
}

/* exl perplexity's value for a cache format, chunk C */
static double perplexity(const char *bits, int chunk) {
    char cmd[4096], out[8192], model[2048];
    snprintf(model, sizeof model, "%s", exl_test_shared("models/tinystories-656k"));
    snprintf(cmd, sizeof cmd,
             "%s perplexity -m %s -f %s --device cpu --ctx 256 --stride 256 --max-windows 2 --chunk %d "
             "--cache-bits %s 2>/dev/null",
             EXL_CLI_PATH, model, exl_test_shared("data/tinystories_val.txt"), chunk, bits);
    const char *p = run(cmd, out, sizeof out) == 0 ? strstr(out, "perplexity: ") : NULL;
    return p ? atof(p + 12) : -1;
}

/* The bounds: the 16-bit cache in pieces of 32 equals one pass (0.1%); 8 bits within +0.5%, 4 bits +5%. */
EXL_TEST(perplexity_in_chunks_through_the_cache) {
    double one_pass = perplexity("16", 256);
    REQUIRE(one_pass > 1);
    static const struct {
        const char *bits;
        double most;
    } bounds[] = {{"16", 0.001}, {"8", 0.005}, {"6", 0.02}, {"4", 0.05}, {"8,4", 0.05}};
    for (size_t i = 0; i < sizeof bounds / sizeof bounds[0]; i++) {
        double ppl = perplexity(bounds[i].bits, 32), rel = ppl / one_pass - 1;
        CHECK_MSG(ppl > 0 && rel <= bounds[i].most && rel >= -bounds[i].most,
                  "--cache-bits %s --chunk 32: perplexity %.4f, one pass %.4f (%+.3f%%)", bounds[i].bits, ppl, one_pass,
                  100 * rel);
    }
    CHECK(perplexity("4", 256) == one_pass); /* one pass: the window's own keys and values, exact */
}

/* Unsupported widths, a cache too small for one sequence, a cache larger than memory: one line each. */
EXL_TEST(bad_cache_options_one_line) {
    const char *model = exl_test_shared("models/tinystories-656k");
    static const struct {
        const char *args, *says;
        int rc;
    } cases[] = {
        {"run -p Hi --cache-bits 5", "--cache-bits takes 16, 8, 6 or 4", 2},
        {"run -p Hi --cache-bits 4,", "not '4,'", 2},
        {"perplexity -f /dev/null --cache-bits 8,3", "not '8,3'", 2},
        {"bench --cache-bits x", "not 'x'", 2},
        {"serve --port 0 --cache-tokens 100", "cannot hold one sequence of 512 tokens", 1},
        {"chat --cache-tokens 64 --ctx 128", "cannot hold the 128-token window", 1},
        {"run -p Hi -n 30 --cache-tokens 20", "exceed the cache (20 tokens)", 1},
        {"run -p Hi --cache-tokens 2000000000", "more than the", 1},
        {"serve --port 0 --cache-tokens 2000000000 --cache-bits 8", "more than the", 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char cmd[4096], out[8192];
        snprintf(cmd, sizeof cmd, "%s %s -m %s --device cpu </dev/null 2>&1", EXL_CLI_PATH, cases[i].args, model);
        int rc = run(cmd, out, sizeof out);
        CHECK_MSG(rc == cases[i].rc && strstr(out, cases[i].says) && count_lines(out) == 1,
                  "exl %s: exit %d, want %d with '%s' in one line: %s", cases[i].args, rc, cases[i].rc, cases[i].says,
                  out);
    }
}
