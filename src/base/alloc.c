/* alloc.c - host allocation wrappers with failure injection for tests. */
#include "alloc.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static atomic_long fail_countdown = -1;

static int should_fail(void) {
    long c = atomic_load(&fail_countdown);
    if (c < 0)
        return 0;
    if (atomic_fetch_sub(&fail_countdown, 1) == 0)
        return 1;
    return 0;
}

void exl_alloc_fail_after(long n) { atomic_store(&fail_countdown, n); }

void *exl_malloc(size_t n) { return should_fail() ? NULL : malloc(n ? n : 1); }

void *exl_calloc(size_t count, size_t size) {
    return should_fail() ? NULL : calloc(count ? count : 1, size ? size : 1);
}

void *exl_realloc(void *p, size_t n) { return should_fail() ? NULL : realloc(p, n ? n : 1); }

void exl_free(void *p) { free(p); }

void *exl_malloc_aligned(size_t n) {
    if (should_fail())
        return NULL;
    void *p = NULL;
    if (posix_memalign(&p, 64, n ? (n + 63) / 64 * 64 : 64) != 0)
        return NULL;
    return p;
}

void exl_free_aligned(void *p) { free(p); }

char *exl_strndup(const char *s, size_t n) {
    char *d = exl_malloc(n + 1);
    if (!d)
        return NULL;
    memcpy(d, s, n);
    d[n] = 0;
    return d;
}

char *exl_strdup(const char *s) { return exl_strndup(s, strlen(s)); }
