/* test_sampler.c - the sampler on hand-made logits: each filter keeps exactly the
 * expected set, draws follow the expected distribution (fixed seeds, 40000 draws,
 * tolerance 0.012 = ~5 sigma), penalties and bias change the right logits, Mirostat
 * holds its target surprise, and a seed fixes the draws. */
#include "generator/sampler.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define DRAWS 40000
#define TOL 0.012

static exl_sampler_scratch scratch_for(int32_t vocab) {
    exl_sampler_scratch s;
    if (exl_sampler_scratch_init(&s, vocab) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "scratch");
    return s;
}

static void set_logprobs(float *logits, const double *p, int n) {
    for (int i = 0; i < n; i++)
        logits[i] = p[i] > 0 ? (float)log(p[i]) : -INFINITY;
}

/* The ids the filters keep, as a bit mask (vocab <= 64). */
static uint64_t kept(const exl_sampling *p, const float *logits, int32_t vocab) {
    exl_sampler_scratch s = scratch_for(vocab);
    exl_sampler_state st;
    exl_sampler_init(&st, p);
    int32_t n = exl_sampler_filter(p, &st, logits, vocab, &s);
    uint64_t mask = 0;
    for (int32_t i = 0; i < n; i++)
        mask |= 1ull << s.cand[i].id;
    exl_sampler_scratch_free(&s);
    return mask;
}

/* Draw DRAWS times from logits (copied each time) and compare the frequencies. */
static void check_distribution(const exl_sampling *p, const float *logits, int32_t vocab, const double *want,
                               const char *what) {
    exl_sampler_scratch s = scratch_for(vocab);
    exl_sampler_state st;
    exl_sampler_init(&st, p);
    float work[64];
    int counts[64] = {0};
    for (int d = 0; d < DRAWS; d++) {
        memcpy(work, logits, (size_t)vocab * sizeof *work);
        int32_t id = exl_sampler_sample(p, &st, work, vocab, NULL, 0, &s);
        if (id >= 0 && id < vocab)
            counts[id]++;
    }
    for (int32_t i = 0; i < vocab; i++) {
        double f = (double)counts[i] / DRAWS;
        CHECK_MSG(fabs(f - want[i]) < TOL, "%s: token %d drawn %.4f of the time, expected %.4f", what, i, f, want[i]);
    }
    exl_sampler_scratch_free(&s);
}

static const double base_p[4] = {0.4, 0.3, 0.2, 0.1};

EXL_TEST(greedy) {
    float logits[6] = {1, 3, -2, 3, 0, -INFINITY};
    exl_sampling p = exl_sampling_default();
    p.temperature = 0;
    exl_sampler_scratch s = scratch_for(6);
    exl_sampler_state st;
    exl_sampler_init(&st, &p);
    CHECK(exl_sampler_sample(&p, &st, logits, 6, NULL, 0, &s) == 1); /* ties: lowest id */
    for (int i = 0; i < 6; i++)
        logits[i] = -INFINITY;
    CHECK(exl_sampler_sample(&p, &st, logits, 6, NULL, 0, &s) == -1);
    exl_sampler_scratch_free(&s);
}

EXL_TEST(bias_and_penalties) {
    exl_sampling p = exl_sampling_default();
    exl_logit_bias bias[2] = {{0, 1.5f}, {4, -INFINITY}};
    p.logit_bias = bias;
    p.n_logit_bias = 2;
    p.repetition_penalty = 2.0f;
    p.frequency_penalty = 0.5f;
    p.presence_penalty = 0.25f;
    float l[6] = {1, 2, -2, 4, 3, 1};
    const int32_t history[] = {3, 1, 2, 1, 3, 3}; /* 3 x3, 1 x2, 2 x1 */
    exl_sampler_scratch s = scratch_for(6);
    exl_sampler_process(&p, l, 6, history, 6, &s);
    CHECK(l[0] == 2.5f);                     /* bias only */
    CHECK(l[1] == 2.0f / 2 - 1.0f - 0.25f);  /* positive: divided */
    CHECK(l[2] == -2.0f * 2 - 0.5f - 0.25f); /* negative: multiplied */
    CHECK(l[3] == 4.0f / 2 - 1.5f - 0.25f);
    CHECK(l[4] == -INFINITY && l[5] == 1.0f);
    for (int i = 0; i < 6; i++)
        CHECK(s.counts[i] == 0); /* the scratch is left clean */
    /* a range of 2 sees only the last two tokens (3, 3) */
    float r[6] = {1, 2, -2, 4, 3, 1};
    p.n_logit_bias = 0;
    p.penalty_range = 2;
    exl_sampler_process(&p, r, 6, history, 6, &s);
    CHECK(r[1] == 2.0f && r[2] == -2.0f && r[3] == 4.0f / 2 - 1.0f - 0.25f);
    exl_sampler_scratch_free(&s);
}

