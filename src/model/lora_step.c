/* lora_step.c - a step's LoRA updates: each row's adapter uses from its sequence's set (its own, or the model's
 * fallback), uploaded in one table, and the lora nodes after the targeted projections' matmuls (lora.h). */
#include "model/lora.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

exl_status exl_lora_set_make(const exl_model *m, const exl_lora_use *uses, int32_t n, exl_lora_set *out) {
    memset(out, 0, sizeof *out);
    if (n < 0 || n > EXL_LORA_MAX_USES)
        return exl_fail(EXL_ERR_ARG, "%d LoRA adapters in one set (at most %d)", n, EXL_LORA_MAX_USES);
    for (int32_t i = 0; i < n; i++) {
        if (!uses[i].lora || uses[i].lora->m != m)
            return exl_fail(EXL_ERR_ARG, "LoRA adapter %d of the set is not one loaded for this model", i);
        if (!(uses[i].scale == uses[i].scale)) /* NaN */
            return exl_fail(EXL_ERR_ARG, "LoRA adapter %s: its scale is not a number", uses[i].lora->dir);
        out->uses[i] = uses[i];
    }
    out->n = n;
    return EXL_OK;
}

exl_status exl_model_set_lora(exl_model *m, const exl_lora_use *uses, int32_t n) {
    exl_lora_set s;
    EXL_TRY(exl_lora_set_make(m, uses, n, &s));
    if (!m->lora) /* no adapter loaded: only the empty set is possible */
        return EXL_OK;
    m->lora->fallback = s;
    return EXL_OK;
}

uint64_t exl_lora_set_hash(const exl_lora_set *s) {
    uint64_t h = 0;
    for (int32_t i = 0; i < s->n; i++) {
        uint32_t bits;
        memcpy(&bits, &s->uses[i].scale, sizeof bits);
        h = (h ^ s->uses[i].lora->id) * 0x100000001b3ull;
        h = (h ^ bits) * 0x100000001b3ull;
    }
    return h;
}

void exl_lora_step_sets(exl_model *m, const exl_lora_set *const *sets, int32_t n_seqs) {
    if (!m->lora)
        return;
    m->lora->step_sets = sets;
    m->lora->n_step_sets = sets ? n_seqs : 0;
}

/* the step's table (row_uses, use_row, use_slot, use_scale, then the uses by adapter) for `ints` int32s and t for
 * `floats` */
static exl_status ensure_buffers(exl_model *m, int32_t ints, int64_t floats) {
    exl_lora_state *s = m->lora;
    exl_backend *be = m->be;
    if (ints > s->table_cap) {
        int32_t cap = ints > 2 * s->table_cap ? ints : 2 * s->table_cap;
        if (s->table)
            be->ops->free(be, s->table);
        exl_free(s->host_table);
        s->table_cap = 0;
        s->host_table = exl_malloc((size_t)cap * sizeof(int32_t));
        s->table = s->host_table ? be->ops->alloc(be, (size_t)cap * sizeof(int32_t)) : NULL;
        if (!s->table)
            return exl_fail(EXL_ERR_NOMEM, "LoRA step tables: out of memory");
        s->table_cap = cap;
    }
    if (floats > s->t_cap) {
        int64_t cap = floats > 2 * s->t_cap ? floats : 2 * s->t_cap;
        if (s->t)
            be->ops->free(be, s->t);
        s->t_cap = 0;
        if (!(s->t = be->ops->alloc(be, (size_t)cap * sizeof(float))))
            return exl_fail(EXL_ERR_NOMEM, "LoRA scratch: out of memory");
        s->t_cap = cap;
    }
    return EXL_OK;
}

/* The uses by adapter (graph.h's lora node: by_adapter), in step order within an adapter */
static void by_adapter(const int32_t *use_slot, int32_t n, int32_t *out) {
    int32_t *seg = out + 1, *order = seg + n + 1, n_seg = 0, k = 0;
    unsigned char seen[EXL_LORA_SLOTS] = {0};
    for (int32_t u = 0; u < n; u++) {
        const int32_t slot = use_slot[u];
        if (seen[slot])
            continue;
        seen[slot] = 1;
        seg[n_seg++] = k;
        for (int32_t v = u; v < n; v++)
            if (use_slot[v] == slot)
                order[k++] = v;
    }
    for (int32_t i = n_seg; i <= n; i++)
        seg[i] = n;
    out[0] = n_seg;
}

static const exl_lora_set *seq_set(const exl_lora_state *s, int32_t i) {
    const exl_lora_set *set = s->step_sets ? s->step_sets[i] : NULL;
    return set ? set : &s->fallback;
}

