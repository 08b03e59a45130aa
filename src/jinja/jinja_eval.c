/* jinja_eval.c - the tree-walking evaluator: scopes, statements, expressions and the
 * render entry point.
 *
 * Scoping follows Jinja: `for` bodies get a fresh frame per iteration (sets inside do
 * not leak out or into the next iteration), `if` does not open a scope, a macro sees its
 * own frame and the top-level one, and namespaces are the way to carry state out. */
#include "jinja/jinja_eval.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- errors and limits */

exl_status exl_jctx_fail(exl_jctx *c, const exl_jnode *at, exl_status st, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!at)
        return exl_fail(st, "%s: %s", c->t->name, msg);
    int line, col;
    exl_jinja_linecol(c->t, at->pos, &line, &col);
    return exl_fail(st, "%s:%d:%d: %s", c->t->name, line, col, msg);
}

exl_status exl_jctx_nomem(exl_jctx *c, const exl_jnode *at) {
    return exl_jctx_fail(c, at, EXL_ERR_NOMEM, "out of memory");
}

exl_status exl_jctx_charge(exl_jctx *c, const exl_jnode *at, uint64_t units) {
    c->steps += units;
    if (c->steps > c->lim.max_steps)
        return exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "template needs more than %llu steps",
                             (unsigned long long)c->lim.max_steps);
    return EXL_OK;
}

exl_status exl_jctx_check_size(exl_jctx *c, const exl_jnode *at, size_t bytes) {
    if (bytes > c->lim.max_bytes)
        return exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "value or output larger than %zu bytes", c->lim.max_bytes);
    return exl_jctx_charge(c, at, bytes / 64);
}

exl_status exl_jctx_take_str(exl_jctx *c, const exl_jnode *at, exl_str *s, exl_jv *out) {
    exl_status st = exl_jctx_check_size(c, at, s->len);
    if (st) {
        exl_str_free(s);
        return st;
    }
    return exl_jv_str_take(s, out) ? exl_jctx_nomem(c, at) : EXL_OK;
}

const exl_jv *exl_jargs_get(const exl_jargs *a, size_t index, const char *name) {
    size_t pos = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->kw && a->kw[i]) {
            if (name && !strcmp(a->kw[i], name))
                return &a->v[i];
        } else if (pos++ == index) {
            return &a->v[i];
        }
    }
    return NULL;
}

static const char *undef_name(exl_jv v) { return v.u.undef_name ? v.u.undef_name : "value"; }

/* ---------------------------------------------------------------- scopes */

static exl_status push_frame(exl_jctx *c, const exl_jnode *at) {
    if (c->n_frames == c->cap_frames) {
        size_t cap = c->cap_frames ? c->cap_frames * 2 : 16;
        exl_jdict **f = exl_realloc(c->frames, cap * sizeof *f);
        if (!f)
            return exl_jctx_nomem(c, at);
        c->frames = f;
        c->cap_frames = cap;
    }
    exl_jv d;
    if (exl_jv_dict(0, &d))
        return exl_jctx_nomem(c, at);
    c->frames[c->n_frames++] = d.u.d;
    return EXL_OK;
}

static void pop_frame(exl_jctx *c) {
    exl_jv d = {EXL_JV_DICT, {.d = c->frames[--c->n_frames]}};
    exl_jv_free(d);
}

static exl_jv lookup(exl_jctx *c, const char *name) {
    size_t len = strlen(name);
    for (size_t i = c->n_frames; i-- > 0;) {
        if (i < c->floor && i > 0)
            i = 0;
        exl_jv *v = exl_jdict_get(c->frames[i], name, len);
        if (v)
            return exl_jv_ref(*v);
    }
    return exl_jv_undef(name);
}

/* Bind v (taken) to the current frame. */
static exl_status bind(exl_jctx *c, const exl_jnode *at, const char *name, exl_jv v) {
    if (exl_jdict_set(c->frames[c->n_frames - 1], name, strlen(name), v))
        return exl_jctx_nomem(c, at);
    return EXL_OK;
}

/* Assign v (taken) to a NAME or a TUPLE of NAMEs (unpacking a list). */
static exl_status assign(exl_jctx *c, const exl_jnode *target, exl_jv v) {
    if (target->kind == EXL_JN_NAME)
        return bind(c, target, target->name, v);
    exl_status st = EXL_OK;
    if (v.type != EXL_JV_LIST || v.u.l->n != target->n_kids) {
        st = exl_jctx_fail(c, target, EXL_ERR_ARG, "cannot unpack %s into %zu names", exl_jv_type_name(v),
                           target->n_kids);
    }
    for (size_t i = 0; st == EXL_OK && i < target->n_kids; i++)
        st = assign(c, target->kids[i], exl_jv_ref(v.u.l->items[i]));
    exl_jv_free(v);
    return st;
}

/* ---------------------------------------------------------------- attributes and items */

