/* fuzz_http.c - libFuzzer target: raw bytes as HTTP/1.1 requests, through all the server does with
 * them before a model is involved: where a head ends, the head itself, the path's decoding, the
 * body (Content-Length, or chunked fed in two pieces), and the route decision (path, method, API
 * key) with its error answer; pipelined requests are followed as the server follows them. */
#include "base/alloc.h"
#include "fuzz.h"
#include "server/http_parse.h"
#include "server/routes.h"

#include <stddef.h>
#include <stdint.h>

#define MAX_BODY 65536

/* The body after a head at data[0..size): the bytes it takes, or -1 to stop. */
static long body(const exl_http_head *h, const char *data, size_t size) {
    if (!h->chunked)
        return h->content_length <= 0 ? 0 : (uint64_t)h->content_length <= size ? (long)h->content_length : -1;
    exl_http_chunked c = {0};
    exl_str out = EXL_STR_INIT;
    int over = 0, done = 0;
    const char *why;
    size_t half = size / 2;
    long a = exl_http_chunked_feed(&c, data, half, &out, MAX_BODY, &over, &done, &why), b = 0;
    if (a >= 0 && !done)
        b = exl_http_chunked_feed(&c, data + a, size - (size_t)a, &out, MAX_BODY, &over, &done, &why);
    exl_str_free(&out);
    return a < 0 || b < 0 || !done ? -1 : a + b;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static exl_server srv; /* exl_route_find reads its model name and API key only */
    srv.model_name = "m";
    srv.api_key = "k";
    const char *p = (const char *)data;
    for (int n = 0; n < 16 && size; n++) {
        long end = exl_http_head_end(p, size);
        if (end <= 0)
            return 0;
        char *head = exl_strndup(p, (size_t)end);
        if (!head)
            return 0;
        p += end;
        size -= (size_t)end;
        exl_http_head h;
        const char *why;
        long taken = -1;
        if (exl_http_parse_head(head, (size_t)end, &h, &why) == 0) {
            exl_http_request req = {.method = h.method,
                                    .path = h.path,
                                    .authorization = h.authorization,
                                    .request_id = "req-0"};
            exl_http_reply reply = {0};
            exl_route_kind kind;
            exl_route_find(&srv, &req, &kind, &reply);
            exl_free(reply.body);
            taken = body(&h, p, size);
        }
        exl_free(head);
        if (taken < 0)
            return 0;
        p += taken;
        size -= (size_t)taken;
    }
    return 0;
}
