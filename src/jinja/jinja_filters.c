/* jinja_filters.c - the `|` filters: text (trim, upper, title, replace, indent, ...),
 * conversion (string, int, float, list, tojson), sequences (length, first, join, map,
 * selectattr, sort, unique, ...) and default. Unknown filters are errors. */
#include "jinja/jinja_eval.h"

#include "base/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef exl_status (*filter_fn)(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out);

/* ---------------------------------------------------------------- helpers */

static int flag_arg(const exl_jargs *a, size_t index, const char *name) {
    const exl_jv *v = exl_jargs_get(a, index, name);
    return v && exl_jv_truthy(*v);
}

/* str(v) as a fresh string value. */
static exl_status to_string(exl_jctx *c, const exl_jnode *at, exl_jv v, exl_jv *out) {
    if (v.type == EXL_JV_STR) {
        *out = exl_jv_ref(v);
        return EXL_OK;
    }
    exl_str b = EXL_STR_INIT;
    if (exl_str_append(&b, "", 0) || exl_jv_write_str(v, &b)) {
        exl_str_free(&b);
        return exl_jctx_nomem(c, at);
    }
    return exl_jctx_take_str(c, at, &b, out);
}

/* Call a str method on str(self) (the filters that are str methods in Jinja). */
static exl_status via_method(exl_jctx *c, const exl_jnode *at, exl_jv self, const char *m, const exl_jargs *a,
                             exl_jv *out) {
    exl_jv s;
    EXL_TRY(to_string(c, at, self, &s));
    int found;
    exl_status st = exl_jinja_method(c, at, s, m, a, out, &found);
    exl_jv_free(s);
    return st;
}

/* v.attr where attr may be dotted ("function.name") or an integer index. */
static exl_status get_path(exl_jctx *c, const exl_jnode *at, exl_jv v, const exl_jv *attr, exl_jv *out) {
    if (attr->type == EXL_JV_INT) {
        *out = v.type == EXL_JV_LIST && attr->u.i >= 0 && (uint64_t)attr->u.i < v.u.l->n
                   ? exl_jv_ref(v.u.l->items[attr->u.i])
                   : exl_jv_undef(NULL);
        return EXL_OK;
    }
    if (attr->type != EXL_JV_STR)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "attribute must be a string");
    exl_jv cur = exl_jv_ref(v);
    const char *p = attr->u.s->data;
    for (;;) {
        const char *dot = strchr(p, '.');
        size_t n = dot ? (size_t)(dot - p) : strlen(p);
        char name[128];
        if (n >= sizeof name) {
            exl_jv_free(cur);
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "attribute name too long");
        }
        memcpy(name, p, n);
        name[n] = 0;
        exl_jv next = exl_jv_undef(NULL);
        exl_status st = cur.type == EXL_JV_UNDEF ? EXL_OK : exl_jctx_getattr(c, at, cur, name, &next);
        exl_jv_free(cur);
        if (st)
            return st;
        cur = next;
        if (!dot)
            break;
        p = dot + 1;
    }
    *out = cur;
    return EXL_OK;
}

/* Arguments from position `from` on, as a new argument list (values borrowed). */
static exl_jargs args_from(const exl_jargs *a, size_t from) {
    exl_jargs r = {0, a->v, a->kw};
    size_t pos = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (!(a->kw && a->kw[i]) && pos++ == from) {
            r.v = a->v + i;
            r.kw = a->kw ? a->kw + i : NULL;
            r.n = a->n - i;
            return r;
        }
    }
    r.n = 0;
    return r;
}

/* ---------------------------------------------------------------- text */

static exl_status f_trim(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return via_method(c, at, self, "strip", a, out);
}
static exl_status f_upper(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return via_method(c, at, self, "upper", a, out);
}
static exl_status f_lower(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return via_method(c, at, self, "lower", a, out);
}
static exl_status f_capitalize(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return via_method(c, at, self, "capitalize", a, out);
}
static exl_status f_replace(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return via_method(c, at, self, "replace", a, out);
}

