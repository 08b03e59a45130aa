/* options.c - the table-driven option parser (see options.h): matching, values, required
 * options, the generated --help, and the shared model and sampling groups. */
#include "options.h"

#include "cli.h"
#include "default_model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define HELP_COLUMN 26 /* where help texts start */

void cli_list_free(cli_list *list) {
    free(list->items);
    *list = (cli_list){0};
}

static int takes_value(const cli_option *o) { return o->kind != CLI_FLAG; }

/* The option that arg names (*index: its place across the groups); *inline_value: what follows
 * '=' in --name=value, else NULL. */
static const cli_option *find(const cli_command *cmd, const char *arg, const char **inline_value, int *index) {
    const char *eq = strncmp(arg, "--", 2) ? NULL : strchr(arg, '=');
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    *inline_value = eq ? eq + 1 : NULL;
    int k = 0;
    for (int g = 0; g < CLI_MAX_GROUPS; g++)
        for (int i = 0; i < cmd->groups[g].n_options; i++, k++) {
            const cli_option *o = &cmd->groups[g].options[i];
            if ((o->short_name && !eq && !strcmp(arg, o->short_name)) ||
                (o->long_name && strlen(o->long_name) == len && !strncmp(arg, o->long_name, len))) {
                *index = k;
                return o;
            }
        }
    return NULL;
}

static int n_options(const cli_command *cmd) {
    int n = 0;
    for (int g = 0; g < CLI_MAX_GROUPS; g++)
        n += cmd->groups[g].n_options;
    return n;
}

static int parse_device(const char *s, exl_device *out) {
    if (!strcmp(s, "auto"))
        *out = EXL_DEVICE_AUTO;
    else if (!strcmp(s, "cpu"))
        *out = EXL_DEVICE_CPU;
    else if (!strcmp(s, "cuda") || !strcmp(s, "gpu"))
        *out = EXL_DEVICE_CUDA;
    else
        return -1;
    return 0;
}

static int is_help(const char *arg) { return !strcmp(arg, "-h") || !strcmp(arg, "--help"); }

/* ---------------------------------------------------------------- help */

static const char *device_name(exl_device d) {
    return d == EXL_DEVICE_CPU ? "cpu" : d == EXL_DEVICE_CUDA ? "cuda" : "auto";
}

/* The i-th word of "a|b|c" into buf; 0 when there is none. */
static int choice_word(const char *choices, int i, char *buf, size_t cap) {
    for (; i > 0 && choices; i--)
        choices = strchr(choices, '|') ? strchr(choices, '|') + 1 : NULL;
    if (!choices || i < 0)
        return 0;
    snprintf(buf, cap, "%.*s", (int)strcspn(choices, "|"), choices);
    return 1;
}

/* The target's current value as help shows it ("" when it shows none). */
static void default_of(const cli_option *o, char *buf, size_t cap) {
    buf[0] = 0;
    if (o->default_text) {
        snprintf(buf, cap, "%s", o->default_text);
        return;
    }
    switch (o->kind) {
    case CLI_STRING:
        if (*(const char **)o->target)
            snprintf(buf, cap, "%s", *(const char **)o->target);
        break;
    case CLI_CHOICE: choice_word(o->value, *(int *)o->target, buf, cap); break;
    case CLI_INT: snprintf(buf, cap, "%d", (int)*(int32_t *)o->target); break;
    case CLI_LONG: snprintf(buf, cap, "%ld", *(long *)o->target); break;
    case CLI_FLOAT: snprintf(buf, cap, "%g", (double)*(float *)o->target); break;
    case CLI_DOUBLE: snprintf(buf, cap, "%g", *(double *)o->target); break;
    case CLI_SEED: snprintf(buf, cap, "%llu", (unsigned long long)*(uint64_t *)o->target); break;
    case CLI_DEVICE: snprintf(buf, cap, "%s", device_name(*(exl_device *)o->target)); break;
    case CLI_SPLIT:
    case CLI_FLAG:
    case CLI_LIST:
    case CLI_LIST_REST: break;
    }
}

