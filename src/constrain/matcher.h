/* matcher.h - a pushdown automaton over a byte grammar, determinized lazily.
 *
 * A parse position is a stack: the element to match next in the current alternative, over the
 * positions to return to when it ends. Stacks are interned as (position, parent) nodes, so equal
 * stacks are equal ids, and a rule reference in tail position pushes nothing (a right-recursive
 * repetition never grows its stack). Node 0 is the empty stack: the input may end there.
 *
 * A matcher state is the set of stacks the input so far can be in, each expanded until a byte
 * set is on top. States are interned too, and their byte transitions are computed on first use
 * and kept, so the automaton is a DFA built as far as the input (and the token masks) explore
 * it. State ids stay valid for the matcher's life: a job keeps its past states to rewind. */
#ifndef EXL_CONSTRAIN_MATCHER_H
#define EXL_CONSTRAIN_MATCHER_H

#include "constrain/grammar.h"

#define EXL_MATCH_DEAD (-1)            /* no state: the input left the grammar */
#define EXL_MATCH_MAX_STATES (1 << 17) /* states one matcher may build */
#define EXL_MATCH_MAX_NODES (1 << 22)  /* stack nodes one matcher may build */

typedef struct exl_mnode {
    int32_t pos, parent;
} exl_mnode;

typedef struct exl_mstate {
    int32_t first, n; /* its stacks: items[first .. first + n), sorted */
    uint32_t hash;
    int32_t *next;      /* [256] transitions once computed (-2: not yet), else NULL */
    uint32_t *mask;     /* the token mask (mask.c), NULL until computed (or dropped) */
    int32_t mask_count; /* tokens it allows, once computed */
    uint8_t accepting;  /* the empty stack is in it */
} exl_mstate;

typedef struct exl_matcher {
    const exl_grammar *g;
    exl_mnode *nodes;
    int32_t n_nodes, cap_nodes;
    int32_t *node_hash; /* open addressing, -1 empty */
    int32_t node_hash_cap;
    uint32_t *seen; /* per node: the closure pass that last visited it */
    int32_t cap_seen;
    uint32_t pass;
    exl_mstate *states;
    int32_t n_states, cap_states;
    int32_t *state_hash;
    int32_t state_hash_cap;
    int32_t *items;
    int64_t n_items, cap_items;
    /* scratch for one transition */
    exl_mnode *work;
    int32_t n_work, cap_work;
    int32_t *out;
    int32_t n_out, cap_out;
    int32_t start; /* the state before any input */
    /* token masks (mask.c) */
    const void *mask_vocab; /* the token trie the masks were computed for */
    int64_t mask_bytes;     /* memory held by masks */
} exl_matcher;

/* A matcher for a finished grammar (which must outlive it), with its start state built. */
exl_status exl_matcher_init(exl_matcher *m, const exl_grammar *g);
void exl_matcher_free(exl_matcher *m);

/* The state after byte b from state s (EXL_MATCH_DEAD when the grammar cannot read it); *out is
 * set. Fails only when out of memory or past the state limits. */
exl_status exl_matcher_step(exl_matcher *m, int32_t s, unsigned char b, int32_t *out);
/* The same over n bytes (stops at a dead state). */
exl_status exl_matcher_walk(exl_matcher *m, int32_t s, const char *bytes, size_t n, int32_t *out);

static inline int exl_matcher_accepting(const exl_matcher *m, int32_t s) { return m->states[s].accepting; }
/* Accepting with nothing more to read: the input is complete. */
static inline int exl_matcher_complete(const exl_matcher *m, int32_t s) {
    return m->states[s].accepting && m->states[s].n == 1;
}

#endif
