/* matcher.c - the lazily determinized pushdown automaton of matcher.h: interned stack nodes,
 * the closure that expands rule references until byte sets are on top, interned states and
 * their transition tables. */
#include "constrain/matcher.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

#define UNKNOWN (-2) /* a transition not computed yet */

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "grammar matcher: out of memory"); }

static uint32_t mix(uint32_t h) {
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    return h ^ (h >> 16);
}

/* Grow an array of elements of size `size` to room for need; 0, or -1 when out of memory. */
static int grow(void **p, int64_t *cap, int64_t need, size_t size) {
    if (need <= *cap)
        return 0;
    int64_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    void *q = exl_realloc(*p, (size_t)c * size);
    if (!q)
        return -1;
    *p = q;
    *cap = c;
    return 0;
}

static int grow32(void **p, int32_t *cap, int32_t need, size_t size) {
    int64_t c = *cap;
    int rc = grow(p, &c, need, size);
    *cap = (int32_t)c;
    return rc;
}

/* A fresh open-addressing table of cap slots (-1 empty). */
static int32_t *new_table(int32_t cap) {
    int32_t *t = exl_malloc((size_t)cap * sizeof *t);
    if (t)
        memset(t, 0xff, (size_t)cap * sizeof *t);
    return t;
}

/* ---------------------------------------------------------------- stack nodes */

static uint32_t node_hash(int32_t pos, int32_t parent) { return mix((uint32_t)pos * 0x9E3779B1u ^ (uint32_t)parent); }

static int rehash_nodes(exl_matcher *m) {
    int32_t cap = m->node_hash_cap ? 2 * m->node_hash_cap : 1024;
    int32_t *t = new_table(cap);
    if (!t)
        return -1;
    for (int32_t i = 0; i < m->n_nodes; i++) {
        uint32_t k = node_hash(m->nodes[i].pos, m->nodes[i].parent) & (uint32_t)(cap - 1);
        while (t[k] >= 0)
            k = (k + 1) & (uint32_t)(cap - 1);
        t[k] = i;
    }
    exl_free(m->node_hash);
    m->node_hash = t;
    m->node_hash_cap = cap;
    return 0;
}

/* *id: the id of stack (pos, parent), added when new. */
static exl_status intern_node(exl_matcher *m, int32_t pos, int32_t parent, int32_t *id) {
    if (2 * (m->n_nodes + 1) > m->node_hash_cap && rehash_nodes(m))
        return nomem();
    uint32_t mask = (uint32_t)(m->node_hash_cap - 1), k = node_hash(pos, parent) & mask;
    for (; m->node_hash[k] >= 0; k = (k + 1) & mask) {
        const exl_mnode *n = &m->nodes[m->node_hash[k]];
        if (n->pos == pos && n->parent == parent) {
            *id = m->node_hash[k];
            return EXL_OK;
        }
    }
    if (m->n_nodes >= EXL_MATCH_MAX_NODES)
        return exl_fail(EXL_ERR_UNSUPPORTED, "grammar matcher: more than %d parse stacks (the grammar is too large)",
                        EXL_MATCH_MAX_NODES);
    if (grow32((void **)&m->nodes, &m->cap_nodes, m->n_nodes + 1, sizeof *m->nodes) ||
        grow32((void **)&m->seen, &m->cap_seen, m->n_nodes + 1, sizeof *m->seen))
        return nomem();
    m->nodes[m->n_nodes] = (exl_mnode){pos, parent};
    m->seen[m->n_nodes] = 0;
    m->node_hash[k] = m->n_nodes;
    *id = m->n_nodes++;
    return EXL_OK;
}

/* ---------------------------------------------------------------- closure */

static int push_work(exl_matcher *m, int32_t pos, int32_t parent) {
    if (grow32((void **)&m->work, &m->cap_work, m->n_work + 1, sizeof *m->work))
        return -1;
    m->work[m->n_work++] = (exl_mnode){pos, parent};
    return 0;
}