static exl_status f_title(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    exl_jv s;
    EXL_TRY(to_string(c, at, self, &s));
    exl_str b = EXL_STR_INIT;
    int err = exl_str_append(&b, "", 0) || exl_jtext_case(s.u.s->data, s.u.s->len, EXL_JCASE_WORDS, &b);
    exl_jv_free(s);
    if (err) {
        exl_str_free(&b);
        return exl_jctx_nomem(c, at);
    }
    return exl_jctx_take_str(c, at, &b, out);
}

static exl_status f_string(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return to_string(c, at, self, out);
}

static exl_status f_safe(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    *out = exl_jv_ref(self);
    return EXL_OK;
}

static exl_status f_escape(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    exl_jv s;
    EXL_TRY(to_string(c, at, self, &s));
    exl_str b = EXL_STR_INIT;
    int err = exl_str_append(&b, "", 0);
    for (size_t i = 0; i < s.u.s->len && !err; i++) {
        char ch = s.u.s->data[i];
        const char *rep = ch == '&'    ? "&amp;"
                          : ch == '<'  ? "&lt;"
                          : ch == '>'  ? "&gt;"
                          : ch == '"'  ? "&#34;"
                          : ch == '\'' ? "&#39;"
                                       : NULL;
        err = rep ? exl_str_puts(&b, rep) : exl_str_putc(&b, ch);
    }
    exl_jv_free(s);
    if (err) {
        exl_str_free(&b);
        return exl_jctx_nomem(c, at);
    }
    return exl_jctx_take_str(c, at, &b, out);
}

static exl_status f_indent(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *w = exl_jargs_get(a, 0, "width");
    int first = flag_arg(a, 1, "first"), blank = flag_arg(a, 2, "blank");
    exl_jv pad;
    if (w && w->type == EXL_JV_STR)
        pad = exl_jv_ref(*w);
    else {
        int64_t n = w && w->type == EXL_JV_INT ? w->u.i : 4;
        if (n < 0)
            n = 0;
        EXL_TRY(exl_jctx_check_size(c, at, (size_t)n));
        exl_str p = EXL_STR_INIT;
        int err = exl_str_append(&p, "", 0);
        for (int64_t i = 0; i < n && !err; i++)
            err = exl_str_putc(&p, ' ');
        if (err || exl_jv_str_take(&p, &pad)) {
            exl_str_free(&p);
            return exl_jctx_nomem(c, at);
        }
    }
    exl_jv s;
    exl_status st = to_string(c, at, self, &s);
    if (st) {
        exl_jv_free(pad);
        return st;
    }
    /* Lines are split at \n; a line gets the pad unless it is blank (and blank is off),
     * the first line only when first is on. */
    exl_str b = EXL_STR_INIT;
    int err = exl_str_append(&b, "", 0);
    const char *p = s.u.s->data, *end = p + s.u.s->len;
    for (int line = 0; !err && p <= end; line++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t len = nl ? (size_t)(nl - p) : (size_t)(end - p);
        if (line == 0 ? first : (blank || len > 0))
            err = exl_str_append(&b, pad.u.s->data, pad.u.s->len);
        err = err || exl_str_append(&b, p, len) || (nl && exl_str_putc(&b, '\n'));
        if (!nl || b.len > c->lim.max_bytes)
            break;
        p = nl + 1;
    }
    exl_jv_free(s);
    exl_jv_free(pad);
    if (err) {
        exl_str_free(&b);
        return exl_jctx_nomem(c, at);
    }
    return exl_jctx_take_str(c, at, &b, out);
}

/* ---------------------------------------------------------------- conversion */

static exl_status f_tojson(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *ind = exl_jargs_get(a, 0, "indent");
    int indent = -1;
    if (ind && ind->type == EXL_JV_INT)
        indent = ind->u.i < 0 ? 0 : ind->u.i > 64 ? 64 : (int)ind->u.i;
    exl_str b = EXL_STR_INIT;
    exl_status st = exl_str_append(&b, "", 0) ? EXL_ERR_NOMEM
                                              : exl_jv_write_json(self, indent, flag_arg(a, 99, "sort_keys"), &b);
    if (st) {
        exl_str_free(&b);
        if (st == EXL_ERR_NOMEM)
            return exl_jctx_nomem(c, at);
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "a %s (or a value inside it) is not JSON serializable",
                             exl_jv_type_name(self));
    }
    return exl_jctx_take_str(c, at, &b, out);
}

