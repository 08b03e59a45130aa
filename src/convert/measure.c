/* measure.c - the candidate EXL2 recipes of a block.
 *
 * Each linear gets one of a ladder of levels, from about 2.1 to 8.2 bits per weight.
 * A block's candidates are every level applied to all its linears, and the same with
 * its most sensitive linear (v_proj in attention, down_proj in the MLP) one or two levels
 * higher; a mixture's experts all take the block's recipe. The driver (quantize.c) measures each candidate's output error. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"

#include <string.h>

static const exl_qz_opt levels[] = {
    {1, {2}, {1}, {128}},
    {1, {2}, {1}, {64}},
    {2, {3, 2}, {0.1, 0.9}, {64, 64}},
    {2, {3, 2}, {0.3, 0.7}, {64, 64}},
    {1, {3}, {1}, {64}},
    {2, {4, 3}, {0.25, 0.75}, {64, 64}},
    {1, {4}, {1}, {128}},
    {1, {4}, {1}, {32}},
    {2, {5, 4}, {0.25, 0.75}, {64, 64}},
    {1, {5}, {1}, {64}},
    {2, {6, 5}, {0.25, 0.75}, {64, 64}},
    {1, {6}, {1}, {64}},
    {2, {8, 6}, {0.25, 0.75}, {128, 128}},
    {1, {8}, {1}, {128}},
};
#define N_LEVELS ((int)(sizeof levels / sizeof levels[0]))

exl_status exl_qz_candidates(const exl_qz_block_desc *d, exl_qz_recipe **out, int32_t *n_out) {
    const int32_t sensitive = 2; /* v_proj of (q, k, v, o); down_proj of (gate, up, down) */
    exl_qz_recipe *r = exl_calloc((size_t)N_LEVELS * 3, sizeof *r);
    if (!r)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    int32_t n = 0;
    for (int lv = 0; lv < N_LEVELS; lv++)
        for (int up = 0; up <= 2; up++) {
            if (lv + up >= N_LEVELS)
                break;
            exl_qz_recipe *c = &r[n++];
            c->total_bits = 0;
            for (int32_t i = 0; i < d->n_linears; i++) {
                c->opt[i] = levels[i == sensitive ? lv + up : lv];
                c->total_bits += d->copies * exl_exl2_opt_bits(&c->opt[i], d->K[i], d->N[i]);
            }
        }
    *out = r;
    *n_out = n;
    return EXL_OK;
}

void exl_qz_measurement_free(exl_qz_measurement *m) {
    for (int32_t i = 0; i < m->n_blocks; i++)
        exl_free(m->b[i].r);
    exl_free(m->b);
    memset(m, 0, sizeof *m);
}