static void loop_attr(const exl_jloop *lp, const char *name, exl_jv *out) {
    size_t i = lp->index0, n = lp->items->n;
    if (!strcmp(name, "index"))
        *out = exl_jv_int((int64_t)i + 1);
    else if (!strcmp(name, "index0"))
        *out = exl_jv_int((int64_t)i);
    else if (!strcmp(name, "revindex"))
        *out = exl_jv_int((int64_t)(n - i));
    else if (!strcmp(name, "revindex0"))
        *out = exl_jv_int((int64_t)(n - i - 1));
    else if (!strcmp(name, "first"))
        *out = exl_jv_bool(i == 0);
    else if (!strcmp(name, "last"))
        *out = exl_jv_bool(i + 1 == n);
    else if (!strcmp(name, "length"))
        *out = exl_jv_int((int64_t)n);
    else if (!strcmp(name, "depth"))
        *out = exl_jv_int(1);
    else if (!strcmp(name, "depth0"))
        *out = exl_jv_int(0);
    else if (!strcmp(name, "previtem"))
        *out = i > 0 ? exl_jv_ref(lp->items->items[i - 1]) : exl_jv_undef("loop.previtem");
    else if (!strcmp(name, "nextitem"))
        *out = i + 1 < n ? exl_jv_ref(lp->items->items[i + 1]) : exl_jv_undef("loop.nextitem");
    else
        *out = exl_jv_undef(NULL);
}

exl_status exl_jctx_getattr(exl_jctx *c, const exl_jnode *at, exl_jv v, const char *name, exl_jv *out) {
    switch (v.type) {
    case EXL_JV_UNDEF: return exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' is undefined", undef_name(v));
    case EXL_JV_DICT:
    case EXL_JV_NS: {
        exl_jv *x = exl_jdict_get(v.u.d, name, strlen(name));
        *out = x ? exl_jv_ref(*x) : exl_jv_undef(name);
        return EXL_OK;
    }
    case EXL_JV_LOOP: loop_attr(v.u.loop, name, out); return EXL_OK;
    default: *out = exl_jv_undef(name); return EXL_OK;
    }
}

/* Python index i into a sequence of n; -1 when out of range. */
static int64_t norm_index(int64_t i, size_t n) {
    if (i < 0)
        i += (int64_t)n;
    return i < 0 || (uint64_t)i >= n ? -1 : i;
}

static exl_status getitem(exl_jctx *c, const exl_jnode *at, exl_jv v, exl_jv key, exl_jv *out) {
    *out = exl_jv_undef(NULL);
    if (v.type == EXL_JV_UNDEF)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' is undefined", undef_name(v));
    if (v.type == EXL_JV_DICT || v.type == EXL_JV_NS || v.type == EXL_JV_LOOP) {
        if (key.type != EXL_JV_STR)
            return EXL_OK;
        EXL_TRY(exl_jctx_getattr(c, at, v, key.u.s->data, out));
        if (out->type == EXL_JV_UNDEF) /* its name would point into the key, which the caller frees */
            *out = exl_jv_undef(NULL);
        return EXL_OK;
    }
    if (key.type != EXL_JV_INT && key.type != EXL_JV_BOOL)
        return EXL_OK;
    int64_t k = key.type == EXL_JV_BOOL ? key.u.b : key.u.i;
    if (v.type == EXL_JV_LIST) {
        int64_t i = norm_index(k, v.u.l->n);
        if (i >= 0)
            *out = exl_jv_ref(v.u.l->items[i]);
    } else if (v.type == EXL_JV_STR) {
        int64_t i = norm_index(k, exl_jtext_len(v.u.s->data, v.u.s->len));
        if (i >= 0) {
            size_t a = exl_jtext_offset(v.u.s->data, v.u.s->len, (size_t)i);
            size_t b = exl_jtext_offset(v.u.s->data + a, v.u.s->len - a, 1);
            if (exl_jv_str(v.u.s->data + a, b, out))
                return exl_jctx_nomem(c, at);
        }
    }
    return EXL_OK;
}

/* Python slice bounds for a sequence of n. */
static exl_status slice_bounds(exl_jctx *c, const exl_jnode *at, const exl_jv *parts, size_t n, int64_t *start,
                               int64_t *stop, int64_t *step) {
    int64_t b[3];
    for (int k = 0; k < 3; k++) {
        if (parts[k].type == EXL_JV_NONE || parts[k].type == EXL_JV_UNDEF)
            b[k] = INT64_MIN;
        else if (parts[k].type == EXL_JV_INT || parts[k].type == EXL_JV_BOOL)
            b[k] = parts[k].type == EXL_JV_INT ? parts[k].u.i : parts[k].u.b;
        else
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "slice indices must be integers, not %s",
                                 exl_jv_type_name(parts[k]));
    }
    *step = b[2] == INT64_MIN ? 1 : b[2];
    if (*step == 0)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "slice step cannot be zero");
    /* As PySlice_AdjustIndices. */
    int64_t len = (int64_t)n, neg = *step < 0;
    for (int k = 0; k < 2; k++) {
        int64_t x = b[k];
        if (x == INT64_MIN) {
            x = k == 0 ? (neg ? len - 1 : 0) : (neg ? -1 : len);
        } else if (x < 0) {
            x = x < -len ? (neg ? -1 : 0) : x + len;
        } else if (x >= len) {
            x = neg ? len - 1 : len;
        }
        if (k == 0)
            *start = x;
        else
            *stop = x;
    }
    return EXL_OK;
}

