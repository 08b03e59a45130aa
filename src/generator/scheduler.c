/* scheduler.c - what runs in a step: admission of waiting jobs (taking their prefix
 * from the cache), the split of the token budget, page growth and preemption.
 *
 * Policy. Jobs are ordered by priority, then by submission. Waiting jobs are admitted
 * in that order while fewer than max_jobs run and the pages of their whole current
 * sequence are available (the first always is: submit checks that a job fits the
 * cache alone). Each step gives every decoding job (one token left to feed) a token
 * first, then fills the rest of the budget with prefill chunks, so long prompts never
 * stall running jobs. Pages are taken only for the tokens fed; when none is left the
 * last job of the order (lowest priority, newest) is preempted: its pages are released
 * (they stay cached) and it goes back to waiting, to be recomputed later.
 *
 * A partly matching cached page is copied into a new page of the job only when the match is at least
 * prefix_copy_min tokens: where the cache is in device memory, kv_cache's copy goes through the host, two
 * synchronous transfers per layer and K/V (~2.8 ms a page on a 32-layer 7B on an H100), which for a short match
 * costs far more than computing its tokens again in the job's prompt step, and which admission paid job after job
 * before the step (64 arrivals sharing 4 short prompts: ~180 ms before any first token). */
#include "generator/generator.h"

#include "base/error.h"

#include <stdlib.h>
#include <string.h>

/* tokens: about what the 7B's prompt rate (12k tokens/s on an H100) computes in the ~3 ms a copy takes, less where
 * the rows join other prompt rows in one step, and a copy also holds up the engine thread and the queued step */
#define PREFIX_COPY_MIN_DEVICE 64

static int32_t pages_for(int64_t tokens, int32_t ps) { return (int32_t)((tokens + ps - 1) / ps); }

/* ---------------------------------------------------------------- admission */

/* Full pages of the job's prefix that running jobs hold already. */
static int32_t held_prefix_pages(exl_generator *g, exl_job *j) {
    const exl_page_pool *pool = &g->pool;
    int32_t ps = pool->page_size, held = 0;
    if (!g->params.prefix_cache)
        return 0;
    for (int32_t i = 0; (int64_t)(i + 1) * ps <= j->n_tokens - 1; i++) {
        uint64_t h = exl_job_parent_hash(j, ps, i + 1);
        int32_t page = exl_prefix_lookup(pool, h, j->tokens + (size_t)i * ps);
        if (page < 0)
            break;
        held += pool->ref[page] > 0;
    }
    return held;
}

/* Give a newly admitted job the longest cached prefix of tokens[0, n_tokens - 1): whole
 * pages shared by hash, then the best partly matching page copied. */
static exl_status attach_prefix(exl_generator *g, exl_job *j) {
    exl_page_pool *pool = &g->pool;
    int32_t ps = pool->page_size, limit = j->n_tokens - 1, pos = 0;
    exl_status st = EXL_OK;
    while (pos < limit) {
        const int32_t *t = j->tokens + pos;
        uint64_t parent = exl_job_parent_hash(j, ps, j->n_pages);
        if (pos + ps <= limit) {
            int32_t page = exl_prefix_lookup(pool, exl_job_parent_hash(j, ps, j->n_pages + 1), t);
            if (page >= 0) {
                exl_page_pool_ref(pool, page);
                j->pages[j->n_pages++] = page;
                pos += ps;
                g->stats.pages_shared++;
                continue;
            }
        }
        int32_t len, src = exl_prefix_best_partial(pool, parent, t, limit - pos < ps ? limit - pos : ps, &len);
        if (src < 0 || len < g->prefix_copy_min)
            break;
        exl_page_pool_ref(pool, src); /* pinned: taking a page must not evict it */
        int32_t dst = exl_page_pool_take(pool, parent);
        if (dst >= 0 && (st = exl_kv_cache_copy_page(g->model, g->cache, src, dst, len)) != EXL_OK) {
            exl_page_pool_release(pool, dst);
            dst = -1;
        }
        exl_page_pool_release(pool, src);
        if (dst < 0)
            break;
        memcpy(pool->tokens + (size_t)dst * ps, t, (size_t)len * sizeof *t);
        pool->n_valid[dst] = len;
        j->pages[j->n_pages++] = dst;
        pos += len;
        g->stats.pages_copied++;
        if (len < ps)
            break;
        exl_prefix_register(pool, dst, exl_job_parent_hash(j, ps, j->n_pages));
    }
    j->n_cached = pos; /* also on failure: the pages it holds must never be rewritten */
    g->stats.prefix_hit_tokens += pos;
    return st;
}

