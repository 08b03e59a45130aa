/* grammar.c - building a byte grammar: rules, interned byte sets, code point classes as UTF-8
 * byte sequences, repetition through helper rules, and the final checks and flattening. */
#include "constrain/grammar.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/str.h"
#include "base/utf8.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CODEPOINT 0x10FFFF

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "grammar: out of memory"); }

void exl_grammar_init(exl_grammar *g) { *g = (exl_grammar){.root = -1}; }

void exl_grammar_free(exl_grammar *g) {
    for (int32_t i = 0; i < g->n_rules; i++) {
        exl_free(g->rules[i].name);
        exl_free(g->rules[i].el);
    }
    exl_free(g->rules);
    exl_free(g->sets);
    exl_free(g->set_hash);
    exl_free(g->flat);
    exl_free(g->alt_start);
    exl_free(g->rule_alt);
    exl_grammar_init(g);
}

/* ---------------------------------------------------------------- rules and elements */

static int32_t add_rule(exl_grammar *g, char *name, int defined) {
    if (!name) {
        nomem();
        return -1;
    }
    if (g->n_rules >= EXL_GRAMMAR_MAX_RULES) {
        exl_free(name);
        exl_fail(EXL_ERR_UNSUPPORTED, "grammar: more than %d rules", EXL_GRAMMAR_MAX_RULES);
        return -1;
    }
    if (g->n_rules == g->cap_rules) {
        int32_t cap = g->cap_rules ? 2 * g->cap_rules : 32;
        exl_grule *r = exl_realloc(g->rules, (size_t)cap * sizeof *r);
        if (!r) {
            exl_free(name);
            nomem();
            return -1;
        }
        g->rules = r;
        g->cap_rules = cap;
    }
    g->rules[g->n_rules] = (exl_grule){.name = name, .defined = defined};
    return g->n_rules++;
}

int32_t exl_grammar_named(exl_grammar *g, const char *name, size_t len) {
    for (int32_t i = 0; i < g->n_rules; i++)
        if (strlen(g->rules[i].name) == len && !memcmp(g->rules[i].name, name, len))
            return i;
    return add_rule(g, exl_strndup(name, len), 0);
}

int32_t exl_grammar_helper(exl_grammar *g, const char *base) {
    char buf[96];
    snprintf(buf, sizeof buf, "%.64s-%d", base, (int)g->n_rules);
    return add_rule(g, exl_strdup(buf), 1);
}

exl_status exl_grammar_push(exl_grammar *g, int32_t r, exl_gkind kind, int32_t arg) {
    exl_grule *rule = &g->rules[r];
    if (g->n_elems >= EXL_GRAMMAR_MAX_ELEMS)
        return exl_fail(EXL_ERR_UNSUPPORTED, "grammar: larger than %d elements", EXL_GRAMMAR_MAX_ELEMS);
    if (rule->n == rule->cap) {
        int32_t cap = rule->cap ? 2 * rule->cap : 8;
        exl_gelem *el = exl_realloc(rule->el, (size_t)cap * sizeof *el);
        if (!el)
            return nomem();
        rule->el = el;
        rule->cap = cap;
    }
    rule->el[rule->n++] = (exl_gelem){kind, arg};
    g->n_elems++;
    return EXL_OK;
}

/* ---------------------------------------------------------------- byte sets */

static uint32_t set_hash(const exl_byteset *s) {
    uint32_t h = 2166136261u;
    for (int i = 0; i < 8; i++)
        h = (h ^ s->w[i]) * 16777619u;
    return h ^ (h >> 15);
}

static int grow_set_hash(exl_grammar *g) {
    int32_t cap = g->set_hash_cap ? 2 * g->set_hash_cap : 64;
    int32_t *h = exl_malloc((size_t)cap * sizeof *h);
    if (!h)
        return -1;
    for (int32_t i = 0; i < cap; i++)
        h[i] = -1;
    for (int32_t i = 0; i < g->n_sets; i++) {
        uint32_t k = set_hash(&g->sets[i]) & (uint32_t)(cap - 1);
        while (h[k] >= 0)
            k = (k + 1) & (uint32_t)(cap - 1);
        h[k] = i;
    }
    exl_free(g->set_hash);
    g->set_hash = h;
    g->set_hash_cap = cap;
    return 0;
}

