/* http.c - the HTTP daemon (see http.h): the listening socket, the event thread (epoll over every
 * socket, an eventfd for wake-ups, a sweep of deadlines four times a second), the per-client
 * connection counts, the worker pool, and start / quiesce / stop. One connection's life is in
 * http_conn.c. */
#include "server/http_internal.h"

#include "base/alloc.h"
#include "base/error.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define SWEEP_S 0.25
#define PEER_BUCKETS 1024
#define MAX_EVENTS 128

double exl_http_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void http_log(exl_http *h, const char *fmt, ...) {
    if (!h->p.log)
        return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    h->p.log(h->p.log_ctx, line);
}

void http_count(exl_http *h, int status) {
    if (status > 0 && status < HTTP_STATUS_MAX)
        atomic_fetch_add(&h->status_counts[status], 1);
}

uint64_t exl_http_status_count(const exl_http *h, int status) {
    return status > 0 && status < HTTP_STATUS_MAX ? atomic_load(&h->status_counts[status]) : 0;
}

void http_busy_add(exl_http_conn *c, int delta) { atomic_fetch_add(&c->h->n_busy, delta); }

void http_schedule_ready(exl_http_conn *c) {
    if (c->ready)
        return;
    c->ready = 1;
    c->ready_next = c->h->ready;
    c->h->ready = c;
}

static void run_ready(exl_http *h) {
    while (h->ready) {
        exl_http_conn *c = h->ready;
        h->ready = c->ready_next;
        c->ready = 0;
        if (!c->dead)
            http_conn_advance(c);
    }
}

int32_t exl_http_busy(exl_http *h) { return atomic_load(&h->n_busy); }

/* ---------------------------------------------------------------- clients by address */

struct http_peer {
    http_peer *next;
    unsigned char addr[16]; /* IPv6, IPv4 mapped into it */
    int32_t count;
};

