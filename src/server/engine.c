/* engine.c - the engine thread (see engine.h): sleep on a condition variable while the
 * generator has nothing pending, else step it and hand each event to its queue. */
#include "server/engine.h"

#include "base/alloc.h"
#include "base/error.h"

#include <pthread.h>
#include <stdio.h>

struct exl_engine {
    exl_generator *gen;
    pthread_t thread;
    pthread_mutex_t mu; /* guards stop and pairs the wake-up with the pending check */
    pthread_cond_t cv;
    int stop;
    /* exl_engine_call: one call at a time (call_mu), handed over under mu, done signalled on done_cv */
    pthread_mutex_t call_mu;
    pthread_cond_t done_cv;
    exl_status (*call)(void *ctx);
    void *call_ctx;
    exl_status call_status;
    char call_msg[512]; /* its message (messages are per thread) */
    int call_done;
};

/* the pending call, if any, run outside the lock */
static void run_call(exl_engine *e) {
    pthread_mutex_lock(&e->mu);
    exl_status (*fn)(void *) = e->call;
    void *ctx = e->call_ctx;
    e->call = NULL;
    pthread_mutex_unlock(&e->mu);
    if (!fn)
        return;
    exl_status st = fn(ctx);
    pthread_mutex_lock(&e->mu);
    e->call_status = st;
    snprintf(e->call_msg, sizeof e->call_msg, "%s", st == EXL_OK ? "" : exl_last_error());
    e->call_done = 1;
    pthread_cond_broadcast(&e->done_cv);
    pthread_mutex_unlock(&e->mu);
}

static void *engine_main(void *arg) {
    exl_engine *e = arg;
    for (;;) {
        pthread_mutex_lock(&e->mu);
        while (!e->stop && !e->call && exl_generator_pending(e->gen) == 0)
            pthread_cond_wait(&e->cv, &e->mu);
        int done = e->stop && exl_generator_pending(e->gen) == 0;
        pthread_mutex_unlock(&e->mu);
        run_call(e);
        if (done)
            return NULL;
        if (exl_generator_pending(e->gen) == 0)
            continue;
        const exl_gen_event *ev;
        int32_t n_ev;
        /* a failing step ends the jobs it held with error events, returned all the same */
        exl_generator_step(e->gen, &ev, &n_ev);
        for (int32_t i = 0; i < n_ev; i++)
            exl_stream_push(&ev[i]);
    }
}

exl_status exl_engine_start(exl_model *model, const exl_tokenizer *tok, const exl_generator_params *params,
                            exl_engine **out) {
    *out = NULL;
    exl_engine *e = exl_calloc(1, sizeof *e);
    if (!e)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = exl_generator_init(model, tok, params, &e->gen);
    if (st != EXL_OK) {
        exl_free(e);
        return st;
    }
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    pthread_mutex_init(&e->call_mu, NULL);
    pthread_cond_init(&e->done_cv, NULL);
    if (pthread_create(&e->thread, NULL, engine_main, e)) {
        pthread_cond_destroy(&e->done_cv);
        pthread_mutex_destroy(&e->call_mu);
        pthread_cond_destroy(&e->cv);
        pthread_mutex_destroy(&e->mu);
        exl_generator_free(e->gen);
        exl_free(e);
        return exl_fail(EXL_ERR_STATE, "server: cannot start the engine thread");
    }
    *out = e;
    return EXL_OK;
}

void exl_engine_stop(exl_engine *e) {
    if (!e)
        return;
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    pthread_join(e->thread, NULL);
    exl_generator_free(e->gen);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->call_mu);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    exl_free(e);
}

exl_status exl_engine_call(exl_engine *e, exl_status (*fn)(void *ctx), void *ctx) {
    pthread_mutex_lock(&e->call_mu);
    pthread_mutex_lock(&e->mu);
    exl_status st = EXL_OK;
    if (e->stop) {
        st = exl_fail(EXL_ERR_STATE, "server: the engine is stopping");
    } else {
        e->call = fn, e->call_ctx = ctx, e->call_done = 0;
        pthread_cond_signal(&e->cv);
        while (!e->call_done)
            pthread_cond_wait(&e->done_cv, &e->mu);
        st = e->call_status;
        if (st != EXL_OK)
            exl_fail(st, "%s", e->call_msg);
    }
    pthread_mutex_unlock(&e->mu);
    pthread_mutex_unlock(&e->call_mu);
    return st;
}

exl_status exl_engine_submit(exl_engine *e, exl_job_params *params, exl_stream_slot *slot) {
    params->user = slot;
    exl_stream_ref(slot->stream);
    exl_status st = exl_generator_submit(e->gen, params, &slot->job);
    if (st != EXL_OK) {
        exl_stream_unref(slot->stream);
        return st;
    }
    pthread_mutex_lock(&e->mu);
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return EXL_OK;
}

void exl_engine_cancel(exl_engine *e, uint64_t job) {
    if (job)
        exl_generator_cancel(e->gen, job); /* EXL_ERR_ARG: it just finished, nothing to do */
}

void exl_engine_stats(exl_engine *e, exl_generator_stats *out) { exl_generator_stats_get(e->gen, out); }