/* The index of set s, added when new; -1 when out of memory. */
static int32_t intern_set(exl_grammar *g, const exl_byteset *s) {
    if (2 * (g->n_sets + 1) > g->set_hash_cap && grow_set_hash(g))
        return -1;
    uint32_t mask = (uint32_t)(g->set_hash_cap - 1), k = set_hash(s) & mask;
    for (; g->set_hash[k] >= 0; k = (k + 1) & mask)
        if (!memcmp(&g->sets[g->set_hash[k]], s, sizeof *s))
            return g->set_hash[k];
    if (g->n_sets == g->cap_sets) {
        int32_t cap = g->cap_sets ? 2 * g->cap_sets : 32;
        exl_byteset *v = exl_realloc(g->sets, (size_t)cap * sizeof *v);
        if (!v)
            return -1;
        g->sets = v;
        g->cap_sets = cap;
    }
    g->sets[g->n_sets] = *s;
    g->set_hash[k] = g->n_sets;
    return g->n_sets++;
}

exl_status exl_grammar_push_set(exl_grammar *g, int32_t r, const exl_byteset *s) {
    int32_t id = intern_set(g, s);
    return id < 0 ? nomem() : exl_grammar_push(g, r, EXL_G_BYTES, id);
}

exl_status exl_grammar_push_byte(exl_grammar *g, int32_t r, unsigned char b) {
    exl_byteset s = {{0}};
    exl_byteset_add(&s, b);
    return exl_grammar_push_set(g, r, &s);
}

exl_status exl_grammar_push_bytes(exl_grammar *g, int32_t r, const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        EXL_TRY(exl_grammar_push_byte(g, r, (unsigned char)s[i]));
    return EXL_OK;
}

/* ---------------------------------------------------------------- code point classes */

typedef struct cp_range {
    int32_t lo, hi;
} cp_range;

static int by_lo(const void *a, const void *b) {
    const cp_range *x = a, *y = b;
    return (x->lo > y->lo) - (x->lo < y->lo);
}

/* Sorted, merged ranges of lo/hi into out; returns their count. */
static int32_t merge_ranges(const int32_t *lo, const int32_t *hi, int32_t n, cp_range *out) {
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++) {
        int32_t a = lo[i] < 0 ? 0 : lo[i], b = hi[i] > MAX_CODEPOINT ? MAX_CODEPOINT : hi[i];
        if (a <= b)
            out[m++] = (cp_range){a, b};
    }
    qsort(out, (size_t)m, sizeof *out, by_lo);
    int32_t k = 0;
    for (int32_t i = 0; i < m; i++) {
        if (k && out[i].lo <= out[k - 1].hi + 1) {
            if (out[i].hi > out[k - 1].hi)
                out[k - 1].hi = out[i].hi;
        } else {
            out[k++] = out[i];
        }
    }
    return k;
}

/* The class as sorted disjoint ranges without surrogates (complemented when negated) into out;
 * out and tmp each have room for n + 3 (a complement adds one range, the surrogate cut another).
 * Returns the count. */
static int32_t normalize_class(const int32_t *lo, const int32_t *hi, int32_t n, int negated, cp_range *tmp,
                               cp_range *out) {
    int32_t k = merge_ranges(lo, hi, n, tmp), m = 0;
    if (negated) {
        int32_t next = 0;
        for (int32_t i = 0; i <= k; i++) {
            int32_t end = i < k ? tmp[i].lo - 1 : MAX_CODEPOINT;
            if (next <= end)
                out[m++] = (cp_range){next, end};
            if (i < k)
                next = tmp[i].hi + 1;
        }
    } else {
        memcpy(out, tmp, (size_t)k * sizeof *out);
        m = k;
    }
    int32_t c = 0; /* cut out D800-DFFF: a range across it splits in two */
    for (int32_t i = 0; i < m; i++) {
        cp_range r = out[i];
        if (r.hi < 0xD800 || r.lo > 0xDFFF) {
            tmp[c++] = r;
            continue;
        }
        if (r.lo < 0xD800)
            tmp[c++] = (cp_range){r.lo, 0xD7FF};
        if (r.hi > 0xDFFF)
            tmp[c++] = (cp_range){0xE000, r.hi};
    }
    memcpy(out, tmp, (size_t)c * sizeof *out);
    return c;
}

