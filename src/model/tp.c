/* tp.c - tensor parallelism at run time: the ranks' worker threads, a step run on every rank at once, the head's
 * vocabulary gather, and the KV cache's shards (tp.h). */
#include "model/tp.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

/* ---- the workers: rank k >= 1 runs every job on its own thread */

/* A decode loop's steps come a host step's work apart (tens of microseconds), about what waking a thread from a
 * condition variable takes, which delays the rank's launches (the others wait at its first collective) or rank 0's
 * next step. So with GPU ranks (tp->spin) a waiting thread first polls for up to SPIN_NS. */
#define SPIN_NS 200000

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* poll (without the lock) until *gen differs from seen (a job posted) or SPIN_NS passed */
static void spin_for_job(const int64_t *gen, int64_t seen) {
    const int64_t t0 = now_ns();
    for (unsigned i = 1; __atomic_load_n(gen, __ATOMIC_ACQUIRE) == seen; i++)
        if (i % 256 == 0 && now_ns() - t0 > SPIN_NS)
            return;
}

/* poll (without the lock) until no worker is busy or SPIN_NS passed */
static void spin_for_workers(const int32_t *busy) {
    const int64_t t0 = now_ns();
    for (unsigned i = 1; __atomic_load_n(busy, __ATOMIC_ACQUIRE) > 0; i++)
        if (i % 256 == 0 && now_ns() - t0 > SPIN_NS)
            return;
}

static void run_job(exl_tp *tp, int32_t k) {
    exl_tp_rank *r = &tp->ranks[k];
    r->st = r->m ? tp->fn(r->m, tp->arg) : EXL_OK; /* a rank not made (its load failed early) has nothing to do */
    if (r->st != EXL_OK) {
        snprintf(r->msg, sizeof r->msg, "%s", exl_last_error());
        exl_backend *be = r->m->be;
        if (be && be->ops->comm_abort) /* the others' collectives must not wait for this rank */
            be->ops->comm_abort(be, 0);
    }
}

typedef struct worker_arg {
    exl_tp *tp;
    int32_t rank;
} worker_arg;

static void *worker(void *p) {
    worker_arg a = *(worker_arg *)p;
    exl_free(p);
    exl_tp *tp = a.tp;
    int64_t seen = 0;
    pthread_mutex_lock(&tp->lock);
    for (;;) {
        if (tp->spin && tp->job_gen == seen && !tp->quit) {
            pthread_mutex_unlock(&tp->lock);
            spin_for_job(&tp->job_gen, seen);
            pthread_mutex_lock(&tp->lock);
        }
        while (tp->job_gen == seen && !tp->quit)
            pthread_cond_wait(&tp->cond, &tp->lock);
        if (tp->quit)
            break;
        seen = tp->job_gen;
        pthread_mutex_unlock(&tp->lock);
        run_job(tp, a.rank);
        pthread_mutex_lock(&tp->lock);
        if (__atomic_sub_fetch(&tp->busy, 1, __ATOMIC_ACQ_REL) == 0)
            pthread_cond_broadcast(&tp->cond);
    }
    pthread_mutex_unlock(&tp->lock);
    return NULL;
}

exl_status exl_tp_start_workers(exl_tp *tp) {
    for (int32_t k = 1; k < tp->n; k++) {
        worker_arg *a = exl_malloc(sizeof *a);
        if (!a)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        *a = (worker_arg){tp, k};
        if (pthread_create(&tp->ranks[k].thread, NULL, worker, a)) {
            exl_free(a);
            return exl_fail(EXL_ERR_STATE, "tensor parallelism: cannot start the thread of rank %d", k);
        }
        tp->ranks[k].has_thread = 1;
    }
    return EXL_OK;
}

exl_status exl_tp_each(exl_model *m, exl_tp_fn fn, void *arg) {
    exl_tp *tp = m->tp;
    pthread_mutex_lock(&tp->lock);
    tp->fn = fn;
    tp->arg = arg;
    tp->busy = 0;
    for (int32_t k = 1; k < tp->n; k++)
        tp->busy += tp->ranks[k].has_thread;
    __atomic_store_n(&tp->job_gen, tp->job_gen + 1, __ATOMIC_RELEASE); /* polled without the lock */
    pthread_cond_broadcast(&tp->cond);
    pthread_mutex_unlock(&tp->lock);
    run_job(tp, 0);
    if (tp->spin)
        spin_for_workers(&tp->busy);
    pthread_mutex_lock(&tp->lock);
    while (tp->busy > 0)
        pthread_cond_wait(&tp->cond, &tp->lock);
    pthread_mutex_unlock(&tp->lock);
    int32_t failed = -1;
    for (int32_t k = 0; k < tp->n; k++) {
        exl_tp_rank *r = &tp->ranks[k];
        if (r->m && r->m->be && r->m->be->ops->comm_abort)
            r->m->be->ops->comm_abort(r->m->be, 1);
        if (failed < 0 && r->st != EXL_OK && (k == 0 || r->has_thread))
            failed = k;
    }
    if (failed < 0)
        return EXL_OK;
    if (failed == 0)
        return exl_fail(tp->ranks[0].st, "%s", tp->ranks[0].msg);
    return exl_fail(tp->ranks[failed].st, "rank %d: %s", failed, tp->ranks[failed].msg);
}

