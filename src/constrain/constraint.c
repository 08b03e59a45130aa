/* constraint.c - exl_constraint_compile: every kind of constraint is turned into GBNF text
 * (JSON Schema and regular expressions by their compilers) and parsed into a byte grammar. */
#include "constrain/constraint.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/str.h"
#include "constrain/gbnf.h"
#include "constrain/json_schema.h"
#include "constrain/regex.h"

/* The GBNF text of a constraint source. */
static exl_status to_gbnf(exl_constraint_kind kind, const char *src, size_t len, exl_str *out) {
    switch (kind) {
    case EXL_CONSTRAINT_GBNF: return exl_str_append(out, src, len) ? exl_fail(EXL_ERR_NOMEM, "out of memory") : EXL_OK;
    case EXL_CONSTRAINT_REGEX: return exl_regex_to_gbnf(src, len, out);
    case EXL_CONSTRAINT_JSON_SCHEMA: return exl_json_schema_to_gbnf(src, len, 1, out);
    case EXL_CONSTRAINT_JSON_SCHEMA_LAX: return exl_json_schema_to_gbnf(src, len, 0, out);
    }
    return exl_fail(EXL_ERR_ARG, "exl_constraint_compile: unknown kind %d", (int)kind);
}

exl_status exl_constraint_compile(exl_constraint_kind kind, const char *source, size_t len, exl_constraint **out) {
    if (!out || (!source && len))
        return exl_fail(EXL_ERR_ARG, "exl_constraint_compile: NULL argument");
    *out = NULL;
    exl_str text = EXL_STR_INIT;
    exl_status st = to_gbnf(kind, source ? source : "", len, &text);
    exl_constraint *c = st == EXL_OK ? exl_calloc(1, sizeof *c) : NULL;
    if (st == EXL_OK && !c)
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (c) {
        atomic_init(&c->refs, 1);
        exl_grammar_init(&c->grammar);
        st = exl_gbnf_parse(text.data ? text.data : "", text.len, &c->grammar);
        if (st == EXL_OK)
            st = exl_matcher_init(&c->matcher, &c->grammar);
        if (st != EXL_OK) {
            exl_grammar_free(&c->grammar);
            exl_free(c);
            c = NULL;
        }
    }
    exl_str_free(&text);
    *out = c;
    return st;
}

exl_constraint *exl_constraint_ref(exl_constraint *c) {
    atomic_fetch_add(&c->refs, 1);
    return c;
}

void exl_constraint_free(exl_constraint *c) {
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1)
        return;
    exl_matcher_free(&c->matcher);
    exl_grammar_free(&c->grammar);
    exl_free(c);
}
