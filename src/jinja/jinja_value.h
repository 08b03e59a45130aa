/* jinja_value.h - the values of the template interpreter.
 *
 * A value is a small tagged struct passed by value. Strings, lists, dicts and loop
 * objects live on the heap with a reference count; a count of 0 marks an immortal value
 * (a literal owned by the parsed template), which is never counted or freed, so renders
 * on several threads can share literals. Lists and dicts never change after they are
 * built, so they cannot form cycles. Namespaces are the one mutable kind: the render
 * owns every namespace it creates (a chain through next_ns) and frees them at its end;
 * values only borrow them.
 *
 * Ownership: functions returning an exl_jv give a new reference; `self`/argument values
 * are borrowed unless a comment says the call takes them. */
#ifndef EXL_TOKENIZER_JINJA_VALUE_H
#define EXL_TOKENIZER_JINJA_VALUE_H

#include "base/str.h"
#include "exl.h"

#include <stddef.h>
#include <stdint.h>

typedef enum exl_jv_type {
    EXL_JV_UNDEF,
    EXL_JV_NONE,
    EXL_JV_BOOL,
    EXL_JV_INT,
    EXL_JV_FLOAT,
    EXL_JV_STR,
    EXL_JV_LIST,
    EXL_JV_DICT,
    EXL_JV_NS,
    EXL_JV_MACRO,
    EXL_JV_LOOP,
} exl_jv_type;

typedef struct exl_jstr {
    size_t rc;
    size_t len;
    char data[]; /* NUL-terminated */
} exl_jstr;

typedef struct exl_jv exl_jv;

typedef struct exl_jlist {
    size_t rc;
    size_t n, cap;
    exl_jv *items;
    int tuple; /* written as (a, b) by repr(); otherwise a list */
} exl_jlist;

typedef struct exl_jdict {
    size_t rc;
    size_t n, cap;
    exl_jstr **keys;
    exl_jv *vals;
    size_t *index; /* open-addressing hash of key positions + 1, from 16 keys on */
    size_t index_cap;
    struct exl_jdict *next_ns; /* namespaces only: the render's chain */
} exl_jdict;

/* The `loop` variable of a for loop: its position in the (materialized) sequence. */
typedef struct exl_jloop {
    size_t rc;
    size_t index0;
    exl_jlist *items;
} exl_jloop;

struct exl_jnode;

struct exl_jv {
    exl_jv_type type;
    union {
        int b;
        int64_t i;
        double f;
        exl_jstr *s;
        exl_jlist *l;
        exl_jdict *d; /* DICT and NS */
        exl_jloop *loop;
        const struct exl_jnode *macro;
        const char *undef_name; /* what was looked up, for messages (may be NULL) */
    } u;
};

/* ---- construction */
static inline exl_jv exl_jv_undef(const char *name) {
    exl_jv v = {EXL_JV_UNDEF, {.undef_name = name}};
    return v;
}
static inline exl_jv exl_jv_none(void) {
    exl_jv v = {EXL_JV_NONE, {.i = 0}};
    return v;
}
static inline exl_jv exl_jv_bool(int b) {
    exl_jv v = {EXL_JV_BOOL, {.b = b != 0}};
    return v;
}
static inline exl_jv exl_jv_int(int64_t i) {
    exl_jv v = {EXL_JV_INT, {.i = i}};
    return v;
}
static inline exl_jv exl_jv_float(double f) {
    exl_jv v = {EXL_JV_FLOAT, {.f = f}};
    return v;
}

/* A new string value holding a copy of s[0..n). */
exl_status exl_jv_str(const char *s, size_t n, exl_jv *out);
/* Take over an exl_str's bytes as a string value (the exl_str is left empty). */
exl_status exl_jv_str_take(exl_str *s, exl_jv *out);
exl_status exl_jv_list(size_t cap, exl_jv *out);
exl_status exl_jv_dict(size_t cap, exl_jv *out);
/* A new namespace, chained into *chain (the render's list of namespaces). */
exl_status exl_jv_namespace(exl_jdict **chain, exl_jv *out);
void exl_jv_namespaces_free(exl_jdict *chain);
/* Mark a string immortal (used for literals the parsed template owns). */
void exl_jv_make_immortal(exl_jv v);
/* Free an immortal string. */
void exl_jv_free_immortal(exl_jv v);

exl_jv exl_jv_ref(exl_jv v);
void exl_jv_free(exl_jv v);

/* ---- containers (fresh ones, before they are shared) */
/* Append v to the list, taking v (freed on failure). */
exl_status exl_jlist_push(exl_jlist *l, exl_jv v);
/* Insert or replace key -> v, taking v (freed on failure); key is copied. */
exl_status exl_jdict_set(exl_jdict *d, const char *key, size_t klen, exl_jv v);
/* Same with a key string that is referenced, not copied. */
exl_status exl_jdict_set_key(exl_jdict *d, exl_jstr *key, exl_jv v);
/* Borrowed pointer to the value, or NULL. */
exl_jv *exl_jdict_get(const exl_jdict *d, const char *key, size_t klen);

/* ---- inspection */
const char *exl_jv_type_name(exl_jv v);
int exl_jv_truthy(exl_jv v);
static inline int exl_jv_is_num(exl_jv v) {
    return v.type == EXL_JV_INT || v.type == EXL_JV_FLOAT || v.type == EXL_JV_BOOL;
}
double exl_jv_num(exl_jv v);
/* Python ==. */
int exl_jv_equal(exl_jv a, exl_jv b);
/* Python ordering for numbers, strings and lists: *cmp is <0, 0 or >0. Fails with
 * EXL_ERR_ARG (no message) for values that have no order. */
exl_status exl_jv_compare(exl_jv a, exl_jv b, int *cmp);
/* Python str(v) appended to out (undefined is ""). */
exl_status exl_jv_write_str(exl_jv v, exl_str *out);
/* Python repr(v) appended to out. */
exl_status exl_jv_write_repr(exl_jv v, exl_str *out);
/* Python float repr ("1.0", "1e+20", "0.30000000000000004", "nan", "inf"). */
exl_status exl_jv_write_float(double f, exl_str *out);

#endif