static void peer_key(const struct sockaddr_storage *sa, unsigned char key[16]) {
    memset(key, 0, 16);
    if (sa->ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        key[10] = key[11] = 0xff;
        memcpy(key + 12, &in->sin_addr, 4);
    } else if (sa->ss_family == AF_INET6) {
        memcpy(key, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
    }
}

static http_peer **peer_bucket(exl_http *h, const unsigned char key[16]) {
    uint32_t x = 2166136261u;
    for (int i = 0; i < 16; i++)
        x = (x ^ key[i]) * 16777619u;
    return &h->peers[x % PEER_BUCKETS];
}

static http_peer *peer_find(exl_http *h, const unsigned char key[16]) {
    for (http_peer *p = *peer_bucket(h, key); p; p = p->next)
        if (!memcmp(p->addr, key, 16))
            return p;
    return NULL;
}

static http_peer *peer_add(exl_http *h, const unsigned char key[16]) {
    http_peer *p = peer_find(h, key);
    if (!p && (p = exl_calloc(1, sizeof *p))) {
        http_peer **b = peer_bucket(h, key);
        memcpy(p->addr, key, 16);
        p->next = *b;
        *b = p;
    }
    if (p)
        p->count++;
    return p;
}

static void peer_release(exl_http *h, http_peer *peer) {
    if (!peer || --peer->count > 0)
        return;
    for (http_peer **pp = peer_bucket(h, peer->addr); *pp; pp = &(*pp)->next)
        if (*pp == peer) {
            *pp = peer->next;
            exl_free(peer);
            return;
        }
}

/* ---------------------------------------------------------------- the notify list */

static void poke(exl_http *h) {
    uint64_t one = 1;
    ssize_t n = write(h->event_fd, &one, sizeof one);
    (void)n; /* a full counter still wakes the event thread */
}

/* The event thread empties the list whenever it is poked, so only the first entry needs a poke. */
static void notify(exl_http_conn *c, int flag) {
    exl_http *h = c->h;
    pthread_mutex_lock(&h->mu);
    int first = !h->notify_head && !c->in_notify;
    c->pending |= flag;
    if (!c->in_notify) {
        c->in_notify = 1;
        c->nprev = NULL;
        c->nnext = h->notify_head;
        if (h->notify_head)
            h->notify_head->nprev = c;
        h->notify_head = c;
    }
    pthread_mutex_unlock(&h->mu);
    if (first)
        poke(h);
}

static void notify_unlink(exl_http *h, exl_http_conn *c) {
    if (!c->in_notify)
        return;
    if (c->nprev)
        c->nprev->nnext = c->nnext;
    else
        h->notify_head = c->nnext;
    if (c->nnext)
        c->nnext->nprev = c->nprev;
    c->in_notify = 0;
}

void exl_http_wake(void *conn) { notify(conn, NOTIFY_WAKE); }

static void drain_notify(exl_http *h) {
    uint64_t n;
    while (read(h->event_fd, &n, sizeof n) > 0) {
    }
    for (;;) {
        pthread_mutex_lock(&h->mu);
        exl_http_conn *c = h->notify_head;
        int flags = 0;
        if (c) {
            notify_unlink(h, c);
            flags = c->pending;
            c->pending = 0;
        }
        pthread_mutex_unlock(&h->mu);
        if (!c)
            return;
        http_conn_on_notify(c, flags);
    }
}

/* ---------------------------------------------------------------- workers */

void http_dispatch(exl_http_conn *c, enum conn_task task) {
    exl_http *h = c->h;
    c->busy = 1;
    c->task = task;
    c->task_next = NULL;
    http_update_events(c);
    pthread_mutex_lock(&h->task_mu);
    if (h->task_tail)
        h->task_tail->task_next = c;
    else
        h->task_head = c;
    h->task_tail = c;
    pthread_cond_signal(&h->task_cv);
    pthread_mutex_unlock(&h->task_mu);
}

static void *worker_main(void *arg) {
    exl_http *h = arg;
    for (;;) {
        pthread_mutex_lock(&h->task_mu);
        while (!h->task_head && !h->workers_stop)
            pthread_cond_wait(&h->task_cv, &h->task_mu);
        exl_http_conn *c = h->workers_stop ? NULL : h->task_head;
        if (c) {
            h->task_head = c->task_next;
            if (!h->task_head)
                h->task_tail = NULL;
        }
        pthread_mutex_unlock(&h->task_mu);
        if (!c)
            return NULL;
        http_conn_run_task(c);
        notify(c, NOTIFY_DONE);
    }
}

/* ---------------------------------------------------------------- connections */

void http_unwatch(exl_http_conn *c) {
    if (c->events)
        epoll_ctl(c->h->epoll_fd, EPOLL_CTL_DEL, c->fd, NULL);
    c->events = 0;
}

void http_update_events(exl_http_conn *c) {
    if (c->gone || c->hung_up || c->dead)
        return;
    uint32_t want = EPOLLRDHUP;
    int pending_out = c->out_pos < c->out.len;
    if (c->busy)
        want = EPOLLRDHUP;
    else if (c->phase == PHASE_HEAD || c->phase == PHASE_BODY || c->phase == PHASE_LINGER)
        want |= EPOLLIN | (pending_out ? EPOLLOUT : 0);
    else if (pending_out)
        want |= EPOLLOUT;
    if (want == c->events)
        return;
    struct epoll_event ev = {.events = want, .data.ptr = c};
    if (epoll_ctl(c->h->epoll_fd, c->events ? EPOLL_CTL_MOD : EPOLL_CTL_ADD, c->fd, &ev) == 0)
        c->events = want;
}

void http_body_free(exl_http_conn *c) {
    c->h->body_bytes -= (int64_t)c->body_counted;
    c->body_counted = 0;
    exl_str_free(&c->body);
}

void http_conn_close(exl_http_conn *c) {
    exl_http *h = c->h;
    if (c->dead)
        return;
    if (c->counted)
        http_busy_add(c, -1);
    c->counted = 0;
    if (c->reply_live && c->reply.free)
        c->reply.free(c->reply.ctx); /* no wake for c can start after this returns */
    c->reply_live = 0;
    pthread_mutex_lock(&h->mu);
    notify_unlink(h, c);
    pthread_mutex_unlock(&h->mu);
    http_body_free(c);
    http_unwatch(c);
    close(c->fd);
    peer_release(h, c->peer);
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    h->n_conns--;
    c->dead = 1;
    c->dead_next = h->dead;
    h->dead = c;
}

static void free_dead(exl_http *h) {
    while (h->dead) {
        exl_http_conn *c = h->dead;
        h->dead = c->dead_next;
        exl_free(c->reply.body);
        exl_str_free(&c->in);
        exl_str_free(&c->out);
        exl_str_free(&c->scratch);
        exl_free(c->head_buf);
        exl_free(c);
    }
}

static void accept_one(exl_http *h, int fd, const struct sockaddr_storage *sa) {
    unsigned char key[16];
    peer_key(sa, key);
    http_peer *known = peer_find(h, key);
    if (h->n_conns >= h->p.max_connections) {
        http_refuse_socket(h, fd, 503, "the server has too many connections; try again later");
        return;
    }
    if (h->p.max_client_connections > 0 && known && known->count >= h->p.max_client_connections) {
        http_refuse_socket(h, fd, 429, "too many connections from this address");
        return;
    }
    http_peer *peer = peer_add(h, key);
    exl_http_conn *c = peer ? http_conn_new(h, fd, peer) : NULL;
    if (!c) {
        peer_release(h, peer);
        http_refuse_socket(h, fd, 503, "out of memory");
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->n_conns++;
    c->deadline = exl_http_now() + h->p.idle_timeout_s;
    http_update_events(c);
    if (!c->events) {
        http_conn_close(c);
        http_log(h, "http: cannot watch a connection: %s", strerror(errno));
    }
}

static void accept_all(exl_http *h) {
    for (;;) {
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        int fd = accept4(h->listen_fd, (struct sockaddr *)&sa, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            accept_one(h, fd, &sa);
            continue;
        }
        if (errno == EINTR || errno == ECONNABORTED)
            continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* out of descriptors: stop listening for a moment rather than spin */
            epoll_ctl(h->epoll_fd, EPOLL_CTL_DEL, h->listen_fd, NULL);
            h->accept_paused_until = exl_http_now() + 0.1;
            http_log(h, "http: cannot accept connections: %s", strerror(errno));
        }
        return;
    }
}

static void watch_listener(exl_http *h) {
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(h->epoll_fd, EPOLL_CTL_ADD, h->listen_fd, &ev);
}

static void quiesce_now(exl_http *h) {
    if (h->quiesced)
        return;
    h->quiesced = 1;
    if (h->listen_fd >= 0) {
        epoll_ctl(h->epoll_fd, EPOLL_CTL_DEL, h->listen_fd, NULL);
        close(h->listen_fd);
        h->listen_fd = -1;
    }
    for (exl_http_conn *c = h->conns, *next; c; c = next) {
        next = c->next;
        http_conn_quiesce(c);
    }
}

static void sweep(exl_http *h, double now) {
    h->next_sweep = now + SWEEP_S;
    if (h->accept_paused_until && now >= h->accept_paused_until && !h->quiesced) {
        h->accept_paused_until = 0;
        watch_listener(h);
    }
    for (exl_http_conn *c = h->conns, *next; c; c = next) {
        next = c->next;
        if (c->deadline && now >= c->deadline && !c->busy)
            http_conn_on_timeout(c);
    }
}

static void *io_main(void *arg) {
    exl_http *h = arg;
    struct epoll_event evs[MAX_EVENTS];
    while (!atomic_load(&h->stop)) {
        int wait_ms = (int)((h->next_sweep - exl_http_now()) * 1e3) + 1;
        int n = epoll_wait(h->epoll_fd, evs, MAX_EVENTS, wait_ms < 1 ? 1 : wait_ms);
        if (atomic_load(&h->quiesce))
            quiesce_now(h);
        for (int i = 0; i < n; i++) {
            void *ptr = evs[i].data.ptr;
            uint32_t ev = evs[i].events;
            if (!ptr) {
                accept_all(h);
                continue;
            }
            if (ptr == &h->event_fd) {
                drain_notify(h);
                continue;
            }
            exl_http_conn *c = ptr;
            if (!c->dead && (ev & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)))
                http_conn_on_input(c);
            if (!c->dead && (ev & EPOLLOUT))
                http_conn_on_output(c);
        }
        run_ready(h);
        free_dead(h);
        double now = exl_http_now();
        if (now >= h->next_sweep) {
            sweep(h, now);
            free_dead(h);
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- start and stop */

static exl_status listen_on(exl_http *h) {
    char port[16];
    snprintf(port, sizeof port, "%d", (int)h->p.port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai;
    int gai = getaddrinfo(h->host, port, &hints, &ai);
    if (gai)
        return exl_fail(EXL_ERR_ARG, "server: cannot resolve host '%s': %s", h->host, gai_strerror(gai));
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0), one = 1;
    int ok = fd >= 0 && setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
             bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 1024) == 0;
    freeaddrinfo(ai);
    if (!ok) {
        int e = errno;
        if (fd >= 0)
            close(fd);
        return exl_fail(EXL_ERR_IO, "server: cannot listen on %s port %d: %s", h->host, (int)h->p.port, strerror(e));
    }
    h->listen_fd = fd;
    struct sockaddr_storage sa;
    socklen_t len = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &len);
    h->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                             : ((struct sockaddr_in *)&sa)->sin_port);
    return EXL_OK;
}