static exl_status f_int(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *def = exl_jargs_get(a, 0, "default");
    *out = def ? exl_jv_ref(*def) : exl_jv_int(0);
    if (self.type == EXL_JV_INT || self.type == EXL_JV_BOOL) {
        *out = exl_jv_int(self.type == EXL_JV_INT ? self.u.i : self.u.b);
    } else if (self.type == EXL_JV_FLOAT && isfinite(self.u.f) && fabs(self.u.f) < 9.2e18) {
        *out = exl_jv_int((int64_t)self.u.f);
    } else if (self.type == EXL_JV_STR) {
        size_t start, len;
        exl_jtext_strip(self.u.s->data, self.u.s->len, NULL, 0, 1, 1, &start, &len);
        char buf[64];
        if (len == 0 || len >= sizeof buf)
            return EXL_OK;
        size_t o = 0;
        for (size_t i = 0; i < len; i++)
            if (self.u.s->data[start + i] != '_')
                buf[o++] = self.u.s->data[start + i];
        buf[o] = 0;
        char *end;
        long long v = strtoll(buf, &end, 10);
        if (*end == 0) {
            exl_jv_free(*out);
            *out = exl_jv_int(v);
            return EXL_OK;
        }
        double d = strtod(buf, &end);
        if (*end == 0 && isfinite(d) && fabs(d) < 9.2e18) {
            exl_jv_free(*out);
            *out = exl_jv_int((int64_t)d);
        }
    }
    return EXL_OK;
}

static exl_status f_float(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *def = exl_jargs_get(a, 0, "default");
    if (exl_jv_is_num(self)) {
        *out = exl_jv_float(exl_jv_num(self));
        return EXL_OK;
    }
    if (self.type == EXL_JV_STR) {
        size_t start, len;
        exl_jtext_strip(self.u.s->data, self.u.s->len, NULL, 0, 1, 1, &start, &len);
        char buf[64];
        if (len > 0 && len < sizeof buf) {
            memcpy(buf, self.u.s->data + start, len);
            buf[len] = 0;
            char *end;
            double d = strtod(buf, &end);
            if (*end == 0) {
                *out = exl_jv_float(d);
                return EXL_OK;
            }
        }
    }
    *out = def ? exl_jv_ref(*def) : exl_jv_float(0.0);
    return EXL_OK;
}

static exl_status f_list(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return exl_jctx_iterate(c, at, self, out);
}

static exl_status f_items(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    if (self.type == EXL_JV_UNDEF)
        return exl_jv_list(0, out) ? exl_jctx_nomem(c, at) : EXL_OK;
    if (self.type != EXL_JV_DICT)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "items filter needs a dict, not %s", exl_jv_type_name(self));
    int found;
    return exl_jinja_method(c, at, self, "items", a, out, &found);
}

/* ---------------------------------------------------------------- sequences */

static exl_status f_length(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    switch (self.type) {
    case EXL_JV_STR: *out = exl_jv_int((int64_t)exl_jtext_len(self.u.s->data, self.u.s->len)); break;
    case EXL_JV_LIST: *out = exl_jv_int((int64_t)self.u.l->n); break;
    case EXL_JV_DICT:
    case EXL_JV_NS: *out = exl_jv_int((int64_t)self.u.d->n); break;
    case EXL_JV_UNDEF: *out = exl_jv_int(0); break;
    default: return exl_jctx_fail(c, at, EXL_ERR_ARG, "object of type '%s' has no len()", exl_jv_type_name(self));
    }
    return EXL_OK;
}

static exl_status f_default(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *def = exl_jargs_get(a, 0, "default_value");
    int use = self.type == EXL_JV_UNDEF || (flag_arg(a, 1, "boolean") && !exl_jv_truthy(self));
    if (!use)
        *out = exl_jv_ref(self);
    else if (def)
        *out = exl_jv_ref(*def);
    else
        return exl_jv_str("", 0, out) ? exl_jctx_nomem(c, at) : EXL_OK;
    return EXL_OK;
}

