/* hf_layers.c - which decoder layers slide over a window and which run a mixture of experts, from config.json's
 * layer_types or the older fields transformers 5 derives them from (per architecture). */
#include "io/hf_config_parts.h"

#include "base/error.h"

#include <string.h>

static int qwen_family(exl_arch a) {
    return a == EXL_ARCH_QWEN2 || a == EXL_ARCH_QWEN3 || a == EXL_ARCH_QWEN3_MOE || a == EXL_ARCH_QWEN2_MOE;
}

/* The window the sliding layers use: sliding_window (null: none; absent: the architecture's default), switched
 * off by use_sliding_window (Qwen models, off by default; Mistral's as older configs have it). */
static exl_status parse_window(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg, int32_t *window) {
    int gemma = cfg->arch == EXL_ARCH_GEMMA2 || cfg->arch == EXL_ARCH_GEMMA3;
    *window = cfg->arch == EXL_ARCH_MISTRAL || gemma || qwen_family(cfg->arch) ? 4096 : 0;
    if (exl_jis_null(o, "sliding_window"))
        *window = 0;
    EXL_TRY(exl_jget_int(c, o, "sliding_window", 0, 0, 1 << 30, window));
    int use = !qwen_family(cfg->arch);
    if (qwen_family(cfg->arch) || cfg->arch == EXL_ARCH_MISTRAL)
        EXL_TRY(exl_jget_bool(c, o, "use_sliding_window", &use));
    if (!use)
        *window = 0;
    if (cfg->arch == EXL_ARCH_GEMMA3) {
        int bidirectional = 0;
        EXL_TRY(exl_jget_bool(c, o, "use_bidirectional_attention", &bidirectional));
        if (bidirectional)
            return exl_fail(EXL_ERR_UNSUPPORTED,
                            "%s: field \"%suse_bidirectional_attention\" = true (an embedding model) is not supported",
                            c->file, c->section);
    }
    return EXL_OK;
}

/* layer_types as given: one of "full_attention", "sliding_attention" per layer. */
static exl_status read_layer_types(const exl_jctx *c, const cJSON *types, exl_hf_config *cfg) {
    if (!cJSON_IsArray(types))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%slayer_types\" must be a list of strings", c->file, c->section);
    int32_t i = 0;
    for (const cJSON *e = types->child; e; e = e->next, i++) {
        if (!cJSON_IsString(e))
            return exl_fail(EXL_ERR_FORMAT, "%s: field \"%slayer_types\" must be a list of strings", c->file,
                            c->section);
        int sliding = !strcmp(e->valuestring, "sliding_attention");
        if (sliding && i < cfg->n_layers)
            cfg->layers[i].sliding = 1;
        else if (!sliding && strcmp(e->valuestring, "full_attention"))
            return exl_fail(EXL_ERR_UNSUPPORTED,
                            "%s: field \"%slayer_types\"[%d] = '%s' is an unsupported layer type (exl runs "
                            "full_attention and sliding_attention)",
                            c->file, c->section, i, e->valuestring);
    }
    if (i != cfg->n_layers)
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%slayer_types\" has %d entries for %d layers", c->file, c->section,
                        i, cfg->n_layers);
    return EXL_OK;
}

/* transformers' defaults when layer_types is absent */
static exl_status default_layer_types(const exl_jctx *c, const cJSON *o, int32_t window, exl_hf_config *cfg) {
    int32_t max_window_layers = 28, pattern = 6;
    EXL_TRY(exl_jget_int(c, o, "max_window_layers", 0, 0, 1 << 20, &max_window_layers));
    if (cfg->arch == EXL_ARCH_GEMMA3)
        EXL_TRY(exl_jget_int(c, o, "sliding_window_pattern", 0, 1, 1 << 20, &pattern));
    for (int32_t i = 0; i < cfg->n_layers; i++) {
        int sliding;
        switch (cfg->arch) {
        case EXL_ARCH_GEMMA2: sliding = i % 2 == 0; break;
        case EXL_ARCH_GEMMA3: sliding = (i + 1) % pattern != 0; break;
        case EXL_ARCH_QWEN2:
        case EXL_ARCH_QWEN3: sliding = window > 0 && i >= max_window_layers; break;
        case EXL_ARCH_QWEN2_MOE: sliding = window > 0 && i % 2 == 0 && i < max_window_layers; break;
        default: sliding = window > 0; break;
        }
        cfg->layers[i].sliding = (uint8_t)sliding;
    }
    return EXL_OK;
}

