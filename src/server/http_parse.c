/* http_parse.c - the request head and the chunked body, parsed strictly (see http_parse.h). */
#include "server/http_parse.h"

#include <string.h>
#include <strings.h>

/* ---------------------------------------------------------------- head boundaries */

static size_t skip_blank_lines(const char *buf, size_t n) {
    size_t i = 0;
    while (i < n && (buf[i] == '\r' || buf[i] == '\n'))
        i++;
    return i;
}

long exl_http_head_end(const char *buf, size_t n) {
    size_t start = skip_blank_lines(buf, n);
    const char *lf = memchr(buf + start, '\n', n - start);
    if (!lf)
        return n - start > EXL_HTTP_MAX_LINE ? -414 : n > EXL_HTTP_MAX_HEAD ? -431 : 0;
    if ((size_t)(lf - buf) - start > EXL_HTTP_MAX_LINE)
        return -414;
    /* the head ends at the first empty line after the request line: "\n\n" or "\n\r\n" */
    for (size_t i = (size_t)(lf - buf); i < n; i++) {
        const char *p = memchr(buf + i, '\n', n - i);
        if (!p)
            break;
        i = (size_t)(p - buf);
        size_t end = i + 1 < n && buf[i + 1] == '\n'                         ? i + 2
                     : i + 2 < n && buf[i + 1] == '\r' && buf[i + 2] == '\n' ? i + 3
                                                                             : 0;
        if (end)
            return end > EXL_HTTP_MAX_HEAD ? -431 : (long)end;
    }
    return n > EXL_HTTP_MAX_HEAD ? -431 : 0;
}

/* ---------------------------------------------------------------- small lexical helpers */

static int is_tchar(unsigned char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
           (c && strchr("!#$%&'*+-.^_`|~", c));
}

static int is_token(const char *s) {
    if (!*s)
        return 0;
    for (; *s; s++)
        if (!is_tchar((unsigned char)*s))
            return 0;
    return 1;
}

