/* token_trie.c - building the preorder token trie of token_trie.h: every token's bytes, the ids
 * sorted by them, then one pass that opens a node per new byte and closes the nodes a token
 * no longer shares with the one before (their subtree sizes are then known). */
#include "constrain/token_trie.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "token trie: out of memory"); }

void exl_token_trie_free(exl_token_trie *t) {
    if (!t)
        return;
    exl_free(t->byte);
    exl_free(t->depth);
    exl_free(t->size);
    exl_free(t->tok_first);
    exl_free(t->tok_n);
    exl_free(t->order);
    exl_free(t->tok_off);
    exl_free(t->tok_len);
    exl_free(t->bytes);
    exl_free(t);
}

/* Every token's bytes into t->bytes / tok_off / tok_len, and the ids in the trie into order. */
static exl_status collect_bytes(exl_token_trie *t, const exl_tokenizer *tok) {
    int32_t n_tok = exl_tokenizer_vocab_size(tok);
    int64_t total = 0, cap = 1 << 16;
    t->tok_off = exl_calloc((size_t)t->vocab, sizeof *t->tok_off);
    t->tok_len = exl_malloc((size_t)t->vocab * sizeof *t->tok_len);
    t->order = exl_malloc((size_t)t->vocab * sizeof *t->order);
    t->bytes = exl_malloc((size_t)cap);
    if (!t->tok_off || !t->tok_len || !t->order || !t->bytes)
        return nomem();
    for (int32_t id = 0; id < t->vocab; id++) {
        int32_t len = -1;
        if (id < n_tok && !exl_tokenizer_is_special(tok, id))
            EXL_TRY(exl_tokenizer_token_bytes(tok, id, NULL, 0, &len));
        t->tok_len[id] = len > 0 && len <= EXL_TOKEN_TRIE_MAX_LEN ? len : -1;
        if (t->tok_len[id] < 0)
            continue;
        if (total + len > cap) {
            while (total + len > cap)
                cap *= 2;
            char *b = exl_realloc(t->bytes, (size_t)cap);
            if (!b)
                return nomem();
            t->bytes = b;
        }
        EXL_TRY(exl_tokenizer_token_bytes(tok, id, t->bytes + total, len, &len));
        t->tok_off[id] = total;
        total += len;
        t->order[t->n_order++] = id;
    }
    return EXL_OK;
}

static int by_bytes(const void *a, const void *b, void *ctx) {
    const exl_token_trie *t = ctx;
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    int32_t lx = t->tok_len[x], ly = t->tok_len[y];
    int c = memcmp(t->bytes + t->tok_off[x], t->bytes + t->tok_off[y], (size_t)(lx < ly ? lx : ly));
    if (c)
        return c;
    if (lx != ly)
        return lx < ly ? -1 : 1;
    return (x > y) - (x < y);
}

/* Room for n nodes. */
static int reserve_nodes(exl_token_trie *t, int32_t n, int32_t *cap) {
    if (n <= *cap)
        return 0;
    int32_t c = *cap ? *cap : 1024;
    while (c < n)
        c *= 2;
    void *p[5] = {exl_realloc(t->byte, (size_t)c), exl_realloc(t->depth, (size_t)c * 2), NULL, NULL, NULL};
    if (p[0])
        t->byte = p[0];
    if (p[1])
        t->depth = p[1];
    p[2] = exl_realloc(t->size, (size_t)c * 4);
    if (p[2])
        t->size = p[2];
    p[3] = exl_realloc(t->tok_first, (size_t)c * 4);
    if (p[3])
        t->tok_first = p[3];
    p[4] = exl_realloc(t->tok_n, (size_t)c * 4);
    if (p[4])
        t->tok_n = p[4];
    for (int i = 0; i < 5; i++)
        if (!p[i])
            return -1;
    *cap = c;
    return 0;
}

static exl_status build_nodes(exl_token_trie *t) {
    int32_t cap = 0, *path = exl_malloc((EXL_TOKEN_TRIE_MAX_LEN + 1) * sizeof *path), sp = 1;
    if (!path || reserve_nodes(t, 1, &cap)) {
        exl_free(path);
        return nomem();
    }
    t->byte[0] = 0;
    t->depth[0] = 0;
    t->tok_n[0] = 0;
    t->tok_first[0] = 0;
    t->n_nodes = 1;
    path[0] = 0;
    const char *prev = NULL;
    int32_t prev_len = 0;
    for (int32_t k = 0; k < t->n_order; k++) {
        int32_t id = t->order[k], len = t->tok_len[id], lcp = 0;
        const char *b = t->bytes + t->tok_off[id];
        while (lcp < len && lcp < prev_len && b[lcp] == prev[lcp])
            lcp++;
        while (sp > lcp + 1) { /* close the nodes below the common prefix */
            int32_t node = path[--sp];
            t->size[node] = t->n_nodes - node;
        }
        if (reserve_nodes(t, t->n_nodes + (len - lcp), &cap)) {
            exl_free(path);
            return nomem();
        }
        for (int32_t d = lcp; d < len; d++) {
            int32_t node = t->n_nodes++;
            t->byte[node] = (uint8_t)b[d];
            t->depth[node] = (uint16_t)(d + 1);
            t->tok_n[node] = 0;
            t->tok_first[node] = 0;
            path[sp++] = node;
        }
        int32_t node = path[len];
        if (!t->tok_n[node]++)
            t->tok_first[node] = k;
        if (len > t->max_depth)
            t->max_depth = len;
        prev = b;
        prev_len = len;
    }
    while (sp > 0) {
        int32_t node = path[--sp];
        t->size[node] = t->n_nodes - node;
    }
    exl_free(path);
    return EXL_OK;
}

exl_status exl_token_trie_build(const exl_tokenizer *tok, int32_t vocab, exl_token_trie **out) {
    *out = NULL;
    if (!tok || vocab < 1)
        return exl_fail(EXL_ERR_ARG, "exl_token_trie_build: bad argument");
    exl_token_trie *t = exl_calloc(1, sizeof *t);
    if (!t)
        return nomem();
    t->vocab = vocab;
    exl_status st = collect_bytes(t, tok);
    if (st == EXL_OK) {
        qsort_r(t->order, (size_t)t->n_order, sizeof *t->order, by_bytes, t);
        st = build_nodes(t);
    }
    if (st != EXL_OK) {
        exl_token_trie_free(t);
        return st;
    }
    *out = t;
    return EXL_OK;
}