static exl_status eval_slice(exl_jctx *c, const exl_jnode *at, exl_jv v, const exl_jv *parts, exl_jv *out) {
    if (v.type == EXL_JV_UNDEF)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' is undefined", undef_name(v));
    int is_str = v.type == EXL_JV_STR;
    if (!is_str && v.type != EXL_JV_LIST)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "cannot slice a %s", exl_jv_type_name(v));
    size_t n = is_str ? exl_jtext_len(v.u.s->data, v.u.s->len) : v.u.l->n;
    int64_t start = 0, stop = 0, step = 1;
    EXL_TRY(slice_bounds(c, at, parts, n, &start, &stop, &step));
    EXL_TRY(exl_jctx_charge(c, at, n));
    if (is_str) {
        /* Code point offsets, then copy the chosen characters. */
        size_t *off = exl_malloc((n + 1) * sizeof *off);
        if (!off)
            return exl_jctx_nomem(c, at);
        const char *s = v.u.s->data;
        for (size_t i = 0, o = 0; i <= n; i++) {
            off[i] = o;
            if (i < n)
                o += exl_jtext_offset(s + o, v.u.s->len - o, 1);
        }
        exl_str r = EXL_STR_INIT;
        int err = exl_str_append(&r, "", 0);
        for (int64_t i = start; !err && (step > 0 ? i < stop : i > stop); i += step)
            err = exl_str_append(&r, s + off[i], off[i + 1] - off[i]);
        exl_free(off);
        if (err) {
            exl_str_free(&r);
            return exl_jctx_nomem(c, at);
        }
        return exl_jctx_take_str(c, at, &r, out);
    }
    if (exl_jv_list(0, out))
        return exl_jctx_nomem(c, at);
    for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step)
        if (exl_jlist_push(out->u.l, exl_jv_ref(v.u.l->items[i]))) {
            exl_jv_free(*out);
            return exl_jctx_nomem(c, at);
        }
    return EXL_OK;
}

exl_status exl_jctx_iterate(exl_jctx *c, const exl_jnode *at, exl_jv v, exl_jv *list) {
    if (v.type == EXL_JV_LIST) {
        *list = exl_jv_ref(v);
        return EXL_OK;
    }
    if (exl_jv_list(0, list))
        return exl_jctx_nomem(c, at);
    exl_status st = EXL_OK;
    if (v.type == EXL_JV_DICT || v.type == EXL_JV_NS) {
        for (size_t i = 0; st == EXL_OK && i < v.u.d->n; i++)
            if (exl_jlist_push(list->u.l, exl_jv_ref((exl_jv){EXL_JV_STR, {.s = v.u.d->keys[i]}})))
                st = exl_jctx_nomem(c, at);
    } else if (v.type == EXL_JV_STR) {
        const char *s = v.u.s->data;
        for (size_t o = 0; st == EXL_OK && o < v.u.s->len;) {
            size_t k = exl_jtext_offset(s + o, v.u.s->len - o, 1);
            exl_jv ch;
            if (exl_jv_str(s + o, k, &ch) || exl_jlist_push(list->u.l, ch))
                st = exl_jctx_nomem(c, at);
            o += k;
        }
        if (st == EXL_OK)
            st = exl_jctx_charge(c, at, v.u.s->len);
    } else if (v.type != EXL_JV_UNDEF) {
        st = exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' object is not iterable", exl_jv_type_name(v));
    }
    if (st)
        exl_jv_free(*list);
    return st;
}

/* ---------------------------------------------------------------- operators */

static exl_status type_error(exl_jctx *c, const exl_jnode *at, const char *op, exl_jv a, exl_jv b) {
    return exl_jctx_fail(c, at, EXL_ERR_ARG, "unsupported operand types for %s: '%s' and '%s'", op, exl_jv_type_name(a),
                         exl_jv_type_name(b));
}

static int is_intlike(exl_jv v) { return v.type == EXL_JV_INT || v.type == EXL_JV_BOOL; }
static int64_t as_int(exl_jv v) { return v.type == EXL_JV_BOOL ? v.u.b : v.u.i; }

static exl_status repeat(exl_jctx *c, const exl_jnode *at, exl_jv seq, int64_t times, exl_jv *out) {
    if (times < 0)
        times = 0;
    size_t unit = seq.type == EXL_JV_STR ? seq.u.s->len : seq.u.l->n * sizeof(exl_jv);
    if (unit && (uint64_t)times > c->lim.max_bytes / unit + 1)
        return exl_jctx_check_size(c, at, SIZE_MAX);
    EXL_TRY(exl_jctx_check_size(c, at, unit * (size_t)times));
    if (seq.type == EXL_JV_STR) {
        exl_str r = EXL_STR_INIT;
        int err = exl_str_append(&r, "", 0);
        for (int64_t i = 0; i < times && !err; i++)
            err = exl_str_append(&r, seq.u.s->data, seq.u.s->len);
        if (err) {
            exl_str_free(&r);
            return exl_jctx_nomem(c, at);
        }
        return exl_jctx_take_str(c, at, &r, out);
    }
    if (exl_jv_list(0, out))
        return exl_jctx_nomem(c, at);
    for (int64_t i = 0; i < times; i++)
        for (size_t k = 0; k < seq.u.l->n; k++)
            if (exl_jlist_push(out->u.l, exl_jv_ref(seq.u.l->items[k]))) {
                exl_jv_free(*out);
                return exl_jctx_nomem(c, at);
            }
    return EXL_OK;
}

