/* jinja_parse.c - recursive-descent parser from tokens to a syntax tree, with Jinja's
 * operator precedence (loosest first):
 *   x if c else y  <  or  <  and  <  not  <  comparisons, in, not in  <  + -  <  ~
 *   <  * / // %  <  **  <  unary - +  <  filters |f, tests `is`  <  . [] ()
 * Nesting of blocks and expressions is bounded (EXL_JINJA_MAX_DEPTH). */
#include "jinja/jinja_ast.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef struct parser {
    exl_jinja *t;
    exl_jtoks tk;
    size_t i;
    int depth;
    int loops; /* enclosing for loops (break/continue are legal) */
    exl_status st;
} parser;

/* ---------------------------------------------------------------- tokens */

static exl_jtok *cur(parser *p) { return &p->tk.v[p->i]; }
static exl_jtok *peek(parser *p) { return &p->tk.v[p->i + (p->i + 1 < p->tk.n)]; }
static void next(parser *p) {
    if (p->i + 1 < p->tk.n)
        p->i++;
}

static int tok_is(const exl_jtok *t, exl_jtok_type type, const char *s) {
    return t->type == type && t->len == strlen(s) && !memcmp(t->p, s, t->len);
}
static int is_op(parser *p, const char *op) { return tok_is(cur(p), EXL_JTOK_OP, op); }
static int is_kw(parser *p, const char *kw) { return tok_is(cur(p), EXL_JTOK_NAME, kw); }
static int accept_op(parser *p, const char *op) {
    if (!is_op(p, op))
        return 0;
    next(p);
    return 1;
}
static int accept_kw(parser *p, const char *kw) {
    if (!is_kw(p, kw))
        return 0;
    next(p);
    return 1;
}

static void describe(const exl_jtok *t, char *buf, size_t n) {
    switch (t->type) {
    case EXL_JTOK_TEXT: snprintf(buf, n, "template text"); break;
    case EXL_JTOK_VAR_BEGIN: snprintf(buf, n, "'{{'"); break;
    case EXL_JTOK_VAR_END: snprintf(buf, n, "'}}'"); break;
    case EXL_JTOK_BLOCK_BEGIN: snprintf(buf, n, "'{%%'"); break;
    case EXL_JTOK_BLOCK_END: snprintf(buf, n, "'%%}'"); break;
    case EXL_JTOK_STRING: snprintf(buf, n, "a string"); break;
    case EXL_JTOK_INT:
    case EXL_JTOK_FLOAT: snprintf(buf, n, "a number"); break;
    case EXL_JTOK_EOF: snprintf(buf, n, "end of template"); break;
    default: snprintf(buf, n, "'%.*s'", (int)(t->len > 32 ? 32 : t->len), t->p); break;
    }
}

