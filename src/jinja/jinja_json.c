/* jinja_json.c - values from cJSON, and `tojson` as Python's
 * json.dumps(v, ensure_ascii=False, indent=..., sort_keys=...) writes them:
 * ", " and ": " separators without indent, "," and ": " with it. */
#include "jinja/jinja_eval.h"

#include "base/alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

exl_status exl_jv_from_json(const cJSON *j, exl_jv *out) {
    *out = exl_jv_none();
    if (cJSON_IsString(j))
        return exl_jv_str(j->valuestring ? j->valuestring : "", j->valuestring ? strlen(j->valuestring) : 0, out);
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        *out = d == floor(d) && fabs(d) <= 9007199254740992.0 ? exl_jv_int((int64_t)d) : exl_jv_float(d);
        return EXL_OK;
    }
    if (cJSON_IsBool(j)) {
        *out = exl_jv_bool(cJSON_IsTrue(j));
        return EXL_OK;
    }
    if (cJSON_IsArray(j)) {
        EXL_TRY(exl_jv_list(0, out));
        for (const cJSON *e = j->child; e; e = e->next) {
            exl_jv v;
            exl_status st = exl_jv_from_json(e, &v);
            if (st == EXL_OK)
                st = exl_jlist_push(out->u.l, v);
            if (st) {
                exl_jv_free(*out);
                return st;
            }
        }
        return EXL_OK;
    }
    if (cJSON_IsObject(j)) {
        EXL_TRY(exl_jv_dict(0, out));
        for (const cJSON *e = j->child; e; e = e->next) {
            exl_jv v;
            exl_status st = exl_jv_from_json(e, &v);
            if (st == EXL_OK && e->string)
                st = exl_jdict_set(out->u.d, e->string, strlen(e->string), v);
            else if (st == EXL_OK)
                exl_jv_free(v);
            if (st) {
                exl_jv_free(*out);
                return st;
            }
        }
    }
    return EXL_OK;
}

static int write_json_str(const char *s, size_t n, exl_str *out) {
    int err = exl_str_putc(out, '"');
    for (size_t i = 0; i < n && !err; i++) {
        unsigned char c = (unsigned char)s[i];
        switch (c) {
        case '"': err = exl_str_puts(out, "\\\""); break;
        case '\\': err = exl_str_puts(out, "\\\\"); break;
        case '\n': err = exl_str_puts(out, "\\n"); break;
        case '\r': err = exl_str_puts(out, "\\r"); break;
        case '\t': err = exl_str_puts(out, "\\t"); break;
        case '\b': err = exl_str_puts(out, "\\b"); break;
        case '\f': err = exl_str_puts(out, "\\f"); break;
        default: err = c < 0x20 ? exl_str_printf(out, "\\u%04x", c) : exl_str_putc(out, (char)c);
        }
    }
    return err || exl_str_putc(out, '"');
}

static int newline_indent(exl_str *out, int indent, int level) {
    if (indent < 0)
        return 0;
    int err = exl_str_putc(out, '\n');
    for (long i = 0; i < (long)indent * level && !err; i++)
        err = exl_str_putc(out, ' ');
    return err;
}

typedef struct keypos {
    const exl_jstr *key;
    size_t pos;
} keypos;

static int key_cmp(const void *a, const void *b) {
    const exl_jstr *x = ((const keypos *)a)->key, *y = ((const keypos *)b)->key;
    size_t n = x->len < y->len ? x->len : y->len;
    int c = memcmp(x->data, y->data, n);
    return c ? c : (x->len > y->len) - (x->len < y->len);
}

static exl_status write_json(exl_jv v, int indent, int sort_keys, int level, exl_str *out) {
    int err = 0;
    const char *sep = indent < 0 ? ", " : ",";
    switch (v.type) {
    case EXL_JV_NONE: err = exl_str_puts(out, "null"); break;
    case EXL_JV_BOOL: err = exl_str_puts(out, v.u.b ? "true" : "false"); break;
    case EXL_JV_INT: err = exl_str_printf(out, "%lld", (long long)v.u.i); break;
    case EXL_JV_FLOAT:
        if (isnan(v.u.f))
            err = exl_str_puts(out, "NaN");
        else if (isinf(v.u.f))
            err = exl_str_puts(out, v.u.f < 0 ? "-Infinity" : "Infinity");
        else
            return exl_jv_write_float(v.u.f, out);
        break;
    case EXL_JV_STR: err = write_json_str(v.u.s->data, v.u.s->len, out); break;
    case EXL_JV_LIST:
        if (v.u.l->n == 0) {
            err = exl_str_puts(out, "[]");
            break;
        }
        err = exl_str_putc(out, '[');
        for (size_t i = 0; i < v.u.l->n && !err; i++) {
            err = (i && exl_str_puts(out, sep)) || newline_indent(out, indent, level + 1);
            if (!err)
                EXL_TRY(write_json(v.u.l->items[i], indent, sort_keys, level + 1, out));
        }
        err = err || newline_indent(out, indent, level) || exl_str_putc(out, ']');
        break;
    case EXL_JV_DICT: {
        if (v.u.d->n == 0) {
            err = exl_str_puts(out, "{}");
            break;
        }
        /* Positions in key order: insertion order, or sorted by key. */
        keypos *order = exl_malloc(v.u.d->n * sizeof *order);
        if (!order)
            return EXL_ERR_NOMEM;
        for (size_t i = 0; i < v.u.d->n; i++)
            order[i] = (keypos){v.u.d->keys[i], i};
        if (sort_keys)
            qsort(order, v.u.d->n, sizeof *order, key_cmp);
        err = exl_str_putc(out, '{');
        exl_status st = EXL_OK;
        for (size_t i = 0; i < v.u.d->n && !err && !st; i++) {
            const exl_jstr *k = order[i].key;
            err = (i && exl_str_puts(out, sep)) || newline_indent(out, indent, level + 1) ||
                  write_json_str(k->data, k->len, out) || exl_str_puts(out, ": ");
            if (!err)
                st = write_json(v.u.d->vals[order[i].pos], indent, sort_keys, level + 1, out);
        }
        exl_free(order);
        if (st)
            return st;
        err = err || newline_indent(out, indent, level) || exl_str_putc(out, '}');
        break;
    }
    default: return EXL_ERR_ARG;
    }
    return err ? EXL_ERR_NOMEM : EXL_OK;
}

exl_status exl_jv_write_json(exl_jv v, int indent, int sort_keys, exl_str *out) {
    return write_json(v, indent, sort_keys, 0, out);
}
