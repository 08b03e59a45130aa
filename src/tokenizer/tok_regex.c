/* tok_regex.c - regexes of tokenizer.json (written for Oniguruma) run with PCRE2:
 * translation of the escapes whose meaning differs, compilation with UTF + UCP + JIT,
 * and iteration over matches with per-call match data. */
#include "tokenizer.h"

#include <string.h>

#include "base/error.h"

/* Oniguruma's \s is Unicode White_Space; PCRE2 also counts U+180E, so spell it out.
 * Its \w takes marks too, which PCRE2's does not (before 10.43). */
#define WORD_SET "\\p{L}\\p{M}\\p{Nd}\\p{Nl}\\p{Pc}"
#define SPACE_SET \
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}\\x{205F}\\x{3000}"

static int translate(const char *src, size_t len, exl_str *out) {
    int in_class = 0;
    for (size_t i = 0; i < len; i++) {
        char c = src[i];
        if (c == '\\' && i + 1 < len) {
            char e = src[++i];
            int r;
            if (e == 's')
                r = exl_str_puts(out, in_class ? SPACE_SET : "[" SPACE_SET "]");
            else if (e == 'S' && !in_class)
                r = exl_str_puts(out, "[^" SPACE_SET "]");
            else if (e == 'w')
                r = exl_str_puts(out, in_class ? WORD_SET : "[" WORD_SET "]");
            else if (e == 'W' && !in_class)
                r = exl_str_puts(out, "[^" WORD_SET "]");
            else if (e == 'h') /* Oniguruma: hexadecimal digit */
                r = exl_str_puts(out, in_class ? "0-9a-fA-F" : "[0-9a-fA-F]");
            else
                r = exl_str_putc(out, '\\') || exl_str_putc(out, e);
            if (r)
                return -1;
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = 1;
            if (exl_str_putc(out, c))
                return -1;
            /* a ']' right after '[' or '[^' is a literal */
            if (i + 1 < len && src[i + 1] == '^') {
                if (exl_str_putc(out, '^'))
                    return -1;
                i++;
            }
            if (i + 1 < len && src[i + 1] == ']') {
                if (exl_str_puts(out, "\\]"))
                    return -1;
                i++;
            }
            continue;
        }
        if (c == ']' && in_class)
            in_class = 0;
        if (exl_str_putc(out, c))
            return -1;
    }
    return 0;
}

exl_status exl_tok_regex_compile(const char *path, const char *what, const char *src, size_t len, pcre2_code **out) {
    exl_str pat = EXL_STR_INIT;
    if (translate(src, len, &pat) || exl_str_reserve(&pat, 0)) {
        exl_str_free(&pat);
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    }
    int err;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat.data, pat.len, PCRE2_UTF | PCRE2_UCP, &err, &off, NULL);
    exl_str_free(&pat);
    if (!re) {
        char msg[160];
        pcre2_get_error_message(err, (PCRE2_UCHAR *)msg, sizeof msg);
        return exl_fail(EXL_ERR_FORMAT, "%s: %s: bad regex: %s", path, what, msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* without JIT the interpreter runs it */
    *out = re;
    return EXL_OK;
}

exl_status exl_tok_regex_each(const pcre2_code *re, exl_tok_work *w, const char *s, size_t n,
                              int (*fn)(void *ctx, size_t start, size_t end), void *ctx) {
    if (!w->md) {
        w->md = pcre2_match_data_create(16, NULL);
        w->mctx = pcre2_match_context_create(NULL);
        w->jit = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
        if (!w->md || !w->mctx || !w->jit)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        pcre2_jit_stack_assign(w->mctx, NULL, w->jit);
    }
    size_t pos = 0;
    while (pos < n) {
        int rc = pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, w->md, w->mctx);
        if (rc == PCRE2_ERROR_NOMATCH)
            break;
        if (rc < 0) {
            char msg[120];
            pcre2_get_error_message(rc, (PCRE2_UCHAR *)msg, sizeof msg);
            return exl_fail(EXL_ERR_ARG, "tokenizer regex failed on the input: %s", msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(w->md);
        size_t start = ov[0], end = ov[1];
        if (end <= start) { /* empty match: step over one character */
            if (start >= n)
                break;
            pos = start + (size_t)exl_utf8_len((unsigned char)s[start]);
            continue;
        }
        if (fn(ctx, start, end))
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        pos = end;
    }
    return EXL_OK;
}
