/* test_speculative.c - speculative decoding in the generator (generator/speculative.c, draft_model.c,
 * draft_ngram.c): greedy output identical to plain decoding with a quantized draft, the model drafting for itself
 * and n-gram drafts, stop/banned strings and lengths as without drafting, jobs with and without drafting in one
 * step; speculative sampling against plain sampling (chi-square); the cache after rollbacks against plain
 * decoding's (logits compared). */
#include "base/alloc.h"
#include "gen_util.h"
#include "generator/generator.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct spec_cfg {
    exl_model *draft;
    int32_t k, ngram, fixed, max_batch, n_pages;
} spec_cfg;

/* Run the jobs on a generator of 16-token pages with the drafting in cfg (NULL: plain decoding). */
static void run_jobs(exl_model *m, exl_tokenizer *tok, const spec_cfg *cfg, const exl_job_params *params, int n,
                     gu_result *res, exl_generator_stats *stats) {
    exl_generator_params p = exl_generator_default_params();
    p.n_pages = 256;
    p.page_size = 16;
    if (cfg) {
        p.draft_model = cfg->draft;
        p.draft_tokens = cfg->k;
        p.ngram = cfg->ngram;
        p.draft_fixed = cfg->fixed;
        if (cfg->max_batch)
            p.max_batch_tokens = p.max_jobs = cfg->max_batch;
        if (cfg->n_pages)
            p.n_pages = cfg->n_pages;
    }
    exl_generator *g = NULL;
    memset(res, 0, (size_t)n * sizeof *res);
    if (exl_generator_init(m, tok, &p, &g) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "generator: %s", exl_last_error());
        return;
    }
    if (gu_run(g, params, n, res) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "run: %s", exl_last_error());
    if (stats)
        exl_generator_stats_get(g, stats);
    exl_generator_free(g);
}

static void check_same(const gu_result *a, const gu_result *b, int n, const char *what) {
    for (int i = 0; i < n; i++) {
        CHECK_MSG(a[i].n_ids == b[i].n_ids && !memcmp(a[i].ids, b[i].ids, sizeof a[i].ids[0] * (size_t)a[i].n_ids),
                  "%s, job %d: %d tokens plain, %d drafted", what, i, a[i].n_ids, b[i].n_ids);
        CHECK_MSG(a[i].finish == b[i].finish && a[i].finish != EXL_FINISH_NONE, "%s, job %d: finish %d vs %d", what, i,
                  a[i].finish, b[i].finish);
        CHECK_MSG(a[i].text_len == b[i].text_len && !memcmp(a[i].text, b[i].text, a[i].text_len) &&
                      !strcmp(a[i].stop_string, b[i].stop_string) && a[i].stop_token == b[i].stop_token,
                  "%s, job %d: text or stop differ", what, i);
    }
}

static double acceptance(const exl_generator_stats *s) {
    return s->draft_proposed ? (double)s->draft_accepted / (double)s->draft_proposed : 0;
}

static exl_job_params ids_job(const int32_t *ids, int32_t n, int32_t max_new) {
    exl_job_params p = exl_job_default_params();
    p.ids = ids;
    p.n_ids = n;
    p.max_new_tokens = max_new;
    p.sampling.temperature = 0;
    return p;
}

/* Prompts for rand-llama: random ids, one of them a block said twice (n-gram matches). */
enum { N_RAND = 5 };
static int32_t rand_prompts[N_RAND][80];
static const int32_t rand_len[N_RAND] = {5, 30, 70, 12, 80};

static void rand_jobs(int32_t vocab, exl_job_params *p) {
    static const int32_t max_new[N_RAND] = {60, 45, 25, 50, 70};
    for (int i = 0; i < N_RAND; i++) {
        gu_random_ids(100 + (uint64_t)i, rand_prompts[i], rand_len[i], vocab);
        p[i] = ids_job(rand_prompts[i], rand_len[i], max_new[i]);
    }
    memcpy(rand_prompts[4] + 40, rand_prompts[4] + 1, 39 * sizeof(int32_t));
    p[1].no_draft = 1;   /* decodes plainly beside the drafting jobs */
    p[2].ignore_eos = 1; /* and one runs to its length whatever it says */
}

