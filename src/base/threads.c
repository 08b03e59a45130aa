/* threads.c - fork-join pool: every thread, the caller too, claims the job's indices until none is left; a waiting
 * thread polls briefly, then sleeps on a futex.
 *
 * Claiming (not a fixed index per thread) means nobody waits for a worker that has not started: when other programs
 * keep the cores busy and a worker is descheduled or still waking up, the caller runs its share. The caller waits only
 * for shares that are running, and gives its core away when that takes long. */
#include "threads.h"

#include "alloc.h"
#include "error.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* How long a waiting thread polls before it sleeps: long enough to cover the gap between the fork-joins of one
 * forward step, short enough that a thread whose partner was preempted hands the core back quickly. */
#define SPIN_NS 100000
/* Polls between two looks at the clock. */
#define SPINS_PER_CLOCK_READ 64

struct exl_pool {
    int n;
    pthread_t *threads;
    exl_task_fn fn;
    void *ctx;
    atomic_uint generation; /* bumped by the caller once per job; workers wait for it to change */
    atomic_uint finished;   /* bumped by a worker that finishes a job's last index; the caller waits for it */
    atomic_int next_index;  /* the next index to claim; n and beyond: none left */
    atomic_int remaining;   /* indices not finished yet */
    atomic_int workers_asleep;
    atomic_int caller_asleep;
    atomic_int quit;
};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static long monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

static void futex_wait(atomic_uint *word, unsigned expected) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void futex_wake_all(atomic_uint *word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

/* Returns once *word differs from `seen` (acquiring what was published before the change) and returns its value.
 * Polls for up to SPIN_NS, then sleeps; `asleep` counts the sleepers so that wakers skip the system call when
 * nobody sleeps. The waker bumps *word, then reads `asleep`; this thread raises `asleep`, then reads *word: with
 * sequentially consistent order one of the two sees the other, so no wake-up is lost. */
static unsigned wait_for_change(atomic_uint *word, unsigned seen, atomic_int *asleep) {
    unsigned now = atomic_load_explicit(word, memory_order_acquire);
    if (now != seen)
        return now;
    long deadline = monotonic_ns() + SPIN_NS;
    for (int spins = 1;; spins++) {
        cpu_relax();
        now = atomic_load_explicit(word, memory_order_acquire);
        if (now != seen)
            return now;
        if (spins % SPINS_PER_CLOCK_READ == 0 && monotonic_ns() > deadline)
            break;
    }
    atomic_fetch_add(asleep, 1);
    while ((now = atomic_load(word)) == seen)
        futex_wait(word, seen);
    atomic_fetch_sub(asleep, 1);
    return now;
}

/* Bumps *word (releasing what this thread wrote before) and wakes the threads sleeping on it, if any. */
static void announce_change(atomic_uint *word, atomic_int *asleep) {
    atomic_fetch_add(word, 1);
    if (atomic_load(asleep) > 0)
        futex_wake_all(word);
}

/* Runs the current job's indices this thread can claim; returns 1 if it finished the job's last one. A claim reads
 * next_index as the caller reset it (a release sequence), so fn and ctx of that job are visible; a claim that finds
 * none left touches nothing, so a worker that wakes late (even during the next job's setup) is harmless. */
static int run_claimed(exl_pool *pool) {
    int last = 0;
    for (;;) {
        int i = atomic_fetch_add_explicit(&pool->next_index, 1, memory_order_acquire);
        if (i >= pool->n)
            return last;
        pool->fn(pool->ctx, i, pool->n);
        last = atomic_fetch_sub_explicit(&pool->remaining, 1, memory_order_acq_rel) == 1;
    }
}

static void *worker_main(void *p) {
    exl_pool *pool = p;
    unsigned seen = 0; /* the generation at creation: a late-starting worker must not miss job 1 */
    for (;;) {
        seen = wait_for_change(&pool->generation, seen, &pool->workers_asleep);
        if (atomic_load(&pool->quit))
            return NULL;
        if (run_claimed(pool))
            announce_change(&pool->finished, &pool->caller_asleep);
    }
}

exl_status exl_pool_init(int n_threads, exl_pool **out) {
    if (n_threads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = c > 0 ? (int)c : 1;
    }
    exl_pool *pool = exl_calloc(1, sizeof *pool);
    if (!pool)
        return exl_fail(EXL_ERR_NOMEM, "thread pool: out of memory");
    pool->n = n_threads;
    atomic_init(&pool->next_index, n_threads); /* nothing to claim before the first job */
    if (n_threads > 1) {
        pool->threads = exl_calloc((size_t)n_threads, sizeof *pool->threads);
        if (!pool->threads) {
            exl_pool_free(pool);
            return exl_fail(EXL_ERR_NOMEM, "thread pool: out of memory");
        }
        for (int i = 1; i < n_threads; i++) {
            if (pthread_create(&pool->threads[i], NULL, worker_main, pool) != 0) {
                pool->n = i;
                break;
            }
        }
    }
    *out = pool;
    return EXL_OK;
}

void exl_pool_free(exl_pool *pool) {
    if (!pool)
        return;
    if (pool->threads) {
        atomic_store(&pool->quit, 1);
        announce_change(&pool->generation, &pool->workers_asleep);
        for (int i = 1; i < pool->n; i++)
            pthread_join(pool->threads[i], NULL);
        exl_free(pool->threads);
    }
    exl_free(pool);
}

int exl_pool_size(const exl_pool *pool) { return pool->n; }

void exl_pool_run(exl_pool *pool, exl_task_fn fn, void *ctx) {
    if (pool->n == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->ctx = ctx;
    unsigned finished = atomic_load_explicit(&pool->finished, memory_order_relaxed);
    atomic_store_explicit(&pool->remaining, pool->n, memory_order_relaxed);
    atomic_store_explicit(&pool->next_index, 0, memory_order_release); /* claims may start now */
    announce_change(&pool->generation, &pool->workers_asleep);
    if (!run_claimed(pool))
        wait_for_change(&pool->finished, finished, &pool->caller_asleep);
}

#define MIN_PARALLEL_WORK (1 << 16)

void exl_pool_run_work(exl_pool *pool, exl_task_fn fn, void *ctx, int64_t work) {
    if (work < MIN_PARALLEL_WORK)
        fn(ctx, 0, 1);
    else
        exl_pool_run(pool, fn, ctx);
}

void exl_split_range(long n, int i, int count, long align, long *begin, long *end) {
    if (align < 1)
        align = 1;
    long units = (n + align - 1) / align;
    long per = units / count, extra = units % count;
    long b = i * per + (i < extra ? i : extra);
    long e = b + per + (i < extra ? 1 : 0);
    b *= align;
    e *= align;
    *begin = b < n ? b : n;
    *end = e < n ? e : n;
}