/* Append to rule r one alternative per UTF-8 byte-range sequence of lo..hi (same length). */
static exl_status utf8_sequences(exl_grammar *g, int32_t r, int32_t lo, int32_t hi, int *first) {
    static const int32_t bounds[] = {0x7F, 0x7FF, 0xFFFF};
    for (int i = 0; i < 3; i++)
        if (lo <= bounds[i] && hi > bounds[i]) {
            EXL_TRY(utf8_sequences(g, r, lo, bounds[i], first));
            return utf8_sequences(g, r, bounds[i] + 1, hi, first);
        }
    char a[4], b[4];
    int n = 0;
    for (int i = 1; i < 4; i++) { /* split until every continuation byte spans a full or aligned range */
        int32_t m = (1 << (6 * i)) - 1;
        if ((lo & ~m) != (hi & ~m)) {
            if ((lo & m) != 0) {
                EXL_TRY(utf8_sequences(g, r, lo, lo | m, first));
                return utf8_sequences(g, r, (lo | m) + 1, hi, first);
            }
            if ((hi & m) != m) {
                EXL_TRY(utf8_sequences(g, r, lo, (hi & ~m) - 1, first));
                return utf8_sequences(g, r, hi & ~m, hi, first);
            }
        }
    }
    n = exl_utf8_encode(lo, a);
    exl_utf8_encode(hi, b);
    if (!*first)
        EXL_TRY(exl_grammar_push(g, r, EXL_G_ALT, 0));
    *first = 0;
    for (int i = 0; i < n; i++) {
        exl_byteset s = {{0}};
        for (unsigned v = (unsigned char)a[i]; v <= (unsigned char)b[i]; v++)
            exl_byteset_add(&s, v);
        EXL_TRY(exl_grammar_push_set(g, r, &s));
    }
    return EXL_OK;
}

exl_status exl_grammar_push_class(exl_grammar *g, int32_t r, const int32_t *lo, const int32_t *hi, int32_t n,
                                  int negated) {
    cp_range *rg = exl_malloc((size_t)(2 * n + 6) * sizeof *rg);
    if (!rg)
        return nomem();
    int32_t k = normalize_class(lo, hi, n, negated, rg + n + 3, rg);
    exl_byteset ascii = {{0}};
    int any_ascii = 0, wide = 0;
    for (int32_t i = 0; i < k; i++) {
        for (int32_t c = rg[i].lo; c <= rg[i].hi && c < 0x80; c++) {
            exl_byteset_add(&ascii, (unsigned)c);
            any_ascii = 1;
        }
        wide |= rg[i].hi >= 0x80;
    }
    exl_status st = EXL_OK;
    if (!wide) { /* an empty class stays an empty set: it matches nothing */
        st = exl_grammar_push_set(g, r, &ascii);
    } else {
        int32_t h = exl_grammar_helper(g, g->rules[r].name);
        int first = 1;
        if (h < 0)
            st = exl_fail(EXL_ERR_NOMEM, "%s", exl_last_error());
        if (st == EXL_OK && any_ascii) {
            st = exl_grammar_push_set(g, h, &ascii);
            first = 0;
        }
        for (int32_t i = 0; i < k && st == EXL_OK; i++)
            if (rg[i].hi >= 0x80)
                st = utf8_sequences(g, h, rg[i].lo < 0x80 ? 0x80 : rg[i].lo, rg[i].hi, &first);
        if (st == EXL_OK)
            st = exl_grammar_push(g, r, EXL_G_RULE, h);
    }
    exl_free(rg);
    return st;
}

/* ---------------------------------------------------------------- repetition */

