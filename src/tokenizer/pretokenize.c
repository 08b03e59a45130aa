/* pretokenize.c - pre-tokenizers: cut a normalized piece into words (Split with a regex
 * or a string and the five split behaviors, Digits, Punctuation, WhitespaceSplit) and
 * rewrite them (ByteLevel's byte -> character table, Metaspace's space -> U+2581). */
#include "tokenizer.h"

#include <string.h>
#include <utf8proc.h>

#include "base/alloc.h"
#include "base/error.h"

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "out of memory"); }

int exl_tok_ranges_push(exl_tok_ranges *r, size_t off, size_t len) {
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 64;
        uint32_t *o = exl_realloc(r->off, cap * sizeof *o);
        if (!o)
            return -1;
        r->off = o;
        uint32_t *l = exl_realloc(r->len, cap * sizeof *l);
        if (!l)
            return -1;
        r->len = l;
        r->cap = cap;
    }
    r->off[r->n] = (uint32_t)off;
    r->len[r->n] = (uint32_t)len;
    r->n++;
    return 0;
}

static void ranges_free(exl_tok_ranges *r) {
    exl_free(r->off);
    exl_free(r->len);
}

void exl_tok_work_free(exl_tok_work *w) {
    for (int i = 0; i < 2; i++) {
        exl_str_free(&w->buf[i]);
        ranges_free(&w->rng[i]);
    }
    ranges_free(&w->seg);
    exl_str_free(&w->tmp);
    exl_str_free(&w->key);
    if (w->md)
        pcre2_match_data_free(w->md);
    if (w->mctx)
        pcre2_match_context_free(w->mctx);
    if (w->jit)
        pcre2_jit_stack_free(w->jit);
    exl_free(w->sym);
    exl_free(w->heap);
    exl_strmap_free(&w->cache);
    exl_tok_arena_free(&w->cache_arena);
    exl_free(w->cache_ids);
}

/* ---------------------------------------------------------------- byte level table */

/* Bytes 33-126, 161-172 and 174-255 stand for themselves; the 68 others are mapped, in
 * order, to U+0100 and up. */
int32_t exl_bytelevel_char(uint8_t b) {
    if (b <= 32)
        return 256 + b;
    if (b >= 127 && b <= 160)
        return 256 + 33 + (b - 127);
    if (b == 173)
        return 256 + 67;
    return b;
}

int exl_bytelevel_byte(int32_t cp) {
    if ((cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) || (cp >= 174 && cp <= 255))
        return cp;
    if (cp >= 256 && cp <= 256 + 32)
        return cp - 256;
    if (cp >= 256 + 33 && cp <= 256 + 66)
        return cp - 256 - 33 + 127;
    if (cp == 256 + 67)
        return 173;
    return -1;
}

/* ---------------------------------------------------------------- splitting */

#define SEG_MATCH 0x80000000u

static int push_match(void *ctx, size_t start, size_t end) { return exl_tok_ranges_push(ctx, start, end - start); }

static exl_status find_literal(exl_tok_work *w, const char *s, size_t n, const char *lit, size_t ln) {
    size_t pos = 0;
    while (pos + ln <= n) {
        const char *hit = memmem(s + pos, n - pos, lit, ln);
        if (!hit)
            break;
        size_t at = (size_t)(hit - s);
        if (push_match(&w->seg, at, at + ln))
            return nomem();
        pos = at + ln;
    }
    return EXL_OK;
}

typedef int (*char_pred)(int32_t cp);

static int is_numeric(int32_t cp) {
    if (cp < 0x80)
        return cp >= '0' && cp <= '9';
    utf8proc_category_t c = utf8proc_category(cp);
    return c == UTF8PROC_CATEGORY_ND || c == UTF8PROC_CATEGORY_NL || c == UTF8PROC_CATEGORY_NO;
}

static int is_punct(int32_t cp) {
    if (cp < 0x80)
        return (cp >= 33 && cp <= 47) || (cp >= 58 && cp <= 64) || (cp >= 91 && cp <= 96) || (cp >= 123 && cp <= 126);
    utf8proc_category_t c = utf8proc_category(cp);
    return c >= UTF8PROC_CATEGORY_PC && c <= UTF8PROC_CATEGORY_PO;
}

static exl_status find_chars(exl_tok_work *w, const char *s, size_t n, char_pred pred) {
    for (size_t i = 0; i < n;) {
        int32_t cp;
        int l = exl_utf8_decode(s + i, &cp);
        if (pred(cp) && push_match(&w->seg, i, i + (size_t)l))
            return nomem();
        i += (size_t)l;
    }
    return EXL_OK;
}

/* Turn the matches in w->seg (for the piece at base, n bytes) into the pieces the
 * behavior keeps, appended to out. */
