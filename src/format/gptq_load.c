/* gptq_load.c - find and validate the tensors of one GPTQ linear layer (docs/formats.md).
 *
 * The widths come from the quantization config (quantize_config.json or config.json),
 * and every tensor shape is checked against them, so a config that disagrees with the
 * tensors is an error, never a misread. group_size -1 (one group) is stored in
 * exl_gptq_src as group_size = in_features, so "row k is in group k / group_size" holds
 * for every source without g_idx. */
#include "format/quant.h"

#include "base/error.h"

#include <stdio.h>
#include <string.h>

static int gptq_bits_ok(int b) { return b == 2 || b == 3 || b == 4 || b == 8; }

exl_status exl_gptq_check(const exl_linear_src *src) {
    const exl_gptq_src *q = &src->gptq;
    const char *name = src->name ? src->name : "linear";
    int64_t K = src->in_features, N = src->out_features;
    if (!gptq_bits_ok(q->bits))
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s.qweight: %d-bit GPTQ is not supported (2, 3, 4 and 8 bits are)", name,
                        q->bits);
    if (K * q->bits % 32 || N * q->bits % 32)
        return exl_fail(EXL_ERR_FORMAT, "%s.qweight: %lld x %lld weights do not fill whole %d-bit words", name,
                        (long long)K, (long long)N, q->bits);
    if (q->group_size < 1 || q->n_groups < 1)
        return exl_fail(EXL_ERR_FORMAT, "%s: GPTQ group size %d with %d groups", name, q->group_size, q->n_groups);
    if (q->zero_offset != 0 && q->zero_offset != 1)
        return exl_fail(EXL_ERR_FORMAT, "%s: GPTQ zero offset %d (1 for gptq, 0 for gptq_v2)", name, q->zero_offset);
    if (q->g_idx) {
        for (int64_t k = 0; k < K; k++)
            if (q->g_idx[k] < 0 || q->g_idx[k] >= q->n_groups)
                return exl_fail(EXL_ERR_FORMAT, "%s.g_idx: row %lld is in group %d, outside 0..%d", name, (long long)k,
                                q->g_idx[k], q->n_groups - 1);
    } else if ((K - 1) / q->group_size >= q->n_groups) {
        return exl_fail(EXL_ERR_FORMAT, "%s.scales: %d groups cannot cover %lld rows in groups of %d", name,
                        q->n_groups, (long long)K, q->group_size);
    }
    return EXL_OK;
}

static exl_status get(const exl_weights *w, const char *prefix, const char *suffix, exl_dtype dtype, int n_dims,
                      const int64_t *shape, const exl_st_tensor **t) {
    char name[512];
    snprintf(name, sizeof name, "%s.%s", prefix, suffix);
    return exl_weights_get(w, name, 1u << dtype, n_dims, shape, t);
}

exl_status exl_gptq_load(const exl_weights *w, const exl_quant_config *cfg, const char *prefix, exl_linear_src *src) {
    int64_t K = src->in_features, N = src->out_features;
    if (!cfg || !cfg->present || strcmp(cfg->method, "gptq"))
        return exl_fail(EXL_ERR_FORMAT,
                        "%s.qweight: GPTQ tensors but the model has no GPTQ quantization config "
                        "(quantize_config.json or config.json quantization_config)",
                        prefix);
    int bits = cfg->bits;
    if (!gptq_bits_ok(bits))
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s.qweight: %d-bit GPTQ is not supported (2, 3, 4 and 8 bits are)",
                        prefix, bits);
    if (K * bits % 32 || N * bits % 32)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s.qweight: %lld x %lld weights do not fill whole %d-bit words", prefix,
                        (long long)K, (long long)N, bits);
    int64_t gs = cfg->group_size < 0 ? K : cfg->group_size;
    int64_t G = (K + gs - 1) / gs;
    const exl_st_tensor *qw, *qz, *sc, *gi = NULL;
    int64_t s_qw[2] = {K * bits / 32, N}, s_qz[2] = {G, N * bits / 32}, s_sc[2] = {G, N}, s_gi[1] = {K};
    EXL_TRY(get(w, prefix, "qweight", EXL_DTYPE_I32, 2, s_qw, &qw));
    EXL_TRY(get(w, prefix, "scales", EXL_DTYPE_F16, 2, s_sc, &sc));
    EXL_TRY(get(w, prefix, "qzeros", EXL_DTYPE_I32, 2, s_qz, &qz));
    char name[512];
    snprintf(name, sizeof name, "%s.g_idx", prefix);
    if (exl_weights_find(w, name))
        EXL_TRY(get(w, prefix, "g_idx", EXL_DTYPE_I32, 1, s_gi, &gi));
    exl_gptq_src *q = &src->gptq;
    q->qweight = qw->data;
    q->qzeros = qz->data;
    q->scales = sc->data;
    q->g_idx = gi ? gi->data : NULL;
    q->bits = bits;
    q->group_size = (int32_t)gs;
    q->n_groups = (int32_t)G;
    q->zero_offset = cfg->gptq_v2 ? 0 : 1;
    src->kind = EXL_LINEAR_GPTQ;
    return exl_gptq_check(src);
}
