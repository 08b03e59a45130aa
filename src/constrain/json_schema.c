/* json_schema.c - JSON Schema to GBNF (see json_schema.h). Each schema node becomes a GBNF
 * expression; objects, arrays and $defs get rules of their own, named after where they are.
 * The shared JSON pieces (whitespace, strings, numbers, any value) are written once, at the end,
 * when something used them. */
#include "constrain/json_schema.h"

#include "base/alloc.h"
#include "base/error.h"
#include "constrain/int_range.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define MAX_DEPTH 64
#define MAX_COUNT 10000 /* the largest minItems / maxItems / maxLength written as a bound */
#define MAX_REFS 1024

/* the shared pieces, by bit */
enum { USE_WS = 1, USE_CHAR = 2, USE_STRING = 4, USE_INTEGER = 8, USE_NUMBER = 16, USE_VALUE = 32 };

static const char *const SHARED[] = {
    "json-ws ::= | \" \" | \"\\n\" [ \\t]{0,16}\n",
    "json-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})\n",
    "json-string ::= \"\\\"\" json-char* \"\\\"\"\n",
    "json-integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n",
    "json-number ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15}) (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n",
    "json-value ::= json-object | json-array | json-string | json-number | \"true\" | \"false\" | \"null\"\n"
    "json-object ::= \"{\" json-ws (json-string json-ws \":\" json-ws json-value json-ws (\",\" json-ws json-string "
    "json-ws \":\" json-ws json-value json-ws)*)? \"}\"\n"
    "json-array ::= \"[\" json-ws (json-value json-ws (\",\" json-ws json-value json-ws)*)? \"]\"\n",
};

typedef struct ref_rule {
    const cJSON *node;
    char name[80];
} ref_rule;

typedef struct sc {
    const cJSON *root;
    int strict;
    const char *prefix; /* of every rule name but the shared ones */
    exl_str rules;
    unsigned used;
    int n_names; /* for unique rule names */
    ref_rule refs[MAX_REFS];
    int n_refs;
    int depth;
    char path[512]; /* where in the schema (for messages) */
    int fail;       /* out of memory */
} sc;

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "json schema: out of memory"); }

static exl_status unsupported(const sc *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static exl_status unsupported(const sc *c, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return exl_fail(EXL_ERR_UNSUPPORTED, "json schema at %s: %s", c->path[0] ? c->path : "#", msg);
}

static void put(sc *c, exl_str *s, const char *text) { c->fail |= exl_str_puts(s, text); }

/* A GBNF literal of bytes s[0..n) ("...", escaped). */
static void put_literal(sc *c, exl_str *s, const char *t, size_t n) {
    put(c, s, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)t[i];
        char buf[8];
        if (ch == '"' || ch == '\\')
            snprintf(buf, sizeof buf, "\\%c", ch);
        else if (ch < 0x20 || ch == 0x7F)
            snprintf(buf, sizeof buf, "\\x%02X", ch);
        else
            buf[0] = (char)ch, buf[1] = 0;
        put(c, s, buf);
    }
    put(c, s, "\"");
}

/* A JSON value as the literal of its compact text. */
static exl_status put_json_literal(sc *c, exl_str *s, const cJSON *v) {
    char *text = cJSON_PrintUnformatted(v);
    if (!text)
        return nomem();
    put_literal(c, s, text, strlen(text));
    cJSON_free(text);
    return EXL_OK;
}

/* A fresh rule name from a hint: letters, digits and '-' only. */
static void rule_name(sc *c, const char *hint, char *out, size_t size) {
    char clean[48];
    size_t k = 0;
    for (const char *p = hint; *p && k + 1 < sizeof clean; p++)
        clean[k++] = (*p >= 'a' && *p <= 'z') || (*p >= 'A' && *p <= 'Z') || (*p >= '0' && *p <= '9') ? *p : '-';
    clean[k] = 0;
    snprintf(out, size, "%ss%d-%s", c->prefix, c->n_names++, clean);
}

