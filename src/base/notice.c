/* notice.c - one-line notices to stderr or to a handler the program set. */
#include "base/notice.h"

#include <stdarg.h>
#include <stdio.h>

static exl_notice_fn handler;
static void *handler_user;

void exl_notice_set_handler(exl_notice_fn fn, void *user) {
    handler = fn;
    handler_user = user;
}

void exl_notice(const char *fmt, ...) {
    char text[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    if (handler)
        handler(handler_user, text);
    else
        fprintf(stderr, "exl: %s\n", text);
}