exl_status exl_hf_parse_layers(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    int32_t window;
    EXL_TRY(parse_window(c, o, cfg, &window));
    const cJSON *types = exl_jfield(o, "layer_types");
    if (types)
        EXL_TRY(read_layer_types(c, types, cfg));
    else
        EXL_TRY(default_layer_types(c, o, window, cfg));
    cfg->sliding_window = 0;
    for (int32_t i = 0; i < cfg->n_layers; i++) {
        if (!cfg->layers[i].sliding)
            continue;
        if (window == 0)
            return exl_fail(EXL_ERR_FORMAT,
                            "%s: layer %d is a sliding_attention layer but \"%ssliding_window\" is not set (or "
                            "use_sliding_window is false)",
                            c->file, i, c->section);
        cfg->layers[i].sliding_window = window;
        cfg->sliding_window = window;
    }
    return EXL_OK;
}

/* ---- mixture of experts */

/* num_experts (Qwen) and num_local_experts (Mixtral; transformers 5 maps Qwen3-MoE's onto it) */
static exl_status parse_expert_count(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    int32_t a = -1, b = -1;
    EXL_TRY(exl_jget_int(c, o, "num_experts", 0, 0, 1 << 16, &a));
    EXL_TRY(exl_jget_int(c, o, "num_local_experts", 0, 0, 1 << 16, &b));
    if (a >= 0 && b >= 0 && a != b)
        return exl_fail(EXL_ERR_FORMAT, "%s: fields \"%snum_experts\" (%d) and \"num_local_experts\" (%d) disagree",
                        c->file, c->section, a, b);
    if (a >= 0)
        cfg->moe.n_experts = a;
    if (b >= 0)
        cfg->moe.n_experts = b;
    if (cfg->moe.n_experts < 1)
        return exl_fail(EXL_ERR_FORMAT, "%s: a %s model needs experts (\"%s%s\" is %d)", c->file,
                        exl_arch_name(cfg->arch), c->section,
                        cfg->arch == EXL_ARCH_MIXTRAL ? "num_local_experts" : "num_experts", cfg->moe.n_experts);
    return EXL_OK;
}

/* Qwen MoE models: layer i is sparse unless listed in mlp_only_layers or off the decoder_sparse_step grid. */
static exl_status qwen_moe_layers(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    int32_t step = 1;
    EXL_TRY(exl_jget_int(c, o, "decoder_sparse_step", 0, 1, 1 << 20, &step));
    for (int32_t i = 0; i < cfg->n_layers; i++)
        cfg->layers[i].moe = (i + 1) % step == 0;
    const cJSON *only = exl_jfield(o, "mlp_only_layers");
    if (only && !cJSON_IsArray(only))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%smlp_only_layers\" must be a list of layer indices", c->file,
                        c->section);
    for (const cJSON *e = only ? only->child : NULL; e; e = e->next) {
        if (!cJSON_IsNumber(e) || !(e->valuedouble >= 0 && e->valuedouble < cfg->n_layers) ||
            e->valuedouble != (int32_t)e->valuedouble)
            return exl_fail(EXL_ERR_FORMAT, "%s: field \"%smlp_only_layers\" must list layer indices below %d", c->file,
                            c->section, cfg->n_layers);
        cfg->layers[(int32_t)e->valuedouble].moe = 0;
    }
    return EXL_OK;
}

exl_status exl_hf_parse_moe(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    exl_moe_config *moe = &cfg->moe;
    switch (cfg->arch) {
    case EXL_ARCH_MIXTRAL: *moe = (exl_moe_config){8, 2, cfg->intermediate_size, 1, 0, 0}; break;
    case EXL_ARCH_QWEN3_MOE: *moe = (exl_moe_config){128, 8, 768, 0, 0, 0}; break;
    case EXL_ARCH_QWEN2_MOE: *moe = (exl_moe_config){60, 4, 1408, 0, 5632, 0}; break;
    default: return EXL_OK;
    }
    EXL_TRY(parse_expert_count(c, o, cfg));
    EXL_TRY(exl_jget_int(c, o, "num_experts_per_tok", 0, 1, 1 << 16, &moe->top_k));
    if (moe->top_k > moe->n_experts)
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%snum_experts_per_tok\" = %d exceeds the %d experts", c->file,
                        c->section, moe->top_k, moe->n_experts);
    if (cfg->arch == EXL_ARCH_MIXTRAL) {
        for (int32_t i = 0; i < cfg->n_layers; i++)
            cfg->layers[i].moe = 1;
    } else {
        EXL_TRY(exl_jget_int(c, o, "moe_intermediate_size", 0, 1, 1 << 20, &moe->expert_ffn));
        EXL_TRY(exl_jget_bool(c, o, "norm_topk_prob", &moe->norm_topk_prob));
        if (cfg->arch == EXL_ARCH_QWEN2_MOE)
            EXL_TRY(exl_jget_int(c, o, "shared_expert_intermediate_size", 0, 1, 1 << 20, &moe->shared_ffn));
        EXL_TRY(qwen_moe_layers(c, o, cfg));
    }
    for (int32_t i = 0; i < cfg->n_layers; i++)
        moe->n_moe_layers += cfg->layers[i].moe;
    return EXL_OK;
}
