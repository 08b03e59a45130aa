/* http_internal.h - the HTTP layer's state, shared by http.c (the daemon: threads, accepting,
 * timers, wake-ups) and http_conn.c (one connection's life: reading, answering, writing).
 *
 * Ownership: the event thread owns every connection, except while `busy` is set, when one
 * worker owns it (runs handle or pump and formats the output) and the event thread only
 * notes what happens to the socket. Workers and exl_http_wake reach the event thread through
 * the notify list (mutex `mu`) and the eventfd. */
#ifndef EXL_SERVER_HTTP_INTERNAL_H
#define EXL_SERVER_HTTP_INTERNAL_H

#include "server/http.h"
#include "server/http_parse.h"

#include <pthread.h>
#include <stdatomic.h>

#define HTTP_STATUS_MAX 600

enum conn_phase {
    PHASE_HEAD,   /* waiting for or reading a request head */
    PHASE_BODY,   /* reading its body */
    PHASE_REPLY,  /* handled on a worker, waiting for a pending answer, or writing the answer */
    PHASE_LINGER, /* answered and closing: our side is shut, the client's bytes are drained */
};

enum conn_task { TASK_HANDLE, TASK_PUMP };

enum notify_flag { NOTIFY_WAKE = 1, NOTIFY_DONE = 2 };

typedef struct http_peer http_peer; /* connections per client address */

struct exl_http_conn {
    exl_http *h;
    int fd;
    exl_http_conn *prev, *next; /* every connection (event thread) */
    http_peer *peer;
    enum conn_phase phase;
    uint32_t events; /* the epoll interest now set; 0 = not registered */
    double deadline; /* monotonic seconds, 0 = none */
    double t_first;  /* the request's first byte (0 = none yet) */
    int gone;        /* its answer was dropped (by the pump, or for want of memory): close it */
    int hung_up;     /* the client left while a worker owned the connection: close it then */
    int dead;        /* closed; freed after the current batch of events */
    exl_http_conn *dead_next;
    int ready; /* in the ready list: pipelined bytes wait in `in` */
    exl_http_conn *ready_next;
    int counted; /* counted in n_busy (a request is in progress) */

    /* the request */
    exl_str in;     /* received, not yet consumed */
    char *head_buf; /* the head, parsed in place */
    exl_http_head head;
    exl_http_chunked chunk;
    exl_str body;
    int64_t body_left;   /* Content-Length bytes still to come */
    size_t body_counted; /* of body.len, what h->body_bytes holds */
    int keep_alive;
    exl_http_request req;
    char request_id[24];

    /* the answer */
    exl_http_reply reply;
    int reply_live;  /* reply.free is owed */
    int streaming;   /* the body comes from pump, as it is made */
    int chunked_out; /* ... with chunked framing (else close-delimited, HTTP/1.0) */
    int preflight;   /* a CORS preflight answer */
    int head_sent, reply_done;
    int status;
    exl_str out; /* bytes to write */
    size_t out_pos;
    exl_str scratch; /* what a pump appends */
    uint64_t bytes_out;
    int want_pump;
    int busy;
    enum conn_task task;
    exl_http_conn *task_next; /* the worker queue (task_mu) */

    /* the notify list (mu) */
    exl_http_conn *nprev, *nnext;
    int in_notify, pending;
};

struct exl_http {
    exl_http_params p; /* strings point at the copies below */
    char *host, *cors;
    int listen_fd, epoll_fd, event_fd;
    int32_t port;
    pthread_t io_thread;
    int io_started;
    atomic_int stop, quiesce;
    int quiesced;               /* event thread: the listener is closed */
    double accept_paused_until; /* out of file descriptors: retry then */
    double next_sweep;

    exl_http_conn *conns; /* event thread */
    int32_t n_conns;
    exl_http_conn *dead;  /* closed, to be freed */
    exl_http_conn *ready; /* connections with a pipelined request to parse */
    atomic_int n_busy;    /* requests in progress */
    int64_t body_bytes;   /* request bodies held, all connections (event thread) */
    http_peer **peers;    /* hash buckets */

    pthread_mutex_t mu; /* the notify list */
    exl_http_conn *notify_head;

    pthread_mutex_t task_mu; /* the worker queue */
    pthread_cond_t task_cv;
    exl_http_conn *task_head, *task_tail;
    int workers_stop;
    pthread_t *workers;
    int n_workers;

    atomic_ullong status_counts[HTTP_STATUS_MAX];
    atomic_ullong next_request;
};

/* http.c */
void http_log(exl_http *h, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void http_count(exl_http *h, int status);
/* Queue a worker task for the connection (which becomes busy). */
void http_dispatch(exl_http_conn *c, enum conn_task task);
/* Set the epoll interest the connection's state calls for. */
void http_update_events(exl_http_conn *c);
/* Stop watching its socket. */
void http_unwatch(exl_http_conn *c);
/* Forget the connection's body (and its share of the bodies held). */
void http_body_free(exl_http_conn *c);
/* Close the connection: free its reply, close its socket (it must not be busy); its memory goes
 * after the current batch of events. */
void http_conn_close(exl_http_conn *c);
void http_busy_add(exl_http_conn *c, int delta);
/* Parse the connection's pipelined input once the current batch of events is handled. */
void http_schedule_ready(exl_http_conn *c);

/* http_conn.c */
exl_http_conn *http_conn_new(exl_http *h, int fd, http_peer *peer);
/* The socket is readable (or hung up). */
void http_conn_on_input(exl_http_conn *c);
/* The socket is writable. */
void http_conn_on_output(exl_http_conn *c);
/* Notified by a worker (done) or a wake. */
void http_conn_on_notify(exl_http_conn *c, int flags);
/* A worker runs the connection's task. */
void http_conn_run_task(exl_http_conn *c);
/* Its deadline passed. */
void http_conn_on_timeout(exl_http_conn *c);
/* The server stops accepting: close it if idle, else close after its answer. */
void http_conn_quiesce(exl_http_conn *c);
/* Parse what waits in the connection's input (a pipelined request). */
void http_conn_advance(exl_http_conn *c);
/* An OpenAI-shaped error answered at once and the connection closed after it (event thread). */
void http_conn_fail(exl_http_conn *c, int status, const char *code, const char *message);
/* Write an error to a socket that gets no connection (refused at accept) and close it. */
void http_refuse_socket(exl_http *h, int fd, int status, const char *message);

#endif