/* Path bookkeeping for messages. */
static size_t path_push(sc *c, const char *part) {
    size_t at = strlen(c->path);
    snprintf(c->path + at, sizeof c->path - at, "%s%s", at ? "/" : "#/", part);
    return at;
}
static void path_pop(sc *c, size_t at) { c->path[at] = 0; }

/* ---------------------------------------------------------------- keywords */

static const char *const ANNOTATIONS[] = {"title", "description", "default", "examples",    "$schema",
                                          "$id",   "$comment",    "$defs",   "definitions", NULL};
static const char *const HANDLED[] = {"type",
                                      "properties",
                                      "required",
                                      "additionalProperties",
                                      "items",
                                      "minItems",
                                      "maxItems",
                                      "enum",
                                      "const",
                                      "anyOf",
                                      "$ref",
                                      "minLength",
                                      "maxLength",
                                      "minimum",
                                      "maximum",
                                      "exclusiveMinimum",
                                      "exclusiveMaximum",
                                      NULL};

static int in_list(const char *const *list, const char *k) {
    for (; *list; list++)
        if (!strcmp(*list, k))
            return 1;
    return 0;
}

static exl_status check_keywords(const sc *c, const cJSON *s) {
    if (!c->strict)
        return EXL_OK;
    for (const cJSON *k = s->child; k; k = k->next)
        if (!in_list(ANNOTATIONS, k->string) && !in_list(HANDLED, k->string))
            return unsupported(c, "the keyword '%.100s' is not supported", k->string);
    return EXL_OK;
}

/* A non-negative integer keyword; -1 when absent. */
static exl_status count_keyword(const sc *c, const cJSON *s, const char *name, int64_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, name);
    *out = -1;
    if (!v)
        return EXL_OK;
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != floor(v->valuedouble))
        return unsupported(c, "'%s' must be a non-negative integer", name);
    if (v->valuedouble > MAX_COUNT)
        return unsupported(c, "'%s' above 10000 is not supported", name);
    *out = (int64_t)v->valuedouble;
    return EXL_OK;
}

/* ---------------------------------------------------------------- nodes */

static exl_status node(sc *c, const cJSON *s, const char *hint, exl_str *expr);

static exl_status string_expr(sc *c, const cJSON *s, exl_str *expr) {
    int64_t lo, hi;
    EXL_TRY(count_keyword(c, s, "minLength", &lo));
    EXL_TRY(count_keyword(c, s, "maxLength", &hi));
    if (lo < 0 && hi < 0) {
        c->used |= USE_STRING;
        put(c, expr, "json-string");
        return EXL_OK;
    }
    if (hi >= 0 && lo > hi)
        return unsupported(c, "%s", "minLength is above maxLength");
    c->used |= USE_CHAR;
    char buf[64];
    if (hi < 0)
        snprintf(buf, sizeof buf, "\"\\\"\" json-char{%lld,} \"\\\"\"", (long long)lo);
    else
        snprintf(buf, sizeof buf, "\"\\\"\" json-char{%lld,%lld} \"\\\"\"", (long long)(lo < 0 ? 0 : lo),
                 (long long)hi);
    put(c, expr, buf);
    return EXL_OK;
}

/* An integer bound: inclusive, rounded inward; *has 0 when absent. */
static exl_status int_bound(const sc *c, const cJSON *s, const char *name, int upper, int exclusive, int *has,
                            int64_t *v) {
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(s, name);
    *has = 0;
    if (!b || (exclusive && cJSON_IsBool(b)))
        return EXL_OK; /* draft 4's boolean exclusiveMinimum: read with minimum below */
    if (!cJSON_IsNumber(b) || !isfinite(b->valuedouble))
        return unsupported(c, "'%s' must be a number", name);
    double x = upper ? floor(b->valuedouble) : ceil(b->valuedouble);
    if (exclusive && x == b->valuedouble)
        x += upper ? -1 : 1;
    x = x > 1e17 ? 1e17 : x < -1e17 ? -1e17 : x;
    *has = 1;
    *v = (int64_t)x;
    return EXL_OK;
}