static exl_status concat_seq(exl_jctx *c, const exl_jnode *at, exl_jv a, exl_jv b, exl_jv *out) {
    if (a.type == EXL_JV_STR) {
        EXL_TRY(exl_jctx_check_size(c, at, a.u.s->len + b.u.s->len));
        exl_str r = EXL_STR_INIT;
        if (exl_str_append(&r, a.u.s->data, a.u.s->len) || exl_str_append(&r, b.u.s->data, b.u.s->len)) {
            exl_str_free(&r);
            return exl_jctx_nomem(c, at);
        }
        return exl_jctx_take_str(c, at, &r, out);
    }
    EXL_TRY(exl_jctx_check_size(c, at, (a.u.l->n + b.u.l->n) * sizeof(exl_jv)));
    if (exl_jv_list(a.u.l->n + b.u.l->n, out))
        return exl_jctx_nomem(c, at);
    for (size_t i = 0; i < a.u.l->n; i++)
        out->u.l->items[out->u.l->n++] = exl_jv_ref(a.u.l->items[i]);
    for (size_t i = 0; i < b.u.l->n; i++)
        out->u.l->items[out->u.l->n++] = exl_jv_ref(b.u.l->items[i]);
    return EXL_OK;
}

static exl_status int_arith(exl_jctx *c, const exl_jnode *at, int op, int64_t x, int64_t y, exl_jv *out) {
    int64_t r = 0;
    int ovf = 0;
    switch (op) {
    case EXL_JOP_ADD: ovf = __builtin_add_overflow(x, y, &r); break;
    case EXL_JOP_SUB: ovf = __builtin_sub_overflow(x, y, &r); break;
    case EXL_JOP_MUL: ovf = __builtin_mul_overflow(x, y, &r); break;
    case EXL_JOP_FLOORDIV:
    case EXL_JOP_MOD:
        if (y == 0)
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "integer division or modulo by zero");
        if (x == INT64_MIN && y == -1) {
            ovf = op == EXL_JOP_FLOORDIV;
            r = 0;
            break;
        }
        {
            int64_t q = x / y, m = x % y;
            if (m != 0 && ((m < 0) != (y < 0))) {
                q--;
                m += y;
            }
            r = op == EXL_JOP_FLOORDIV ? q : m;
        }
        break;
    case EXL_JOP_POW:
        if (y < 0) {
            *out = exl_jv_float(pow((double)x, (double)y));
            return EXL_OK;
        }
        r = 1;
        for (int64_t b = x, e = y; e && !ovf; e >>= 1) {
            if (e & 1)
                ovf = __builtin_mul_overflow(r, b, &r);
            if (e > 1 && !ovf)
                ovf = __builtin_mul_overflow(b, b, &b);
        }
        break;
    default: break;
    }
    if (ovf)
        return exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "integer overflow");
    *out = exl_jv_int(r);
    return EXL_OK;
}

static exl_status binary(exl_jctx *c, const exl_jnode *at, int op, exl_jv a, exl_jv b, exl_jv *out) {
    static const char *const names[] = {"", "+", "-", "*", "/", "//", "%", "**", "~"};
    if (op == EXL_JOP_CONCAT) {
        exl_str r = EXL_STR_INIT;
        if (exl_str_append(&r, "", 0) || exl_jv_write_str(a, &r) || exl_jv_write_str(b, &r)) {
            exl_str_free(&r);
            return exl_jctx_nomem(c, at);
        }
        return exl_jctx_take_str(c, at, &r, out);
    }
    if (is_intlike(a) && is_intlike(b) && op != EXL_JOP_DIV)
        return int_arith(c, at, op, as_int(a), as_int(b), out);
    if (exl_jv_is_num(a) && exl_jv_is_num(b)) {
        double x = exl_jv_num(a), y = exl_jv_num(b), r = 0;
        switch (op) {
        case EXL_JOP_ADD: r = x + y; break;
        case EXL_JOP_SUB: r = x - y; break;
        case EXL_JOP_MUL: r = x * y; break;
        case EXL_JOP_POW: r = pow(x, y); break;
        default:
            if (y == 0)
                return exl_jctx_fail(c, at, EXL_ERR_ARG, "division by zero");
            if (op == EXL_JOP_DIV)
                r = x / y;
            else if (op == EXL_JOP_FLOORDIV)
                r = floor(x / y);
            else {
                r = fmod(x, y);
                if (r != 0 && ((r < 0) != (y < 0)))
                    r += y;
            }
        }
        *out = exl_jv_float(r);
        return EXL_OK;
    }
    if (op == EXL_JOP_ADD && a.type == b.type && (a.type == EXL_JV_STR || a.type == EXL_JV_LIST))
        return concat_seq(c, at, a, b, out);
    if (op == EXL_JOP_MUL && (a.type == EXL_JV_STR || a.type == EXL_JV_LIST) && is_intlike(b))
        return repeat(c, at, a, as_int(b), out);
    if (op == EXL_JOP_MUL && (b.type == EXL_JV_STR || b.type == EXL_JV_LIST) && is_intlike(a))
        return repeat(c, at, b, as_int(a), out);
    if (a.type == EXL_JV_UNDEF || b.type == EXL_JV_UNDEF)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' is undefined", undef_name(a.type == EXL_JV_UNDEF ? a : b));
    return type_error(c, at, names[op], a, b);
}

