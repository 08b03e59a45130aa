/* test.h - the unit-test harness: EXL_TEST(name) { ... } registers itself; CHECK records a
 * failure and goes on, REQUIRE records it and leaves the test. Suites are source files. */
#ifndef EXL_TEST_H
#define EXL_TEST_H

#include <stdio.h>

typedef void (*exl_test_fn)(void);
void exl_test_register(const char *file, const char *name, exl_test_fn fn);
void exl_test_failed(const char *file, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Path of a file under ../shared (or $EXL_SHARED): static buffer, valid until the next call. */
const char *exl_test_shared(const char *rel);
/* A fresh empty directory for this test (under $TMPDIR); static buffer. */
const char *exl_test_tmpdir(void);

#define EXL_TEST(name)                                                   \
    static void exl_test_##name(void);                                   \
    __attribute__((constructor)) static void exl_test_reg_##name(void) { \
        exl_test_register(__FILE__, #name, exl_test_##name);             \
    }                                                                    \
    static void exl_test_##name(void)

#define CHECK(cond)                                                  \
    do {                                                             \
        if (!(cond))                                                 \
            exl_test_failed(__FILE__, __LINE__, "CHECK(%s)", #cond); \
    } while (0)

#define CHECK_MSG(cond, ...)                                  \
    do {                                                      \
        if (!(cond))                                          \
            exl_test_failed(__FILE__, __LINE__, __VA_ARGS__); \
    } while (0)

#define REQUIRE(cond)                                                  \
    do {                                                               \
        if (!(cond)) {                                                 \
            exl_test_failed(__FILE__, __LINE__, "REQUIRE(%s)", #cond); \
            return;                                                    \
        }                                                              \
    } while (0)

#define REQUIRE_OK(expr)                                                                                       \
    do {                                                                                                       \
        exl_status st_ = (expr);                                                                               \
        if (st_ != EXL_OK) {                                                                                   \
            exl_test_failed(__FILE__, __LINE__, "%s -> %s: %s", #expr, exl_status_str(st_), exl_last_error()); \
            return;                                                                                            \
        }                                                                                                      \
    } while (0)

#endif