static exl_status integer_expr(sc *c, const cJSON *s, exl_str *expr) {
    int has[4];
    int64_t v[4];
    EXL_TRY(int_bound(c, s, "minimum", 0, 0, &has[0], &v[0]));
    EXL_TRY(int_bound(c, s, "exclusiveMinimum", 0, 1, &has[1], &v[1]));
    EXL_TRY(int_bound(c, s, "maximum", 1, 0, &has[2], &v[2]));
    EXL_TRY(int_bound(c, s, "exclusiveMaximum", 1, 1, &has[3], &v[3]));
    if (!has[0] && !has[1] && !has[2] && !has[3]) {
        c->used |= USE_INTEGER;
        put(c, expr, "json-integer");
        return EXL_OK;
    }
    int64_t lo = -EXL_INT_RANGE_LIMIT, hi = EXL_INT_RANGE_LIMIT;
    for (int i = 0; i < 2; i++)
        if (has[i] && v[i] > lo)
            lo = v[i];
    for (int i = 2; i < 4; i++)
        if (has[i] && v[i] < hi)
            hi = v[i];
    if (lo > hi || lo > EXL_INT_RANGE_LIMIT || hi < -EXL_INT_RANGE_LIMIT)
        return unsupported(c, "%s", "the integer range is empty (or beyond 16 digits)");
    c->fail |= exl_int_range_gbnf(lo, hi, expr);
    return EXL_OK;
}

static exl_status number_expr(sc *c, const cJSON *s, exl_str *expr) {
    static const char *const bounds[] = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"};
    for (int i = 0; i < 4; i++)
        if (c->strict && cJSON_GetObjectItemCaseSensitive(s, bounds[i]))
            return unsupported(c, "'%s' on a number (not an integer) is not supported", bounds[i]);
    c->used |= USE_NUMBER;
    put(c, expr, "json-number");
    return EXL_OK;
}

static exl_status array_expr(sc *c, const cJSON *s, const char *hint, exl_str *expr) {
    int64_t lo, hi;
    EXL_TRY(count_keyword(c, s, "minItems", &lo));
    EXL_TRY(count_keyword(c, s, "maxItems", &hi));
    lo = lo < 0 ? 0 : lo;
    if (hi >= 0 && lo > hi)
        return unsupported(c, "%s", "minItems is above maxItems");
    const cJSON *items = cJSON_GetObjectItemCaseSensitive(s, "items");
    if (items && !cJSON_IsObject(items) && !cJSON_IsBool(items))
        return unsupported(c, "%s", "'items' as a list (tuple validation) is not supported");
    exl_str item = EXL_STR_INIT;
    size_t at = path_push(c, "items");
    exl_status st = EXL_OK;
    if (items)
        st = node(c, items, hint, &item);
    else
        put(c, &item, "json-value"), c->used |= USE_VALUE;
    path_pop(c, at);
    c->used |= USE_WS;
    if (st == EXL_OK) {
        char name[80], buf[96];
        rule_name(c, hint, name, sizeof name);
        exl_str *r = &c->rules;
        put(c, r, name);
        put(c, r, " ::= \"[\" json-ws ");
        if (hi != 0) {
            put(c, r, lo == 0 ? "(" : "");
            put(c, r, item.data);
            put(c, r, " json-ws (\",\" json-ws ");
            put(c, r, item.data);
            put(c, r, " json-ws)");
            int64_t rmin = lo > 0 ? lo - 1 : 0;
            if (hi < 0)
                snprintf(buf, sizeof buf, "{%lld,}", (long long)rmin);
            else
                snprintf(buf, sizeof buf, "{%lld,%lld}", (long long)rmin, (long long)(hi - 1));
            put(c, r, buf);
            put(c, r, lo == 0 ? ")? " : " ");
        }
        put(c, r, "\"]\"\n");
        put(c, expr, name);
    }
    exl_str_free(&item);
    return st;
}

