/* jinja_methods.c - Python methods that templates call on values (str.strip,
 * str.split, str.format with {} / {0} / {name} fields, dict.items, dict.get, loop.cycle,
 * ...) and the global functions (range, namespace, dict, raise_exception, strftime_now). */
#include "jinja/jinja_eval.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- helpers */

static exl_status want_str(exl_jctx *c, const exl_jnode *at, const exl_jv *v, const char *what) {
    if (v && v->type == EXL_JV_STR)
        return EXL_OK;
    return exl_jctx_fail(c, at, EXL_ERR_ARG, "%s must be a string, not %s", what, v ? exl_jv_type_name(*v) : "missing");
}

static exl_status new_str(exl_jctx *c, const exl_jnode *at, const char *s, size_t n, exl_jv *out) {
    return exl_jv_str(s, n, out) ? exl_jctx_nomem(c, at) : EXL_OK;
}

static exl_status push(exl_jctx *c, const exl_jnode *at, exl_jv list, exl_jv v) {
    return exl_jlist_push(list.u.l, v) ? exl_jctx_nomem(c, at) : EXL_OK;
}

static exl_status new_list(exl_jctx *c, const exl_jnode *at, exl_jv *out) {
    return exl_jv_list(0, out) ? exl_jctx_nomem(c, at) : EXL_OK;
}

static exl_status push_str(exl_jctx *c, const exl_jnode *at, exl_jv list, const char *s, size_t n) {
    exl_jv v;
    EXL_TRY(new_str(c, at, s, n, &v));
    return push(c, at, list, v);
}

static int64_t int_arg(const exl_jv *v, int64_t def) {
    if (!v)
        return def;
    if (v->type == EXL_JV_INT)
        return v->u.i;
    if (v->type == EXL_JV_BOOL)
        return v->u.b;
    return def;
}

/* ---------------------------------------------------------------- str methods */

static exl_status str_split(exl_jctx *c, const exl_jnode *at, const exl_jstr *s, const exl_jargs *a, exl_jv *out) {
    const exl_jv *sep = exl_jargs_get(a, 0, "sep");
    int64_t max = int_arg(exl_jargs_get(a, 1, "maxsplit"), -1);
    if (sep && sep->type == EXL_JV_NONE)
        sep = NULL;
    if (sep)
        EXL_TRY(want_str(c, at, sep, "split separator"));
    if (sep && sep->u.s->len == 0)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "empty separator");
    EXL_TRY(exl_jctx_charge(c, at, s->len));
    EXL_TRY(new_list(c, at, out));
    exl_status st = EXL_OK;
    const char *p = s->data, *end = s->data + s->len;
    if (sep) {
        const char *needle = sep->u.s->data;
        size_t nl = sep->u.s->len;
        while (st == EXL_OK) {
            const char *hit = max != 0 ? memmem(p, (size_t)(end - p), needle, nl) : NULL;
            if (!hit) {
                st = push_str(c, at, *out, p, (size_t)(end - p));
                break;
            }
            st = push_str(c, at, *out, p, (size_t)(hit - p));
            p = hit + nl;
            max--;
        }
    } else {
        for (;;) {
            size_t start, len;
            exl_jtext_strip(p, (size_t)(end - p), NULL, 0, 1, 0, &start, &len);
            p += start;
            if (p == end || st)
                break;
            if (max == 0) {
                st = push_str(c, at, *out, p, (size_t)(end - p));
                break;
            }
            /* Find the next whitespace character. */
            const char *q = p;
            while (q < end) {
                size_t s2, l2;
                size_t k = exl_jtext_offset(q, (size_t)(end - q), 1);
                exl_jtext_strip(q, k, NULL, 0, 1, 0, &s2, &l2);
                if (l2 == 0)
                    break;
                q += k;
            }
            st = push_str(c, at, *out, p, (size_t)(q - p));
            p = q;
            max--;
        }
    }
    if (st)
        exl_jv_free(*out);
    return st;
}

