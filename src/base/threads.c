/* threads.c - fork-join pool: workers spin briefly on a generation counter, then sleep. */
#include "threads.h"

#include "alloc.h"
#include "error.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

struct exl_pool {
    int n;
    pthread_t *threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint generation;
    atomic_int pending;
    atomic_int quit;
    exl_task_fn fn;
    void *ctx;
    struct worker_arg *args;
};

typedef struct worker_arg {
    exl_pool *pool;
    int index;
} worker_arg;

static void *worker_main(void *p) {
    worker_arg *a = p;
    exl_pool *pool = a->pool;
    unsigned seen = 0; /* the generation at creation: a late-starting worker must not miss job 1 */
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&pool->generation, memory_order_acquire) == seen) {
            if (++spins < 20000)
                continue;
            pthread_mutex_lock(&pool->mu);
            while (atomic_load(&pool->generation) == seen && !atomic_load(&pool->quit))
                pthread_cond_wait(&pool->cv, &pool->mu);
            pthread_mutex_unlock(&pool->mu);
            break;
        }
        if (atomic_load(&pool->quit))
            return NULL;
        seen = atomic_load(&pool->generation);
        pool->fn(pool->ctx, a->index, pool->n);
        atomic_fetch_sub_explicit(&pool->pending, 1, memory_order_release);
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
    pthread_mutex_init(&pool->mu, NULL);
    pthread_cond_init(&pool->cv, NULL);
    if (n_threads > 1) {
        pool->threads = exl_calloc((size_t)n_threads, sizeof *pool->threads);
        worker_arg *args = exl_calloc((size_t)n_threads, sizeof *args);
        if (!pool->threads || !args) {
            exl_free(args);
            exl_pool_free(pool);
            return exl_fail(EXL_ERR_NOMEM, "thread pool: out of memory");
        }
        pool->args = args;
        for (int i = 1; i < n_threads; i++) {
            args[i].pool = pool;
            args[i].index = i;
            if (pthread_create(&pool->threads[i], NULL, worker_main, &args[i]) != 0) {
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
        pthread_mutex_lock(&pool->mu);
        atomic_store(&pool->quit, 1);
        atomic_fetch_add(&pool->generation, 1);
        pthread_cond_broadcast(&pool->cv);
        pthread_mutex_unlock(&pool->mu);
        for (int i = 1; i < pool->n; i++)
            pthread_join(pool->threads[i], NULL);
        exl_free(pool->args);
        exl_free(pool->threads);
    }
    pthread_mutex_destroy(&pool->mu);
    pthread_cond_destroy(&pool->cv);
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
    atomic_store(&pool->pending, pool->n - 1);
    pthread_mutex_lock(&pool->mu);
    atomic_fetch_add_explicit(&pool->generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool->cv);
    pthread_mutex_unlock(&pool->mu);
    fn(ctx, 0, pool->n);
    while (atomic_load_explicit(&pool->pending, memory_order_acquire) > 0)
        ;
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
