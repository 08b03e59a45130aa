/* error.h - status codes with a per-thread message: the one way errors leave a call. */
#ifndef EXL_BASE_ERROR_H
#define EXL_BASE_ERROR_H

#include "exl.h"

/* Record a formatted message for this thread and return st, so a failing path reads
 * `return exl_fail(EXL_ERR_FORMAT, "%s: tensor %s: ...", path, name);` */
exl_status exl_fail(exl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prefix the current message with "prefix: " (for adding context while unwinding). */
exl_status exl_fail_prefix(exl_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void exl_error_clear(void);

#define EXL_TRY(expr)                    \
    do {                                 \
        exl_status exl_try_st_ = (expr); \
        if (exl_try_st_ != EXL_OK)       \
            return exl_try_st_;          \
    } while (0)

#endif
