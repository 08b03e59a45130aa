/* constrained_bench.c - the cost of constrained decoding on the host: batch-1 decode time per token
 * without a constraint and with three, over the same prompt and sampling settings.
 * usage: constrained_bench MODEL_DIR NEW_TOKENS SEEDS     (EXL_BENCH_DEVICE=cuda: on the GPU, else the CPU)
 * Each variant runs one job per seed (seeds 1..SEEDS, temperature 1, end-of-sequence ignored) and
 * counts the time from a job's first token to its last: decode only, prefill left out. Prints one
 * Markdown table row per variant: tokens decoded, forward steps, ms per token and per step, and the
 * per-step ratio to the free run (text the grammar writes itself adds tokens without steps).
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

/* Decode seconds and tokens of one job (from its first token to its end). */
static int run_job(exl_generator *gen, exl_constraint *c, int new_tokens, uint64_t seed, double *secs,
                   int64_t *tokens, int64_t *steps) {
    exl_job_params p = exl_job_default_params();
    p.text = "Once upon a time";
    p.max_new_tokens = new_tokens;
    p.ignore_eos = 1;
    p.constraint = c;
    p.sampling.seed = seed;
    uint64_t id;
    if (exl_generator_submit(gen, &p, &id) != EXL_OK)
        return fail("submit");
    double first = 0, last = 0;
    int32_t n_first = 0, n_last = 0;
    exl_generator_stats st;
    int64_t step_first = 0;
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
            if (!n_first && ev[e].n_generated) {
                first = now();
                n_first = ev[e].n_generated;
                exl_generator_stats_get(gen, &st);
                step_first = st.steps;
            }
            last = now();
            n_last = ev[e].n_generated;
        }
    }
    exl_generator_stats_get(gen, &st);
    *secs += last - first;
    *tokens += n_last - n_first;
    *steps += st.steps - step_first;
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: constrained_bench MODEL_DIR NEW_TOKENS SEEDS\n");
        return 2;
    }
    int new_tokens = atoi(argv[2]), seeds = atoi(argv[3]);
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
    printf("| constraint | tokens | steps | ms/token | ms/step | step vs free |\n|---|---|---|---|---|---|\n");
    double free_ms = 0;
    for (size_t v = 0; v < sizeof VARIANTS / sizeof VARIANTS[0]; v++) {
        exl_constraint *c = NULL;
        if (VARIANTS[v].source &&
            exl_constraint_compile(VARIANTS[v].kind, VARIANTS[v].source, strlen(VARIANTS[v].source), &c) != EXL_OK)
            return fail(VARIANTS[v].name);
        double secs = 0;
        int64_t tokens = 0, steps = 0;
        for (int s = 1; s <= seeds; s++)
            if (run_job(gen, c, new_tokens, (uint64_t)s, &secs, &tokens, &steps))
                return 1;
        exl_constraint_free(c);
        double ms = tokens ? 1e3 * secs / (double)tokens : 0, ms_step = steps ? 1e3 * secs / (double)steps : 0;
        if (v == 0)
            free_ms = ms_step;
        printf("| %s | %lld | %lld | %.3f | %.3f | %.2fx |\n", VARIANTS[v].name, (long long)tokens, (long long)steps, ms,
               ms_step, free_ms > 0 ? ms_step / free_ms : 0);
        fflush(stdout);
    }
    exl_generator_free(gen);
    exl_tokenizer_free(tok);
    exl_model_free(model);
    return 0;
}
