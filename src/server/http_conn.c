/* http_conn.c - one connection's life (see http_internal.h): the head read and parsed under the
 * request deadline, `admit` before any body is read, the body (Content-Length or chunked) read
 * within max_body, `handle` and `pump` run on a worker, the answer formatted (whole, or chunked
 * as the pump makes it) and written without blocking, then keep-alive or a lingering close that
 * drains what the client still sends, so it reads the answer instead of a reset. */
#include "server/http_internal.h"

#include "base/alloc.h"
#include "server/openai_error.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#define READ_CHUNK 16384
#define LINGER_S 3.0
#define READS_PER_EVENT 16        /* then the event thread moves on to other connections */
#define BODY_BUDGET (256LL << 20) /* request bodies held at once, at least (4 x max_body when more) */

exl_http_conn *http_conn_new(exl_http *h, int fd, http_peer *peer) {
    exl_http_conn *c = exl_calloc(1, sizeof *c);
    if (c) {
        c->h = h;
        c->fd = fd;
        c->peer = peer;
        c->phase = PHASE_HEAD;
    }
    return c;
}

/* ---------------------------------------------------------------- the log line */

/* The bytes of s, with anything but printable ASCII as \xNN, at most about 200 of them. */
static void escaped(const char *s, char *out, size_t cap) {
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p && o + 8 < cap; p++) {
        if (o > 200) {
            memcpy(out + o, "...", 3);
            o += 3;
            break;
        }
        if (*p >= 0x20 && *p < 0x7f && *p != '\\' && *p != '"')
            out[o++] = (char)*p;
        else
            o += (size_t)snprintf(out + o, cap - o, "\\x%02x", *p);
    }
    out[o] = 0;
}

static void log_request(exl_http_conn *c, int status, const char *note) {
    char path[256];
    escaped(c->req.path ? c->req.path : "-", path, sizeof path);
    double ms = c->t_first ? (exl_http_now() - c->t_first) * 1e3 : 0;
    http_log(c->h, "%s %s %s %d %.1f ms %llu B%s", c->request_id[0] ? c->request_id : "-",
             c->req.method ? c->req.method : "-", path, status, ms, (unsigned long long)c->bytes_out, note);
    http_count(c->h, status);
}

/* ---------------------------------------------------------------- formatting the answer */

static int put(exl_http_conn *c, const char *s, size_t n) {
    if (exl_str_append(&c->out, s, n)) {
        c->gone = 1; /* out of memory: drop the connection */
        return -1;
    }
    return 0;
}

__attribute__((format(printf, 2, 3))) static int putf(exl_http_conn *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = exl_str_vprintf(&c->out, fmt, ap);
    va_end(ap);
    if (rc)
        c->gone = 1;
    return rc;
}

/* The Origin to allow: "*", the request's own when it is in the configured list, else NULL. */
static const char *allowed_origin(const exl_http_conn *c) {
    const char *list = c->h->p.cors_origin, *origin = c->head.origin;
    if (!list)
        return NULL;
    if (!strcmp(list, "*"))
        return "*";
    size_t n = origin ? strlen(origin) : 0;
    for (const char *p = list; origin && *p;) {
        size_t len = strcspn(p, ",");
        if (len == n && !strncmp(p, origin, n))
            return origin;
        p += len + (p[len] == ',');
    }
    return NULL;
}

static void cors_headers(exl_http_conn *c) {
    const char *origin = allowed_origin(c);
    if (!origin)
        return;
    putf(c, "Access-Control-Allow-Origin: %s\r\n%sAccess-Control-Expose-Headers: x-request-id\r\n", origin,
         strcmp(origin, "*") ? "Vary: Origin\r\n" : "");
    if (c->preflight)
        putf(c,
             "Access-Control-Allow-Methods: GET, POST, OPTIONS\r\nAccess-Control-Allow-Headers: %s\r\n"
             "Access-Control-Max-Age: 600\r\n",
             c->head.cors_headers ? c->head.cors_headers : "Authorization, Content-Type");
}

