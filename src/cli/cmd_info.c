/* cmd_info.c - `exl info`: describe a model directory. */
#include "cli.h"
#include "options.h"

#include <stdio.h>

static const char ABOUT[] = "Print a model's architecture, sizes, the format and bits per weight of its linear layers\n"
                            "(grouped by kind: q/k/v/o, gate/up/down, head...), the dtype of each tensor group, the\n"
                            "parameter count and the memory it needs.";

int cmd_info(int argc, char **argv) {
    cli_model_args model;
    int verbose = 0;
    const cli_option options[] = {
        {NULL, "--verbose", CLI_FLAG, &verbose, NULL, .help = "one line per linear layer instead of one per kind"},
    };
    const cli_command cmd = {"info",
                             "-m DIR [--verbose]",
                             ABOUT,
                             NULL,
                             {CLI_GROUP("options", options), cli_model_group(&model, CLI_MODEL_DIR)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc != CLI_GO_ON)
        return rc;
    model.params.device = EXL_DEVICE_CPU;
    model.params.load_only = 1; /* describe also what exl cannot run yet */
    exl_model *m;
    exl_status st = exl_model_load(model.dir, &model.params, &m);
    if (st != EXL_OK)
        return cli_error(st);
    char *report;
    st = verbose ? exl_model_report(m, &report) : exl_model_report_grouped(m, &report);
    if (st == EXL_OK) {
        fputs(report, stdout);
        exl_string_free(report);
    }
    exl_model_free(m);
    return st == EXL_OK ? 0 : cli_error(st);
}
