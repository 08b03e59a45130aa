/* page_pool.h - bookkeeping of the generator's KV cache pages and the prefix cache.
 *
 * Every page is in one of three states:
 *   used   - held by one or more jobs (ref > 0); a page held by several jobs is full and
 *            never written again (writers only ever append to their own last page);
 *   cached - held by no job but with valid K/V (n_valid > 0), on an LRU list, reusable
 *            by a later job with the same prefix, evicted oldest first when pages run out;
 *   free   - empty.
 * For the prefix cache each page remembers the tokens in its valid slots and `parent`,
 * the chain hash of every token before the page. A full page is registered in a hash
 * map under its own chain hash (parent + its tokens), so a job finds its prefix page by
 * page; a partly matching page is found by its parent and copied (prefix_cache.c). */
#ifndef EXL_GENERATOR_PAGE_POOL_H
#define EXL_GENERATOR_PAGE_POOL_H

#include <stdint.h>

#include "exl.h"

#define EXL_HASH_ROOT 0x9e3779b97f4a7c15ull /* parent hash of a sequence's first page */

typedef struct exl_page_pool {
    int32_t n_pages, page_size;
    int32_t *ref;                 /* jobs holding the page */
    int32_t *n_valid;             /* leading slots whose K/V are computed */
    int32_t *tokens;              /* [n_pages * page_size]: the token in each valid slot */
    uint64_t *parent;             /* chain hash of the tokens before the page */
    uint64_t *hash;               /* chain hash including the page when registered, else 0 */
    int32_t *lru_prev, *lru_next; /* cached pages, oldest at lru_head */
    int32_t lru_head, lru_tail, n_cached;
    int32_t *free_list, n_free;
    int32_t *bucket, *bucket_next; /* hash map: registered pages by hash */
    uint32_t bucket_mask;
} exl_page_pool;

exl_status exl_page_pool_init(exl_page_pool *p, int32_t n_pages, int32_t page_size);
void exl_page_pool_free(exl_page_pool *p);

/* Pages a job could get now: free plus cached. */
static inline int32_t exl_page_pool_available(const exl_page_pool *p) { return p->n_free + p->n_cached; }

/* Take an empty page for a sequence whose preceding tokens hash to parent (a free page,
 * else the least recently used cached one, forgotten); -1 when none is left. */
int32_t exl_page_pool_take(exl_page_pool *p, uint64_t parent);
/* Add a holder to a used or cached page. */
void exl_page_pool_ref(exl_page_pool *p, int32_t page);
/* Drop a holder; a page nobody holds becomes cached (if it has valid slots) or free. */
void exl_page_pool_release(exl_page_pool *p, int32_t page);
/* Forget a page's contents beyond its first n slots (its owner rewrites them): it
 * leaves the hash map if it was registered. */
void exl_page_pool_truncate(exl_page_pool *p, int32_t page, int32_t n);

/* ---- prefix_cache.c */

/* Chain hash of a page of tokens following the given parent hash (never 0). */
uint64_t exl_prefix_hash(uint64_t parent, const int32_t *tokens, int32_t n);
/* Register a full page under its chain hash unless another page already holds it. */
void exl_prefix_register(exl_page_pool *p, int32_t page, uint64_t hash);
/* Remove a page from the hash map (no-op if not registered). */
void exl_prefix_unregister(exl_page_pool *p, int32_t page);
/* The registered page with this chain hash holding exactly these tokens, or -1. */
int32_t exl_prefix_lookup(const exl_page_pool *p, uint64_t hash, const int32_t *tokens);
/* The page (used or cached) after parent whose valid slots share the longest common
 * prefix with tokens[0..n); *len receives that length. -1 when none shares a token. */
int32_t exl_prefix_best_partial(const exl_page_pool *p, uint64_t parent, const int32_t *tokens, int32_t n,
                                int32_t *len);

#endif