static exl_status first_last(exl_jctx *c, const exl_jnode *at, exl_jv self, int last, exl_jv *out) {
    exl_jv items;
    EXL_TRY(exl_jctx_iterate(c, at, self, &items));
    size_t n = items.u.l->n;
    *out = n ? exl_jv_ref(items.u.l->items[last ? n - 1 : 0]) : exl_jv_undef(last ? "last" : "first");
    exl_jv_free(items);
    return EXL_OK;
}
static exl_status f_first(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return first_last(c, at, self, 0, out);
}
static exl_status f_last(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return first_last(c, at, self, 1, out);
}

/* Apply per-item work to a materialized sequence: map (kind 0), select/reject by test
 * on the item (1/2) or on an attribute (3/4). */
static exl_status transform(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, int kind, exl_jv *out) {
    exl_jv items;
    EXL_TRY(exl_jctx_iterate(c, at, self, &items));
    if (exl_jv_list(0, out)) {
        exl_jv_free(items);
        return exl_jctx_nomem(c, at);
    }
    const exl_jv *attr = kind == 0 ? exl_jargs_get(a, 99, "attribute") : kind >= 3 ? exl_jargs_get(a, 0, NULL) : NULL;
    const exl_jv *def = kind == 0 ? exl_jargs_get(a, 99, "default") : NULL;
    const exl_jv *name = kind == 0 ? (attr ? NULL : exl_jargs_get(a, 0, NULL)) : exl_jargs_get(a, kind >= 3, NULL);
    exl_jargs rest = args_from(a, kind == 0 ? 1 : kind >= 3 ? 2 : 1);
    exl_status st = EXL_OK;
    if (kind >= 3 && !attr)
        st = exl_jctx_fail(c, at, EXL_ERR_ARG, "selectattr/rejectattr need an attribute name");
    if (name && name->type != EXL_JV_STR)
        st = exl_jctx_fail(c, at, EXL_ERR_ARG, "filter or test name must be a string");
    if (kind == 0 && !attr && !name)
        st = exl_jctx_fail(c, at, EXL_ERR_ARG, "map needs a filter name or attribute=");
    for (size_t i = 0; st == EXL_OK && i < items.u.l->n; i++) {
        exl_jv item = items.u.l->items[i], val;
        if ((st = exl_jctx_charge(c, at, 1)))
            break;
        if (attr)
            st = get_path(c, at, item, attr, &val);
        else
            val = exl_jv_ref(item);
        if (st)
            break;
        if (kind == 0) {
            exl_jv r = val;
            if (!attr) {
                st = exl_jinja_filter(c, at, name->u.s->data, val, &rest, &r);
                exl_jv_free(val);
            } else if (val.type == EXL_JV_UNDEF && def) {
                r = exl_jv_ref(*def);
            }
            if (st == EXL_OK && exl_jlist_push(out->u.l, r))
                st = exl_jctx_nomem(c, at);
            continue;
        }
        int r;
        if (name)
            st = exl_jinja_test(c, at, name->u.s->data, val, &rest, &r);
        else
            r = exl_jv_truthy(val);
        exl_jv_free(val);
        if (st == EXL_OK && r == (kind == 1 || kind == 3) && exl_jlist_push(out->u.l, exl_jv_ref(item)))
            st = exl_jctx_nomem(c, at);
    }
    exl_jv_free(items);
    if (st)
        exl_jv_free(*out);
    return st;
}
static exl_status f_map(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return transform(c, at, self, a, 0, out);
}
static exl_status f_select(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return transform(c, at, self, a, 1, out);
}
static exl_status f_reject(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return transform(c, at, self, a, 2, out);
}
static exl_status f_selectattr(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return transform(c, at, self, a, 3, out);
}
static exl_status f_rejectattr(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return transform(c, at, self, a, 4, out);
}

