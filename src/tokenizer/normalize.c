/* normalize.c - normalizers: Unicode forms (utf8proc), Lowercase, Strip, StripAccents,
 * Replace (string or regex), Prepend, and SentencePiece's whitespace squeezing, run in
 * sequence over one piece of text. */
#include "tokenizer.h"

#include <string.h>
#include <utf8proc.h>

#include "base/alloc.h"
#include "base/error.h"

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "out of memory"); }

static int is_ascii(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] >= 0x80)
            return 0;
    return 1;
}

static exl_status unicode_form(const char *s, size_t n, utf8proc_option_t opts, exl_str *out) {
    if (is_ascii(s, n)) /* ASCII is invariant under every normalization form */
        return exl_str_append(out, s, n) ? nomem() : EXL_OK;
    opts |= UTF8PROC_STABLE;
    utf8proc_ssize_t need = utf8proc_decompose((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, NULL, 0, opts);
    if (need < 0)
        return exl_fail(EXL_ERR_ARG, "normalizer: %s", utf8proc_errmsg(need));
    utf8proc_int32_t *buf = exl_malloc(((size_t)need + 1) * sizeof *buf);
    if (!buf)
        return nomem();
    utf8proc_ssize_t got = utf8proc_decompose((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, buf, need, opts);
    if (got >= 0)
        got = utf8proc_normalize_utf32(buf, got, opts);
    if (got >= 0)
        got = utf8proc_reencode(buf, got, opts);
    exl_status st = got < 0 ? exl_fail(EXL_ERR_ARG, "normalizer: %s", utf8proc_errmsg(got))
                    : exl_str_append(out, (const char *)buf, (size_t)got) ? nomem()
                                                                          : EXL_OK;
    exl_free(buf);
    return st;
}

/* Apply a per-code-point rewrite: f returns the code point to keep, or -1 to drop it. */
static exl_status map_cps(const char *s, size_t n, int32_t (*f)(int32_t), exl_str *out) {
    if (exl_str_reserve(out, n + 16))
        return nomem();
    for (size_t i = 0; i < n;) {
        int32_t cp;
        i += (size_t)exl_utf8_decode(s + i, &cp);
        cp = f(cp);
        if (cp < 0)
            continue;
        if (exl_str_reserve(out, 4))
            return nomem();
        out->len += (size_t)exl_utf8_encode(cp, out->data + out->len);
    }
    out->data[out->len] = 0;
    return EXL_OK;
}

static int32_t lower_cp(int32_t cp) { return utf8proc_tolower(cp); }

static int32_t drop_marks(int32_t cp) { return utf8proc_category(cp) == UTF8PROC_CATEGORY_MN ? -1 : cp; }

static exl_status strip(const char *s, size_t n, int left, int right, exl_str *out) {
    size_t a = 0, b = n;
    while (left && a < b) {
        int32_t cp;
        int l = exl_utf8_decode(s + a, &cp);
        if (!exl_unicode_is_space(cp))
            break;
        a += (size_t)l;
    }
    while (right && b > a) {
        size_t p = exl_utf8_prev(s, b);
        int32_t cp;
        exl_utf8_decode(s + p, &cp);
        if (!exl_unicode_is_space(cp))
            break;
        b = p;
    }
    return exl_str_append(out, s + a, b - a) ? nomem() : EXL_OK;
}

static exl_status spm_whitespace(const char *s, size_t n, exl_str *out) {
    size_t a = 0, b = n;
    while (a < b && s[a] == ' ')
        a++;
    while (b > a && s[b - 1] == ' ')
        b--;
    for (size_t i = a; i < b; i++)
        if (!(s[i] == ' ' && s[i - 1] == ' ') && exl_str_putc(out, s[i]))
            return nomem();
    return exl_str_reserve(out, 0) ? nomem() : EXL_OK;
}

static exl_status replace(const exl_tok_norm *o, const char *s, size_t n, exl_str *out) {
    if (o->pattern.literal) {
        size_t pos = 0, ln = o->pattern.literal_len;
        for (;;) {
            const char *hit = pos + ln <= n ? memmem(s + pos, n - pos, o->pattern.literal, ln) : NULL;
            size_t at = hit ? (size_t)(hit - s) : n;
            if (exl_str_append(out, s + pos, at - pos))
                return nomem();
            if (!hit)
                break;
            if (exl_str_append(out, o->content, o->content_len))
                return nomem();
            pos = at + ln;
        }
        return exl_str_reserve(out, 0) ? nomem() : EXL_OK;
    }
    pcre2_match_data *md = pcre2_match_data_create(1, NULL);
    if (!md)
        return nomem();
    size_t pos = 0, copied = 0;
    exl_status st = EXL_OK;
    while (pos <= n && st == EXL_OK) {
        int rc = pcre2_match(o->pattern.re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
        if (rc < 0)
            break;
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (ov[1] <= ov[0]) {
            if (ov[0] >= n)
                break;
            pos = ov[0] + (size_t)exl_utf8_len((unsigned char)s[ov[0]]);
            continue;
        }
        if (exl_str_append(out, s + copied, ov[0] - copied) || exl_str_append(out, o->content, o->content_len))
            st = nomem();
        copied = pos = ov[1];
    }
    pcre2_match_data_free(md);
    if (st == EXL_OK && exl_str_append(out, s + copied, n - copied))
        st = nomem();
    return st;
}

static exl_status apply(const exl_tok_norm *o, const char *s, size_t n, exl_str *out) {
    switch (o->kind) {
    case EXL_TOK_NORM_NFC: return unicode_form(s, n, UTF8PROC_COMPOSE, out);
    case EXL_TOK_NORM_NFD: return unicode_form(s, n, UTF8PROC_DECOMPOSE, out);
    case EXL_TOK_NORM_NFKC: return unicode_form(s, n, UTF8PROC_COMPOSE | UTF8PROC_COMPAT, out);
    case EXL_TOK_NORM_NFKD: return unicode_form(s, n, UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT, out);
    case EXL_TOK_NORM_LOWERCASE: return map_cps(s, n, lower_cp, out);
    case EXL_TOK_NORM_STRIP_ACCENTS: return map_cps(s, n, drop_marks, out);
    case EXL_TOK_NORM_STRIP: return strip(s, n, o->a, o->b, out);
    case EXL_TOK_NORM_REPLACE: return replace(o, s, n, out);
    case EXL_TOK_NORM_PREPEND:
        if (n && exl_str_append(out, o->content, o->content_len))
            return nomem();
        return exl_str_append(out, s, n) ? nomem() : EXL_OK;
    case EXL_TOK_NORM_SPM_WHITESPACE: return spm_whitespace(s, n, out);
    }
    return EXL_OK;
}

exl_status exl_tok_normalize(const exl_tokenizer *tok, const char *s, size_t n, exl_str *out) {
    exl_str other = EXL_STR_INIT;
    exl_str *cur = out, *prev = &other;
    exl_status st = EXL_OK;
    exl_str_clear(out);
    if (exl_str_append(out, s, n)) /* the chain reads from *prev and writes *cur */
        st = nomem();
    for (int32_t i = 0; i < tok->n_norms && st == EXL_OK; i++) {
        exl_str *t = cur;
        cur = prev;
        prev = t;
        exl_str_clear(cur);
        st = apply(&tok->norms[i], prev->data, prev->len, cur);
    }
    if (st == EXL_OK && cur != out) {
        exl_str t = *out;
        *out = *cur;
        *cur = t;
    }
    exl_str_free(&other);
    return st;
}
