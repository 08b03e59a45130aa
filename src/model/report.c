/* report.c - the text `exl info` prints: architecture, sizes, per-layer attention windows, experts, norms,
 * dtypes, parameters (total and active per token), memory, and per linear layer (or per kind of linear layer)
 * its format, code widths and bits per weight. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/str.h"
#include "format/quant.h"

#include <stdio.h>
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
    if (strstr(name, "mlp") || strstr(name, "block_sparse_moe"))
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

static int linear_line(exl_str *s, const char *name, const exl_linear_src *src, const exl_quant_stats *st) {
    static const char *kinds[] = {"dense", "EXL2", "GPTQ"};
    int bad = exl_str_printf(s, "  %-36s %-5s %6lld x %-6lld ", name, kinds[src->kind], (long long)src->in_features,
                             (long long)src->out_features);
    if (src->kind == EXL_LINEAR_DENSE) {
        bad |= exl_str_printf(s, "%-24s", exl_dtype_name(src->dense.dtype));
    } else {
        exl_str mix = EXL_STR_INIT;
        bad |= bits_mix(&mix, st);
        if (src->kind == EXL_LINEAR_GPTQ)
            bad |= exl_str_printf(&mix, " g%d%s", src->gptq.group_size, src->gptq.g_idx ? " g_idx" : "");
        bad |= exl_str_printf(s, "%-24s", mix.data ? mix.data : "");
        exl_str_free(&mix);
    }
    return bad | exl_str_printf(s, " %6.3f bpw\n", st->bits / (double)st->weights);
}

/* The length of "<...>.experts." in name, 0 when it is no expert's. */
static size_t experts_prefix(const char *name) {
    const char *e = strstr(name, ".experts.");
    return e ? (size_t)(e - name) + 9 : 0;
}

/* A linear layer's kind: its name after the layer number, with other numbers (experts) as '*':
 * "self_attn.q_proj", "mlp.experts.*.up_proj", "lm_head". */
static void kind_of(const char *name, char *out, size_t cap) {
    const char *layers = strstr(name, "layers.");
    if (layers && (layers == name || layers[-1] == '.') && layers[7] >= '0' && layers[7] <= '9') {
        const char *p = layers + 7;
        while (*p >= '0' && *p <= '9')
            p++;
        if (*p == '.')
            name = p + 1;
    }
    size_t n = 0;
    for (const char *p = name; *p && n + 1 < cap; p++) {
        int number = (p == name || p[-1] == '.') && *p >= '0' && *p <= '9';
        out[n++] = number ? '*' : *p;
        while (number && p[1] >= '0' && p[1] <= '9')
            p++;
    }
    out[n] = 0;
}

/* The linear layers of one kind. */
typedef struct linear_group {
    char kind[64];
    const char *formats[4]; /* "EXL2", "GPTQ" or a dense dtype's name, in order of appearance */
    int32_t n_formats, count;
    int64_t in, out; /* -1: not the same in every layer */
    double bpw_min, bpw_max;
    int bits_min, bits_max; /* code widths (0: none quantized) */
    double bits;            /* storage, all layers */
} linear_group;

static void group_add(linear_group *g, const exl_linear_src *src, const exl_quant_stats *st) {
    static const char *kinds[] = {NULL, "EXL2", "GPTQ"};
    const char *format = src->kind == EXL_LINEAR_DENSE ? exl_dtype_name(src->dense.dtype) : kinds[src->kind];
    int32_t f = 0;
    while (f < g->n_formats && strcmp(g->formats[f], format))
        f++;
    if (f == g->n_formats && f < (int32_t)(sizeof g->formats / sizeof g->formats[0]))
        g->formats[g->n_formats++] = format;
    double bpw = st->bits / (double)st->weights;
    if (!g->count || bpw < g->bpw_min)
        g->bpw_min = bpw;
    if (!g->count || bpw > g->bpw_max)
        g->bpw_max = bpw;
    if (!g->count)
        g->in = src->in_features, g->out = src->out_features;
    if (g->in != src->in_features || g->out != src->out_features)
        g->in = g->out = -1;
    for (int b = 1; b <= 8; b++)
        if (st->rows_by_bits[b]) {
            g->bits_min = g->bits_min && g->bits_min < b ? g->bits_min : b;
            g->bits_max = g->bits_max > b ? g->bits_max : b;
        }
    g->bits += st->bits;
    g->count++;
}

