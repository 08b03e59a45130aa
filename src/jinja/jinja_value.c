/* jinja_value.c - template values: allocation, reference counts, containers,
 * truthiness, equality, ordering and Python-style str()/repr(). */
#include "jinja/jinja_value.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- construction */

exl_status exl_jv_str(const char *s, size_t n, exl_jv *out) {
    if (n > SIZE_MAX - sizeof(exl_jstr) - 1)
        return EXL_ERR_NOMEM;
    exl_jstr *j = exl_malloc(sizeof *j + n + 1);
    if (!j)
        return EXL_ERR_NOMEM;
    j->rc = 1;
    j->len = n;
    if (n)
        memcpy(j->data, s, n);
    j->data[n] = 0;
    out->type = EXL_JV_STR;
    out->u.s = j;
    return EXL_OK;
}

exl_status exl_jv_str_take(exl_str *s, exl_jv *out) {
    exl_status st = exl_jv_str(s->data ? s->data : "", s->len, out);
    exl_str_free(s);
    return st;
}

exl_status exl_jv_list(size_t cap, exl_jv *out) {
    exl_jlist *l = exl_calloc(1, sizeof *l);
    if (!l)
        return EXL_ERR_NOMEM;
    l->rc = 1;
    if (cap) {
        l->items = exl_malloc(cap * sizeof *l->items);
        if (!l->items) {
            exl_free(l);
            return EXL_ERR_NOMEM;
        }
        l->cap = cap;
    }
    out->type = EXL_JV_LIST;
    out->u.l = l;
    return EXL_OK;
}

exl_status exl_jv_dict(size_t cap, exl_jv *out) {
    exl_jdict *d = exl_calloc(1, sizeof *d);
    if (!d)
        return EXL_ERR_NOMEM;
    d->rc = 1;
    if (cap) {
        d->keys = exl_malloc(cap * sizeof *d->keys);
        d->vals = exl_malloc(cap * sizeof *d->vals);
        if (!d->keys || !d->vals) {
            exl_free(d->keys);
            exl_free(d->vals);
            exl_free(d);
            return EXL_ERR_NOMEM;
        }
        d->cap = cap;
    }
    out->type = EXL_JV_DICT;
    out->u.d = d;
    return EXL_OK;
}

exl_status exl_jv_namespace(exl_jdict **chain, exl_jv *out) {
    EXL_TRY(exl_jv_dict(0, out));
    out->type = EXL_JV_NS;
    out->u.d->rc = 0;
    out->u.d->next_ns = *chain;
    *chain = out->u.d;
    return EXL_OK;
}

static void dict_release(exl_jdict *d) {
    for (size_t i = 0; i < d->n; i++) {
        exl_jv k = {EXL_JV_STR, {.s = d->keys[i]}};
        exl_jv_free(k);
        exl_jv_free(d->vals[i]);
    }
    exl_free(d->keys);
    exl_free(d->vals);
    exl_free(d->index);
    exl_free(d);
}

void exl_jv_namespaces_free(exl_jdict *chain) {
    while (chain) {
        exl_jdict *next = chain->next_ns;
        dict_release(chain);
        chain = next;
    }
}

void exl_jv_make_immortal(exl_jv v) {
    if (v.type == EXL_JV_STR)
        v.u.s->rc = 0;
}

void exl_jv_free_immortal(exl_jv v) {
    if (v.type == EXL_JV_STR && v.u.s->rc == 0)
        exl_free(v.u.s);
}

/* ---------------------------------------------------------------- reference counts */

static size_t *rc_of(exl_jv v) {
    switch (v.type) {
    case EXL_JV_STR: return &v.u.s->rc;
    case EXL_JV_LIST: return &v.u.l->rc;
    case EXL_JV_DICT: return &v.u.d->rc;
    case EXL_JV_LOOP: return &v.u.loop->rc;
    default: return NULL;
    }
}