/* ---- a forward step on every rank */

typedef struct step_job {
    exl_kv_cache *cache;
    const exl_seq_step *steps, *fed_steps; /* fed_steps: the other ranks', with the fed tokens as ids */
    int32_t n_seqs;
    int ahead;
    int32_t n_logits;
    int32_t stage; /* a layer split's (split_step) */
} step_job;

static exl_kv_cache *rank_cache(exl_kv_cache *c, int32_t rank) {
    for (int32_t k = 0; c && k < rank; k++)
        c = c->rank_next;
    return c;
}

static exl_status rank_step(exl_model *m, void *arg) {
    step_job *j = arg;
    int32_t n;
    const exl_seq_step *steps = m->rank && j->fed_steps ? j->fed_steps : j->steps;
    EXL_TRY(exl_model_step_to_logits(m, rank_cache(j->cache, m->rank), steps, j->n_seqs, j->ahead, &n));
    if (m->rank == 0)
        j->n_logits = n;
    /* every rank launches its step and waits for it here, where its collectives meet the others' (a device that
     * queues a step until its next synchronisation would otherwise wait for a rank that never launches) */
    return m->be->ops->synchronize(m->be);
}

/* a split's step (tp.h): every rank's begin_step and allocations, then the stages one after another */
static exl_status rank_split_begin(exl_model *m, void *arg) {
    step_job *j = arg;
    int32_t n;
    const exl_seq_step *steps = m->rank && j->fed_steps ? j->fed_steps : j->steps;
    EXL_TRY(exl_model_begin_step(m, rank_cache(j->cache, m->rank), steps, j->n_seqs, j->ahead, &n));
    if (m->rank == 0)
        j->n_logits = n; /* the same on every rank: read in the stages, after this job */
    return exl_tp_split_prepare(m, n);
}

static exl_status rank_split_stage(exl_model *m, void *arg) {
    step_job *j = arg;
    return exl_tp_split_stage(m, rank_cache(j->cache, m->rank), j->n_logits, j->stage);
}

static exl_status split_step(exl_model *m, step_job *j) {
    EXL_TRY(exl_tp_each(m, rank_split_begin, j));
    for (j->stage = 0; j->stage < 2 * m->tp->n; j->stage++)
        EXL_TRY(exl_tp_each(m, rank_split_stage, j));
    return EXL_OK;
}

exl_status exl_tp_forward_to_logits(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    int ahead, int32_t *n_logits) {
    *n_logits = 0;
    /* rank 0's step before is done (a decode step ahead of the host included) */
    EXL_TRY(m->be->ops->synchronize(m->be));
    step_job j = {cache, steps, NULL, n_seqs, ahead, 0, 0};
    exl_seq_step *fed = NULL;
    int32_t *ids = NULL;
    if (n_seqs > 0 && !steps[0].ids) { /* tokens the last argmax chose on rank 0: the others get them as ids */
        if (n_seqs != m->fs.fed_rows)
            return exl_fail(EXL_ERR_ARG, "forward: %d sequences take device tokens, the step before chose %d", n_seqs,
                            m->fs.fed_rows);
        fed = exl_malloc((size_t)n_seqs * sizeof *fed);
        ids = exl_malloc((size_t)n_seqs * sizeof *ids);
        if (!fed || !ids) {
            exl_free(fed);
            exl_free(ids);
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        }
        exl_status st = EXL_OK;
        if (m->be->ops->argmax)
            st = m->be->ops->download(m->be, ids, m->fs.table, (size_t)n_seqs * sizeof(int32_t));
        else
            memcpy(ids, m->fs.host_fed, (size_t)n_seqs * sizeof(int32_t));
        for (int32_t i = 0; i < n_seqs; i++) {
            fed[i] = steps[i];
            fed[i].ids = &ids[i];
        }
        j.fed_steps = fed;
        if (st != EXL_OK) {
            exl_free(fed);
            exl_free(ids);
            return st;
        }
    }
    exl_status st = m->tp->split ? split_step(m, &j) : exl_tp_each(m, rank_step, &j);
    exl_free(fed);
    exl_free(ids);
    *n_logits = j.n_logits;
    return st;
}