/* Python str.replace; count < 0 replaces all. An empty `old` inserts between characters. */
static exl_status str_replace(exl_jctx *c, const exl_jnode *at, const exl_jstr *s, const exl_jv *old,
                              const exl_jv *new_, int64_t count, exl_jv *out) {
    EXL_TRY(want_str(c, at, old, "replace() argument 1"));
    EXL_TRY(want_str(c, at, new_, "replace() argument 2"));
    const exl_jstr *o = old->u.s, *r = new_->u.s;
    exl_str b = EXL_STR_INIT;
    int err = exl_str_append(&b, "", 0);
    size_t i = 0;
    while (!err && i <= s->len && count != 0) {
        size_t k;
        if (o->len == 0) {
            err = exl_str_append(&b, r->data, r->len);
            if (i == s->len) {
                i++;
                break;
            }
            k = exl_jtext_offset(s->data + i, s->len - i, 1);
            err = err || exl_str_append(&b, s->data + i, k);
            i += k;
        } else {
            const char *hit = memmem(s->data + i, s->len - i, o->data, o->len);
            if (!hit)
                break;
            k = (size_t)(hit - (s->data + i));
            err = exl_str_append(&b, s->data + i, k) || exl_str_append(&b, r->data, r->len);
            i += k + o->len;
        }
        if (count > 0)
            count--;
        if (!err && b.len > c->lim.max_bytes)
            break;
    }
    if (!err && i < s->len)
        err = exl_str_append(&b, s->data + i, s->len - i);
    if (err) {
        exl_str_free(&b);
        return exl_jctx_nomem(c, at);
    }
    return exl_jctx_take_str(c, at, &b, out);
}

/* str.format with automatic ({}), numbered ({0}) and named ({name}) fields. */
static exl_status str_format(exl_jctx *c, const exl_jnode *at, const exl_jstr *s, const exl_jargs *a, exl_jv *out) {
    exl_str b = EXL_STR_INIT;
    int err = exl_str_append(&b, "", 0);
    size_t next = 0;
    exl_status st = EXL_OK;
    for (size_t i = 0; i < s->len && !err && !st; i++) {
        char ch = s->data[i];
        if ((ch == '{' || ch == '}') && i + 1 < s->len && s->data[i + 1] == ch) {
            err = exl_str_putc(&b, ch);
            i++;
            continue;
        }
        if (ch == '}') {
            st = exl_jctx_fail(c, at, EXL_ERR_ARG, "single '}' in format string");
            break;
        }
        if (ch != '{') {
            err = exl_str_putc(&b, ch);
            continue;
        }
        const char *close = memchr(s->data + i, '}', s->len - i);
        if (!close) {
            st = exl_jctx_fail(c, at, EXL_ERR_ARG, "single '{' in format string");
            break;
        }
        const char *f = s->data + i + 1;
        size_t fl = (size_t)(close - f);
        const exl_jv *v = NULL;
        char name[64];
        if (fl == 0) {
            v = exl_jargs_get(a, next++, NULL);
        } else if (fl < sizeof name && strspn(f, "0123456789") >= fl) {
            v = exl_jargs_get(a, (size_t)strtoul(f, NULL, 10), NULL);
        } else if (fl < sizeof name && !memchr(f, ':', fl) && !memchr(f, '!', fl)) {
            memcpy(name, f, fl);
            name[fl] = 0;
            for (size_t k = 0; k < a->n && !v; k++)
                if (a->kw && a->kw[k] && !strcmp(a->kw[k], name))
                    v = &a->v[k];
        } else {
            st = exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "format field '{%.*s}' is not supported",
                               (int)(fl > 32 ? 32 : fl), f);
            break;
        }
        if (!v) {
            st = exl_jctx_fail(c, at, EXL_ERR_ARG, "format field '{%.*s}' has no argument", (int)(fl > 32 ? 32 : fl),
                               f);
            break;
        }
        err = exl_jv_write_str(*v, &b) != EXL_OK;
        i = (size_t)(close - s->data);
        if (!err && b.len > c->lim.max_bytes)
            break;
    }
    if (err)
        st = exl_jctx_nomem(c, at);
    if (st) {
        exl_str_free(&b);
        return st;
    }
    return exl_jctx_take_str(c, at, &b, out);
}

