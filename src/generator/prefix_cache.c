/* prefix_cache.c - finding cached K/V by prefix: chain hashes of full pages in a hash
 * map, and a scan for the best partly matching page after a given prefix.
 *
 * A page's chain hash covers every token from the start of the sequence to its end, so
 * equal hashes mean equal prefixes (up to 64-bit collisions; the page's own tokens are
 * compared as well). Lookups run when a job is admitted, not per token. */
#include "generator/page_pool.h"

#include <string.h>

static uint64_t mix(uint64_t x) { /* splitmix64 finalizer */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

uint64_t exl_prefix_hash(uint64_t parent, const int32_t *tokens, int32_t n) {
    uint64_t h = mix(parent ^ (uint64_t)n);
    for (int32_t i = 0; i < n; i++)
        h = mix(h ^ (uint32_t)tokens[i]) + 0x9e3779b97f4a7c15ull;
    return h ? h : 1;
}

void exl_prefix_register(exl_page_pool *p, int32_t page, uint64_t hash) {
    if (p->hash[page] || exl_prefix_lookup(p, hash, p->tokens + (size_t)page * p->page_size) >= 0)
        return;
    uint32_t b = (uint32_t)hash & p->bucket_mask;
    p->hash[page] = hash;
    p->bucket_next[page] = p->bucket[b];
    p->bucket[b] = page;
}

void exl_prefix_unregister(exl_page_pool *p, int32_t page) {
    if (!p->hash[page])
        return;
    int32_t *link = &p->bucket[(uint32_t)p->hash[page] & p->bucket_mask];
    while (*link != page)
        link = &p->bucket_next[*link];
    *link = p->bucket_next[page];
    p->hash[page] = 0;
}

int32_t exl_prefix_lookup(const exl_page_pool *p, uint64_t hash, const int32_t *tokens) {
    for (int32_t i = p->bucket[(uint32_t)hash & p->bucket_mask]; i >= 0; i = p->bucket_next[i])
        if (p->hash[i] == hash && p->n_valid[i] == p->page_size &&
            !memcmp(p->tokens + (size_t)i * p->page_size, tokens, (size_t)p->page_size * sizeof *tokens))
            return i;
    return -1;
}

int32_t exl_prefix_best_partial(const exl_page_pool *p, uint64_t parent, const int32_t *tokens, int32_t n,
                                int32_t *len) {
    int32_t best = -1, best_len = 0;
    for (int32_t i = 0; i < p->n_pages; i++) {
        if (p->parent[i] != parent || p->n_valid[i] <= best_len)
            continue;
        const int32_t *t = p->tokens + (size_t)i * p->page_size;
        int32_t k = 0, lim = p->n_valid[i] < n ? p->n_valid[i] : n;
        while (k < lim && t[k] == tokens[k])
            k++;
        if (k > best_len) {
            best = i;
            best_len = k;
        }
    }
    *len = best_len;
    return best;
}
