/* cmd_info.c - `exl info`: describe a model directory. */
#include "cli.h"
#include "options.h"

#include <stdio.h>

static const char ABOUT[] = "Print a model's architecture, sizes, the dtype or quantization of each tensor group,\n"
                            "the parameter count and the memory it needs.";

int cmd_info(int argc, char **argv) {
    cli_model_args model;
    const cli_command cmd = {"info", "-m DIR", ABOUT, NULL, {cli_model_group(&model, CLI_MODEL_DIR)}};
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
    st = exl_model_report(m, &report);
    if (st == EXL_OK) {
        fputs(report, stdout);
        exl_string_free(report);
    }
    exl_model_free(m);
    return st == EXL_OK ? 0 : cli_error(st);
}