static void print_option(const cli_option *o) {
    char left[128], def[128];
    int n = snprintf(left, sizeof left, "  %s%s%s", o->short_name ? o->short_name : "",
                     o->short_name && o->long_name ? ", " : "", o->long_name ? o->long_name : "");
    if (takes_value(o))
        snprintf(left + n, sizeof left - (size_t)n, " %s%s", o->value, o->kind == CLI_LIST_REST ? "..." : "");
    default_of(o, def, sizeof def);
    printf("%-*s", HELP_COLUMN, left);
    if ((int)strlen(left) >= HELP_COLUMN - 1)
        printf("\n%-*s", HELP_COLUMN, "");
    for (const char *line = o->help;;) {
        size_t len = strcspn(line, "\n");
        printf("%.*s", (int)len, line);
        if (!line[len])
            break;
        line += len + 1;
        printf("\n%-*s", HELP_COLUMN, "");
    }
    if (def[0])
        printf(o->default_text ? " (default: %s)" : " (default %s)", def);
    printf("\n");
}

static void print_help(const cli_command *cmd) {
    printf("usage: exl %s %s\n\n%s\n", cmd->name, cmd->usage, cmd->about);
    for (int g = 0; g < CLI_MAX_GROUPS; g++) {
        if (!cmd->groups[g].n_options)
            continue;
        printf("\n%s:\n", cmd->groups[g].title);
        for (int i = 0; i < cmd->groups[g].n_options; i++)
            print_option(&cmd->groups[g].options[i]);
    }
    if (cmd->notes)
        printf("\n%s\n", cmd->notes);
}

/* Whether -h/--help stands where an option may (not as some option's value). */
static int wants_help(const cli_command *cmd, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (is_help(argv[i]))
            return 1;
        const char *inline_value;
        int k;
        const cli_option *o = find(cmd, argv[i], &inline_value, &k);
        if (!o || !takes_value(o) || inline_value)
            continue;
        if (o->kind == CLI_LIST_REST)
            while (i + 1 < argc && argv[i + 1][0] != '-')
                i++;
        else
            i++;
    }
    return 0;
}

/* ---------------------------------------------------------------- values */

/* name: the option as the user wrote it. */
static int bad_value(const cli_command *cmd, const cli_option *o, const char *name, const char *v) {
    if (o->kind == CLI_INT || o->kind == CLI_LONG)
        return cli_usage_error(cmd->name, "%s needs an integer in %.0f..%.0f, not '%s'", name, o->lo, o->hi, v);
    if (o->kind == CLI_FLOAT || o->kind == CLI_DOUBLE)
        return cli_usage_error(cmd->name, "%s needs a number in %g..%g, not '%s'", name, o->lo, o->hi, v);
    if (o->kind == CLI_SEED)
        return cli_usage_error(cmd->name, "%s needs a non-negative integer, not '%s'", name, v);
    if (o->kind == CLI_DEVICE)
        return cli_usage_error(cmd->name, "unknown device '%s' (cpu, cuda or auto)", v);
    return cli_usage_error(cmd->name, "%s needs one of %s, not '%s'", name, o->value, v);
}

static int append(cli_list *list, const char *v, int cap) {
    if (!list->items && !(list->items = calloc((size_t)cap, sizeof *list->items)))
        return -1;
    list->items[list->n++] = v;
    return 0;
}