exl_status exl_tp_head_nodes(exl_model *m, int32_t n, exl_graph *g) {
    exl_tp *tp = m->tp;
    exl_tp_rank *r = &tp->ranks[m->rank];
    int32_t part = tp->vocab_cols[m->rank + 1] - tp->vocab_cols[m->rank], hid = m->cfg.hidden_size;
    int32_t vocab = tp->vocab_cols[tp->n];
    if (n > r->head_rows) { /* grows with the logits (forward.c): the slice, then the gather's staging room */
        if (r->head_part)
            m->be->ops->free(m->be, r->head_part);
        r->head_rows = 0;
        size_t floats = (size_t)m->fs.max_logit_rows * (size_t)(part + vocab);
        if (!(r->head_part = m->be->ops->alloc(m->be, floats * sizeof(float))))
            return EXL_ERR_NOMEM;
        r->head_rows = m->fs.max_logit_rows;
    }
    float *staging = r->head_part + (size_t)r->head_rows * part;
    const exl_node nodes[] = {
        {.op = EXL_OP_MATMUL, .tag = {-1, EXL_PART_HEAD}, .matmul = {r->head_part, m->fs.h, m->head, n, hid, part, 0}},
        {.op = EXL_OP_GATHER_COLS,
         .tag = {-1, EXL_PART_HEAD_GATHER},
         .gather_cols = {m->fs.logits, r->head_part, tp->vocab_cols, n, vocab, tp->n, m->rank, staging}},
    };
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0] - (tp->no_comm != 0); i++)
        EXL_TRY(exl_graph_add(g, &nodes[i]));
    return EXL_OK;
}

/* ---- the KV cache: one shard a rank, chained from rank 0's */

typedef struct cache_job {
    int32_t n_pages, page_size, k_bits, v_bits;
    exl_kv_cache **shards; /* [n] */
    int32_t src, dst, n_slots;
} cache_job;

static exl_status rank_cache_init(exl_model *m, void *arg) {
    cache_job *j = arg;
    return exl_kv_cache_init_local(m, j->n_pages, j->page_size, j->k_bits, j->v_bits, &j->shards[m->rank]);
}

static exl_status rank_cache_free(exl_model *m, void *arg) {
    cache_job *j = arg;
    exl_kv_cache_free_local(m, j->shards[m->rank]);
    return EXL_OK;
}

static exl_status rank_cache_copy(exl_model *m, void *arg) {
    cache_job *j = arg;
    return exl_kv_cache_copy_page_local(m, j->shards[m->rank], j->src, j->dst, j->n_slots);
}

exl_status exl_tp_kv_cache_init(exl_model *m, int32_t n_pages, int32_t page_size, int32_t k_bits, int32_t v_bits,
                                exl_kv_cache **out) {
    *out = NULL;
    exl_kv_cache *shards[64] = {0};
    cache_job j = {n_pages, page_size, k_bits, v_bits, shards, 0, 0, 0};
    exl_status st = exl_tp_each(m, rank_cache_init, &j);
    if (st != EXL_OK) {
        exl_tp_each(m, rank_cache_free, &j);
        return st;
    }
    for (int32_t k = 0; k + 1 < m->tp->n; k++)
        shards[k]->rank_next = shards[k + 1];
    *out = shards[0];
    return EXL_OK;
}

void exl_tp_kv_cache_free(exl_model *m, exl_kv_cache *c) {
    if (!c)
        return;
    exl_kv_cache *shards[64] = {0};
    for (int32_t k = 0; k < m->tp->n; k++, c = c->rank_next)
        shards[k] = c;
    cache_job j = {0, 0, 0, 0, shards, 0, 0, 0};
    exl_tp_each(m, rank_cache_free, &j);
}

exl_status exl_tp_kv_cache_copy_page(exl_model *m, exl_kv_cache *c, int32_t src, int32_t dst, int32_t n_slots) {
    exl_kv_cache *shards[64] = {0};
    for (int32_t k = 0; k < m->tp->n; k++, c = c->rank_next)
        shards[k] = c;
    cache_job j = {0, 0, 0, 0, shards, src, dst, n_slots};
    return exl_tp_each(m, rank_cache_copy, &j);
}