static exl_status str_join(exl_jctx *c, const exl_jnode *at, const exl_jstr *sep, const exl_jv *seq, exl_jv *out) {
    exl_jv items;
    if (!seq)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "join() takes one argument");
    EXL_TRY(exl_jctx_iterate(c, at, *seq, &items));
    exl_str b = EXL_STR_INIT;
    int err = exl_str_append(&b, "", 0);
    for (size_t i = 0; i < items.u.l->n && !err; i++) {
        err = (i && exl_str_append(&b, sep->data, sep->len)) || exl_jv_write_str(items.u.l->items[i], &b);
        if (b.len > c->lim.max_bytes)
            break;
    }
    exl_jv_free(items);
    if (err) {
        exl_str_free(&b);
        return exl_jctx_nomem(c, at);
    }
    return exl_jctx_take_str(c, at, &b, out);
}

static int affix_match(const exl_jstr *s, const exl_jstr *x, int end) {
    return x->len <= s->len && !memcmp(s->data + (end ? s->len - x->len : 0), x->data, x->len);
}

static exl_status str_affix(exl_jctx *c, const exl_jnode *at, const exl_jstr *s, const exl_jv *x, int end,
                            exl_jv *out) {
    int r = 0;
    if (x && x->type == EXL_JV_LIST) {
        for (size_t i = 0; i < x->u.l->n && !r; i++) {
            EXL_TRY(want_str(c, at, &x->u.l->items[i], end ? "endswith() item" : "startswith() item"));
            r = affix_match(s, x->u.l->items[i].u.s, end);
        }
    } else {
        EXL_TRY(want_str(c, at, x, end ? "endswith() argument" : "startswith() argument"));
        r = affix_match(s, x->u.s, end);
    }
    *out = exl_jv_bool(r);
    return EXL_OK;
}

static exl_status str_method(exl_jctx *c, const exl_jnode *at, const exl_jstr *s, const char *m, const exl_jargs *a,
                             exl_jv *out, int *found) {
    *found = 1;
    const exl_jv *a0 = exl_jargs_get(a, 0, NULL);
    int strip = !strcmp(m, "strip") ? 3 : !strcmp(m, "lstrip") ? 1 : !strcmp(m, "rstrip") ? 2 : 0;
    if (strip) {
        const exl_jv *chars = exl_jargs_get(a, 0, "chars");
        if (chars && chars->type == EXL_JV_NONE)
            chars = NULL;
        if (chars)
            EXL_TRY(want_str(c, at, chars, "strip characters"));
        size_t start, len;
        exl_jtext_strip(s->data, s->len, chars ? chars->u.s->data : NULL, chars ? chars->u.s->len : 0, strip & 1,
                        strip & 2, &start, &len);
        return new_str(c, at, s->data + start, len, out);
    }
    static const struct {
        const char *name;
        exl_jcase mode;
    } cases[] = {{"upper", EXL_JCASE_UPPER},
                 {"lower", EXL_JCASE_LOWER},
                 {"title", EXL_JCASE_TITLE},
                 {"capitalize", EXL_JCASE_CAPITALIZE}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        if (strcmp(m, cases[i].name))
            continue;
        exl_str b = EXL_STR_INIT;
        if (exl_str_append(&b, "", 0) || exl_jtext_case(s->data, s->len, cases[i].mode, &b)) {
            exl_str_free(&b);
            return exl_jctx_nomem(c, at);
        }
        return exl_jctx_take_str(c, at, &b, out);
    }
    if (!strcmp(m, "startswith") || !strcmp(m, "endswith"))
        return str_affix(c, at, s, a0, m[0] == 'e', out);
    if (!strcmp(m, "split"))
        return str_split(c, at, s, a, out);
    if (!strcmp(m, "replace"))
        return str_replace(c, at, s, a0, exl_jargs_get(a, 1, NULL), int_arg(exl_jargs_get(a, 2, "count"), -1), out);
    if (!strcmp(m, "format"))
        return str_format(c, at, s, a, out);
    if (!strcmp(m, "join"))
        return str_join(c, at, s, a0, out);
    if (!strcmp(m, "find") || !strcmp(m, "count")) {
        EXL_TRY(want_str(c, at, a0, "argument"));
        const exl_jstr *x = a0->u.s;
        EXL_TRY(exl_jctx_charge(c, at, s->len / 16));
        int64_t count = 0, first = -1;
        for (size_t i = 0; i + x->len <= s->len;) {
            const char *hit = memmem(s->data + i, s->len - i, x->data, x->len);
            if (!hit)
                break;
            size_t off = (size_t)(hit - s->data);
            if (first < 0)
                first = (int64_t)exl_jtext_len(s->data, off);
            count++;
            i = off + (x->len ? x->len : exl_jtext_offset(s->data + off, s->len - off, 1) + (off == s->len));
        }
        *out = exl_jv_int(m[0] == 'f' ? first : count);
        return EXL_OK;
    }
    *found = 0;
    return EXL_OK;
}

