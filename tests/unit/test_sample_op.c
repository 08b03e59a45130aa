/* test_sample_op.c - the backends' sample op (here the CPU's, the reference) against the host sampler: on reference
 * logits of a trained and a random model and on a wide random vocabulary, for each setting the server accepts and
 * several seeds, the op picks the host's token, uses the random number exactly when the host draws, and reports the
 * host's log-probability; and the generator gives the same tokens with sampling on the backend as on the host. */
#include "backend/backend.h"
#include "gen_util.h"
#include "generator/sampler.h"
#include "io/safetensors.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAX_EDITS 4096

/* A row to sample: logits plus the history and bans the generator would pass. */
typedef struct op_case {
    exl_sampling s;
    const int32_t *history;
    int32_t n_history;
    const int32_t *banned;
    int32_t n_banned;
} op_case;

/* The op's params and edits for a case, built as the generator builds them (device_sample.c). */
static void build_row(const op_case *c, int32_t vocab, double u, exl_sample_params *p, exl_logit_edit *e,
                      int32_t *n_edits) {
    const exl_sampling *s = &c->s;
    *p = (exl_sample_params){.temperature = s->temperature,
                             .top_k = s->top_k,
                             .top_p = s->top_p,
                             .min_p = s->min_p,
                             .typical_p = s->typical_p,
                             .repetition_penalty = s->repetition_penalty,
                             .frequency_penalty = s->frequency_penalty,
                             .presence_penalty = s->presence_penalty,
                             .first_edit = *n_edits,
                             .want_logprob = 1,
                             .u = u};
    for (int32_t i = 0; i < s->n_logit_bias; i++)
        e[(*n_edits)++] = (exl_logit_edit){s->logit_bias[i].id, s->logit_bias[i].bias};
    p->n_bias = s->n_logit_bias;
    int32_t *counts = calloc((size_t)vocab, sizeof *counts);
    const int32_t *h = c->history;
    int32_t nh = c->n_history;
    if (s->penalty_range > 0 && nh > s->penalty_range) {
        h += nh - s->penalty_range;
        nh = s->penalty_range;
    }
    int penalize = s->repetition_penalty != 1.0f || s->frequency_penalty != 0.0f || s->presence_penalty != 0.0f;
    for (int32_t i = 0; penalize && i < nh; i++)
        counts[h[i]]++;
    for (int32_t i = 0; penalize && i < nh; i++)
        if (counts[h[i]]) {
            e[(*n_edits)++] = (exl_logit_edit){h[i], (float)counts[h[i]]};
            p->n_penalized++;
            counts[h[i]] = 0;
        }
    free(counts);
    for (int32_t i = 0; i < c->n_banned; i++)
        e[(*n_edits)++] = (exl_logit_edit){c->banned[i], 0};
    p->n_banned = c->n_banned;
}

static float lse_of(const float *x, int32_t vocab) {
    float m = -INFINITY;
    for (int32_t i = 0; i < vocab; i++)
        m = x[i] > m ? x[i] : m;
    double sum = 0;
    for (int32_t i = 0; i < vocab; i++)
        sum += exp((double)x[i] - m);
    return m + (float)log(sum);
}

typedef struct op_tally {
    int rows, differ, stream_differ, lp_differ;
} op_tally;

/* One case on one row of logits with one seed: host sampler against the op. */
static void compare_row(exl_backend *be, const op_case *c, const float *logits, int32_t vocab, uint64_t seed,
                        exl_sampler_scratch *scratch, op_tally *t) {
    float *host = malloc((size_t)vocab * sizeof *host), *dev = malloc((size_t)vocab * sizeof *dev);
    exl_logit_edit *edits = malloc(MAX_EDITS * sizeof *edits);
    memcpy(host, logits, (size_t)vocab * sizeof *host);
    memcpy(dev, logits, (size_t)vocab * sizeof *dev);
    exl_sampling s = c->s;
    s.seed = seed;
    exl_sampler_state hs, ds;
    exl_sampler_init(&hs, &s);
    ds = hs;
    for (int32_t i = 0; i < c->n_banned; i++) /* as sample_job bans tokens */
        host[c->banned[i]] = -INFINITY;
    int32_t want = exl_sampler_sample(&s, &hs, host, vocab, c->history, c->n_history, scratch);
    exl_sample_params p;
    int32_t n_edits = 0;
    exl_sampler_state peek = ds;
    build_row(c, vocab, exl_sampler_uniform(&peek), &p, edits, &n_edits);
    exl_sample_result r;
    exl_status st = be->ops->sample(be, &r, dev, 1, vocab, &p, edits, n_edits);
    CHECK_MSG(st == EXL_OK, "sample: %s", exl_last_error());
    if (r.n_kept > 1)
        ds = peek;
    t->rows++;
    t->differ += r.id != want;
    t->stream_differ += memcmp(hs.rng, ds.rng, sizeof hs.rng) != 0;
    if (want >= 0 && r.id == want)
        t->lp_differ += fabsf(r.logprob - (logits[want] - lse_of(logits, vocab))) > 1e-4f;
    free(host);
    free(dev);
    free(edits);
}

