/* main.c - the exl command: dispatches to one subcommand per file (cmd_*.c). */
#include "cli.h"
#include "options.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int version(int argc, char **argv) {
    const cli_command cmd = {"version", "(or exl --version)", "Print the version of exl.", NULL, {{0}}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc != CLI_GO_ON)
        return rc;
    printf("exl %s\n", EXL_VERSION_STRING);
    return 0;
}

typedef struct {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *summary;
} command;

static const command commands[] = {
    {"info", cmd_info, "describe a model directory: architecture, sizes, dtypes, memory"},
    {"bench", cmd_bench, "measure prefill and decode speed against the memory-bandwidth bound"},
    {"perplexity", cmd_perplexity, "perplexity of a model on a text file (sliding windows)"},
    {"run", cmd_run, "complete prompts (streaming; several prompts run as one batch)"},
    {"chat", cmd_chat, "chat with a model in the terminal (streaming, history, /help)"},
    {"serve", cmd_serve, "serve an OpenAI-compatible HTTP API (completions, chat, SSE)"},
    {"logits", cmd_logits, "write the logits of a token sequence to a safetensors file"},
    {"quantize", cmd_quantize, "convert a Hugging Face model to EXL2 or GPTQ (calibrated, layer by layer)"},
    {"tokenize", cmd_tokenize, "print the token ids of text read on stdin"},
    {"version", version, "print the version (also: exl --version)"},
};

static void usage(FILE *f) {
    fprintf(f,
            "exl %s - fast inference for quantized LLMs (EXL2, GPTQ, fp16/bf16)\n\n"
            "usage: exl <command> [options]   (exl <command> --help for details)\n\ncommands:\n",
            EXL_VERSION_STRING);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].summary);
}

int cli_error(exl_status st) {
    fprintf(stderr, "exl: %s\n", exl_last_error()[0] ? exl_last_error() : exl_status_str(st));
    return 1;
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    fprintf(stderr, "exl %s: ", cmd);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, " (see exl %s --help)\n", cmd);
    return 2;
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version"))
        return version(argc - 1, argv + 1);
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(argv[1], commands[i].name))
            return commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "exl: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
