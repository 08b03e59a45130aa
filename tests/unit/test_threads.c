/* test_threads.c - the fork-join pool: every index runs once per job, and a waiting thread gives its core away. */
#include "base/threads.h"
#include "test.h"

#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#define MAX_POOL 16

typedef struct {
    atomic_int runs[MAX_POOL];
    atomic_int bad_index;
    long slow_share_ns; /* how long each share but index 0 takes (asleep), 0 for none */
} tally;

static void sleep_ns(long ns) {
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

static double clock_seconds(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void tally_task(void *ctx, int index, int count) {
    tally *t = ctx;
    if (index < 0 || index >= count || index >= MAX_POOL) {
        atomic_fetch_add(&t->bad_index, 1);
        return;
    }
    atomic_fetch_add(&t->runs[index], 1);
    if (index > 0 && t->slow_share_ns > 0)
        sleep_ns(t->slow_share_ns);
}

static void check_tally(tally *t, int n, int rounds) {
    for (int i = 0; i < n; i++)
        CHECK_MSG(atomic_load(&t->runs[i]) == rounds, "index %d ran %d of %d times", i, atomic_load(&t->runs[i]),
                  rounds);
    CHECK(atomic_load(&t->bad_index) == 0);
}

static atomic_int hogs_stop;

static void *hog_main(void *unused) {
    (void)unused;
    while (!atomic_load_explicit(&hogs_stop, memory_order_relaxed))
        ;
    return NULL;
}

/* One busy thread per core, and fork-joins whose shares but index 0 are slow (they sleep 5 ms, as a worker does that
 * lost its core to a busy neighbour): the caller must sleep while it waits rather than spin, or it burns the core
 * the late share needs. A caller that spins until the last worker is done used a share of the ~100 ms wait
 * (tens of ms); one that polls for at most 100 microseconds before sleeping uses about 2 ms. */
EXL_TEST(caller_waiting_for_late_shares_gives_its_core_away) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int n_hogs = cores > 0 && cores < MAX_POOL ? (int)cores : MAX_POOL;
    pthread_t hogs[MAX_POOL];
    atomic_store(&hogs_stop, 0);
    int started = 0;
    while (started < n_hogs && pthread_create(&hogs[started], NULL, hog_main, NULL) == 0)
        started++;

    exl_pool *pool = NULL;
    exl_status st = exl_pool_init(n_hogs, &pool);
    static tally t = {.slow_share_ns = 5000000};
    const int rounds = 20;
    double cpu_begin = clock_seconds(CLOCK_THREAD_CPUTIME_ID), wall_begin = clock_seconds(CLOCK_MONOTONIC);
    for (int r = 0; st == EXL_OK && r < rounds; r++)
        exl_pool_run(pool, tally_task, &t);
    double cpu = clock_seconds(CLOCK_THREAD_CPUTIME_ID) - cpu_begin;
    double wall = clock_seconds(CLOCK_MONOTONIC) - wall_begin;

    atomic_store(&hogs_stop, 1);
    for (int i = 0; i < started; i++)
        pthread_join(hogs[i], NULL);
    REQUIRE_OK(st);
    int n = exl_pool_size(pool);
    exl_pool_free(pool);
    printf("    %d fork-joins of %d threads beside %d busy threads: %.1f ms, the caller used %.2f ms of CPU\n", rounds,
           n, started, wall * 1e3, cpu * 1e3);
    check_tally(&t, n, rounds);
    CHECK_MSG(cpu < 0.010, "the caller used %.1f ms of CPU waiting for the slow shares: it spins", cpu * 1e3);
}

/* Idle workers must sleep too: a pool between jobs costs (almost) nothing. */
EXL_TEST(idle_workers_sleep) {
    exl_pool *pool;
    REQUIRE_OK(exl_pool_init(4, &pool));
    static tally t;
    exl_pool_run(pool, tally_task, &t);
    sleep_ns(1000000); /* past the workers' polling */
    double begin = clock_seconds(CLOCK_PROCESS_CPUTIME_ID);
    sleep_ns(50000000);
    double cpu = clock_seconds(CLOCK_PROCESS_CPUTIME_ID) - begin;
    exl_pool_run(pool, tally_task, &t);
    exl_pool_free(pool);
    check_tally(&t, 4, 2);
    CHECK_MSG(cpu < 0.005, "an idle pool used %.1f ms of CPU in 50 ms", cpu * 1e3);
}

/* Jobs that come after pauses around the polling time, so that the wake-up races with falling asleep: a lost
 * wake-up hangs here. */
EXL_TEST(no_lost_wakeups_at_the_polling_boundary) {
    exl_pool *pool;
    REQUIRE_OK(exl_pool_init(3, &pool));
    static tally t;
    const int rounds = 2000;
    unsigned seed = 12345;
    for (int r = 0; r < rounds; r++) {
        seed = seed * 1103515245u + 12345u;
        double until = clock_seconds(CLOCK_MONOTONIC) + (double)(seed >> 16 & 127) * 1e-6;
        while (clock_seconds(CLOCK_MONOTONIC) < until)
            ;
        exl_pool_run(pool, tally_task, &t);
    }
    exl_pool_free(pool);
    check_tally(&t, 3, rounds);
}