EXL_TEST(greedy_identity_quantized_draft) {
    exl_tokenizer *tok, *dtok;
    exl_model *m = gu_load("rand-llama", &tok), *d = gu_load("rand-llama-exl2-5.0bpw-h8", &dtok);
    REQUIRE(m && d);
    exl_job_params p[N_RAND];
    rand_jobs(m->cfg.vocab_size, p);
    gu_result *plain = calloc(N_RAND, sizeof *plain), *spec = calloc(N_RAND, sizeof *spec);
    run_jobs(m, tok, NULL, p, N_RAND, plain, NULL);
    const spec_cfg cfgs[] = {{d, 4, 0, 0, 0, 0}, {d, 8, 0, 1, 0, 0}, {d, 3, 0, 1, 24, 0}, {d, 5, 2, 0, 0, 0}};
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
        exl_generator_stats st;
        run_jobs(m, tok, &cfgs[c], p, N_RAND, spec, &st);
        char what[64];
        snprintf(what, sizeof what, "config %zu", c);
        check_same(plain, spec, N_RAND, what);
        CHECK_MSG(st.draft_proposed > 50 && st.draft_accepted > 0, "config %zu: %lld proposed, %lld accepted", c,
                  (long long)st.draft_proposed, (long long)st.draft_accepted);
        CHECK(spec[1].n_ids > 0);
        printf("  config %zu: acceptance %.3f (%lld of %lld), %lld steps\n", c, acceptance(&st),
               (long long)st.draft_accepted, (long long)st.draft_proposed, (long long)st.steps);
    }
    free(plain);
    free(spec);
    exl_tokenizer_free(dtok);
    exl_model_free(d);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(model_drafting_for_itself_accepts_nearly_all) {
    exl_tokenizer *tok, *dtok;
    exl_model *m = gu_load("rand-llama", &tok), *d = gu_load("rand-llama", &dtok);
    REQUIRE(m && d);
    exl_job_params p[N_RAND];
    rand_jobs(m->cfg.vocab_size, p);
    gu_result *plain = calloc(N_RAND, sizeof *plain), *spec = calloc(N_RAND, sizeof *spec);
    run_jobs(m, tok, NULL, p, N_RAND, plain, NULL);
    exl_generator_stats st;
    const spec_cfg cfg = {d, 4, 0, 1, 0, 0};
    run_jobs(m, tok, &cfg, p, N_RAND, spec, &st);
    check_same(plain, spec, N_RAND, "self-draft");
    printf("  acceptance %.4f (%lld of %lld)\n", acceptance(&st), (long long)st.draft_accepted,
           (long long)st.draft_proposed);
    CHECK_MSG(st.draft_proposed > 100 && acceptance(&st) >= 0.95, "acceptance %.3f of %lld", acceptance(&st),
              (long long)st.draft_proposed);
    /* the same model object drafting for itself (its own draft cache) */
    const spec_cfg same = {m, 4, 0, 1, 0, 0};
    run_jobs(m, tok, &same, p, N_RAND, spec, &st);
    check_same(plain, spec, N_RAND, "same object");
    CHECK(acceptance(&st) >= 0.95);
    free(plain);
    free(spec);
    exl_tokenizer_free(dtok);
    exl_model_free(d);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(ngram_identity_tinystories) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    static const char *const stops[] = {"happy"}, *const bans[] = {" the park"};
    enum { N = 7 };
    exl_job_params p[N];
    const char *texts[N] = {"Once upon a time, there was a little girl named Lily. Lily liked to play. One day, Lily",
                            "Tom had a red ball. Tom had a red ball. Tom",
                            "The sun was",
                            "One day, a cat",
                            "Ben and Mia went to",
                            "Sue liked to sing",
                            "There was a big dog"};
    const int32_t max_new[N] = {150, 80, 120, 100, 90, 60, 100};
    for (int i = 0; i < N; i++) {
        p[i] = exl_job_default_params();
        p[i].text = texts[i];
        p[i].max_new_tokens = max_new[i];
        p[i].sampling.temperature = 0;
    }
    p[2].stop_strings = stops;
    p[2].n_stop_strings = 1;
    p[3].banned_strings = bans;
    p[3].n_banned_strings = 1;
    p[4].min_new_tokens = 30;
    p[5].sampling.temperature = 0.8f; /* n-gram drafts are point masses: seeded sampling gives plain's tokens */
    p[5].sampling.top_k = 40;
    p[5].sampling.seed = 7;
    p[6].sampling.temperature = 1.0f;
    p[6].sampling.repetition_penalty = 1.1f;
    p[6].sampling.seed = 3;
    gu_result *plain = calloc(N, sizeof *plain), *spec = calloc(N, sizeof *spec);
    run_jobs(m, tok, NULL, p, N, plain, NULL);
    const spec_cfg cfgs[] = {{NULL, 4, 3, 0, 0, 0}, {NULL, 8, 2, 1, 0, 0}, {NULL, 6, 4, 0, 40, 0}};
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
        exl_generator_stats st;
        run_jobs(m, tok, &cfgs[c], p, N, spec, &st);
        char what[64];
        snprintf(what, sizeof what, "n-gram config %zu", c);
        check_same(plain, spec, N, what);
        printf("  config %zu: acceptance %.3f (%lld of %lld), %lld steps for %lld tokens\n", c, acceptance(&st),
               (long long)st.draft_accepted, (long long)st.draft_proposed, (long long)st.steps,
               (long long)st.tokens_generated);
        CHECK(st.draft_accepted > 50);
    }
    CHECK(!strcmp(plain[2].stop_string, "happy") || plain[2].finish == EXL_FINISH_LENGTH);
    free(plain);
    free(spec);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* A draft model on greedy jobs with stop and banned strings, min_new_tokens, a shared prompt (prefix cache hits) and a
 * cache so small that jobs are preempted and recomputed: what plain decoding gives with the same cache. */