static exl_sampling base_sampling(void) { return exl_sampling_default(); }

/* The settings the server accepts, alone and together. */
static int32_t make_cases(op_case *cases, const int32_t *history, int32_t n_history, const int32_t *banned,
                          int32_t n_banned, const exl_logit_bias *bias, int32_t n_bias) {
    int32_t n = 0;
    exl_sampling s;
    memset(cases, 0, 16 * sizeof *cases);
    s = base_sampling(), s.temperature = 0, cases[n++].s = s;
    s = base_sampling(), cases[n++].s = s;
    s = base_sampling(), s.temperature = 0.8f, s.top_p = 0.95f, cases[n++].s = s;
    s = base_sampling(), s.top_p = 0.5f, cases[n++].s = s;
    s = base_sampling(), s.temperature = 1.3f, s.top_k = 40, cases[n++].s = s;
    s = base_sampling(), s.temperature = 0.7f, s.top_k = 50, s.top_p = 0.9f, s.min_p = 0.05f, cases[n++].s = s;
    s = base_sampling(), s.min_p = 0.1f, cases[n++].s = s;
    s = base_sampling(), s.typical_p = 0.9f, cases[n++].s = s;
    s = base_sampling(), s.top_p = 0.9f, s.typical_p = 0.5f, cases[n++].s = s;
    s = base_sampling(), s.temperature = 0.9f, s.repetition_penalty = 1.3f, s.frequency_penalty = 0.5f;
    s.presence_penalty = 0.4f, s.penalty_range = 64, cases[n++].s = s;
    s = base_sampling(), s.temperature = 0, s.repetition_penalty = 1.5f, cases[n++].s = s;
    s = base_sampling(), s.top_p = 0.95f, s.logit_bias = bias, s.n_logit_bias = n_bias, cases[n++].s = s;
    for (int32_t i = 0; i < n; i++) {
        cases[i].history = history;
        cases[i].n_history = n_history;
    }
    cases[n] = cases[n - 1]; /* and with bans */
    cases[n].banned = banned;
    cases[n++].n_banned = n_banned;
    return n;
}

/* Every case on rows [0, rows) of logits (row-major), seeds 1..n_seeds. */
static void compare_rows(const float *logits, int32_t rows, int32_t vocab, int n_seeds, const char *what) {
    exl_backend *be;
    REQUIRE(exl_backend_cpu_init(2, &be) == EXL_OK);
    REQUIRE(be->ops->sample != NULL);
    exl_sampler_scratch scratch;
    REQUIRE(exl_sampler_scratch_init(&scratch, vocab) == EXL_OK);
    int32_t history[200], banned[3];
    gu_random_ids(7, history, 200, vocab);
    exl_logit_bias bias[3];
    op_case cases[16];
    op_tally t = {0};
    for (int32_t r = 0; r < rows; r++) {
        const float *row = logits + (size_t)r * vocab;
        /* bias and bans on the row's own likely tokens, so that they matter */
        int32_t top = 0;
        for (int32_t i = 1; i < vocab; i++)
            top = row[i] > row[top] ? i : top;
        banned[0] = top, banned[1] = (top + 1) % vocab, banned[2] = (top + 7) % vocab;
        bias[0] = (exl_logit_bias){top, -2.5f}, bias[1] = (exl_logit_bias){(top + 3) % vocab, 3.0f};
        bias[2] = (exl_logit_bias){(top + 3) % vocab, 0.5f};
        history[199] = top;
        int32_t n_cases = make_cases(cases, history, 200, banned, 3, bias, 3);
        for (int32_t ci = 0; ci < n_cases; ci++)
            for (int seed = 1; seed <= n_seeds; seed++)
                compare_row(be, &cases[ci], row, vocab, (uint64_t)seed * 7919u + (uint64_t)r, &scratch, &t);
    }
    printf("  %s: %d draws, %d other tokens, %d other random streams, %d other log-probabilities\n", what, t.rows,
           t.differ, t.stream_differ, t.lp_differ);
    CHECK_MSG(t.differ == 0 && t.stream_differ == 0 && t.lp_differ == 0,
              "%s: the op and the host sampler disagree (%d tokens, %d streams, %d log-probabilities of %d)", what,
              t.differ, t.stream_differ, t.lp_differ, t.rows);
    exl_sampler_scratch_free(&scratch);
    be->ops->destroy(be);
}

