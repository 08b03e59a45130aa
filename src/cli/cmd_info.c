/* cmd_info.c - `exl info`: describe a model directory. */
#include "cli.h"

#include <stdio.h>
#include <string.h>

int cmd_info(int argc, char **argv) {
    const char *dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            printf("usage: exl info -m DIR\n\n"
                   "Print a model's architecture, sizes, the dtype or quantization of each tensor group,\n"
                   "the parameter count and the memory it needs.\n");
            return 0;
        } else if ((!strcmp(argv[i], "-m") || !strcmp(argv[i], "--model")) && i + 1 < argc) {
            dir = argv[++i];
        } else {
            return cli_usage_error("info", "unknown option '%s'", argv[i]);
        }
    }
    if (!dir)
        return cli_usage_error("info", "missing -m DIR");
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    p.load_only = 1; /* describe also what exl cannot run yet */
    exl_model *model;
    exl_status st = exl_model_load(dir, &p, &model);
    if (st != EXL_OK)
        return cli_error(st);
    char *report;
    st = exl_model_report(model, &report);
    if (st == EXL_OK) {
        fputs(report, stdout);
        exl_string_free(report);
    }
    exl_model_free(model);
    return st == EXL_OK ? 0 : cli_error(st);
}