EXL_TEST(draft_model_with_stops_bans_prefixes_and_preemption) {
    exl_tokenizer *tok, *dtok;
    exl_model *m = gu_load("tinystories-656k", &tok),
              *d = gu_load("tinystories-656k-gptq-4bit-g32-actorder-asym", &dtok);
    REQUIRE(m && d);
    static const char *const stops[] = {"happy"}, *const bans[] = {" the park", " Lily"};
    enum { N = 8 };
    static const char shared[] =
        "Once upon a time, there was a little girl named Lily. She had a big red ball. One day";
    const char *texts[N] = {shared,
                            shared,
                            shared,
                            "Tom had a red ball. Tom",
                            "The sun was",
                            "One day, a cat",
                            "Ben and Mia went to",
                            "There was a big dog"};
    exl_job_params p[N];
    for (int i = 0; i < N; i++) {
        p[i] = exl_job_default_params();
        p[i].text = texts[i];
        p[i].max_new_tokens = 90 + 7 * i;
        p[i].sampling.temperature = 0;
    }
    p[1].stop_strings = stops;
    p[1].n_stop_strings = 1;
    p[2].banned_strings = bans;
    p[2].n_banned_strings = 2;
    p[3].min_new_tokens = 40;
    p[4].ignore_eos = 1;
    p[5].no_draft = 1;
    gu_result *plain = calloc(N, sizeof *plain), *spec = calloc(N, sizeof *spec);
    const spec_cfg small = {NULL, 0, 0, 0, 0, 24}; /* 24 pages of 16 tokens for 8 jobs of about 130 */
    exl_generator_stats pst, st;
    run_jobs(m, tok, &small, p, N, plain, &pst);
    const spec_cfg cfgs[] = {{d, 4, 0, 0, 0, 24}, {d, 6, 3, 1, 0, 24}, {d, 3, 0, 0, 0, 0}};
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
        run_jobs(m, tok, &cfgs[c], p, N, spec, &st);
        char what[64];
        snprintf(what, sizeof what, "draft model config %zu", c);
        check_same(plain, spec, N, what);
        printf(
            "  config %zu: acceptance %.3f (%lld of %lld), %lld preemptions (plain: %lld), %lld rewinds, %lld prefix "
            "tokens\n",
            c, acceptance(&st), (long long)st.draft_accepted, (long long)st.draft_proposed, (long long)st.preemptions,
            (long long)pst.preemptions, (long long)st.rewinds, (long long)st.prefix_hit_tokens);
        CHECK(st.draft_accepted > 0 && (c == 2 || st.preemptions > 0));
    }
    CHECK(pst.preemptions > 0 && pst.rewinds > 0);
    free(plain);
    free(spec);
    exl_tokenizer_free(dtok);
    exl_model_free(d);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(ngram_identity_rand_llama) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("rand-llama", &tok);
    REQUIRE(m);
    exl_job_params p[N_RAND];
    rand_jobs(m->cfg.vocab_size, p);
    gu_result *plain = calloc(N_RAND, sizeof *plain), *spec = calloc(N_RAND, sizeof *spec);
    run_jobs(m, tok, NULL, p, N_RAND, plain, NULL);
    exl_generator_stats st;
    const spec_cfg cfg = {NULL, 5, 3, 0, 0, 0};
    run_jobs(m, tok, &cfg, p, N_RAND, spec, &st);
    check_same(plain, spec, N_RAND, "n-gram");
    printf("  acceptance %.3f (%lld of %lld)\n", acceptance(&st), (long long)st.draft_accepted,
           (long long)st.draft_proposed);
    CHECK(st.draft_proposed > 0);
    /* with greedy decode ahead (the default on CUDA): a step without drafts must not chain plain steps after it */
    setenv("EXL_DECODE_AHEAD", "1", 1);
    exl_generator_stats ahead;
    run_jobs(m, tok, &cfg, p, N_RAND, spec, &ahead);
    unsetenv("EXL_DECODE_AHEAD");
    check_same(plain, spec, N_RAND, "n-gram, decode ahead on");
    CHECK_MSG(ahead.draft_proposed == st.draft_proposed, "%lld drafts with decode ahead on, %lld without",
              (long long)ahead.draft_proposed, (long long)st.draft_proposed);
    free(plain);
    free(spec);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(ngram_lookup) {
    int32_t t[32] = {1, 5, 6, 7, 8, 9, 5, 6}, out[8];
    CHECK(exl_draft_ngram(t, 8, 2, 3, out) == 3 && out[0] == 7 && out[1] == 8 && out[2] == 9);
    int32_t r[16] = {1, 2, 3, 2, 3}; /* a repeating pattern: read on into the drafts */
    CHECK(exl_draft_ngram(r, 5, 2, 5, r + 5) == 5 && r[5] == 2 && r[6] == 3 && r[7] == 2 && r[9] == 2);
    int32_t u[4] = {1, 2, 3, 4};
    CHECK(exl_draft_ngram(u, 4, 3, 4, out) == 0);
    int32_t v[8] = {9, 4, 1, 2, 4}; /* the last 2 do not occur before: the last 1 does */
    CHECK(exl_draft_ngram(v, 5, 2, 2, out) == 2 && out[0] == 1 && out[1] == 2);
}