static exl_status contains(exl_jctx *c, const exl_jnode *at, exl_jv item, exl_jv seq, int *out) {
    *out = 0;
    switch (seq.type) {
    case EXL_JV_STR:
        if (item.type != EXL_JV_STR)
            return exl_jctx_fail(c, at, EXL_ERR_ARG, "'in <string>' requires string as left operand, not %s",
                                 exl_jv_type_name(item));
        *out = item.u.s->len == 0 || memmem(seq.u.s->data, seq.u.s->len, item.u.s->data, item.u.s->len) != NULL;
        return exl_jctx_charge(c, at, seq.u.s->len / 16);
    case EXL_JV_LIST:
        for (size_t i = 0; i < seq.u.l->n && !*out; i++)
            *out = exl_jv_equal(item, seq.u.l->items[i]);
        return exl_jctx_charge(c, at, seq.u.l->n);
    case EXL_JV_DICT:
    case EXL_JV_NS:
        *out = item.type == EXL_JV_STR && exl_jdict_get(seq.u.d, item.u.s->data, item.u.s->len);
        return EXL_OK;
    case EXL_JV_UNDEF: return exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' is undefined", undef_name(seq));
    default: return exl_jctx_fail(c, at, EXL_ERR_ARG, "argument of type '%s' is not iterable", exl_jv_type_name(seq));
    }
}

static exl_status compare(exl_jctx *c, const exl_jnode *at, int op, exl_jv a, exl_jv b, int *out) {
    int cmp;
    switch (op) {
    case EXL_JOP_EQ: *out = exl_jv_equal(a, b); return EXL_OK;
    case EXL_JOP_NE: *out = !exl_jv_equal(a, b); return EXL_OK;
    case EXL_JOP_IN: return contains(c, at, a, b, out);
    case EXL_JOP_NOTIN:
        EXL_TRY(contains(c, at, a, b, out));
        *out = !*out;
        return EXL_OK;
    default: break;
    }
    if (exl_jv_compare(a, b, &cmp) != EXL_OK) {
        static const char *const sym[] = {
            [EXL_JOP_LT] = "<", [EXL_JOP_LE] = "<=", [EXL_JOP_GT] = ">", [EXL_JOP_GE] = ">="};
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "'%s' not supported between '%s' and '%s'", sym[op],
                             exl_jv_type_name(a), exl_jv_type_name(b));
    }
    *out = op == EXL_JOP_LT ? cmp < 0 : op == EXL_JOP_LE ? cmp <= 0 : op == EXL_JOP_GT ? cmp > 0 : cmp >= 0;
    return EXL_OK;
}

/* ---------------------------------------------------------------- expressions */

static exl_status eval(exl_jctx *c, const exl_jnode *n, exl_jv *out);
static exl_status exec(exl_jctx *c, const exl_jnode *n);

/* Evaluate kids[first..] of n as call arguments. */
static exl_status eval_args(exl_jctx *c, const exl_jnode *n, size_t first, exl_jargs *a) {
    a->n = 0;
    a->kw = n->kw ? n->kw + first : NULL;
    a->v = exl_calloc(n->n_kids > first ? n->n_kids - first : 1, sizeof *a->v);
    if (!a->v)
        return exl_jctx_nomem(c, n);
    for (size_t i = first; i < n->n_kids; i++) {
        exl_status st = eval(c, n->kids[i], &a->v[a->n]);
        if (st)
            return st;
        a->n++;
    }
    return EXL_OK;
}

static void free_args(exl_jargs *a) {
    for (size_t i = 0; a->v && i < a->n; i++)
        exl_jv_free(a->v[i]);
    exl_free(a->v);
}

exl_status exl_jctx_call_macro(exl_jctx *c, const exl_jnode *at, exl_jv macro, const exl_jargs *a, exl_jv *out) {
    const exl_jnode *m = macro.u.macro;
    size_t n_params = (m->n_kids - 1) / 2;
    if (c->calls >= c->lim.max_calls)
        return exl_jctx_fail(c, at, EXL_ERR_UNSUPPORTED, "macro calls nested deeper than %d", c->lim.max_calls);
    size_t n_pos = 0;
    for (size_t i = 0; i < a->n; i++) {
        if (a->kw && a->kw[i]) {
            size_t k = 0;
            while (k < n_params && strcmp(m->kids[1 + 2 * k]->name, a->kw[i]))
                k++;
            if (k == n_params)
                return exl_jctx_fail(c, at, EXL_ERR_ARG, "macro '%s' has no parameter '%s'", m->name, a->kw[i]);
        } else {
            n_pos++;
        }
    }
    if (n_pos > n_params)
        return exl_jctx_fail(c, at, EXL_ERR_ARG, "macro '%s' takes not more than %zu argument(s)", m->name, n_params);
    size_t saved_floor = c->floor;
    EXL_TRY(push_frame(c, at));
    c->floor = c->n_frames - 1;
    c->calls++;
    exl_status st = EXL_OK;
    for (size_t k = 0; st == EXL_OK && k < n_params; k++) {
        const exl_jnode *param = m->kids[1 + 2 * k], *def = m->kids[2 + 2 * k];
        const exl_jv *given = exl_jargs_get(a, k, param->name);
        exl_jv v = exl_jv_undef(param->name);
        if (given)
            v = exl_jv_ref(*given);
        else if (def)
            st = eval(c, def, &v);
        if (st == EXL_OK)
            st = bind(c, param, param->name, v);
    }
    exl_str saved = c->out, body = EXL_STR_INIT;
    c->out = body;
    if (st == EXL_OK)
        st = exec(c, m->kids[0]);
    body = c->out;
    c->out = saved;
    c->flow = EXL_JFLOW_NONE;
    c->calls--;
    pop_frame(c);
    c->floor = saved_floor;
    if (st) {
        exl_str_free(&body);
        return st;
    }
    return exl_jctx_take_str(c, at, &body, out);
}

