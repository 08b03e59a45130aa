/* http.c - libmicrohttpd glue: the daemon (a thread per connection), the body read
 * with a size limit, the request handed to the handler, its reply turned into an MHD
 * response (a buffer, or a callback for SSE), and one log line per request. */
#include "server/http.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/str.h"

#include <errno.h>
#include <stdarg.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

struct exl_http {
    exl_http_params params; /* host points at the copy below */
    char *host;
    struct MHD_Daemon *mhd;
    int32_t port;
};

__attribute__((format(printf, 2, 3))) static void http_log(const exl_http *h, const char *fmt, ...) {
    if (!h->params.log)
        return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    h->params.log(h->params.log_ctx, line);
}

/* ---------------------------------------------------------------- per-request state */

typedef struct conn_state {
    exl_str body;
    int too_large;
    int status;     /* what was answered, for the log */
    double t0;
    char method[16];
    char path[128];
} conn_state;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int exl_http_peer_gone(int fd) {
    if (fd < 0)
        return 0;
    char c;
    ssize_t n = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* ---------------------------------------------------------------- replies */

static ssize_t stream_read(void *cls, uint64_t pos, char *buf, size_t max) {
    exl_http_reply *r = cls;
    ssize_t n = r->read(r->ctx, buf, max);
    return n == EXL_HTTP_END ? MHD_CONTENT_READER_END_OF_STREAM : n < 0 ? MHD_CONTENT_READER_END_WITH_ERROR : n;
}

static void stream_free(void *cls) {
    exl_http_reply *r = cls;
    r->free(r->ctx);
    exl_free(r);
}

/* Queue the reply; it is consumed whatever happens. */
static enum MHD_Result send_reply(struct MHD_Connection *c, conn_state *cs, exl_http_reply *reply) {
    cs->status = reply->status;
    struct MHD_Response *resp = NULL;
    if (reply->read) {
        exl_http_reply *held = exl_malloc(sizeof *held);
        if (held) {
            *held = *reply;
            resp = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, stream_read, held, stream_free);
            if (!resp)
                exl_free(held);
        }
        if (!resp)
            reply->free(reply->ctx);
        else {
            MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
            MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
        }
    } else if (reply->status) {
        resp = MHD_create_response_from_buffer_with_free_callback(reply->body_len, reply->body, exl_free);
        if (!resp)
            exl_free(reply->body);
        else {
            MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
            if (reply->allow)
                MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, reply->allow);
        }
    }
    if (!resp) {
        cs->status = 0;
        return MHD_NO; /* drop the connection */
    }
    enum MHD_Result rc = MHD_queue_response(c, (unsigned)reply->status, resp);
    MHD_destroy_response(resp);
    return rc;
}

/* Hand the request to the handler and queue its reply. */
static enum MHD_Result answer(exl_http *h, struct MHD_Connection *c, conn_state *cs, const char *url,
                              const char *method) {
    const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    exl_http_request req = {
        .method = method,
        .path = url,
        .authorization = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION),
        .body = cs->body.data ? cs->body.data : "",
        .body_len = cs->body.len,
        .too_large = cs->too_large,
        .fd = ci ? ci->connect_fd : -1,
    };
    exl_http_reply reply = {0};
    h->params.handler(h->params.user, &req, &reply);
    exl_str_free(&cs->body);
    return send_reply(c, cs, &reply);
}

/* ---------------------------------------------------------------- MHD callbacks */

static enum MHD_Result on_access(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                 const char *version, const char *upload, size_t *upload_size, void **con_cls) {
    exl_http *h = cls;
    conn_state *cs = *con_cls;
    if (!cs) { /* first call: headers only */
        cs = exl_calloc(1, sizeof *cs);
        if (!cs)
            return MHD_NO;
        cs->t0 = now_s();
        snprintf(cs->method, sizeof cs->method, "%s", method);
        snprintf(cs->path, sizeof cs->path, "%s", url);
        *con_cls = cs;
        const char *cl = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl && strtoull(cl, NULL, 10) > (unsigned long long)h->params.max_body) {
            cs->too_large = 1;
            return answer(h, c, cs, url, method); /* MHD closes the connection after it */
        }
        return MHD_YES;
    }
    if (*upload_size) {
        if (!cs->too_large && cs->body.len + *upload_size <= (size_t)h->params.max_body) {
            if (exl_str_append(&cs->body, upload, *upload_size))
                return MHD_NO;
        } else {
            cs->too_large = 1;
            exl_str_free(&cs->body);
        }
        *upload_size = 0;
        return MHD_YES;
    }
    return answer(h, c, cs, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls, enum MHD_RequestTerminationCode toe) {
    exl_http *h = cls;
    conn_state *cs = *con_cls;
    if (!cs)
        return;
    http_log(h, "%s %s %d %.1f ms%s", cs->method, cs->path, cs->status, (now_s() - cs->t0) * 1e3,
                   toe == MHD_REQUEST_TERMINATED_COMPLETED_OK ? "" : " (connection closed early)");
    exl_str_free(&cs->body);
    exl_free(cs);
    *con_cls = NULL;
}

/* libmicrohttpd's own printf-style messages */
__attribute__((format(printf, 2, 0))) static void on_mhd_error(void *cls, const char *fmt, va_list ap) {
    exl_http *h = cls;
    char line[512];
    vsnprintf(line, sizeof line, fmt, ap);
    line[strcspn(line, "\n")] = 0;
    http_log(h, "http: %s", line);
}

/* ---------------------------------------------------------------- daemon */

exl_status exl_http_start(const exl_http_params *params, exl_http **out) {
    *out = NULL;
    exl_http *h = exl_calloc(1, sizeof *h);
    if (!h || !(h->host = exl_strdup(params->host))) {
        exl_free(h);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    h->params = *params;
    h->params.host = h->host;
    char port[16];
    snprintf(port, sizeof port, "%d", (int)params->port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai;
    int gai = getaddrinfo(h->host, port, &hints, &ai);
    if (gai) {
        exl_http_stop(h);
        return exl_fail(EXL_ERR_ARG, "server: cannot resolve host '%s': %s", params->host, gai_strerror(gai));
    }
    unsigned flags = MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6)
        flags |= MHD_USE_IPv6;
    h->mhd = MHD_start_daemon(flags, 0, NULL, NULL, on_access, h,
                              MHD_OPTION_EXTERNAL_LOGGER, on_mhd_error, h, /* first, to catch all */
                              MHD_OPTION_SOCK_ADDR, ai->ai_addr,
                              MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)params->timeout_s,
                              MHD_OPTION_CONNECTION_LIMIT, (unsigned)params->max_connections,
                              MHD_OPTION_LISTENING_ADDRESS_REUSE, 1,
                              MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!h->mhd) {
        exl_http_stop(h);
        return exl_fail(EXL_ERR_IO, "server: cannot listen on %s port %d (in use, or not an address here?)",
                        params->host, (int)params->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di && di->port ? di->port : params->port;
    *out = h;
    return EXL_OK;
}

int32_t exl_http_port(const exl_http *h) { return h->port; }

void exl_http_stop(exl_http *h) {
    if (!h)
        return;
    if (h->mhd)
        MHD_stop_daemon(h->mhd);
    exl_free(h->host);
    exl_free(h);
}
