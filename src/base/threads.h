/* threads.h - a fork-join worker pool: run fn(ctx, i, n) for i in [0, n) across threads. */
#ifndef EXL_BASE_THREADS_H
#define EXL_BASE_THREADS_H

#include "exl.h"

#include <stdint.h>

typedef struct exl_pool exl_pool;
typedef void (*exl_task_fn)(void *ctx, int index, int count);

/* n_threads <= 0 means one per online core. The caller's thread is one of them. */
exl_status exl_pool_init(int n_threads, exl_pool **out);
void exl_pool_free(exl_pool *pool);
int exl_pool_size(const exl_pool *pool);
/* Calls fn(ctx, i, pool_size) once for each index i in [0, pool_size) and waits for all. The threads, the caller
 * included, claim indices until none is left, so any thread may run any index, and one thread several. A waiting
 * thread polls briefly, then sleeps. One caller at a time. */
void exl_pool_run(exl_pool *pool, exl_task_fn fn, void *ctx);
/* Like exl_pool_run, but runs fn(ctx, 0, 1) on the caller alone when `work` (in
 * roughly multiply-adds) is too small to repay waking the other threads. */
void exl_pool_run_work(exl_pool *pool, exl_task_fn fn, void *ctx, int64_t work);
/* Split [0, n) into near-equal ranges for thread i of count; multiples of `align`. */
void exl_split_range(long n, int i, int count, long align, long *begin, long *end);

#endif
