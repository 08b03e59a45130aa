/* generator_bench.c - aggregate generation throughput of the generator at several levels
 * of concurrency: N jobs with distinct random prompts submitted at once, run to the end.
 * usage: generator_bench MODEL_DIR PROMPT_TOKENS NEW_TOKENS REPEATS N [N ...]
 * Prints one Markdown table row per N, the fastest of REPEATS runs: jobs, wall seconds,
 * generated tokens/s, tokens/s through the model (prompt + generated), forward steps, and the
 * seconds spent in the forward pass and in sampling (the rest is setup and scheduling).
 * Jobs sample at temperature 0.8, top-k 40, top-p 0.95; EXL_BENCH_TEMPERATURE=0 makes them greedy, and
 * EXL_BENCH_TOP_K / EXL_BENCH_TOP_P set the filters (EXL_BENCH_TOP_K=0: top-p alone, as the server's clients);
 * EXL_BENCH_THREADS the CPU threads. */
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
    fprintf(stderr, "generator_bench: %s: %s\n", what, exl_last_error());
    return 1;
}

typedef struct {
    double seconds;
    exl_generator_stats st;
} outcome;

static int run(exl_model *model, exl_tokenizer *tok, int vocab, int prompt_len, int new_tokens, int n_jobs,
               outcome *out) {
    exl_generator_params gp = exl_generator_default_params();
    int pages_per_job = (prompt_len + new_tokens + gp.page_size - 1) / gp.page_size;
    if (n_jobs * pages_per_job > gp.n_pages)
        gp.n_pages = n_jobs * pages_per_job;
    exl_generator *gen;
    if (exl_generator_init(model, tok, &gp, &gen) != EXL_OK)
        return fail("generator");
    int32_t *ids = malloc((size_t)prompt_len * sizeof *ids);
    uint64_t x = 0x12345678u + (uint64_t)n_jobs;
    double t0 = now();
    for (int j = 0; j < n_jobs; j++) {
        ids[0] = 1;
        for (int i = 1; i < prompt_len; i++) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;
            ids[i] = 3 + (int32_t)(x % (uint64_t)(vocab - 3));
        }
        exl_job_params p = exl_job_default_params();
        p.ids = ids;
        p.n_ids = prompt_len;
        p.max_new_tokens = new_tokens;
        p.ignore_eos = 1;
        const char *temp = getenv("EXL_BENCH_TEMPERATURE"), *top_k = getenv("EXL_BENCH_TOP_K");
        const char *top_p = getenv("EXL_BENCH_TOP_P");
        p.sampling.temperature = temp ? (float)atof(temp) : 0.8f;
        p.sampling.top_k = top_k ? atoi(top_k) : 40;
        p.sampling.top_p = top_p ? (float)atof(top_p) : 0.95f;
        p.sampling.seed = (uint64_t)j;
        uint64_t id;
        if (exl_generator_submit(gen, &p, &id) != EXL_OK)
            return fail("submit");
    }
    while (exl_generator_pending(gen) > 0) {
        const exl_gen_event *ev;
        int32_t n;
        if (exl_generator_step(gen, &ev, &n) != EXL_OK)
            return fail("step");
    }
    out->seconds = now() - t0;
    exl_generator_stats_get(gen, &out->st);
    free(ids);
    exl_generator_free(gen);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: generator_bench MODEL_DIR PROMPT_TOKENS NEW_TOKENS REPEATS N [N ...]\n");
        return 2;
    }
    exl_model_params mp = exl_model_default_params();
    /* EXL_BENCH_TP=N splits the model over N devices (tensor parallelism) */
    mp.tp = getenv("EXL_BENCH_TP") ? atoi(getenv("EXL_BENCH_TP")) : 0;
    /* EXL_BENCH_DEVICE=cuda runs the same benchmark on the GPU */
    const char *dev = getenv("EXL_BENCH_DEVICE");
    mp.device = dev && !strcmp(dev, "cuda") ? EXL_DEVICE_CUDA : EXL_DEVICE_CPU;
    const char *threads = getenv("EXL_BENCH_THREADS"); /* the CPU backend's threads (default: one per core) */
    mp.n_threads = threads ? atoi(threads) : 0;
    exl_model *model;
    exl_tokenizer *tok;
    if (exl_model_load(argv[1], &mp, &model) != EXL_OK || exl_tokenizer_load(argv[1], &tok) != EXL_OK)
        return fail(argv[1]);
    exl_model_desc d;
    exl_model_describe(model, &d);
    int prompt_len = atoi(argv[2]), new_tokens = atoi(argv[3]), repeats = atoi(argv[4]);
    printf("| jobs | seconds | generated tok/s | computed tok/s | steps | forward s | sampling s |\n"
           "|---|---|---|---|---|---|---|\n");
    for (int i = 5; i < argc; i++) {
        outcome best = {0}, o;
        for (int r = 0; r < repeats; r++) {
            if (run(model, tok, d.vocab_size, prompt_len, new_tokens, atoi(argv[i]), &o))
                return 1;
            if (r == 0 || o.seconds < best.seconds)
                best = o;
        }
        printf("| %s | %.2f | %.1f | %.1f | %lld | %.2f | %.2f |\n", argv[i], best.seconds,
               best.st.tokens_generated / best.seconds, best.st.tokens_computed / best.seconds,
               (long long)best.st.steps, best.st.seconds_forward, best.st.seconds_sampling);
        fflush(stdout);
    }
    exl_tokenizer_free(tok);
    exl_model_free(model);
    return 0;
}