exl_jv exl_jv_ref(exl_jv v) {
    size_t *rc = rc_of(v);
    if (rc && *rc)
        ++*rc;
    return v;
}

void exl_jv_free(exl_jv v) {
    size_t *rc = rc_of(v);
    if (!rc || *rc == 0 || --*rc > 0)
        return;
    switch (v.type) {
    case EXL_JV_STR: exl_free(v.u.s); break;
    case EXL_JV_LIST:
        for (size_t i = 0; i < v.u.l->n; i++)
            exl_jv_free(v.u.l->items[i]);
        exl_free(v.u.l->items);
        exl_free(v.u.l);
        break;
    case EXL_JV_DICT: dict_release(v.u.d); break;
    case EXL_JV_LOOP:
        exl_jv_free((exl_jv){EXL_JV_LIST, {.l = v.u.loop->items}});
        exl_free(v.u.loop);
        break;
    default: break;
    }
}

/* ---------------------------------------------------------------- containers */

exl_status exl_jlist_push(exl_jlist *l, exl_jv v) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 8;
        exl_jv *items = cap < SIZE_MAX / sizeof *items ? exl_realloc(l->items, cap * sizeof *items) : NULL;
        if (!items) {
            exl_jv_free(v);
            return EXL_ERR_NOMEM;
        }
        l->items = items;
        l->cap = cap;
    }
    l->items[l->n++] = v;
    return EXL_OK;
}

/* Small dicts are searched linearly; from INDEX_MIN keys on, a hash index keeps lookups
 * (and so building a dict from hostile JSON) linear overall. */
#define INDEX_MIN 16

static size_t key_hash(const char *key, size_t klen) {
    uint64_t h = 1469598103934665603u;
    for (size_t i = 0; i < klen; i++)
        h = (h ^ (unsigned char)key[i]) * 1099511628211u;
    return (size_t)h;
}

static ptrdiff_t dict_find(const exl_jdict *d, const char *key, size_t klen) {
    if (d->index) {
        size_t mask = d->index_cap - 1;
        for (size_t i = key_hash(key, klen) & mask; d->index[i]; i = (i + 1) & mask) {
            const exl_jstr *k = d->keys[d->index[i] - 1];
            if (k->len == klen && !memcmp(k->data, key, klen))
                return (ptrdiff_t)(d->index[i] - 1);
        }
        return -1;
    }
    for (size_t i = 0; i < d->n; i++)
        if (d->keys[i]->len == klen && !memcmp(d->keys[i]->data, key, klen))
            return (ptrdiff_t)i;
    return -1;
}

static void index_put(exl_jdict *d, size_t pos) {
    size_t mask = d->index_cap - 1;
    size_t i = key_hash(d->keys[pos]->data, d->keys[pos]->len) & mask;
    while (d->index[i])
        i = (i + 1) & mask;
    d->index[i] = pos + 1;
}

/* Make room in the index for n keys (rebuilding it when it grows). */
static int index_reserve(exl_jdict *d, size_t n) {
    if (n < INDEX_MIN || n * 2 <= d->index_cap)
        return 0;
    size_t cap = 64;
    while (cap < n * 2)
        cap *= 2;
    size_t *index = exl_calloc(cap, sizeof *index);
    if (!index)
        return -1;
    exl_free(d->index);
    d->index = index;
    d->index_cap = cap;
    for (size_t i = 0; i < d->n; i++)
        index_put(d, i);
    return 0;
}

exl_jv *exl_jdict_get(const exl_jdict *d, const char *key, size_t klen) {
    ptrdiff_t i = dict_find(d, key, klen);
    return i < 0 ? NULL : &d->vals[i];
}

