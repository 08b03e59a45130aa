/* progress.c - progress bars for long commands (perplexity, quantization, loading). */
#include "progress.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

void cli_progress_begin(cli_progress *p, const char *label, long total) {
    const char *env = getenv("EXL_PROGRESS");
    p->label = label;
    p->total = total > 0 ? total : 1;
    p->start = now();
    p->last_draw = 0;
    p->enabled = env ? !strcmp(env, "1") : isatty(STDERR_FILENO);
}

void cli_progress_update(cli_progress *p, long done, const char *extra) {
    if (!p->enabled)
        return;
    double t = now();
    if (done < p->total && t - p->last_draw < 0.1)
        return;
    p->last_draw = t;
    int width = 30, fill = (int)(width * done / p->total);
    char bar[64];
    for (int i = 0; i < width; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    double el = t - p->start;
    double eta = done > 0 ? el * (p->total - done) / done : 0;
    fprintf(stderr, "\r%s [%s] %ld/%ld %.0fs elapsed, %.0fs left %s", p->label, bar, done, p->total, el, eta,
            extra ? extra : "");
    fflush(stderr);
}

void cli_progress_end(cli_progress *p) {
    if (!p->enabled)
        return;
    cli_progress_update(p, p->total, NULL);
    fputc('\n', stderr);
}
