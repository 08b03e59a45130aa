/* jinja_tests.c - the `is` tests: defined, none, string, number, mapping, iterable,
 * equalto, divisibleby, ... */
#include "jinja/jinja_eval.h"

#include <string.h>

static int cmp_test(exl_jctx *c, const exl_jnode *at, const char *name, exl_jv self, const exl_jv *other, int *out,
                    exl_status *st) {
    static const struct {
        const char *names[3];
        int ord; /* 0: ==, 1: !=, 2: <, 3: <=, 4: >, 5: >= */
    } tests[] = {{{"eq", "equalto", "=="}, 0}, {{"ne", "!=", NULL}, 1},         {{"lt", "lessthan", "<"}, 2},
                 {{"le", "<=", NULL}, 3},      {{"gt", "greaterthan", ">"}, 4}, {{"ge", ">=", NULL}, 5}};
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; i++) {
        for (int k = 0; k < 3; k++) {
            if (!tests[i].names[k] || strcmp(tests[i].names[k], name))
                continue;
            if (!other) {
                *st = exl_jctx_fail(c, at, EXL_ERR_ARG, "test '%s' needs an argument", name);
                return 1;
            }
            int ord = tests[i].ord, cmp = 0;
            if (ord < 2) {
                *out = exl_jv_equal(self, *other) == (ord == 0);
                return 1;
            }
            if (exl_jv_compare(self, *other, &cmp)) {
                *st = exl_jctx_fail(c, at, EXL_ERR_ARG, "cannot compare %s with %s", exl_jv_type_name(self),
                                    exl_jv_type_name(*other));
                return 1;
            }
            *out = ord == 2 ? cmp < 0 : ord == 3 ? cmp <= 0 : ord == 4 ? cmp > 0 : cmp >= 0;
            return 1;
        }
    }
    return 0;
}

exl_status exl_jinja_test(exl_jctx *c, const exl_jnode *at, const char *name, exl_jv self, const exl_jargs *a,
                          int *out) {
    const exl_jv *arg = exl_jargs_get(a, 0, NULL);
    exl_jv_type t = self.type;
    exl_status st = EXL_OK;
    *out = 0;
    if (cmp_test(c, at, name, self, arg, out, &st))
        return st;
    if (!strcmp(name, "defined"))
        *out = t != EXL_JV_UNDEF;
    else if (!strcmp(name, "undefined"))
        *out = t == EXL_JV_UNDEF;
    else if (!strcmp(name, "none"))
        *out = t == EXL_JV_NONE;
    else if (!strcmp(name, "string"))
        *out = t == EXL_JV_STR;
    else if (!strcmp(name, "number"))
        *out = exl_jv_is_num(self);
    else if (!strcmp(name, "integer"))
        *out = t == EXL_JV_INT;
    else if (!strcmp(name, "float"))
        *out = t == EXL_JV_FLOAT;
    else if (!strcmp(name, "boolean"))
        *out = t == EXL_JV_BOOL;
    else if (!strcmp(name, "true"))
        *out = t == EXL_JV_BOOL && self.u.b;
    else if (!strcmp(name, "false"))
        *out = t == EXL_JV_BOOL && !self.u.b;
    else if (!strcmp(name, "mapping"))
        *out = t == EXL_JV_DICT;
    else if (!strcmp(name, "iterable") || !strcmp(name, "sequence"))
        *out = t == EXL_JV_LIST || t == EXL_JV_DICT || t == EXL_JV_STR;
    else if (!strcmp(name, "callable"))
        *out = t == EXL_JV_MACRO;
    else if (!strcmp(name, "sameas"))
        *out = arg && (arg->type == t && (t == EXL_JV_NONE || t == EXL_JV_UNDEF || exl_jv_equal(self, *arg)) &&
                       (t != EXL_JV_STR || self.u.s == arg->u.s) && (t != EXL_JV_LIST || self.u.l == arg->u.l) &&
                       (t != EXL_JV_DICT || self.u.d == arg->u.d));
    else if (!strcmp(name, "in")) {
        if (!arg)
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "test 'in' needs an argument");
        if (arg->type == EXL_JV_STR && t == EXL_JV_STR)
            *out = self.u.s->len == 0 || memmem(arg->u.s->data, arg->u.s->len, self.u.s->data, self.u.s->len);
        else if (arg->type == EXL_JV_LIST)
            for (size_t i = 0; i < arg->u.l->n && !*out; i++)
                *out = exl_jv_equal(self, arg->u.l->items[i]);
        else if (arg->type == EXL_JV_DICT)
            *out = t == EXL_JV_STR && exl_jdict_get(arg->u.d, self.u.s->data, self.u.s->len);
    } else if (!strcmp(name, "odd") || !strcmp(name, "even") || !strcmp(name, "divisibleby")) {
        if (t != EXL_JV_INT)
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "test '%s' needs an integer, not %s", name,
                                 exl_jv_type_name(self));
        int64_t d = name[0] == 'd' ? (arg && arg->type == EXL_JV_INT ? arg->u.i : 0) : 2;
        if (d == 0)
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "divisibleby needs a non-zero integer");
        int64_t m = d == -1 ? 0 : self.u.i % d;
        *out = name[0] == 'o' ? m != 0 : m == 0;
    } else if (!strcmp(name, "lower") || !strcmp(name, "upper")) {
        if (t != EXL_JV_STR)
            return EXL_OK;
        exl_str b = EXL_STR_INIT;
        if (exl_str_append(&b, "", 0) ||
            exl_jtext_case(self.u.s->data, self.u.s->len, name[0] == 'l' ? EXL_JCASE_LOWER : EXL_JCASE_UPPER, &b)) {
            exl_str_free(&b);
            return exl_jctx_nomem(c, at);
        }
        *out = b.len == self.u.s->len && !memcmp(b.data, self.u.s->data, b.len);
        exl_str_free(&b);
    } else
        return exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "unknown test '%s'", name);
    return EXL_OK;
}