/* Store v into o's target; 2 after a usage error, -1 out of memory. */
static int set_value(const cli_command *cmd, const cli_option *o, const char *name, const char *v, int argc) {
    char *end = NULL;
    errno = 0;
    switch (o->kind) {
    case CLI_FLAG: *(int *)o->target = 1; return 0;
    case CLI_STRING: *(const char **)o->target = v; return 0;
    case CLI_LIST:
    case CLI_LIST_REST: return append(o->target, v, argc);
    case CLI_CHOICE: {
        char word[64];
        for (int i = 0; choice_word(o->value, i, word, sizeof word); i++)
            if (!strcmp(word, v)) {
                *(int *)o->target = i;
                return 0;
            }
        return bad_value(cmd, o, name, v);
    }
    case CLI_INT:
    case CLI_LONG: {
        long x = strtol(v, &end, 10);
        if (!*v || *end || errno || x < o->lo || x > o->hi)
            return bad_value(cmd, o, name, v);
        if (o->kind == CLI_INT)
            *(int32_t *)o->target = (int32_t)x;
        else
            *(long *)o->target = x;
        return 0;
    }
    case CLI_FLOAT:
    case CLI_DOUBLE: {
        double x = strtod(v, &end);
        if (!*v || *end || !isfinite(x) || x < o->lo || x > o->hi)
            return bad_value(cmd, o, name, v);
        if (o->kind == CLI_FLOAT)
            *(float *)o->target = (float)x;
        else
            *(double *)o->target = x;
        return 0;
    }
    case CLI_SEED: {
        unsigned long long x = strtoull(v, &end, 10);
        if (!*v || *v == '-' || *end || errno)
            return bad_value(cmd, o, name, v);
        *(uint64_t *)o->target = (uint64_t)x;
        return 0;
    }
    case CLI_DEVICE: return parse_device(v, o->target) ? bad_value(cmd, o, name, v) : 0;
    case CLI_SPLIT: {
        float *parts = o->target;
        memset(parts, 0, EXL_MAX_GPU_SPLIT * sizeof(float));
        for (int i = 0;; i++) {
            double x = strtod(v, &end);
            if (i == EXL_MAX_GPU_SPLIT || end == v || !isfinite(x) || x <= 0 || (*end && *end != ','))
                return bad_value(cmd, o, name, v);
            parts[i] = (float)x;
            if (!*end)
                return 0;
            v = end + 1;
        }
    }
    }
    return 0;
}

/* ---------------------------------------------------------------- parse */

static int parse(const cli_command *cmd, int argc, char **argv, int *seen) {
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i], *v;
        int k, rc = 0;
        const cli_option *o = find(cmd, arg, &v, &k);
        if (!o)
            return cli_usage_error(cmd->name, arg[0] == '-' ? "unknown option '%s'" : "unexpected argument '%s'", arg);
        seen[k] = 1;
        const char *name = v ? o->long_name : arg;
        if (!takes_value(o)) {
            if (v)
                return cli_usage_error(cmd->name, "%s takes no value", name);
            rc = set_value(cmd, o, name, NULL, argc);
        } else if (v) {
            rc = set_value(cmd, o, name, v, argc);
        } else if (o->kind == CLI_LIST_REST) {
            if (i + 1 >= argc || argv[i + 1][0] == '-')
                return cli_usage_error(cmd->name, "%s needs at least one %s", name, o->value);
            while (rc == 0 && i + 1 < argc && argv[i + 1][0] != '-')
                rc = set_value(cmd, o, name, argv[++i], argc);
        } else {
            if (i + 1 >= argc)
                return cli_usage_error(cmd->name, "%s needs a value (%s)", name, o->value);
            rc = set_value(cmd, o, name, argv[++i], argc);
        }
        if (rc < 0) {
            fprintf(stderr, "exl %s: out of memory\n", cmd->name);
            return 1;
        }
        if (rc)
            return rc;
    }
    int k = 0;
    for (int g = 0; g < CLI_MAX_GROUPS; g++)
        for (int i = 0; i < cmd->groups[g].n_options; i++, k++) {
            const cli_option *o = &cmd->groups[g].options[i];
            if (o->required && !seen[k])
                return cli_usage_error(cmd->name, "missing %s %s", o->short_name ? o->short_name : o->long_name,
                                       o->value);
        }
    return CLI_GO_ON;
}

int cli_parse(const cli_command *cmd, int argc, char **argv) {
    if (wants_help(cmd, argc, argv)) {
        print_help(cmd);
        return 0;
    }
    int *seen = calloc((size_t)n_options(cmd) + 1, sizeof *seen);
    if (!seen) {
        fprintf(stderr, "exl %s: out of memory\n", cmd->name);
        return 1;
    }
    int rc = parse(cmd, argc, argv, seen);
    free(seen);
    return rc;
}

/* ---------------------------------------------------------------- shared groups */