/* ---------------------------------------------------------------- distribution */

/* Two-sample chi-square over the counts a[], b[] (equal totals), bins with fewer than 10 in all merged; the
 * statistic and its degrees of freedom. */
static double chi_square(const int32_t *a, const int32_t *b, int32_t n, int32_t *df) {
    double stat = 0;
    int32_t ra = 0, rb = 0, bins = 0;
    for (int32_t i = 0; i < n; i++) {
        if (a[i] + b[i] < 10) {
            ra += a[i];
            rb += b[i];
            continue;
        }
        stat += (double)(a[i] - b[i]) * (a[i] - b[i]) / (a[i] + b[i]);
        bins++;
    }
    if (ra + rb > 0) {
        stat += (double)(ra - rb) * (ra - rb) / (ra + rb);
        bins++;
    }
    *df = bins - 1;
    return stat;
}

/* The 0.999 quantile of chi-square with df degrees of freedom (Wilson-Hilferty). */
static double chi_square_limit(int32_t df) {
    double z = 3.09, k = 2.0 / (9.0 * df), c = 1 - k + z * sqrt(k);
    return df * c * c * c;
}

/* Tokens 1 and 2 of many sampled completions, each seed once: plain sampling against speculative sampling with
 * a draft whose distribution differs from the model's (its 4-bit GPTQ version, at a higher temperature). */
