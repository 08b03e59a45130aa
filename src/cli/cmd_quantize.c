/* cmd_quantize.c - `exl quantize`: a Hugging Face model to EXL2 (measured bit allocation)
 * or GPTQ, with calibration text from the user's files. */
#include "cli.h"
#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

static const char ABOUT[] =
    "EXL2 measures the error of candidate bit allocations for every attention and MLP block\n"
    "(or reuses --measurement), picks one per block within B bits per weight (decoder layers;\n"
    "the head gets H bits), quantizes with GPTQ and writes output.safetensors, config.json\n"
    "(quantization_config), measurement.json and the model's other files to OUT_DIR.\n"
    "GPTQ writes model.safetensors (AutoGPTQ v1 layout) and quantize_config.json; --rtn rounds\n"
    "to nearest without calibration. Calibration: the files are tokenized and cut into N rows\n"
    "of L tokens. OUT_DIR must be empty or absent; an interrupted run continues from its last\n"
    "finished layer when the same command is given again. Progress goes to stderr: a line per\n"
    "finished layer (its blocks' accuracy and bits, seconds) and a bar with the time left on a\n"
    "terminal (EXL_PROGRESS=1 forces the bar, 0 turns it off).\n"
    "--device: where the big fp32 products (layer matmuls, Hessians, GPTQ updates) run; the\n"
    "report's first line names the device used.";

/* What stderr shows of a run: a line when a stage begins and for every finished layer (accuracy, bits, seconds),
 * terminal or not; on a terminal a progress bar with the time left, elsewhere a line every HEARTBEAT seconds
 * while a layer takes long. */
#define HEARTBEAT 5.0

typedef struct quant_view {
    int bar;           /* draw the bar (a terminal, or EXL_PROGRESS=1) */
    int bar_shown;     /* a bar is on the current line */
    const char *stage; /* the last stage shown */
    double last_line;  /* elapsed time of the last line */
    double seconds[2]; /* measuring, quantizing: the finished layers' time */
    int32_t layers[2];
} quant_view;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* 75 s -> "1m15s" */
static const char *duration(double s, char *buf, size_t size) {
    long t = (long)(s + 0.5);
    if (t >= 3600)
        snprintf(buf, size, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60)
        snprintf(buf, size, "%ldm%02lds", t / 60, t % 60);
    else
        snprintf(buf, size, "%lds", t);
    return buf;
}

static void print_times(const exl_quantize_status *s) {
    char a[32], b[32];
    if (s->remaining >= 0)
        fprintf(stderr, " [%s elapsed, about %s left]\n", duration(s->elapsed, a, sizeof a),
                duration(s->remaining, b, sizeof b));
    else
        fprintf(stderr, " [%s elapsed]\n", duration(s->elapsed, a, sizeof a));
}

static void on_status(void *user, const exl_quantize_status *s) {
    quant_view *v = user;
    int layered = !strcmp(s->stage, "measuring") || !strcmp(s->stage, "quantizing");
    if (v->bar_shown) {
        fputs("\r\033[K", stderr);
        v->bar_shown = 0;
    }
    if (!v->stage || strcmp(v->stage, s->stage)) {
        v->stage = s->stage;
        fprintf(stderr, "quantize: %s%s\n", s->stage, layered ? " the decoder layers" : "");
        v->last_line = s->elapsed;
    }
    if (s->finished) {
        int pass = !strcmp(s->stage, "measuring") ? 0 : 1;
        v->seconds[pass] += s->seconds;
        v->layers[pass]++;
        fprintf(stderr, "%s layer %d/%d in %.1f s:", pass ? "quantized" : "measured", s->layer + 1, s->n_layers,
                s->seconds);
        for (int32_t k = 0; k < s->n_blocks; k++) {
            fprintf(stderr, "%s %s", k ? "," : "", s->block[k].name);
            if (s->block[k].accuracy >= 0)
                fprintf(stderr, " accuracy %.4f", s->block[k].accuracy);
            fprintf(stderr, " %s %.2f bpw", pass ? "at" : "within target:", s->block[k].bpw);
        }
        print_times(s);
        v->last_line = s->elapsed;
    } else if (!v->bar && s->elapsed - v->last_line >= HEARTBEAT) {
        if (layered)
            fprintf(stderr, "%s layer %d/%d: %.0f%% of it", s->stage, s->layer + 1, s->n_layers,
                    100 * s->layer_fraction);
        else
            fprintf(stderr, "%s", s->stage);
        print_times(s);
        v->last_line = s->elapsed;
    }
    if (v->bar) {
        char bar[32], a[32], b[32];
        int width = 24, fill = (int)(width * s->fraction);
        for (int i = 0; i < width; i++)
            bar[i] = i < fill ? '#' : '.';
        bar[width] = 0;
        fprintf(stderr, "[%s] %3.0f%% %s", bar, 100 * s->fraction, s->stage);
        if (layered)
            fprintf(stderr, " layer %d/%d", s->layer + 1, s->n_layers);
        fprintf(stderr, ", %s elapsed", duration(s->elapsed, a, sizeof a));
        if (s->remaining >= 0)
            fprintf(stderr, ", about %s left", duration(s->remaining, b, sizeof b));
        v->bar_shown = 1;
    }
    fflush(stderr);
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
    cli_exact_cpu_activations(); /* the forward passes that calibrate later layers */
    p.format = format == 1 ? EXL_QUANT_GPTQ : EXL_QUANT_EXL2;
    p.device = model.params.device;
    p.n_threads = model.params.n_threads;
    if (!cal.n && !(p.format == EXL_QUANT_GPTQ && p.rtn))
        return cli_usage_error("quantize", "missing calibration text: give --calibration FILE... (UTF-8 text)");
    p.calibration = cal.items;
    p.n_calibration = cal.n;
    const char *env = getenv("EXL_PROGRESS");
    quant_view view = {.bar = env ? !strcmp(env, "1") : isatty(STDERR_FILENO)};
    p.status = on_status;
    p.status_user = &view;
    char *report = NULL;
    double t0 = now_s();
    exl_status st = exl_quantize(&p, &report);
    if (view.bar_shown)
        fputs("\r\033[K", stderr);
    cli_list_free(&cal);
    if (st != EXL_OK)
        return cli_error(st);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    fprintf(stderr,
            "quantize: done in %.1f s (this run: measuring %.1f s over %d layers, quantizing %.1f s over %d layers), "
            "peak memory %.0f MiB\n",
            now_s() - t0, view.seconds[0], view.layers[0], view.seconds[1], view.layers[1], ru.ru_maxrss / 1024.0);
    if (report)
        fputs(report, stdout);
    exl_string_free(report);
    printf("wrote %s\n", p.out_dir);
    return 0;
}
