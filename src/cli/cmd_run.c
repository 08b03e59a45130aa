/* cmd_run.c - `exl run`: complete one or more prompts with the generator. One prompt
 * streams its completion as it is generated; several run as one batch. */
#include "cli.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_PROMPTS 1024

static void help(void) {
    printf("usage: exl run -m DIR -p TEXT [-p TEXT ...] [options]\n\n"
           "Complete each prompt (tokenized with the tokenizer's post-processor, e.g. BOS).\n"
           "One prompt: the completion is printed as it is generated. Several prompts run\n"
           "together as one batch and are printed when all are done.\n\n"
           "options:\n"
           "  -n N                 new tokens per prompt (default 128)\n"
           "  --greedy             always take the most likely token\n"
           "  --temperature T      (default 0.8)\n"
           "  --top-k K            (default 40; 0 = off)\n"
           "  --top-p P            (default 0.95; 1 = off)\n"
           "  --min-p P            (default 0.05; 0 = off)\n"
           "  --repeat-penalty R   (default 1 = off)\n"
           "  --seed S             random seed (default: from the clock)\n"
           "  --ignore-eos         keep going past end-of-sequence tokens\n"
           "  --json               print one JSON object per prompt:\n"
           "                       {\"prompt\", \"text\", \"tokens\", \"finish_reason\"}\n"
           "  --stats              print throughput and cache statistics to stderr\n"
           "  --device cpu|cuda|auto, -t THREADS\n");
}

typedef struct {
    const char *prompt;
    uint64_t job;
    char *text;
    size_t len;
    int32_t *ids;
    int32_t n_ids;
    exl_finish_reason finish;
} run_item;

static int append(run_item *it, const exl_gen_event *e) {
    char *t = realloc(it->text, it->len + e->text_len + 1);
    int32_t *ids = realloc(it->ids, (size_t)(it->n_ids + e->n_ids + 1) * sizeof *ids);
    if (t)
        it->text = t;
    if (ids)
        it->ids = ids;
    if (!t || !ids)
        return -1;
    memcpy(it->text + it->len, e->text, e->text_len);
    it->len += e->text_len;
    it->text[it->len] = 0;
    memcpy(it->ids + it->n_ids, e->ids, (size_t)e->n_ids * sizeof *ids);
    it->n_ids += e->n_ids;
    if (e->finish)
        it->finish = e->finish;
    return 0;
}

static void print_json(const run_item *it) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "prompt", it->prompt);
    cJSON_AddStringToObject(o, "text", it->text ? it->text : "");
    cJSON *ids = cJSON_AddArrayToObject(o, "tokens");
    for (int32_t i = 0; i < it->n_ids; i++)
        cJSON_AddItemToArray(ids, cJSON_CreateNumber(it->ids[i]));
    cJSON_AddStringToObject(o, "finish_reason", exl_finish_reason_str(it->finish));
    char *s = cJSON_PrintUnformatted(o);
    if (s)
        printf("%s\n", s);
    free(s);
    cJSON_Delete(o);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Submit every prompt and step until all are done. */
static exl_status generate(exl_generator *gen, run_item *items, int n, const exl_job_params *jp, int stream) {
    for (int i = 0; i < n; i++) {
        exl_job_params p = *jp;
        p.text = items[i].prompt;
        exl_status st = exl_generator_submit(gen, &p, &items[i].job);
        if (st != EXL_OK)
            return st;
    }
    while (exl_generator_pending(gen) > 0) {
        const exl_gen_event *ev;
        int32_t n_ev;
        exl_status st = exl_generator_step(gen, &ev, &n_ev);
        if (st != EXL_OK)
            return st;
        for (int32_t e = 0; e < n_ev; e++) {
            run_item *it = items;
            while (it->job != ev[e].job)
                it++;
            if (append(it, &ev[e]))
                return EXL_ERR_NOMEM;
            if (stream) {
                fwrite(ev[e].text, 1, ev[e].text_len, stdout);
                fflush(stdout);
            }
        }
    }
    return EXL_OK;
}

