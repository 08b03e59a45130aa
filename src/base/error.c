/* error.c - per-thread error messages and status names. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[1024];

const char *exl_status_str(exl_status st) {
    switch (st) {
    case EXL_OK: return "ok";
    case EXL_ERR_IO: return "i/o error";
    case EXL_ERR_FORMAT: return "format error";
    case EXL_ERR_UNSUPPORTED: return "unsupported";
    case EXL_ERR_NOMEM: return "out of memory";
    case EXL_ERR_ARG: return "invalid argument";
    case EXL_ERR_DEVICE: return "device error";
    case EXL_ERR_STATE: return "invalid state";
    }
    return "unknown status";
}

const char *exl_last_error(void) { return last_error; }

void exl_error_clear(void) { last_error[0] = 0; }

exl_status exl_fail(exl_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return st;
}

exl_status exl_fail_prefix(exl_status st, const char *fmt, ...) {
    char old[sizeof last_error];
    memcpy(old, last_error, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    size_t len = n < 0 ? 0 : (size_t)n < sizeof last_error ? (size_t)n : sizeof last_error - 1;
    if (old[0] && len + 2 < sizeof last_error) {
        size_t room = sizeof last_error - len - 3, olen = strlen(old);
        memcpy(last_error + len, ": ", 2);
        memcpy(last_error + len + 2, old, olen < room ? olen : room);
        last_error[len + 2 + (olen < room ? olen : room)] = 0;
    }
    return st;
}