exl_status exl_grammar_repeat(exl_grammar *g, int32_t r, int32_t from, int32_t min, int32_t max) {
    exl_grule *rule = &g->rules[r];
    int32_t count = rule->n - from;
    if (count <= 0)
        return exl_fail(EXL_ERR_FORMAT, "grammar: a repetition with nothing before it in rule '%s'", rule->name);
    exl_gelem x = rule->el[from];
    if (count > 1) { /* the item as a rule of its own */
        int32_t w = exl_grammar_helper(g, g->rules[r].name);
        if (w < 0)
            return exl_fail(EXL_ERR_NOMEM, "%s", exl_last_error());
        rule = &g->rules[r];
        for (int32_t i = from; i < rule->n; i++)
            EXL_TRY(exl_grammar_push(g, w, (exl_gkind)rule->el[i].kind, rule->el[i].arg));
        x = (exl_gelem){EXL_G_RULE, w};
    }
    g->n_elems -= count;
    g->rules[r].n = from;
    for (int32_t i = 0; i < min; i++)
        EXL_TRY(exl_grammar_push(g, r, (exl_gkind)x.kind, x.arg));
    if (max >= 0 && max <= min)
        return EXL_OK;
    if (max < 0) { /* s ::= x s | ε */
        int32_t s = exl_grammar_helper(g, g->rules[r].name);
        if (s < 0)
            return exl_fail(EXL_ERR_NOMEM, "%s", exl_last_error());
        EXL_TRY(exl_grammar_push(g, s, (exl_gkind)x.kind, x.arg));
        EXL_TRY(exl_grammar_push(g, s, EXL_G_RULE, s));
        EXL_TRY(exl_grammar_push(g, s, EXL_G_ALT, 0));
        return exl_grammar_push(g, r, EXL_G_RULE, s);
    }
    int32_t prev = -1; /* o_k ::= x o_(k-1) | ε, o_1 ::= x | ε */
    for (int32_t k = 1; k <= max - min; k++) {
        int32_t o = exl_grammar_helper(g, g->rules[r].name);
        if (o < 0)
            return exl_fail(EXL_ERR_NOMEM, "%s", exl_last_error());
        EXL_TRY(exl_grammar_push(g, o, (exl_gkind)x.kind, x.arg));
        if (prev >= 0)
            EXL_TRY(exl_grammar_push(g, o, EXL_G_RULE, prev));
        EXL_TRY(exl_grammar_push(g, o, EXL_G_ALT, 0));
        prev = o;
    }
    return exl_grammar_push(g, r, EXL_G_RULE, prev);
}

/* ---------------------------------------------------------------- checks and flattening */

/* Which rules can match the empty string (fixpoint over the rules). */
static void find_nullable(const exl_grammar *g, uint8_t *nullable) {
    int changed = 1;
    while (changed) {
        changed = 0;
        for (int32_t r = 0; r < g->n_rules; r++) {
            if (nullable[r])
                continue;
            const exl_grule *rule = &g->rules[r];
            int ok = 1; /* the current alternative so far matches empty */
            for (int32_t i = 0; i <= rule->n && !nullable[r]; i++) {
                if (i == rule->n || rule->el[i].kind == EXL_G_ALT) {
                    if (ok)
                        nullable[r] = 1, changed = 1;
                    ok = 1;
                } else if (rule->el[i].kind == EXL_G_BYTES ||
                           (rule->el[i].kind == EXL_G_RULE && !nullable[rule->el[i].arg])) {
                    ok = 0;
                }
            }
        }
    }
}

/* The rules each rule can start with (a reference preceded by nullable rules only), as lists
 * first[r] .. first[r + 1] in to[]; -1 when out of memory. */
static int start_edges(const exl_grammar *g, const uint8_t *nullable, int32_t *first, int32_t **to) {
    int32_t n = 0, cap = 64;
    *to = exl_malloc((size_t)cap * sizeof **to);
    if (!*to)
        return -1;
    for (int32_t r = 0; r < g->n_rules; r++) {
        const exl_grule *rule = &g->rules[r];
        first[r] = n;
        int at_start = 1;
        for (int32_t i = 0; i < rule->n; i++) {
            const exl_gelem *e = &rule->el[i];
            if (e->kind == EXL_G_ALT) {
                at_start = 1;
                continue;
            }
            if (at_start && e->kind == EXL_G_RULE) {
                if (n == cap) {
                    int32_t *t = exl_realloc(*to, (size_t)(cap *= 2) * sizeof *t);
                    if (!t)
                        return -1;
                    *to = t;
                }
                (*to)[n++] = e->arg;
            }
            at_start = at_start && e->kind == EXL_G_RULE && nullable[e->arg];
        }
    }
    first[g->n_rules] = n;
    return 0;
}

