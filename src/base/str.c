/* str.c - growable byte strings. */
#include "str.h"

#include "alloc.h"

#include <stdio.h>
#include <string.h>

int exl_str_reserve(exl_str *s, size_t extra) {
    if (s->len + extra + 1 <= s->cap)
        return 0;
    size_t cap = s->cap ? s->cap : 32;
    while (cap < s->len + extra + 1)
        cap *= 2;
    char *d = exl_realloc(s->data, cap);
    if (!d)
        return -1;
    s->data = d;
    s->cap = cap;
    return 0;
}

int exl_str_append(exl_str *s, const char *data, size_t n) {
    if (exl_str_reserve(s, n))
        return -1;
    if (n)
        memcpy(s->data + s->len, data, n);
    s->len += n;
    s->data[s->len] = 0;
    return 0;
}

int exl_str_puts(exl_str *s, const char *cstr) { return exl_str_append(s, cstr, strlen(cstr)); }

int exl_str_putc(exl_str *s, char c) { return exl_str_append(s, &c, 1); }

int exl_str_vprintf(exl_str *s, const char *fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    if (n < 0 || exl_str_reserve(s, (size_t)n))
        return -1;
    vsnprintf(s->data + s->len, (size_t)n + 1, fmt, ap);
    s->len += (size_t)n;
    return 0;
}

int exl_str_printf(exl_str *s, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int r = exl_str_vprintf(s, fmt, ap);
    va_end(ap);
    return r;
}

void exl_str_clear(exl_str *s) {
    s->len = 0;
    if (s->data)
        s->data[0] = 0;
}

void exl_str_free(exl_str *s) {
    exl_free(s->data);
    s->data = NULL;
    s->len = s->cap = 0;
}

char *exl_str_steal(exl_str *s) {
    if (!s->data && exl_str_reserve(s, 0))
        return NULL;
    s->data[s->len] = 0;
    char *d = s->data;
    s->data = NULL;
    s->len = s->cap = 0;
    return d;
}
