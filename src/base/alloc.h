/* alloc.h - the single host allocation choke point (tests can inject failures). */
#ifndef EXL_BASE_ALLOC_H
#define EXL_BASE_ALLOC_H

#include <stddef.h>

void *exl_malloc(size_t n);
void *exl_calloc(size_t count, size_t size);
void *exl_realloc(void *p, size_t n);
/* 64-byte aligned; free with exl_free_aligned. */
void *exl_malloc_aligned(size_t n);
void exl_free_aligned(void *p);
void exl_free(void *p);
char *exl_strdup(const char *s);
char *exl_strndup(const char *s, size_t n);

/* Test hook: make the allocation numbered `n` from now (0 = the next one) fail;
 * a negative n disables injection. */
void exl_alloc_fail_after(long n);

#endif