cli_group cli_model_group(cli_model_args *a, int parts) {
    a->dir = cli_default_model(); /* the embedded model, when this exl has it */
    a->params = exl_model_default_params();
    const cli_option dir[] = {
        {"-m", "--model", CLI_STRING, &a->dir, "DIR", .required = a->dir == NULL,
         .help = "the model directory (config.json, *.safetensors, tokenizer);\n"
                 "left out: the embedded " CLI_DEFAULT_MODEL_NAME},
    };
    const cli_option device[] = {
        {NULL, "--device", CLI_DEVICE, &a->params.device, "cpu|cuda|auto",
         .help = "auto takes the GPU when one is usable, else the CPU;\ncuda insists on the GPU"},
        {"-t", "--threads", CLI_INT, &a->params.n_threads, "N", .lo = 1, .hi = 1024, .help = "CPU worker threads",
         .default_text = "one per core"},
        {NULL, "--tp", CLI_INT, &a->params.tp, "N", .lo = 1, .hi = 16, .default_text = "1",
         .help =
             "tensor parallelism: split the model over N devices\n(GPUs 0..N-1; on the CPU, N ranks share the cores)"},
        {NULL, "--gpu-split", CLI_SPLIT, a->params.gpu_split, "A,B,...",
         .help = "GB of weights for each device: whole layers placed on\nGPUs 0, 1, ... in order (a model larger than "
                 "one GPU)"},
    };
    a->lora = (cli_list){NULL, 0};
    const cli_option lora[] = {
        {NULL, "--lora", CLI_LIST, &a->lora, "DIR[:SCALE]", .default_text = "",
         .help = "a PEFT LoRA adapter, its update times SCALE (default 1);\nrepeat for a weighted sum of several"},
    };
    _Static_assert(sizeof dir + sizeof device + sizeof lora == sizeof a->options,
                   "cli_model_args.options holds the group");
    int n = 0;
    if (parts & CLI_MODEL_DIR)
        a->options[n++] = dir[0];
    if (parts & CLI_MODEL_DEVICE) {
        memcpy(a->options + n, device, sizeof device);
        n += (int)(sizeof device / sizeof device[0]);
    }
    if (parts & CLI_MODEL_LORA)
        a->options[n++] = lora[0];
    return (cli_group){"model options", a->options, n};
}

exl_status cli_model_load(cli_model_args *a, exl_model **out) {
    exl_lora_use uses[EXL_LORA_MAX_USES];
    exl_status st = exl_model_load(a->dir, &a->params, out);
    if (st == EXL_OK && a->lora.n > EXL_LORA_MAX_USES)
        st = exl_model_set_lora(*out, uses, a->lora.n); /* the message for too many */
    for (int i = 0; st == EXL_OK && i < a->lora.n; i++)
        st = exl_lora_load_spec(*out, a->lora.items[i], &uses[i]);
    if (st == EXL_OK)
        st = exl_model_set_lora(*out, uses, a->lora.n);
    cli_list_free(&a->lora);
    if (st != EXL_OK) {
        exl_model_free(*out);
        *out = NULL;
    }
    return st;
}

void cli_exact_cpu_activations(void) { setenv("EXL_CPU_ACT", "fp32", 0); }

cli_group cli_cache_group(cli_cache_args *a, int parts, const char *tokens_default) {
    *a = (cli_cache_args){.k_bits = 16, .v_bits = 16};
    const cli_option bits[] = {
        {NULL, "--cache-bits", CLI_STRING, &a->bits, "K[,V]", .default_text = "16",
         .help = "bits per cached key and value: 16 (unquantized: fp16; fp32 on\nthe CPU's exact path), 8, 6 or 4; "
                 "V defaults to K"},
    };
    const cli_option tokens[] = {
        {NULL, "--cache-tokens", CLI_LONG, &a->tokens, "N", .lo = 1, .hi = INT32_MAX, .default_text = tokens_default,
         .help = "tokens the KV cache holds, shared by the sequences:\npages are taken as they grow"},
    };
    const cli_option memory[] = {
        {NULL, "--gpu-memory", CLI_FLOAT, &a->gpu_memory, "F", .lo = 0.05, .hi = 1, .default_text = "0.9",
         .help = "the fraction of the GPU's memory exl may fill, weights\nincluded, when the cache is sized to "
                 "fit"},
    };
    _Static_assert(sizeof bits + sizeof tokens + sizeof memory == sizeof a->options,
                   "cli_cache_args.options holds the group");
    int n = 0;
    if (parts & CLI_CACHE_BITS)
        a->options[n++] = bits[0];
    if (parts & CLI_CACHE_TOKENS)
        a->options[n++] = tokens[0];
    if (parts & CLI_CACHE_MEMORY)
        a->options[n++] = memory[0];
    return (cli_group){"kv cache options", a->options, n};
}

