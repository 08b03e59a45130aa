/* str.h - a tiny growable byte string used instead of ad-hoc char* juggling. */
#ifndef EXL_BASE_STR_H
#define EXL_BASE_STR_H

#include <stdarg.h>
#include <stddef.h>

typedef struct exl_str {
    char *data; /* always NUL-terminated when non-NULL */
    size_t len;
    size_t cap;
} exl_str;

#define EXL_STR_INIT \
    { NULL, 0, 0 }

/* All appenders return 0 on success, -1 on allocation failure (the string is unchanged). */
int exl_str_reserve(exl_str *s, size_t extra);
int exl_str_append(exl_str *s, const char *data, size_t n);
int exl_str_puts(exl_str *s, const char *cstr);
int exl_str_putc(exl_str *s, char c);
int exl_str_printf(exl_str *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int exl_str_vprintf(exl_str *s, const char *fmt, va_list ap) __attribute__((format(printf, 2, 0)));
void exl_str_clear(exl_str *s);
void exl_str_free(exl_str *s);
/* Hand over the buffer (never NULL on success; "" for an empty string). */
char *exl_str_steal(exl_str *s);

#endif
