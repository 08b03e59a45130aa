/* metrics.c - counters, histograms and their Prometheus text (see metrics.h). */
#include "server/metrics.h"

static const double TTFT_BOUNDS[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
static const double ITL_BOUNDS[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5};

static void histogram_init(exl_histogram *h, const double *bounds, int n) {
    h->bounds = bounds;
    h->n_bounds = n;
    for (int i = 0; i <= EXL_HIST_BUCKETS; i++)
        atomic_init(&h->counts[i], 0);
    atomic_init(&h->sum_us, 0);
}

void exl_metrics_init(exl_metrics *m) {
    atomic_init(&m->prompt_tokens, 0);
    histogram_init(&m->ttft, TTFT_BOUNDS, (int)(sizeof TTFT_BOUNDS / sizeof TTFT_BOUNDS[0]));
    histogram_init(&m->itl, ITL_BOUNDS, (int)(sizeof ITL_BOUNDS / sizeof ITL_BOUNDS[0]));
}

void exl_histogram_observe(exl_histogram *h, double seconds) {
    if (!(seconds >= 0))
        seconds = 0;
    int i = 0;
    while (i < h->n_bounds && seconds > h->bounds[i])
        i++;
    atomic_fetch_add(&h->counts[i], 1);
    atomic_fetch_add(&h->sum_us, (unsigned long long)(seconds * 1e6 + 0.5));
}

static int write_histogram(exl_str *out, const char *name, const char *help, const exl_histogram *h) {
    int rc = exl_str_printf(out, "# HELP %s %s\n# TYPE %s histogram\n", name, help, name);
    unsigned long long total = 0;
    for (int i = 0; i <= h->n_bounds && !rc; i++) {
        total += atomic_load(&h->counts[i]);
        if (i < h->n_bounds)
            rc = exl_str_printf(out, "%s_bucket{le=\"%g\"} %llu\n", name, h->bounds[i], total);
        else
            rc = exl_str_printf(out, "%s_bucket{le=\"+Inf\"} %llu\n", name, total);
    }
    return rc || exl_str_printf(out, "%s_sum %.6f\n%s_count %llu\n", name, (double)atomic_load(&h->sum_us) * 1e-6, name,
                                total);
}

static int gauge(exl_str *out, const char *name, const char *type, const char *help, double v) {
    return exl_str_printf(out, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

int exl_metrics_write(exl_str *out, const exl_metrics *m, const exl_generator_stats *g, const exl_http *http) {
    int rc = gauge(out, "exl_jobs_running", "gauge", "Jobs decoding now.", g->jobs_running) ||
             gauge(out, "exl_jobs_waiting", "gauge", "Jobs waiting to start.", g->jobs_waiting) ||
             gauge(out, "exl_kv_pages_used", "gauge", "KV cache pages held by jobs.", g->pages_used) ||
             gauge(out, "exl_kv_pages_total", "gauge", "KV cache pages in all.", g->pages_total) ||
             gauge(out, "exl_prompt_tokens_total", "counter", "Prompt tokens of the requests accepted.",
                   (double)atomic_load(&m->prompt_tokens)) ||
             gauge(out, "exl_generated_tokens_total", "counter", "Tokens generated.", (double)g->tokens_generated) ||
             gauge(out, "exl_draft_tokens_total", "counter", "Speculative decoding: tokens drafted.",
                   (double)g->draft_proposed) ||
             gauge(out, "exl_draft_accepted_tokens_total", "counter", "Speculative decoding: drafted tokens accepted.",
                   (double)g->draft_accepted) ||
             exl_str_printf(out, "# HELP exl_requests_total HTTP answers by status (499: the client left first).\n"
                                 "# TYPE exl_requests_total counter\n");
    for (int code = 100; code < 600 && !rc; code++) {
        uint64_t n = exl_http_status_count(http, code);
        if (n)
            rc = exl_str_printf(out, "exl_requests_total{code=\"%d\"} %llu\n", code, (unsigned long long)n);
    }
    return rc ||
                   write_histogram(out, "exl_time_to_first_token_seconds",
                                   "From a request's arrival to its first generated token.", &m->ttft) ||
                   write_histogram(out, "exl_inter_token_seconds", "Between consecutive tokens of one choice.", &m->itl)
               ? -1
               : 0;
}
