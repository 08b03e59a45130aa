/* jinja_lex.c - the Jinja lexer: template data, tags and expression tokens.
 *
 * Whitespace control follows Jinja with trim_blocks and lstrip_blocks on:
 *   {%- {{- {#-   strip all whitespace before the tag
 *   -%} -}} -#}   strip all whitespace after the tag
 *   %} #}         (trim_blocks) drop one newline right after a block or comment tag
 *   {% {#         (lstrip_blocks) drop spaces and tabs between a line start and the tag
 *   {%+ +%}       turn lstrip_blocks / trim_blocks off for that side of the tag
 * Inside a tag, end markers count only outside brackets, and strings may hold them. */
#include "jinja/jinja_ast.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/utf8.h"

#include <stdlib.h>
#include <string.h>

typedef struct lexer {
    const exl_jinja *t;
    const char *s;
    size_t n;
    exl_jtoks *toks;
} lexer;

void exl_jinja_linecol(const exl_jinja *t, size_t pos, int *line, int *col) {
    int l = 1, c = 1;
    for (size_t i = 0; i < pos && i < t->len; i++) {
        if (t->src[i] == '\n') {
            l++;
            c = 1;
        } else if (((unsigned char)t->src[i] & 0xC0) != 0x80) {
            c++;
        }
    }
    *line = l;
    *col = c;
}

static exl_status lex_fail(const lexer *lx, size_t pos, const char *msg) {
    int line, col;
    exl_jinja_linecol(lx->t, pos, &line, &col);
    return exl_fail(EXL_ERR_FORMAT, "%s:%d:%d: %s", lx->t->name, line, col, msg);
}

static exl_status push(lexer *lx, exl_jtok tok) {
    exl_jtoks *v = lx->toks;
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 256;
        exl_jtok *nv = exl_realloc(v->v, cap * sizeof *nv);
        if (!nv) {
            exl_free(tok.sval);
            return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", lx->t->name);
        }
        v->v = nv;
        v->cap = cap;
    }
    v->v[v->n++] = tok;
    return EXL_OK;
}

static exl_status push_simple(lexer *lx, exl_jtok_type type, size_t pos, size_t len) {
    exl_jtok tok = {.type = type, .pos = pos, .p = lx->s + pos, .len = len};
    return push(lx, tok);
}

void exl_jinja_toks_free(exl_jtoks *toks) {
    for (size_t i = 0; i < toks->n; i++)
        exl_free(toks->v[i].sval);
    exl_free(toks->v);
    toks->v = NULL;
    toks->n = toks->cap = 0;
}

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }
static int is_digit(char c) { return c >= '0' && c <= '9'; }
static int is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static int is_name_char(char c) { return is_name_start(c) || is_digit(c); }

/* ---------------------------------------------------------------- literals */

