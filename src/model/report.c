/* report.c - the text `exl info` prints: architecture, sizes, dtypes, parameters, memory,
 * and per linear layer its format, code widths and bits per weight. */
#include "model/model.h"

#include "base/error.h"
#include "base/str.h"
#include "format/quant.h"

#include <string.h>

/* Tensor groups by name pattern, counted per dtype. */
static const char *group_of(const char *name) {
    if (strstr(name, "embed_tokens"))
        return "embeddings";
    if (strstr(name, "lm_head"))
        return "head";
    if (strstr(name, "norm"))
        return "norms";
    if (strstr(name, "self_attn"))
        return "attention";
    if (strstr(name, "mlp"))
        return "mlp";
    return "other";
}

/* "4:224 5:32": input rows per code width, widest first. */
static int bits_mix(exl_str *s, const exl_quant_stats *st) {
    int bad = 0, first = 1;
    for (int b = 8; b >= 1; b--)
        if (st->rows_by_bits[b]) {
            bad |= exl_str_printf(s, "%s%d:%lld", first ? "" : " ", b, (long long)st->rows_by_bits[b]);
            first = 0;
        }
    return bad;
}

/* One line per linear layer (format, shape, code widths, bits per weight), then the
 * bits per weight of the decoder layers, the head, and all linear layers together. */
static int linear_report(const exl_model *m, exl_str *s) {
    static const char *kinds[] = {"dense", "EXL2", "GPTQ"};
    double bits[2] = {0}, weights[2] = {0}; /* [0] decoder layers, [1] head */
    int bad = exl_str_puts(s, "linear layers (format, in x out, code widths as bits:rows, bits per weight):\n");
    for (int32_t i = 0; i < m->n_linears; i++) {
        const exl_linear_src *src = &m->linears[i].src;
        const char *name = m->linears[i].name;
        exl_quant_stats st;
        exl_linear_stats(src, &st);
        int head = strncmp(name, "model.layers.", 13) != 0;
        bits[head] += st.bits;
        weights[head] += (double)st.weights;
        bad |= exl_str_printf(s, "  %-36s %-5s %6lld x %-6lld ", name, kinds[src->kind],
                              (long long)src->in_features, (long long)src->out_features);
        if (src->kind == EXL_LINEAR_DENSE)
            bad |= exl_str_printf(s, "%-24s", exl_dtype_name(src->dense.dtype));
        else {
            exl_str mix = EXL_STR_INIT;
            bad |= bits_mix(&mix, &st);
            if (src->kind == EXL_LINEAR_GPTQ)
                bad |= exl_str_printf(&mix, " g%d%s", src->gptq.group_size, src->gptq.g_idx ? " g_idx" : "");
            bad |= exl_str_printf(s, "%-24s", mix.data ? mix.data : "");
            exl_str_free(&mix);
        }
        bad |= exl_str_printf(s, " %6.3f bpw\n", st.bits / (double)st.weights);
    }
    if (weights[0] > 0)
        bad |= exl_str_printf(s, "bits/weight:  %.3f decoder layers", bits[0] / weights[0]);
    if (weights[1] > 0)
        bad |= exl_str_printf(s, ", %.3f head", bits[1] / weights[1]);
    if (weights[0] + weights[1] > 0)
        bad |= exl_str_printf(s, ", %.3f all linear layers\n", (bits[0] + bits[1]) / (weights[0] + weights[1]));
    return bad;
}

exl_status exl_model_report(const exl_model *m, char **out) {
    const exl_hf_config *c = &m->cfg;
    exl_str s = EXL_STR_INIT;
    int bad = 0;
    bad |= exl_str_printf(&s, "model:        %s\n", m->dir);
    bad |= exl_str_printf(&s, "architecture: %s\n", c->model_type);
    bad |= exl_str_printf(&s, "layers:       %d\n", c->n_layers);
    bad |= exl_str_printf(&s, "hidden:       %d (intermediate %d, %s)\n", c->hidden_size, c->intermediate_size,
                          c->act == EXL_ACT_SILU ? "SwiGLU" : "GeGLU");
    bad |= exl_str_printf(&s, "attention:    %d heads, %d kv heads, head_dim %d%s%s\n", c->n_heads, c->n_kv_heads,
                          c->head_dim, c->qkv_bias ? ", q/k/v bias" : "", c->sliding_window ? ", sliding window" : "");
    bad |= exl_str_printf(&s, "rope:         %s, theta %g", exl_rope_type_name(c->rope.type), c->rope.theta);
    if (c->rope.type != EXL_ROPE_DEFAULT)
        bad |= exl_str_printf(&s, ", factor %g", c->rope.factor);
    bad |= exl_str_printf(&s, "\ncontext:      %d\nvocab:        %d%s\n", c->max_pos, c->vocab_size,
                          c->tie_embeddings ? " (tied embeddings)" : "");
    if (c->quant.present)
        bad |= exl_str_printf(&s, "quantization: %s\n", c->quant.method);
    bad |= linear_report(m, &s);

    /* parameters and bytes per (group, dtype) */
    static const char *groups[] = {"embeddings", "attention", "mlp", "norms", "head", "other"};
    uint64_t params[6][EXL_DTYPE_COUNT] = {{0}}, bytes_total = 0;
    uint64_t n_params = 0;
    for (int f = 0; f < m->weights->n_files; f++) {
        const exl_st_file *file = m->weights->files[f];
        for (int i = 0; i < file->n_tensors; i++) {
            const exl_st_tensor *t = &file->tensors[i];
            const char *g = group_of(t->name);
            for (int k = 0; k < 6; k++)
                if (!strcmp(g, groups[k]))
                    params[k][t->dtype] += (uint64_t)exl_st_numel(t);
            bytes_total += t->nbytes;
            if (t->dtype == EXL_DTYPE_F32 || t->dtype == EXL_DTYPE_F16 || t->dtype == EXL_DTYPE_BF16)
                n_params += (uint64_t)exl_st_numel(t);
        }
    }
    bad |= exl_str_puts(&s, "tensors:\n");
    for (int k = 0; k < 6; k++)
        for (int d = 0; d < EXL_DTYPE_COUNT; d++)
            if (params[k][d])
                bad |= exl_str_printf(&s, "  %-12s %-5s %llu values\n", groups[k], exl_dtype_name((exl_dtype)d),
                                      (unsigned long long)params[k][d]);
    bad |= exl_str_printf(&s, "parameters:   %.3f M (unquantized tensors)\n", n_params / 1e6);
    uint64_t kv_per_token = 2ull * c->n_layers * c->n_kv_heads * c->head_dim * m->be->kv_elem_bytes;
    bad |= exl_str_printf(&s, "weights:      %.2f MiB in %d file(s), memory-mapped\n", bytes_total / 1048576.0,
                          m->weights->n_files);
    bad |= exl_str_printf(&s, "kv cache:     %.1f KiB per token on %s (%.1f MiB for %d tokens)\n",
                          kv_per_token / 1024.0, m->be->name, kv_per_token * (double)c->max_pos / 1048576.0,
                          c->max_pos);
    bad |= exl_str_printf(&s, "memory:       %.2f MiB for weights + full-context cache\n",
                          (bytes_total + kv_per_token * (double)c->max_pos) / 1048576.0);
    if (bad) {
        exl_str_free(&s);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    *out = exl_str_steal(&s);
    return EXL_OK;
}
