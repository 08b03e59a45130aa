/* gbnf.c - a recursive-descent parser for GBNF (see gbnf.h) that builds the byte grammar as it
 * reads: literals become byte elements, classes UTF-8 helper rules, groups and repetitions
 * helper rules. */
#include "constrain/gbnf.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/utf8.h"

#include <string.h>

typedef struct parser {
    const char *s;
    size_t n, i;
    exl_grammar *g;
    int depth;
    int32_t *lo, *hi; /* class ranges being read */
    int32_t n_rg, cap_rg;
} parser;

static int peek(const parser *p) { return p->i < p->n ? (unsigned char)p->s[p->i] : -1; }
static int peek_at(const parser *p, size_t k) { return p->i + k < p->n ? (unsigned char)p->s[p->i + k] : -1; }

/* A syntax error at the current position, with its line and column. */
static exl_status syntax(const parser *p, const char *what) {
    int line = 1, col = 1;
    for (size_t k = 0; k < p->i && k < p->n; k++) {
        if (p->s[k] == '\n')
            line++, col = 1;
        else
            col++;
    }
    return exl_fail(EXL_ERR_FORMAT, "grammar: line %d, column %d: %s", line, col, what);
}

static int is_word(int c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

/* Skip blanks and comments, and newlines too when newline_ok. */
static void skip_space(parser *p, int newline_ok) {
    for (;;) {
        int c = peek(p);
        if (c == ' ' || c == '\t' || (newline_ok && (c == '\n' || c == '\r'))) {
            p->i++;
        } else if (c == '#') {
            while (peek(p) >= 0 && peek(p) != '\n' && peek(p) != '\r')
                p->i++;
        } else {
            return;
        }
    }
}

static int hex_digit(int c) {
    return c >= '0' && c <= '9'   ? c - '0'
           : c >= 'a' && c <= 'f' ? c - 'a' + 10
           : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                  : -1;
}

/* One character of a literal or class (an escape or a UTF-8 sequence) as a code point. */
static exl_status read_char(parser *p, int32_t *cp) {
    int c = peek(p);
    if (c < 0)
        return syntax(p, "unexpected end of the grammar");
    if (c != '\\') {
        p->i += (size_t)exl_utf8_decode(p->s + p->i, cp);
        return EXL_OK;
    }
    int e = peek_at(p, 1);
    int digits = e == 'x' ? 2 : e == 'u' ? 4 : e == 'U' ? 8 : 0;
    if (digits) {
        int32_t v = 0;
        for (int k = 0; k < digits; k++) {
            int d = hex_digit(peek_at(p, 2 + (size_t)k));
            if (d < 0)
                return syntax(p, "bad hexadecimal escape");
            v = v * 16 + d;
            if (v > 0x10FFFF)
                return syntax(p, "escape beyond U+10FFFF");
        }
        if (v >= 0xD800 && v <= 0xDFFF)
            return syntax(p, "escape of a UTF-16 surrogate");
        p->i += 2 + (size_t)digits;
        *cp = v;
        return EXL_OK;
    }
    static const char from[] = "nrt\\\"[]-/", to[] = "\n\r\t\\\"[]-/";
    const char *hit = e > 0 ? strchr(from, e) : NULL;
    if (!hit)
        return syntax(p, "unknown escape");
    *cp = (unsigned char)to[hit - from];
    p->i += 2;
    return EXL_OK;
}

static exl_status literal(parser *p, int32_t r) {
    p->i++; /* the opening quote */
    while (peek(p) != '"') {
        if (peek(p) < 0 || peek(p) == '\n' || peek(p) == '\r')
            return syntax(p, "unterminated string");
        int32_t cp;
        char buf[4];
        EXL_TRY(read_char(p, &cp));
        EXL_TRY(exl_grammar_push_bytes(p->g, r, buf, (size_t)exl_utf8_encode(cp, buf)));
    }
    p->i++;
    return EXL_OK;
}

static exl_status add_range(parser *p, int32_t lo, int32_t hi) {
    if (p->n_rg == p->cap_rg) {
        int32_t cap = p->cap_rg ? 2 * p->cap_rg : 16;
        int32_t *a = exl_realloc(p->lo, (size_t)cap * sizeof *a);
        if (a)
            p->lo = a;
        int32_t *b = a ? exl_realloc(p->hi, (size_t)cap * sizeof *b) : NULL;
        if (!b)
            return exl_fail(EXL_ERR_NOMEM, "grammar: out of memory");
        p->hi = b;
        p->cap_rg = cap;
    }
    p->lo[p->n_rg] = lo;
    p->hi[p->n_rg++] = hi;
    return EXL_OK;
}

static exl_status char_class(parser *p, int32_t r) {
    p->i++; /* [ */
    int negated = peek(p) == '^';
    p->i += (size_t)negated;
    p->n_rg = 0;
    while (peek(p) != ']') {
        if (peek(p) < 0 || peek(p) == '\n' || peek(p) == '\r')
            return syntax(p, "unterminated character class");
        int32_t lo, hi;
        EXL_TRY(read_char(p, &lo));
        hi = lo;
        if (peek(p) == '-' && peek_at(p, 1) != ']' && peek_at(p, 1) >= 0) {
            p->i++;
            EXL_TRY(read_char(p, &hi));
            if (hi < lo)
                return syntax(p, "a character range whose end comes before its start");
        }
        EXL_TRY(add_range(p, lo, hi));
    }
    p->i++;
    return exl_grammar_push_class(p->g, r, p->lo, p->hi, p->n_rg, negated);
}

static exl_status read_count(parser *p, int32_t *v) {
    if (!(peek(p) >= '0' && peek(p) <= '9'))
        return syntax(p, "expected a number");
    int64_t x = 0;
    while (peek(p) >= '0' && peek(p) <= '9') {
        x = x * 10 + (peek(p) - '0');
        if (x > EXL_GBNF_MAX_REPEAT)
            return syntax(p, "repetition count too large (at most 10000)");
        p->i++;
    }
    *v = (int32_t)x;
    return EXL_OK;
}

/* {m}, {m,}, {m,n} after the item that starts at element `from`. */
static exl_status braces(parser *p, int32_t r, int32_t from) {
    int32_t min, max;
    p->i++;
    skip_space(p, 0);
    EXL_TRY(read_count(p, &min));
    skip_space(p, 0);
    max = min;
    if (peek(p) == ',') {
        p->i++;
        skip_space(p, 0);
        max = -1;
        if (peek(p) != '}')
            EXL_TRY(read_count(p, &max));
        skip_space(p, 0);
    }
    if (peek(p) != '}')
        return syntax(p, "expected '}'");
    p->i++;
    if (max >= 0 && max < min)
        return syntax(p, "a repetition whose maximum is below its minimum");
    return exl_grammar_repeat(p->g, r, from, min, max);
}

static exl_status alternatives(parser *p, int32_t r, int nested);

/* Items until something that cannot continue a sequence. */
static exl_status sequence(parser *p, int32_t r, int nested) {
    int32_t last = -1; /* where the last item's elements start */
    for (;;) {
        int c = peek(p);
        int32_t start = p->g->rules[r].n;
        if (c == '"') {
            EXL_TRY(literal(p, r));
        } else if (c == '[') {
            EXL_TRY(char_class(p, r));
        } else if (c == '.') {
            p->i++;
            int32_t lo = 0, hi = 0x10FFFF;
            EXL_TRY(exl_grammar_push_class(p->g, r, &lo, &hi, 1, 0));
        } else if (is_word(c)) {
            size_t at = p->i;
            while (is_word(peek(p)))
                p->i++;
            int32_t ref = exl_grammar_named(p->g, p->s + at, p->i - at);
            if (ref < 0)
                return EXL_ERR_NOMEM;
            EXL_TRY(exl_grammar_push(p->g, r, EXL_G_RULE, ref));
        } else if (c == '(') {
            if (++p->depth > EXL_GBNF_MAX_DEPTH)
                return syntax(p, "groups nested too deeply");
            p->i++;
            int32_t sub = exl_grammar_helper(p->g, p->g->rules[r].name);
            if (sub < 0)
                return EXL_ERR_NOMEM;
            skip_space(p, 1);
            EXL_TRY(alternatives(p, sub, 1));
            if (peek(p) != ')')
                return syntax(p, "expected ')'");
            p->i++;
            p->depth--;
            EXL_TRY(exl_grammar_push(p->g, r, EXL_G_RULE, sub));
        } else if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (last < 0)
                return syntax(p, "a repetition operator with nothing before it");
            if (c == '{') {
                EXL_TRY(braces(p, r, last));
            } else {
                p->i++;
                EXL_TRY(exl_grammar_repeat(p->g, r, last, c == '+', c == '?' ? 1 : -1));
            }
            last = -1; /* x** is an error, as in llama.cpp */
            skip_space(p, nested);
            continue;
        } else {
            return EXL_OK;
        }
        last = start;
        skip_space(p, nested);
    }
}

