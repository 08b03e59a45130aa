/* constrained_bench.c - the cost of constrained decoding on the host: batch-1 decode time per token
 * without a constraint and with three, over the same prompt and sampling settings.
 * usage: constrained_bench MODEL_DIR NEW_TOKENS SEEDS ROUNDS [BATCH]
 *   (EXL_BENCH_DEVICE=cuda: on the GPU, else the CPU)
 * A variant's run is one job per seed (seeds 1..SEEDS, temperature 1, end-of-sequence ignored), BATCH jobs at a
 * time (default 1), timed from the moment every job of a batch has its first token to the batch's end: decode
 * only, prefill left out; tokens per second is the batch's throughput. The variants take turns, ROUNDS
 * times, and each keeps its fastest run (the machine's load drifts). Prints one Markdown table row per
 * variant: tokens decoded, forward steps, ms per token and per step, and the per-step ratio to the free
 * run (text the grammar writes itself adds tokens without steps).
 * The constraints: free text inside JSON strings (few grammar states: their masks are computed once
 * and reused), a list of objects under a bounded schema (many states: strings of at most 24
 * characters and integer ranges), and a regular expression of words. */
#include "exl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int fail(const char *what) {
    fprintf(stderr, "constrained_bench: %s: %s\n", what, exl_last_error());
    return 1;
}

typedef struct variant {
    const char *name;
    exl_constraint_kind kind;
    const char *source; /* NULL: free */
} variant;

static const variant VARIANTS[] = {
    {"free (no constraint)", EXL_CONSTRAINT_GBNF, NULL},
    {"JSON list of free strings", EXL_CONSTRAINT_GBNF,
     "root ::= \"[\" str (\", \" str)*\n"
     "str ::= \"\\\"\" ([^\"\\\\\\x00-\\x1F] | \"\\\\\" [\"\\\\/nt])* \"\\\"\"\n"},
    {"JSON Schema: list of bounded objects", EXL_CONSTRAINT_JSON_SCHEMA,
     "{\"type\": \"array\", \"items\": {\"type\": \"object\", \"properties\": {"
     "\"name\": {\"type\": \"string\", \"maxLength\": 24}, \"age\": {\"type\": \"integer\", \"minimum\": 0,"
     " \"maximum\": 120}, \"tags\": {\"type\": \"array\", \"items\": {\"enum\": [\"red\", \"green\", \"blue\"]},"
     " \"maxItems\": 3}, \"ok\": {\"type\": \"boolean\"}}, \"required\": [\"name\", \"age\", \"tags\", \"ok\"],"
     " \"additionalProperties\": false}}"},
    {"regex ([a-z]+ )+", EXL_CONSTRAINT_REGEX, "([a-z]+ )+"},
};

/* A run of `batch` concurrent jobs (seeds first..first+batch-1): decode seconds and tokens from the moment every
 * job has its first token (all in decode) to the end, and the forward steps in that span. */
static int run_batch(exl_generator *gen, exl_constraint *c, int new_tokens, int first, int batch, double *secs,
                     int64_t *tokens, int64_t *steps) {
    int32_t n_now[256] = {0}, n_start[256] = {0};
    for (int j = 0; j < batch; j++) {
        exl_job_params p = exl_job_default_params();
        p.text = "Once upon a time";
        p.max_new_tokens = new_tokens;
        p.ignore_eos = 1;
        p.constraint = c;
        p.sampling.seed = (uint64_t)(first + j);
        p.user = &n_now[j];
        uint64_t id;
        if (exl_generator_submit(gen, &p, &id) != EXL_OK)
            return fail("submit");
    }
    double t_start = 0, t_end = 0;
    int started = 0, n_started = 0;
    exl_generator_stats st;
    int64_t step_start = 0;
    while (exl_generator_pending(gen) > 0) {
        const exl_gen_event *ev;
        int32_t n_ev;
        if (exl_generator_step(gen, &ev, &n_ev) != EXL_OK)
            return fail("step");
        for (int32_t e = 0; e < n_ev; e++) {
            if (ev[e].finish == EXL_FINISH_ERROR) {
                fprintf(stderr, "constrained_bench: job failed: %s\n", ev[e].error);
                return 1;
            }
            int32_t *n = ev[e].user;
            if (!*n && ev[e].n_generated)
                n_started++;
            *n = ev[e].n_generated;
        }
        t_end = now();
        if (!started && n_started == batch) {
            started = 1;
            t_start = t_end;
            memcpy(n_start, n_now, sizeof n_start);
            exl_generator_stats_get(gen, &st);
            step_start = st.steps;
        }
    }
    exl_generator_stats_get(gen, &st);
    *secs += t_end - t_start;
    for (int j = 0; j < batch; j++)
        *tokens += n_now[j] - n_start[j];
    *steps += st.steps - step_start;
    return 0;
}