/* Record "name:line:col: <what>" for the current token (first error wins). */
static void *fail_at(parser *p, size_t pos, exl_status st, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void *fail_at(parser *p, size_t pos, exl_status st, const char *fmt, ...) {
    if (p->st)
        return NULL;
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line, col;
    exl_jinja_linecol(p->t, pos, &line, &col);
    p->st = exl_fail(st, "%s:%d:%d: %s", p->t->name, line, col, msg);
    return NULL;
}

static void *expected(parser *p, const char *what) {
    char got[64];
    describe(cur(p), got, sizeof got);
    return fail_at(p, cur(p)->pos, EXL_ERR_FORMAT, "expected %s, got %s", what, got);
}

static void *nomem(parser *p) {
    if (!p->st)
        p->st = exl_fail(EXL_ERR_NOMEM, "%s: out of memory", p->t->name);
    return NULL;
}

static int expect_op(parser *p, const char *op) {
    if (accept_op(p, op))
        return 1;
    char what[16];
    snprintf(what, sizeof what, "'%s'", op);
    expected(p, what);
    return 0;
}

static int expect_end(parser *p) {
    if (cur(p)->type == EXL_JTOK_BLOCK_END) {
        next(p);
        return 1;
    }
    expected(p, "'%}'");
    return 0;
}

static int enter(parser *p) {
    if (++p->depth > EXL_JINJA_MAX_DEPTH) {
        fail_at(p, cur(p)->pos, EXL_ERR_FORMAT, "nesting deeper than %d levels", EXL_JINJA_MAX_DEPTH);
        return 0;
    }
    return 1;
}

/* ---------------------------------------------------------------- nodes */

void exl_jnode_free(exl_jnode *n) {
    if (!n)
        return;
    for (size_t i = 0; i < n->n_kids; i++) {
        exl_jnode_free(n->kids[i]);
        if (n->kw)
            exl_free(n->kw[i]);
    }
    exl_jv_free_immortal(n->lit);
    exl_free(n->kids);
    exl_free(n->kw);
    exl_free(n->ops);
    exl_free(n->name);
    exl_free(n);
}

static exl_jnode *node(parser *p, exl_jnode_kind kind, size_t pos) {
    exl_jnode *n = exl_calloc(1, sizeof *n);
    if (!n)
        return nomem(p);
    n->kind = kind;
    n->pos = pos;
    n->lit = exl_jv_none();
    return n;
}

/* Append kid (may be NULL for an absent optional part) with an optional keyword name;
 * on failure kid is freed. Returns 0 on success, -1 if this or an earlier step failed. */
static int add_kw(parser *p, exl_jnode *n, exl_jnode *kid, const char *kw, size_t kwlen) {
    char *name = NULL;
    if (kw && !(name = exl_strndup(kw, kwlen)))
        goto fail;
    exl_jnode **kids = exl_realloc(n->kids, (n->n_kids + 1) * sizeof *kids);
    if (!kids)
        goto fail;
    n->kids = kids;
    if (name || n->kw) {
        char **kws = exl_realloc(n->kw, (n->n_kids + 1) * sizeof *kws);
        if (!kws)
            goto fail;
        if (!n->kw)
            memset(kws, 0, n->n_kids * sizeof *kws);
        n->kw = kws;
        kws[n->n_kids] = name;
    }
    n->kids[n->n_kids++] = kid;
    return p->st ? -1 : 0;
fail:
    exl_free(name);
    exl_jnode_free(kid);
    nomem(p);
    return -1;
}

static int add(parser *p, exl_jnode *n, exl_jnode *kid) { return add_kw(p, n, kid, NULL, 0); }

/* A node with up to three kids; NULL (and everything freed) if any required kid is
 * missing, i.e. its parse failed. */
static exl_jnode *node3(parser *p, exl_jnode_kind kind, size_t pos, exl_jnode *a, exl_jnode *b, exl_jnode *c,
                        int nreq) {
    exl_jnode *kid[3] = {a, b, c};
    exl_jnode *n = p->st ? NULL : node(p, kind, pos);
    int ok = n != NULL;
    for (int i = 0; i < 3; i++) {
        if (i < nreq && !kid[i])
            ok = 0;
    }
    if (!ok) {
        for (int i = 0; i < 3; i++)
            exl_jnode_free(kid[i]);
        exl_jnode_free(n);
        return NULL;
    }
    int nk = nreq > 0 ? nreq : 0;
    for (int i = 0; i < 3; i++)
        if (kid[i] || i < nk)
            nk = i + 1;
    for (int i = 0; i < nk; i++) {
        if (add(p, n, kid[i])) {
            for (int j = i + 1; j < 3; j++)
                exl_jnode_free(kid[j]);
            exl_jnode_free(n);
            return NULL;
        }
    }
    return n;
}

static int set_name(parser *p, exl_jnode *n, const char *s, size_t len) {
    n->name = exl_strndup(s, len);
    if (!n->name) {
        nomem(p);
        return -1;
    }
    return 0;
}

static exl_jnode *lit(parser *p, size_t pos, exl_jv v) {
    exl_jnode *n = node(p, EXL_JN_LIT, pos);
    if (!n) {
        exl_jv_free(v);
        return NULL;
    }
    exl_jv_make_immortal(v);
    n->lit = v;
    return n;
}

/* ---------------------------------------------------------------- expressions */

static exl_jnode *parse_expression(parser *p, int with_cond);
static exl_jnode *parse_unary(parser *p, int with_filter);

static exl_jnode *parse_seq(parser *p, exl_jnode *n, const char *close) {
    while (!p->st && !is_op(p, close)) {
        if (n->n_kids && !expect_op(p, ","))
            break;
        if (is_op(p, close))
            break;
        if (add(p, n, parse_expression(p, 1)))
            break;
    }
    if (p->st || !expect_op(p, close)) {
        exl_jnode_free(n);
        return NULL;
    }
    return n;
}

static exl_jnode *parse_dict(parser *p, size_t pos) {
    exl_jnode *n = node(p, EXL_JN_DICT, pos);
    while (n && !p->st && !is_op(p, "}")) {
        if (n->n_kids && !expect_op(p, ","))
            break;
        if (is_op(p, "}"))
            break;
        if (add(p, n, parse_expression(p, 1)) || !expect_op(p, ":") || add(p, n, parse_expression(p, 1)))
            break;
    }
    if (p->st || !expect_op(p, "}")) {
        exl_jnode_free(n);
        return NULL;
    }
    return n;
}

static exl_jnode *parse_primary(parser *p) {
    exl_jtok *t = cur(p);
    size_t pos = t->pos;
    switch (t->type) {
    case EXL_JTOK_NAME:
        next(p);
        if (tok_is(t, EXL_JTOK_NAME, "true") || tok_is(t, EXL_JTOK_NAME, "True"))
            return lit(p, pos, exl_jv_bool(1));
        if (tok_is(t, EXL_JTOK_NAME, "false") || tok_is(t, EXL_JTOK_NAME, "False"))
            return lit(p, pos, exl_jv_bool(0));
        if (tok_is(t, EXL_JTOK_NAME, "none") || tok_is(t, EXL_JTOK_NAME, "None"))
            return lit(p, pos, exl_jv_none());
        exl_jnode *n = node(p, EXL_JN_NAME, pos);
        if (n && set_name(p, n, t->p, t->len)) {
            exl_jnode_free(n);
            return NULL;
        }
        return n;
    case EXL_JTOK_STRING: {
        /* Adjacent literals concatenate: "a" "b" is "ab". */
        exl_str s = EXL_STR_INIT;
        int err = exl_str_append(&s, "", 0);
        while (!err && cur(p)->type == EXL_JTOK_STRING) {
            err = exl_str_append(&s, cur(p)->sval, cur(p)->slen);
            next(p);
        }
        exl_jv v;
        if (err || exl_jv_str_take(&s, &v)) {
            exl_str_free(&s);
            return nomem(p);
        }
        return lit(p, pos, v);
    }
    case EXL_JTOK_INT: next(p); return lit(p, pos, exl_jv_int(t->ival));
    case EXL_JTOK_FLOAT: next(p); return lit(p, pos, exl_jv_float(t->fval));
    case EXL_JTOK_OP:
        if (accept_op(p, "(")) {
            if (accept_op(p, ")"))
                return node(p, EXL_JN_TUPLE, pos);
            exl_jnode *e = parse_expression(p, 1);
            if (!e)
                return NULL;
            if (!is_op(p, ",")) {
                if (!expect_op(p, ")")) {
                    exl_jnode_free(e);
                    return NULL;
                }
                return e;
            }
            exl_jnode *tuple = node(p, EXL_JN_TUPLE, pos);
            if (!tuple || add(p, tuple, e)) {
                if (!tuple)
                    exl_jnode_free(e);
                exl_jnode_free(tuple);
                return NULL;
            }
            return parse_seq(p, tuple, ")");
        }
        if (accept_op(p, "[")) {
            exl_jnode *list = node(p, EXL_JN_LIST, pos);
            return list ? parse_seq(p, list, "]") : NULL;
        }
        if (accept_op(p, "{"))
            return parse_dict(p, pos);
        break;
    default: break;
    }
    return expected(p, "an expression");
}

/* Arguments of a call, filter or test up to ')': positional, then name=value. */
static int parse_args(parser *p, exl_jnode *n) {
    size_t first = n->n_kids;
    while (!p->st && !is_op(p, ")")) {
        if (n->n_kids > first && !expect_op(p, ","))
            return -1;
        if (is_op(p, ")"))
            break;
        exl_jtok *t = cur(p);
        if (t->type == EXL_JTOK_NAME && tok_is(peek(p), EXL_JTOK_OP, "=")) {
            next(p);
            next(p);
            if (add_kw(p, n, parse_expression(p, 1), t->p, t->len))
                return -1;
        } else if (add(p, n, parse_expression(p, 1))) {
            return -1;
        }
    }
    return p->st || !expect_op(p, ")") ? -1 : 0;
}

static exl_jnode *parse_subscript(parser *p, exl_jnode *obj, size_t pos) {
    exl_jnode *start = NULL, *stop = NULL, *step = NULL;
    if (!is_op(p, ":")) {
        start = parse_expression(p, 1);
        if (!start) {
            exl_jnode_free(obj);
            return NULL;
        }
        if (accept_op(p, "]")) {
            exl_jnode *n = node3(p, EXL_JN_ITEM, pos, obj, start, NULL, 2);
            return n;
        }
    }
    if (!expect_op(p, ":"))
        goto fail;
    if (!is_op(p, ":") && !is_op(p, "]") && !(stop = parse_expression(p, 1)))
        goto fail;
    if (accept_op(p, ":") && !is_op(p, "]") && !(step = parse_expression(p, 1)))
        goto fail;
    if (!expect_op(p, "]"))
        goto fail;
    exl_jnode *n = node(p, EXL_JN_SLICE, pos);
    if (n && !add(p, n, obj)) {
        obj = NULL;
        int e = add(p, n, start);
        start = NULL;
        e = e || add(p, n, stop);
        stop = NULL;
        e = e || add(p, n, step);
        step = NULL;
        if (!e)
            return n;
    }
    exl_jnode_free(n);
fail:
    exl_jnode_free(obj);
    exl_jnode_free(start);
    exl_jnode_free(stop);
    exl_jnode_free(step);
    return NULL;
}

static exl_jnode *parse_postfix(parser *p, exl_jnode *n) {
    while (n && !p->st) {
        size_t pos = cur(p)->pos;
        if (accept_op(p, ".")) {
            exl_jtok *t = cur(p);
            if (t->type == EXL_JTOK_NAME) {
                next(p);
                exl_jnode *a = node3(p, EXL_JN_ATTR, pos, n, NULL, NULL, 1);
                if (a && set_name(p, a, t->p, t->len)) {
                    exl_jnode_free(a);
                    return NULL;
                }
                n = a;
            } else if (t->type == EXL_JTOK_INT) {
                next(p);
                n = node3(p, EXL_JN_ITEM, pos, n, lit(p, t->pos, exl_jv_int(t->ival)), NULL, 2);
            } else {
                exl_jnode_free(n);
                return expected(p, "an attribute name");
            }
        } else if (accept_op(p, "[")) {
            if (!enter(p)) {
                exl_jnode_free(n);
                return NULL;
            }
            n = parse_subscript(p, n, pos);
            p->depth--;
        } else if (accept_op(p, "(")) {
            exl_jnode *c = node3(p, EXL_JN_CALL, pos, n, NULL, NULL, 1);
            if (c && parse_args(p, c)) {
                exl_jnode_free(c);
                return NULL;
            }
            n = c;
        } else {
            break;
        }
    }
    return n;
}

static exl_jnode *parse_filter_or_test(parser *p, exl_jnode *operand, exl_jnode_kind kind, int negated) {
    size_t pos = cur(p)->pos;
    exl_jtok *t = cur(p);
    if (t->type != EXL_JTOK_NAME) {
        exl_jnode_free(operand);
        return expected(p, kind == EXL_JN_FILTER ? "a filter name" : "a test name");
    }
    next(p);
    exl_jnode *n = node3(p, kind, pos, operand, NULL, NULL, 1);
    if (!n || set_name(p, n, t->p, t->len)) {
        exl_jnode_free(n);
        return NULL;
    }
    n->flag = negated;
    if (accept_op(p, "(")) {
        if (parse_args(p, n)) {
            exl_jnode_free(n);
            return NULL;
        }
        return n;
    }
    /* A test takes one argument without parentheses: `x is divisibleby 3`. */
    exl_jtok *a = cur(p);
    if (kind == EXL_JN_TEST && ((a->type == EXL_JTOK_NAME && !is_kw(p, "else") && !is_kw(p, "or") && !is_kw(p, "and") &&
                                 !is_kw(p, "if") && !is_kw(p, "is") && !is_kw(p, "in") && !is_kw(p, "not")) ||
                                a->type == EXL_JTOK_STRING || a->type == EXL_JTOK_INT || a->type == EXL_JTOK_FLOAT ||
                                is_op(p, "[") || is_op(p, "{"))) {
        if (add(p, n, parse_postfix(p, parse_primary(p)))) {
            exl_jnode_free(n);
            return NULL;
        }
    }
    return n;
}

static exl_jnode *parse_unary(parser *p, int with_filter) {
    if (!enter(p))
        return NULL;
    size_t pos = cur(p)->pos;
    exl_jnode *n;
    if (accept_op(p, "-"))
        n = node3(p, EXL_JN_NEG, pos, parse_unary(p, 0), NULL, NULL, 1);
    else if (accept_op(p, "+"))
        n = node3(p, EXL_JN_POS, pos, parse_unary(p, 0), NULL, NULL, 1);
    else
        n = parse_primary(p);
    n = parse_postfix(p, n);
    while (with_filter && n && !p->st) {
        if (accept_op(p, "|")) {
            n = parse_filter_or_test(p, n, EXL_JN_FILTER, 0);
        } else if (accept_kw(p, "is")) {
            int neg = accept_kw(p, "not");
            n = parse_filter_or_test(p, n, EXL_JN_TEST, neg);
        } else {
            break;
        }
    }
    p->depth--;
    return n;
}

typedef struct binop {
    const char *tok;
    exl_jop op;
} binop;

/* One left-associative level of binary operators over `sub`. */
static exl_jnode *parse_binary(parser *p, const binop *ops, exl_jnode *(*sub)(parser *)) {
    exl_jnode *n = sub(p);
    while (n && !p->st) {
        const binop *b = ops;
        while (b->tok && !is_op(p, b->tok))
            b++;
        if (!b->tok)
            break;
        size_t pos = cur(p)->pos;
        next(p);
        n = node3(p, EXL_JN_BINARY, pos, n, sub(p), NULL, 2);
        if (n)
            n->op = b->op;
    }
    return n;
}

static exl_jnode *parse_unary_f(parser *p) { return parse_unary(p, 1); }
static exl_jnode *parse_pow(parser *p) {
    static const binop ops[] = {{"**", EXL_JOP_POW}, {NULL, 0}};
    return parse_binary(p, ops, parse_unary_f);
}
static exl_jnode *parse_math2(parser *p) {
    static const binop ops[] = {
        {"*", EXL_JOP_MUL}, {"//", EXL_JOP_FLOORDIV}, {"/", EXL_JOP_DIV}, {"%", EXL_JOP_MOD}, {NULL, 0}};
    return parse_binary(p, ops, parse_pow);
}
static exl_jnode *parse_concat(parser *p) {
    static const binop ops[] = {{"~", EXL_JOP_CONCAT}, {NULL, 0}};
    return parse_binary(p, ops, parse_math2);
}
static exl_jnode *parse_math1(parser *p) {
    static const binop ops[] = {{"+", EXL_JOP_ADD}, {"-", EXL_JOP_SUB}, {NULL, 0}};
    return parse_binary(p, ops, parse_concat);
}

static exl_jnode *parse_compare(parser *p) {
    static const binop ops[] = {{"==", EXL_JOP_EQ}, {"!=", EXL_JOP_NE}, {"<=", EXL_JOP_LE}, {">=", EXL_JOP_GE},
                                {"<", EXL_JOP_LT},  {">", EXL_JOP_GT},  {NULL, 0}};
    exl_jnode *left = parse_math1(p);
    exl_jnode *n = NULL;
    while (left && !p->st) {
        exl_jop op = 0;
        size_t pos = cur(p)->pos;
        for (const binop *b = ops; b->tok; b++)
            if (is_op(p, b->tok)) {
                op = b->op;
                next(p);
                break;
            }
        if (!op && accept_kw(p, "in")) {
            op = EXL_JOP_IN;
        } else if (!op && is_kw(p, "not") && tok_is(peek(p), EXL_JTOK_NAME, "in")) {
            next(p);
            next(p);
            op = EXL_JOP_NOTIN;
        }
        if (!op)
            break;
        if (!n) {
            n = node3(p, EXL_JN_COMPARE, pos, left, NULL, NULL, 1);
            if (!n)
                return NULL;
        }
        unsigned char *nops = exl_realloc(n->ops, n->n_kids);
        if (!nops) {
            exl_jnode_free(n);
            return nomem(p);
        }
        n->ops = nops;
        n->ops[n->n_kids - 1] = (unsigned char)op;
        if (add(p, n, parse_math1(p)) || p->st) {
            exl_jnode_free(n);
            return NULL;
        }
    }
    if (p->st) {
        exl_jnode_free(n ? n : left);
        return NULL;
    }
    return n ? n : left;
}

static exl_jnode *parse_not(parser *p) {
    size_t pos = cur(p)->pos;
    if (accept_kw(p, "not")) {
        if (!enter(p))
            return NULL;
        exl_jnode *n = node3(p, EXL_JN_NOT, pos, parse_not(p), NULL, NULL, 1);
        p->depth--;
        return n;
    }
    return parse_compare(p);
}

static exl_jnode *parse_and(parser *p) {
    exl_jnode *n = parse_not(p);
    while (n && !p->st && is_kw(p, "and")) {
        size_t pos = cur(p)->pos;
        next(p);
        n = node3(p, EXL_JN_AND, pos, n, parse_not(p), NULL, 2);
    }
    return n;
}

static exl_jnode *parse_or(parser *p) {
    exl_jnode *n = parse_and(p);
    while (n && !p->st && is_kw(p, "or")) {
        size_t pos = cur(p)->pos;
        next(p);
        n = node3(p, EXL_JN_OR, pos, n, parse_and(p), NULL, 2);
    }
    return n;
}

static exl_jnode *parse_expression(parser *p, int with_cond) {
    if (!enter(p))
        return NULL;
    exl_jnode *n = parse_or(p);
    while (with_cond && n && !p->st && is_kw(p, "if")) {
        size_t pos = cur(p)->pos;
        next(p);
        exl_jnode *cond = parse_or(p);
        exl_jnode *other = NULL;
        if (cond && accept_kw(p, "else") && !(other = parse_expression(p, 1))) {
            exl_jnode_free(cond);
            cond = NULL;
        }
        n = node3(p, EXL_JN_COND, pos, n, cond, other, 2);
    }
    p->depth--;
    if (p->st) {
        exl_jnode_free(n);
        return NULL;
    }
    return n;
}

/* An expression, or an unparenthesized tuple `a, b` (for {{ }}, set and for). */
static exl_jnode *parse_tuple(parser *p, int with_cond) {
    size_t pos = cur(p)->pos;
    exl_jnode *e = parse_expression(p, with_cond);
    if (!e || !is_op(p, ","))
        return e;
    exl_jnode *n = node(p, EXL_JN_TUPLE, pos);
    if (!n || add(p, n, e)) {
        if (!n)
            exl_jnode_free(e);
        exl_jnode_free(n);
        return NULL;
    }
    while (accept_op(p, ",")) {
        exl_jtok *t = cur(p);
        if (t->type == EXL_JTOK_BLOCK_END || t->type == EXL_JTOK_VAR_END || is_kw(p, "if"))
            break;
        if (add(p, n, parse_expression(p, with_cond))) {
            exl_jnode_free(n);
            return NULL;
        }
    }
    return n;
}

/* ---------------------------------------------------------------- statements */

static exl_jnode *parse_name(parser *p) {
    exl_jtok *t = cur(p);
    if (t->type != EXL_JTOK_NAME)
        return expected(p, "a name");
    next(p);
    exl_jnode *n = node(p, EXL_JN_NAME, t->pos);
    if (n && set_name(p, n, t->p, t->len)) {
        exl_jnode_free(n);
        return NULL;
    }
    return n;
}

/* name | name.attr (when allow_attr) | name, name, ... | (name, name) */
static exl_jnode *parse_target(parser *p, int allow_attr) {
    size_t pos = cur(p)->pos;
    int paren = accept_op(p, "(");
    exl_jnode *n = parse_name(p);
    if (n && allow_attr && !paren && is_op(p, ".")) {
        next(p);
        exl_jtok *t = cur(p);
        if (t->type != EXL_JTOK_NAME) {
            exl_jnode_free(n);
            return expected(p, "an attribute name");
        }
        next(p);
        n = node3(p, EXL_JN_ATTR, pos, n, NULL, NULL, 1);
        if (n && set_name(p, n, t->p, t->len)) {
            exl_jnode_free(n);
            return NULL;
        }
        return n;
    }
    if (n && (paren || is_op(p, ","))) {
        exl_jnode *tup = node3(p, EXL_JN_TUPLE, pos, n, NULL, NULL, 1);
        while (tup && accept_op(p, ",")) {
            if (paren && is_op(p, ")"))
                break;
            if (add(p, tup, parse_name(p))) {
                exl_jnode_free(tup);
                return NULL;
            }
        }
        if (tup && paren && !expect_op(p, ")")) {
            exl_jnode_free(tup);
            return NULL;
        }
        return tup;
    }
    return n;
}

static exl_jnode *parse_body(parser *p, const char *const *stops, int *which);

static int end_tag(parser *p, exl_jnode *n) {
    if (!n || p->st || !expect_end(p)) {
        exl_jnode_free(n);
        return -1;
    }
    return 0;
}

static exl_jnode *parse_if(parser *p, size_t pos) {
    static const char *const stops[] = {"elif", "else", "endif", NULL};
    static const char *const endif[] = {"endif", NULL};
    if (!enter(p))
        return NULL;
    exl_jnode *cond = parse_tuple(p, 1);
    if (!cond || !expect_end(p)) {
        exl_jnode_free(cond);
        p->depth--;
        return NULL;
    }
    int which = -1;
    size_t epos = cur(p)->pos;
    exl_jnode *then = parse_body(p, stops, &which);
    exl_jnode *els = NULL;
    if (then && which == 0) {
        els = node3(p, EXL_JN_BLOCK, epos, parse_if(p, epos), NULL, NULL, 1);
    } else if (then && which == 1) {
        if (expect_end(p))
            els = parse_body(p, endif, &which);
        if (els && end_tag(p, els))
            els = NULL;
    } else if (then && which == 2 && !expect_end(p)) {
        which = -1;
    }
    p->depth--;
    return node3(p, EXL_JN_IF, pos, cond, then, els, which == 2 || els ? 2 : 3);
}

static exl_jnode *parse_for(parser *p, size_t pos) {
    static const char *const stops[] = {"else", "endfor", NULL};
    static const char *const endfor[] = {"endfor", NULL};
    exl_jnode *n = node(p, EXL_JN_FOR, pos);
    if (!n || add(p, n, parse_target(p, 0)))
        goto fail;
    if (!accept_kw(p, "in")) {
        expected(p, "'in'");
        goto fail;
    }
    if (add(p, n, parse_tuple(p, 0)) || add(p, n, accept_kw(p, "if") ? parse_expression(p, 1) : NULL) || p->st)
        goto fail;
    if (is_kw(p, "recursive")) {
        fail_at(p, cur(p)->pos, EXL_ERR_UNSUPPORTED, "recursive loops are not supported");
        goto fail;
    }
    if (!expect_end(p))
        goto fail;
    int which;
    p->loops++;
    exl_jnode *body = parse_body(p, stops, &which);
    p->loops--;
    if (add(p, n, body))
        goto fail;
    exl_jnode *els = NULL;
    if (which == 0 && (!expect_end(p) || !(els = parse_body(p, endfor, &which))))
        goto fail;
    if (add(p, n, els) || !expect_end(p))
        goto fail;
    return n;
fail:
    exl_jnode_free(n);
    return NULL;
}

static exl_jnode *parse_set(parser *p, size_t pos) {
    static const char *const endset[] = {"endset", NULL};
    exl_jnode *n = node(p, EXL_JN_SET, pos);
    if (!n || add(p, n, parse_target(p, 1)))
        goto fail;
    if (accept_op(p, "=")) {
        if (add(p, n, parse_tuple(p, 1)) || !expect_end(p))
            goto fail;
        return n;
    }
    if (n->kids[0]->kind != EXL_JN_NAME) {
        expected(p, "'='");
        goto fail;
    }
    if (!expect_end(p))
        goto fail;
    int which;
    n->flag = 1;
    if (add(p, n, parse_body(p, endset, &which)) || !expect_end(p))
        goto fail;
    return n;
fail:
    exl_jnode_free(n);
    return NULL;
}

static exl_jnode *parse_macro(parser *p, size_t pos) {
    static const char *const endmacro[] = {"endmacro", NULL};
    exl_jnode *n = node(p, EXL_JN_MACRO, pos);
    exl_jtok *t = cur(p);
    if (!n)
        return NULL;
    if (t->type != EXL_JTOK_NAME) {
        expected(p, "a macro name");
        goto fail;
    }
    next(p);
    if (set_name(p, n, t->p, t->len) || add(p, n, NULL) || !expect_op(p, "("))
        goto fail;
    while (!is_op(p, ")")) {
        if (n->n_kids > 1 && !expect_op(p, ","))
            goto fail;
        if (is_op(p, ")"))
            break;
        if (add(p, n, parse_name(p)) || add(p, n, accept_op(p, "=") ? parse_expression(p, 1) : NULL) || p->st)
            goto fail;
    }
    next(p);
    if (!expect_end(p))
        goto fail;
    int which, loops = p->loops;
    p->loops = 0;
    n->kids[0] = parse_body(p, endmacro, &which);
    p->loops = loops;
    if (!n->kids[0] || !expect_end(p))
        goto fail;
    return n;
fail:
    exl_jnode_free(n);
    return NULL;
}

static exl_jnode *parse_statement(parser *p) {
    static const char *const endgen[] = {"endgeneration", NULL};
    exl_jtok *t = cur(p);
    size_t pos = t->pos;
    if (t->type != EXL_JTOK_NAME)
        return expected(p, "a tag name");
    next(p);
    if (tok_is(t, EXL_JTOK_NAME, "if"))
        return parse_if(p, pos);
    if (tok_is(t, EXL_JTOK_NAME, "for"))
        return parse_for(p, pos);
    if (tok_is(t, EXL_JTOK_NAME, "set"))
        return parse_set(p, pos);
    if (tok_is(t, EXL_JTOK_NAME, "macro"))
        return parse_macro(p, pos);
    if (tok_is(t, EXL_JTOK_NAME, "break") || tok_is(t, EXL_JTOK_NAME, "continue")) {
        if (!p->loops)
            return fail_at(p, pos, EXL_ERR_FORMAT, "'%.*s' outside of a loop", (int)t->len, t->p);
        exl_jnode *n = node(p, tok_is(t, EXL_JTOK_NAME, "break") ? EXL_JN_BREAK : EXL_JN_CONTINUE, pos);
        return end_tag(p, n) ? NULL : n;
    }
    if (tok_is(t, EXL_JTOK_NAME, "generation")) {
        /* transformers' assistant-mask marker: renders its body unchanged. */
        int which;
        exl_jnode *body = expect_end(p) ? parse_body(p, endgen, &which) : NULL;
        return end_tag(p, body) ? NULL : body;
    }
    static const char *const unsupported[] = {"include", "extends", "import", "from",       "block",
                                              "call",    "filter",  "with",   "autoescape", NULL};
    for (const char *const *u = unsupported; *u; u++)
        if (tok_is(t, EXL_JTOK_NAME, *u))
            return fail_at(p, pos, EXL_ERR_UNSUPPORTED, "the '%s' tag is not supported", *u);
    if (t->len > 3 && !memcmp(t->p, "end", 3))
        return fail_at(p, pos, EXL_ERR_FORMAT, "unexpected '%.*s'", (int)(t->len > 32 ? 32 : t->len), t->p);
    return fail_at(p, pos, EXL_ERR_FORMAT, "unknown tag '%.*s'", (int)(t->len > 32 ? 32 : t->len), t->p);
}

/* Statements up to a block tag named in stops (NULL: up to the end of the template).
 * On return the stop tag's name has been consumed and *which is its index. */
static exl_jnode *parse_body(parser *p, const char *const *stops, int *which) {
    if (!enter(p))
        return NULL;
    exl_jnode *body = node(p, EXL_JN_BLOCK, cur(p)->pos);
    while (body && !p->st) {
        exl_jtok *t = cur(p);
        exl_jnode *n = NULL;
        if (t->type == EXL_JTOK_EOF) {
            if (!stops)
                break;
            char what[128] = "";
            for (int i = 0; stops[i]; i++)
                snprintf(what + strlen(what), sizeof what - strlen(what), "%s'%s'", i ? " or " : "", stops[i]);
            expected(p, what);
        } else if (t->type == EXL_JTOK_TEXT) {
            exl_jv v;
            next(p);
            if (exl_jv_str(t->p, t->len, &v))
                nomem(p);
            else if ((n = node(p, EXL_JN_TEXT, t->pos))) {
                exl_jv_make_immortal(v);
                n->lit = v;
            } else {
                exl_jv_free(v);
            }
        } else if (t->type == EXL_JTOK_VAR_BEGIN) {
            next(p);
            n = node3(p, EXL_JN_OUTPUT, t->pos, parse_tuple(p, 1), NULL, NULL, 1);
            if (n && cur(p)->type != EXL_JTOK_VAR_END) {
                exl_jnode_free(n);
                n = expected(p, "'}}'");
            }
            next(p);
        } else if (t->type == EXL_JTOK_BLOCK_BEGIN) {
            next(p);
            for (int i = 0; stops && stops[i]; i++)
                if (is_kw(p, stops[i])) {
                    next(p);
                    *which = i;
                    p->depth--;
                    return body;
                }
            n = parse_statement(p);
        } else {
            expected(p, "template text or a tag");
        }
        if (n)
            add(p, body, n);
    }
    p->depth--;
    if (p->st) {
        exl_jnode_free(body);
        return NULL;
    }
    return body;
}

/* ---------------------------------------------------------------- entry points */

exl_status exl_jinja_parse(const char *name, const char *src, size_t len, exl_jinja **out) {
    *out = NULL;
    if (!name)
        name = "chat template";
    if (len > EXL_JINJA_MAX_SOURCE)
        return exl_fail(EXL_ERR_FORMAT, "%s: template larger than %zu bytes", name, EXL_JINJA_MAX_SOURCE);
    exl_jinja *t = exl_calloc(1, sizeof *t);
    if (!t || !(t->name = exl_strdup(name)) || !(t->src = exl_malloc(len + 1))) {
        exl_jinja_free(t);
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", name);
    }
    /* Jinja reads \r\n and \r as \n and drops one trailing newline. */
    size_t o = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            t->src[o++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            t->src[o++] = src[i];
        }
    }
    if (o && t->src[o - 1] == '\n')
        o--;
    t->src[o] = 0;
    t->len = o;

    parser p = {.t = t};
    exl_status st = exl_jinja_lex(t, &p.tk);
    if (st == EXL_OK) {
        int which;
        t->root = parse_body(&p, NULL, &which);
        st = p.st;
        exl_jinja_toks_free(&p.tk);
    }
    if (st != EXL_OK) {
        exl_jinja_free(t);
        return st;
    }
    *out = t;
    return EXL_OK;
}

void exl_jinja_free(exl_jinja *t) {
    if (!t)
        return;
    exl_jnode_free(t->root);
    exl_free(t->src);
    exl_free(t->name);
    exl_free(t);
}