static exl_status f_join(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *sep = exl_jargs_get(a, 0, "d"), *attr = exl_jargs_get(a, 1, "attribute");
    exl_jv items, empty = exl_jv_none();
    if (attr) {
        exl_jv attr_arg = *attr;
        exl_jargs ma = {1, &attr_arg, (char *const[]){"attribute"}};
        EXL_TRY(transform(c, at, self, &ma, 0, &items));
    } else {
        items = exl_jv_ref(self);
    }
    exl_status st = EXL_OK;
    if (!sep || sep->type != EXL_JV_STR) {
        st = exl_jv_str("", 0, &empty) ? exl_jctx_nomem(c, at) : EXL_OK;
        sep = &empty;
    }
    exl_jargs ja = {1, &items, NULL};
    int found;
    if (st == EXL_OK)
        st = exl_jinja_method(c, at, *sep, "join", &ja, out, &found);
    exl_jv_free(items);
    exl_jv_free(empty);
    return st;
}

/* Sort key of an item: the attribute if asked, lowercased when case-insensitive. */
static exl_status sort_key(exl_jctx *c, const exl_jnode *at, exl_jv item, const exl_jv *attr, int cs, exl_jv *key) {
    if (attr)
        EXL_TRY(get_path(c, at, item, attr, key));
    else
        *key = exl_jv_ref(item);
    if (cs || key->type != EXL_JV_STR)
        return EXL_OK;
    exl_str b = EXL_STR_INIT;
    int err = exl_str_append(&b, "", 0) || exl_jtext_case(key->u.s->data, key->u.s->len, EXL_JCASE_LOWER, &b);
    exl_jv_free(*key);
    *key = exl_jv_none();
    if (err || exl_jv_str_take(&b, key)) {
        exl_str_free(&b);
        return exl_jctx_nomem(c, at);
    }
    return EXL_OK;
}

/* Stable merge sort of idx[0..n) by keys. */
static exl_status merge_sort(exl_jctx *c, const exl_jnode *at, const exl_jv *keys, size_t *idx, size_t *tmp, size_t n,
                             int reverse) {
    if (n < 2)
        return EXL_OK;
    size_t h = n / 2;
    EXL_TRY(merge_sort(c, at, keys, idx, tmp, h, reverse));
    EXL_TRY(merge_sort(c, at, keys, idx + h, tmp, n - h, reverse));
    EXL_TRY(exl_jctx_charge(c, at, n));
    size_t i = 0, j = h, o = 0;
    while (i < h && j < n) {
        int cmp;
        if (exl_jv_compare(keys[idx[j]], keys[idx[i]], &cmp))
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "cannot sort %s with %s", exl_jv_type_name(keys[idx[j]]),
                                 exl_jv_type_name(keys[idx[i]]));
        tmp[o++] = (reverse ? cmp > 0 : cmp < 0) ? idx[j++] : idx[i++];
    }
    while (i < h)
        tmp[o++] = idx[i++];
    while (j < n)
        tmp[o++] = idx[j++];
    memcpy(idx, tmp, n * sizeof *idx);
    return EXL_OK;
}