/* One property: "key" ws ":" ws value ws, into out. */
static exl_status property(sc *c, const cJSON *p, const char *hint, exl_str *out) {
    cJSON *key = cJSON_CreateString(p->string);
    if (!key)
        return nomem();
    exl_status st = put_json_literal(c, out, key);
    cJSON_Delete(key);
    put(c, out, " json-ws \":\" json-ws ");
    char sub[64];
    snprintf(sub, sizeof sub, "%.20s-%.30s", hint, p->string);
    size_t at = path_push(c, "properties");
    path_push(c, p->string);
    if (st == EXL_OK)
        st = node(c, p, sub, out);
    path_pop(c, at);
    put(c, out, " json-ws");
    return st;
}

static int is_required(const cJSON *req, const char *name) {
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
        if (cJSON_IsString(r) && !strcmp(r->valuestring, name))
            return 1;
    return 0;
}

/* Properties in their declared order when some are optional: a_i follows what was written
 * (each property after a comma), b_i comes when nothing was written yet; the body is b_0.
 *   a_i ::= ("," ws P_i)? a_(i+1)      b_i ::= P_i a_(i+1) | b_(i+1)    (P_i optional)
 *   a_i ::= "," ws P_i a_(i+1)         b_i ::= P_i a_(i+1)              (P_i required) */
static void property_chain(sc *c, const exl_str *kv, const uint8_t *required, int n, const char *obj, exl_str *body) {
    exl_str *r = &c->rules;
    for (int i = n - 1; i >= 0; i--) {
        char next_a[96] = "", next_b[96] = "";
        if (i + 1 < n) {
            snprintf(next_a, sizeof next_a, " %s-a%d", obj, i + 1);
            snprintf(next_b, sizeof next_b, " | %s-b%d", obj, i + 1);
        } else if (!required[i]) {
            snprintf(next_b, sizeof next_b, " | \"\"");
        }
        c->fail |= exl_str_printf(r, "%s-a%d ::= %s\",\" json-ws %s%s%s\n", obj, i, required[i] ? "" : "(", kv[i].data,
                                  required[i] ? "" : ")?", next_a);
        c->fail |= exl_str_printf(r, "%s-b%d ::= %s%s%s\n", obj, i, kv[i].data, next_a, required[i] ? "" : next_b);
    }
    c->fail |= exl_str_printf(body, " %s-b0", obj);
}

