/* qz_status.c - where a quantization stands, for exl_quantize_params.status: the stage, the layer and how much of
 * it is done, the time so far and an estimate of the time left, and each finished layer with its blocks' accuracy
 * and bits. Calls come at most every half second within a layer (after a candidate or a linear, and after every
 * forward step of the calibration rows), and always when a layer finishes.
 *
 * The estimate: the layers left to measure at the measuring pass's mean time per layer, and the layers left to
 * quantize (and the head, counted as one) at the quantizing pass's; before a pass has finished a layer its time per
 * layer comes from the part of the current layer done, and the quantizing pass is guessed at a fifth of the
 * measuring pass until it has timed a layer of its own. */
#include "convert/qz.h"

#include <string.h>
#include <time.h>

#define STEP_INTERVAL 0.5
#define QUANT_PER_MEASURE 0.2

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

void exl_qz_clock_init(exl_qz_clock *c, const exl_quantize_params *p, int32_t n_layers) {
    memset(c, 0, sizeof *c);
    c->p = p;
    c->n_layers = n_layers;
    c->start = c->layer_start = now_s();
    c->measure_from = c->quant_from = n_layers;
}

void exl_qz_clock_plan(exl_qz_clock *c, int32_t measure_from, int32_t quant_from) {
    c->measure_from = measure_from;
    c->quant_from = quant_from;
}

/* mean seconds per layer of a pass (measuring: 0, quantizing: 1), < 0 when unknown */
static double per_layer(const exl_qz_clock *c, int pass, double t) {
    if (c->layers[pass] > 0)
        return c->seconds[pass] / c->layers[pass];
    if (c->pass == pass && c->fraction > 0.02)
        return (t - c->layer_start) / c->fraction;
    return -1;
}

static void report(exl_qz_clock *c, double t, int finished) {
    c->last_call = t;
    if (!c->p->status)
        return;
    exl_quantize_status s = {0};
    s.stage = c->stage;
    s.layer = c->layer;
    s.n_layers = c->n_layers;
    s.layer_fraction = c->fraction;
    s.elapsed = t - c->start;
    double tm = per_layer(c, 0, t), tq = per_layer(c, 1, t);
    if (tq < 0 && tm >= 0)
        tq = tm * QUANT_PER_MEASURE;
    double meas_left = 0, quant_left = 0; /* layers; the head counts as one quantized layer */
    if (!strcmp(c->stage, "measuring")) {
        meas_left = c->n_layers - c->layer - c->fraction;
        quant_left = c->n_layers + 1;
    } else if (!strcmp(c->stage, "quantizing")) {
        quant_left = c->n_layers - c->layer - c->fraction + 1;
    } else if (!strcmp(c->stage, "head")) {
        quant_left = 1 - c->fraction;
    } else if (!strcmp(c->stage, "calibrating")) {
        meas_left = c->n_layers - c->measure_from;
        quant_left = c->n_layers - c->quant_from + 1;
    }
    if ((meas_left > 0 && tm < 0) || (quant_left > 0 && tq < 0))
        s.remaining = -1;
    else
        s.remaining = (meas_left > 0 ? meas_left * tm : 0) + (quant_left > 0 ? quant_left * tq : 0);
    s.fraction = s.remaining >= 0 && s.elapsed + s.remaining > 0 ? s.elapsed / (s.elapsed + s.remaining) : 0;
    if (!strcmp(c->stage, "writing"))
        s.fraction = c->fraction;
    s.finished = finished;
    if (finished) {
        s.seconds = t - c->layer_start;
        s.n_blocks = c->n_blocks;
        for (int32_t k = 0; k < c->n_blocks; k++) {
            s.block[k].name = c->block_name[k];
            s.block[k].accuracy = c->accuracy[k];
            s.block[k].bpw = c->bpw[k];
        }
    }
    c->p->status(c->p->status_user, &s);
}

void exl_qz_clock_stage(exl_qz_clock *c, const char *stage, int32_t layer) {
    double t = now_s();
    c->stage = stage;
    c->layer = layer;
    c->pass = !strcmp(stage, "measuring") ? 0 : 1;
    c->fraction = 0;
    c->n_blocks = 0;
    c->layer_start = t;
    report(c, t, 0);
}

void exl_qz_clock_step(exl_qz_clock *c, double fraction) {
    double t = now_s();
    c->fraction = fraction;
    if (t - c->last_call >= STEP_INTERVAL)
        report(c, t, 0);
}

void exl_qz_clock_tick(void *user) {
    exl_qz_clock *c = user;
    double t = now_s();
    if (c->stage && t - c->last_call >= STEP_INTERVAL)
        report(c, t, 0);
}

void exl_qz_clock_block(exl_qz_clock *c, int k, const char *name, double accuracy, double bits) {
    if (k < 0 || k > 1)
        return;
    c->block_name[k] = name;
    c->accuracy[k] = accuracy;
    c->bpw[k] = bits;
    c->n_blocks = k + 1 > c->n_blocks ? k + 1 : c->n_blocks;
}

void exl_qz_clock_layer_done(exl_qz_clock *c) {
    double t = now_s();
    int pass = c->pass;
    c->seconds[pass] += t - c->layer_start;
    c->layers[pass]++;
    c->fraction = 1;
    report(c, t, 1);
}