static exl_status eval_call(exl_jctx *c, const exl_jnode *n, exl_jv *out) {
    const exl_jnode *callee = n->kids[0];
    exl_jargs a;
    exl_jv obj = exl_jv_none();
    exl_status st = eval_args(c, n, 1, &a);
    if (st == EXL_OK && callee->kind == EXL_JN_ATTR) {
        st = eval(c, callee->kids[0], &obj);
        int found = 0;
        if (st == EXL_OK)
            st = exl_jinja_method(c, n, obj, callee->name, &a, out, &found);
        if (st == EXL_OK && !found) {
            exl_jv f;
            st = exl_jctx_getattr(c, n, obj, callee->name, &f);
            if (st == EXL_OK && f.type == EXL_JV_MACRO)
                st = exl_jctx_call_macro(c, n, f, &a, out);
            else if (st == EXL_OK)
                st = exl_jctx_fail(c, n, EXL_ERR_ARG, "'%s' has no method '%s'", exl_jv_type_name(obj), callee->name);
            exl_jv_free(f);
        }
    } else if (st == EXL_OK) {
        if (callee->kind == EXL_JN_NAME)
            obj = lookup(c, callee->name);
        else
            st = eval(c, callee, &obj);
        if (st == EXL_OK && obj.type == EXL_JV_MACRO) {
            st = exl_jctx_call_macro(c, n, obj, &a, out);
        } else if (st == EXL_OK && obj.type == EXL_JV_UNDEF && callee->kind == EXL_JN_NAME) {
            int found = 0;
            st = exl_jinja_global(c, n, callee->name, &a, out, &found);
            if (st == EXL_OK && !found)
                st = exl_jctx_fail(c, n, EXL_ERR_ARG, "'%s' is undefined", callee->name);
        } else if (st == EXL_OK) {
            st = exl_jctx_fail(c, n, EXL_ERR_ARG, "'%s' object is not callable", exl_jv_type_name(obj));
        }
    }
    exl_jv_free(obj);
    free_args(&a);
    return st;
}

static exl_status eval_compare(exl_jctx *c, const exl_jnode *n, exl_jv *out) {
    exl_jv left;
    EXL_TRY(eval(c, n->kids[0], &left));
    int r = 1;
    exl_status st = EXL_OK;
    for (size_t i = 1; st == EXL_OK && r && i < n->n_kids; i++) {
        exl_jv right;
        st = eval(c, n->kids[i], &right);
        if (st)
            break;
        st = compare(c, n, n->ops[i - 1], left, right, &r);
        exl_jv_free(left);
        left = right;
    }
    exl_jv_free(left);
    *out = exl_jv_bool(r);
    return st;
}

static exl_status eval_display(exl_jctx *c, const exl_jnode *n, exl_jv *out) {
    if (n->kind == EXL_JN_DICT) {
        if (exl_jv_dict(0, out))
            return exl_jctx_nomem(c, n);
        for (size_t i = 0; i + 1 < n->n_kids; i += 2) {
            exl_jv k, v;
            exl_status st = eval(c, n->kids[i], &k);
            if (st == EXL_OK && k.type != EXL_JV_STR) {
                st = exl_jctx_fail(c, n->kids[i], EXL_ERR_UNSUPPORTED, "dict keys must be strings, not %s",
                                   exl_jv_type_name(k));
                exl_jv_free(k);
            }
            if (st == EXL_OK) {
                st = eval(c, n->kids[i + 1], &v);
                if (st == EXL_OK && exl_jdict_set_key(out->u.d, k.u.s, v))
                    st = exl_jctx_nomem(c, n);
                exl_jv_free(k);
            }
            if (st) {
                exl_jv_free(*out);
                return st;
            }
        }
        return EXL_OK;
    }
    if (exl_jv_list(n->n_kids, out))
        return exl_jctx_nomem(c, n);
    out->u.l->tuple = n->kind == EXL_JN_TUPLE;
    for (size_t i = 0; i < n->n_kids; i++) {
        exl_status st = eval(c, n->kids[i], &out->u.l->items[i]);
        if (st) {
            exl_jv_free(*out);
            return st;
        }
        out->u.l->n++;
    }
    return EXL_OK;
}

