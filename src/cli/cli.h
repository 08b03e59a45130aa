/* cli.h - the exl subcommands and the messages they share (options: options.h). */
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
#endif