/* ---------------------------------------------------------------- dict and loop methods */

static exl_status dict_method(exl_jctx *c, const exl_jnode *at, const exl_jdict *d, const char *m, const exl_jargs *a,
                              exl_jv *out, int *found) {
    *found = 1;
    if (!strcmp(m, "get")) {
        const exl_jv *k = exl_jargs_get(a, 0, NULL), *def = exl_jargs_get(a, 1, "default");
        const exl_jv *v = k && k->type == EXL_JV_STR ? exl_jdict_get(d, k->u.s->data, k->u.s->len) : NULL;
        *out = v ? exl_jv_ref(*v) : def ? exl_jv_ref(*def) : exl_jv_none();
        return EXL_OK;
    }
    int which = !strcmp(m, "items") ? 0 : !strcmp(m, "keys") ? 1 : !strcmp(m, "values") ? 2 : -1;
    if (which < 0) {
        *found = 0;
        return EXL_OK;
    }
    EXL_TRY(exl_jctx_charge(c, at, d->n));
    EXL_TRY(new_list(c, at, out));
    exl_status st = EXL_OK;
    for (size_t i = 0; st == EXL_OK && i < d->n; i++) {
        exl_jv key = exl_jv_ref((exl_jv){EXL_JV_STR, {.s = d->keys[i]}});
        exl_jv val = exl_jv_ref(d->vals[i]);
        if (which == 1) {
            exl_jv_free(val);
            st = push(c, at, *out, key);
        } else if (which == 2) {
            exl_jv_free(key);
            st = push(c, at, *out, val);
        } else {
            exl_jv pair;
            if (exl_jv_list(2, &pair)) {
                exl_jv_free(key);
                exl_jv_free(val);
                st = exl_jctx_nomem(c, at);
                break;
            }
            pair.u.l->tuple = 1;
            pair.u.l->items[0] = key;
            pair.u.l->items[1] = val;
            pair.u.l->n = 2;
            st = push(c, at, *out, pair);
        }
    }
    if (st)
        exl_jv_free(*out);
    return st;
}

exl_status exl_jinja_method(exl_jctx *c, const exl_jnode *at, exl_jv self, const char *name, const exl_jargs *a,
                            exl_jv *out, int *found) {
    *found = 0;
    switch (self.type) {
    case EXL_JV_STR: return str_method(c, at, self.u.s, name, a, out, found);
    case EXL_JV_DICT: return dict_method(c, at, self.u.d, name, a, out, found);
    case EXL_JV_LOOP:
        if (!strcmp(name, "cycle")) {
            *found = 1;
            if (a->n == 0)
                return exl_jctx_fail(c, at, EXL_ERR_ARG, "loop.cycle() needs at least one argument");
            *out = exl_jv_ref(a->v[self.u.loop->index0 % a->n]);
        }
        return EXL_OK;
    case EXL_JV_UNDEF:
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' is undefined", self.u.undef_name ? self.u.undef_name : "value");
    default: return EXL_OK;
    }
}

/* ---------------------------------------------------------------- globals */

