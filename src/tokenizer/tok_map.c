/* tok_map.c - the tokenizer's storage: a string arena, a string -> id hash map (the
 * vocabulary, the word cache) and an id pair -> (rank, id) hash map (the BPE merges). */
#include "tokenizer.h"

#include <string.h>

#include "base/alloc.h"

/* ---------------------------------------------------------------- arena */

struct exl_tok_arena_block {
    exl_tok_arena_block *next;
    size_t used, cap;
    char data[];
};

char *exl_tok_arena_dup(exl_tok_arena *a, const char *s, size_t n) {
    exl_tok_arena_block *b = a->head;
    if (!b || b->cap - b->used < n + 1) {
        size_t cap = n + 1 > (1u << 20) ? n + 1 : (1u << 20);
        b = exl_malloc(sizeof *b + cap);
        if (!b)
            return NULL;
        b->used = 0;
        b->cap = cap;
        b->next = a->head;
        a->head = b;
    }
    char *p = b->data + b->used;
    if (n)
        memcpy(p, s, n);
    p[n] = 0;
    b->used += n + 1;
    return p;
}

void exl_tok_arena_free(exl_tok_arena *a) {
    while (a->head) {
        exl_tok_arena_block *next = a->head->next;
        exl_free(a->head);
        a->head = next;
    }
}

/* ---------------------------------------------------------------- string map */

uint32_t exl_tok_hash(const char *s, size_t n) {
    /* FNV-1a, with a final mix so the low bits spread well. */
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    h ^= h >> 15;
    h *= 0x2c1b3c6dU;
    h ^= h >> 12;
    return h;
}

static size_t cap_for(size_t expected) {
    size_t cap = 16;
    while (cap < expected * 2)
        cap *= 2;
    return cap;
}

int exl_strmap_init(exl_strmap *m, size_t expected) {
    m->cap = cap_for(expected);
    m->count = 0;
    m->slots = exl_calloc(m->cap, sizeof *m->slots);
    return m->slots ? 0 : -1;
}

void exl_strmap_free(exl_strmap *m) {
    exl_free(m->slots);
    m->slots = NULL;
    m->cap = m->count = 0;
}

static exl_strmap_slot *strmap_find(const exl_strmap *m, const char *key, size_t len, uint32_t h) {
    size_t mask = m->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        exl_strmap_slot *s = &m->slots[i];
        if (!s->key || (s->hash == h && s->len == len && !memcmp(s->key, key, len)))
            return s;
    }
}

static int strmap_grow(exl_strmap *m) {
    exl_strmap bigger = {exl_calloc(m->cap * 2, sizeof *m->slots), m->cap * 2, m->count};
    if (!bigger.slots)
        return -1;
    for (size_t i = 0; i < m->cap; i++)
        if (m->slots[i].key)
            *strmap_find(&bigger, m->slots[i].key, m->slots[i].len, m->slots[i].hash) = m->slots[i];
    exl_free(m->slots);
    *m = bigger;
    return 0;
}

int exl_strmap_put(exl_strmap *m, const char *key, size_t len, int32_t val) {
    if ((m->count + 1) * 2 > m->cap && strmap_grow(m))
        return -1;
    uint32_t h = exl_tok_hash(key, len);
    exl_strmap_slot *s = strmap_find(m, key, len, h);
    if (!s->key) {
        s->key = key;
        s->len = (uint32_t)len;
        s->hash = h;
        m->count++;
    }
    s->val = val;
    return 0;
}

int32_t exl_strmap_get(const exl_strmap *m, const char *key, size_t len) {
    if (!m->cap)
        return -1;
    const exl_strmap_slot *s = strmap_find(m, key, len, exl_tok_hash(key, len));
    return s->key ? s->val : -1;
}

/* ---------------------------------------------------------------- pair map */

static inline uint64_t pair_key(int32_t a, int32_t b) { return (((uint64_t)(uint32_t)a << 32) | (uint32_t)b) + 1; }

static inline size_t pair_hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return (size_t)k;
}

int exl_pairmap_init(exl_pairmap *m, size_t expected) {
    m->cap = cap_for(expected);
    m->count = 0;
    m->slots = exl_calloc(m->cap, sizeof *m->slots);
    return m->slots ? 0 : -1;
}

void exl_pairmap_free(exl_pairmap *m) {
    exl_free(m->slots);
    m->slots = NULL;
    m->cap = m->count = 0;
}

static exl_pairmap_slot *pair_find(const exl_pairmap *m, uint64_t k) {
    size_t mask = m->cap - 1;
    for (size_t i = pair_hash(k) & mask;; i = (i + 1) & mask)
        if (m->slots[i].key == k || !m->slots[i].key)
            return &m->slots[i];
}

int exl_pairmap_put(exl_pairmap *m, int32_t a, int32_t b, uint32_t rank, int32_t id) {
    if ((m->count + 1) * 2 > m->cap) {
        exl_pairmap bigger = {exl_calloc(m->cap * 2, sizeof *m->slots), m->cap * 2, m->count};
        if (!bigger.slots)
            return -1;
        for (size_t i = 0; i < m->cap; i++)
            if (m->slots[i].key)
                *pair_find(&bigger, m->slots[i].key) = m->slots[i];
        exl_free(m->slots);
        *m = bigger;
    }
    uint64_t k = pair_key(a, b);
    exl_pairmap_slot *s = pair_find(m, k);
    if (!s->key)
        m->count++;
    s->key = k;
    s->rank = rank;
    s->id = id;
    return 0;
}

const exl_pairmap_slot *exl_pairmap_get(const exl_pairmap *m, int32_t a, int32_t b) {
    if (!m->cap)
        return NULL;
    const exl_pairmap_slot *s = pair_find(m, pair_key(a, b));
    return s->key ? s : NULL;
}
