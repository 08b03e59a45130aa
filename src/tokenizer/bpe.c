/* bpe.c - the BPE model: a word (in the model's alphabet) becomes one symbol per
 * character (or its <0xXX> bytes, or <unk>), then the adjacent pair of lowest merge rank
 * is merged, leftmost first, until no pair merges. Candidate pairs sit in a min-heap
 * keyed (rank, position) and stale ones are skipped when popped, so a word costs
 * O(n log n). Results are cached per encode call, since words repeat a lot. */
#include "tokenizer.h"

#include <string.h>

#include "base/alloc.h"
#include "base/error.h"

#define CACHE_MAX_WORDS (1 << 17)
#define CACHE_MAX_WORD_BYTES 256

typedef struct sym {
    int32_t id;
    int32_t prev, next; /* -1 at the ends */
} sym;

typedef struct cand {
    uint32_t rank;
    uint32_t pos;
    int32_t id;
} cand;

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "out of memory"); }

static int grow(void **p, size_t *cap, size_t need, size_t item) {
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = exl_realloc(*p, c * item);
    if (!q)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

/* ---------------------------------------------------------------- heap */

static inline int cand_less(const cand *a, const cand *b) {
    return a->rank < b->rank || (a->rank == b->rank && a->pos < b->pos);
}

static void heap_push(cand *h, size_t *n, cand c) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&c, &h[p]))
            break;
        h[i] = h[p];
        i = p;
    }
    h[i] = c;
}

static cand heap_pop(cand *h, size_t *n) {
    cand top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, best = i;
        const cand *bc = &last;
        if (l < *n && cand_less(&h[l], bc)) {
            best = l;
            bc = &h[l];
        }
        if (l + 1 < *n && cand_less(&h[l + 1], bc))
            best = l + 1;
        if (best == i)
            break;
        h[i] = h[best];
        i = best;
    }
    if (*n)
        h[i] = last;
    return top;
}

/* ---------------------------------------------------------------- symbols */

/* Does every byte of this character have a <0xXX> token? */
static int has_byte_ids(const exl_tokenizer *tok, const char *s, size_t n) {
    for (size_t k = 0; k < n; k++)
        if (tok->byte_ids[(uint8_t)s[k]] < 0)
            return 0;
    return 1;
}

/* Split the word into initial symbols; returns the count or -1 on allocation failure. */
static long initial_symbols(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n) {
    size_t count = 0;
    int pending_unk = 0; /* as in `tokenizers`: byte-fallback tokens do not flush it */
    int prefix = tok->subword_prefix[0] != 0, suffix = tok->word_suffix[0] != 0;
    for (size_t i = 0; i < n;) {
        size_t l = (size_t)exl_utf8_len((unsigned char)s[i]);
        if (l > n - i)
            l = n - i;
        int32_t id;
        if (prefix || suffix) {
            exl_str_clear(&w->key);
            if ((prefix && i > 0 && exl_str_puts(&w->key, tok->subword_prefix)) || exl_str_append(&w->key, s + i, l) ||
                (suffix && i + l == n && exl_str_puts(&w->key, tok->word_suffix)))
                return -1;
            id = exl_strmap_get(&tok->vocab, w->key.data, w->key.len);
        } else {
            id = exl_strmap_get(&tok->vocab, s + i, l);
        }
        if (grow(&w->sym, &w->sym_cap, count + l + 1, sizeof(sym)))
            return -1;
        sym *sy = w->sym;
        if (id >= 0) {
            if (pending_unk) /* a pending <unk> lands before the next known character */
                sy[count++].id = tok->unk_id;
            pending_unk = 0;
            sy[count++].id = id;
        } else if (tok->byte_fallback && has_byte_ids(tok, s + i, l)) {
            for (size_t k = 0; k < l; k++)
                sy[count++].id = tok->byte_ids[(uint8_t)s[i + k]];
        } else if (tok->unk_id >= 0) {
            if (pending_unk && !tok->fuse_unk)
                sy[count++].id = tok->unk_id;
            pending_unk = 1;
        }
        i += l;
    }
    if (pending_unk) {
        if (grow(&w->sym, &w->sym_cap, count + 1, sizeof(sym)))
            return -1;
        ((sym *)w->sym)[count++].id = tok->unk_id;
    }
    sym *sy = w->sym;
    for (size_t k = 0; k < count; k++) {
        sy[k].prev = (int32_t)k - 1;
        sy[k].next = k + 1 < count ? (int32_t)k + 1 : -1;
    }
    return (long)count;
}

static int push_pair(const exl_tokenizer *tok, exl_tok_work *w, size_t *nh, const sym *sy, int32_t pos) {
    int32_t nx = sy[pos].next;
    if (nx < 0)
        return 0;
    const exl_pairmap_slot *m = exl_pairmap_get(&tok->merges, sy[pos].id, sy[nx].id);
    if (!m)
        return 0;
    if (grow(&w->heap, &w->heap_cap, *nh + 1, sizeof(cand)))
        return -1;
    heap_push(w->heap, nh, (cand){m->rank, (uint32_t)pos, m->id});
    return 0;
}

