/* cmd_bench.c - `exl bench`: prefill and decode speed of a model against the memory bound. */
#include "cli.h"
#include "membw.h"
#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static const char ABOUT[] =
    "Time a prefill of PROMPT_TOKENS random tokens and then N single-token decode steps. Decode\n"
    "reads every weight once per token, so its bound is memory bandwidth / weight bytes per token;\n"
    "on the CPU the read bandwidth is measured in the same run and the fraction reached is printed.\n"
    "On the GPU, N greedy tokens are also generated after the prompt as `exl run --temperature 0`\n"
    "does (each token chosen on the GPU, the next step queued before the host reads it), when DIR\n"
    "has a tokenizer.";

/* Tokens/s of greedy generation after the prompt (its prefill not counted): one generator job,
 * as `exl run --temperature 0` runs it. */
static exl_status greedy_speed(exl_model *m, const char *dir, const cli_cache_args *cache, const int32_t *ids,
                               long prompt, long gen, double *tps) {
    exl_tokenizer *tok;
    exl_status st = exl_tokenizer_load(dir, &tok);
    if (st != EXL_OK)
        return st;
    exl_generator_params gp = exl_generator_default_params();
    gp.n_pages = (int32_t)((prompt + gen) / gp.page_size + 2);
    cli_cache_apply(cache, &gp);
    exl_generator *g;
    st = exl_generator_init(m, tok, &gp, &g);
    if (st != EXL_OK) {
        exl_tokenizer_free(tok);
        return st;
    }
    exl_job_params jp = exl_job_default_params();
    jp.ids = ids, jp.n_ids = (int32_t)prompt, jp.max_new_tokens = (int32_t)gen, jp.ignore_eos = 1;
    jp.sampling.temperature = 0;
    uint64_t job;
    st = exl_generator_submit(g, &jp, &job);
    long got = 0, first = 0;
    double t0 = 0;
    while (st == EXL_OK && exl_generator_pending(g) > 0) {
        const exl_gen_event *ev;
        int32_t n;
        st = exl_generator_step(g, &ev, &n);
        for (int32_t e = 0; st == EXL_OK && e < n; e++)
            got += ev[e].n_ids;
        if (!t0 && got > 0) /* the prompt is in: time the rest */
            t0 = now(), first = got;
    }
    *tps = got > first ? (got - first) / (now() - t0) : 0;
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    return st;
}

int cmd_bench(int argc, char **argv) {
    cli_model_args model;
    cli_cache_args cache;
    long prompt = 128, gen = 64;
    const cli_option options[] = {
        {"-p", NULL, CLI_LONG, &prompt, "PROMPT_TOKENS", .help = "tokens in the timed prefill", .lo = 1, .hi = 1 << 20},
        {"-n", NULL, CLI_LONG, &gen, "N", .help = "decode steps", .lo = 1, .hi = 1 << 20},
    };
    const cli_command cmd = {"bench",
                             "-m DIR [-p PROMPT_TOKENS] [-n N] [options]",
                             ABOUT,
                             NULL,
                             {CLI_GROUP("options", options), cli_model_group(&model, CLI_MODEL_ALL | CLI_MODEL_LORA),
                              cli_cache_group(&cache, CLI_CACHE_BITS, NULL)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc == CLI_GO_ON)
        rc = cli_cache_get(&cache, "bench");
    if (rc != CLI_GO_ON)
        return rc;
    const char *dir = model.dir;
    exl_model *m;
    exl_status st = cli_model_load(&model, &m);
    if (st != EXL_OK)
        return cli_error(st);
    exl_model_desc d;
    exl_model_describe(m, &d);
    exl_session *s;
    st = exl_session_init_cache(m, (int32_t)(prompt + gen), cache.k_bits, cache.v_bits, &s);
    int32_t *ids = malloc((size_t)prompt * sizeof *ids);
    float *logits = malloc((size_t)d.vocab_size * sizeof *logits);
    if (st != EXL_OK || !ids || !logits) {
        free(ids);
        free(logits);
        exl_model_free(m);
        return cli_error(st != EXL_OK ? st : EXL_ERR_NOMEM);
    }
    srand(1);
    for (long i = 0; i < prompt; i++)
        ids[i] = rand() % d.vocab_size;
    /* warm-up: touch every weight page once */
    st = exl_session_eval(s, ids, 1, NULL, logits);
    exl_session_reset(s);
    double t0 = now();
    if (st == EXL_OK)
        st = exl_session_eval(s, ids, (int32_t)prompt, NULL, logits);
    double t1 = now();
    for (long i = 0; st == EXL_OK && i < gen; i++) {
        int32_t next = (int32_t)(i * 7919 % d.vocab_size);
        st = exl_session_eval(s, &next, 1, NULL, logits);
    }
    double t2 = now();
    if (st != EXL_OK) {
        exl_session_free(s);
        exl_model_free(m);
        free(ids);
        free(logits);
        return cli_error(st);
    }
    double prefill = prompt / (t1 - t0), decode = gen / (t2 - t1);
    printf("model:    %s (%s, %.1f MiB of weights, %.1f MiB read per decoded token)\n", dir, d.arch,
           d.file_bytes / 1048576.0, d.decode_bytes / 1048576.0);
    printf("backend:  %s, kv cache keys %d-bit, values %d-bit\n", d.backend, (int)cache.k_bits, (int)cache.v_bits);
    printf("prefill:  %ld tokens in %.3f s = %.1f tokens/s\n", prompt, t1 - t0, prefill);
    printf("decode:   %ld tokens in %.3f s = %.2f tokens/s (context %ld..%ld)\n", gen, t2 - t1, decode, prompt,
           prompt + gen);
    if (strcmp(d.backend, "cpu") != 0 && gen > 1) {
        double g;
        if (greedy_speed(m, dir, &cache, ids, prompt, gen, &g) == EXL_OK)
            printf("greedy:   %.2f tokens/s generating (context %ld..%ld)\n", g, prompt, prompt + gen);
        else
            printf("greedy:   not measured: %s\n", exl_last_error());
    }
    if (!strcmp(d.backend, "cpu")) {
        long cores = model.params.n_threads > 0 ? model.params.n_threads : sysconf(_SC_NPROCESSORS_ONLN);
        double bw = exl_cli_read_bandwidth((int)cores, (size_t)1 << 30);
        double bound = bw / (double)d.decode_bytes;
        printf("memory:   %.2f GB/s read bandwidth measured (%ld threads)\n", bw / 1e9, cores);
        printf("bound:    %.2f tokens/s decode; reached %.1f%%\n", bound, 100.0 * decode / bound);
    }
    exl_session_free(s);
    exl_model_free(m);
    free(ids);
    free(logits);
    return 0;
}
