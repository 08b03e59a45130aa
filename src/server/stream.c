/* stream.c - the per-request event queue (see stream.h): a mutex-guarded linked list with a
 * waker, reference counted between the HTTP side and the engine thread. */
#include "server/stream.h"

#include "base/alloc.h"
#include "server/http.h"

#include <string.h>

exl_stream *exl_stream_new(int32_t n_slots) {
    exl_stream *s = exl_calloc(1, sizeof *s + (size_t)n_slots * sizeof s->slots[0]);
    if (!s)
        return NULL;
    pthread_mutex_init(&s->mu, NULL);
    s->refs = 1;
    s->n_slots = n_slots;
    for (int32_t i = 0; i < n_slots; i++)
        s->slots[i] = (exl_stream_slot){.stream = s, .index = i};
    return s;
}

void exl_stream_event_free(exl_stream_event *e) {
    if (!e)
        return;
    exl_free(e->text);
    exl_free(e->ids);
    exl_free(e->logprobs);
    exl_free(e->top_logprobs);
    exl_free(e->error);
    exl_free(e);
}

void exl_stream_ref(exl_stream *s) {
    pthread_mutex_lock(&s->mu);
    s->refs++;
    pthread_mutex_unlock(&s->mu);
}

void exl_stream_unref(exl_stream *s) {
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    int left = --s->refs;
    pthread_mutex_unlock(&s->mu);
    if (left)
        return;
    while (s->head) {
        exl_stream_event *n = s->head->next;
        exl_stream_event_free(s->head);
        s->head = n;
    }
    pthread_mutex_destroy(&s->mu);
    exl_free(s);
}

void exl_stream_set_waker(exl_stream *s, void (*wake)(void *ctx), void *ctx) {
    pthread_mutex_lock(&s->mu);
    s->wake = wake;
    s->wake_ctx = ctx;
    pthread_mutex_unlock(&s->mu);
}

static void *dup_bytes(const void *p, size_t n) {
    if (!p || !n)
        return NULL;
    void *d = exl_malloc(n);
    if (d)
        memcpy(d, p, n);
    return d;
}

static exl_stream_event *copy_event(const exl_gen_event *e, int32_t index) {
    exl_stream_event *c = exl_calloc(1, sizeof *c);
    if (!c)
        return NULL;
    size_t n = (size_t)e->n_ids, n_top = n * (size_t)e->n_top_logprobs;
    *c = (exl_stream_event){.index = index,
                            .text_len = e->text_len,
                            .n_ids = e->n_ids,
                            .n_top = e->n_top_logprobs,
                            .finish = e->finish,
                            .stop_token = e->stop_token,
                            .n_prompt_tokens = e->n_prompt_tokens,
                            .n_cached_tokens = e->n_cached_tokens,
                            .n_generated = e->n_generated,
                            .time = exl_http_now()};
    c->text = exl_strndup(e->text ? e->text : "", e->text_len);
    c->ids = dup_bytes(e->ids, n * sizeof *e->ids);
    c->logprobs = dup_bytes(e->logprobs, n * sizeof *e->logprobs);
    c->top_logprobs = dup_bytes(e->top_logprobs, n_top * sizeof *e->top_logprobs);
    c->error = e->error ? exl_strdup(e->error) : NULL;
    if (!c->text || (n && !c->ids) || (e->logprobs && n && !c->logprobs) ||
        (e->top_logprobs && n_top && !c->top_logprobs) || (e->error && !c->error)) {
        exl_stream_event_free(c);
        return NULL;
    }
    return c;
}

void exl_stream_push(const exl_gen_event *e) {
    exl_stream_slot *slot = e->user;
    exl_stream *s = slot->stream;
    exl_stream_event *c = copy_event(e, slot->index);
    pthread_mutex_lock(&s->mu);
    if (c) {
        if (s->tail)
            s->tail->next = c;
        else
            s->head = c;
        s->tail = c;
    } else {
        s->lost = 1;
    }
    if (s->wake)
        s->wake(s->wake_ctx);
    pthread_mutex_unlock(&s->mu);
    if (e->finish != EXL_FINISH_NONE)
        exl_stream_unref(s);
}

exl_stream_event *exl_stream_pop(exl_stream *s, int *lost) {
    pthread_mutex_lock(&s->mu);
    exl_stream_event *e = s->head;
    if (e) {
        s->head = e->next;
        if (!s->head)
            s->tail = NULL;
        e->next = NULL;
    }
    *lost = s->lost;
    pthread_mutex_unlock(&s->mu);
    return e;
}