static int hex_value(char c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

static char *trim(char *s) {
    while (*s == ' ' || *s == '\t')
        s++;
    size_t n = strlen(s);
    while (n && (s[n - 1] == ' ' || s[n - 1] == '\t'))
        s[--n] = 0;
    return s;
}

/* Split a comma-separated list in place: the next trimmed element, or NULL at the end. */
static char *next_element(char **rest) {
    if (!*rest)
        return NULL;
    char *s = *rest, *comma = strchr(s, ',');
    if (comma)
        *comma = 0;
    *rest = comma ? comma + 1 : NULL;
    return trim(s);
}

/* ---------------------------------------------------------------- the request line */

static int fail(const char **why, const char *reason, int status) {
    *why = reason;
    return status;
}

/* Percent-decode the path of target (up to '?' or '#') into out (room for strlen(target) + 1). */
static int decode_path(const char *target, char *out, const char **why) {
    size_t o = 0;
    for (const char *p = target; *p && *p != '?' && *p != '#'; p++) {
        if (*p != '%') {
            out[o++] = *p;
            continue;
        }
        int hi = hex_value(p[1]), lo = hi < 0 ? -1 : hex_value(p[2]);
        if (lo < 0)
            return fail(why, "malformed percent-encoding in the path", 400);
        if (hi == 0 && lo == 0)
            return fail(why, "%00 in the path", 400);
        out[o++] = (char)(hi * 16 + lo);
        p += 2;
    }
    out[o] = 0;
    return o ? 0 : fail(why, "empty path", 400);
}

/* The origin-form path of a target (writable): "/x" as is, "http://host/x" as "/x", "http://host" and
 * "http://host?q" as "/", "*" for OPTIONS; NULL for anything else. */
static char *path_of(char *target, const char *method) {
    if (target[0] == '/')
        return target;
    if (!strcmp(target, "*"))
        return strcmp(method, "OPTIONS") ? NULL : target;
    char *authority = strncasecmp(target, "http://", 7) == 0    ? target + 7
                      : strncasecmp(target, "https://", 8) == 0 ? target + 8
                                                                : NULL;
    if (!authority || !*authority || strchr("/?#", *authority))
        return NULL;
    char *end = strpbrk(authority, "/?#");
    if (end && *end == '/')
        return end;
    target[0] = '/'; /* no path: the root */
    target[1] = 0;
    return target;
}

static int request_line(char *line, exl_http_head *h, const char **why) {
    char *sp1 = strchr(line, ' '), *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
    if (!sp1 || !sp2 || strchr(sp2 + 1, ' '))
        return fail(why, "malformed request line", 400);
    *sp1 = *sp2 = 0;
    const char *version = sp2 + 1;
    char *target = sp1 + 1;
    h->method = line;
    if (!is_token(h->method) || strlen(h->method) > 32)
        return fail(why, "malformed method", 400);
    for (const unsigned char *p = (const unsigned char *)target; *p; p++)
        if (*p <= ' ' || *p == 0x7f)
            return fail(why, "malformed request target", 400);
    if (strncmp(version, "HTTP/", 5) || !(version[5] >= '0' && version[5] <= '9') || version[6] != '.' ||
        !(version[7] >= '0' && version[7] <= '9') || version[8])
        return fail(why, "malformed HTTP version", 400);
    if (version[5] != '1')
        return fail(why, "only HTTP/1.0 and HTTP/1.1 are supported", 505);
    h->minor = version[7] - '0';
    if (!(h->path = path_of(target, h->method)))
        return fail(why, "malformed request target", 400);
    return decode_path(h->path, h->path, why); /* in place: it is never longer */
}

/* ---------------------------------------------------------------- headers */

typedef struct head_state {
    int hosts, te_seen, close, keep_alive_token;
} head_state;

static int content_length(char *value, exl_http_head *h, const char **why) {
    char *rest = value, *e;
    int any = 0;
    while ((e = next_element(&rest))) {
        size_t n = strlen(e);
        if (!n || n > 18 || strspn(e, "0123456789") != n)
            return fail(why, "malformed Content-Length", 400);
        int64_t v = 0;
        for (size_t i = 0; i < n; i++)
            v = v * 10 + (e[i] - '0');
        if (h->content_length >= 0 && h->content_length != v)
            return fail(why, "conflicting Content-Length values", 400);
        h->content_length = v;
        any = 1;
    }
    return any ? 0 : fail(why, "malformed Content-Length", 400);
}

static int transfer_encoding(char *value, exl_http_head *h, head_state *st, const char **why) {
    char *rest = value, *e;
    while ((e = next_element(&rest))) {
        if (strcasecmp(e, "chunked"))
            return fail(why, *e ? "only Transfer-Encoding: chunked is supported" : "malformed Transfer-Encoding",
                        *e ? 501 : 400);
        if (h->chunked)
            return fail(why, "chunked given twice in Transfer-Encoding", 400);
        h->chunked = 1;
    }
    st->te_seen = 1;
    return 0;
}

static void connection_tokens(char *value, head_state *st) {
    char *rest = value, *e;
    while ((e = next_element(&rest))) {
        if (!strcasecmp(e, "close"))
            st->close = 1;
        else if (!strcasecmp(e, "keep-alive"))
            st->keep_alive_token = 1;
    }
}

static int single(const char **slot, const char *value, const char **why) {
    if (*slot)
        return fail(why, "a header that may appear once appears twice", 400);
    *slot = value;
    return 0;
}

static int header_line(char *line, exl_http_head *h, head_state *st, const char **why) {
    if (*line == ' ' || *line == '\t')
        return fail(why, "folded header lines are not accepted", 400);
    char *colon = strchr(line, ':');
    if (!colon)
        return fail(why, "malformed header line", 400);
    *colon = 0;
    if (!is_token(line))
        return fail(why, "malformed header name", 400);
    char *value = trim(colon + 1);
    for (const unsigned char *p = (const unsigned char *)value; *p; p++)
        if ((*p < ' ' && *p != '\t') || *p == 0x7f)
            return fail(why, "control character in a header value", 400);
    if (!strcasecmp(line, "Content-Length"))
        return content_length(value, h, why);
    if (!strcasecmp(line, "Transfer-Encoding"))
        return transfer_encoding(value, h, st, why);
    if (!strcasecmp(line, "Connection"))
        connection_tokens(value, st);
    else if (!strcasecmp(line, "Host"))
        st->hosts++;
    else if (!strcasecmp(line, "Authorization"))
        return single(&h->authorization, value, why);
    else if (!strcasecmp(line, "Origin"))
        return single(&h->origin, value, why);
    else if (!strcasecmp(line, "Access-Control-Request-Method"))
        return single(&h->cors_method, value, why);
    else if (!strcasecmp(line, "Access-Control-Request-Headers"))
        return single(&h->cors_headers, value, why);
    else if (!strcasecmp(line, "Expect")) {
        if (strcasecmp(value, "100-continue"))
            return fail(why, "only Expect: 100-continue is supported", 417);
        h->expect_continue = 1;
    }
    return 0;
}

static int framing(exl_http_head *h, const head_state *st, const char **why) {
    if (st->te_seen && h->minor == 0)
        return fail(why, "Transfer-Encoding in an HTTP/1.0 request", 400);
    if (st->te_seen && !h->chunked)
        return fail(why, "malformed Transfer-Encoding", 400);
    if (h->chunked && h->content_length >= 0)
        return fail(why, "both Content-Length and Transfer-Encoding", 400);
    if (h->minor >= 1 && st->hosts != 1)
        return fail(why, st->hosts ? "more than one Host header" : "no Host header", 400);
    if (st->hosts > 1)
        return fail(why, "more than one Host header", 400);
    h->keep_alive = h->minor >= 1 ? !st->close : st->keep_alive_token && !st->close;
    return 0;
}

int exl_http_parse_head(char *buf, size_t n, exl_http_head *h, const char **why) {
    *h = (exl_http_head){.content_length = -1};
    head_state st = {0};
    size_t pos = skip_blank_lines(buf, n);
    int line_no = 0;
    while (pos < n) {
        char *line = buf + pos, *lf = memchr(line, '\n', n - pos);
        if (!lf)
            return fail(why, "malformed head", 400);
        pos = (size_t)(lf - buf) + 1;
        size_t len = (size_t)(lf - line);
        if (len && line[len - 1] == '\r')
            len--;
        line[len] = 0;
        if (memchr(line, 0, len) || memchr(line, '\r', len))
            return fail(why, "NUL or bare CR in the head", 400);
        if (!*line)
            break; /* the blank line */
        int rc = line_no == 0 ? request_line(line, h, why) : header_line(line, h, &st, why);
        if (rc)
            return rc;
        if (++line_no > EXL_HTTP_MAX_HEADERS + 1)
            return fail(why, "too many header lines", 431);
    }
    if (!line_no)
        return fail(why, "empty request", 400);
    return framing(h, &st, why);
}

/* ---------------------------------------------------------------- chunked bodies */

enum { CK_SIZE, CK_EXT, CK_SIZE_LF, CK_DATA, CK_DATA_END, CK_DATA_LF, CK_TRAILER, CK_DONE };

#define CK_MAX_LINE 4096

static long ck_fail(const char **why, const char *reason) {
    *why = reason;
    return -1;
}

static void ck_size_done(exl_http_chunked *c) {
    c->state = c->left ? CK_DATA : CK_TRAILER;
    c->line = 0;
}

long exl_http_chunked_feed(exl_http_chunked *c, const char *in, size_t n, exl_str *body, size_t max_body, int *over,
                           int *done, const char **why) {
    size_t i = 0;
    while (i < n && c->state != CK_DONE) {
        char ch = in[i];
        switch (c->state) {
        case CK_SIZE: {
            int v = hex_value(ch);
            if (v >= 0) {
                if (++c->digits > 15)
                    return ck_fail(why, "chunk size too large");
                c->left = c->left * 16 + (uint64_t)v;
            } else if (!c->digits) {
                return ck_fail(why, "malformed chunk size");
            } else if (ch == ';' || ch == ' ' || ch == '\t') {
                c->state = CK_EXT;
            } else if (ch == '\r') {
                c->state = CK_SIZE_LF;
            } else if (ch == '\n') {
                ck_size_done(c);
            } else {
                return ck_fail(why, "malformed chunk size");
            }
            i++;
            break;
        }
        case CK_EXT:
            if (++c->line > CK_MAX_LINE)
                return ck_fail(why, "chunk extension too long");
            if (ch == '\n')
                ck_size_done(c);
            i++;
            break;
        case CK_SIZE_LF:
            if (ch != '\n')
                return ck_fail(why, "bare CR after a chunk size");
            ck_size_done(c);
            i++;
            break;
        case CK_DATA: {
            size_t take = n - i < c->left ? n - i : (size_t)c->left;
            if (!*over && body->len + take <= max_body) {
                if (exl_str_append(body, in + i, take))
                    return ck_fail(why, "out of memory");
            } else {
                *over = 1;
                exl_str_free(body);
            }
            c->left -= take;
            i += take;
            if (!c->left)
                c->state = CK_DATA_END;
            break;
        }
        case CK_DATA_END:
        case CK_DATA_LF:
            if (ch == '\r' && c->state == CK_DATA_END)
                c->state = CK_DATA_LF;
            else if (ch == '\n')
                c->state = CK_SIZE, c->digits = 0;
            else
                return ck_fail(why, "missing CRLF after chunk data");
            i++;
            break;
        case CK_TRAILER:
            if (ch == '\n') {
                if (!c->line)
                    c->state = CK_DONE;
                c->line = 0;
            } else if (ch != '\r' && ++c->line > CK_MAX_LINE) {
                return ck_fail(why, "trailer line too long");
            }
            if (++c->left > EXL_HTTP_MAX_HEAD) /* the trailer's total size */
                return ck_fail(why, "trailer too long");
            i++;
            break;
        }
    }
    *done = c->state == CK_DONE;
    return (long)i;
}

/* ---------------------------------------------------------------- reason phrases */

const char *exl_http_reason(int status) {
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    default: return "Unknown";
    }
}
