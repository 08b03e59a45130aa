/* qz_prof.c - EXL_QUANT_PROFILE=1: where a quantization's wall time went, one notice per layer and pass.
 *
 * The parts nest (a candidate forward uploads rows, a GPTQ runs its scale search): each moment counts for the
 * innermost part entered, so the parts of a line add up to the layer's wall time ("other": in none); each part shows
 * wall seconds / CPU seconds of the whole process (all threads: the work done, whatever else loads the machine). With
 * the
 * profile on, entering and leaving a part waits for the backend (its synchronize), so that device work is counted
 * where it was launched rather than where the host next waited for it; the count after each part is how often it
 * was entered, and "switches" how often the profile waited (each switch of parts: waits the run has without the
 * profile are not counted). Off (the default) every call returns at once. Only the thread that runs exl_quantize
 * enters parts. */
#include "convert/qz.h"

#include "base/notice.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_DEPTH 8

static const char *const part_names[EXL_QZ_PROF_N] = {
    "calib_fwd", "cand_fwd", "transfer", "hessian", "factor", "gptq", "scales",      "rows",
    "update",    "trial",    "accuracy", "permute", "load",   "save", "cand_shared",
};

static struct {
    int on;
    exl_backend *be;
    int depth;
    exl_qz_prof_part stack[MAX_DEPTH];
    double last, start, last_cpu, start_cpu;
    double seconds[EXL_QZ_PROF_N + 1], cpu[EXL_QZ_PROF_N + 1]; /* the last: in no part */
    int64_t calls[EXL_QZ_PROF_N];
    int64_t switches;
} prof;

static double clock_s(clockid_t id) {
    struct timespec t;
    clock_gettime(id, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

/* the time since the last switch to the part on top (or to none), after the device caught up */
static void charge(void) {
    prof.be->ops->synchronize(prof.be);
    prof.switches++;
    double t = clock_s(CLOCK_MONOTONIC), c = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    int part = prof.depth ? prof.stack[prof.depth - 1] : EXL_QZ_PROF_N;
    prof.seconds[part] += t - prof.last;
    prof.cpu[part] += c - prof.last_cpu;
    prof.last = t;
    prof.last_cpu = c;
}

void exl_qz_prof_init(exl_backend *be) {
    const char *e = getenv("EXL_QUANT_PROFILE");
    memset(&prof, 0, sizeof prof);
    prof.on = be && e && *e && strcmp(e, "0");
    prof.be = be;
    prof.start = prof.last = clock_s(CLOCK_MONOTONIC);
    prof.start_cpu = prof.last_cpu = clock_s(CLOCK_PROCESS_CPUTIME_ID);
}

void exl_qz_prof_enter(exl_qz_prof_part part) {
    if (!prof.on)
        return;
    charge();
    if (prof.depth < MAX_DEPTH)
        prof.stack[prof.depth] = part;
    prof.depth++;
    prof.calls[part]++;
}

void exl_qz_prof_leave(void) {
    if (!prof.on)
        return;
    if (prof.depth <= MAX_DEPTH)
        charge();
    prof.depth--;
}

void exl_qz_prof_report(const char *stage, int32_t layer) {
    if (!prof.on)
        return;
    charge();
    char line[900];
    int n = snprintf(line, sizeof line, "profile %s layer %d: %.2f/%.2f s:", stage, layer, prof.last - prof.start,
                     prof.last_cpu - prof.start_cpu);
    for (int i = 0; i < EXL_QZ_PROF_N && n < (int)sizeof line; i++)
        if (prof.calls[i])
            n += snprintf(line + n, sizeof line - (size_t)n, " %s %.2f/%.2f (%lld)", part_names[i], prof.seconds[i],
                          prof.cpu[i], (long long)prof.calls[i]);
    if (n < (int)sizeof line)
        n += snprintf(line + n, sizeof line - (size_t)n, " other %.2f/%.2f", prof.seconds[EXL_QZ_PROF_N],
                      prof.cpu[EXL_QZ_PROF_N]);
    if (n < (int)sizeof line)
        snprintf(line + n, sizeof line - (size_t)n, "; switches %lld", (long long)prof.switches);
    exl_notice("%s", line);
    memset(prof.seconds, 0, sizeof prof.seconds);
    memset(prof.cpu, 0, sizeof prof.cpu);
    memset(prof.calls, 0, sizeof prof.calls);
    prof.switches = 0;
    prof.start = prof.last;
    prof.start_cpu = prof.last_cpu;
}