/* content_length < 0: the body follows as the pump makes it. */
static void write_head(exl_http_conn *c, long long content_length) {
    const exl_http_reply *r = &c->reply;
    c->status = r->status;
    c->chunked_out = content_length < 0 && c->head.minor >= 1;
    if (atomic_load(&c->h->quiesce) || (content_length < 0 && !c->chunked_out))
        c->keep_alive = 0;
    putf(c, "HTTP/1.1 %d %s\r\n", r->status, exl_http_reason(r->status));
    if (r->status != 204)
        putf(c, "Content-Type: %s\r\n", r->content_type ? r->content_type : "application/json");
    if (content_length >= 0 && r->status != 204)
        putf(c, "Content-Length: %lld\r\n", content_length);
    if (c->chunked_out)
        putf(c, "Transfer-Encoding: chunked\r\n");
    if (content_length < 0)
        putf(c, "Cache-Control: no-cache\r\nX-Accel-Buffering: no\r\n");
    putf(c, "Connection: %s\r\n", c->keep_alive ? "keep-alive" : "close");
    if (c->request_id[0])
        putf(c, "x-request-id: %s\r\n", c->request_id);
    if (r->allow)
        putf(c, "Allow: %s\r\n", r->allow);
    if (r->status == 401)
        putf(c, "WWW-Authenticate: Bearer\r\n");
    cors_headers(c);
    put(c, "\r\n", 2);
    c->head_sent = 1;
}

static void server_error(exl_http_reply *r) {
    exl_oai_error err;
    exl_oai_fail(&err, 500, "server_error", NULL, NULL, "the server could not form an answer");
    exl_free(r->body);
    r->body = exl_oai_error_json(&err);
    r->body_len = r->body ? strlen(r->body) : 0;
    r->status = r->body ? 500 : 0;
    r->content_type = NULL;
}

/* Empty a buffer; one that grew large (a long answer) is given back rather than kept for the next. */
static void release(exl_str *s) {
    if (s->cap > 65536)
        exl_str_free(s);
    else
        exl_str_clear(s);
}

/* Format what a handler or pump produced: data (a streamed piece) and rc (EXL_HTTP_MORE / DONE / DROP). */
static void emit(exl_http_conn *c, const char *data, size_t n, int rc) {
    if (rc == EXL_HTTP_DROP) {
        c->gone = 1;
        return;
    }
    if (c->streaming) {
        if (!c->head_sent)
            write_head(c, -1);
        if (n && c->chunked_out)
            putf(c, "%zx\r\n", n);
        if (n)
            put(c, data, n);
        if (n && c->chunked_out)
            put(c, "\r\n", 2);
        if (rc == EXL_HTTP_DONE) {
            if (c->chunked_out)
                put(c, "0\r\n\r\n", 5);
            c->reply_done = 1;
        }
        return;
    }
    if (rc != EXL_HTTP_DONE)
        return; /* a pending answer, not known yet */
    exl_http_reply *r = &c->reply;
    if (!r->status || (!r->body && r->status != 204))
        server_error(r);
    if (!r->status) {
        c->gone = 1;
        return;
    }
    write_head(c, (long long)r->body_len);
    if (strcmp(c->req.method ? c->req.method : "", "HEAD") && r->body_len)
        put(c, r->body, r->body_len);
    exl_free(r->body);
    r->body = NULL;
    c->reply_done = 1;
}

void http_conn_run_task(exl_http_conn *c) {
    exl_http *h = c->h;
    if (c->task == TASK_HANDLE) {
        h->p.handle(h->p.user, &c->req, &c->reply);
        c->reply_live = 1;
        c->streaming = c->reply.status && c->reply.pump;
        if (!c->reply.pump) {
            emit(c, NULL, 0, c->reply.status ? EXL_HTTP_DONE : EXL_HTTP_DROP);
            return;
        }
    }
    exl_str_clear(&c->scratch);
    int rc = c->reply.pump(c->reply.ctx, &c->reply, &c->scratch);
    emit(c, c->scratch.data, c->scratch.len, rc);
    release(&c->scratch);
}

/* ---------------------------------------------------------------- the end of an exchange */

static void client_gone(exl_http_conn *c, const char *why) {
    if (c->busy) { /* closed when its worker is done; meanwhile the socket is not watched */
        c->hung_up = 1;
        http_unwatch(c);
        return;
    }
    if (c->counted)
        log_request(c, c->reply_done ? c->status : 499, why);
    http_conn_close(c);
}

static void linger(exl_http_conn *c) {
    shutdown(c->fd, SHUT_WR);
    c->phase = PHASE_LINGER;
    c->deadline = exl_http_now() + LINGER_S;
    exl_str_free(&c->in);
    http_update_events(c);
}