EXL_TEST(speculative_sampling_keeps_the_distribution) {
    exl_tokenizer *tok, *dtok;
    exl_model *m = gu_load("tinystories-656k", &tok),
              *d = gu_load("tinystories-656k-gptq-4bit-g32-actorder-asym", &dtok);
    REQUIRE(m && d);
    REQUIRE(m->cfg.vocab_size == d->cfg.vocab_size);
    enum { RUNS = 1600, TOP = 6 };
    int32_t vocab = m->cfg.vocab_size;
    exl_job_params *p = calloc(RUNS, sizeof *p);
    gu_result *plain = calloc(RUNS, sizeof *plain), *spec = calloc(RUNS, sizeof *spec);
    int32_t *count[2][2];
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 2; t++)
            count[s][t] = calloc((size_t)vocab, sizeof(int32_t));
    REQUIRE(p && plain && spec);
    for (int i = 0; i < RUNS; i++) {
        p[i] = exl_job_default_params();
        p[i].text = "Once upon a time, there was a";
        p[i].max_new_tokens = 4;
        p[i].ignore_eos = 1;
        p[i].sampling.temperature = 1.3f;
        p[i].sampling.top_k = TOP;
        p[i].sampling.seed = (uint64_t)i + 1;
    }
    run_jobs(m, tok, NULL, p, RUNS, plain, NULL);
    for (int i = 0; i < RUNS; i++)
        p[i].sampling.seed = (uint64_t)i + 1 + RUNS; /* independent draws */
    exl_generator_stats st;
    const spec_cfg cfg = {d, 2, 0, 1, 0, 0};
    run_jobs(m, tok, &cfg, p, RUNS, spec, &st);
    gu_result *draft = calloc(RUNS, sizeof *draft); /* the test's power: the draft's own distribution differs */
    run_jobs(d, dtok, NULL, p, RUNS, draft, NULL);
    int32_t *dc = calloc((size_t)vocab, sizeof *dc), *pc = calloc((size_t)vocab, sizeof *pc);
    for (int i = 0; i < RUNS; i++) {
        dc[draft[i].ids[1]]++;
        pc[plain[i].ids[1]]++;
    }
    int32_t ddf;
    double dx = chi_square(pc, dc, vocab, &ddf);
    printf("  the draft's own token 1 against the model's: chi-square %.1f, df %d\n", dx, ddf);
    CHECK(dx > 2 * chi_square_limit(ddf));
    free(dc);
    free(pc);
    free(draft);
    for (int i = 0; i < RUNS; i++) {
        REQUIRE(plain[i].n_ids == 4 && spec[i].n_ids == 4);
        for (int t = 0; t < 2; t++) {
            count[0][t][plain[i].ids[1 + t]]++;
            count[1][t][spec[i].ids[1 + t]]++;
        }
    }
    printf("  acceptance %.3f (%lld of %lld)\n", acceptance(&st), (long long)st.draft_accepted,
           (long long)st.draft_proposed);
    CHECK(st.draft_proposed >= RUNS && st.draft_accepted > 0 && acceptance(&st) < 0.9);
    for (int t = 0; t < 2; t++) {
        int32_t df;
        double x = chi_square(count[0][t], count[1][t], vocab, &df);
        printf("  token %d: chi-square %.1f, %d degrees of freedom, 0.999 quantile %.1f\n", t + 1, x, df,
               chi_square_limit(df));
        CHECK_MSG(df >= 3 && x < chi_square_limit(df), "token %d: chi-square %.1f > %.1f (df %d)", t + 1, x,
                  chi_square_limit(df), df);
    }
    for (int s = 0; s < 2; s++)
        for (int t = 0; t < 2; t++)
            free(count[s][t]);
    free(p);
    free(plain);
    free(spec);
    exl_tokenizer_free(dtok);
    exl_model_free(d);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* ---------------------------------------------------------------- rollback */

/* The log-probabilities of the token after prompt + completion, read from the cache that decoding left: a probe
 * job on the same generator takes the sequence's pages from the prefix cache and computes one row. */
