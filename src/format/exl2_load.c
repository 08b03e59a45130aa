/* exl2_load.c - find and validate the tensors of one EXL2 linear layer (docs/formats.md).
 *
 * Everything a kernel later trusts is checked here: the group table adds up to exactly
 * in_features rows and ends at the last q_weight row, every width is one EXL2 writes,
 * every group holds a whole number of codes, and q_invperm is a permutation. */
#include "format/quant.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdio.h>

static int exl2_bits_ok(int b) { return b == 2 || b == 3 || b == 4 || b == 5 || b == 6 || b == 8; }

exl_status exl_exl2_check(const exl_linear_src *src) {
    const exl_exl2_src *e = &src->exl2;
    const char *name = src->name ? src->name : "linear";
    int64_t K = src->in_features, rows = 0;
    if (e->n_groups < 1)
        return exl_fail(EXL_ERR_FORMAT, "%s: EXL2 layer has no groups", name);
    for (exl_exl2_group g = EXL_EXL2_WALK; exl_exl2_next_group(e, &g);) {
        if (!exl2_bits_ok(g.bits))
            return exl_fail(EXL_ERR_UNSUPPORTED, "%s.q_groups: group %d has %d-bit codes (EXL2 uses 2, 3, 4, 5, 6, 8)",
                            name, g.index, g.bits);
        if (g.index == 0 && g.q_row != 0)
            return exl_fail(EXL_ERR_FORMAT, "%s.q_groups: the first group starts at q_weight row %lld, not 0", name,
                            (long long)g.q_row);
        if (g.q_end <= g.q_row || g.q_end > e->q_rows)
            return exl_fail(EXL_ERR_FORMAT,
                            "%s.q_groups: group %d spans q_weight rows %lld..%lld (q_weight has %d rows)", name,
                            g.index, (long long)g.q_row, (long long)g.q_end, e->q_rows);
        if ((g.q_end - g.q_row) * 32 % g.bits)
            return exl_fail(EXL_ERR_FORMAT, "%s.q_groups: group %d has %lld words of %d-bit codes, not whole codes",
                            name, g.index, (long long)(g.q_end - g.q_row), g.bits);
        rows += g.n_rows;
    }
    if (rows != K)
        return exl_fail(EXL_ERR_FORMAT, "%s.q_groups: groups hold %lld rows but the layer has %lld input features",
                        name, (long long)rows, (long long)K);
    uint8_t *seen = exl_calloc((size_t)K, 1);
    if (!seen)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int64_t k = 0; k < K; k++) {
        int32_t r = e->q_invperm[k];
        if (r < 0 || r >= K || seen[r]) {
            exl_free(seen);
            return exl_fail(EXL_ERR_FORMAT, "%s.q_invperm: not a permutation (entry %lld is %d%s)", name, (long long)k,
                            r, r >= 0 && r < K ? ", repeated" : ", out of range");
        }
        seen[r] = 1;
    }
    exl_free(seen);
    return EXL_OK;
}

static exl_status get(const exl_weights *w, const char *prefix, const char *suffix, exl_dtype dtype, int n_dims,
                      const int64_t *shape, const exl_st_tensor **t) {
    char name[512];
    snprintf(name, sizeof name, "%s.%s", prefix, suffix);
    return exl_weights_get(w, name, 1u << dtype, n_dims, shape, t);
}

exl_status exl_exl2_load(const exl_weights *w, const char *prefix, exl_linear_src *src) {
    int64_t K = src->in_features, N = src->out_features, Np = (N + 31) / 32 * 32;
    const exl_st_tensor *qw, *inv, *sc, *smax, *grp;
    int64_t s_qw[2] = {-1, Np}, s_inv[1] = {K}, s_smax[1] = {-1};
    EXL_TRY(get(w, prefix, "q_weight", EXL_DTYPE_I32, 2, s_qw, &qw));
    EXL_TRY(get(w, prefix, "q_invperm", EXL_DTYPE_I32, 1, s_inv, &inv));
    EXL_TRY(get(w, prefix, "q_scale_max", EXL_DTYPE_F16, 1, s_smax, &smax));
    int64_t G = smax->shape[0];
    int64_t s_sc[2] = {G, Np / 8}, s_grp[1] = {2 * G};
    EXL_TRY(get(w, prefix, "q_scale", EXL_DTYPE_I32, 2, s_sc, &sc));
    EXL_TRY(get(w, prefix, "q_groups", EXL_DTYPE_I16, 1, s_grp, &grp));
    if (qw->shape[0] < 1 || qw->shape[0] > INT32_MAX || G > INT32_MAX / 2)
        return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s.q_weight' has %lld rows", qw->path, prefix,
                        (long long)qw->shape[0]);
    exl_exl2_src *e = &src->exl2;
    e->q_weight = qw->data;
    e->q_invperm = inv->data;
    e->q_scale = sc->data;
    e->q_scale_max = smax->data;
    e->q_groups = grp->data;
    e->q_rows = (int32_t)qw->shape[0];
    e->n_padded = (int32_t)Np;
    e->n_groups = (int32_t)G;
    src->kind = EXL_LINEAR_EXL2;
    return exl_exl2_check(src);
}
