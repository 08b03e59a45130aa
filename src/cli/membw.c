/* membw.c - measure this machine's memory read bandwidth (for decode bounds in `exl bench`). */
#include "membw.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
} reader;

static void *read_all(void *arg) {
    reader *r = arg;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= r->n; i += 4) {
        s0 += r->p[i];
        s1 += r->p[i + 1];
        s2 += r->p[i + 2];
        s3 += r->p[i + 3];
    }
    r->sum = s0 + s1 + s2 + s3;
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

double exl_cli_read_bandwidth(int n_threads, size_t bytes) {
    if (n_threads < 1 || n_threads > 256)
        n_threads = 1;
    size_t words = bytes / 8 / (size_t)n_threads / 4 * 4;
    uint64_t *buf = malloc(words * 8 * (size_t)n_threads);
    if (!buf)
        return 0;
    memset(buf, 1, words * 8 * (size_t)n_threads);
    reader rd[256];
    pthread_t th[256];
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = now();
        for (int i = 0; i < n_threads; i++) {
            rd[i] = (reader){buf + (size_t)i * words, words, 0};
            pthread_create(&th[i], NULL, read_all, &rd[i]);
        }
        for (int i = 0; i < n_threads; i++)
            pthread_join(th[i], NULL);
        double bw = (double)words * 8 * n_threads / (now() - t0);
        if (bw > best)
            best = bw;
    }
    free(buf);
    return best;
}