static void probe_after(exl_model *m, exl_tokenizer *tok, const spec_cfg *cfg, const int32_t *prompt, int32_t n,
                        int32_t max_new, gu_result *probe, int32_t *n_cached) {
    exl_generator_params gp = exl_generator_default_params();
    gp.n_pages = 64;
    gp.page_size = 16;
    if (cfg) {
        gp.draft_model = cfg->draft;
        gp.draft_tokens = cfg->k;
        gp.ngram = cfg->ngram;
        gp.draft_fixed = cfg->fixed;
    }
    exl_generator *g = NULL;
    if (exl_generator_init(m, tok, &gp, &g) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "generator: %s", exl_last_error());
        return;
    }
    exl_job_params p = ids_job(prompt, n, max_new);
    p.ignore_eos = 1;
    gu_result *gen = calloc(1, sizeof *gen);
    if (gu_run(g, &p, 1, gen) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "run: %s", exl_last_error());
    int32_t all[256];
    memcpy(all, prompt, (size_t)n * sizeof *all);
    memcpy(all + n, gen->ids, (size_t)gen->n_ids * sizeof *all);
    exl_job_params q = ids_job(all, n + gen->n_ids, 1);
    q.logprobs = 1;
    q.top_logprobs = 4;
    q.no_draft = 1;
    if (gu_run(g, &q, 1, probe) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "probe: %s", exl_last_error());
    *n_cached = probe->n_cached;
    exl_generator_stats st;
    exl_generator_stats_get(g, &st);
    if (cfg)
        CHECK_MSG(st.draft_accepted < st.draft_proposed && st.draft_accepted > 0, "%lld of %lld accepted",
                  (long long)st.draft_accepted, (long long)st.draft_proposed);
    free(gen);
    exl_generator_free(g);
}

EXL_TEST(rollback_leaves_the_cache_of_plain_decoding) {
    exl_tokenizer *tok, *dtok;
    exl_model *m = gu_load("rand-llama", &tok), *d = gu_load("rand-llama-exl2-5.0bpw-h8", &dtok);
    REQUIRE(m && d);
    int32_t prompt[37];
    gu_random_ids(77, prompt, 37, m->cfg.vocab_size);
    gu_result *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b), *c = calloc(1, sizeof *c);
    int32_t ca, cb, cc;
    probe_after(m, tok, NULL, prompt, 37, 90, a, &ca);
    const spec_cfg model = {d, 8, 0, 1, 0, 0}, ngram = {NULL, 6, 1, 1, 0, 0}; /* long drafts: rejections */
    probe_after(m, tok, &model, prompt, 37, 90, b, &cb);
    probe_after(m, tok, &ngram, prompt, 37, 90, c, &cc);
    /* the probe computed its last token alone: everything before came from the cache decoding wrote */
    CHECK_MSG(ca == 37 + 90 - 1 && cb == ca && cc == ca, "cached %d, %d, %d", ca, cb, cc);
    REQUIRE(a->n_ids == 1 && b->n_ids == 1 && c->n_ids == 1);
    double worst = 0;
    for (int t = 0; t < 4; t++) {
        CHECK(a->top[t].id == b->top[t].id && a->top[t].id == c->top[t].id);
        worst = fmax(worst,
                     fmax(fabs(a->top[t].logprob - b->top[t].logprob), fabs(a->top[t].logprob - c->top[t].logprob)));
    }
    printf("  largest log-probability difference %.3g\n", worst);
    CHECK(worst <= 1e-4);
    free(a);
    free(b);
    free(c);
    exl_tokenizer_free(dtok);
    exl_model_free(d);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* ---------------------------------------------------------------- allocation failures */

/* Every allocation of a drafting generator's life failing in turn: an EXL_ERR_NOMEM, never a crash or a leak, and
 * the jobs end. */