static void request_end(exl_http_conn *c) {
    exl_http *h = c->h;
    log_request(c, c->status, "");
    if (c->reply_live && c->reply.free)
        c->reply.free(c->reply.ctx);
    exl_free(c->reply.body);
    c->reply = (exl_http_reply){0};
    c->reply_live = c->streaming = c->chunked_out = c->preflight = 0;
    c->head_sent = c->reply_done = c->status = c->want_pump = 0;
    c->bytes_out = 0;
    c->t_first = 0;
    c->request_id[0] = 0;
    exl_free(c->head_buf);
    c->head_buf = NULL;
    c->head = (exl_http_head){0};
    c->req = (exl_http_request){0};
    http_body_free(c);
    if (c->counted)
        http_busy_add(c, -1);
    c->counted = 0;
    if (!c->keep_alive || h->quiesced) {
        linger(c);
        return;
    }
    c->phase = PHASE_HEAD;
    c->deadline = exl_http_now() + h->p.idle_timeout_s;
    if (c->in.len)
        http_schedule_ready(c);
    http_update_events(c);
}

/* Write what waits; once all is out, end the exchange or run the pump if it was woken (so a
 * client that reads slowly holds back its pump, not the server's memory). */
static void flush(exl_http_conn *c) {
    while (c->out_pos < c->out.len) {
        ssize_t n = send(c->fd, c->out.data + c->out_pos, c->out.len - c->out_pos, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n > 0) {
            c->out_pos += (size_t)n;
            c->bytes_out += (uint64_t)n;
            if (c->phase == PHASE_REPLY)
                c->deadline = 0; /* progress: the write timeout starts again at the next stall */
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            if (c->phase == PHASE_REPLY && !c->deadline)
                c->deadline = exl_http_now() + c->h->p.idle_timeout_s;
            http_update_events(c);
            return;
        }
        client_gone(c, " (write failed: client gone)");
        return;
    }
    release(&c->out);
    c->out_pos = 0;
    if (c->phase == PHASE_REPLY) {
        c->deadline = 0;
        if (c->reply_done) {
            request_end(c);
            return;
        }
        if (c->want_pump && c->reply.pump && !c->gone) {
            c->want_pump = 0;
            http_dispatch(c, TASK_PUMP);
            return;
        }
    }
    http_update_events(c);
}

/* Answer c->reply now (event thread). */
static void answer_now(exl_http_conn *c) {
    c->reply_live = 1;
    c->streaming = 0;
    c->phase = PHASE_REPLY;
    c->deadline = 0;
    emit(c, NULL, 0, EXL_HTTP_DONE);
    if (c->gone)
        client_gone(c, " (out of memory)");
    else
        flush(c);
}

static const char *error_code(int status) {
    switch (status) {
    case 408: return "request_timeout";
    case 413: return "request_too_large";
    case 414: return "uri_too_long";
    case 417: return "expectation_failed";
    case 431: return "headers_too_large";
    case 501: return "not_implemented";
    case 505: return "http_version_not_supported";
    default: return NULL;
    }
}

void http_conn_fail(exl_http_conn *c, int status, const char *code, const char *message) {
    exl_oai_error err;
    exl_oai_fail(&err, status, status >= 500 ? "server_error" : "invalid_request_error", NULL,
                 code ? code : error_code(status), "%s", message);
    exl_free(c->reply.body);
    c->reply = (exl_http_reply){.status = status, .body = exl_oai_error_json(&err)};
    c->reply.body_len = c->reply.body ? strlen(c->reply.body) : 0;
    c->keep_alive = 0;
    answer_now(c);
}

void http_refuse_socket(exl_http *h, int fd, int status, const char *message) {
    exl_oai_error err;
    exl_oai_fail(&err, status, status >= 500 ? "server_error" : "invalid_request_error", NULL,
                 status == 429 ? "too_many_connections" : "server_busy", "%s", message);
    char *json = exl_oai_error_json(&err), buf[1024];
    int n = json ? snprintf(buf, sizeof buf,
                            "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n"
                            "Connection: close\r\n\r\n%s",
                            status, exl_http_reason(status), strlen(json), json)
                 : 0;
    exl_free(json);
    char sink[4096]; /* what already came (a little of it), so closing does not reset the connection first */
    for (int i = 0; i < 4 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; i++) {
    }
    if (n > 0 && (size_t)n < sizeof buf && send(fd, buf, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) > 0)
        shutdown(fd, SHUT_WR);
    close(fd);
    http_count(h, status);
}