static exl_status apply_behavior(exl_tok_work *w, exl_tok_ranges *out, size_t base, size_t n,
                                 exl_tok_split_behavior behavior, int invert) {
    /* matches -> alternating segments, in place after the matches */
    size_t n_matches = w->seg.n, prev = 0;
    for (size_t i = 0; i < n_matches; i++) {
        size_t st = w->seg.off[i], len = w->seg.len[i];
        if (st > prev && exl_tok_ranges_push(&w->seg, prev, (st - prev) | (invert ? SEG_MATCH : 0)))
            return nomem();
        if (exl_tok_ranges_push(&w->seg, st, len | (invert ? 0 : SEG_MATCH)))
            return nomem();
        prev = st + len;
    }
    if (prev < n && exl_tok_ranges_push(&w->seg, prev, (n - prev) | (invert ? SEG_MATCH : 0)))
        return nomem();
    const uint32_t *off = w->seg.off + n_matches, *lens = w->seg.len + n_matches;
    size_t n_seg = w->seg.n - n_matches, first = out->n;
    int prev_match = 0;
    if (behavior == EXL_TOK_SPLIT_MERGED_WITH_NEXT) {
        /* folded from the end, as `tokenizers` does, then put back in order */
        for (size_t k = n_seg; k-- > 0;) {
            int m = !!(lens[k] & SEG_MATCH);
            size_t st = off[k], len = lens[k] & ~SEG_MATCH;
            if (m && !prev_match && out->n > first) {
                out->len[out->n - 1] += (uint32_t)((out->off[out->n - 1] - (base + st)));
                out->off[out->n - 1] = (uint32_t)(base + st);
            } else if (exl_tok_ranges_push(out, base + st, len)) {
                return nomem();
            }
            prev_match = m;
        }
        for (size_t a = first, b = out->n - 1; a < b && out->n > first; a++, b--) {
            uint32_t t = out->off[a];
            out->off[a] = out->off[b];
            out->off[b] = t;
            t = out->len[a];
            out->len[a] = out->len[b];
            out->len[b] = t;
        }
    } else {
        for (size_t k = 0; k < n_seg; k++) {
            int m = !!(lens[k] & SEG_MATCH);
            size_t st = off[k], len = lens[k] & ~SEG_MATCH;
            int extend = 0;
            if (behavior == EXL_TOK_SPLIT_REMOVED && m) {
                prev_match = m;
                continue;
            }
            if (behavior == EXL_TOK_SPLIT_MERGED_WITH_PREVIOUS)
                extend = m && !prev_match && out->n > first;
            else if (behavior == EXL_TOK_SPLIT_CONTIGUOUS)
                extend = m == prev_match && out->n > first;
            if (extend)
                out->len[out->n - 1] += (uint32_t)len;
            else if (exl_tok_ranges_push(out, base + st, len))
                return nomem();
            prev_match = m;
        }
    }
    w->seg.n = 0;
    return EXL_OK;
}