static exl_status eval_node(exl_jctx *c, const exl_jnode *n, exl_jv *out) {
    *out = exl_jv_undef(NULL);
    EXL_TRY(exl_jctx_charge(c, n, 1));
    exl_jv a = exl_jv_none(), b = exl_jv_none();
    exl_status st = EXL_OK;
    switch (n->kind) {
    case EXL_JN_LIT: *out = exl_jv_ref(n->lit); return EXL_OK;
    case EXL_JN_NAME: *out = lookup(c, n->name); return EXL_OK;
    case EXL_JN_ATTR:
        EXL_TRY(eval(c, n->kids[0], &a));
        st = exl_jctx_getattr(c, n, a, n->name, out);
        break;
    case EXL_JN_ITEM:
        EXL_TRY(eval(c, n->kids[0], &a));
        if ((st = eval(c, n->kids[1], &b)) == EXL_OK)
            st = getitem(c, n, a, b, out);
        break;
    case EXL_JN_SLICE: {
        exl_jv parts[3] = {exl_jv_none(), exl_jv_none(), exl_jv_none()};
        st = eval(c, n->kids[0], &a);
        for (int k = 0; st == EXL_OK && k < 3; k++)
            if (n->kids[1 + k])
                st = eval(c, n->kids[1 + k], &parts[k]);
        if (st == EXL_OK)
            st = eval_slice(c, n, a, parts, out);
        for (int k = 0; k < 3; k++)
            exl_jv_free(parts[k]);
        break;
    }
    case EXL_JN_CALL: return eval_call(c, n, out);
    case EXL_JN_FILTER:
    case EXL_JN_TEST: {
        exl_jargs args = {0, NULL, NULL};
        st = eval(c, n->kids[0], &a);
        if (st == EXL_OK)
            st = eval_args(c, n, 1, &args);
        if (st == EXL_OK && n->kind == EXL_JN_FILTER) {
            st = exl_jinja_filter(c, n, n->name, a, &args, out);
        } else if (st == EXL_OK) {
            int r;
            st = exl_jinja_test(c, n, n->name, a, &args, &r);
            *out = exl_jv_bool(r != n->flag);
        }
        free_args(&args);
        break;
    }
    case EXL_JN_NEG:
    case EXL_JN_POS:
        EXL_TRY(eval(c, n->kids[0], &a));
        if (!exl_jv_is_num(a))
            st = exl_jctx_fail(c, n, EXL_ERR_ARG, "bad operand type for unary %c: '%s'",
                               n->kind == EXL_JN_NEG ? '-' : '+', exl_jv_type_name(a));
        else if (a.type == EXL_JV_FLOAT)
            *out = exl_jv_float(n->kind == EXL_JN_NEG ? -a.u.f : a.u.f);
        else if (n->kind == EXL_JN_POS)
            *out = exl_jv_int(as_int(a));
        else
            st = int_arith(c, n, EXL_JOP_SUB, 0, as_int(a), out);
        break;
    case EXL_JN_NOT:
        EXL_TRY(eval(c, n->kids[0], &a));
        *out = exl_jv_bool(!exl_jv_truthy(a));
        break;
    case EXL_JN_AND:
    case EXL_JN_OR:
        EXL_TRY(eval(c, n->kids[0], &a));
        if (exl_jv_truthy(a) == (n->kind == EXL_JN_OR)) {
            *out = a;
            return EXL_OK;
        }
        exl_jv_free(a);
        return eval(c, n->kids[1], out);
    case EXL_JN_BINARY:
        EXL_TRY(eval(c, n->kids[0], &a));
        if ((st = eval(c, n->kids[1], &b)) == EXL_OK)
            st = binary(c, n, n->op, a, b, out);
        break;
    case EXL_JN_COMPARE: return eval_compare(c, n, out);
    case EXL_JN_COND:
        EXL_TRY(eval(c, n->kids[1], &a));
        if (exl_jv_truthy(a))
            st = eval(c, n->kids[0], out);
        else if (n->n_kids > 2 && n->kids[2])
            st = eval(c, n->kids[2], out);
        break;
    case EXL_JN_LIST:
    case EXL_JN_TUPLE:
    case EXL_JN_DICT: return eval_display(c, n, out);
    default: return exl_jctx_fail(c, n, EXL_ERR_ARG, "statement used as an expression");
    }
    exl_jv_free(a);
    exl_jv_free(b);
    return st;
}

/* Evaluate n into *out (a new reference). On failure *out is undefined: whatever the
 * failing step had built is already freed. */
static exl_status eval(exl_jctx *c, const exl_jnode *n, exl_jv *out) {
    exl_status st = eval_node(c, n, out);
    if (st)
        *out = exl_jv_undef(NULL);
    return st;
}

/* ---------------------------------------------------------------- statements */

static exl_status emit(exl_jctx *c, const exl_jnode *at, exl_jv v) {
    size_t before = c->out.len;
    if (exl_jv_write_str(v, &c->out))
        return exl_jctx_nomem(c, at);
    return exl_jctx_check_size(c, at, before > c->out.len ? 0 : c->out.len);
}

static exl_status exec_for(exl_jctx *c, const exl_jnode *n) {
    const exl_jnode *target = n->kids[0], *filter = n->kids[2], *body = n->kids[3], *els = n->kids[4];
    exl_jv seq, items;
    EXL_TRY(eval(c, n->kids[1], &seq));
    exl_status st = exl_jctx_iterate(c, n, seq, &items);
    exl_jv_free(seq);
    if (st)
        return st;
    if (filter) {
        /* `for x in xs if cond`: the loop (and loop.length) sees only the kept items. */
        exl_jv kept = exl_jv_none();
        st = exl_jv_list(0, &kept) ? exl_jctx_nomem(c, n) : EXL_OK;
        for (size_t i = 0; st == EXL_OK && i < items.u.l->n; i++) {
            exl_jv cond = exl_jv_none();
            if ((st = push_frame(c, n)))
                break;
            st = assign(c, target, exl_jv_ref(items.u.l->items[i]));
            if (st == EXL_OK)
                st = eval(c, filter, &cond);
            pop_frame(c);
            int keep = exl_jv_truthy(cond);
            exl_jv_free(cond);
            if (st == EXL_OK && keep && exl_jlist_push(kept.u.l, exl_jv_ref(items.u.l->items[i])))
                st = exl_jctx_nomem(c, n);
        }
        exl_jv_free(items);
        if (st) {
            exl_jv_free(kept);
            return st;
        }
        items = kept;
    }
    if (items.u.l->n == 0) {
        exl_jv_free(items);
        return els ? exec(c, els) : EXL_OK;
    }
    exl_jloop *lp = exl_calloc(1, sizeof *lp);
    if (!lp) {
        exl_jv_free(items);
        return exl_jctx_nomem(c, n);
    }
    lp->rc = 1;
    lp->items = items.u.l;
    exl_jv loop = {EXL_JV_LOOP, {.loop = lp}};
    for (size_t i = 0; st == EXL_OK && i < items.u.l->n; i++) {
        lp->index0 = i;
        if ((st = exl_jctx_charge(c, n, 1)) || (st = push_frame(c, n)))
            break;
        st = assign(c, target, exl_jv_ref(items.u.l->items[i]));
        if (st == EXL_OK)
            st = bind(c, n, "loop", exl_jv_ref(loop));
        if (st == EXL_OK)
            st = exec(c, body);
        pop_frame(c);
        if (c->flow == EXL_JFLOW_BREAK) {
            c->flow = EXL_JFLOW_NONE;
            break;
        }
        c->flow = EXL_JFLOW_NONE;
    }
    exl_jv_free(loop);
    return st;
}

