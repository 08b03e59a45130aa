/* spec_bench.c - speculative decoding's speed against plain decoding, one greedy job decoding alone, every variant
 * in one process.
 * usage: spec_bench MODEL DRAFT [NEW_TOKENS] [cpu|cuda]
 * Rows (a Markdown table on stdout): plain decoding; the model drafting for itself (a second copy) at K = 1..8;
 * DRAFT, whose proposals the test-only hook EXL_SPEC_TEST_ORACLE / EXL_SPEC_TEST_ALPHA (src/generator/draft_oracle.c)
 * replaces to agree with plain decoding's tokens with probability alpha, at alpha 0.5, 0.7, 0.8, 0.9, 1.0 and
 * K = 2, 4, 8 (fixed) and adaptive K <= 8; n-gram drafting on a prompt asking to repeat a passage (against plain
 * decoding of that prompt). tok/s is decode only: from the first generated token to the last, the best of two runs.
 * Each row says whether its tokens are plain decoding's. */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include "exl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_NEW 1024

static const char PROMPT[] =
    "The history of the city begins with a small settlement on the river, where traders met to exchange grain, salt "
    "and cloth. Over the centuries it grew into a market town, then a regional capital with";
static const char PASSAGE[] =
    "The old lighthouse stood at the end of the pier, its white paint peeling in the salt wind. Every evening the "
    "keeper climbed the one hundred and twelve steps to light the lamp, and every morning he climbed them again to "
    "put it out. Ships passed in the night and never knew his name, but they knew his light, and that was enough.";

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct result {
    double tps, acceptance;
    int32_t ids[MAX_NEW], n;
} result;

/* One job of n_new greedy tokens after prompt on a generator with the given drafting; the best of two runs. */
static int decode(exl_model *m, const exl_tokenizer *tok, const char *prompt, int n_new, exl_model *draft, int k,
                  int ngram, int fixed, result *r) {
    r->tps = 0;
    for (int rep = 0; rep < 2; rep++) {
        exl_generator_params gp = exl_generator_default_params();
        gp.n_pages = 16;
        gp.draft_model = draft, gp.draft_tokens = k, gp.ngram = ngram, gp.draft_fixed = fixed;
        exl_generator *g;
        if (exl_generator_init(m, tok, &gp, &g) != EXL_OK)
            return -1;
        exl_job_params p = exl_job_default_params();
        p.text = prompt;
        p.max_new_tokens = n_new;
        p.ignore_eos = 1;
        p.sampling.temperature = 0;
        uint64_t id;
        double first = 0, last = 0;
        int n = 0, first_n = 0;
        exl_status st = exl_generator_submit(g, &p, &id);
        while (st == EXL_OK && exl_generator_pending(g) > 0) {
            const exl_gen_event *ev;
            int32_t ne;
            st = exl_generator_step(g, &ev, &ne);
            for (int32_t e = 0; st == EXL_OK && e < ne; e++) {
                for (int32_t i = 0; i < ev[e].n_ids && n < MAX_NEW; i++)
                    r->ids[n++] = ev[e].ids[i];
                if (ev[e].n_ids && !first_n) {
                    first = now();
                    first_n = n;
                }
                last = now();
            }
        }
        exl_generator_stats s;
        exl_generator_stats_get(g, &s);
        exl_generator_free(g);
        if (st != EXL_OK)
            return -1;
        double tps = last > first ? (n - first_n) / (last - first) : 0;
        r->tps = tps > r->tps ? tps : r->tps;
        r->n = n;
        r->acceptance = s.draft_proposed ? (double)s.draft_accepted / (double)s.draft_proposed : 0;
    }
    return 0;
}

static const char *same(const result *a, const result *b) {
    return a->n == b->n && !memcmp(a->ids, b->ids, (size_t)a->n * sizeof *a->ids) ? "yes" : "NO";
}

