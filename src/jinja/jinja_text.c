/* jinja_text.c - UTF-8 strings seen as Python str: lengths and indexes in code points,
 * case mapping (utf8proc), whitespace and strip. Invalid bytes count as one character
 * each and are copied unchanged. */
#include "jinja/jinja_eval.h"

#include <string.h>
#include <utf8proc.h>

static size_t decode(const char *s, size_t n, int32_t *cp) {
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, cp);
    if (k <= 0) {
        *cp = -1;
        return 1;
    }
    return (size_t)k;
}

size_t exl_jtext_len(const char *s, size_t n) {
    size_t count = 0;
    for (size_t o = 0; o < n; count++) {
        int32_t cp;
        o += (unsigned char)s[o] < 0x80 ? 1 : decode(s + o, n - o, &cp);
    }
    return count;
}

size_t exl_jtext_offset(const char *s, size_t n, size_t i) {
    size_t o = 0;
    while (i-- > 0 && o < n) {
        int32_t cp;
        o += (unsigned char)s[o] < 0x80 ? 1 : decode(s + o, n - o, &cp);
    }
    return o < n ? o : n;
}

int exl_jtext_is_space(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}

static int is_cased(int32_t cp) {
    utf8proc_category_t cat = utf8proc_category(cp);
    return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

exl_status exl_jtext_case(const char *s, size_t n, exl_jcase mode, exl_str *out) {
    int at_start = 1, prev_cased = 0;
    for (size_t o = 0; o < n;) {
        int32_t cp;
        size_t k = decode(s + o, n - o, &cp);
        if (cp < 0) {
            if (exl_str_append(out, s + o, k))
                return EXL_ERR_NOMEM;
            o += k;
            at_start = 0;
            prev_cased = 0;
            continue;
        }
        int32_t m = cp;
        switch (mode) {
        case EXL_JCASE_UPPER: m = utf8proc_toupper(cp); break;
        case EXL_JCASE_LOWER: m = utf8proc_tolower(cp); break;
        case EXL_JCASE_CAPITALIZE: m = at_start ? utf8proc_totitle(cp) : utf8proc_tolower(cp); break;
        case EXL_JCASE_TITLE:
            m = prev_cased ? utf8proc_tolower(cp) : utf8proc_totitle(cp);
            prev_cased = is_cased(cp);
            break;
        case EXL_JCASE_WORDS:
            m = prev_cased ? utf8proc_tolower(cp) : utf8proc_toupper(cp);
            /* here prev_cased means "inside a word" */
            prev_cased = !(exl_jtext_is_space((uint32_t)cp) || (cp > 0 && cp < 0x80 && strchr("-({[<", cp)));
            break;
        }
        utf8proc_uint8_t buf[4];
        utf8proc_ssize_t len = utf8proc_encode_char(m, buf);
        if (exl_str_append(out, (const char *)buf, (size_t)len))
            return EXL_ERR_NOMEM;
        o += k;
        at_start = 0;
    }
    return EXL_OK;
}

static int in_set(int32_t cp, const char *chars, size_t nchars) {
    if (!chars)
        return cp >= 0 && exl_jtext_is_space((uint32_t)cp);
    for (size_t o = 0; o < nchars;) {
        int32_t c;
        o += decode(chars + o, nchars - o, &c);
        if (c == cp && c >= 0)
            return 1;
    }
    return 0;
}

void exl_jtext_strip(const char *s, size_t n, const char *chars, size_t nchars, int left, int right, size_t *start,
                     size_t *len) {
    size_t a = 0, b = n;
    while (left && a < b) {
        int32_t cp;
        size_t k = decode(s + a, b - a, &cp);
        if (!in_set(cp, chars, nchars))
            break;
        a += k;
    }
    while (right && b > a) {
        size_t p = b - 1;
        while (p > a && ((unsigned char)s[p] & 0xC0) == 0x80 && b - p < 4)
            p--;
        int32_t cp;
        size_t k = decode(s + p, b - p, &cp);
        if (p + k != b) {
            p = b - 1;
            cp = -1;
        }
        if (!in_set(cp, chars, nchars))
            break;
        b = p;
    }
    *start = a;
    *len = b - a;
}