exl_status exl_jdict_set_key(exl_jdict *d, exl_jstr *key, exl_jv v) {
    ptrdiff_t i = dict_find(d, key->data, key->len);
    if (i >= 0) {
        exl_jv_free(d->vals[i]);
        d->vals[i] = v;
        return EXL_OK;
    }
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 8;
        exl_jstr **keys = exl_realloc(d->keys, cap * sizeof *keys);
        if (keys)
            d->keys = keys;
        exl_jv *vals = keys ? exl_realloc(d->vals, cap * sizeof *vals) : NULL;
        if (!vals) {
            exl_jv_free(v);
            return EXL_ERR_NOMEM;
        }
        d->vals = vals;
        d->cap = cap;
    }
    if (index_reserve(d, d->n + 1)) {
        exl_jv_free(v);
        return EXL_ERR_NOMEM;
    }
    exl_jv k = exl_jv_ref((exl_jv){EXL_JV_STR, {.s = key}});
    d->keys[d->n] = k.u.s;
    d->vals[d->n++] = v;
    if (d->index)
        index_put(d, d->n - 1);
    return EXL_OK;
}

exl_status exl_jdict_set(exl_jdict *d, const char *key, size_t klen, exl_jv v) {
    ptrdiff_t i = dict_find(d, key, klen);
    if (i >= 0) {
        exl_jv_free(d->vals[i]);
        d->vals[i] = v;
        return EXL_OK;
    }
    exl_jv k;
    if (exl_jv_str(key, klen, &k) != EXL_OK) {
        exl_jv_free(v);
        return EXL_ERR_NOMEM;
    }
    exl_status st = exl_jdict_set_key(d, k.u.s, v);
    exl_jv_free(k);
    return st;
}

/* ---------------------------------------------------------------- inspection */

const char *exl_jv_type_name(exl_jv v) {
    switch (v.type) {
    case EXL_JV_UNDEF: return "undefined";
    case EXL_JV_NONE: return "none";
    case EXL_JV_BOOL: return "bool";
    case EXL_JV_INT: return "int";
    case EXL_JV_FLOAT: return "float";
    case EXL_JV_STR: return "string";
    case EXL_JV_LIST: return "list";
    case EXL_JV_DICT: return "dict";
    case EXL_JV_NS: return "namespace";
    case EXL_JV_MACRO: return "macro";
    case EXL_JV_LOOP: return "loop";
    }
    return "?";
}

int exl_jv_truthy(exl_jv v) {
    switch (v.type) {
    case EXL_JV_UNDEF:
    case EXL_JV_NONE: return 0;
    case EXL_JV_BOOL: return v.u.b;
    case EXL_JV_INT: return v.u.i != 0;
    case EXL_JV_FLOAT: return v.u.f != 0.0;
    case EXL_JV_STR: return v.u.s->len != 0;
    case EXL_JV_LIST: return v.u.l->n != 0;
    case EXL_JV_DICT: return v.u.d->n != 0;
    default: return 1;
    }
}

double exl_jv_num(exl_jv v) {
    switch (v.type) {
    case EXL_JV_BOOL: return v.u.b;
    case EXL_JV_INT: return (double)v.u.i;
    case EXL_JV_FLOAT: return v.u.f;
    default: return 0;
    }
}

static int64_t int_of(exl_jv v) { return v.type == EXL_JV_BOOL ? v.u.b : v.u.i; }

int exl_jv_equal(exl_jv a, exl_jv b) {
    if (exl_jv_is_num(a) && exl_jv_is_num(b)) {
        if (a.type != EXL_JV_FLOAT && b.type != EXL_JV_FLOAT)
            return int_of(a) == int_of(b);
        return exl_jv_num(a) == exl_jv_num(b);
    }
    if (a.type != b.type)
        return 0;
    switch (a.type) {
    case EXL_JV_UNDEF:
    case EXL_JV_NONE: return 1;
    case EXL_JV_STR: return a.u.s->len == b.u.s->len && !memcmp(a.u.s->data, b.u.s->data, a.u.s->len);
    case EXL_JV_LIST:
        if (a.u.l->n != b.u.l->n)
            return 0;
        for (size_t i = 0; i < a.u.l->n; i++)
            if (!exl_jv_equal(a.u.l->items[i], b.u.l->items[i]))
                return 0;
        return 1;
    case EXL_JV_DICT:
        if (a.u.d->n != b.u.d->n)
            return 0;
        for (size_t i = 0; i < a.u.d->n; i++) {
            exl_jv *o = exl_jdict_get(b.u.d, a.u.d->keys[i]->data, a.u.d->keys[i]->len);
            if (!o || !exl_jv_equal(a.u.d->vals[i], *o))
                return 0;
        }
        return 1;
    case EXL_JV_NS: return a.u.d == b.u.d;
    case EXL_JV_MACRO: return a.u.macro == b.u.macro;
    case EXL_JV_LOOP: return a.u.loop == b.u.loop;
    default: return 0;
    }
}