static void row(const char *what, const char *k, const result *r, double base, const result *plain) {
    char acc[32] = "-";
    if (r->acceptance > 0 || strcmp(k, "-"))
        snprintf(acc, sizeof acc, "%.1f%%", 100 * r->acceptance);
    printf("| %s | %s | %s | %.1f | %.2fx | %s |\n", what, k, acc, r->tps, r->tps / base, same(r, plain));
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: spec_bench MODEL DRAFT [NEW_TOKENS] [cpu|cuda]\n");
        return 2;
    }
    int n_new = argc > 3 ? atoi(argv[3]) : 256;
    n_new = n_new < 2 ? 2 : n_new > MAX_NEW ? MAX_NEW : n_new;
    exl_model_params mp = exl_model_default_params();
    mp.device = argc > 4 && !strcmp(argv[4], "cpu") ? EXL_DEVICE_CPU : EXL_DEVICE_CUDA;
    exl_model *m = NULL, *d = NULL, *self = NULL; /* self: a second copy, with a backend (and CUDA graphs) of its own */
    exl_tokenizer *tok = NULL;
    if (exl_model_load(argv[1], &mp, &m) != EXL_OK || exl_model_load(argv[2], &mp, &d) != EXL_OK ||
        exl_model_load(argv[1], &mp, &self) != EXL_OK || exl_tokenizer_load(argv[1], &tok) != EXL_OK) {
        fprintf(stderr, "spec_bench: %s\n", exl_last_error());
        return 1;
    }
    static result plain, r, plain_repeat;
    static char repeat[2048], oracle[64], k_text[32], what[96];
    snprintf(repeat, sizeof repeat, "Repeat the following passage exactly, three times.\n\n%s\n\nRepeated:\n%s\n",
             PASSAGE, PASSAGE);
    int rc = 0;
    printf("| run | K | acceptance | tok/s | vs plain | tokens = plain's |\n|---|---|---|---|---|---|\n");
    rc |= decode(m, tok, PROMPT, n_new, NULL, 0, 0, 0, &plain);
    row("plain decoding", "-", &plain, plain.tps, &plain);
    rc |= decode(d, tok, PROMPT, n_new, NULL, 0, 0, 0, &r);
    printf("| the draft model alone | - | - | %.1f | - | - |\n", r.tps);
    for (int k = 1; k <= 8 && !rc; k++) {
        rc |= decode(m, tok, PROMPT, n_new, self, k, 0, 1, &r);
        snprintf(k_text, sizeof k_text, "%d", k);
        row("self-draft", k_text, &r, plain.tps, &plain);
    }
    /* the oracle: plain decoding's tokens */
    snprintf(oracle, sizeof oracle, "/tmp/spec_bench_oracle_%d.txt", (int)getpid());
    FILE *f = fopen(oracle, "w");
    for (int i = 0; f && i < plain.n; i++)
        fprintf(f, "%d\n", plain.ids[i]);
    if (f)
        fclose(f);
    setenv("EXL_SPEC_TEST_ORACLE", oracle, 1);
    static const char *const alphas[] = {"0.5", "0.7", "0.8", "0.9", "1.0"};
    for (int a = 0; a < 5 && !rc; a++) {
        setenv("EXL_SPEC_TEST_ALPHA", alphas[a], 1);
        for (int k = 2; k <= 16 && !rc; k *= 2) {
            int adaptive = k == 16;
            rc |= decode(m, tok, PROMPT, n_new, d, adaptive ? 8 : k, 0, !adaptive, &r);
            snprintf(what, sizeof what, "draft, alpha %s", alphas[a]);
            snprintf(k_text, sizeof k_text, adaptive ? "adaptive <= 8" : "%d", k);
            row(what, k_text, &r, plain.tps, &plain);
        }
    }
    unsetenv("EXL_SPEC_TEST_ORACLE");
    unsetenv("EXL_SPEC_TEST_ALPHA");
    remove(oracle);
    rc |= decode(m, tok, repeat, n_new, NULL, 0, 0, 0, &plain_repeat);
    row("plain decoding, repeat prompt", "-", &plain_repeat, plain_repeat.tps, &plain_repeat);
    for (int k = 4; k <= 8 && !rc; k += 4) {
        rc |= decode(m, tok, repeat, n_new, NULL, k, 3, 0, &r);
        snprintf(k_text, sizeof k_text, "adaptive <= %d", k);
        row("n-gram 3, repeat prompt", k_text, &r, plain_repeat.tps, &plain_repeat);
    }
    if (rc)
        fprintf(stderr, "spec_bench: %s\n", exl_last_error());
    exl_tokenizer_free(tok);
    exl_model_free(self);
    exl_model_free(d);
    exl_model_free(m);
    return rc ? 1 : 0;
}
