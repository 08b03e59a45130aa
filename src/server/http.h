/* http.h - the server's HTTP layer, free of libmicrohttpd types and of the routes: a daemon
 * (a thread per connection) hands every request (method, path, the Authorization header, the
 * body) to a handler, a function pointer with its user data, which fills the reply (a JSON body
 * with a status, or a stream read chunk by chunk, for SSE). */
#ifndef EXL_SERVER_HTTP_H
#define EXL_SERVER_HTTP_H

#include "exl.h"

#include <stddef.h>
#include <sys/types.h>

typedef struct exl_http_request {
    const char *method;
    const char *path;
    const char *authorization; /* NULL when absent */
    const char *body;          /* NUL-terminated */
    size_t body_len;
    int too_large;             /* the body outgrew max_body: it was dropped (body is "") */
    int fd;                    /* the client's socket (to notice it leaving), -1 if unknown */
} exl_http_request;

/* read: bytes written to buf (> 0), EXL_HTTP_END at the end, EXL_HTTP_ABORT to drop
 * the connection. free is called once, however the exchange ends. */
#define EXL_HTTP_END ((ssize_t)-1)
#define EXL_HTTP_ABORT ((ssize_t)-2)

typedef struct exl_http_reply {
    int status;           /* 0 = close the connection without answering */
    char *body;           /* exl_malloc'd JSON, owned by the reply */
    size_t body_len;
    const char *allow;    /* the Allow header of a 405 */
    ssize_t (*read)(void *ctx, char *buf, size_t max); /* a text/event-stream body instead */
    void (*free)(void *ctx);
    void *ctx;
} exl_http_reply;

/* Answer one request; called on the connection's thread, so it may block (a completion waits
 * for its tokens). */
typedef void (*exl_http_handler)(void *user, const exl_http_request *req, exl_http_reply *reply);

typedef struct exl_http_params {
    const char *host;        /* address to bind */
    int32_t port;            /* 0 = any free port (see exl_http_port) */
    int64_t max_body;        /* larger bodies reach the handler as too_large */
    int32_t max_connections;
    int32_t timeout_s;       /* idle connection timeout */
    exl_http_handler handler;
    void *user;
    /* one line per finished request and per libmicrohttpd message; may be NULL */
    void (*log)(void *ctx, const char *line);
    void *log_ctx;
} exl_http_params;

typedef struct exl_http exl_http;

exl_status exl_http_start(const exl_http_params *params, exl_http **out);
/* The port actually bound. */
int32_t exl_http_port(const exl_http *http);
/* Stop listening, wait for the connections' threads (their handlers must return), free all. */
void exl_http_stop(exl_http *http);
/* Whether the peer has closed its end (a pending read would see end-of-file or an error). */
int exl_http_peer_gone(int fd);

#endif