static int hex_val(char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* A quoted string at *pos with Python escapes (\n \t \xhh \uXXXX \UXXXXXXXX octal ...). */
static exl_status lex_string(lexer *lx, size_t *pos) {
    size_t start = *pos, i = start + 1;
    char q = lx->s[start];
    while (i < lx->n && lx->s[i] != q)
        i += lx->s[i] == '\\' ? 2 : 1;
    if (i >= lx->n)
        return lex_fail(lx, start, "unterminated string literal");
    /* Unescaped text is never longer than the escaped source. */
    char *buf = exl_malloc(i - start + 1);
    if (!buf)
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", lx->t->name);
    size_t o = 0;
    for (size_t j = start + 1; j < i; j++) {
        char c = lx->s[j];
        if (c != '\\') {
            buf[o++] = c;
            continue;
        }
        char e = lx->s[++j];
        const char *simple = strchr("\\'\"ntrabfv", e);
        if (simple && e) {
            static const char map[] = "\\'\"\n\t\r\a\b\f\v";
            buf[o++] = map[simple - "\\'\"ntrabfv"];
        } else if (e == '\n') {
            /* line continuation */
        } else if (e >= '0' && e <= '7') {
            uint32_t v = 0;
            int k = 0;
            while (k < 3 && j < i && lx->s[j] >= '0' && lx->s[j] <= '7')
                v = v * 8 + (uint32_t)(lx->s[j++] - '0'), k++;
            j--;
            o += (size_t)exl_utf8_encode((int32_t)v, buf + o);
        } else if (e == 'x' || e == 'u' || e == 'U') {
            int digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t v = 0;
            for (int k = 0; k < digits; k++) {
                int h = j + 1 < i ? hex_val(lx->s[j + 1]) : -1;
                if (h < 0) {
                    exl_free(buf);
                    return lex_fail(lx, j - 1, "truncated \\x, \\u or \\U escape in string");
                }
                v = v * 16 + (uint32_t)h;
                j++;
            }
            if (v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) {
                exl_free(buf);
                return lex_fail(lx, j, "escape is not a Unicode scalar value");
            }
            o += (size_t)exl_utf8_encode((int32_t)v, buf + o);
        } else {
            buf[o++] = '\\';
            buf[o++] = e;
        }
    }
    buf[o] = 0;
    exl_jtok tok = {
        .type = EXL_JTOK_STRING, .pos = start, .p = lx->s + start, .len = i + 1 - start, .sval = buf, .slen = o};
    *pos = i + 1;
    return push(lx, tok);
}

static exl_status lex_number(lexer *lx, size_t *pos) {
    size_t start = *pos, i = start;
    int is_float = 0;
    while (i < lx->n && (is_digit(lx->s[i]) || (lx->s[i] == '_' && i + 1 < lx->n && is_digit(lx->s[i + 1]))))
        i++;
    if (i + 1 < lx->n && lx->s[i] == '.' && is_digit(lx->s[i + 1])) {
        is_float = 1;
        i++;
        while (i < lx->n && (is_digit(lx->s[i]) || (lx->s[i] == '_' && i + 1 < lx->n && is_digit(lx->s[i + 1]))))
            i++;
    }
    if (i < lx->n && (lx->s[i] == 'e' || lx->s[i] == 'E')) {
        size_t j = i + 1;
        if (j < lx->n && (lx->s[j] == '+' || lx->s[j] == '-'))
            j++;
        if (j < lx->n && is_digit(lx->s[j])) {
            is_float = 1;
            i = j;
            while (i < lx->n && is_digit(lx->s[i]))
                i++;
        }
    }
    char buf[64];
    size_t o = 0;
    for (size_t j = start; j < i; j++)
        if (lx->s[j] != '_') {
            if (o + 1 >= sizeof buf)
                return lex_fail(lx, start, "number literal too long");
            buf[o++] = lx->s[j];
        }
    buf[o] = 0;
    exl_jtok tok = {.type = is_float ? EXL_JTOK_FLOAT : EXL_JTOK_INT,
                    .pos = start,
                    .p = lx->s + start,
                    .len = i - start};
    if (is_float) {
        tok.fval = strtod(buf, NULL);
    } else {
        char *end;
        unsigned long long v = strtoull(buf, &end, 10);
        if (v > INT64_MAX || o > 19)
            return lex_fail(lx, start, "integer literal too large");
        tok.ival = (int64_t)v;
    }
    *pos = i;
    return push(lx, tok);
}

/* ---------------------------------------------------------------- tags */

static const char *const OPS[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<",
                                  ">",  "=",  "(",  ")",  "[",  "]",  "{", "}", ",", ".", ":", "|"};

/* Tokens of one {{ }} or {% %} tag starting after its opening marker. On return *pos is
 * past the end marker, *strip_after says it was -}} / -%}, *keep_nl that it was +%}. */
static exl_status lex_tag(lexer *lx, size_t *pos, int is_block, int *strip_after, int *keep_nl) {
    size_t i = *pos;
    int depth = 0;
    char close = is_block ? '%' : '}';
    for (;;) {
        while (i < lx->n && is_space(lx->s[i]))
            i++;
        if (i >= lx->n)
            return lex_fail(lx, i,
                            is_block ? "unexpected end of template, expected '%}'"
                                     : "unexpected end of template, expected '}}'");
        const char *c = lx->s + i;
        size_t left = lx->n - i;
        if (depth == 0) {
            size_t m = 0;
            if ((c[0] == '-' || (is_block && c[0] == '+')) && left >= 3 && c[1] == close && c[2] == '}')
                m = 3;
            else if (left >= 2 && c[0] == close && c[1] == '}')
                m = 2;
            if (m) {
                *strip_after = c[0] == '-';
                *keep_nl = c[0] == '+';
                EXL_TRY(push_simple(lx, is_block ? EXL_JTOK_BLOCK_END : EXL_JTOK_VAR_END, i, m));
                *pos = i + m;
                return EXL_OK;
            }
        }
        if (is_name_start(c[0])) {
            size_t j = i;
            while (j < lx->n && is_name_char(lx->s[j]))
                j++;
            EXL_TRY(push_simple(lx, EXL_JTOK_NAME, i, j - i));
            i = j;
        } else if (is_digit(c[0])) {
            EXL_TRY(lex_number(lx, &i));
        } else if (c[0] == '\'' || c[0] == '"') {
            EXL_TRY(lex_string(lx, &i));
        } else {
            size_t k, m = 0;
            for (k = 0; k < sizeof OPS / sizeof OPS[0]; k++) {
                m = strlen(OPS[k]);
                if (m <= left && !memcmp(c, OPS[k], m))
                    break;
            }
            if (k == sizeof OPS / sizeof OPS[0])
                return lex_fail(lx, i, "unexpected character in expression");
            if (strchr("([{", c[0]))
                depth++;
            else if (strchr(")]}", c[0]) && depth > 0)
                depth--;
            EXL_TRY(push_simple(lx, EXL_JTOK_OP, i, m));
            i += m;
        }
    }
}

/* Is the block tag whose content starts at i `raw` (with optional markers)? Sets *end
 * past its %}. */
static int is_raw_tag(const lexer *lx, size_t i, const char *word, size_t *end, int *strip_after) {
    while (i < lx->n && is_space(lx->s[i]))
        i++;
    size_t wl = strlen(word);
    if (lx->n - i < wl || memcmp(lx->s + i, word, wl) || (i + wl < lx->n && is_name_char(lx->s[i + wl])))
        return 0;
    i += wl;
    while (i < lx->n && is_space(lx->s[i]))
        i++;
    *strip_after = 0;
    if (i < lx->n && (lx->s[i] == '-' || lx->s[i] == '+'))
        *strip_after = lx->s[i++] == '-';
    if (lx->n - i < 2 || lx->s[i] != '%' || lx->s[i + 1] != '}')
        return 0;
    *end = i + 2;
    return 1;
}

/* Text [start, end) of a raw block, ended by {% endraw %}: returns the tag's start. */
static exl_status find_endraw(lexer *lx, size_t from, size_t *tag, size_t *end, int *strip_after) {
    for (size_t i = from; i + 1 < lx->n; i++) {
        if (lx->s[i] != '{' || lx->s[i + 1] != '%')
            continue;
        size_t j = i + 2;
        if (j < lx->n && (lx->s[j] == '-' || lx->s[j] == '+'))
            j++;
        if (is_raw_tag(lx, j, "endraw", end, strip_after)) {
            *tag = i;
            return EXL_OK;
        }
    }
    return lex_fail(lx, from, "unexpected end of template, expected 'endraw'");
}

static size_t find_tag(const lexer *lx, size_t from) {
    for (size_t i = from; i + 1 < lx->n; i++)
        if (lx->s[i] == '{' && (lx->s[i + 1] == '{' || lx->s[i + 1] == '%' || lx->s[i + 1] == '#'))
            return i;
    return lx->n;
}

exl_status exl_jinja_lex(const exl_jinja *t, exl_jtoks *out) {
    lexer lx = {t, t->src, t->len, out};
    memset(out, 0, sizeof *out);
    size_t pos = 0;
    int strip_next = 0, trim_nl = 0;
    exl_status st = EXL_OK;
    while (st == EXL_OK && pos <= lx.n) {
        size_t tag = find_tag(&lx, pos);
        size_t a = pos, b = tag;
        if (strip_next)
            while (a < b && is_space(lx.s[a]))
                a++;
        else if (trim_nl && a < b && lx.s[a] == '\n')
            a++;
        int line_start = a == 0 || (a > pos && lx.s[a - 1] == '\n');
        char kind = tag < lx.n ? lx.s[tag + 1] : 0;
        char mark = tag + 2 < lx.n ? lx.s[tag + 2] : 0;
        if (kind && mark == '-') {
            while (b > a && is_space(lx.s[b - 1]))
                b--;
        } else if (kind && kind != '{' && mark != '+') {
            size_t l = b;
            while (l > a && lx.s[l - 1] != '\n')
                l--;
            int blank = l < b;
            for (size_t k = l; k < b; k++)
                blank &= is_space(lx.s[k]);
            if ((l > a || line_start) && blank)
                b = l;
        }
        if (b > a && (st = push_simple(&lx, EXL_JTOK_TEXT, a, b - a)))
            break;
        if (tag >= lx.n)
            break;
        size_t body = tag + 2 + (mark == '-' || mark == '+');
        int keep_nl = 0, raw_strip;
        size_t raw_end;
        if (kind == '#') {
            size_t e = body;
            while (e + 1 < lx.n && !(lx.s[e] == '#' && lx.s[e + 1] == '}'))
                e++;
            if (e + 1 >= lx.n) {
                st = lex_fail(&lx, tag, "unterminated comment, expected '#}'");
                break;
            }
            strip_next = e > body && lx.s[e - 1] == '-';
            keep_nl = e > body && lx.s[e - 1] == '+';
            pos = e + 2;
        } else if (kind == '%' && is_raw_tag(&lx, body, "raw", &raw_end, &raw_strip)) {
            size_t etag = 0, eend = 0;
            if ((st = find_endraw(&lx, raw_end, &etag, &eend, &strip_next)))
                break;
            size_t ra = raw_end, rb = etag;
            if (raw_strip)
                while (ra < rb && is_space(lx.s[ra]))
                    ra++;
            else if (ra < rb && lx.s[ra] == '\n')
                ra++;
            if (lx.s[etag + 2] == '-')
                while (rb > ra && is_space(lx.s[rb - 1]))
                    rb--;
            if (rb > ra)
                st = push_simple(&lx, EXL_JTOK_TEXT, ra, rb - ra);
            pos = eend;
        } else {
            int is_block = kind == '%';
            st = push_simple(&lx, is_block ? EXL_JTOK_BLOCK_BEGIN : EXL_JTOK_VAR_BEGIN, tag, body - tag);
            if (st == EXL_OK)
                st = lex_tag(&lx, &body, is_block, &strip_next, &keep_nl);
            if (!is_block)
                keep_nl = 1;
            pos = body;
        }
        trim_nl = !keep_nl;
    }
    if (st == EXL_OK)
        st = push_simple(&lx, EXL_JTOK_EOF, lx.n, 0);
    if (st != EXL_OK)
        exl_jinja_toks_free(out);
    return st;
}