EXL_TEST(filters_keep_the_right_sets) {
    float l[4];
    set_logprobs(l, base_p, 4);
    exl_sampling p = exl_sampling_default();
    p.top_k = 2;
    CHECK(kept(&p, l, 4) == 0x3);
    p = exl_sampling_default();
    p.top_p = 0.65f; /* 0.4 + 0.3 reaches it */
    CHECK(kept(&p, l, 4) == 0x3);
    p.top_p = 0.75f;
    CHECK(kept(&p, l, 4) == 0x7);
    p = exl_sampling_default();
    p.min_p = 0.5f; /* >= 0.2 */
    CHECK(kept(&p, l, 4) == 0x7);
    /* typical: with [0.4, 0.2, 0.2, 0.2] the three 0.2 tokens are closer to the entropy */
    static const double typ[4] = {0.4, 0.2, 0.2, 0.2};
    set_logprobs(l, typ, 4);
    p = exl_sampling_default();
    p.typical_p = 0.5f;
    CHECK(kept(&p, l, 4) == 0xe);
    /* tail-free on [0.5, 0.3, 0.1, 0.05, 0.05]: |2nd differences| 0, 0.15, 0.05 -> 0, 0.75, 1 */
    static const double tf[5] = {0.5, 0.3, 0.1, 0.05, 0.05};
    float lt[5];
    set_logprobs(lt, tf, 5);
    p = exl_sampling_default();
    p.tfs_z = 0.5f;
    CHECK(kept(&p, lt, 5) == 0x3);
    p.tfs_z = 0.9f;
    CHECK(kept(&p, lt, 5) == 0x7);
    /* temperature does not change the order, only the weights */
    set_logprobs(l, base_p, 4);
    p = exl_sampling_default();
    p.temperature = 0.3f;
    p.top_k = 3;
    CHECK(kept(&p, l, 4) == 0x7);
}

EXL_TEST(distributions) {
    float l[4];
    set_logprobs(l, base_p, 4);
    exl_sampling p = exl_sampling_default();
    p.seed = 1;
    check_distribution(&p, l, 4, base_p, "plain");
    p.top_k = 3;
    static const double k3[4] = {0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0};
    check_distribution(&p, l, 4, k3, "top-k 3");
    p = exl_sampling_default();
    p.seed = 2;
    p.temperature = 0.5f; /* p^2, normalized */
    static const double t05[4] = {0.16 / 0.30, 0.09 / 0.30, 0.04 / 0.30, 0.01 / 0.30};
    check_distribution(&p, l, 4, t05, "temperature 0.5");
    p = exl_sampling_default();
    p.seed = 3;
    p.top_p = 0.65f;
    static const double p2[4] = {4.0 / 7, 3.0 / 7, 0, 0};
    check_distribution(&p, l, 4, p2, "top-p 0.65");
    p = exl_sampling_default();
    p.seed = 4;
    p.min_p = 0.6f;
    check_distribution(&p, l, 4, p2, "min-p 0.6");
    static const double typ[4] = {0.4, 0.2, 0.2, 0.2};
    set_logprobs(l, typ, 4);
    p = exl_sampling_default();
    p.seed = 5;
    p.typical_p = 0.5f;
    static const double third[4] = {0, 1.0 / 3, 1.0 / 3, 1.0 / 3};
    check_distribution(&p, l, 4, third, "typical 0.5");
    static const double tf[5] = {0.5, 0.3, 0.1, 0.05, 0.05};
    float lt[5];
    set_logprobs(lt, tf, 5);
    p = exl_sampling_default();
    p.seed = 6;
    p.tfs_z = 0.5f;
    static const double tf2[5] = {0.625, 0.375, 0, 0, 0};
    check_distribution(&p, lt, 5, tf2, "tail-free 0.5");
}