static int group_line(exl_str *s, const linear_group *g, int kind_width) {
    char formats[32] = "", shape[32], bpw[32], codes[16], size[32];
    for (int32_t f = 0; f < g->n_formats; f++)
        snprintf(formats + strlen(formats), sizeof formats - strlen(formats), "%s%s", f ? "+" : "", g->formats[f]);
    if (g->in < 0)
        snprintf(shape, sizeof shape, "%-15s", "mixed");
    else
        snprintf(shape, sizeof shape, "%6lld x %-6lld", (long long)g->in, (long long)g->out);
    if (g->bpw_max - g->bpw_min < 0.0005)
        snprintf(bpw, sizeof bpw, "%.3f", g->bpw_min);
    else
        snprintf(bpw, sizeof bpw, "%.2f-%.2f", g->bpw_min, g->bpw_max);
    if (!g->bits_max)
        snprintf(codes, sizeof codes, "-");
    else if (g->bits_min == g->bits_max)
        snprintf(codes, sizeof codes, "%d", g->bits_max);
    else
        snprintf(codes, sizeof codes, "%d-%d", g->bits_min, g->bits_max);
    double bytes = g->bits / 8;
    if (bytes >= 1048576)
        snprintf(size, sizeof size, "%.2f MiB", bytes / 1048576);
    else
        snprintf(size, sizeof size, "%.1f KiB", bytes / 1024);
    return exl_str_printf(s, "  %-*s %5d  %-10s %s %-12s %-6s %s\n", kind_width, g->kind, (int)g->count, formats, shape,
                          bpw, codes, size);
}

/* One line per kind of linear layer: count, formats, shape, bits per weight (range), code widths, size. */
static int group_report(const exl_model *m, exl_str *s) {
    linear_group *groups = exl_calloc((size_t)m->n_linears + 1, sizeof *groups);
    if (!groups)
        return -1;
    int32_t n = 0;
    for (int32_t i = 0; i < m->n_linears; i++) {
        char kind[64];
        kind_of(m->linears[i].name, kind, sizeof kind);
        int32_t g = 0;
        while (g < n && strcmp(groups[g].kind, kind))
            g++;
        if (g == n)
            snprintf(groups[n++].kind, sizeof groups[g].kind, "%s", kind);
        exl_quant_stats st;
        exl_linear_stats(&m->linears[i].src, &st);
        group_add(&groups[g], &m->linears[i].src, &st);
    }
    int width = 16;
    for (int32_t g = 0; g < n; g++)
        width = (int)strlen(groups[g].kind) > width ? (int)strlen(groups[g].kind) : width;
    int bad = exl_str_puts(s, "linear layers by kind (exl info --verbose: one line each):\n");
    bad |= exl_str_printf(s, "  %-*s %5s  %-10s %6s x %-6s %-12s %-6s %s\n", width, "kind", "count", "format", "in",
                          "out", "bits/weight", "codes", "size");
    for (int32_t g = 0; g < n; g++)
        bad |= group_line(s, &groups[g], width);
    exl_free(groups);
    return bad;
}

/* One line per linear layer (a layer's experts together on one line) or per kind (group_report), then the bits
 * per weight of the decoder layers, the head, and all linear layers together. */
static int linear_report(const exl_model *m, int per_layer, exl_str *s) {
    double bits[2] = {0}, weights[2] = {0}; /* [0] decoder layers, [1] head */
    int bad = per_layer ? exl_str_puts(s, "linear layers (format, in x out, code widths as bits:rows, bits per "
                                          "weight):\n")
                        : group_report(m, s);
    for (int32_t i = 0; i < m->n_linears;) {
        const exl_linear_src *src = &m->linears[i].src;
        const char *name = m->linears[i].name;
        size_t ep = experts_prefix(name);
        exl_quant_stats st, sum;
        exl_linear_stats(src, &sum);
        int32_t n = 1;
        for (; ep && i + n < m->n_linears && !strncmp(m->linears[i + n].name, name, ep); n++) {
            exl_linear_stats(&m->linears[i + n].src, &st);
            sum.bits += st.bits;
            sum.weights += st.weights;
            for (int b = 0; b < 9; b++)
                sum.rows_by_bits[b] += st.rows_by_bits[b];
        }
        int head = strstr(name, ".layers.") == NULL;
        bits[head] += sum.bits;
        weights[head] += (double)sum.weights;
        if (per_layer && n == 1) {
            bad |= linear_line(s, name, src, &sum);
        } else if (per_layer) { /* the experts: their count, and the first one's shape and format */
            char label[128];
            snprintf(label, sizeof label, "%.*s* x%d", (int)ep, name, n);
            bad |= linear_line(s, label, src, &sum);
        }
        i += n;
    }
    if (weights[0] > 0)
        bad |= exl_str_printf(s, "bits/weight:  %.3f decoder layers", bits[0] / weights[0]);
    if (weights[1] > 0)
        bad |= exl_str_printf(s, ", %.3f head", bits[1] / weights[1]);
    if (weights[0] + weights[1] > 0)
        bad |= exl_str_printf(s, ", %.3f all linear layers\n", (bits[0] + bits[1]) / (weights[0] + weights[1]));
    return bad;
}