int cmd_run(int argc, char **argv) {
    const char *dir = NULL;
    static run_item items[MAX_PROMPTS];
    int n_items = 0, json = 0, stats = 0, greedy = 0, have_seed = 0;
    long n_new = 128;
    exl_model_params mp = exl_model_default_params();
    exl_job_params jp = exl_job_default_params();
    exl_sampling *s = &jp.sampling;
    s->temperature = 0.8f;
    s->top_k = 40;
    s->top_p = 0.95f;
    s->min_p = 0.05f;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            help();
            return 0;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (!strcmp(a, "--stats")) {
            stats = 1;
        } else if (!strcmp(a, "--greedy")) {
            greedy = 1;
        } else if (!strcmp(a, "--ignore-eos")) {
            jp.ignore_eos = 1;
        } else if (!v) {
            return cli_usage_error("run", "unknown option or missing value '%s'", a);
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            dir = argv[++i];
        } else if (!strcmp(a, "-p") || !strcmp(a, "--prompt")) {
            if (n_items == MAX_PROMPTS)
                return cli_usage_error("run", "at most %d prompts", MAX_PROMPTS);
            items[n_items++].prompt = argv[++i];
        } else if (!strcmp(a, "-n")) {
            if (cli_parse_int(argv[++i], 1, 1 << 24, &n_new))
                return cli_usage_error("run", "bad token count '%s'", v);
        } else if (!strcmp(a, "--top-k")) {
            long k;
            if (cli_parse_int(argv[++i], 0, 1 << 24, &k))
                return cli_usage_error("run", "bad --top-k '%s'", v);
            s->top_k = (int32_t)k;
        } else if (!strcmp(a, "--seed")) {
            s->seed = strtoull(argv[++i], &end, 10);
            if (*end || !*v)
                return cli_usage_error("run", "bad --seed '%s'", v);
            have_seed = 1;
        } else if (!strcmp(a, "--temperature") || !strcmp(a, "--top-p") || !strcmp(a, "--min-p") ||
                   !strcmp(a, "--repeat-penalty")) {
            float x = strtof(argv[++i], &end);
            if (*end || !*v)
                return cli_usage_error("run", "bad %s '%s'", a, v);
            *(!strcmp(a, "--temperature") ? &s->temperature
              : !strcmp(a, "--top-p")     ? &s->top_p
              : !strcmp(a, "--min-p")     ? &s->min_p
                                          : &s->repetition_penalty) = x;
        } else if (!strcmp(a, "--device")) {
            if (cli_parse_device(argv[++i], &mp.device))
                return cli_usage_error("run", "unknown device '%s'", v);
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            long t;
            if (cli_parse_int(argv[++i], 1, 1024, &t))
                return cli_usage_error("run", "bad thread count '%s'", v);
            mp.n_threads = (int32_t)t;
        } else {
            return cli_usage_error("run", "unknown option '%s'", a);
        }
    }
    if (!dir || !n_items)
        return cli_usage_error("run", "need -m DIR and at least one -p TEXT");
    if (greedy)
        s->temperature = 0;
    if (!have_seed)
        s->seed = (uint64_t)time(NULL);
    jp.max_new_tokens = (int32_t)n_new;

    /* enough cache pages for the longest job alone (tokens <= bytes + specials) */
    exl_generator_params gp = exl_generator_default_params();
    size_t longest = 0;
    for (int i = 0; i < n_items; i++)
        longest = strlen(items[i].prompt) > longest ? strlen(items[i].prompt) : longest;
    long need = (long)((longest + (size_t)n_new + 8) / (size_t)gp.page_size) + 1;
    gp.n_pages = need > gp.n_pages ? (int32_t)need : gp.n_pages;

    exl_model *model = NULL;
    exl_tokenizer *tok = NULL;
    exl_generator *gen = NULL;
    exl_status st = exl_model_load(dir, &mp, &model);
    if (st == EXL_OK)
        st = exl_tokenizer_load(dir, &tok);
    if (st == EXL_OK)
        st = exl_generator_init(model, tok, &gp, &gen);
    double t0 = now();
    if (st == EXL_OK)
        st = generate(gen, items, n_items, &jp, n_items == 1 && !json);
    double dt = now() - t0;
    if (st == EXL_OK) {
        for (int i = 0; i < n_items; i++) {
            if (json)
                print_json(&items[i]);
            else if (n_items == 1)
                printf("\n");
            else
                printf("%s%s\n\n", items[i].prompt, items[i].text ? items[i].text : "");
        }
    }
    if (st == EXL_OK && stats) {
        exl_generator_stats gs;
        exl_generator_stats_get(gen, &gs);
        fprintf(stderr, "exl run: %lld tokens generated in %.2f s (%.1f tokens/s), %lld computed, %lld steps\n",
                (long long)gs.tokens_generated, dt, dt > 0 ? gs.tokens_generated / dt : 0.0,
                (long long)gs.tokens_computed, (long long)gs.steps);
    }
    for (int i = 0; i < n_items; i++) {
        free(items[i].text);
        free(items[i].ids);
    }
    exl_generator_free(gen);
    exl_tokenizer_free(tok);
    exl_model_free(model);
    return st == EXL_OK ? 0 : cli_error(st);
}
