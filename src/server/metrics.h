/* metrics.h - the server's counters and latency histograms (lock-free, updated from any thread)
 * and GET /metrics in the Prometheus text format. */
#ifndef EXL_SERVER_METRICS_H
#define EXL_SERVER_METRICS_H

#include "base/str.h"
#include "exl.h"
#include "server/http.h"

#include <stdatomic.h>

#define EXL_HIST_BUCKETS 14

typedef struct exl_histogram {
    const double *bounds; /* upper bounds in seconds, ascending; +Inf follows */
    int n_bounds;
    atomic_ullong counts[EXL_HIST_BUCKETS + 1]; /* per bucket (not cumulative); the last is +Inf */
    atomic_ullong sum_us;                       /* microseconds */
} exl_histogram;

typedef struct exl_metrics {
    atomic_ullong prompt_tokens; /* of the requests accepted */
    exl_histogram ttft;          /* request head received -> its first token */
    exl_histogram itl;           /* between tokens of one choice */
} exl_metrics;

void exl_metrics_init(exl_metrics *m);
void exl_histogram_observe(exl_histogram *h, double seconds);
/* The whole /metrics page: the generator's state, the HTTP answers by status, the counters and
 * histograms. 0, or -1 when out of memory. */
int exl_metrics_write(exl_str *out, const exl_metrics *m, const exl_generator_stats *gen, const exl_http *http);

#endif