static int rope_line(exl_str *s, const char *label, const exl_rope_config *r) {
    int bad = exl_str_printf(s, "%-14s%s, theta %g", label, exl_rope_type_name(r->type), r->theta);
    if (r->type != EXL_ROPE_DEFAULT)
        bad |= exl_str_printf(s, ", factor %g", r->factor);
    if (r->original_max_pos && r->type != EXL_ROPE_DEFAULT)
        bad |= exl_str_printf(s, ", original context %d", r->original_max_pos);
    if (r->partial_rotary_factor != 1.0)
        bad |= exl_str_printf(s, ", partial rotary factor %g", r->partial_rotary_factor);
    return bad | exl_str_putc(s, '\n');
}

/* Which layers slide: "SSSF" (S sliding, F full), when any does. */
static int window_lines(exl_str *s, const exl_hf_config *c) {
    if (!c->sliding_window)
        return 0;
    int32_t n = 0;
    for (int32_t i = 0; i < c->n_layers; i++)
        n += c->layers[i].sliding_window > 0;
    int bad = exl_str_printf(s, "windows:      sliding window %d on %d of %d layers (S sliding, F full): ",
                             c->sliding_window, n, c->n_layers);
    for (int32_t i = 0; i < c->n_layers; i++)
        bad |= exl_str_putc(s, c->layers[i].sliding_window ? 'S' : 'F');
    return bad | exl_str_putc(s, '\n');
}

/* Parameters by the config's shapes: all of them, and those one token runs through (a MoE layer's top-k experts
 * of its n). Norms and biases are left out. */
static void param_counts(const exl_hf_config *c, double *total, double *active) {
    double H = c->hidden_size, q = (double)c->n_heads * c->head_dim, kv = (double)c->n_kv_heads * c->head_dim;
    double fixed = c->vocab_size * H * (c->tie_embeddings ? 1 : 2), experts = 0, active_experts = 0;
    for (int32_t i = 0; i < c->n_layers; i++) {
        fixed += H * (q + 2 * kv) + q * H;
        if (!c->layers[i].moe) {
            fixed += 3 * H * c->intermediate_size;
            continue;
        }
        const exl_moe_config *e = &c->moe;
        fixed += H * e->n_experts + (e->shared_ffn ? 3 * H * e->shared_ffn + H : 0);
        experts += 3 * H * e->expert_ffn * e->n_experts;
        active_experts += 3 * H * e->expert_ffn * e->top_k;
    }
    *total = fixed + experts;
    *active = fixed + active_experts;
}