static exl_status start_threads(exl_http *h) {
    h->workers = exl_calloc((size_t)h->p.workers, sizeof *h->workers);
    if (!h->workers)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (; h->n_workers < h->p.workers; h->n_workers++)
        if (pthread_create(&h->workers[h->n_workers], NULL, worker_main, h))
            return exl_fail(EXL_ERR_STATE, "server: cannot start the HTTP worker threads");
    if (pthread_create(&h->io_thread, NULL, io_main, h))
        return exl_fail(EXL_ERR_STATE, "server: cannot start the HTTP thread");
    h->io_started = 1;
    return EXL_OK;
}

static exl_status check_params(const exl_http_params *p) {
    if (p->max_body < 1 || p->max_connections < 1 || p->max_client_connections < 0 || p->request_timeout_s < 1 ||
        p->idle_timeout_s < 1 || p->workers < 1 || p->workers > 256 || !p->admit || !p->handle)
        return exl_fail(EXL_ERR_ARG, "server: bad HTTP parameters");
    return EXL_OK;
}

exl_status exl_http_start(const exl_http_params *params, exl_http **out) {
    *out = NULL;
    EXL_TRY(check_params(params));
    exl_http *h = exl_calloc(1, sizeof *h);
    if (!h)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    h->p = *params;
    h->listen_fd = h->epoll_fd = h->event_fd = -1;
    pthread_mutex_init(&h->mu, NULL);
    pthread_mutex_init(&h->task_mu, NULL);
    pthread_cond_init(&h->task_cv, NULL);
    atomic_init(&h->next_request, (unsigned long long)time(NULL) << 20);
    h->host = exl_strdup(params->host ? params->host : "127.0.0.1");
    h->cors = params->cors_origin ? exl_strdup(params->cors_origin) : NULL;
    h->peers = exl_calloc(PEER_BUCKETS, sizeof *h->peers);
    h->p.host = h->host;
    h->p.cors_origin = h->cors;
    exl_status st = !h->host || (params->cors_origin && !h->cors) || !h->peers
                        ? exl_fail(EXL_ERR_NOMEM, "out of memory")
                        : listen_on(h);
    if (st == EXL_OK) {
        h->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
        h->event_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        struct epoll_event ev = {.events = EPOLLIN, .data.ptr = &h->event_fd};
        if (h->epoll_fd < 0 || h->event_fd < 0 || epoll_ctl(h->epoll_fd, EPOLL_CTL_ADD, h->event_fd, &ev))
            st = exl_fail(EXL_ERR_IO, "server: cannot set up epoll: %s", strerror(errno));
    }
    if (st == EXL_OK) {
        watch_listener(h);
        h->next_sweep = exl_http_now() + SWEEP_S;
        *out = h; /* before the threads start: handlers may look at it (the metrics do) */
        st = start_threads(h);
    }
    if (st != EXL_OK) {
        *out = NULL;
        exl_http_stop(h);
    }
    return st;
}

