/* cmd_run.c - `exl run`: complete one or more prompts with the generator. One prompt
 * streams its completion as it is generated; several run as one batch. */
#include "cli.h"
#include "options.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static const char ABOUT[] =
    "Complete each prompt, tokenized with the tokenizer's post-processor (e.g. BOS) as the server\n"
    "tokenizes a text prompt. One prompt: the completion is printed as it is generated. Several\n"
    "prompts run together as one batch and are printed when all are done.";

static const char NOTES[] =
    "Counting: a stop token (end of sequence) that ends a completion is a generated token, as in\n"
    "the server's usage.completion_tokens: it is the last of --json's \"tokens\" and --stats counts\n"
    "it; it adds no text.\n"
    "Constraints (--grammar, --json-schema, --regex, one at a time): each token is drawn from those\n"
    "that keep the output inside the constraint; the completion ends where the output is complete\n"
    "and nothing may follow, or with end-of-sequence where it may end.";

typedef struct {
    const char *prompt;
    int32_t *prompt_ids;
    int32_t n_prompt_ids;
    uint64_t job;
    char *text;
    size_t len;
    int32_t *ids;
    int32_t n_ids;
    exl_finish_reason finish;
    int32_t draft_proposed, draft_accepted;
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
    it->draft_proposed = e->n_draft_proposed;
    it->draft_accepted = e->n_draft_accepted;
    return 0;
}

static void print_json(const run_item *it, int drafting) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "prompt", it->prompt);
    cJSON_AddStringToObject(o, "text", it->text ? it->text : "");
    cJSON *ids = cJSON_AddArrayToObject(o, "tokens");
    for (int32_t i = 0; i < it->n_ids; i++)
        cJSON_AddItemToArray(ids, cJSON_CreateNumber(it->ids[i]));
    cJSON_AddStringToObject(o, "finish_reason", exl_finish_reason_str(it->finish));
    if (drafting) {
        cJSON_AddNumberToObject(o, "draft_proposed", it->draft_proposed);
        cJSON_AddNumberToObject(o, "draft_accepted", it->draft_accepted);
    }
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
        p.ids = items[i].prompt_ids;
        p.n_ids = items[i].n_prompt_ids;
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

/* The whole of a file, NUL-terminated (free); NULL with errno when unreadable. */
static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t n = 0, cap = 0;
    while (f) {
        if (n + 4096 + 1 > cap) {
            char *b = realloc(buf, cap = 2 * cap + 4096 + 1);
            if (!b)
                break;
            buf = b;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, f);
        n += got;
        if (got == 0) {
            int bad = ferror(f);
            fclose(f);
            if (bad)
                break;
            buf[n] = 0;
            *len = n;
            return buf;
        }
    }
    free(buf);
    return NULL;
}

/* The constraint the options ask for (*out NULL when none); 2 after a usage error. */
static int load_constraint(const char *grammar, const char *schema, const char *regex, exl_constraint **out) {
    *out = NULL;
    if (!!grammar + !!schema + !!regex > 1) {
        fprintf(stderr, "exl run: give at most one of --grammar, --json-schema and --regex\n");
        return 2;
    }
    if (!grammar && !schema && !regex)
        return 0;
    size_t len = regex ? strlen(regex) : 0;
    const char *path = grammar ? grammar : schema;
    char *text = path ? read_file(path, &len) : NULL;
    if (path && !text) {
        fprintf(stderr, "exl run: cannot read %s\n", path);
        return 1;
    }
    exl_constraint_kind kind = grammar  ? EXL_CONSTRAINT_GBNF
                               : schema ? EXL_CONSTRAINT_JSON_SCHEMA
                                        : EXL_CONSTRAINT_REGEX;
    exl_status st = exl_constraint_compile(kind, text ? text : regex, len, out);
    free(text);
    if (st != EXL_OK) {
        fprintf(stderr, "exl run: %s%s%s\n", path ? path : "", path ? ": " : "", exl_last_error());
        return 1;
    }
    return 0;
}

/* The prompts as token ids; *longest: the most ids of one. */
static exl_status tokenize(const exl_tokenizer *tok, run_item *items, int n, int32_t *longest) {
    *longest = 0;
    for (int i = 0; i < n; i++) {
        exl_status st = exl_tokenizer_encode(tok, items[i].prompt, strlen(items[i].prompt), 1, &items[i].prompt_ids,
                                             &items[i].n_prompt_ids);
        if (st != EXL_OK)
            return st;
        if (items[i].n_prompt_ids > *longest)
            *longest = items[i].n_prompt_ids;
    }
    return EXL_OK;
}