/* A rule that reaches itself before reading a byte, by iterative DFS; -1 when none does. */
static int32_t find_cycle(int32_t n_rules, const int32_t *first, const int32_t *to, uint8_t *color, int32_t *stack,
                          int32_t *edge) {
    for (int32_t start = 0; start < n_rules; start++) {
        if (color[start])
            continue;
        int32_t sp = 0;
        stack[sp] = start;
        edge[sp++] = first[start];
        color[start] = 1;
        while (sp) {
            int32_t r = stack[sp - 1];
            if (edge[sp - 1] == first[r + 1]) {
                color[r] = 2;
                sp--;
                continue;
            }
            int32_t next = to[edge[sp - 1]++];
            if (color[next] == 1)
                return next;
            if (!color[next]) {
                color[next] = 1;
                stack[sp] = next;
                edge[sp++] = first[next];
            }
        }
    }
    return -1;
}

static exl_status check_rules(const exl_grammar *g) {
    for (int32_t r = 0; r < g->n_rules; r++)
        if (!g->rules[r].defined)
            return exl_fail(EXL_ERR_FORMAT, "grammar: rule '%s' is used but not defined", g->rules[r].name);
    int32_t nr = g->n_rules, *to = NULL;
    uint8_t *flags = exl_calloc((size_t)nr, 2);                      /* nullable, then DFS colors */
    int32_t *ints = exl_malloc((size_t)(3 * nr + 1) * sizeof *ints); /* stack, edge, first */
    exl_status st = flags && ints ? EXL_OK : nomem();
    if (st == EXL_OK) {
        find_nullable(g, flags);
        if (start_edges(g, flags, ints + 2 * nr, &to))
            st = nomem();
    }
    if (st == EXL_OK) {
        int32_t bad = find_cycle(nr, ints + 2 * nr, to, flags + nr, ints, ints + nr);
        if (bad >= 0)
            st = exl_fail(EXL_ERR_UNSUPPORTED,
                          "grammar: rule '%s' is left-recursive (it can reach itself before matching a character)",
                          g->rules[bad].name);
    }
    exl_free(to);
    exl_free(flags);
    exl_free(ints);
    return st;
}

exl_status exl_grammar_finish(exl_grammar *g, const char *root_name) {
    g->root = -1;
    for (int32_t r = 0; r < g->n_rules && g->root < 0; r++)
        if (!strcmp(g->rules[r].name, root_name) && g->rules[r].defined)
            g->root = r;
    if (g->root < 0)
        return exl_fail(EXL_ERR_FORMAT, "grammar: no rule named '%s'", root_name);
    EXL_TRY(check_rules(g));
    int64_t n_flat = g->n_elems + g->n_rules, n_alts = g->n_rules;
    for (int32_t r = 0; r < g->n_rules; r++)
        for (int32_t i = 0; i < g->rules[r].n; i++)
            n_alts += g->rules[r].el[i].kind == EXL_G_ALT;
    g->flat = exl_malloc((size_t)n_flat * sizeof *g->flat);
    g->alt_start = exl_malloc((size_t)n_alts * sizeof *g->alt_start);
    g->rule_alt = exl_malloc((size_t)(g->n_rules + 1) * sizeof *g->rule_alt);
    if (!g->flat || !g->alt_start || !g->rule_alt)
        return nomem();
    int32_t at = 0, a = 0;
    for (int32_t r = 0; r < g->n_rules; r++) {
        const exl_grule *rule = &g->rules[r];
        g->rule_alt[r] = a;
        g->alt_start[a++] = at;
        for (int32_t i = 0; i < rule->n; i++) {
            g->flat[at++] = rule->el[i];
            if (rule->el[i].kind == EXL_G_ALT)
                g->alt_start[a++] = at;
        }
        g->flat[at++] = (exl_gelem){EXL_G_END, 0};
    }
    g->rule_alt[g->n_rules] = a;
    return EXL_OK;
}
