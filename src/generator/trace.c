/* trace.c - the opt-in step trace (EXL_STEP_TRACE=FILE): a line per step and a line per job, appended to FILE, so
 * that a run shows where a job's time to first token goes (waiting for a step, admission, prompt steps).
 *
 * Times are CLOCK_MONOTONIC seconds (the clock of Python's time.perf_counter on Linux, so a client's own times can be
 * set beside them). Lines:
 *   step N begin T planned T end T rows R seqs S prompt_rows P inbox I admitted A copied C ahead kept|dropped|none
 *     begin: the step starts (takes in submitted jobs); planned: admitted, planned, before the forward; end: its
 *     events are made. inbox: jobs submitted since the step before; admitted: jobs that started running; copied:
 *     partial prefix pages copied at admission.
 *   job ID submit T admit T first T prompt N cached N step_admit N step_first N
 *     written once its first token is out (or at its end without one: first -1). step_*: the step numbers. */
#include "generator/generator.h"

#include "base/error.h"

#include <stdlib.h>
#include <time.h>

double exl_gen_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void exl_gen_trace_open(exl_generator *g) {
    const char *path = getenv("EXL_STEP_TRACE");
    if (!path || !*path)
        return;
    g->trace.f = fopen(path, "a");
    if (!g->trace.f)
        fprintf(stderr, "exl: EXL_STEP_TRACE: cannot open %s for appending\n", path);
}

void exl_gen_trace_close(exl_generator *g) {
    if (g->trace.f)
        fclose(g->trace.f);
    g->trace.f = NULL;
}

void exl_gen_trace_begin(exl_generator *g, int32_t inbox) {
    exl_gen_trace *t = &g->trace;
    t->begin = exl_gen_now();
    t->planned = t->begin;
    t->inbox = inbox;
    t->admitted = 0;
    t->copied0 = g->stats.pages_copied;
    t->ahead = 'n';
}

void exl_gen_trace_planned(exl_generator *g, int64_t ticket) {
    exl_gen_trace *t = &g->trace;
    t->planned = exl_gen_now();
    t->ahead = ticket >= 0 ? 'k' : g->ahead.dropped != t->dropped0 ? 'd' : 'n';
    t->dropped0 = g->ahead.dropped;
}

static void job_line(exl_generator *g, exl_job *j) {
    if (j->traced || !g->trace.f)
        return;
    j->traced = 1;
    fprintf(g->trace.f,
            "job %llu submit %.6f admit %.6f first %.6f prompt %d cached %d step_admit %lld step_first %lld\n",
            (unsigned long long)j->id, j->t_submit, j->t_admit ? j->t_admit : -1.0, j->t_first ? j->t_first : -1.0,
            (int)j->n_prompt, (int)j->n_cached_prompt, (long long)j->step_admit, (long long)j->step_first);
}

void exl_gen_trace_end(exl_generator *g) {
    exl_gen_trace *t = &g->trace;
    if (!t->f) {
        t->step++;
        return;
    }
    int32_t rows = 0, prompt_rows = 0;
    for (int32_t s = 0; s < g->n_step; s++) {
        rows += g->steps[s].n_new;
        if (g->steps[s].n_past < g->step_jobs[s]->n_prompt)
            prompt_rows += g->steps[s].n_new;
    }
    const char *ahead = t->ahead == 'k' ? "kept" : t->ahead == 'd' ? "dropped" : "none";
    fprintf(
        t->f,
        "step %lld begin %.6f planned %.6f end %.6f rows %d seqs %d prompt_rows %d inbox %d admitted %d copied %lld "
        "ahead %s\n",
        (long long)t->step, t->begin, t->planned, exl_gen_now(), (int)rows, (int)g->n_step, (int)prompt_rows,
        (int)t->inbox, (int)t->admitted, (long long)(g->stats.pages_copied - t->copied0), ahead);
    for (int32_t s = 0; s < g->n_step; s++)
        if (g->step_jobs[s]->t_first)
            job_line(g, g->step_jobs[s]);
    for (int32_t i = 0; i < g->done.n; i++)
        job_line(g, g->done.v[i]);
    fflush(t->f);
    t->step++;
}
