/* main.c - the unit-test runner: `exl_tests [SUITE...]` runs every test (or those whose
 * suite, the source file's base name, is named) and ends with "N passed, N failed". */
#include "test.h"

#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    char suite[64];
    const char *name;
    exl_test_fn fn;
} test_entry;

static test_entry tests[4096];
static int n_tests;
static int current_failures;

static void suite_of(const char *file, char *out, size_t n) {
    const char *b = strrchr(file, '/');
    b = b ? b + 1 : file;
    size_t len = strcspn(b, ".");
    if (len >= n)
        len = n - 1;
    memcpy(out, b, len);
    out[len] = 0;
}

void exl_test_register(const char *file, const char *name, exl_test_fn fn) {
    if (n_tests >= (int)(sizeof tests / sizeof tests[0])) {
        fprintf(stderr, "too many tests\n");
        abort();
    }
    test_entry *t = &tests[n_tests++];
    suite_of(file, t->suite, sizeof t->suite);
    t->name = name;
    t->fn = fn;
}

void exl_test_failed(const char *file, int line, const char *fmt, ...) {
    current_failures++;
    fprintf(stderr, "    %s:%d: ", file, line);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}

const char *exl_test_shared(const char *rel) {
    static char buf[4096];
    const char *root = getenv("EXL_SHARED");
    snprintf(buf, sizeof buf, "%s/%s", root ? root : EXL_SHARED_DIR, rel);
    return buf;
}

const char *exl_test_tmpdir(void) {
    static char buf[4096];
    static int counter;
    const char *tmp = getenv("TMPDIR");
    snprintf(buf, sizeof buf, "%s/exl-test-%d-%d", tmp ? tmp : "/tmp", (int)getpid(), counter++);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", buf);
    if (system(cmd) != 0 || mkdir(buf, 0700) != 0) {
        fprintf(stderr, "cannot create %s\n", buf);
        abort();
    }
    return buf;
}

static int selected(const test_entry *t, int argc, char **argv) {
    if (argc <= 1)
        return 1;
    for (int i = 1; i < argc; i++) {
        const char *dot = strchr(argv[i], '.');
        if (dot) {
            size_t sl = (size_t)(dot - argv[i]);
            if (strlen(t->suite) == sl && !strncmp(t->suite, argv[i], sl) && !strcmp(dot + 1, t->name))
                return 1;
        } else if (!strcmp(argv[i], t->suite)) {
            return 1;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    int passed = 0, failed = 0;
    setenv("EXL_CPU_ACT", "fp32", 0); /* the exact CPU path the tolerances are for, unless asked otherwise */
    for (int i = 0; i < n_tests; i++) {
        test_entry *t = &tests[i];
        if (!selected(t, argc, argv))
            continue;
        current_failures = 0;
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        t->fn();
        clock_gettime(CLOCK_MONOTONIC, &b);
        double ms = (b.tv_sec - a.tv_sec) * 1e3 + (b.tv_nsec - a.tv_nsec) / 1e6;
        if (current_failures) {
            failed++;
            printf("FAIL %s.%s (%.0f ms)\n", t->suite, t->name, ms);
        } else {
            passed++;
            printf("ok   %s.%s (%.0f ms)\n", t->suite, t->name, ms);
        }
        fflush(stdout);
    }
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}