static exl_status object_expr(sc *c, const cJSON *s, const char *hint, exl_str *expr) {
    const cJSON *props = cJSON_GetObjectItemCaseSensitive(s, "properties");
    const cJSON *req = cJSON_GetObjectItemCaseSensitive(s, "required");
    const cJSON *extra = cJSON_GetObjectItemCaseSensitive(s, "additionalProperties");
    if (props && !cJSON_IsObject(props))
        return unsupported(c, "%s", "'properties' must be an object");
    if (req && !cJSON_IsArray(req))
        return unsupported(c, "%s", "'required' must be a list of names");
    for (const cJSON *r = req ? req->child : NULL; r; r = r->next)
        if (!cJSON_IsString(r) || (c->strict && !cJSON_GetObjectItemCaseSensitive(props, r->valuestring)))
            return unsupported(c, "'required' names '%.100s', which is not among the properties",
                               cJSON_IsString(r) ? r->valuestring : "?");
    int n_props = props ? cJSON_GetArraySize(props) : 0;
    c->used |= USE_WS;
    if (n_props == 0 && !cJSON_IsFalse(extra)) { /* any object, its values as additionalProperties says */
        if (!extra || cJSON_IsTrue(extra)) {
            c->used |= USE_VALUE;
            put(c, expr, "json-object");
            return EXL_OK;
        }
        exl_str val = EXL_STR_INIT;
        size_t at = path_push(c, "additionalProperties");
        exl_status st = node(c, extra, hint, &val);
        path_pop(c, at);
        if (st == EXL_OK) {
            char name[80];
            rule_name(c, hint, name, sizeof name);
            c->used |= USE_STRING;
            put(c, &c->rules, name);
            put(c, &c->rules, " ::= \"{\" json-ws (json-string json-ws \":\" json-ws ");
            put(c, &c->rules, val.data);
            put(c, &c->rules, " json-ws (\",\" json-ws json-string json-ws \":\" json-ws ");
            put(c, &c->rules, val.data);
            put(c, &c->rules, " json-ws)*)? \"}\"\n");
            put(c, expr, name);
        }
        exl_str_free(&val);
        return st;
    }
    if (n_props && extra && !cJSON_IsFalse(extra) && c->strict)
        return unsupported(c, "%s", "additionalProperties must be false when properties are given");
    char obj[80];
    rule_name(c, hint, obj, sizeof obj);
    exl_str *kv = exl_calloc((size_t)(n_props ? n_props : 1), sizeof *kv);
    if (!kv)
        return nomem();
    exl_status st = EXL_OK;
    int n_req = 0, i = 0;
    for (const cJSON *p = props ? props->child : NULL; p && st == EXL_OK; p = p->next, i++)
        st = property(c, p, obj, &kv[i]);
    exl_str body = EXL_STR_INIT;
    uint8_t *required = st == EXL_OK ? exl_calloc((size_t)(n_props ? n_props : 1), 1) : NULL;
    if (st == EXL_OK && !required)
        st = nomem();
    i = 0;
    for (const cJSON *p = props ? props->child : NULL; p && st == EXL_OK; p = p->next, i++)
        n_req += required[i] = (uint8_t)is_required(req, p->string);
    for (i = 0; st == EXL_OK && n_req == n_props && i < n_props; i++) { /* all required: one sequence */
        put(c, &body, i ? " \",\" json-ws " : " ");
        put(c, &body, kv[i].data);
    }
    if (st == EXL_OK && n_req < n_props)
        property_chain(c, kv, required, n_props, obj, &body);
    if (st == EXL_OK) {
        put(c, &c->rules, obj);
        put(c, &c->rules, " ::= \"{\" json-ws");
        put(c, &c->rules, body.data ? body.data : "");
        put(c, &c->rules, " \"}\"\n");
        put(c, expr, obj);
    }
    for (i = 0; i < n_props; i++)
        exl_str_free(&kv[i]);
    exl_free(kv);
    exl_free(required);
    exl_str_free(&body);
    return st;
}

/* One type by name, with the schema's keywords for it. */
static exl_status typed(sc *c, const cJSON *s, const char *type, const char *hint, exl_str *expr) {
    if (!strcmp(type, "string"))
        return string_expr(c, s, expr);
    if (!strcmp(type, "integer"))
        return integer_expr(c, s, expr);
    if (!strcmp(type, "number"))
        return number_expr(c, s, expr);
    if (!strcmp(type, "boolean"))
        return put(c, expr, "(\"true\" | \"false\")"), EXL_OK;
    if (!strcmp(type, "null"))
        return put(c, expr, "\"null\""), EXL_OK;
    if (!strcmp(type, "object"))
        return object_expr(c, s, hint, expr);
    if (!strcmp(type, "array"))
        return array_expr(c, s, hint, expr);
    return unsupported(c, "the type '%.64s' is not a JSON Schema type", type);
}