static exl_status exec_set(exl_jctx *c, const exl_jnode *n) {
    const exl_jnode *target = n->kids[0];
    exl_jv v;
    if (n->flag) {
        exl_str saved = c->out;
        c->out = (exl_str)EXL_STR_INIT;
        exl_status st = exec(c, n->kids[1]);
        exl_str body = c->out;
        c->out = saved;
        if (st) {
            exl_str_free(&body);
            return st;
        }
        EXL_TRY(exl_jctx_take_str(c, n, &body, &v));
    } else {
        EXL_TRY(eval(c, n->kids[1], &v));
    }
    if (target->kind != EXL_JN_ATTR)
        return assign(c, target, v);
    exl_jv obj;
    exl_status st = eval(c, target->kids[0], &obj);
    if (st == EXL_OK && obj.type != EXL_JV_NS)
        st = exl_jctx_fail(c, target, EXL_ERR_ARG, "cannot assign attribute on a %s (only on a namespace)",
                           exl_jv_type_name(obj));
    if (st == EXL_OK) {
        st = exl_jdict_set(obj.u.d, target->name, strlen(target->name), v) ? exl_jctx_nomem(c, n) : EXL_OK;
        v = exl_jv_none();
    }
    exl_jv_free(obj);
    exl_jv_free(v);
    return st;
}

static exl_status exec(exl_jctx *c, const exl_jnode *n) {
    EXL_TRY(exl_jctx_charge(c, n, 1));
    exl_jv v;
    switch (n->kind) {
    case EXL_JN_BLOCK:
        for (size_t i = 0; i < n->n_kids && c->flow == EXL_JFLOW_NONE; i++)
            EXL_TRY(exec(c, n->kids[i]));
        return EXL_OK;
    case EXL_JN_TEXT: return emit(c, n, n->lit);
    case EXL_JN_OUTPUT: {
        EXL_TRY(eval(c, n->kids[0], &v));
        exl_status st = emit(c, n, v);
        exl_jv_free(v);
        return st;
    }
    case EXL_JN_IF: {
        EXL_TRY(eval(c, n->kids[0], &v));
        int t = exl_jv_truthy(v);
        exl_jv_free(v);
        if (t)
            return exec(c, n->kids[1]);
        return n->n_kids > 2 && n->kids[2] ? exec(c, n->kids[2]) : EXL_OK;
    }
    case EXL_JN_FOR: return exec_for(c, n);
    case EXL_JN_SET: return exec_set(c, n);
    case EXL_JN_MACRO: return bind(c, n, n->name, (exl_jv){EXL_JV_MACRO, {.macro = n}});
    case EXL_JN_BREAK: c->flow = EXL_JFLOW_BREAK; return EXL_OK;
    case EXL_JN_CONTINUE: c->flow = EXL_JFLOW_CONTINUE; return EXL_OK;
    default: {
        EXL_TRY(eval(c, n, &v));
        exl_jv_free(v);
        return EXL_OK;
    }
    }
}

/* ---------------------------------------------------------------- entry point */

exl_status exl_jinja_render(const exl_jinja *t, const cJSON *context, const exl_jinja_limits *limits, char **out) {
    *out = NULL;
    exl_jctx c = {.t = t};
    c.lim.max_steps = limits && limits->max_steps ? limits->max_steps : EXL_JINJA_DEFAULT_STEPS;
    c.lim.max_bytes = limits && limits->max_bytes ? limits->max_bytes : EXL_JINJA_DEFAULT_BYTES;
    c.lim.max_calls = limits && limits->max_calls ? limits->max_calls : EXL_JINJA_DEFAULT_CALLS;
    if (context && !cJSON_IsObject(context))
        return exl_fail(EXL_ERR_ARG, "%s: the render context must be a JSON object", t->name);
    exl_status st = push_frame(&c, NULL);
    for (const cJSON *j = context ? context->child : NULL; st == EXL_OK && j; j = j->next) {
        exl_jv v;
        if (!j->string)
            continue;
        if ((st = exl_jv_from_json(j, &v)))
            st = exl_jctx_nomem(&c, NULL);
        else if (exl_jdict_set(c.frames[0], j->string, strlen(j->string), v))
            st = exl_jctx_nomem(&c, NULL);
    }
    if (st == EXL_OK && exl_str_append(&c.out, "", 0))
        st = exl_jctx_nomem(&c, NULL);
    if (st == EXL_OK)
        st = exec(&c, t->root);
    while (c.n_frames)
        pop_frame(&c);
    exl_free(c.frames);
    exl_jv_namespaces_free(c.namespaces);
    if (st) {
        exl_str_free(&c.out);
        return st;
    }
    *out = exl_str_steal(&c.out);
    return EXL_OK;
}