void exl_sched_init(exl_generator *g) {
    const char *e = getenv("EXL_PREFIX_COPY_MIN");
    int host = !strcmp(g->model->be->name, "cpu"); /* a copy is a memcpy */
    g->prefix_copy_min = e && *e ? atoi(e) : host ? 1 : PREFIX_COPY_MIN_DEVICE;
    if (g->prefix_copy_min < 1)
        g->prefix_copy_min = 1;
}

static exl_status admit(exl_generator *g) {
    while (g->waiting.n > 0 && g->running.n < g->params.max_jobs) {
        exl_job *j = g->waiting.v[0];
        int32_t need = pages_for(j->n_tokens, g->pool.page_size) - held_prefix_pages(g, j);
        if (g->running.n > 0 && need > exl_page_pool_available(&g->pool))
            break;
        exl_job_list_remove(&g->waiting, j);
        exl_job_list_insert(&g->running, j);
        j->state = EXL_JOB_RUNNING;
        if (!j->t_admit) { /* the first time (not after a preemption) */
            j->t_admit = exl_gen_now();
            j->step_admit = g->trace.step;
        }
        g->trace.admitted++;
        if (g->params.prefix_cache)
            EXL_TRY(attach_prefix(g, j));
        if (j->n_tokens == j->n_prompt && j->n_cached_prompt == 0)
            j->n_cached_prompt = j->n_cached;
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- the step's work */

static void preempt(exl_generator *g, exl_job *j) {
    exl_job_release_pages(g, j);
    j->step_tokens = 0;
    exl_job_list_remove(&g->running, j);
    exl_job_list_insert(&g->waiting, j);
    j->state = EXL_JOB_WAITING;
    g->stats.preemptions++;
}

static void split_budget(exl_generator *g) {
    int32_t budget = g->params.max_batch_tokens;
    for (int32_t i = 0; i < g->running.n; i++) {
        exl_job *j = g->running.v[i];
        j->step_tokens = 0;
        if (j->n_tokens - j->n_cached == 1 && budget > 0) {
            j->step_tokens = 1;
            budget--;
        }
    }
    for (int32_t i = 0; i < g->running.n && budget > 0; i++) {
        exl_job *j = g->running.v[i];
        int32_t left = j->n_tokens - j->n_cached;
        if (left > 1) {
            j->step_tokens = left < budget ? left : budget;
            budget -= j->step_tokens;
        }
    }
}

static void take_pages(exl_generator *g) {
    int32_t ps = g->pool.page_size;
    for (int32_t i = 0; i < g->running.n; i++) {
        exl_job *j = g->running.v[i];
        int32_t need = pages_for((int64_t)j->n_cached + j->step_tokens, ps);
        while (j->step_tokens && j->n_pages < need) {
            int32_t page = exl_page_pool_take(&g->pool, exl_job_parent_hash(j, ps, j->n_pages));
            if (page >= 0)
                j->pages[j->n_pages++] = page;
            else /* the last job in the order; when that is j itself, the loop ends with it */
                preempt(g, g->running.v[g->running.n - 1]);
        }
    }
}

exl_status exl_sched_plan(exl_generator *g) {
    g->n_step = 0;
    EXL_TRY(admit(g));
    split_budget(g);
    take_pages(g);
    for (int32_t i = 0; i < g->running.n; i++) {
        exl_job *j = g->running.v[i];
        if (!j->step_tokens)
            continue;
        int32_t end = j->n_cached + j->step_tokens;
        g->steps[g->n_step] = (exl_seq_step){j->tokens + j->n_cached, j->step_tokens, j->n_cached, j->pages, j->n_pages,
                                             end == j->n_tokens};
        g->step_sets[g->n_step] = &j->lora;
        g->step_jobs[g->n_step++] = j;
    }
    return EXL_OK;
}

void exl_sched_commit(exl_generator *g) {
    exl_page_pool *pool = &g->pool;
    int32_t ps = pool->page_size;
    for (int32_t s = 0; s < g->n_step; s++) {
        exl_job *j = g->step_jobs[s];
        for (int32_t t = j->n_cached; t < j->n_cached + j->step_tokens; t++) {
            int32_t page = j->pages[t / ps], off = t % ps;
            pool->tokens[(size_t)page * ps + off] = j->tokens[t];
            pool->n_valid[page] = off + 1;
            if (off == ps - 1 && g->params.prefix_cache)
                exl_prefix_register(pool, page, exl_job_parent_hash(j, ps, t / ps + 1));
        }
        j->n_cached += j->step_tokens;
        g->stats.tokens_computed += j->step_tokens;
    }
}
