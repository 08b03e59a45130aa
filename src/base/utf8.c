/* utf8.c - UTF-8 helpers (see utf8.h): validation, decoding, lossy repair (Rust's
 * from_utf8_lossy rules) and the White_Space property. */
#include "base/utf8.h"

int exl_utf8_len(unsigned char c) {
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF)
        return 2;
    if (c >= 0xE0 && c <= 0xEF)
        return 3;
    if (c >= 0xF0 && c <= 0xF4)
        return 4;
    return 1;
}

int exl_utf8_decode(const char *s, int32_t *cp) {
    const unsigned char *u = (const unsigned char *)s;
    int n = exl_utf8_len(u[0]);
    switch (n) {
    case 2: *cp = ((u[0] & 0x1F) << 6) | (u[1] & 0x3F); break;
    case 3: *cp = ((u[0] & 0x0F) << 12) | ((u[1] & 0x3F) << 6) | (u[2] & 0x3F); break;
    case 4: *cp = ((u[0] & 0x07) << 18) | ((u[1] & 0x3F) << 12) | ((u[2] & 0x3F) << 6) | (u[3] & 0x3F); break;
    default: *cp = u[0]; break;
    }
    return n;
}

int exl_utf8_encode(int32_t cp, char *out) {
    unsigned char *o = (unsigned char *)out;
    if (cp < 0x80) {
        o[0] = (unsigned char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (unsigned char)(0xC0 | (cp >> 6));
        o[1] = (unsigned char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | (cp >> 12));
        o[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (unsigned char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | (cp >> 18));
    o[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (unsigned char)(0x80 | (cp & 0x3F));
    return 4;
}

/* How many bytes of s[0..n) continue a valid sequence led by s[0]; *need is the full
 * length the lead byte asks for (1 for an invalid lead). */
static size_t valid_run(const unsigned char *s, size_t n, int *need) {
    unsigned char c = s[0];
    *need = exl_utf8_len(c);
    if (*need == 1)
        return 1;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c == 0xE0)
        lo = 0xA0;
    else if (c == 0xED)
        hi = 0x9F;
    else if (c == 0xF0)
        lo = 0x90;
    else if (c == 0xF4)
        hi = 0x8F;
    size_t i = 1;
    if (i < n && s[i] >= lo && s[i] <= hi) {
        i++;
        while (i < (size_t)*need && i < n && s[i] >= 0x80 && s[i] <= 0xBF)
            i++;
    }
    return i;
}

int exl_utf8_valid(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        int need;
        size_t run = valid_run(u + i, n - i, &need);
        if (need == 1 || run != (size_t)need)
            return 0;
        i += run;
    }
    return 1;
}

size_t exl_utf8_complete_prefix(const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    /* Only the last 3 bytes can start an unfinished character. */
    size_t from = n > 3 ? n - 3 : 0;
    for (size_t i = from; i < n; i++) {
        if (u[i] < 0x80 || (u[i] & 0xC0) == 0x80)
            continue;
        int need;
        size_t run = valid_run(u + i, n - i, &need);
        if (need > 1 && run == n - i && run < (size_t)need)
            return i;
    }
    return n;
}

size_t exl_utf8_prev(const char *s, size_t end) {
    size_t i = end - 1;
    while (i > 0 && ((unsigned char)s[i] & 0xC0) == 0x80)
        i--;
    return i;
}

int exl_utf8_append_lossy(exl_str *out, const char *s, size_t n) {
    const unsigned char *u = (const unsigned char *)s;
    size_t i = 0, start = 0;
    while (i < n) {
        if (u[i] < 0x80) {
            i++;
            continue;
        }
        int need;
        size_t run = valid_run(u + i, n - i, &need);
        if (need > 1 && run == (size_t)need) {
            i += run;
            continue;
        }
        if (exl_str_append(out, s + start, i - start) || exl_str_append(out, "\xEF\xBF\xBD", 3))
            return -1;
        i += run;
        start = i;
    }
    return exl_str_append(out, s + start, n - start);
}

int exl_unicode_is_space(int32_t cp) {
    return (cp >= 9 && cp <= 13) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
           cp == 0x3000;
}
