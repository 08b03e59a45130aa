/* page_pool.c - KV cache pages: reference counts, the free list and the LRU of cached pages. */
#include "generator/page_pool.h"

#include "base/alloc.h"
#include "base/error.h"

exl_status exl_page_pool_init(exl_page_pool *p, int32_t n_pages, int32_t page_size) {
    *p = (exl_page_pool){.n_pages = n_pages, .page_size = page_size, .lru_head = -1, .lru_tail = -1};
    uint32_t n_buckets = 16;
    while (n_buckets < (uint32_t)n_pages * 2)
        n_buckets *= 2;
    p->bucket_mask = n_buckets - 1;
    size_t n = (size_t)n_pages;
    p->ref = exl_calloc(n, sizeof *p->ref);
    p->n_valid = exl_calloc(n, sizeof *p->n_valid);
    p->tokens = exl_malloc(n * (size_t)page_size * sizeof *p->tokens);
    p->parent = exl_calloc(n, sizeof *p->parent);
    p->hash = exl_calloc(n, sizeof *p->hash);
    p->lru_prev = exl_malloc(n * sizeof *p->lru_prev);
    p->lru_next = exl_malloc(n * sizeof *p->lru_next);
    p->free_list = exl_malloc(n * sizeof *p->free_list);
    p->bucket = exl_malloc(n_buckets * sizeof *p->bucket);
    p->bucket_next = exl_malloc(n * sizeof *p->bucket_next);
    if (!p->ref || !p->n_valid || !p->tokens || !p->parent || !p->hash || !p->lru_prev || !p->lru_next ||
        !p->free_list || !p->bucket || !p->bucket_next) {
        exl_page_pool_free(p);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    for (uint32_t i = 0; i < n_buckets; i++)
        p->bucket[i] = -1;
    /* stacked so that page 0 is taken first */
    for (int32_t i = 0; i < n_pages; i++)
        p->free_list[i] = n_pages - 1 - i;
    p->n_free = n_pages;
    return EXL_OK;
}

void exl_page_pool_free(exl_page_pool *p) {
    exl_free(p->ref);
    exl_free(p->n_valid);
    exl_free(p->tokens);
    exl_free(p->parent);
    exl_free(p->hash);
    exl_free(p->lru_prev);
    exl_free(p->lru_next);
    exl_free(p->free_list);
    exl_free(p->bucket);
    exl_free(p->bucket_next);
    *p = (exl_page_pool){0};
}

static void lru_unlink(exl_page_pool *p, int32_t page) {
    int32_t a = p->lru_prev[page], b = p->lru_next[page];
    if (a >= 0)
        p->lru_next[a] = b;
    else
        p->lru_head = b;
    if (b >= 0)
        p->lru_prev[b] = a;
    else
        p->lru_tail = a;
    p->n_cached--;
}

static void lru_append(exl_page_pool *p, int32_t page) {
    p->lru_prev[page] = p->lru_tail;
    p->lru_next[page] = -1;
    if (p->lru_tail >= 0)
        p->lru_next[p->lru_tail] = page;
    else
        p->lru_head = page;
    p->lru_tail = page;
    p->n_cached++;
}

int32_t exl_page_pool_take(exl_page_pool *p, uint64_t parent) {
    int32_t page;
    if (p->n_free > 0) {
        page = p->free_list[--p->n_free];
    } else if (p->lru_head >= 0) {
        page = p->lru_head;
        lru_unlink(p, page);
        exl_prefix_unregister(p, page);
    } else {
        return -1;
    }
    p->ref[page] = 1;
    p->n_valid[page] = 0;
    p->parent[page] = parent;
    return page;
}

void exl_page_pool_ref(exl_page_pool *p, int32_t page) {
    if (p->ref[page]++ == 0)
        lru_unlink(p, page);
}

void exl_page_pool_release(exl_page_pool *p, int32_t page) {
    if (--p->ref[page] > 0)
        return;
    if (p->n_valid[page] > 0) {
        lru_append(p, page);
    } else {
        exl_prefix_unregister(p, page);
        p->free_list[p->n_free++] = page;
    }
}

void exl_page_pool_truncate(exl_page_pool *p, int32_t page, int32_t n) {
    if (n < p->n_valid[page]) {
        p->n_valid[page] = n;
        exl_prefix_unregister(p, page);
    }
}