exl_status exl_lora_begin_step(exl_model *m, const exl_seq_step *steps, int32_t n_seqs, int32_t rows) {
    exl_lora_state *s = m->lora;
    if (!s)
        return EXL_OK;
    s->rows = rows;
    s->n_uses = s->max_rank = 0;
    if (s->step_sets && s->n_step_sets != n_seqs)
        return exl_fail(EXL_ERR_ARG, "forward: %d sequences, LoRA sets for %d", n_seqs, s->n_step_sets);
    int32_t n_uses = 0;
    const int32_t n_proj = m->cfg.n_layers * EXL_LORA_N_PROJ;
    memset(s->targeted, 0, (size_t)n_proj);
    for (int32_t i = 0; i < n_seqs; i++) {
        const exl_lora_set *set = seq_set(s, i);
        for (int32_t u = 0; u < set->n; u++) {
            const exl_lora *lo = set->uses[u].lora;
            if (set->uses[u].scale == 0)
                continue;
            n_uses += steps[i].n_new;
            s->max_rank = s->max_rank > lo->max_rank ? s->max_rank : lo->max_rank;
            for (int32_t p = 0; p < n_proj; p++)
                s->targeted[p] |= lo->rank[p] > 0;
        }
    }
    if (n_uses == 0) {
        s->step_sets = NULL; /* the sets were for this step */
        return EXL_OK;
    }
    const int32_t ints = rows + 1 + 3 * n_uses + 2 + 2 * n_uses;
    EXL_TRY(ensure_buffers(m, ints, (int64_t)n_uses * EXL_LORA_MAX_OUT * s->max_rank));
    int32_t *row_uses = s->host_table, *use_row = row_uses + rows + 1, *use_slot = use_row + n_uses;
    float *use_scale = (float *)(void *)(use_slot + n_uses);
    int32_t row = 0, k = 0;
    for (int32_t i = 0; i < n_seqs; i++) {
        const exl_lora_set *set = seq_set(s, i);
        for (int32_t t = 0; t < steps[i].n_new; t++, row++) {
            row_uses[row] = k;
            for (int32_t u = 0; u < set->n; u++)
                if (set->uses[u].scale != 0) {
                    use_row[k] = row;
                    use_slot[k] = set->uses[u].lora->slot;
                    use_scale[k++] = set->uses[u].scale;
                }
        }
    }
    row_uses[rows] = k;
    by_adapter(use_slot, n_uses, use_slot + 2 * n_uses);
    s->n_uses = n_uses;
    s->step_sets = NULL;
    return m->be->ops->upload(m->be, s->table, s->host_table, (size_t)ints * sizeof(int32_t));
}

exl_status exl_lora_nodes(exl_model *m, exl_graph *g, int32_t li, int32_t n, const exl_lora_proj *p,
                          const exl_linear *const *w, float *const *out, const int32_t *out_features,
                          const exl_lora_input *in) {
    exl_lora_state *s = m->lora;
    if (!s || s->n_uses == 0)
        return EXL_OK;
    const int32_t *use_row = s->table + s->rows + 1, *use_slot = use_row + s->n_uses;
    exl_node node = {.op = EXL_OP_LORA,
                     .tag = {li, EXL_PART_OTHER},
                     .lora = {.x = in->x,
                              .norm = in->norm,
                              .up = in->up,
                              .eps = in->eps,
                              .act = in->act,
                              .row_uses = s->table,
                              .use_row = use_row,
                              .use_slot = use_slot,
                              .use_scale = (const float *)(const void *)(use_slot + s->n_uses),
                              .by_adapter = use_slot + 2 * s->n_uses,
                              .t = s->t,
                              .rows = s->rows,
                              .in_features = in->in,
                              .n_uses = s->n_uses,
                              .max_rank = s->max_rank}};
    exl_lora_node *l = &node.lora;
    for (int32_t i = 0; i < n && i < EXL_LORA_MAX_OUT; i++) {
        int32_t at = li * EXL_LORA_N_PROJ + p[i];
        if (!s->targeted[at] || w[i] != exl_lora_proj_linear(&m->layers[li], p[i]))
            continue;
        l->out[l->n_out] = out[i];
        l->factors[l->n_out] = s->tables + (size_t)at * EXL_LORA_SLOTS;
        l->out_features[l->n_out++] = out_features[i];
    }
    return l->n_out ? exl_graph_add(g, &node) : EXL_OK;
}

exl_status exl_lora_load_spec(exl_model *m, const char *spec, exl_lora_use *use) {
    const char *colon = strrchr(spec, ':');
    char *end = NULL;
    float scale = 1;
    if (colon && colon[1]) {
        scale = strtof(colon + 1, &end);
        if (*end || !(scale == scale)) /* not a number: part of the directory's name */
            colon = NULL, scale = 1;
    } else {
        colon = NULL;
    }
    char *dir = colon ? exl_strndup(spec, (size_t)(colon - spec)) : exl_strdup(spec);
    if (!dir)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_lora *lo;
    exl_status st = exl_lora_load(m, dir, &lo);
    exl_free(dir);
    EXL_TRY(st);
    *use = (exl_lora_use){lo, scale};
    return EXL_OK;
}

exl_status exl_lora_job_set(const exl_model *m, const exl_lora_use *uses, int32_t n, exl_lora_set *out) {
    if (n != 0)
        return exl_lora_set_make(m, uses, n, out);
    memset(out, 0, sizeof *out);
    if (m->lora)
        *out = m->lora->fallback;
    return EXL_OK;
}

void exl_lora_set_hold(const exl_lora_set *s, int delta) {
    for (int32_t i = 0; i < s->n; i++)
        atomic_fetch_add(&s->uses[i].lora->m->lora->users[s->uses[i].lora->slot], delta);
}

int32_t exl_lora_users(const exl_lora *lo) { return atomic_load(&lo->m->lora->users[lo->slot]); }
