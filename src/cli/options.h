/* options.h - the table-driven option parser of the exl commands. A command declares a table of
 * options (short and long name, kind, target, value name, help) and adds the shared groups (model,
 * sampling) defined once here; cli_parse fills the targets and generates --help from the tables. */
#ifndef EXL_CLI_OPTIONS_H
#define EXL_CLI_OPTIONS_H

#include "exl.h"

typedef enum cli_kind {
    CLI_FLAG,      /* int: set to 1; takes no value */
    CLI_STRING,    /* const char * */
    CLI_CHOICE,    /* int: the index of the value among the '|'-separated words of `value` */
    CLI_LIST,      /* cli_list: one value per use, repeatable */
    CLI_LIST_REST, /* cli_list: every value up to the next option */
    CLI_INT,       /* int32_t in [lo, hi] */
    CLI_LONG,      /* long in [lo, hi] */
    CLI_FLOAT,     /* float in [lo, hi] */
    CLI_DOUBLE,    /* double in [lo, hi] */
    CLI_SEED,      /* uint64_t, any */
    CLI_DEVICE,    /* exl_device: cpu, cuda (or gpu), auto */
    CLI_SPLIT,     /* float[EXL_MAX_GPU_SPLIT]: comma-separated positive numbers, the rest 0 */
} cli_kind;

typedef struct cli_list {
    const char **items; /* point into argv; free the array with cli_list_free */
    int n;
} cli_list;

void cli_list_free(cli_list *list);

typedef struct cli_option {
    const char *short_name; /* "-m", or NULL */
    const char *long_name;  /* "--model", or NULL */
    cli_kind kind;
    void *target;
    const char *value;        /* the value's name in help and messages ("DIR"); CLI_CHOICE: "exl2|gptq" */
    const char *help;         /* lines separated by '\n' */
    double lo, hi;            /* numeric kinds: the accepted range */
    int required;             /* a usage error when not given */
    const char *default_text; /* help's "(default ...)": NULL = the target's value before parsing, "" = none */
} cli_option;

typedef struct cli_group {
    const char *title; /* the heading in --help */
    const cli_option *options;
    int n_options;
} cli_group;

#define CLI_GROUP(title, table) ((cli_group){(title), (table), (int)(sizeof(table) / sizeof((table)[0]))})
#define CLI_MAX_GROUPS 5

typedef struct cli_command {
    const char *name;  /* "run" */
    const char *usage; /* the synopsis after "usage: exl run " */
    const char *about; /* the text between the synopsis and the options */
    const char *notes; /* the text after the options, or NULL */
    cli_group groups[CLI_MAX_GROUPS];
} cli_command;

/* cli_parse's answer when the command should go on. */
#define CLI_GO_ON (-1)

/* Parse argv[1..argc) into the targets (long options also as --name=value). Returns CLI_GO_ON, or
 * the command's exit code: 0 when -h/--help printed the help, 2 after a usage error on stderr
 * (unknown option, missing or bad value, missing required option). */
int cli_parse(const cli_command *cmd, int argc, char **argv);

/* ---------------------------------------------------------------- shared groups */

/* Which options the model group has. */
enum { CLI_MODEL_DIR = 1, CLI_MODEL_DEVICE = 2, CLI_MODEL_ALL = 3, CLI_MODEL_LORA = 4 };

/* -m/--model DIR (default: the embedded model, default_model.h), --device, -t/--threads, --tp, --gpu-split,
 * --lora DIR[:SCALE] (repeatable); the defaults are exl_model_default_params(). */
typedef struct cli_model_args {
    const char *dir;
    exl_model_params params;
    cli_list lora;
    cli_option options[6];
} cli_model_args;

cli_group cli_model_group(cli_model_args *args, int parts);
/* After cli_parse: load the model, then its --lora adapters as the set every sequence runs with (freed with the
 * model; the list is freed here). */
exl_status cli_model_load(cli_model_args *args, exl_model **out);
/* Before loading: quantized matmuls on the CPU with exact fp32 activations, not the default int8 ones, unless
 * $EXL_CPU_ACT says otherwise (the commands that measure the model: logits, perplexity, quantize). */
void cli_exact_cpu_activations(void);

/* The KV cache: --cache-bits K[,V], --cache-tokens N (commands that run a generator), --gpu-memory F (those that
 * size the cache to the memory). */
enum { CLI_CACHE_BITS = 1, CLI_CACHE_TOKENS = 2, CLI_CACHE_MEMORY = 4 };

typedef struct cli_cache_args {
    const char *bits;       /* --cache-bits as given, or NULL */
    int32_t k_bits, v_bits; /* from it (cli_cache_get); 16 by default */
    long tokens;            /* --cache-tokens; 0: the command's default */
    float gpu_memory;       /* --gpu-memory; 0: the library's default */
    cli_option options[3];
} cli_cache_args;

/* tokens_default: what help says the command's cache holds without --cache-tokens. */
cli_group cli_cache_group(cli_cache_args *args, int parts, const char *tokens_default);
/* After cli_parse: k_bits and v_bits from --cache-bits. Returns CLI_GO_ON, or 2 after a usage error on stderr. */
int cli_cache_get(cli_cache_args *args, const char *cmd);
/* A generator's cache as the group says: the bits, and with --cache-tokens the pages that hold them (pages of
 * gp->page_size, or one page of them all when fewer). */
void cli_cache_apply(const cli_cache_args *args, exl_generator_params *gp);

/* Speculative decoding (draft_args.c): --draft-model DIR, --draft-tokens K, --draft-fixed, --ngram N. */
typedef struct cli_draft_args {
    const char *model_dir;
    int32_t tokens, ngram;
    int fixed;
    cli_option options[4];
} cli_draft_args;

cli_group cli_draft_group(cli_draft_args *args);
/* After cli_parse: 2 after a usage error on stderr (--draft-tokens without a draft model or --ngram), else
 * CLI_GO_ON. */
int cli_draft_get(cli_draft_args *args, const char *cmd);
/* Load the draft model (*draft, NULL without --draft-model) as the model was loaded (params), and set gp's
 * drafting fields. */
exl_status cli_draft_apply(const cli_draft_args *args, const exl_model_params *params, exl_model **draft,
                           exl_generator_params *gp);

/* --greedy, --temperature, --top-k, --top-p, --min-p, --repeat-penalty, --seed; the defaults are
 * the library's, exl_sampling_default() (the server's too), with the seed from the clock. */
typedef struct cli_sampling_args {
    exl_sampling sampling;
    int greedy;
    cli_option options[7];
} cli_sampling_args;

cli_group cli_sampling_group(cli_sampling_args *args);
/* After cli_parse: --greedy wins over --temperature. */
exl_sampling cli_sampling_get(const cli_sampling_args *args);

#endif