/* ---------------------------------------------------------------- reading a request */

static void consume(exl_http_conn *c, size_t n) {
    memmove(c->in.data, c->in.data + n, c->in.len - n);
    c->in.len -= n;
    c->in.data[c->in.len] = 0;
}

static int preflight(exl_http_conn *c) {
    const exl_http_head *hd = &c->head;
    if (!c->h->p.cors_origin || strcmp(hd->method, "OPTIONS") || !hd->origin || !hd->cors_method)
        return 0;
    c->preflight = 1;
    c->reply = (exl_http_reply){.status = 204};
    answer_now(c);
    return 1;
}

/* The head is parsed: admit the request, then read its body. 1 when the body is next. */
static int start_request(exl_http_conn *c) {
    exl_http *h = c->h;
    exl_http_head *hd = &c->head;
    int has_body = hd->chunked || hd->content_length > 0;
    c->keep_alive = hd->keep_alive;
    c->req = (exl_http_request){.method = hd->method,
                                .path = hd->path,
                                .authorization = hd->authorization,
                                .request_id = c->request_id,
                                .received = exl_http_now(),
                                .conn = c};
    if (preflight(c))
        return 0;
    if (!h->p.admit(h->p.user, &c->req, &c->reply)) {
        if (has_body)
            c->keep_alive = 0; /* the body is never read */
        answer_now(c);
        return 0;
    }
    if (hd->content_length > h->p.max_body) {
        char msg[96];
        snprintf(msg, sizeof msg, "the request body is larger than %lld bytes", (long long)h->p.max_body);
        http_conn_fail(c, 413, NULL, msg);
        return 0;
    }
    if (hd->expect_continue && has_body && hd->minor >= 1)
        put(c, "HTTP/1.1 100 Continue\r\n\r\n", 25);
    c->phase = PHASE_BODY;
    c->body_left = hd->content_length > 0 ? hd->content_length : 0;
    c->chunk = (exl_http_chunked){0};
    if (c->out.len)
        flush(c);
    return !c->dead;
}

static int head_step(exl_http_conn *c) {
    exl_http *h = c->h;
    if (!c->in.len)
        return 0;
    if (!c->t_first) {
        c->t_first = exl_http_now();
        c->deadline = c->t_first + h->p.request_timeout_s;
        c->counted = 1;
        http_busy_add(c, 1);
        snprintf(c->request_id, sizeof c->request_id, "req-%016llx",
                 (unsigned long long)atomic_fetch_add(&h->next_request, 1));
    }
    long end = exl_http_head_end(c->in.data, c->in.len);
    if (end == 0)
        return 0;
    if (end < 0) {
        http_conn_fail(c, (int)-end, NULL,
                       end == -414 ? "the request line is too long" : "the request head is too large");
        return 0;
    }
    if (!(c->head_buf = exl_strndup(c->in.data, (size_t)end))) {
        http_conn_fail(c, 503, "out_of_memory", "out of memory");
        return 0;
    }
    consume(c, (size_t)end);
    const char *why = NULL;
    int st = exl_http_parse_head(c->head_buf, (size_t)end, &c->head, &why);
    if (st) {
        http_conn_fail(c, st, NULL, why);
        return 0;
    }
    return start_request(c);
}

/* Count the body read so far among the bodies held; refuse it (503) when they would outgrow the
 * budget: max_body bounds one request, this bounds them all. 1 when refused. */
static int hold_body(exl_http_conn *c) {
    exl_http *h = c->h;
    int64_t budget = h->p.max_body * 4 > BODY_BUDGET ? h->p.max_body * 4 : BODY_BUDGET;
    h->body_bytes += (int64_t)(c->body.len - c->body_counted);
    c->body_counted = c->body.len;
    if (h->body_bytes <= budget)
        return 0;
    http_conn_fail(c, 503, "server_busy", "too many request bodies are being received at once; try again");
    return 1;
}

