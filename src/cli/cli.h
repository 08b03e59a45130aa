/* cli.h - the exl subcommands and the helpers they share (option parsing, messages). */
#ifndef EXL_CLI_H
#define EXL_CLI_H

#include "exl.h"

int cmd_info(int argc, char **argv);
int cmd_logits(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_perplexity(int argc, char **argv);
int cmd_quantize(int argc, char **argv);
int cmd_run(int argc, char **argv);
int cmd_serve(int argc, char **argv);
int cmd_chat(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);

/* Print "exl: <message>" for the last library error and return 1. */
int cli_error(exl_status st);
/* Print "exl <cmd>: <formatted message>" to stderr and return 2 (usage errors). */
int cli_usage_error(const char *cmd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Parse an integer option value; returns 0 on success. */
int cli_parse_int(const char *s, long lo, long hi, long *out);
/* The options every model-loading command takes: -m/--model DIR, --device cpu|cuda|auto,
 * -t/--threads N. If argv[*i] is one of them (with its value), consume it and return 1;
 * return 0 if it is not; on a bad value print a usage error and return -1. */
int cli_model_option(const char *cmd, int argc, char **argv, int *i, const char **dir, exl_model_params *p);
/* Parse "cpu", "cuda" or "auto". */
int cli_parse_device(const char *s, exl_device *out);

#endif