/* "#", "#/$defs/x", "#/definitions/x": the rule of the referenced schema, compiled once. */
static exl_status reference(sc *c, const char *ref, exl_str *expr) {
    if (!strcmp(ref, "#"))
        return put(c, expr, c->prefix), put(c, expr, "root"), EXL_OK;
    const char *name = NULL;
    const cJSON *defs = NULL;
    if (!strncmp(ref, "#/$defs/", 8))
        name = ref + 8, defs = cJSON_GetObjectItemCaseSensitive(c->root, "$defs");
    else if (!strncmp(ref, "#/definitions/", 14))
        name = ref + 14, defs = cJSON_GetObjectItemCaseSensitive(c->root, "definitions");
    if (!name)
        return unsupported(c, "the reference '%.100s' is not supported (only #, #/$defs/... and #/definitions/...)",
                           ref);
    char key[256]; /* JSON pointer unescaping: ~1 is '/', ~0 is '~' */
    size_t k = 0;
    for (const char *p = name; *p && k + 1 < sizeof key; p++) {
        if (*p == '/')
            return unsupported(c, "the reference '%.100s' goes deeper than one definition", ref);
        if (*p == '~' && (p[1] == '0' || p[1] == '1'))
            key[k++] = p[1] == '0' ? '~' : '/', p++;
        else
            key[k++] = *p;
    }
    key[k] = 0;
    const cJSON *target = defs ? cJSON_GetObjectItemCaseSensitive(defs, key) : NULL;
    if (!target)
        return unsupported(c, "the reference '%.100s' names no definition", ref);
    for (int i = 0; i < c->n_refs; i++)
        if (c->refs[i].node == target)
            return put(c, expr, c->refs[i].name), EXL_OK;
    if (c->n_refs == MAX_REFS)
        return unsupported(c, "%s", "too many definitions");
    ref_rule *rr = &c->refs[c->n_refs++];
    rr->node = target;
    rule_name(c, key, rr->name, sizeof rr->name);
    put(c, expr, rr->name);
    exl_str body = EXL_STR_INIT;
    char saved[sizeof c->path];
    memcpy(saved, c->path, sizeof saved);
    snprintf(c->path, sizeof c->path, "%s", ref);
    exl_status st = node(c, target, key, &body);
    memcpy(c->path, saved, sizeof saved);
    if (st == EXL_OK) {
        put(c, &c->rules, rr->name);
        put(c, &c->rules, " ::= ");
        put(c, &c->rules, body.data);
        put(c, &c->rules, "\n");
    }
    exl_str_free(&body);
    return st;
}

/* Alternatives of a list of schemas (anyOf). */
static exl_status any_of(sc *c, const cJSON *list, const char *kw, const char *hint, exl_str *expr) {
    if (!cJSON_IsArray(list) || !list->child)
        return unsupported(c, "'%s' must be a non-empty list of schemas", kw);
    put(c, expr, "(");
    int i = 0;
    exl_status st = EXL_OK;
    for (const cJSON *s = list->child; s && st == EXL_OK; s = s->next, i++) {
        char part[32];
        snprintf(part, sizeof part, "%s/%d", kw, i);
        size_t at = path_push(c, part);
        if (i)
            put(c, expr, " | ");
        st = node(c, s, hint, expr);
        path_pop(c, at);
    }
    put(c, expr, ")");
    return st;
}

static exl_status node_object(sc *c, const cJSON *s, const char *hint, exl_str *expr) {
    EXL_TRY(check_keywords(c, s));
    const cJSON *v;
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "$ref"))) {
        if (!cJSON_IsString(v))
            return unsupported(c, "%s", "'$ref' must be a string");
        return reference(c, v->valuestring, expr);
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "const")))
        return put_json_literal(c, expr, v);
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "enum"))) {
        if (!cJSON_IsArray(v) || !v->child)
            return unsupported(c, "%s", "'enum' must be a non-empty list");
        put(c, expr, "(");
        for (const cJSON *e = v->child; e; e = e->next) {
            if (e != v->child)
                put(c, expr, " | ");
            EXL_TRY(put_json_literal(c, expr, e));
        }
        put(c, expr, ")");
        return EXL_OK;
    }
    if ((v = cJSON_GetObjectItemCaseSensitive(s, "anyOf")))
        return any_of(c, v, "anyOf", hint, expr);
    if (!c->strict && (v = cJSON_GetObjectItemCaseSensitive(s, "oneOf")))
        return any_of(c, v, "oneOf", hint, expr);
    if (!c->strict && (v = cJSON_GetObjectItemCaseSensitive(s, "allOf")) && cJSON_GetArraySize(v) == 1)
        return node(c, v->child, hint, expr);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(s, "type");
    if (cJSON_IsString(type))
        return typed(c, s, type->valuestring, hint, expr);
    if (cJSON_IsArray(type) && type->child) {
        put(c, expr, "(");
        for (const cJSON *t = type->child; t; t = t->next) {
            if (!cJSON_IsString(t))
                return unsupported(c, "%s", "'type' must be a name or a list of names");
            if (t != type->child)
                put(c, expr, " | ");
            EXL_TRY(typed(c, s, t->valuestring, hint, expr));
        }
        put(c, expr, ")");
        return EXL_OK;
    }
    if (type)
        return unsupported(c, "%s", "'type' must be a name or a list of names");
    if (cJSON_GetObjectItemCaseSensitive(s, "properties") || cJSON_GetObjectItemCaseSensitive(s, "required") ||
        cJSON_GetObjectItemCaseSensitive(s, "additionalProperties"))
        return object_expr(c, s, hint, expr);
    if (cJSON_GetObjectItemCaseSensitive(s, "items"))
        return array_expr(c, s, hint, expr);
    c->used |= USE_VALUE; /* no constraint: any JSON value */
    put(c, expr, "json-value");
    return EXL_OK;
}

