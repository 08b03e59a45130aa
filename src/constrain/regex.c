/* regex.c - regular expressions translated to GBNF (see regex.h) by a recursive-descent parser
 * that writes each construct in GBNF's spelling as it reads it. */
#include "constrain/regex.h"

#include "base/error.h"
#include "base/utf8.h"

#include <stdio.h>
#include <string.h>

#define MAX_DEPTH 200
#define MAX_REPEAT 10000

typedef struct rx {
    const char *s;
    size_t n, i;
    exl_str *out;
    int depth;
    int fail; /* out of memory */
} rx;

static int peek(const rx *r) { return r->i < r->n ? (unsigned char)r->s[r->i] : -1; }

static exl_status bad(const rx *r, const char *what) {
    return exl_fail(EXL_ERR_UNSUPPORTED, "regex: %s at offset %zu", what, r->i);
}

static void put(rx *r, const char *s) { r->fail |= exl_str_puts(r->out, s); }

/* A code point inside a GBNF string or class, escaped where it must be. */
static void put_cp(rx *r, int32_t cp, int in_class) {
    char buf[16];
    if (cp == '"' || cp == '\\' || (in_class && (cp == ']' || cp == '-' || cp == '^' || cp == '['))) {
        buf[0] = '\\';
        buf[1] = (char)cp;
        buf[2] = 0;
    } else if (cp < 0x20 || cp == 0x7F) {
        snprintf(buf, sizeof buf, "\\x%02X", (unsigned)cp);
    } else {
        buf[exl_utf8_encode(cp, buf)] = 0;
    }
    put(r, buf);
}

static void put_range(rx *r, int32_t lo, int32_t hi) {
    put_cp(r, lo, 1);
    if (hi != lo) {
        put(r, "-");
        put_cp(r, hi, 1);
    }
}