static int layout_lines(exl_str *s, const exl_hf_config *c) {
    int bad = exl_str_printf(s, "attention:    %d heads, %d kv heads, head_dim %d%s%s", c->n_heads, c->n_kv_heads,
                             c->head_dim, c->qkv_bias ? ", q/k/v bias" : "", c->fused_qkv ? ", fused qkv_proj" : "");
    if (c->query_pre_attn_scalar > 0)
        bad |= exl_str_printf(s, ", scores scaled by 1/sqrt(%g)", c->query_pre_attn_scalar);
    if (c->attn_softcap > 0)
        bad |= exl_str_printf(s, ", scores soft-capped at %g", c->attn_softcap);
    bad |= exl_str_putc(s, '\n');
    bad |= window_lines(s, c);
    bad |= rope_line(s, "rope:", &c->rope);
    const exl_rope_config *r = &c->rope, *rs = &c->rope_sliding;
    if (c->sliding_window && (r->type != rs->type || r->theta != rs->theta || r->factor != rs->factor ||
                              r->partial_rotary_factor != rs->partial_rotary_factor))
        bad |= rope_line(s, "rope sliding:", &c->rope_sliding);
    bad |= exl_str_printf(s, "norms:        RMSNorm%s%s%s\n", c->norm_plus_one ? " (1 + w)" : "",
                          c->qk_norm ? ", q/k norms per head" : "",
                          c->sandwich_norms ? ", post-attention and pre/post feed-forward norms" : "");
    if (c->moe.n_experts) {
        const exl_moe_config *e = &c->moe;
        bad |= exl_str_printf(s, "experts:      %d per MoE layer, top-%d%s, expert ffn %d, %d of %d layers MoE",
                              e->n_experts, e->top_k, e->norm_topk_prob ? " (weights renormalized)" : "", e->expert_ffn,
                              e->n_moe_layers, c->n_layers);
        if (e->shared_ffn)
            bad |= exl_str_printf(s, ", shared expert ffn %d with a sigmoid gate", e->shared_ffn);
        bad |= exl_str_putc(s, '\n');
    }
    double total, active;
    param_counts(c, &total, &active);
    bad |= exl_str_printf(s, "by shape:     %.3f M parameters", total / 1e6);
    if (c->moe.n_experts)
        bad |= exl_str_printf(s, ", %.3f M active per token", active / 1e6);
    return bad | exl_str_putc(s, '\n');
}

static int token_lines(exl_str *s, const exl_hf_config *c) {
    int bad = exl_str_printf(s, "context:      %d\nvocab:        %d%s\n", c->max_pos, c->vocab_size,
                             c->tie_embeddings ? " (tied embeddings)" : "");
    if (c->final_softcap > 0)
        bad |= exl_str_printf(s, "logits:       soft-capped at %g\n", c->final_softcap);
    bad |= exl_str_printf(s, "tokens:       bos %d, eos", c->bos_token_id);
    for (int32_t i = 0; i < c->n_eos; i++)
        bad |= exl_str_printf(s, " %d", c->eos_token_ids[i]);
    bad |= exl_str_putc(s, '\n');
    const exl_generation_config *g = &c->gen;
    if (!g->present || (g->do_sample < 0 && g->temperature < 0 && g->top_k < 0 && g->top_p < 0 && g->min_p < 0 &&
                        g->repetition_penalty < 0))
        return bad;
    bad |= exl_str_puts(s, "generation:  ");
    if (g->do_sample >= 0)
        bad |= exl_str_printf(s, " %s", g->do_sample ? "sample" : "greedy");
    if (g->temperature >= 0)
        bad |= exl_str_printf(s, " temperature %g", g->temperature);
    if (g->top_k >= 0)
        bad |= exl_str_printf(s, " top_k %d", g->top_k);
    if (g->top_p >= 0)
        bad |= exl_str_printf(s, " top_p %g", g->top_p);
    if (g->min_p >= 0)
        bad |= exl_str_printf(s, " min_p %g", g->min_p);
    if (g->repetition_penalty >= 0)
        bad |= exl_str_printf(s, " repetition_penalty %g", g->repetition_penalty);
    return bad | exl_str_puts(s, " (generation_config.json)\n");
}

static exl_status report(const exl_model *m, int per_layer, char **out) {
    const exl_hf_config *c = &m->cfg;
    exl_str s = EXL_STR_INIT;
    int bad = 0;
    bad |= exl_str_printf(&s, "model:        %s\n", m->dir);
    bad |= exl_str_printf(&s, "architecture: %s", c->model_type);
    if (c->vision_ignored)
        bad |= exl_str_printf(&s, " (its %s text model; the vision tower is ignored)", exl_arch_name(c->arch));
    bad |= exl_str_printf(&s, "\nlayers:       %d\n", c->n_layers);
    bad |= exl_str_printf(&s, "hidden:       %d (intermediate %d, %s%s)\n", c->hidden_size, c->intermediate_size,
                          c->act == EXL_ACT_SILU ? "SwiGLU" : "GeGLU", c->fused_gate_up ? ", fused gate_up_proj" : "");
    bad |= layout_lines(&s, c);
    bad |= token_lines(&s, c);
    if (c->quant.present)
        bad |= exl_str_printf(&s, "quantization: %s\n", c->quant.method);
    bad |= linear_report(m, per_layer, &s);

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

exl_status exl_model_report(const exl_model *m, char **out) { return report(m, 1, out); }

exl_status exl_model_report_grouped(const exl_model *m, char **out) { return report(m, 0, out); }