/* Split every piece of (buf, in) into out with one splitting pre-tokenizer. */
static exl_status split_pieces(const exl_tok_pretok *p, exl_tok_work *w, const char *buf, const exl_tok_ranges *in,
                               exl_tok_ranges *out) {
    out->n = 0;
    for (size_t i = 0; i < in->n; i++) {
        const char *s = buf + in->off[i];
        size_t n = in->len[i];
        exl_tok_split_behavior behavior = p->behavior;
        int invert = p->invert;
        w->seg.n = 0;
        switch (p->kind) {
        case EXL_TOK_PRE_SPLIT:
            if (p->pattern.re)
                EXL_TRY(exl_tok_regex_each(p->pattern.re, w, s, n, push_match, &w->seg));
            else
                EXL_TRY(find_literal(w, s, n, p->pattern.literal, p->pattern.literal_len));
            break;
        case EXL_TOK_PRE_DIGITS:
            EXL_TRY(find_chars(w, s, n, is_numeric));
            behavior = p->a ? EXL_TOK_SPLIT_ISOLATED : EXL_TOK_SPLIT_CONTIGUOUS;
            invert = 0;
            break;
        case EXL_TOK_PRE_PUNCT:
            EXL_TRY(find_chars(w, s, n, is_punct));
            invert = 0;
            break;
        default: /* EXL_TOK_PRE_WSPLIT */
            EXL_TRY(find_chars(w, s, n, exl_unicode_is_space));
            behavior = EXL_TOK_SPLIT_REMOVED;
            invert = 0;
            break;
        }
        EXL_TRY(apply_behavior(w, out, in->off[i], n, behavior, invert));
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- rewriting */

static exl_status append_bytelevel(exl_str *out, exl_tok_ranges *r, const char *s, size_t n) {
    size_t start = out->len;
    if (exl_str_reserve(out, n * 2))
        return nomem();
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        if (b >= 33 && b <= 126)
            out->data[out->len++] = (char)b;
        else
            out->len += (size_t)exl_utf8_encode(exl_bytelevel_char(b), out->data + out->len);
    }
    out->data[out->len] = 0;
    if (exl_tok_ranges_push(r, start, out->len - start))
        return nomem();
    return EXL_OK;
}

typedef struct bl_ctx {
    exl_str *out;
    exl_tok_ranges *r;
    const char *s;
} bl_ctx;

static int bytelevel_match(void *ctx, size_t start, size_t end) {
    bl_ctx *c = ctx;
    return append_bytelevel(c->out, c->r, c->s + start, end - start) != EXL_OK;
}

static exl_status bytelevel(const exl_tok_pretok *p, exl_tok_work *w, const char *buf, const exl_tok_ranges *in,
                            exl_str *out, exl_tok_ranges *r) {
    for (size_t i = 0; i < in->n; i++) {
        const char *s = buf + in->off[i];
        size_t n = in->len[i];
        if (p->a && (n == 0 || s[0] != ' ')) {
            exl_str_clear(&w->tmp);
            if (exl_str_putc(&w->tmp, ' ') || exl_str_append(&w->tmp, s, n))
                return nomem();
            s = w->tmp.data;
            n = w->tmp.len;
        }
        if (p->b) {
            bl_ctx c = {out, r, s};
            EXL_TRY(exl_tok_regex_each(p->pattern.re, w, s, n, bytelevel_match, &c));
        } else {
            EXL_TRY(append_bytelevel(out, r, s, n));
        }
    }
    return EXL_OK;
}

static exl_status metaspace(const exl_tok_pretok *p, exl_tok_work *w, const char *buf, const exl_tok_ranges *in,
                            int at_start, exl_str *out, exl_tok_ranges *r) {
    for (size_t i = 0; i < in->n; i++) {
        const char *s = buf + in->off[i];
        size_t n = in->len[i], start = out->len;
        for (size_t k = 0; k < n; k++) {
            if (s[k] == ' ' ? exl_str_append(out, p->content, p->content_len) : exl_str_putc(out, s[k]))
                return nomem();
        }
        size_t len = out->len - start;
        int starts = len >= p->content_len && !memcmp(out->data + start, p->content, p->content_len);
        int prepend = p->a == EXL_TOK_PREPEND_ALWAYS || (p->a == EXL_TOK_PREPEND_FIRST && at_start && in->off[i] == 0);
        if (prepend && !starts) {
            if (exl_str_reserve(out, p->content_len))
                return nomem();
            memmove(out->data + start + p->content_len, out->data + start, len);
            memcpy(out->data + start, p->content, p->content_len);
            out->len += p->content_len;
            out->data[out->len] = 0;
            len += p->content_len;
        }
        if (!p->b) {
            if (exl_tok_ranges_push(r, start, len))
                return nomem();
            continue;
        }
        w->seg.n = 0;
        EXL_TRY(find_literal(w, out->data + start, len, p->content, p->content_len));
        EXL_TRY(apply_behavior(w, r, start, len, EXL_TOK_SPLIT_MERGED_WITH_NEXT, 0));
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- the chain */

exl_status exl_tok_pretokenize(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, int at_start,
                               const char **text, const exl_tok_ranges **words) {
    int b = 0, r = 0;
    exl_str_clear(&w->buf[0]);
    w->rng[0].n = 0;
    if (exl_str_append(&w->buf[0], s, n) || exl_tok_ranges_push(&w->rng[0], 0, n))
        return nomem();
    for (int32_t i = 0; i < tok->n_pretoks; i++) {
        const exl_tok_pretok *p = &tok->pretoks[i];
        if (p->kind == EXL_TOK_PRE_BYTELEVEL || p->kind == EXL_TOK_PRE_METASPACE) {
            exl_str_clear(&w->buf[!b]);
            w->rng[!r].n = 0;
            if (exl_str_reserve(&w->buf[!b], 0))
                return nomem();
            if (p->kind == EXL_TOK_PRE_BYTELEVEL)
                EXL_TRY(bytelevel(p, w, w->buf[b].data, &w->rng[r], &w->buf[!b], &w->rng[!r]));
            else
                EXL_TRY(metaspace(p, w, w->buf[b].data, &w->rng[r], at_start, &w->buf[!b], &w->rng[!r]));
            b = !b;
        } else {
            EXL_TRY(split_pieces(p, w, w->buf[b].data, &w->rng[r], &w->rng[!r]));
        }
        r = !r;
    }
    *text = w->buf[b].data;
    *words = &w->rng[r];
    return EXL_OK;
}
