/* http_parse.h - HTTP/1.x request parsing, strict and free of I/O: where a request head ends,
 * the head itself (request line, the headers the server uses, framing rules), the path's
 * percent-decoding, and the chunked body decoder. Whatever could be read two ways (two
 * different Content-Lengths, Content-Length with Transfer-Encoding, folded or malformed
 * header lines) is refused, so no proxy in front can see another request than this one.
 * A refusal is an HTTP status with a reason: 400, 414, 417, 431, 501 or 505. */
#ifndef EXL_SERVER_HTTP_PARSE_H
#define EXL_SERVER_HTTP_PARSE_H

#include "base/str.h"

#include <stddef.h>
#include <stdint.h>

#define EXL_HTTP_MAX_HEAD 16384 /* request line and headers, bytes (431 beyond) */
#define EXL_HTTP_MAX_LINE 8192  /* the request line (414 beyond) */
#define EXL_HTTP_MAX_HEADERS 64 /* header lines (431 beyond) */

typedef struct exl_http_head {
    const char *method;        /* these point into the buffer given to exl_http_parse_head */
    char *path;                /* the target's path, percent-decoded, without the query */
    int minor;                 /* HTTP/1.minor */
    int64_t content_length;    /* -1 when not given */
    int chunked;               /* Transfer-Encoding: chunked */
    int keep_alive;            /* what the version and Connection ask for */
    int expect_continue;       /* Expect: 100-continue */
    const char *authorization; /* NULL when absent; the others likewise */
    const char *origin;
    const char *cors_method;  /* Access-Control-Request-Method (a CORS preflight) */
    const char *cors_headers; /* Access-Control-Request-Headers */
} exl_http_head;

/* Length of the head at the start of buf[0..n) through its blank line; 0 when more bytes are needed;
 * or the negative status (-414, -431) when it cannot be a valid head within the limits. */
long exl_http_head_end(const char *buf, size_t n);
/* Parse the head buf[0..n) (as exl_http_head_end measured it), writing NULs into buf. Returns 0, or
 * the status to refuse it with and *why, a static reason. */
int exl_http_parse_head(char *buf, size_t n, exl_http_head *head, const char **why);

/* Chunked transfer coding, fed incrementally. */
typedef struct exl_http_chunked {
    int state;
    uint64_t left; /* bytes left in the current chunk */
    size_t line;   /* bytes of the current size / trailer line */
    int digits;
} exl_http_chunked;

/* Decode in[0..n): data bytes are appended to body while it stays within max_body (beyond, *over is
 * set and they are dropped). Returns the bytes consumed (all of them unless the body ended inside
 * in[0..n)), or -1 with *why when the coding is malformed. *done is set at the end of the body. */
long exl_http_chunked_feed(exl_http_chunked *c, const char *in, size_t n, exl_str *body, size_t max_body, int *over,
                           int *done, const char **why);

/* The reason phrase of a status ("OK", "Not Found", ...). */
const char *exl_http_reason(int status);

#endif
