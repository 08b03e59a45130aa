/* grammar.h - a context-free grammar over bytes, the form every constraint (GBNF, JSON Schema,
 * regular expression) is compiled to before matching.
 *
 * A rule is a list of alternatives, each a sequence of elements: a set of bytes (one byte of
 * input) or a reference to a rule. Characters are bytes here: a class of code points becomes a
 * rule whose alternatives are the UTF-8 byte sequences of its ranges. Rules are built one element
 * at a time (exl_grammar_push, ALT between alternatives) and flattened by exl_grammar_finish,
 * which also refuses left recursion (the matcher expands rules before reading a byte). */
#ifndef EXL_CONSTRAIN_GRAMMAR_H
#define EXL_CONSTRAIN_GRAMMAR_H

#include "exl.h"

#include <stddef.h>
#include <stdint.h>

#define EXL_GRAMMAR_MAX_ELEMS (1 << 20) /* elements over all rules: bounds what a request may build */
#define EXL_GRAMMAR_MAX_RULES (1 << 18)

typedef enum exl_gkind {
    EXL_G_END,   /* end of the rule's last alternative */
    EXL_G_ALT,   /* end of an alternative, another follows */
    EXL_G_RULE,  /* arg: the rule */
    EXL_G_BYTES, /* arg: the byte set */
} exl_gkind;

typedef struct exl_gelem {
    int32_t kind, arg;
} exl_gelem;

typedef struct exl_byteset {
    uint32_t w[8];
} exl_byteset;

static inline int exl_byteset_has(const exl_byteset *s, unsigned b) { return (s->w[b >> 5] >> (b & 31)) & 1; }
static inline void exl_byteset_add(exl_byteset *s, unsigned b) { s->w[b >> 5] |= 1u << (b & 31); }

/* A rule while it is built. */
typedef struct exl_grule {
    char *name;
    exl_gelem *el;
    int32_t n, cap;
    int defined; /* named rules: given a definition (references may come first) */
} exl_grule;

typedef struct exl_grammar {
    exl_grule *rules;
    int32_t n_rules, cap_rules;
    int64_t n_elems; /* over all rules */
    exl_byteset *sets;
    int32_t n_sets, cap_sets;
    int32_t *set_hash; /* open addressing over sets, -1 empty */
    int32_t set_hash_cap;
    /* after exl_grammar_finish */
    int32_t root;
    exl_gelem *flat;    /* every rule's elements, END-terminated */
    int32_t *alt_start; /* positions in flat where alternatives start */
    int32_t *rule_alt;  /* [n_rules + 1]: rule r's alternatives are alt_start[rule_alt[r] .. rule_alt[r + 1]) */
} exl_grammar;

void exl_grammar_init(exl_grammar *g);
void exl_grammar_free(exl_grammar *g);

/* The rule named name[0..len): found, or added undefined. -1 with a message when out of room. */
int32_t exl_grammar_named(exl_grammar *g, const char *name, size_t len);
/* A new helper rule named after base ("base-N"). -1 with a message when out of room. */
int32_t exl_grammar_helper(exl_grammar *g, const char *base);
/* Append an element to rule r. */
exl_status exl_grammar_push(exl_grammar *g, int32_t r, exl_gkind kind, int32_t arg);
/* Append one byte set / one byte / a string of bytes to rule r. */
exl_status exl_grammar_push_set(exl_grammar *g, int32_t r, const exl_byteset *s);
exl_status exl_grammar_push_byte(exl_grammar *g, int32_t r, unsigned char b);
exl_status exl_grammar_push_bytes(exl_grammar *g, int32_t r, const char *s, size_t n);

/* A code point class: the inclusive ranges lo[i]..hi[i] (any order, overlapping allowed), or
 * everything else when negated; surrogates are never in it. Appends one element to rule r: a
 * byte set when only ASCII is in it, else a reference to a helper rule of UTF-8 sequences. */
exl_status exl_grammar_push_class(exl_grammar *g, int32_t r, const int32_t *lo, const int32_t *hi, int32_t n,
                                  int negated);

/* Repeat the elements r->el[from..] (the last item of its current alternative) between min and
 * max times (max < 0: no bound), rewriting them with helper rules as needed. */
exl_status exl_grammar_repeat(exl_grammar *g, int32_t r, int32_t from, int32_t min, int32_t max);

/* Check that every referenced rule is defined and none is left-recursive, then flatten with
 * root_name as the start rule. Messages name the rule at fault. */
exl_status exl_grammar_finish(exl_grammar *g, const char *root_name);

#endif