void cli_cache_apply(const cli_cache_args *a, exl_generator_params *gp) {
    gp->cache_k_bits = a->k_bits, gp->cache_v_bits = a->v_bits;
    if (!a->tokens)
        return;
    if (a->tokens < gp->page_size)
        gp->page_size = (int32_t)a->tokens;
    long pages = a->tokens / gp->page_size;
    gp->n_pages = pages < INT32_MAX ? (int32_t)pages : INT32_MAX;
}

static int parse_bits(const char *s, int32_t *bits, const char **end) {
    char *e;
    errno = 0;
    long b = strtol(s, &e, 10);
    if (e == s || errno || !(b == 16 || b == 8 || b == 6 || b == 4))
        return -1;
    *bits = (int32_t)b;
    *end = e;
    return 0;
}

int cli_cache_get(cli_cache_args *a, const char *cmd) {
    if (!a->bits)
        return CLI_GO_ON;
    const char *rest;
    if (parse_bits(a->bits, &a->k_bits, &rest) ||
        (*rest && (*rest != ',' || parse_bits(rest + 1, &a->v_bits, &rest) || *rest)))
        return cli_usage_error(cmd,
                               "--cache-bits takes 16, 8, 6 or 4 bits for keys, then optionally ',' and those "
                               "for values, not '%s'",
                               a->bits);
    if (a->bits[strcspn(a->bits, ",")] != ',')
        a->v_bits = a->k_bits;
    return CLI_GO_ON;
}

cli_group cli_sampling_group(cli_sampling_args *a) {
    exl_sampling *s = &a->sampling;
    *s = exl_sampling_default();
    s->seed = (uint64_t)time(NULL);
    a->greedy = 0;
    const cli_option options[] = {
        {NULL, "--greedy", CLI_FLAG, &a->greedy, NULL,
         .help = "always take the most likely token (temperature 0, whatever\n--temperature says)"},
        {NULL, "--temperature", CLI_FLOAT, &s->temperature, "T", .lo = 0, .hi = 100, .help = "0 = greedy"},
        {NULL, "--top-k", CLI_INT, &s->top_k, "K", .lo = 0, .hi = 1 << 24,
         .help = "keep the K most likely tokens; 0 = off"},
        {NULL, "--top-p", CLI_FLOAT, &s->top_p, "P", .lo = 0, .hi = 1,
         .help = "keep the most likely tokens up to probability P; 1 = off"},
        {NULL, "--min-p", CLI_FLOAT, &s->min_p, "P", .lo = 0, .hi = 1,
         .help = "drop tokens below P times the top probability; 0 = off"},
        {NULL, "--repeat-penalty", CLI_FLOAT, &s->repetition_penalty, "R", .lo = 0.01, .hi = 100,
         .help = "penalize the tokens seen in prompt and completion; 1 = off"},
        {NULL, "--seed", CLI_SEED, &s->seed, "S", .help = "random seed", .default_text = "from the clock"},
    };
    _Static_assert(sizeof options == sizeof a->options, "cli_sampling_args.options holds the group");
    memcpy(a->options, options, sizeof options);
    return (cli_group){"sampling options (the library's defaults, exl_sampling_default, as the server's)", a->options,
                       (int)(sizeof options / sizeof options[0])};
}

exl_sampling cli_sampling_get(const cli_sampling_args *a) {
    exl_sampling s = a->sampling;
    if (a->greedy)
        s.temperature = 0;
    return s;
}
