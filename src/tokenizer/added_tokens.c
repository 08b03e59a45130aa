/* added_tokens.c - added (special and user) tokens: registration, a byte trie per kind
 * (raw / normalized), and leftmost-longest matching with the lstrip, rstrip and
 * single_word rules of Hugging Face `tokenizers`. */
#include "tokenizer.h"

#include <string.h>
#include <utf8proc.h>

#include "base/alloc.h"
#include "base/error.h"

/* ---------------------------------------------------------------- registration */

exl_status exl_tok_add_token(exl_tokenizer *tok, const char *path, int32_t id, const char *content, size_t len,
                             int special, int lstrip, int rstrip, int normalized, int single_word) {
    if (id < 0 || id >= tok->n_vocab)
        return exl_fail(EXL_ERR_FORMAT, "%s: added token '%.40s': id %d out of range", path, content, id);
    char *text = exl_tok_arena_dup(&tok->arena, content, len);
    if (!text)
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    const char *match = text;
    size_t match_len = len;
    if (normalized && tok->n_norms) {
        exl_str norm = EXL_STR_INIT;
        exl_status st = exl_tok_normalize(tok, content, len, &norm);
        if (st != EXL_OK) {
            exl_str_free(&norm);
            return exl_fail_prefix(st, "%s: added token '%.40s'", path, content);
        }
        match_len = norm.len;
        match = exl_tok_arena_dup(&tok->arena, norm.data ? norm.data : "", norm.len);
        exl_str_free(&norm);
        if (!match)
            return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    }
    exl_tok_added *a = exl_realloc(tok->added, (size_t)(tok->n_added + 1) * sizeof *a);
    if (!a)
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    tok->added = a;
    a[tok->n_added++] = (exl_tok_added){id,
                                        match,
                                        (uint32_t)match_len,
                                        (uint8_t) !!special,
                                        (uint8_t) !!lstrip,
                                        (uint8_t) !!rstrip,
                                        (uint8_t) !!normalized,
                                        (uint8_t) !!single_word};
    /* Decoding sees the (normalized) match string; skip_special only drops a token whose
     * string is its own content, as `tokenizers` does. */
    tok->text[id] = text;
    tok->text_len[id] = (uint32_t)len;
    tok->dec_text[id] = match;
    tok->dec_len[id] = (uint32_t)match_len;
    if (special) {
        tok->flags[id] |= EXL_TOK_F_SPECIAL;
        if (match_len == len && !memcmp(match, text, len))
            tok->flags[id] |= EXL_TOK_F_SKIP;
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- trie */

static int32_t trie_node(exl_tok_trie *t, uint8_t byte) {
    if (t->n == t->cap) {
        int32_t cap = t->cap ? t->cap * 2 : 64;
        exl_tok_trie_node *p = exl_realloc(t->nodes, (size_t)cap * sizeof *p);
        if (!p)
            return -1;
        t->nodes = p;
        t->cap = cap;
    }
    t->nodes[t->n] = (exl_tok_trie_node){-1, -1, -1, byte};
    return t->n++;
}

static int32_t trie_child(const exl_tok_trie *t, int32_t node, uint8_t byte) {
    for (int32_t c = t->nodes[node].child; c >= 0; c = t->nodes[c].sibling)
        if (t->nodes[c].byte == byte)
            return c;
    return -1;
}

static int trie_insert(exl_tok_trie *t, const char *s, size_t n, int32_t added) {
    if (!t->n && trie_node(t, 0) < 0)
        return -1;
    int32_t node = 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t c = trie_child(t, node, b);
        if (c < 0) {
            if ((c = trie_node(t, b)) < 0)
                return -1;
            t->nodes[c].sibling = t->nodes[node].child;
            t->nodes[node].child = c;
        }
        node = c;
    }
    if (t->nodes[node].added < 0)
        t->nodes[node].added = added;
    t->first[(uint8_t)s[0]] = 1;
    return 0;
}

exl_status exl_tok_build_tries(exl_tokenizer *tok, const char *path) {
    for (int32_t i = 0; i < tok->n_added; i++) {
        const exl_tok_added *a = &tok->added[i];
        if (!a->match_len)
            continue;
        exl_tok_trie *t = a->normalized && tok->n_norms ? &tok->trie_norm : &tok->trie_raw;
        if (trie_insert(t, a->match, a->match_len, i))
            return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    }
    return EXL_OK;
}

void exl_tok_trie_free(exl_tok_trie *t) {
    exl_free(t->nodes);
    memset(t, 0, sizeof *t);
}

/* ---------------------------------------------------------------- matching */

static int is_word_cp(int32_t cp) {
    if (cp == '_')
        return 1;
    switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_LU:
    case UTF8PROC_CATEGORY_LL:
    case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM:
    case UTF8PROC_CATEGORY_LO:
    case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC:
    case UTF8PROC_CATEGORY_ME:
    case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_PC: return 1;
    default: return 0;
    }
}

/* The code point ending at s[end) (s valid UTF-8, end > 0). */
static size_t prev_cp(const char *s, size_t end, int32_t *cp) {
    size_t i = exl_utf8_prev(s, end);
    exl_utf8_decode(s + i, cp);
    return i;
}

int exl_tok_added_next(const exl_tokenizer *tok, const exl_tok_trie *t, const char *s, size_t n, size_t from,
                       exl_tok_match *m) {
    if (!t->n)
        return 0;
    size_t pos = from;
    while (pos < n) {
        if (!t->first[(uint8_t)s[pos]]) {
            pos++;
            continue;
        }
        /* longest match starting at pos */
        int32_t node = 0, best = -1;
        size_t best_end = 0;
        for (size_t i = pos; i < n; i++) {
            node = trie_child(t, node, (uint8_t)s[i]);
            if (node < 0)
                break;
            if (t->nodes[node].added >= 0) {
                best = t->nodes[node].added;
                best_end = i + 1;
            }
        }
        if (best < 0) {
            pos++;
            continue;
        }
        const exl_tok_added *a = &tok->added[best];
        size_t start = pos, end = best_end;
        if (a->single_word) {
            int32_t cp;
            int word_before = start > 0 && (prev_cp(s, start, &cp), is_word_cp(cp));
            int word_after = end < n && (exl_utf8_decode(s + end, &cp), is_word_cp(cp));
            if (word_before || word_after) {
                pos = end; /* the match is consumed, as the Aho-Corasick iterator does */
                continue;
            }
        }
        if (a->lstrip) {
            while (start > from) {
                int32_t cp;
                size_t p = prev_cp(s, start, &cp);
                if (!exl_unicode_is_space(cp))
                    break;
                start = p;
            }
        }
        if (a->rstrip) {
            while (end < n) {
                int32_t cp;
                int l = exl_utf8_decode(s + end, &cp);
                if (!exl_unicode_is_space(cp))
                    break;
                end += (size_t)l;
            }
        }
        m->start = start;
        m->end = end;
        m->id = a->id;
        return 1;
    }
    return 0;
}
