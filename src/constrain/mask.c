/* mask.c - token masks: a preorder walk of the token trie that carries the matcher state of each
 * depth and skips every subtree whose first byte the state cannot read; the same walk stops at the
 * first token where only whether there is one matters. */
#include "constrain/mask.h"

#include "base/alloc.h"
#include "base/error.h"

#include <string.h>

/* Drop every cached mask (they are recomputed on demand). */
static void drop_masks(exl_matcher *m) {
    for (int32_t i = 0; i < m->n_states; i++) {
        exl_free(m->states[i].mask);
        m->states[i].mask = NULL;
    }
    m->mask_bytes = 0;
}

/* The tokens state s allows: set in bits and counted, or (bits NULL) *count 1 at the first one found, else 0. */
static exl_status walk(exl_matcher *m, const exl_token_trie *t, int32_t s, uint32_t *bits, int32_t *count) {
    int32_t *at = exl_malloc((size_t)(t->max_depth + 1) * sizeof *at);
    if (!at)
        return exl_fail(EXL_ERR_NOMEM, "token mask: out of memory");
    at[0] = s;
    *count = 0;
    exl_status st = EXL_OK;
    for (int32_t i = 1; i < t->n_nodes;) {
        int32_t from = at[t->depth[i] - 1], next;
        const int32_t *tr = m->states[from].next;
        if (tr && tr[t->byte[i]] != -2) {
            next = tr[t->byte[i]];
        } else if ((st = exl_matcher_step(m, from, t->byte[i], &next)) != EXL_OK) {
            break;
        }
        if (next < 0) {
            i += t->size[i];
            continue;
        }
        at[t->depth[i]] = next;
        if (!bits && t->tok_n[i]) {
            *count = 1;
            break;
        }
        *count += t->tok_n[i];
        for (int32_t k = 0; k < t->tok_n[i]; k++) {
            int32_t id = t->order[t->tok_first[i] + k];
            bits[id >> 5] |= 1u << (id & 31);
        }
        i++;
    }
    exl_free(at);
    return st;
}

exl_status exl_mask_get(exl_matcher *m, const exl_token_trie *t, int32_t s, const uint32_t **mask) {
    *mask = NULL;
    if (m->mask_vocab != t) {
        drop_masks(m);
        m->mask_vocab = t;
    }
    if (m->states[s].mask) {
        *mask = m->states[s].mask;
        return EXL_OK;
    }
    int64_t bytes = (int64_t)exl_token_mask_words(t->vocab) * 4;
    if (m->mask_bytes + bytes > EXL_MASK_CACHE_BYTES)
        drop_masks(m);
    uint32_t *bits = exl_calloc((size_t)exl_token_mask_words(t->vocab), sizeof *bits);
    if (!bits)
        return exl_fail(EXL_ERR_NOMEM, "token mask: out of memory");
    int32_t count = 0;
    exl_status st = walk(m, t, s, bits, &count);
    if (st != EXL_OK) {
        exl_free(bits);
        return st;
    }
    m->states[s].mask = bits;
    m->states[s].mask_count = count;
    m->mask_bytes += bytes;
    *mask = bits;
    return EXL_OK;
}

exl_status exl_mask_any(exl_matcher *m, const exl_token_trie *t, int32_t s, int *any) {
    if (m->mask_vocab == t && m->states[s].mask) {
        *any = m->states[s].mask_count > 0;
        return EXL_OK;
    }
    int32_t found = 0;
    EXL_TRY(walk(m, t, s, NULL, &found));
    *any = found > 0;
    return EXL_OK;
}
