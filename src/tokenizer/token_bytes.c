/* token_bytes.c - the bytes one token adds to decoded text when other tokens come before it: the
 * decoder chain applied to that token alone, without the effects that belong to the start of a
 * text (Strip after Fuse, Metaspace's dropped first replacement). Constrained decoding matches
 * grammars against these byte strings, so they must be what exl_detokenizer streams. */
#include "tokenizer.h"

#include "base/alloc.h"
#include "base/error.h"

#include <string.h>

/* "<0xAB>" -> 0xAB, else -1. */
static int fallback_byte(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Every occurrence of a literal in s replaced by content, into out. */
static int replace_literal(exl_str *out, const char *s, size_t n, const char *lit, size_t ln, const char *content,
                           size_t cl) {
    size_t pos = 0;
    for (;;) {
        const char *hit = ln && pos + ln <= n ? memmem(s + pos, n - pos, lit, ln) : NULL;
        size_t at = hit ? (size_t)(hit - s) : n;
        if (exl_str_append(out, s + pos, at - pos))
            return -1;
        if (!hit)
            return 0;
        if (exl_str_append(out, content, cl))
            return -1;
        pos = at + ln;
    }
}

/* Every match of a regex in s replaced by content, into out. */
static int replace_regex(exl_str *out, const char *s, size_t n, const pcre2_code *re, const char *content, size_t cl) {
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md)
        return -1;
    size_t pos = 0, copied = 0;
    int fail = 0;
    while (pos < n && !fail) {
        if (pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL) < 0)
            break;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (ov[1] <= ov[0]) {
            pos = ov[0] + 1;
            continue;
        }
        fail = exl_str_append(out, s + copied, ov[0] - copied) || exl_str_append(out, content, cl);
        copied = pos = ov[1];
    }
    pcre2_match_data_free(md);
    return fail || exl_str_append(out, s + copied, n - copied) ? -1 : 0;
}

/* One decoder on the token's string cur, into nxt; *fused tells whether a Fuse came before. */
static int apply_decoder(const exl_tok_dec *d, const exl_str *cur, exl_str *nxt, int *fused) {
    const char *s = cur->data ? cur->data : "";
    size_t n = cur->len;
    switch (d->kind) {
    case EXL_TOK_DEC_REPLACE:
        return d->pattern.literal
                   ? replace_literal(nxt, s, n, d->pattern.literal, d->pattern.literal_len, d->content, d->content_len)
                   : replace_regex(nxt, s, n, d->pattern.re, d->content, d->content_len);
    case EXL_TOK_DEC_BYTEFALLBACK: {
        int b = fallback_byte(s, n);
        return b >= 0 ? exl_str_putc(nxt, (char)b) : exl_str_append(nxt, s, n);
    }
    case EXL_TOK_DEC_FUSE: *fused = 1; return exl_str_append(nxt, s, n);
    case EXL_TOK_DEC_STRIP: {
        size_t a = 0, e = n, cl = d->content_len;
        for (int k = 0; !*fused && k < d->a && e - a >= cl && !memcmp(s + a, d->content, cl); k++)
            a += cl;
        for (int k = 0; !*fused && k < d->b && e - a >= cl && !memcmp(s + e - cl, d->content, cl); k++)
            e -= cl;
        return exl_str_append(nxt, s + a, e - a);
    }
    case EXL_TOK_DEC_METASPACE: return replace_literal(nxt, s, n, d->content, d->content_len, " ", 1);
    case EXL_TOK_DEC_BYTELEVEL:
        for (size_t i = 0; i < n;) {
            int32_t cp;
            size_t at = i;
            i += (size_t)exl_utf8_decode(s + i, &cp);
            int b = exl_bytelevel_byte(cp);
            if (b < 0 ? exl_str_append(nxt, s + at, i - at) : exl_str_putc(nxt, (char)b))
                return -1;
        }
        return 0;
    }
    return 0;
}

exl_status exl_tokenizer_token_bytes(const exl_tokenizer *tok, int32_t id, char *buf, int32_t cap, int32_t *len) {
    if (!tok || !len || (cap > 0 && !buf))
        return exl_fail(EXL_ERR_ARG, "exl_tokenizer_token_bytes: bad argument");
    *len = -1;
    if (id < 0 || id >= tok->n_vocab)
        return exl_fail(EXL_ERR_ARG, "token id %d is out of range (vocabulary of %d)", id, tok->n_vocab);
    if (!tok->dec_text[id] || (tok->flags[id] & EXL_TOK_F_SKIP))
        return EXL_OK; /* a hole, or a special token: never in the text */
    exl_str a = EXL_STR_INIT, b = EXL_STR_INIT;
    int fail = 0, fused = 0;
    if (!tok->has_decoder) /* tokens are joined with spaces */
        fail = exl_str_putc(&a, ' ');
    fail = fail || exl_str_append(&a, tok->dec_text[id], tok->dec_len[id]);
    for (int32_t k = 0; tok->has_decoder && k < tok->n_decs && !fail; k++) {
        exl_str_clear(&b);
        fail = apply_decoder(&tok->decs[k], &a, &b, &fused);
        exl_str t = a;
        a = b;
        b = t;
    }
    if (!fail && a.len <= INT32_MAX) {
        *len = (int32_t)a.len;
        if (*len && cap > 0)
            memcpy(buf, a.data, (size_t)(*len < cap ? *len : cap));
    }
    exl_str_free(&a);
    exl_str_free(&b);
    return fail ? exl_fail(EXL_ERR_NOMEM, "out of memory") : EXL_OK;
}