static int hexval(int c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* The ranges of a class shorthand (d, w, s), written into a class being built. */
static void put_shorthand(rx *r, int c) {
    if (c == 'd')
        put(r, "0-9");
    else if (c == 'w')
        put(r, "0-9A-Za-z_");
    else
        put(r, " \\t\\n\\r\\x0C\\x0B");
}

/* After a backslash: a single code point escape; -1 in *cp when it is a shorthand class (its
 * letter in *cls), error for what is not supported. */
static exl_status escape(rx *r, int32_t *cp, int *cls) {
    int c = peek(r);
    *cls = 0;
    if (c < 0)
        return bad(r, "a trailing backslash");
    r->i++;
    switch (c) {
    case 'd':
    case 'D':
    case 'w':
    case 'W':
    case 's':
    case 'S':
        *cls = c;
        *cp = -1;
        return EXL_OK;
    case 'n': *cp = '\n'; return EXL_OK;
    case 'r': *cp = '\r'; return EXL_OK;
    case 't': *cp = '\t'; return EXL_OK;
    case 'f': *cp = '\f'; return EXL_OK;
    case 'v': *cp = '\v'; return EXL_OK;
    case '0': *cp = 0; return EXL_OK;
    case 'x':
    case 'u': {
        int digits = c == 'x' ? 2 : 4;
        int32_t v = 0;
        for (int k = 0; k < digits; k++) {
            int d = hexval(peek(r));
            if (d < 0)
                return bad(r, "a bad hexadecimal escape");
            v = v * 16 + d;
            r->i++;
        }
        if (v >= 0xD800 && v <= 0xDFFF)
            return bad(r, "an escaped UTF-16 surrogate");
        *cp = v;
        return EXL_OK;
    }
    case 'b':
    case 'B': return bad(r, "word boundaries (\\b, \\B) are not supported");
    default:
        if ((c >= '1' && c <= '9') || c == 'k')
            return bad(r, "backreferences are not supported");
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
            return bad(r, "an unknown escape");
        r->i--;
        r->i += (size_t)exl_utf8_decode(r->s + r->i, cp); /* escaped punctuation: itself */
        return EXL_OK;
    }
}

static exl_status char_class(rx *r) {
    r->i++; /* [ */
    put(r, "[");
    if (peek(r) == '^') {
        r->i++;
        put(r, "^");
    }
    int first = 1;
    while (peek(r) != ']' || first) {
        int c = peek(r);
        if (c < 0)
            return bad(r, "an unterminated class");
        first = 0;
        int32_t lo, hi;
        int cls = 0;
        if (c == '\\') {
            r->i++;
            EXL_TRY(escape(r, &lo, &cls));
        } else if (c == '[' && r->i + 1 < r->n && r->s[r->i + 1] == ':') {
            return bad(r, "POSIX classes ([:alpha:]) are not supported");
        } else {
            r->i += (size_t)exl_utf8_decode(r->s + r->i, &lo);
        }
        if (cls) {
            if (cls == 'D' || cls == 'W' || cls == 'S')
                return bad(r, "a negated shorthand (\\D, \\W, \\S) inside a class is not supported");
            put_shorthand(r, cls);
            continue;
        }
        hi = lo;
        if (peek(r) == '-' && r->i + 1 < r->n && r->s[r->i + 1] != ']') {
            r->i++;
            if (peek(r) == '\\') {
                r->i++;
                EXL_TRY(escape(r, &hi, &cls));
                if (cls)
                    return bad(r, "a class shorthand as the end of a range");
            } else {
                r->i += (size_t)exl_utf8_decode(r->s + r->i, &hi);
            }
            if (hi < lo)
                return bad(r, "a range whose end comes before its start");
        }
        put_range(r, lo, hi);
    }
    r->i++;
    put(r, "]");
    return EXL_OK;
}

/* A quantifier after an atom, if one follows. */
static exl_status quantifier(rx *r) {
    int c = peek(r);
    if (c == '*' || c == '+' || c == '?') {
        char q[2] = {(char)c, 0};
        r->i++;
        put(r, q);
    } else if (c == '{') {
        size_t at = r->i++;
        long m = -1, n = -1;
        int comma = 0;
        while (peek(r) >= '0' && peek(r) <= '9' && m < MAX_REPEAT + 1)
            m = (m < 0 ? 0 : m * 10) + (peek(r) - '0'), r->i++;
        if (peek(r) == ',') {
            comma = 1;
            r->i++;
            while (peek(r) >= '0' && peek(r) <= '9' && n < MAX_REPEAT + 1)
                n = (n < 0 ? 0 : n * 10) + (peek(r) - '0'), r->i++;
        }
        if (peek(r) != '}' || m < 0) { /* not a quantifier: a literal brace */
            r->i = at;
            return EXL_OK;
        }
        r->i++;
        if (m > MAX_REPEAT || n > MAX_REPEAT)
            return bad(r, "a repetition count above 10000");
        if (comma && n >= 0 && n < m)
            return bad(r, "a repetition whose maximum is below its minimum");
        char buf[48];
        if (!comma)
            snprintf(buf, sizeof buf, "{%ld}", m);
        else if (n < 0)
            snprintf(buf, sizeof buf, "{%ld,}", m);
        else
            snprintf(buf, sizeof buf, "{%ld,%ld}", m, n);
        put(r, buf);
    } else {
        return EXL_OK;
    }
    if (peek(r) == '?' || peek(r) == '+') /* lazy / possessive: the same strings */
        r->i++;
    c = peek(r);
    if (c == '*' || c == '+' || c == '?' || c == '{')
        return bad(r, "a quantifier after a quantifier");
    return EXL_OK;
}

static exl_status alternation(rx *r);

static exl_status group(rx *r) {
    r->i++; /* ( */
    if (peek(r) == '?') {
        const char *rest = r->s + r->i + 1;
        size_t left = r->n - r->i - 1;
        if (left >= 1 && rest[0] == ':') {
            r->i += 2;
        } else if ((left >= 2 && rest[0] == '<' && rest[1] != '=' && rest[1] != '!') ||
                   (left >= 2 && rest[0] == 'P' && rest[1] == '<')) {
            const char *close = memchr(rest, '>', left);
            if (!close)
                return bad(r, "an unterminated group name");
            r->i = (size_t)(close - r->s) + 1;
        } else if (left >= 1 && (rest[0] == '=' || rest[0] == '!' || rest[0] == '<')) {
            return bad(r, "lookaround is not supported");
        } else {
            return bad(r, "inline flags and other (?...) groups are not supported");
        }
    }
    if (++r->depth > MAX_DEPTH)
        return bad(r, "groups nested too deeply");
    put(r, "(");
    EXL_TRY(alternation(r));
    if (peek(r) != ')')
        return bad(r, "a missing ')'");
    r->i++;
    r->depth--;
    put(r, ")");
    return EXL_OK;
}

static exl_status sequence(rx *r) {
    int any = 0;
    for (;;) {
        int c = peek(r);
        if (c < 0 || c == '|' || c == ')')
            break;
        if (any)
            put(r, " ");
        any = 1;
        if (c == '(') {
            EXL_TRY(group(r));
        } else if (c == '[') {
            EXL_TRY(char_class(r));
        } else if (c == '.') {
            r->i++;
            put(r, "[^\\n]");
        } else if (c == '^' || c == '$') {
            if ((c == '^' && r->i != 0) || (c == '$' && r->i + 1 != r->n))
                return bad(r, "anchors (^, $) are supported only at the start and the end");
            r->i++;
            put(r, "\"\"");
        } else if (c == '*' || c == '+' || c == '?') {
            return bad(r, "a quantifier with nothing before it");
        } else {
            int32_t cp;
            int cls = 0;
            if (c == '\\') {
                r->i++;
                EXL_TRY(escape(r, &cp, &cls));
            } else {
                r->i += (size_t)exl_utf8_decode(r->s + r->i, &cp);
            }
            if (cls) {
                put(r, cls == 'd' || cls == 'w' || cls == 's' ? "[" : "[^");
                put_shorthand(r, cls | 0x20);
                put(r, "]");
            } else {
                put(r, "\"");
                put_cp(r, cp, 0);
                put(r, "\"");
            }
        }
        EXL_TRY(quantifier(r));
    }
    if (!any)
        put(r, "\"\"");
    return EXL_OK;
}

static exl_status alternation(rx *r) {
    EXL_TRY(sequence(r));
    while (peek(r) == '|') {
        r->i++;
        put(r, " | ");
        EXL_TRY(sequence(r));
    }
    return EXL_OK;
}

exl_status exl_regex_to_gbnf(const char *re, size_t len, exl_str *out) {
    if (!exl_utf8_valid(re, len))
        return exl_fail(EXL_ERR_FORMAT, "regex: not valid UTF-8");
    rx r = {.s = re, .n = len, .out = out};
    put(&r, "root ::= ");
    exl_status st = alternation(&r);
    if (st == EXL_OK && peek(&r) == ')')
        st = bad(&r, "an unmatched ')'");
    put(&r, "\n");
    return st == EXL_OK && r.fail ? exl_fail(EXL_ERR_NOMEM, "regex: out of memory") : st;
}