exl_status exl_jv_compare(exl_jv a, exl_jv b, int *cmp) {
    if (exl_jv_is_num(a) && exl_jv_is_num(b)) {
        if (a.type != EXL_JV_FLOAT && b.type != EXL_JV_FLOAT) {
            int64_t x = int_of(a), y = int_of(b);
            *cmp = (x > y) - (x < y);
        } else {
            double x = exl_jv_num(a), y = exl_jv_num(b);
            *cmp = (x > y) - (x < y);
        }
        return EXL_OK;
    }
    if (a.type == EXL_JV_STR && b.type == EXL_JV_STR) {
        /* Byte order of UTF-8 is code point order, as Python compares. */
        size_t n = a.u.s->len < b.u.s->len ? a.u.s->len : b.u.s->len;
        int c = memcmp(a.u.s->data, b.u.s->data, n);
        *cmp = c ? (c > 0) - (c < 0) : (a.u.s->len > b.u.s->len) - (a.u.s->len < b.u.s->len);
        return EXL_OK;
    }
    if (a.type == EXL_JV_LIST && b.type == EXL_JV_LIST) {
        size_t n = a.u.l->n < b.u.l->n ? a.u.l->n : b.u.l->n;
        for (size_t i = 0; i < n; i++) {
            if (exl_jv_equal(a.u.l->items[i], b.u.l->items[i]))
                continue;
            return exl_jv_compare(a.u.l->items[i], b.u.l->items[i], cmp);
        }
        *cmp = (a.u.l->n > b.u.l->n) - (a.u.l->n < b.u.l->n);
        return EXL_OK;
    }
    return EXL_ERR_ARG;
}

/* ---------------------------------------------------------------- str() and repr() */