/* Mirostat v2 on a Zipf distribution over 1000 tokens settles near its target surprise. */
EXL_TEST(mirostat_holds_target) {
    enum { V = 1000 };
    float logits[V], work[V];
    for (int i = 0; i < V; i++)
        logits[i] = -1.1f * logf((float)(i + 1));
    exl_sampling p = exl_sampling_default();
    p.mirostat = 2;
    p.mirostat_tau = 4.0f;
    p.mirostat_eta = 0.1f;
    p.seed = 9;
    exl_sampler_scratch s = scratch_for(V);
    exl_sampler_state st;
    exl_sampler_init(&st, &p);
    CHECK(st.mu == 8.0f);
    double sum = 0;
    int n = 0;
    for (int d = 0; d < 4000; d++) {
        memcpy(work, logits, sizeof work);
        int32_t k = exl_sampler_filter(&p, &st, work, V, &s);
        double total = 0, chosen = 0;
        int32_t id = exl_sampler_draw(&p, &st, &s, k);
        for (int32_t i = 0; i < k; i++) {
            total += s.cand[i].p;
            if (s.cand[i].id == id)
                chosen = s.cand[i].p;
        }
        if (d >= 1000) {
            sum += -log2(chosen / total);
            n++;
        }
    }
    CHECK_MSG(fabs(sum / n - 4.0) < 0.25, "mean surprise %.3f, target 4", sum / n);
    exl_sampler_scratch_free(&s);
}

/* top-p's partial sort and top-k's selection against a full sort, on a large vocabulary. */
static int by_logit_desc(const void *a, const void *b, void *ctx) {
    const float *l = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    if (l[x] != l[y])
        return l[x] > l[y] ? -1 : 1;
    return x - y;
}

EXL_TEST(large_vocabulary_against_full_sort) {
    enum { V = 50000 };
    float *l = malloc(V * sizeof *l);
    int32_t *order = malloc(V * sizeof *order);
    uint64_t x = 12345;
    for (int i = 0; i < V; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        l[i] = (float)(x % 1000) / 100.0f; /* many ties */
        order[i] = i;
    }
    qsort_r(order, V, sizeof *order, by_logit_desc, l);
    exl_sampler_scratch s = scratch_for(V);
    exl_sampler_state st;
    exl_sampling p = exl_sampling_default();
    exl_sampler_init(&st, &p);
    p.top_k = 777;
    int32_t n = exl_sampler_filter(&p, &st, l, V, &s);
    REQUIRE(n == 777);
    for (int i = 0; i < n; i++)
        CHECK(s.cand[i].id == order[i]);
    p = exl_sampling_default();
    p.top_p = 0.3f;
    n = exl_sampler_filter(&p, &st, l, V, &s);
    double total = 0, cum = 0, m = l[order[0]];
    for (int i = 0; i < V; i++)
        total += exp(l[i] - m);
    int want = 0;
    while (cum < 0.3 * total)
        cum += exp(l[order[want++]] - m);
    CHECK_MSG(abs(n - want) <= 1, "top-p kept %d, full sort says %d", n, want);
    for (int i = 0; i < n && i < want; i++)
        CHECK(s.cand[i].id == order[i]);
    exl_sampler_scratch_free(&s);
    free(l);
    free(order);
}

EXL_TEST(seed_fixes_the_draws) {
    float l[4];
    set_logprobs(l, base_p, 4);
    exl_sampling p = exl_sampling_default();
    exl_sampler_scratch s = scratch_for(4);
    int32_t a[64], b[64], c[64];
    for (int run = 0; run < 3; run++) {
        p.seed = run == 2 ? 43 : 42;
        exl_sampler_state st;
        exl_sampler_init(&st, &p);
        for (int i = 0; i < 64; i++) {
            float w[4];
            memcpy(w, l, sizeof w);
            (run == 0 ? a : run == 1 ? b : c)[i] = exl_sampler_sample(&p, &st, w, 4, NULL, 0, &s);
        }
    }
    CHECK(!memcmp(a, b, sizeof a));
    CHECK(memcmp(a, c, sizeof a) != 0);
    exl_sampler_state st;
    exl_sampler_init(&st, &p);
    double u = 0;
    for (int i = 0; i < 1000; i++) {
        double v = exl_sampler_uniform(&st);
        CHECK(v >= 0 && v < 1);
        u += v;
    }
    CHECK(fabs(u / 1000 - 0.5) < 0.05);
    exl_sampler_scratch_free(&s);
}

/* A row masked by a constraint (-inf scattered over the vocabulary) draws as the allowed tokens alone
 * would, in id order: the same candidates, weights and random-stream use, for each filter. */