static exl_status global_range(exl_jctx *c, const exl_jnode *at, const exl_jargs *a, exl_jv *out) {
    int64_t start = 0, stop, step = 1;
    for (size_t i = 0; i < a->n; i++)
        if (a->v[i].type != EXL_JV_INT && a->v[i].type != EXL_JV_BOOL)
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "range() arguments must be integers");
    if (a->n == 1) {
        stop = int_arg(&a->v[0], 0);
    } else if (a->n == 2 || a->n == 3) {
        start = int_arg(&a->v[0], 0);
        stop = int_arg(&a->v[1], 0);
        step = a->n == 3 ? int_arg(&a->v[2], 1) : 1;
    } else {
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "range() takes 1 to 3 arguments");
    }
    if (step == 0)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "range() step must not be zero");
    double count = step > 0 ? ((double)stop - (double)start) / (double)step
                            : ((double)start - (double)stop) / (double)-step;
    if (count > 0)
        EXL_TRY(exl_jctx_check_size(
            c, at, count * sizeof(exl_jv) > (double)SIZE_MAX / 2 ? SIZE_MAX : (size_t)(count + 1) * sizeof(exl_jv)));
    EXL_TRY(new_list(c, at, out));
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (exl_jlist_push(out->u.l, exl_jv_int(i))) {
            exl_jv_free(*out);
            return exl_jctx_nomem(c, at);
        }
        if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step))
            break;
    }
    return EXL_OK;
}

/* namespace(...) / dict(...): keyword arguments, or one dict to copy first. */
static exl_status fill_from_args(exl_jctx *c, const exl_jnode *at, exl_jdict *d, const exl_jargs *a) {
    for (size_t i = 0; i < a->n; i++) {
        if (a->kw && a->kw[i]) {
            if (exl_jdict_set(d, a->kw[i], strlen(a->kw[i]), exl_jv_ref(a->v[i])))
                return exl_jctx_nomem(c, at);
        } else if (a->v[i].type == EXL_JV_DICT) {
            const exl_jdict *src = a->v[i].u.d;
            for (size_t k = 0; k < src->n; k++)
                if (exl_jdict_set_key(d, src->keys[k], exl_jv_ref(src->vals[k])))
                    return exl_jctx_nomem(c, at);
        } else {
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "expected keyword arguments or a dict, got %s",
                                 exl_jv_type_name(a->v[i]));
        }
    }
    return EXL_OK;
}

exl_status exl_jinja_global(exl_jctx *c, const exl_jnode *at, const char *name, const exl_jargs *a, exl_jv *out,
                            int *found) {
    *found = 1;
    if (!strcmp(name, "range"))
        return global_range(c, at, a, out);
    if (!strcmp(name, "namespace")) {
        if (exl_jv_namespace(&c->namespaces, out))
            return exl_jctx_nomem(c, at);
        return fill_from_args(c, at, out->u.d, a);
    }
    if (!strcmp(name, "dict")) {
        EXL_TRY(exl_jv_dict(0, out) ? exl_jctx_nomem(c, at) : EXL_OK);
        exl_status st = fill_from_args(c, at, out->u.d, a);
        if (st)
            exl_jv_free(*out);
        return st;
    }
    if (!strcmp(name, "raise_exception")) {
        const exl_jv *msg = exl_jargs_get(a, 0, NULL);
        exl_str b = EXL_STR_INIT;
        if (msg && exl_jv_write_str(*msg, &b) == EXL_OK)
            exl_fail(EXL_ERR_ARG, "%s", b.data ? b.data : "");
        else
            exl_fail(EXL_ERR_ARG, "template raised an exception");
        exl_str_free(&b);
        return EXL_ERR_ARG;
    }
    if (!strcmp(name, "strftime_now")) {
        const exl_jv *fmt = exl_jargs_get(a, 0, "format");
        EXL_TRY(want_str(c, at, fmt, "strftime_now() format"));
        time_t now = time(NULL);
        struct tm tm;
        char buf[256];
/* the template's own format string, as Python's strftime takes it */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
        size_t n = localtime_r(&now, &tm) ? strftime(buf, sizeof buf, fmt->u.s->data, &tm) : 0;
#pragma GCC diagnostic pop
        return new_str(c, at, buf, n, out);
    }
    *found = 0;
    return EXL_OK;
}