static exl_status merge_word(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, exl_tok_ids *out) {
    long count = initial_symbols(tok, w, s, n);
    if (count < 0)
        return nomem();
    sym *sy = w->sym;
    size_t nh = 0;
    for (long i = 0; i + 1 < count; i++)
        if (push_pair(tok, w, &nh, sy, (int32_t)i))
            return nomem();
    while (nh) {
        cand c = heap_pop(w->heap, &nh);
        sym *a = &sy[c.pos];
        if (a->id < 0 || a->next < 0)
            continue;
        const exl_pairmap_slot *m = exl_pairmap_get(&tok->merges, a->id, sy[a->next].id);
        if (!m || m->id != c.id || m->rank != c.rank)
            continue; /* stale: one side was merged since */
        sym *b = &sy[a->next];
        a->id = c.id;
        b->id = -1;
        a->next = b->next;
        if (b->next >= 0)
            sy[b->next].prev = (int32_t)c.pos;
        if ((a->prev >= 0 && push_pair(tok, w, &nh, sy, a->prev)) || push_pair(tok, w, &nh, sy, (int32_t)c.pos))
            return nomem();
    }
    for (int32_t i = count ? 0 : -1; i >= 0; i = sy[i].next)
        if (exl_tok_ids_push(out, sy[i].id))
            return nomem();
    return EXL_OK;
}

/* ---------------------------------------------------------------- cache + entry */

static exl_status bpe_uncached(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, exl_tok_ids *out) {
    if (tok->ignore_merges) {
        int32_t id = exl_strmap_get(&tok->vocab, s, n);
        if (id >= 0)
            return exl_tok_ids_push(out, id) ? nomem() : EXL_OK;
    }
    return merge_word(tok, w, s, n, out);
}

static exl_status bpe_word(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, exl_tok_ids *out);

#define CUT_MIN_BYTES 32

/* Long words (whole texts, for models without a pre-tokenizer) are cut between two
 * characters that are both tokens but never adjacent inside one: no merge can join
 * them, so the pieces merge exactly as the whole would, and they hit the cache. */
exl_status exl_tok_bpe(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, exl_tok_ids *out) {
    if (n < CUT_MIN_BYTES || !tok->char_pairs.count)
        return bpe_word(tok, w, s, n, out);
    size_t start = 0, i = 0;
    int32_t prev = -1;
    int prev_known = 0;
    while (i < n) {
        int32_t cp;
        int l = exl_utf8_decode(s + i, &cp);
        int known = exl_strmap_get(&tok->vocab, s + i, (size_t)l) >= 0;
        if (prev_known && known && !exl_pairmap_get(&tok->char_pairs, prev, cp)) {
            EXL_TRY(bpe_word(tok, w, s + start, i - start, out));
            start = i;
        }
        prev = cp;
        prev_known = known;
        i += (size_t)l;
    }
    return bpe_word(tok, w, s + start, n - start, out);
}

/* One word through the cache. */
static exl_status bpe_word(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, exl_tok_ids *out) {
    if (!n)
        return EXL_OK;
    if (n > CACHE_MAX_WORD_BYTES)
        return bpe_uncached(tok, w, s, n, out);
    if (!w->cache.slots && exl_strmap_init(&w->cache, 1024))
        return nomem();
    int32_t at = exl_strmap_get(&w->cache, s, n);
    if (at >= 0) {
        int32_t cnt = w->cache_ids[at];
        for (int32_t i = 0; i < cnt; i++)
            if (exl_tok_ids_push(out, w->cache_ids[at + 1 + i]))
                return nomem();
        return EXL_OK;
    }
    size_t before = out->n;
    EXL_TRY(bpe_uncached(tok, w, s, n, out));
    size_t cnt = out->n - before;
    if (w->cache.count >= CACHE_MAX_WORDS || w->cache_n + cnt + 1 > (size_t)INT32_MAX)
        return EXL_OK;
    void *ids = w->cache_ids;
    if (grow(&ids, &w->cache_cap, w->cache_n + cnt + 1, sizeof(int32_t)))
        return nomem();
    w->cache_ids = ids;
    char *key = exl_tok_arena_dup(&w->cache_arena, s, n);
    if (!key || exl_strmap_put(&w->cache, key, n, (int32_t)w->cache_n))
        return nomem();
    w->cache_ids[w->cache_n] = (int32_t)cnt;
    memcpy(w->cache_ids + w->cache_n + 1, out->v + before, cnt * sizeof(int32_t));
    w->cache_n += cnt + 1;
    return EXL_OK;
}