EXL_TEST(masked_row_draws_as_the_allowed_tokens) {
    enum { V = 4000 };
    float *full = malloc(V * sizeof *full), *allowed = malloc(V * sizeof *allowed), *work = malloc(V * sizeof *work);
    int32_t *id_of = malloc(V * sizeof *id_of), n = 0;
    uint64_t x = 7;
    for (int32_t i = 0; i < V; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        full[i] = (float)((x >> 40) % 1024) / 128.0f - 4.0f;
        if ((x >> 20) % 3 == 0) { /* a third allowed, in no pattern */
            id_of[n] = i;
            allowed[n++] = full[i];
        } else {
            full[i] = -INFINITY;
        }
    }
    exl_sampler_scratch s = scratch_for(V);
    for (int setting = 0; setting < 4; setting++) {
        exl_sampling p = exl_sampling_default();
        p.seed = (uint64_t)setting;
        if (setting == 1)
            p.top_p = 0.8f;
        else if (setting == 2)
            p.min_p = 0.1f, p.temperature = 0.7f;
        else if (setting == 3)
            p.top_k = 2000; /* more than the tokens allowed: every finite logit */
        exl_sampler_state a, b;
        exl_sampler_init(&a, &p);
        exl_sampler_init(&b, &p);
        for (int d = 0; d < 200; d++) {
            memcpy(work, full, V * sizeof *work);
            int32_t got = exl_sampler_sample(&p, &a, work, V, NULL, 0, &s);
            memcpy(work, allowed, (size_t)n * sizeof *work);
            int32_t want = exl_sampler_sample(&p, &b, work, n, NULL, 0, &s);
            REQUIRE(want >= 0 && want < n);
            CHECK_MSG(got == id_of[want], "setting %d draw %d: token %d, the allowed tokens alone give %d", setting, d,
                      got, id_of[want]);
        }
    }
    exl_sampler_scratch_free(&s);
    free(full);
    free(allowed);
    free(work);
    free(id_of);
}

/* ---- the head path (a backend selects the largest logits, the host finishes): for every
 * setting it takes, the same token and the same random-stream use as the full logits */

static int head_order(const void *a, const void *b) {
    const exl_candidate *x = a, *y = b;
    if (x->p != y->p)
        return x->p > y->p ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

EXL_TEST(head_path_matches_full_logits) {
    enum { V = 3000, K = 64 };
    exl_sampler_scratch s = scratch_for(V), s2 = scratch_for(V);
    float *logits = malloc(V * sizeof *logits), *work = malloc(V * sizeof *work);
    exl_candidate *sorted = malloc(V * sizeof *sorted);
    int32_t ids[K];
    float vals[K];
    uint64_t x = 42;
    int settings = 0, draws = 0;
    for (int round = 0; round < 40; round++) {
        for (int32_t i = 0; i < V; i++) { /* coarse values: many ties, also at the k-th place */
            x = x * 6364136223846793005ull + 1442695040888963407ull;
            logits[i] = (float)((x >> 40) % 64) * 0.25f - 8.0f;
        }
        for (int32_t i = 0; i < V; i++)
            sorted[i] = (exl_candidate){i, logits[i]};
        qsort(sorted, V, sizeof *sorted, head_order);
        for (int32_t i = 0; i < K; i++)
            ids[i] = sorted[i].id, vals[i] = sorted[i].p;
        exl_sampling p = exl_sampling_default();
        p.seed = (uint64_t)round;
        switch (round % 5) {
        case 0: p.temperature = 0; break;
        case 1: p.top_k = 1 + round % 64, p.temperature = 0.7f; break;
        case 2: p.top_k = 40, p.top_p = 0.9f, p.min_p = 0.05f; break;
        case 3: p.top_k = 64, p.typical_p = 0.8f; break;
        default: p.top_k = 20, p.tfs_z = 0.95f, p.temperature = 1.5f; break;
        }
        CHECK(exl_sampler_head_size(&p, V, K) > 0);
        exl_sampler_state a, b;
        exl_sampler_init(&a, &p);
        exl_sampler_init(&b, &p);
        for (int d = 0; d < 20; d++, draws++) {
            memcpy(work, logits, V * sizeof *work);
            int32_t full = exl_sampler_sample(&p, &a, work, V, NULL, 0, &s);
            int32_t head = exl_sampler_sample_head(&p, &b, ids, vals, &s2);
            CHECK_MSG(full == head, "round %d draw %d: full logits give %d, the head %d", round, d, full, head);
        }
        CHECK(!memcmp(a.rng, b.rng, sizeof a.rng));
        settings++;
    }
    /* settings that need the full logits */
    exl_sampling p = exl_sampling_default();
    p.repetition_penalty = 1.1f;
    CHECK(exl_sampler_head_size(&p, V, K) == 0);
    p = exl_sampling_default();
    p.top_k = 0;
    CHECK(exl_sampler_head_size(&p, V, K) == 0);
    p.top_k = K + 1;
    CHECK(exl_sampler_head_size(&p, V, K) == 0);
    p = exl_sampling_default();
    p.mirostat = 2;
    CHECK(exl_sampler_head_size(&p, V, K) == 0);
    printf("    %d settings, %d draws: head path == full logits\n", settings, draws);
    free(logits);
    free(work);
    free(sorted);
    exl_sampler_scratch_free(&s);
    exl_sampler_scratch_free(&s2);
}