int32_t exl_http_port(const exl_http *h) { return h->port; }

void exl_http_quiesce(exl_http *h) {
    atomic_store(&h->quiesce, 1);
    poke(h);
}

void exl_http_stop(exl_http *h) {
    if (!h)
        return;
    atomic_store(&h->stop, 1);
    if (h->event_fd >= 0)
        poke(h);
    if (h->io_started)
        pthread_join(h->io_thread, NULL);
    pthread_mutex_lock(&h->task_mu);
    h->workers_stop = 1;
    pthread_cond_broadcast(&h->task_cv);
    pthread_mutex_unlock(&h->task_mu);
    for (int i = 0; i < h->n_workers; i++)
        pthread_join(h->workers[i], NULL);
    /* every thread of ours is gone: close what is left (queued tasks included) */
    while (h->conns) {
        h->conns->busy = 0;
        http_conn_close(h->conns);
    }
    free_dead(h);
    for (int i = 0; h->peers && i < PEER_BUCKETS; i++)
        while (h->peers[i]) {
            http_peer *p = h->peers[i];
            h->peers[i] = p->next;
            exl_free(p);
        }
    if (h->listen_fd >= 0)
        close(h->listen_fd);
    if (h->epoll_fd >= 0)
        close(h->epoll_fd);
    if (h->event_fd >= 0)
        close(h->event_fd);
    pthread_cond_destroy(&h->task_cv);
    pthread_mutex_destroy(&h->task_mu);
    pthread_mutex_destroy(&h->mu);
    exl_free(h->workers);
    exl_free(h->peers);
    exl_free(h->host);
    exl_free(h->cors);
    exl_free(h);
}