EXL_TEST(allocation_failures) {
    exl_tokenizer *tok, *dtok;
    exl_model *m = gu_load("tinystories-656k", &tok),
              *d = gu_load("tinystories-656k-gptq-4bit-g32-actorder-asym", &dtok);
    REQUIRE(m && d);
    exl_job_params p[2] = {exl_job_default_params(), exl_job_default_params()};
    p[0].text = "Tom had a red ball. Tom had a red ball. Tom";
    p[0].max_new_tokens = 20;
    p[0].sampling.temperature = 0;
    p[1].text = "Once upon a time";
    p[1].max_new_tokens = 12;
    p[1].sampling.top_k = 20;
    int completed = 0, in_steps = 0; /* failures that landed in a step (after init and submit) */
    for (long n = 0; n < 450; n++) {
        exl_generator_params gp = exl_generator_default_params();
        gp.n_pages = 8;
        gp.page_size = 8;
        gp.draft_model = d;
        gp.draft_tokens = 4;
        gp.ngram = 2;
        exl_generator *g = NULL;
        exl_alloc_fail_after(n);
        exl_status st = exl_generator_init(m, tok, &gp, &g);
        uint64_t id;
        for (int i = 0; i < 2 && st == EXL_OK; i++)
            st = exl_generator_submit(g, &p[i], &id);
        int done = 0;
        for (int s = 0; st != EXL_ERR_ARG && g && s < 200 && exl_generator_pending(g) > 0; s++) {
            const exl_gen_event *ev;
            int32_t k;
            st = exl_generator_step(g, &ev, &k);
            CHECK_MSG(st == EXL_OK || st == EXL_ERR_NOMEM, "failing allocation %ld: %s", n, exl_last_error());
            in_steps += st == EXL_ERR_NOMEM;
            for (int32_t e = 0; e < k; e++)
                done += ev[e].finish != EXL_FINISH_NONE;
        }
        exl_alloc_fail_after(-1);
        CHECK_MSG(!g || exl_generator_pending(g) == 0, "failing allocation %ld: a job never ended", n);
        completed += done;
        exl_generator_free(g);
    }
    printf("  %d jobs completed, %d steps failed\n", completed, in_steps);
    CHECK(completed > 100 && in_steps > 10);
    exl_tokenizer_free(dtok);
    exl_model_free(d);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* ---------------------------------------------------------------- the command line */

static int run_cli(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    return pclose(p);
}

/* The "tokens" array of exl run --json's line (its text from '[' to ']'). */
static const char *tokens_of(const char *json, char *out, size_t cap) {
    const char *a = strstr(json, "\"tokens\":["), *b = a ? strchr(a, ']') : NULL;
    snprintf(out, cap, "%.*s", a && b ? (int)(b - a) : 0, a ? a : "");
    return out;
}

EXL_TEST(run_reports_drafts) {
    char cmd[4096], plain[16384], spec[16384], stats[16384], a[8192], b[8192];
    const char *dir = exl_test_shared("models/tinystories-656k");
    snprintf(cmd, sizeof cmd, "%s run -m %s --device cpu --greedy -n 80 -p 'Once upon a time' --json 2>/dev/null",
             EXL_CLI_PATH, dir);
    CHECK(run_cli(cmd, plain, sizeof plain) == 0);
    snprintf(cmd, sizeof cmd,
             "%s run -m %s --device cpu --greedy -n 80 -p 'Once upon a time' --json --ngram 3 --draft-model %s "
             "2>/dev/null",
             EXL_CLI_PATH, dir, dir);
    CHECK(run_cli(cmd, spec, sizeof spec) == 0);
    CHECK_MSG(!strcmp(tokens_of(plain, a, sizeof a), tokens_of(spec, b, sizeof b)) && strlen(a) > 20,
              "plain %s\ndrafted %s", plain, spec);
    CHECK_MSG(strstr(spec, "\"draft_proposed\":") && strstr(spec, "\"draft_accepted\":") &&
                  !strstr(plain, "draft_proposed"),
              "%s", spec);
    snprintf(cmd, sizeof cmd, "%s run -m %s --device cpu --greedy -n 40 -p 'Once' --ngram 2 --stats 2>&1 >/dev/null",
             EXL_CLI_PATH, dir);
    CHECK(run_cli(cmd, stats, sizeof stats) == 0);
    CHECK_MSG(strstr(stats, "proposed") && strstr(stats, "acceptance rate"), "%s", stats);
    snprintf(cmd, sizeof cmd, "%s run -m %s --device cpu -p x --draft-tokens 3 2>&1", EXL_CLI_PATH, dir);
    CHECK(run_cli(cmd, stats, sizeof stats) != 0 && strstr(stats, "--draft-tokens needs"));
}
