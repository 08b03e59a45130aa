/* stream.h - the per-request event queue between the engine thread and the HTTP side.
 *
 * A request runs one job per choice. The engine thread pushes a copy of every event of
 * those jobs and calls the queue's waker; the HTTP side pops them in order, without
 * waiting. The queue is shared: the HTTP side holds one reference and each submitted job
 * one more, dropped by the engine when it pushes that job's final event, so a client that
 * leaves early can release its side at once while its cancelled jobs are still being
 * wound down. */
#ifndef EXL_SERVER_STREAM_H
#define EXL_SERVER_STREAM_H

#include "exl.h"

#include <pthread.h>

typedef struct exl_stream exl_stream;

/* One job's slot: the `user` pointer handed to the generator. */
typedef struct exl_stream_slot {
    exl_stream *stream;
    int32_t index; /* the choice index */
    uint64_t job;  /* 0 until submitted */
    int finished;  /* its final event was popped (HTTP side only) */
} exl_stream_slot;

/* A copied event. */
typedef struct exl_stream_event {
    struct exl_stream_event *next;
    int32_t index;
    char *text;
    size_t text_len;
    int32_t *ids;
    float *logprobs;                 /* [n_ids] or NULL */
    exl_token_logprob *top_logprobs; /* [n_ids * n_top] or NULL */
    int32_t n_ids, n_top;
    exl_finish_reason finish;
    int32_t stop_token;
    int32_t n_prompt_tokens, n_cached_tokens, n_generated;
    char *error;
    double time; /* when the engine pushed it (exl_http_now's clock) */
} exl_stream_event;

struct exl_stream {
    pthread_mutex_t mu;
    exl_stream_event *head, *tail;
    int refs;
    int lost;                /* an event could not be copied (out of memory): the request fails */
    void (*wake)(void *ctx); /* called (under mu) after each push; NULL = nobody to tell */
    void *wake_ctx;
    int32_t n_slots;
    exl_stream_slot slots[];
};

/* A queue with n_slots job slots and one reference (the HTTP side's). NULL: no memory. */
exl_stream *exl_stream_new(int32_t n_slots);
/* Another reference, taken before a job with this queue's slot is submitted. */
void exl_stream_ref(exl_stream *s);
void exl_stream_unref(exl_stream *s);
/* Who to tell when an event comes (wake NULL: nobody). Once this returns, an earlier waker
 * is no longer called, nor running. */
void exl_stream_set_waker(exl_stream *s, void (*wake)(void *ctx), void *ctx);
/* Engine thread: copy an event to the queue of its slot (e->user) and wake its reader; on
 * its final event the job's reference is dropped. */
void exl_stream_push(const exl_gen_event *e);
/* HTTP side: the next event, or NULL when none is there, with *lost set when an event was
 * dropped for want of memory. Free it with exl_stream_event_free. */
exl_stream_event *exl_stream_pop(exl_stream *s, int *lost);
void exl_stream_event_free(exl_stream_event *e);

#endif
