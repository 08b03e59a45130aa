/* cmd_quantize.c - `exl quantize`: a Hugging Face model to EXL2 (measured bit allocation)
 * or GPTQ, with calibration text from the user's files. */
#include "cli.h"
#include "options.h"
#include "progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char ABOUT[] =
    "EXL2 measures the error of candidate bit allocations for every attention and MLP block\n"
    "(or reuses --measurement), picks one per block within B bits per weight (decoder layers;\n"
    "the head gets H bits), quantizes with GPTQ and writes output.safetensors, config.json\n"
    "(quantization_config), measurement.json and the model's other files to OUT_DIR.\n"
    "GPTQ writes model.safetensors (AutoGPTQ v1 layout) and quantize_config.json; --rtn rounds\n"
    "to nearest without calibration. Calibration: the files are tokenized and cut into N rows\n"
    "of L tokens. OUT_DIR must be empty or absent; an interrupted run continues from its last\n"
    "finished layer when the same command is given again.\n"
    "--device: where the big fp32 products (layer matmuls, Hessians, GPTQ updates) run; the\n"
    "report's first line names the device used.";

static void on_progress(void *user, const char *stage, int32_t done, int32_t total) {
    cli_progress *p = user;
    if (!p->label || strcmp(p->label, stage)) {
        if (p->label)
            cli_progress_end(p);
        cli_progress_begin(p, stage, total);
    }
    cli_progress_update(p, done, NULL);
}

int cmd_quantize(int argc, char **argv) {
    exl_quantize_params p = exl_quantize_default_params();
    cli_model_args model;
    cli_list cal = {0};
    int format = -1;
    const cli_option options[] = {
        {"-i", NULL, CLI_STRING, &p.in_dir, "HF_DIR", .help = "the Hugging Face model directory", .required = 1},
        {"-o", NULL, CLI_STRING, &p.out_dir, "OUT_DIR", .help = "where the quantized model goes", .required = 1},
        {NULL, "--format", CLI_CHOICE, &format, "exl2|gptq", .help = "the output format", .required = 1},
        {NULL, "--calibration", CLI_LIST_REST, &cal, "FILE", .help = "calibration text (UTF-8); not needed with --rtn"},
        {NULL, "--rows", CLI_INT, &p.rows, "N", .help = "calibration rows", .lo = 1, .hi = 1 << 20},
        {NULL, "--length", CLI_INT, &p.length, "L", .help = "tokens per calibration row", .lo = 1, .hi = 1 << 20},
    };
    const cli_option exl2[] = {
        {NULL, "--bpw", CLI_DOUBLE, &p.bpw, "B", .help = "bits per weight of the decoder layers", .lo = 1, .hi = 16},
        {NULL, "--head-bits", CLI_INT, &p.head_bits, "H", .help = "bits of lm_head (2-6 or 8)", .lo = 1, .hi = 16},
        {NULL, "--measurement", CLI_STRING, &p.measurement, "FILE", .help = "reuse this measurement.json"},
    };
    const cli_option gptq[] = {
        {NULL, "--bits", CLI_INT, &p.bits, "N", .help = "bits per weight (2, 3, 4 or 8)", .lo = 1, .hi = 16},
        {NULL, "--group-size", CLI_INT, &p.group_size, "G", .help = "input rows per group; -1 = one group", .lo = -1,
         .hi = 1 << 20},
        {NULL, "--act-order", CLI_FLAG, &p.act_order, NULL, .help = "quantize columns by decreasing activation"},
        {NULL, "--sym", CLI_FLAG, &p.sym, NULL, .help = "symmetric (no zero points)"},
        {NULL, "--rtn", CLI_FLAG, &p.rtn, NULL, .help = "round to nearest (no Hessian, no calibration)"},
    };
    const cli_command cmd = {"quantize",
                             "-i HF_DIR -o OUT_DIR --format exl2|gptq --calibration FILE... [options]",
                             ABOUT,
                             NULL,
                             {CLI_GROUP("options", options), CLI_GROUP("exl2 options", exl2),
                              CLI_GROUP("gptq options", gptq), cli_model_group(&model, CLI_MODEL_DEVICE)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc != CLI_GO_ON) {
        cli_list_free(&cal);
        return rc;
    }
    p.format = format == 1 ? EXL_QUANT_GPTQ : EXL_QUANT_EXL2;
    p.device = model.params.device;
    p.n_threads = model.params.n_threads;
    if (!cal.n && !(p.format == EXL_QUANT_GPTQ && p.rtn))
        return cli_usage_error("quantize", "missing calibration text: give --calibration FILE... (UTF-8 text)");
    p.calibration = cal.items;
    p.n_calibration = cal.n;
    cli_progress bar = {0};
    p.progress = on_progress;
    p.progress_user = &bar;
    char *report = NULL;
    exl_status st = exl_quantize(&p, &report);
    if (bar.label)
        cli_progress_end(&bar);
    cli_list_free(&cal);
    if (st != EXL_OK)
        return cli_error(st);
    if (report)
        fputs(report, stdout);
    exl_string_free(report);
    printf("wrote %s\n", p.out_dir);
    return 0;
}