static int body_step(exl_http_conn *c) {
    exl_http *h = c->h;
    if (c->head.chunked) {
        int over = 0, done = 0;
        const char *why = NULL;
        long used = exl_http_chunked_feed(&c->chunk, c->in.data ? c->in.data : "", c->in.len, &c->body,
                                          (size_t)h->p.max_body, &over, &done, &why);
        if (used < 0) {
            http_conn_fail(c, 400, "bad_chunked_body", why);
            return 0;
        }
        consume(c, (size_t)used);
        if (over) {
            char msg[96];
            snprintf(msg, sizeof msg, "the request body is larger than %lld bytes", (long long)h->p.max_body);
            http_conn_fail(c, 413, NULL, msg);
            return 0;
        }
        if (!done) {
            hold_body(c);
            return 0;
        }
    } else {
        size_t take = c->in.len < (uint64_t)c->body_left ? c->in.len : (size_t)c->body_left;
        if (take && exl_str_append(&c->body, c->in.data, take)) {
            http_conn_fail(c, 503, "out_of_memory", "out of memory");
            return 0;
        }
        consume(c, take);
        c->body_left -= (int64_t)take;
        if (c->body_left) {
            hold_body(c);
            return 0;
        }
    }
    if (hold_body(c))
        return 0;
    c->deadline = 0;
    c->req.body = c->body.data ? c->body.data : "";
    c->req.body_len = c->body.len;
    c->phase = PHASE_REPLY;
    http_dispatch(c, TASK_HANDLE);
    return 0;
}

void http_conn_advance(exl_http_conn *c) {
    while (!c->dead && !c->busy) {
        if (c->phase == PHASE_HEAD ? !head_step(c) : c->phase == PHASE_BODY ? !body_step(c) : 1)
            return;
    }
}

/* ---------------------------------------------------------------- events */

static void drain_lingering(exl_http_conn *c) {
    char sink[READ_CHUNK];
    for (int i = 0; i < READS_PER_EVENT; i++) {
        ssize_t n = recv(c->fd, sink, sizeof sink, MSG_DONTWAIT);
        if (n > 0)
            continue;
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        http_conn_close(c);
        return;
    }
}

void http_conn_on_input(exl_http_conn *c) {
    if (c->phase == PHASE_REPLY) { /* only hang-ups are watched now */
        client_gone(c, " (client gone)");
        return;
    }
    if (c->phase == PHASE_LINGER) {
        drain_lingering(c);
        return;
    }
    for (int i = 0; i < READS_PER_EVENT; i++) {
        if (exl_str_reserve(&c->in, READ_CHUNK)) {
            http_conn_close(c);
            return;
        }
        ssize_t n = recv(c->fd, c->in.data + c->in.len, READ_CHUNK, MSG_DONTWAIT);
        if (n > 0) {
            c->in.len += (size_t)n;
            c->in.data[c->in.len] = 0;
            http_conn_advance(c);
            if (c->dead || (c->phase != PHASE_HEAD && c->phase != PHASE_BODY))
                return;
            continue;
        }
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
            return;
        if (c->counted)
            log_request(c, 499, " (client closed before the request was complete)");
        http_conn_close(c); /* end of file or an error: an unfinished request gets no answer */
        return;
    } /* enough for one turn: the others get theirs, and epoll brings this one back */
}

void http_conn_on_output(exl_http_conn *c) {
    if (!c->busy)
        flush(c);
}

void http_conn_on_notify(exl_http_conn *c, int flags) {
    if (flags & NOTIFY_DONE) {
        c->busy = 0;
        if (c->gone || c->hung_up) {
            client_gone(c, " (client gone)");
            return;
        }
    }
    if (flags & NOTIFY_WAKE)
        c->want_pump = 1;
    if (!c->busy && c->phase == PHASE_REPLY)
        flush(c); /* writes what waits; once all is out, ends the exchange or runs the pump */
}

void http_conn_on_timeout(exl_http_conn *c) {
    switch (c->phase) {
    case PHASE_HEAD:
        if (!c->t_first) {
            http_conn_close(c); /* idle keep-alive */
            return;
        }
        /* fall through */
    case PHASE_BODY: http_conn_fail(c, 408, NULL, "the request did not arrive in time"); return;
    case PHASE_REPLY: client_gone(c, " (write timeout)"); return;
    case PHASE_LINGER: http_conn_close(c); return;
    }
}

void http_conn_quiesce(exl_http_conn *c) {
    if (c->busy || (c->phase != PHASE_HEAD && c->phase != PHASE_BODY))
        return; /* answering: it closes after its answer */
    if (c->t_first)
        http_conn_fail(c, 503, "shutting_down", "the server is shutting down");
    else
        http_conn_close(c);
}