/* sort (kind 0), unique (1), min (2), max (3). */
static exl_status ordered(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, int kind, exl_jv *out) {
    int reverse = kind == 0 && flag_arg(a, 0, "reverse");
    int cs = flag_arg(a, kind == 0 ? 1 : 0, "case_sensitive");
    const exl_jv *attr = exl_jargs_get(a, kind == 0 ? 2 : 1, "attribute");
    exl_jv items;
    EXL_TRY(exl_jctx_iterate(c, at, self, &items));
    size_t n = items.u.l->n;
    exl_jv *keys = exl_calloc(n ? n : 1, sizeof *keys);
    size_t *idx = exl_malloc((n ? n : 1) * sizeof *idx), *tmp = exl_malloc((n ? n : 1) * sizeof *tmp);
    exl_status st = keys && idx && tmp ? EXL_OK : exl_jctx_nomem(c, at);
    size_t nk = 0;
    for (; st == EXL_OK && nk < n; nk++) {
        idx[nk] = nk;
        st = sort_key(c, at, items.u.l->items[nk], attr, cs, &keys[nk]);
    }
    if (st == EXL_OK && kind != 1)
        st = merge_sort(c, at, keys, idx, tmp, n, reverse);
    if (st == EXL_OK && kind >= 2) {
        *out = n ? exl_jv_ref(items.u.l->items[idx[kind == 2 ? 0 : n - 1]]) : exl_jv_undef(NULL);
    } else if (st == EXL_OK) {
        st = exl_jv_list(n, out) ? exl_jctx_nomem(c, at) : EXL_OK;
        for (size_t i = 0; st == EXL_OK && i < n; i++) {
            int dup = 0;
            if (kind == 1) {
                st = exl_jctx_charge(c, at, i);
                for (size_t k = 0; k < i && !dup; k++)
                    dup = exl_jv_equal(keys[k], keys[i]);
            }
            if (!dup)
                out->u.l->items[out->u.l->n++] = exl_jv_ref(items.u.l->items[idx[i]]);
        }
        if (st && out->type == EXL_JV_LIST)
            exl_jv_free(*out);
    }
    for (size_t i = 0; keys && i < nk; i++)
        exl_jv_free(keys[i]);
    exl_free(keys);
    exl_free(idx);
    exl_free(tmp);
    exl_jv_free(items);
    return st;
}
static exl_status f_sort(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return ordered(c, at, self, a, 0, out);
}
static exl_status f_unique(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return ordered(c, at, self, a, 1, out);
}
static exl_status f_min(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return ordered(c, at, self, a, 2, out);
}
static exl_status f_max(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    return ordered(c, at, self, a, 3, out);
}

static exl_status f_dictsort(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    if (self.type != EXL_JV_DICT)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "dictsort needs a dict, not %s", exl_jv_type_name(self));
    const exl_jv *by = exl_jargs_get(a, 1, "by");
    int by_value = by && by->type == EXL_JV_STR && !strcmp(by->u.s->data, "value");
    exl_jv pairs, idx = exl_jv_int(by_value);
    int found;
    EXL_TRY(exl_jinja_method(c, at, self, "items", a, &pairs, &found));
    exl_jv sa[3] = {exl_jv_bool(flag_arg(a, 2, "reverse")), exl_jv_bool(flag_arg(a, 0, "case_sensitive")), idx};
    exl_jargs sargs = {3, sa, NULL};
    exl_status st = ordered(c, at, pairs, &sargs, 0, out);
    exl_jv_free(pairs);
    return st;
}

static exl_status f_reverse(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    exl_jv items;
    EXL_TRY(exl_jctx_iterate(c, at, self, &items));
    exl_status st = EXL_OK;
    if (self.type == EXL_JV_STR) {
        exl_str b = EXL_STR_INIT;
        int err = exl_str_append(&b, "", 0);
        for (size_t i = items.u.l->n; i-- > 0 && !err;)
            err = exl_jv_write_str(items.u.l->items[i], &b) != EXL_OK;
        st = err ? exl_jctx_nomem(c, at) : exl_jctx_take_str(c, at, &b, out);
        if (err)
            exl_str_free(&b);
    } else if (exl_jv_list(items.u.l->n, out)) {
        st = exl_jctx_nomem(c, at);
    } else {
        for (size_t i = items.u.l->n; i-- > 0;)
            out->u.l->items[out->u.l->n++] = exl_jv_ref(items.u.l->items[i]);
    }
    exl_jv_free(items);
    return st;
}

static exl_status f_sum(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *attr = exl_jargs_get(a, 0, "attribute"), *start = exl_jargs_get(a, 1, "start");
    exl_jv items;
    EXL_TRY(exl_jctx_iterate(c, at, self, &items));
    int64_t isum = start && start->type == EXL_JV_INT ? start->u.i : 0;
    double fsum = start ? exl_jv_num(*start) : 0;
    int is_float = start && start->type == EXL_JV_FLOAT;
    exl_status st = EXL_OK;
    for (size_t i = 0; st == EXL_OK && i < items.u.l->n; i++) {
        exl_jv v;
        if (attr)
            st = get_path(c, at, items.u.l->items[i], attr, &v);
        else
            v = exl_jv_ref(items.u.l->items[i]);
        if (st)
            break;
        if (!exl_jv_is_num(v))
            st = exl_jctx_fail(c, at, EXL_ERR_ARG, "sum of a %s", exl_jv_type_name(v));
        else if (v.type == EXL_JV_FLOAT)
            is_float = 1;
        else if (__builtin_add_overflow(isum, v.type == EXL_JV_INT ? v.u.i : v.u.b, &isum))
            st = exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "integer overflow");
        fsum += exl_jv_num(v);
        exl_jv_free(v);
    }
    exl_jv_free(items);
    *out = is_float ? exl_jv_float(fsum) : exl_jv_int(isum);
    return st;
}