static void compare_reference(const char *file, const char *key, int n_seeds) {
    exl_st_file *f;
    REQUIRE(exl_st_open(exl_test_shared(file), &f) == EXL_OK);
    const exl_st_tensor *lg = exl_st_find(f, key);
    REQUIRE(lg && lg->dtype == EXL_DTYPE_F32);
    int32_t rows = (int32_t)lg->shape[0], vocab = (int32_t)lg->shape[1];
    compare_rows(lg->data, rows < 24 ? rows : 24, vocab, n_seeds, file);
    exl_st_close(f);
}

EXL_TEST(op_matches_host_on_a_trained_model) {
    compare_reference("reference/tinystories-656k.logits.safetensors", "logits_0", 6);
}

EXL_TEST(op_matches_host_on_a_random_model) {
    compare_reference("reference/rand-llama.logits.safetensors", "logits_a", 6);
}

EXL_TEST(op_matches_host_on_a_wide_vocabulary) {
    const int32_t vocab = 128256, rows = 3;
    float *logits = malloc((size_t)rows * vocab * sizeof *logits);
    uint64_t x = 12345;
    for (int32_t i = 0; i < rows * vocab; i++) { /* sums of uniforms: roughly normal, spread like a model's */
        double v = 0;
        for (int k = 0; k < 4; k++) {
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            v += (double)(x >> 11) * 0x1.0p-53;
        }
        logits[i] = (float)((v - 2) * (i / vocab + 2));
    }
    logits[vocab + 5] = logits[vocab + 9] = 40; /* a tie at the top */
    logits[vocab + 11] = 39.5f;
    compare_rows(logits, rows, vocab, 1, "128k vocabulary");
    free(logits);
}

/* The generator on the CPU, sampled on the backend and on the host: same tokens and log-probabilities. */
EXL_TEST(generator_same_tokens_either_way) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    exl_job_params p[6];
    exl_logit_bias bias[1] = {{13, 2.0f}};
    int32_t prompt[6][12];
    for (int i = 0; i < 6; i++) {
        gu_random_ids(100 + (uint64_t)i, prompt[i], 12, 2048);
        p[i] = exl_job_default_params();
        p[i].ids = prompt[i];
        p[i].n_ids = 12;
        p[i].max_new_tokens = 40;
        p[i].sampling.seed = 1000 + (uint64_t)i;
    }
    p[0].sampling.temperature = 0.8f, p[0].sampling.top_p = 0.95f, p[0].logprobs = 1;
    p[1].sampling.top_k = 20, p[1].sampling.min_p = 0.05f;
    p[2].sampling.repetition_penalty = 1.4f, p[2].sampling.frequency_penalty = 0.3f;
    p[2].sampling.presence_penalty = 0.2f, p[2].sampling.penalty_range = 16;
    p[3].sampling.typical_p = 0.8f, p[3].sampling.logit_bias = bias, p[3].sampling.n_logit_bias = 1;
    p[4].sampling.temperature = 1.5f, p[4].min_new_tokens = 30, p[4].logprobs = 1;
    p[5].sampling.temperature = 0.6f, p[5].banned_strings = (const char *const[]){"the"}, p[5].n_banned_strings = 1;
    gu_result *a = calloc(6, sizeof *a), *b = calloc(6, sizeof *b);
    for (int pass = 0; pass < 2; pass++) {
        setenv("EXL_DEVICE_SAMPLING", pass ? "1" : "0", 1);
        exl_generator *g = gu_generator(m, tok, 0, 0, 0);
        REQUIRE(g);
        CHECK(gu_run(g, p, 6, pass ? b : a) == EXL_OK);
        exl_generator_free(g);
    }
    unsetenv("EXL_DEVICE_SAMPLING");
    for (int i = 0; i < 6; i++) {
        CHECK_MSG(a[i].n_ids == b[i].n_ids && !memcmp(a[i].ids, b[i].ids, (size_t)a[i].n_ids * sizeof(int32_t)),
                  "job %d: %d tokens on the host, %d on the backend, or other tokens", i, a[i].n_ids, b[i].n_ids);
        for (int32_t k = 0; p[i].logprobs && k < a[i].n_ids && k < b[i].n_ids; k++)
            CHECK_MSG(fabsf(a[i].lp[k] - b[i].lp[k]) < 1e-4f, "job %d token %d: log-probability %g, not %g", i, k,
                      b[i].lp[k], a[i].lp[k]);
    }
    free(a);
    free(b);
    exl_model_free(m);
    exl_tokenizer_free(tok);
}
