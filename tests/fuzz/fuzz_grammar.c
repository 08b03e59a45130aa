/* fuzz_grammar.c - libFuzzer target for the constraint compilers and the matcher: the first byte
 * picks what the rest is (a GBNF grammar, a regular expression, a JSON Schema strict or lax); up to
 * the first NUL it is compiled, and what follows the NUL is fed to the matcher byte by byte, then
 * masks are taken over a small synthetic vocabulary. Any crash, leak or sanitizer report is a bug. */
#include "fuzz.h"

#include "base/alloc.h"
#include "constrain/constraint.h"
#include "constrain/mask.h"
#include "constrain/token_trie.h"

#include <stdlib.h>
#include <string.h>

/* A vocabulary of 300 tokens of 1 to 3 bytes (every byte once, then pairs and triples of
 * JSON-ish text), as a trie. */
static exl_token_trie *vocab(void) {
    static const char *const extra[] = {"{\"",      "\":", "\", ", "true", "null", "[1", "]}", "ab", "\\u",
                                        "\xc3\xa9", "  ",  "\n",   "yes",  "no ",  "12", "-1", "e+", ".5"};
    exl_token_trie *t = exl_calloc(1, sizeof *t);
    int32_t n_extra = (int32_t)(sizeof extra / sizeof extra[0]), vocab = 256 + n_extra;
    t->vocab = vocab;
    t->tok_off = exl_calloc((size_t)vocab, sizeof *t->tok_off);
    t->tok_len = exl_calloc((size_t)vocab, sizeof *t->tok_len);
    t->bytes = exl_malloc(1024);
    /* the trie of these few tokens, built by hand in preorder: the root, then each byte b with
     * the extra tokens starting with b below it (depth 2 and 3) */
    t->order = exl_malloc((size_t)vocab * sizeof *t->order);
    size_t at = 0;
    for (int32_t id = 0; id < vocab; id++) {
        const char *s = id < 256 ? NULL : extra[id - 256];
        char b = (char)id;
        t->tok_off[id] = (int64_t)at;
        t->tok_len[id] = s ? (int32_t)strlen(s) : 1;
        memcpy(t->bytes + at, s ? s : &b, (size_t)t->tok_len[id]);
        at += (size_t)t->tok_len[id];
        t->order[id] = id;
    }
    return t;
}

/* Nodes for vocab()'s tokens: one path per token (no sharing beyond the first byte is needed for
 * correctness of a walk: a node per token prefix, in preorder with sizes). */
static void build_nodes(exl_token_trie *t) {
    int32_t cap = 1 + 3 * t->vocab;
    t->byte = exl_calloc((size_t)cap, 1);
    t->depth = exl_calloc((size_t)cap, sizeof *t->depth);
    t->size = exl_calloc((size_t)cap, sizeof *t->size);
    t->tok_first = exl_calloc((size_t)cap, sizeof *t->tok_first);
    t->tok_n = exl_calloc((size_t)cap, sizeof *t->tok_n);
    int32_t n = 1;
    for (int32_t k = 0; k < t->vocab; k++) { /* each token as its own chain below the root */
        int32_t id = t->order[k], len = t->tok_len[id], first = n;
        for (int32_t d = 0; d < len; d++, n++) {
            t->byte[n] = (uint8_t)t->bytes[t->tok_off[id] + d];
            t->depth[n] = (uint16_t)(d + 1);
            t->size[n] = len - d;
        }
        t->tok_first[first + len - 1] = k;
        t->tok_n[first + len - 1] = 1;
        if (len > t->max_depth)
            t->max_depth = len;
    }
    t->size[0] = n;
    t->n_nodes = n;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static exl_token_trie *trie;
    if (!trie) {
        trie = vocab();
        build_nodes(trie);
    }
    if (size < 1 || size > 8192)
        return 0;
    static const exl_constraint_kind kinds[] = {EXL_CONSTRAINT_GBNF, EXL_CONSTRAINT_REGEX, EXL_CONSTRAINT_JSON_SCHEMA,
                                                EXL_CONSTRAINT_JSON_SCHEMA_LAX};
    const char *src = (const char *)data + 1;
    size_t n = size - 1;
    const char *nul = memchr(src, 0, n);
    size_t src_len = nul ? (size_t)(nul - src) : n;
    exl_constraint *c = NULL;
    if (exl_constraint_compile(kinds[data[0] % 4], src, src_len, &c) != EXL_OK)
        return 0;
    exl_matcher *m = &c->matcher;
    int32_t s = m->start;
    const uint32_t *mask;
    if (exl_mask_get(m, trie, s, &mask) == EXL_OK) {
        const char *in = nul ? nul + 1 : src + n;
        size_t in_len = nul ? n - src_len - 1 : 0;
        for (size_t i = 0; i < in_len && s >= 0; i++) {
            if (exl_matcher_step(m, s, (unsigned char)in[i], &s) != EXL_OK)
                break;
            if (s >= 0 && (i % 7 == 0) && exl_mask_get(m, trie, s, &mask) != EXL_OK)
                break;
        }
    }
    exl_constraint_free(c);
    return 0;
}
