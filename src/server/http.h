/* http.h - what the routes see of an HTTP exchange, free of libmicrohttpd types: the
 * request (method, path, the Authorization header, the body) and the reply they fill
 * (a JSON body with a status, or a stream read chunk by chunk, for SSE). */
#ifndef EXL_SERVER_HTTP_H
#define EXL_SERVER_HTTP_H

#include "server/openai_request.h"
#include "server/server_internal.h"

#include <stddef.h>
#include <sys/types.h>

typedef struct exl_http_request {
    const char *method;
    const char *path;
    const char *authorization; /* NULL when absent */
    const char *body;          /* NUL-terminated */
    size_t body_len;
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

/* Start / stop the daemon on srv->params host and port (srv->port gets the bound port). */
exl_status exl_http_start(exl_server *srv);
void exl_http_stop(exl_server *srv);
/* Whether the peer has closed its end (a pending read would see end-of-file or an error). */
int exl_http_peer_gone(int fd);

/* routes.c: answer one request. */
void exl_route(exl_server *srv, const exl_http_request *req, exl_http_reply *reply);
/* Fill reply with an OpenAI-shaped error. */
void exl_reply_error(exl_http_reply *reply, const exl_oai_error *err);
/* Fill reply with a 200 JSON body (json is taken over; NULL means out of memory: 500). */
void exl_reply_json(exl_http_reply *reply, int status, char *json);

/* completions.c: POST /v1/completions and /v1/chat/completions. */
void exl_completions(exl_server *srv, exl_oai_kind kind, const exl_http_request *req, exl_http_reply *reply);

#endif