static int add_out(exl_matcher *m, int32_t id) {
    if (grow32((void **)&m->out, &m->cap_out, m->n_out + 1, sizeof *m->out))
        return -1;
    m->out[m->n_out++] = id;
    return 0;
}

static int by_id(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Expand the stacks in m->work until each has a byte set on top (or is empty) into m->out,
 * sorted and without repeats. */
static exl_status closure(exl_matcher *m) {
    const exl_grammar *g = m->g;
    if (++m->pass == 0) { /* wrapped: forget old marks */
        memset(m->seen, 0, (size_t)m->n_nodes * sizeof *m->seen);
        m->pass = 1;
    }
    m->n_out = 0;
    while (m->n_work) {
        exl_mnode w = m->work[--m->n_work];
        const exl_gelem *e = &g->flat[w.pos];
        if (e->kind == EXL_G_END || e->kind == EXL_G_ALT) { /* the alternative ends: return */
            if (w.parent == 0) {
                if (m->seen[0] != m->pass) {
                    m->seen[0] = m->pass;
                    if (add_out(m, 0))
                        return nomem();
                }
            } else if (push_work(m, m->nodes[w.parent].pos, m->nodes[w.parent].parent)) {
                return nomem();
            }
            continue;
        }
        int32_t id;
        EXL_TRY(intern_node(m, w.pos, w.parent, &id));
        if (m->seen[id] == m->pass)
            continue;
        m->seen[id] = m->pass;
        if (e->kind == EXL_G_BYTES) {
            if (add_out(m, id))
                return nomem();
            continue;
        }
        int32_t after = g->flat[w.pos + 1].kind, cont = w.parent;
        if (after != EXL_G_END && after != EXL_G_ALT)
            EXL_TRY(intern_node(m, w.pos + 1, w.parent, &cont));
        for (int32_t a = g->rule_alt[e->arg]; a < g->rule_alt[e->arg + 1]; a++)
            if (push_work(m, g->alt_start[a], cont))
                return nomem();
    }
    qsort(m->out, (size_t)m->n_out, sizeof *m->out, by_id);
    return EXL_OK;
}

/* ---------------------------------------------------------------- states */

static uint32_t items_hash(const int32_t *v, int32_t n) {
    uint32_t h = 0x811C9DC5u ^ (uint32_t)n;
    for (int32_t i = 0; i < n; i++)
        h = mix(h ^ (uint32_t)v[i]);
    return h;
}

static int rehash_states(exl_matcher *m) {
    int32_t cap = m->state_hash_cap ? 2 * m->state_hash_cap : 256;
    int32_t *t = new_table(cap);
    if (!t)
        return -1;
    for (int32_t i = 0; i < m->n_states; i++) {
        uint32_t k = m->states[i].hash & (uint32_t)(cap - 1);
        while (t[k] >= 0)
            k = (k + 1) & (uint32_t)(cap - 1);
        t[k] = i;
    }
    exl_free(m->state_hash);
    m->state_hash = t;
    m->state_hash_cap = cap;
    return 0;
}

/* The state of the stacks in m->out (EXL_MATCH_DEAD when there are none). */
static exl_status intern_state(exl_matcher *m, int32_t *out) {
    *out = EXL_MATCH_DEAD;
    if (!m->n_out)
        return EXL_OK;
    if (2 * (m->n_states + 1) > m->state_hash_cap && rehash_states(m))
        return nomem();
    uint32_t h = items_hash(m->out, m->n_out), mask = (uint32_t)(m->state_hash_cap - 1), k = h & mask;
    for (; m->state_hash[k] >= 0; k = (k + 1) & mask) {
        const exl_mstate *s = &m->states[m->state_hash[k]];
        if (s->hash == h && s->n == m->n_out && !memcmp(m->items + s->first, m->out, (size_t)s->n * sizeof *m->out)) {
            *out = m->state_hash[k];
            return EXL_OK;
        }
    }
    if (m->n_states >= EXL_MATCH_MAX_STATES)
        return exl_fail(EXL_ERR_UNSUPPORTED, "grammar matcher: more than %d states (the grammar is too large)",
                        EXL_MATCH_MAX_STATES);
    if (grow32((void **)&m->states, &m->cap_states, m->n_states + 1, sizeof *m->states) ||
        grow((void **)&m->items, &m->cap_items, m->n_items + m->n_out, sizeof *m->items))
        return nomem();
    memcpy(m->items + m->n_items, m->out, (size_t)m->n_out * sizeof *m->out);
    m->states[m->n_states] =
        (exl_mstate){.first = (int32_t)m->n_items, .n = m->n_out, .hash = h, .accepting = m->out[0] == 0};
    m->n_items += m->n_out;
    m->state_hash[k] = m->n_states;
    *out = m->n_states++;
    return EXL_OK;
}

exl_status exl_matcher_step(exl_matcher *m, int32_t s, unsigned char b, int32_t *out) {
    *out = EXL_MATCH_DEAD;
    if (s < 0)
        return EXL_OK;
    if (m->states[s].next && m->states[s].next[b] != UNKNOWN) {
        *out = m->states[s].next[b];
        return EXL_OK;
    }
    if (!m->states[s].next) {
        int32_t *t = exl_malloc(256 * sizeof *t);
        if (!t)
            return nomem();
        for (int i = 0; i < 256; i++)
            t[i] = UNKNOWN;
        m->states[s].next = t;
    }
    m->n_work = 0;
    const exl_mstate *st = &m->states[s];
    for (int32_t i = 0; i < st->n; i++) {
        int32_t id = m->items[st->first + i];
        if (!id)
            continue;
        const exl_mnode *n = &m->nodes[id];
        if (exl_byteset_has(&m->g->sets[m->g->flat[n->pos].arg], b) && push_work(m, n->pos + 1, n->parent))
            return nomem();
    }
    EXL_TRY(closure(m));
    int32_t next;
    EXL_TRY(intern_state(m, &next));
    m->states[s].next[b] = next;
    *out = next;
    return EXL_OK;
}

exl_status exl_matcher_walk(exl_matcher *m, int32_t s, const char *bytes, size_t n, int32_t *out) {
    for (size_t i = 0; i < n && s >= 0; i++)
        EXL_TRY(exl_matcher_step(m, s, (unsigned char)bytes[i], &s));
    *out = s;
    return EXL_OK;
}

/* ---------------------------------------------------------------- life */

exl_status exl_matcher_init(exl_matcher *m, const exl_grammar *g) {
    *m = (exl_matcher){.g = g, .start = EXL_MATCH_DEAD};
    int32_t empty;
    exl_status st = intern_node(m, -1, -1, &empty); /* node 0: the empty stack */
    for (int32_t a = g->rule_alt[g->root]; st == EXL_OK && a < g->rule_alt[g->root + 1]; a++)
        if (push_work(m, g->alt_start[a], 0))
            st = nomem();
    if (st == EXL_OK)
        st = closure(m);
    if (st == EXL_OK)
        st = intern_state(m, &m->start);
    if (st == EXL_OK && m->start < 0)
        st = exl_fail(EXL_ERR_FORMAT, "grammar: the root rule matches nothing");
    if (st != EXL_OK)
        exl_matcher_free(m);
    return st;
}

void exl_matcher_free(exl_matcher *m) {
    for (int32_t i = 0; i < m->n_states; i++) {
        exl_free(m->states[i].next);
        exl_free(m->states[i].mask);
    }
    exl_free(m->nodes);
    exl_free(m->node_hash);
    exl_free(m->seen);
    exl_free(m->states);
    exl_free(m->state_hash);
    exl_free(m->items);
    exl_free(m->work);
    exl_free(m->out);
    *m = (exl_matcher){.start = EXL_MATCH_DEAD};
}
