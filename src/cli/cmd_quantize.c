/* cmd_quantize.c - `exl quantize`: a Hugging Face model to EXL2 (measured bit allocation)
 * or GPTQ, with calibration text from the user's files. */
#include "cli.h"
#include "progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void help(void) {
    printf("usage: exl quantize -i HF_DIR -o OUT_DIR --calibration FILE... [--rows N] [--length L] [-t THREADS]\n"
           "         [--device cpu|cuda|auto]\n"
           "         --format exl2 --bpw B [--head-bits H] [--measurement FILE]\n"
           "         --format gptq [--bits 4] [--group-size 128] [--act-order] [--sym] [--rtn]\n\n"
           "EXL2 measures the error of candidate bit allocations for every attention and MLP block\n"
           "(or reuses --measurement), picks one per block within B bits per weight (decoder layers;\n"
           "the head gets H bits), quantizes with GPTQ and writes output.safetensors, config.json\n"
           "(quantization_config), measurement.json and the model's other files to OUT_DIR.\n"
           "GPTQ writes model.safetensors (AutoGPTQ v1 layout) and quantize_config.json; --rtn rounds\n"
           "to nearest without calibration. Calibration: the files are tokenized and cut into N rows\n"
           "of L tokens (defaults 32 x 512). OUT_DIR must be empty or absent; an interrupted run\n"
           "continues from its last finished layer when the same command is given again.\n"
           "--device: where the big fp32 products (layer matmuls, Hessians, GPTQ updates) run: auto\n"
           "(default) uses the GPU when one is usable, else the CPU; cuda insists on the GPU. The\n"
           "report's first line names the device used.\n");
}

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
    const char **cal = calloc((size_t)argc, sizeof *cal);
    int n_cal = 0, fmt_set = 0;
    if (!cal)
        return cli_error(EXL_ERR_NOMEM);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has = i + 1 < argc;
        long v;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            help();
            free(cal);
            return 0;
        } else if (!strcmp(a, "-i") && has) {
            p.in_dir = argv[++i];
        } else if (!strcmp(a, "-o") && has) {
            p.out_dir = argv[++i];
        } else if (!strcmp(a, "--format") && has) {
            const char *f = argv[++i];
            fmt_set = 1;
            if (!strcmp(f, "exl2"))
                p.format = EXL_QUANT_EXL2;
            else if (!strcmp(f, "gptq"))
                p.format = EXL_QUANT_GPTQ;
            else {
                free(cal);
                return cli_usage_error("quantize", "unknown format '%s' (exl2 or gptq)", f);
            }
        } else if (!strcmp(a, "--bpw") && has) {
            char *end;
            p.bpw = strtod(argv[++i], &end);
            if (*end || !(p.bpw > 0 && p.bpw <= 16)) {
                free(cal);
                return cli_usage_error("quantize", "--bpw must be a number of bits per weight");
            }
        } else if ((!strcmp(a, "--head-bits") || !strcmp(a, "--bits") || !strcmp(a, "--group-size") ||
                    !strcmp(a, "--rows") || !strcmp(a, "--length") || !strcmp(a, "-t")) && has) {
            if (cli_parse_int(argv[++i], !strcmp(a, "--group-size") ? -1 : 1, 1 << 20, &v)) {
                free(cal);
                return cli_usage_error("quantize", "%s needs a positive integer", a);
            }
            if (!strcmp(a, "--head-bits"))
                p.head_bits = (int32_t)v;
            else if (!strcmp(a, "--bits"))
                p.bits = (int32_t)v;
            else if (!strcmp(a, "--group-size"))
                p.group_size = (int32_t)v;
            else if (!strcmp(a, "--rows"))
                p.rows = (int32_t)v;
            else if (!strcmp(a, "--length"))
                p.length = (int32_t)v;
            else
                p.n_threads = (int32_t)v;
        } else if (!strcmp(a, "--device") && has) {
            if (cli_parse_device(argv[++i], &p.device)) {
                free(cal);
                return cli_usage_error("quantize", "unknown device '%s' (cpu, cuda or auto)", argv[i]);
            }
        } else if (!strcmp(a, "--measurement") && has) {
            p.measurement = argv[++i];
        } else if (!strcmp(a, "--act-order")) {
            p.act_order = 1;
        } else if (!strcmp(a, "--sym")) {
            p.sym = 1;
        } else if (!strcmp(a, "--rtn")) {
            p.rtn = 1;
        } else if (!strcmp(a, "--calibration") && has) {
            while (i + 1 < argc && strncmp(argv[i + 1], "-", 1))
                cal[n_cal++] = argv[++i];
        } else {
            free(cal);
            return cli_usage_error("quantize", "unknown option or missing value '%s'", a);
        }
    }
    if (!p.in_dir || !p.out_dir || !fmt_set) {
        free(cal);
        return cli_usage_error("quantize", "need -i HF_DIR, -o OUT_DIR and --format exl2|gptq");
    }
    if (!n_cal && !(p.format == EXL_QUANT_GPTQ && p.rtn)) {
        free(cal);
        return cli_usage_error("quantize", "missing calibration text: give --calibration FILE... (UTF-8 text)");
    }
    p.calibration = cal;
    p.n_calibration = n_cal;
    cli_progress bar = {0};
    p.progress = on_progress;
    p.progress_user = &bar;
    char *report = NULL;
    exl_status st = exl_quantize(&p, &report);
    if (bar.label)
        cli_progress_end(&bar);
    free(cal);
    if (st != EXL_OK)
        return cli_error(st);
    if (report)
        fputs(report, stdout);
    exl_string_free(report);
    printf("wrote %s\n", p.out_dir);
    return 0;
}