/* ---------------------------------------------------------------- numbers */

static exl_status f_abs(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    if (self.type == EXL_JV_FLOAT)
        *out = exl_jv_float(fabs(self.u.f));
    else if ((self.type == EXL_JV_INT && self.u.i != INT64_MIN) || self.type == EXL_JV_BOOL)
        *out = exl_jv_int(self.type == EXL_JV_BOOL ? self.u.b : self.u.i < 0 ? -self.u.i : self.u.i);
    else
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "bad operand type for abs(): '%s'", exl_jv_type_name(self));
    return EXL_OK;
}

static exl_status f_round(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    if (!exl_jv_is_num(self))
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "round needs a number, not %s", exl_jv_type_name(self));
    const exl_jv *prec = exl_jargs_get(a, 0, "precision"), *method = exl_jargs_get(a, 1, "method");
    int64_t p = prec && prec->type == EXL_JV_INT ? prec->u.i : 0;
    if (p > 300)
        p = 300;
    if (p < -300)
        p = -300;
    double x = exl_jv_num(self), m = pow(10.0, (double)p), r;
    const char *how = method && method->type == EXL_JV_STR ? method->u.s->data : "common";
    if (!strcmp(how, "floor"))
        r = floor(x * m) / m;
    else if (!strcmp(how, "ceil"))
        r = ceil(x * m) / m;
    else if (!strcmp(how, "common"))
        r = nearbyint(x * m) / m; /* Python round(): half to even */
    else
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "round method must be common, ceil or floor");
    *out = exl_jv_float(isfinite(r) ? r : x);
    return EXL_OK;
}

static exl_status f_attr(exl_jctx *c, const exl_jnode *at, exl_jv self, const exl_jargs *a, exl_jv *out) {
    const exl_jv *name = exl_jargs_get(a, 0, NULL);
    if (!name || name->type != EXL_JV_STR)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "attr needs an attribute name");
    return exl_jctx_getattr(c, at, self, name->u.s->data, out);
}

/* ---------------------------------------------------------------- dispatch */

static const struct {
    const char *name;
    filter_fn fn;
} FILTERS[] = {
    {"abs", f_abs},           {"attr", f_attr},       {"capitalize", f_capitalize},
    {"count", f_length},      {"d", f_default},       {"default", f_default},
    {"dictsort", f_dictsort}, {"e", f_escape},        {"escape", f_escape},
    {"first", f_first},       {"float", f_float},     {"indent", f_indent},
    {"int", f_int},           {"items", f_items},     {"join", f_join},
    {"last", f_last},         {"length", f_length},   {"list", f_list},
    {"lower", f_lower},       {"map", f_map},         {"max", f_max},
    {"min", f_min},           {"reject", f_reject},   {"rejectattr", f_rejectattr},
    {"replace", f_replace},   {"reverse", f_reverse}, {"round", f_round},
    {"safe", f_safe},         {"select", f_select},   {"selectattr", f_selectattr},
    {"sort", f_sort},         {"string", f_string},   {"sum", f_sum},
    {"title", f_title},       {"tojson", f_tojson},   {"trim", f_trim},
    {"unique", f_unique},     {"upper", f_upper},
};

exl_status exl_jinja_filter(exl_jctx *c, const exl_jnode *at, const char *name, exl_jv self, const exl_jargs *a,
                            exl_jv *out) {
    *out = exl_jv_undef(NULL);
    for (size_t i = 0; i < sizeof FILTERS / sizeof FILTERS[0]; i++)
        if (!strcmp(FILTERS[i].name, name))
            return FILTERS[i].fn(c, at, self, a, out);
    return exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "unknown filter '%s'", name);
}