static exl_status alternatives(parser *p, int32_t r, int nested) {
    EXL_TRY(sequence(p, r, nested));
    while (peek(p) == '|') {
        p->i++;
        EXL_TRY(exl_grammar_push(p->g, r, EXL_G_ALT, 0));
        skip_space(p, 1);
        EXL_TRY(sequence(p, r, nested));
    }
    return EXL_OK;
}

static exl_status rules(parser *p) {
    skip_space(p, 1);
    while (peek(p) >= 0) {
        size_t at = p->i;
        while (is_word(peek(p)))
            p->i++;
        if (p->i == at)
            return syntax(p, "expected a rule name");
        int32_t r = exl_grammar_named(p->g, p->s + at, p->i - at);
        if (r < 0)
            return EXL_ERR_NOMEM;
        if (p->g->rules[r].defined)
            return exl_fail(EXL_ERR_FORMAT, "grammar: rule '%s' is defined twice", p->g->rules[r].name);
        p->g->rules[r].defined = 1;
        skip_space(p, 0);
        if (p->i + 3 > p->n || memcmp(p->s + p->i, "::=", 3))
            return syntax(p, "expected '::='");
        p->i += 3;
        skip_space(p, 1);
        EXL_TRY(alternatives(p, r, 0));
        int c = peek(p);
        if (c >= 0 && c != '\n' && c != '\r')
            return syntax(p, "expected the end of the rule (a newline)");
        skip_space(p, 1);
    }
    return EXL_OK;
}

exl_status exl_gbnf_parse(const char *src, size_t len, exl_grammar *g) {
    if (!exl_utf8_valid(src, len))
        return exl_fail(EXL_ERR_FORMAT, "grammar: not valid UTF-8");
    if (memchr(src, 0, len))
        return exl_fail(EXL_ERR_FORMAT, "grammar: contains a NUL byte");
    parser p = {.s = src, .n = len, .g = g};
    exl_status st = rules(&p);
    exl_free(p.lo);
    exl_free(p.hi);
    return st == EXL_OK ? exl_grammar_finish(g, "root") : st;
}