int cmd_run(int argc, char **argv) {
    cli_model_args model;
    cli_sampling_args sampling;
    cli_cache_args cache;
    cli_draft_args draft;
    cli_list prompts = {0};
    long n_new = 128;
    int json = 0, stats = 0, ignore_eos = 0;
    const char *grammar = NULL, *schema = NULL, *regex = NULL;
    const cli_option options[] = {
        {"-p", "--prompt", CLI_LIST, &prompts, "TEXT", .help = "a prompt to complete (repeat for a batch)",
         .required = 1},
        {"-n", NULL, CLI_LONG, &n_new, "N", .help = "new tokens per prompt", .lo = 1, .hi = 1 << 24},
        {NULL, "--ignore-eos", CLI_FLAG, &ignore_eos, NULL, .help = "keep going past end-of-sequence tokens"},
        {NULL, "--json", CLI_FLAG, &json, NULL,
         .help = "print one JSON object per prompt:\n{\"prompt\", \"text\", \"tokens\", \"finish_reason\"}, "
                 "with\nspeculative decoding \"draft_proposed\", \"draft_accepted\""},
        {NULL, "--stats", CLI_FLAG, &stats, NULL, .help = "print throughput and cache statistics to stderr"},
        {NULL, "--grammar", CLI_STRING, &grammar, "FILE", .help = "the output follows this GBNF grammar (rule root)",
         .default_text = ""},
        {NULL, "--json-schema", CLI_STRING, &schema, "FILE",
         .help = "the output is JSON valid under this schema\n(the subset OpenAI's strict mode takes)",
         .default_text = ""},
        {NULL, "--regex", CLI_STRING, &regex, "RE", .help = "the output matches this regular expression",
         .default_text = ""},
    };
    const cli_command cmd = {"run",
                             "-m DIR -p TEXT [-p TEXT ...] [options]",
                             ABOUT,
                             NOTES,
                             {CLI_GROUP("options", options), cli_model_group(&model, CLI_MODEL_ALL | CLI_MODEL_LORA),
                              cli_sampling_group(&sampling),
                              cli_cache_group(&cache, CLI_CACHE_BITS | CLI_CACHE_TOKENS,
                                              "the longest prompt and -n, at least 16384"),
                              cli_draft_group(&draft)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc == CLI_GO_ON)
        rc = cli_cache_get(&cache, "run");
    if (rc == CLI_GO_ON)
        rc = cli_draft_get(&draft, "run");
    exl_constraint *constraint = NULL;
    if (rc == CLI_GO_ON && (rc = load_constraint(grammar, schema, regex, &constraint)) == 0)
        rc = CLI_GO_ON;
    run_item *items = rc == CLI_GO_ON ? calloc((size_t)prompts.n, sizeof *items) : NULL;
    if (rc == CLI_GO_ON && !items)
        rc = cli_error(EXL_ERR_NOMEM);
    if (rc != CLI_GO_ON) {
        exl_constraint_free(constraint);
        cli_list_free(&prompts);
        return rc;
    }
    int n_items = prompts.n;
    for (int i = 0; i < n_items; i++)
        items[i].prompt = prompts.items[i];
    exl_job_params jp = exl_job_default_params();
    jp.sampling = cli_sampling_get(&sampling);
    jp.ignore_eos = ignore_eos;
    jp.max_new_tokens = (int32_t)n_new;
    jp.constraint = constraint;

    exl_model *m = NULL, *draft_model = NULL;
    exl_tokenizer *tok = NULL;
    exl_generator *gen = NULL;
    int32_t longest = 0;
    exl_generator_params gp = exl_generator_default_params();
    exl_status st = cli_model_load(&model, &m);
    if (st == EXL_OK)
        st = exl_tokenizer_load(model.dir, &tok);
    if (st == EXL_OK)
        st = tokenize(tok, items, n_items, &longest);
    if (st == EXL_OK) {
        /* enough cache pages for the longest job alone */
        long need = (longest + n_new) / gp.page_size + 1;
        gp.n_pages = need > gp.n_pages ? (int32_t)need : gp.n_pages;
        cli_cache_apply(&cache, &gp);
        st = cli_draft_apply(&draft, &model.params, &draft_model, &gp);
    }
    if (st == EXL_OK) {
        st = exl_generator_init(m, tok, &gp, &gen);
    }
    double t0 = now();
    if (st == EXL_OK)
        st = generate(gen, items, n_items, &jp, n_items == 1 && !json);
    double dt = now() - t0;
    if (st == EXL_OK) {
        for (int i = 0; i < n_items; i++) {
            if (json)
                print_json(&items[i], gp.draft_tokens > 0);
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
        if (gp.draft_tokens > 0)
            fprintf(stderr, "exl run: drafts: %lld proposed, %lld accepted (acceptance rate %.1f%%)\n",
                    (long long)gs.draft_proposed, (long long)gs.draft_accepted,
                    gs.draft_proposed ? 100.0 * (double)gs.draft_accepted / (double)gs.draft_proposed : 0.0);
    }
    for (int i = 0; i < n_items; i++) {
        free(items[i].text);
        free(items[i].ids);
        exl_ids_free(items[i].prompt_ids);
    }
    free(items);
    cli_list_free(&prompts);
    exl_generator_free(gen);
    exl_constraint_free(constraint);
    exl_tokenizer_free(tok);
    exl_model_free(draft_model);
    exl_model_free(m);
    return st == EXL_OK ? 0 : cli_error(st);
}
