/* jinja_eval.h - the render state shared by the evaluator, the filters, the tests, the
 * methods and the global functions, and the helpers they have in common. */
#ifndef EXL_TOKENIZER_JINJA_EVAL_H
#define EXL_TOKENIZER_JINJA_EVAL_H

#include "base/error.h"
#include "jinja/jinja_ast.h"

#include <cjson/cJSON.h>

enum { EXL_JFLOW_NONE, EXL_JFLOW_BREAK, EXL_JFLOW_CONTINUE };

typedef struct exl_jctx {
    const exl_jinja *t;
    exl_str out;        /* where output goes (swapped while a macro or block set runs) */
    exl_jdict **frames; /* frames[0]: the context and top-level sets */
    size_t n_frames, cap_frames;
    size_t floor;          /* frames below this (except 0) are hidden: a macro's scope */
    exl_jdict *namespaces; /* every namespace() of this render */
    int flow;
    int calls;
    uint64_t steps;
    exl_jinja_limits lim;
} exl_jctx;

/* Evaluated arguments of a call, filter or test; kw is NULL or one name (or NULL for a
 * positional argument) per value. */
typedef struct exl_jargs {
    size_t n;
    exl_jv *v;
    char *const *kw;
} exl_jargs;

/* The index-th positional argument, else the keyword argument `name` (may be NULL);
 * NULL when neither was given. */
const exl_jv *exl_jargs_get(const exl_jargs *a, size_t index, const char *name);

/* Fail with "template:line:col: message" for node `at` (at may be NULL). */
exl_status exl_jctx_fail(exl_jctx *c, const struct exl_jnode *at, exl_status st, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* An allocation failed (or a value-level call returned st): report it. */
exl_status exl_jctx_nomem(exl_jctx *c, const struct exl_jnode *at);
/* Spend work units (nodes, iterations, copied elements); fails past the step limit. */
exl_status exl_jctx_charge(exl_jctx *c, const struct exl_jnode *at, uint64_t units);
/* Fails when a string or list of `bytes` would pass the size limit. */
exl_status exl_jctx_check_size(exl_jctx *c, const struct exl_jnode *at, size_t bytes);
/* A new string value from an exl_str, checked against the size limit (s is freed). */
exl_status exl_jctx_take_str(exl_jctx *c, const struct exl_jnode *at, exl_str *s, exl_jv *out);
/* Materialize what a for loop or filter iterates over: a list's items, a dict's keys,
 * a string's characters; undefined gives an empty list. */
exl_status exl_jctx_iterate(exl_jctx *c, const struct exl_jnode *at, exl_jv v, exl_jv *list);
/* Attribute lookup as `v.name` (dict key, namespace attribute, loop field). */
exl_status exl_jctx_getattr(exl_jctx *c, const struct exl_jnode *at, exl_jv v, const char *name, exl_jv *out);
/* Call a macro value with arguments. */
exl_status exl_jctx_call_macro(exl_jctx *c, const struct exl_jnode *at, exl_jv macro, const exl_jargs *a, exl_jv *out);

/* ---- implemented in jinja_filters.c, jinja_tests.c, jinja_methods.c */
exl_status exl_jinja_filter(exl_jctx *c, const struct exl_jnode *at, const char *name, exl_jv self, const exl_jargs *a,
                            exl_jv *out);
exl_status exl_jinja_test(exl_jctx *c, const struct exl_jnode *at, const char *name, exl_jv self, const exl_jargs *a,
                          int *out);
/* *found = 0 (and EXL_OK) when self's type has no such method. */
exl_status exl_jinja_method(exl_jctx *c, const struct exl_jnode *at, exl_jv self, const char *name, const exl_jargs *a,
                            exl_jv *out, int *found);
/* Global functions: range, namespace, dict, raise_exception, strftime_now. *found as above. */
exl_status exl_jinja_global(exl_jctx *c, const struct exl_jnode *at, const char *name, const exl_jargs *a, exl_jv *out,
                            int *found);

/* ---- jinja_json.c */
exl_status exl_jv_from_json(const cJSON *j, exl_jv *out);
/* json.dumps(v, ensure_ascii=False, indent=indent (<0: none), sort_keys=...). Fails with
 * EXL_ERR_ARG (no message) for values JSON cannot hold. */
exl_status exl_jv_write_json(exl_jv v, int indent, int sort_keys, exl_str *out);

/* ---- jinja_text.c: UTF-8 text as Python str sees it (code points) */
size_t exl_jtext_len(const char *s, size_t n);
/* Byte offset of code point index i (n if past the end). */
size_t exl_jtext_offset(const char *s, size_t n, size_t i);
typedef enum exl_jcase {
    EXL_JCASE_UPPER,
    EXL_JCASE_LOWER,
    EXL_JCASE_CAPITALIZE, /* first upper, rest lower */
    EXL_JCASE_TITLE,      /* Python str.title(): upper after a non-letter */
    EXL_JCASE_WORDS,      /* Jinja |title: upper after - ( { [ < or whitespace */
} exl_jcase;
exl_status exl_jtext_case(const char *s, size_t n, exl_jcase mode, exl_str *out);
/* Python str.strip/lstrip/rstrip: chars NULL strips whitespace. left/right select sides. */
void exl_jtext_strip(const char *s, size_t n, const char *chars, size_t nchars, int left, int right, size_t *start,
                     size_t *len);
/* Is the code point Python whitespace (str.isspace)? */
int exl_jtext_is_space(uint32_t cp);

#endif
