/* http.h - the server's HTTP/1.1 layer, free of the routes: one event thread (epoll) owns every
 * socket and never runs a handler; a small pool of worker threads runs them. A hostile or slow
 * client costs a socket and a few kilobytes, never a thread: the head and body must arrive
 * within request_timeout_s of their first byte, idle keep-alive connections and stalled
 * writes end after idle_timeout_s, and connections are capped in all and per client address.
 *
 * A request reaches the routes twice: `admit` sees its head on the event thread (cheap checks
 * only: route, method, key) and may answer at once, before a byte of the body is read; else
 * `handle` gets the whole body on a worker. A reply is whole (status and body), or pending:
 * its `pump` is called on a worker, first right after `handle` and then whenever
 * exl_http_wake is called for the connection, and appends what is ready (chunked when the
 * status is already set, the SSE case) or sets the status and body once the answer is known.
 * A client that leaves (end-of-file, reset, failed write) has its reply freed at once, which
 * is how its jobs get cancelled. Errors of the HTTP layer itself are OpenAI-shaped JSON. */
#ifndef EXL_SERVER_HTTP_H
#define EXL_SERVER_HTTP_H

#include "base/str.h"
#include "exl.h"

#include <stddef.h>

typedef struct exl_http exl_http;
typedef struct exl_http_conn exl_http_conn;

typedef struct exl_http_request {
    const char *method;
    const char *path;          /* percent-decoded, without the query */
    const char *authorization; /* NULL when absent */
    const char *request_id;    /* also sent back as x-request-id */
    const char *body;          /* NUL-terminated; NULL in admit */
    size_t body_len;
    double received;     /* monotonic seconds (exl_http_now) when the head was complete */
    exl_http_conn *conn; /* for exl_http_wake */
} exl_http_request;

/* What a pump returns. */
#define EXL_HTTP_MORE 0  /* call again after the next wake */
#define EXL_HTTP_DONE 1  /* the body is complete */
#define EXL_HTTP_DROP -1 /* close the connection without (more of) an answer */

typedef struct exl_http_reply {
    int status;               /* 0 while a pending reply has no answer yet */
    const char *content_type; /* NULL: application/json */
    char *body;               /* exl_malloc'd, owned by the reply (whole replies) */
    size_t body_len;
    const char *allow; /* the Allow header of a 405 */
    /* pending replies: pump may set status/body (whole) or append to out (streamed, status set) */
    int (*pump)(void *ctx, struct exl_http_reply *reply, exl_str *out);
    void (*free)(void *ctx); /* called once, on the event thread, however the exchange ends */
    void *ctx;
} exl_http_reply;

/* Event thread: return 1 to read the body and call handle, 0 when reply is filled. */
typedef int (*exl_http_admit_fn)(void *user, const exl_http_request *req, exl_http_reply *reply);
/* Worker thread: fill reply (whole or pending). */
typedef void (*exl_http_handle_fn)(void *user, const exl_http_request *req, exl_http_reply *reply);

typedef struct exl_http_params {
    const char *host;               /* address to bind */
    int32_t port;                   /* 0 = any free port (see exl_http_port) */
    int64_t max_body;               /* larger bodies are refused with 413; the bodies of all requests
                                       together, with 503 beyond max(256 MiB, 4 x max_body) */
    int32_t max_connections;        /* in all; more are refused with 503 */
    int32_t max_client_connections; /* per client address (429 beyond); 0 = no cap */
    int32_t request_timeout_s;      /* from a request's first byte to its last (408) */
    int32_t idle_timeout_s;         /* keep-alive idle, and a write that makes no progress */
    int32_t workers;                /* handler threads */
    const char *cors_origin;        /* Access-Control-Allow-Origin for every answer; NULL = no CORS */
    exl_http_admit_fn admit;
    exl_http_handle_fn handle;
    void *user;
    /* one line per finished request and per server-side problem; may be NULL */
    void (*log)(void *ctx, const char *line);
    void *log_ctx;
} exl_http_params;

/* *out is set before any thread starts, so the handlers may use it (it is NULL on failure). */
exl_status exl_http_start(const exl_http_params *params, exl_http **out);
/* The port actually bound. */
int32_t exl_http_port(const exl_http *http);
/* Stop accepting connections and close the idle ones; requests in progress go on, and the
 * connections close after their current answer. */
void exl_http_quiesce(exl_http *http);
/* Connections with a request in progress (being read, handled or answered). */
int32_t exl_http_busy(exl_http *http);
/* Close every connection, stop the threads, free all. */
void exl_http_stop(exl_http *http);
/* Ask for the connection's pump to be called (any thread; the connection's reply must not have
 * been freed yet). */
void exl_http_wake(void *conn);
/* Answers sent with this status since the start (for metrics). */
uint64_t exl_http_status_count(const exl_http *http, int status);
/* Monotonic seconds. */
double exl_http_now(void);

#endif