exl_status exl_jv_write_float(double f, exl_str *out) {
    if (isnan(f))
        return exl_str_puts(out, "nan") ? EXL_ERR_NOMEM : EXL_OK;
    if (isinf(f))
        return exl_str_puts(out, f < 0 ? "-inf" : "inf") ? EXL_ERR_NOMEM : EXL_OK;
    /* The shortest digits that read back as f, laid out as Python's repr does:
     * positional for decimal exponents -5 < e < 16, else d.ddde+XX. */
    char buf[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*e", prec - 1, f);
        if (strtod(buf, NULL) == f)
            break;
    }
    char digits[24];
    int nd = 0, neg = buf[0] == '-';
    const char *p = buf + neg;
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9')
            digits[nd++] = *p;
    int exp = atoi(p + 1);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    exl_str s = EXL_STR_INIT;
    int err = neg ? exl_str_putc(&s, '-') : 0;
    if (exp < -4 || exp >= 16) {
        err |= exl_str_putc(&s, digits[0]);
        if (nd > 1) {
            err |= exl_str_putc(&s, '.');
            err |= exl_str_append(&s, digits + 1, (size_t)nd - 1);
        }
        err |= exl_str_printf(&s, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    } else if (exp < 0) {
        err |= exl_str_puts(&s, "0.");
        for (int i = 0; i < -exp - 1; i++)
            err |= exl_str_putc(&s, '0');
        err |= exl_str_append(&s, digits, (size_t)nd);
    } else {
        for (int i = 0; i <= exp; i++)
            err |= exl_str_putc(&s, i < nd ? digits[i] : '0');
        err |= exl_str_putc(&s, '.');
        if (nd > exp + 1)
            err |= exl_str_append(&s, digits + exp + 1, (size_t)(nd - exp - 1));
        else
            err |= exl_str_putc(&s, '0');
    }
    if (!err)
        err = exl_str_append(out, s.data, s.len);
    exl_str_free(&s);
    return err ? EXL_ERR_NOMEM : EXL_OK;
}

static exl_status write_str_repr(const exl_jstr *s, exl_str *out) {
    /* Python picks single quotes unless the text has ' and no ". */
    char q = memchr(s->data, '\'', s->len) && !memchr(s->data, '"', s->len) ? '"' : '\'';
    int err = exl_str_putc(out, q);
    for (size_t i = 0; i < s->len && !err; i++) {
        unsigned char c = (unsigned char)s->data[i];
        if (c == '\\' || c == (unsigned char)q)
            err = exl_str_putc(out, '\\') || exl_str_putc(out, (char)c);
        else if (c == '\n')
            err = exl_str_puts(out, "\\n");
        else if (c == '\r')
            err = exl_str_puts(out, "\\r");
        else if (c == '\t')
            err = exl_str_puts(out, "\\t");
        else if (c < 0x20 || c == 0x7f)
            err = exl_str_printf(out, "\\x%02x", c);
        else
            err = exl_str_putc(out, (char)c);
    }
    if (!err)
        err = exl_str_putc(out, q);
    return err ? EXL_ERR_NOMEM : EXL_OK;
}

static exl_status write_common(exl_jv v, exl_str *out, int repr) {
    int err = 0;
    switch (v.type) {
    case EXL_JV_UNDEF: return EXL_OK;
    case EXL_JV_NONE: err = exl_str_puts(out, "None"); break;
    case EXL_JV_BOOL: err = exl_str_puts(out, v.u.b ? "True" : "False"); break;
    case EXL_JV_INT: err = exl_str_printf(out, "%lld", (long long)v.u.i); break;
    case EXL_JV_FLOAT: return exl_jv_write_float(v.u.f, out);
    case EXL_JV_STR:
        if (repr)
            return write_str_repr(v.u.s, out);
        err = exl_str_append(out, v.u.s->data, v.u.s->len);
        break;
    case EXL_JV_LIST:
        err = exl_str_putc(out, v.u.l->tuple ? '(' : '[');
        for (size_t i = 0; i < v.u.l->n && !err; i++) {
            if (i)
                err = exl_str_puts(out, ", ");
            if (!err && exl_jv_write_repr(v.u.l->items[i], out))
                err = 1;
        }
        if (v.u.l->tuple && v.u.l->n == 1)
            err = err || exl_str_putc(out, ',');
        err = err || exl_str_putc(out, v.u.l->tuple ? ')' : ']');
        break;
    case EXL_JV_DICT:
        err = exl_str_putc(out, '{');
        for (size_t i = 0; i < v.u.d->n && !err; i++) {
            if (i)
                err = exl_str_puts(out, ", ");
            if (!err && write_str_repr(v.u.d->keys[i], out))
                err = 1;
            err = err || exl_str_puts(out, ": ");
            if (!err && exl_jv_write_repr(v.u.d->vals[i], out))
                err = 1;
        }
        err = err || exl_str_putc(out, '}');
        break;
    case EXL_JV_NS: err = exl_str_puts(out, "<Namespace>"); break;
    case EXL_JV_MACRO: err = exl_str_puts(out, "<Macro>"); break;
    case EXL_JV_LOOP: err = exl_str_puts(out, "<LoopContext>"); break;
    }
    return err ? EXL_ERR_NOMEM : EXL_OK;
}

exl_status exl_jv_write_str(exl_jv v, exl_str *out) { return write_common(v, out, 0); }

exl_status exl_jv_write_repr(exl_jv v, exl_str *out) { return write_common(v, out, 1); }