static exl_status node(sc *c, const cJSON *s, const char *hint, exl_str *expr) {
    if (cJSON_IsTrue(s)) {
        c->used |= USE_VALUE;
        put(c, expr, "json-value");
        return EXL_OK;
    }
    if (!cJSON_IsObject(s))
        return unsupported(c, "%s",
                           cJSON_IsFalse(s) ? "the schema false matches nothing" : "a schema must be an object");
    if (++c->depth > MAX_DEPTH)
        return unsupported(c, "%s", "schemas nested more than 64 deep");
    exl_status st = node_object(c, s, hint, expr);
    c->depth--;
    return st;
}

/* ---------------------------------------------------------------- entry */

/* The schema's rules, its start rule named <prefix>root; *used: the shared pieces it needs. */
static exl_status schema_rules(const cJSON *schema, int strict, const char *prefix, exl_str *out, unsigned *used) {
    sc *c = exl_calloc(1, sizeof *c);
    if (!c)
        return nomem();
    c->root = schema;
    c->strict = strict;
    c->prefix = prefix;
    exl_str root = EXL_STR_INIT;
    exl_status st = node(c, schema, "root", &root);
    if (st == EXL_OK) {
        c->fail |= exl_str_printf(out, "%sroot ::= %s\n", prefix, root.data);
        put(c, out, c->rules.data ? c->rules.data : "");
        if (c->fail)
            st = nomem();
    }
    *used = c->used;
    exl_str_free(&root);
    exl_str_free(&c->rules);
    exl_free(c);
    return st;
}

static exl_status shared_rules(unsigned used, exl_str *out) {
    if (used & USE_VALUE) /* any value uses every piece */
        used |= USE_WS | USE_CHAR | USE_STRING | USE_NUMBER;
    if (used & USE_STRING)
        used |= USE_CHAR;
    for (int i = 0; i < 6; i++)
        if ((used & (1u << i)) && exl_str_puts(out, SHARED[i]))
            return nomem();
    return EXL_OK;
}

exl_status exl_json_schema_gbnf(const cJSON *schema, int strict, exl_str *out) {
    unsigned used = 0;
    EXL_TRY(schema_rules(schema, strict, "", out, &used));
    return shared_rules(used, out);
}

exl_status exl_json_schema_gbnf_part(const cJSON *schema, int strict, const char *prefix, exl_str *out) {
    unsigned used;
    return schema_rules(schema, strict, prefix, out, &used);
}

exl_status exl_json_schema_gbnf_shared(exl_str *out) { return shared_rules(USE_VALUE | USE_INTEGER, out); }

exl_status exl_json_schema_to_gbnf(const char *src, size_t len, int strict, exl_str *out) {
    const char *end = NULL;
    cJSON *schema = cJSON_ParseWithLengthOpts(src, len, &end, 0);
    if (!schema)
        return exl_fail(EXL_ERR_FORMAT, "json schema: not valid JSON (near offset %zu)",
                        end && end >= src ? (size_t)(end - src) : (size_t)0);
    exl_status st = exl_json_schema_gbnf(schema, strict, out);
    cJSON_Delete(schema);
    return st;
}