typedef struct result {
    double secs;
    int64_t tokens, steps;
} result;

/* One run of variant v: every seed, `batch` jobs at a time. */
static int run_variant(exl_generator *gen, const variant *v, int new_tokens, int seeds, int batch, result *out) {
    exl_constraint *c = NULL;
    if (v->source && exl_constraint_compile(v->kind, v->source, strlen(v->source), &c) != EXL_OK)
        return fail(v->name);
    *out = (result){0};
    for (int s = 1; s <= seeds; s += batch)
        if (run_batch(gen, c, new_tokens, s, seeds - s + 1 < batch ? seeds - s + 1 : batch, &out->secs, &out->tokens,
                      &out->steps)) {
            exl_constraint_free(c);
            return 1;
        }
    exl_constraint_free(c);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 5 && argc != 6) {
        fprintf(stderr, "usage: constrained_bench MODEL_DIR NEW_TOKENS SEEDS ROUNDS [BATCH]\n");
        return 2;
    }
    int new_tokens = atoi(argv[2]), seeds = atoi(argv[3]), rounds = atoi(argv[4]);
    int batch = argc == 6 ? atoi(argv[5]) : 1;
    if (batch < 1 || batch > 256) {
        fprintf(stderr, "constrained_bench: BATCH must be in 1..256\n");
        return 2;
    }
    exl_model_params mp = exl_model_default_params();
    const char *dev = getenv("EXL_BENCH_DEVICE");
    mp.device = dev && !strcmp(dev, "cuda") ? EXL_DEVICE_CUDA : EXL_DEVICE_CPU;
    exl_model *model;
    exl_tokenizer *tok;
    exl_generator *gen;
    if (exl_model_load(argv[1], &mp, &model) != EXL_OK)
        return fail("model");
    if (exl_tokenizer_load(argv[1], &tok) != EXL_OK)
        return fail("tokenizer");
    if (exl_generator_init(model, tok, NULL, &gen) != EXL_OK)
        return fail("generator");
    enum { N_VARIANTS = sizeof VARIANTS / sizeof VARIANTS[0] };
    result best[N_VARIANTS];
    for (int r = 0; r < rounds; r++)
        for (int v = 0; v < N_VARIANTS; v++) {
            result x;
            if (run_variant(gen, &VARIANTS[v], new_tokens, seeds, batch, &x))
                return 1;
            if (!r ||
                x.secs / (double)(x.steps ? x.steps : 1) < best[v].secs / (double)(best[v].steps ? best[v].steps : 1))
                best[v] = x;
        }
    printf(
        "| constraint | tokens | steps | ms/token | ms/step | tok/s | step vs free |\n|---|---|---|---|---|---|---|\n");
    double free_ms = best[0].steps ? 1e3 * best[0].secs / (double)best[0].steps : 0;
    for (int v = 0; v < N_VARIANTS; v++) {
        const result *x = &best[v];
        double ms = x->tokens ? 1e3 * x->secs / (double)x->tokens : 0,
               ms_step = x->steps ? 1e3 * x->secs / (double)x->steps : 0;
        printf("| %s | %lld | %lld | %.3f | %.3f | %.1f | %.2fx |\n", VARIANTS[v].name, (long long)x->tokens,
               (long long)x->steps, ms, ms_step, x->secs > 0 ? (double)x->tokens / x->secs : 0,
               free_ms > 0 ? ms_step / free_ms : 0);
    }
    exl_generator_free(gen);
    exl_tokenizer_free(tok);
    exl_model_free(model);
    return 0;
}
