/* hf_config.c - read config.json: architecture, sizes, attention and MLP layout, tokens, quantization, with
 * transformers 5's defaults per architecture for absent fields. */
#include "io/hf_config.h"

#include "base/alloc.h"
#include "base/error.h"
#include "io/hf_config_parts.h"
#include "io/json_file.h"

#include <stdio.h>
#include <string.h>

/* An architecture: its names and transformers' defaults for fields a config may leave out. */
typedef struct arch_info {
    const char *model_type, *class_name;
    exl_arch arch;
    int32_t vocab, hidden, ffn, layers, heads;
    int32_t kv_heads, head_dim; /* 0: n_heads, hidden / n_heads */
    int32_t max_pos;
    double rms_eps;
    int tie;
    int32_t bos, eos; /* -1 = none */
} arch_info;

static const arch_info archs[] = {
    {"llama", "LlamaForCausalLM", EXL_ARCH_LLAMA, 32000, 4096, 11008, 32, 32, 0, 0, 2048, 1e-6, 0, 1, 2},
    {"mistral", "MistralForCausalLM", EXL_ARCH_MISTRAL, 32000, 4096, 14336, 32, 32, 8, 0, 131072, 1e-6, 0, 1, 2},
    {"qwen2", "Qwen2ForCausalLM", EXL_ARCH_QWEN2, 151936, 4096, 22016, 32, 32, 32, 0, 32768, 1e-6, 0, -1, -1},
    {"gemma", "GemmaForCausalLM", EXL_ARCH_GEMMA, 256000, 3072, 24576, 28, 16, 16, 256, 8192, 1e-6, 1, 2, 1},
    {"qwen3", "Qwen3ForCausalLM", EXL_ARCH_QWEN3, 151936, 4096, 22016, 32, 32, 32, 128, 32768, 1e-6, 0, -1, -1},
    {"gemma2", "Gemma2ForCausalLM", EXL_ARCH_GEMMA2, 256000, 2304, 9216, 26, 8, 4, 256, 8192, 1e-6, 1, 2, 1},
    {"gemma3_text", "Gemma3ForCausalLM", EXL_ARCH_GEMMA3, 262208, 2304, 9216, 26, 8, 4, 256, 131072, 1e-6, 1, 2, 1},
    {"phi3", "Phi3ForCausalLM", EXL_ARCH_PHI3, 32064, 3072, 8192, 32, 32, 0, 0, 4096, 1e-5, 0, 1, 32000},
    {"mixtral", "MixtralForCausalLM", EXL_ARCH_MIXTRAL, 32000, 4096, 14336, 32, 32, 8, 0, 131072, 1e-5, 0, 1, 2},
    {"qwen3_moe", "Qwen3MoeForCausalLM", EXL_ARCH_QWEN3_MOE, 151936, 2048, 6144, 24, 32, 4, 0, 32768, 1e-6, 0, -1, -1},
    {"qwen2_moe", "Qwen2MoeForCausalLM", EXL_ARCH_QWEN2_MOE, 151936, 2048, 5632, 24, 16, 16, 0, 32768, 1e-6, 0, -1, -1},
};
#define N_ARCHS ((int)(sizeof archs / sizeof archs[0]))

/* Multimodal checkpoints whose text_config holds one of the models above. */
static const struct {
    const char *model_type, *class_name, *text_type;
} wrappers[] = {
    {"gemma3", "Gemma3ForConditionalGeneration", "gemma3_text"},
};

const char *exl_arch_name(exl_arch a) {
    for (int i = 0; i < N_ARCHS; i++)
        if (archs[i].arch == a)
            return archs[i].model_type;
    return "?";
}

/* ---- architecture: model_type, else the first architectures entry */

static const arch_info *find_arch(const char *model_type, const char *class_name) {
    for (int i = 0; i < N_ARCHS; i++)
        if ((model_type && !strcmp(model_type, archs[i].model_type)) ||
            (!model_type && !strcmp(class_name, archs[i].class_name)))
            return &archs[i];
    return NULL;
}

/* The architecture and the object that describes the text model (root, or a wrapper's text_config, which may be
 * NULL: all defaults). */
static exl_status parse_arch(const exl_jctx *c, const cJSON *root, exl_hf_config *cfg, const arch_info **arch,
                             const cJSON **text) {
    const char *model_type = NULL, *class_name = NULL;
    EXL_TRY(exl_jget_str(c, root, "model_type", &model_type));
    const cJSON *names = exl_jfield(root, "architectures");
    if (names) {
        if (!cJSON_IsArray(names) || (names->child && !cJSON_IsString(names->child)))
            return exl_fail(EXL_ERR_FORMAT, "%s: field \"architectures\" must be a list of strings", c->file);
        if (names->child)
            class_name = names->child->valuestring;
    }
    if (!model_type && !class_name)
        return exl_fail(EXL_ERR_FORMAT, "%s: neither \"model_type\" nor \"architectures\" is given", c->file);
    snprintf(cfg->model_type, sizeof cfg->model_type, "%s", model_type ? model_type : "");
    *text = root;
    for (size_t i = 0; i < sizeof wrappers / sizeof wrappers[0]; i++) {
        if (model_type ? strcmp(model_type, wrappers[i].model_type) : strcmp(class_name, wrappers[i].class_name))
            continue;
        EXL_TRY(exl_jget_obj(c, root, "text_config", text));
        const char *text_type = NULL;
        exl_jctx tc = {c->file, "text_config."};
        EXL_TRY(exl_jget_str(&tc, *text, "model_type", &text_type));
        if (text_type && strcmp(text_type, wrappers[i].text_type))
            return exl_fail(EXL_ERR_UNSUPPORTED, "%s: field \"text_config.model_type\" = '%s' (a %s model holds %s)",
                            c->file, text_type, wrappers[i].model_type, wrappers[i].text_type);
        model_type = wrappers[i].text_type;
        cfg->vision_ignored = 1;
        snprintf(cfg->model_type, sizeof cfg->model_type, "%s", wrappers[i].model_type);
        break;
    }
    if (!(*arch = find_arch(model_type, class_name)))
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: unsupported architecture '%s' (exl reads llama, mistral, qwen2, qwen3, gemma, gemma2, "
                        "gemma3, phi3, mixtral, qwen2_moe and qwen3_moe)",
                        c->file, model_type ? model_type : class_name);
    cfg->arch = (*arch)->arch;
    if (!cfg->model_type[0])
        snprintf(cfg->model_type, sizeof cfg->model_type, "%s", (*arch)->model_type);
    return EXL_OK;
}

/* ---- sizes */

static exl_status parse_sizes(const exl_jctx *c, const cJSON *o, const arch_info *a, exl_hf_config *cfg) {
    cfg->vocab_size = a->vocab;
    cfg->hidden_size = a->hidden;
    cfg->intermediate_size = a->ffn;
    cfg->n_layers = a->layers;
    cfg->n_heads = a->heads;
    EXL_TRY(exl_jget_int(c, o, "vocab_size", 0, 1, 1 << 24, &cfg->vocab_size));
    EXL_TRY(exl_jget_int(c, o, "hidden_size", 0, 1, 1 << 17, &cfg->hidden_size));
    EXL_TRY(exl_jget_int(c, o, "intermediate_size", 0, 1, 1 << 20, &cfg->intermediate_size));
    EXL_TRY(exl_jget_int(c, o, "num_hidden_layers", 0, 1, EXL_MAX_LAYERS, &cfg->n_layers));
    EXL_TRY(exl_jget_int(c, o, "num_attention_heads", 0, 1, 4096, &cfg->n_heads));
    cfg->n_kv_heads = a->kv_heads && !exl_jis_null(o, "num_key_value_heads") ? a->kv_heads : cfg->n_heads;
    EXL_TRY(exl_jget_int(c, o, "num_key_value_heads", 0, 1, 4096, &cfg->n_kv_heads));
    if (cfg->n_heads % cfg->n_kv_heads)
        return exl_fail(EXL_ERR_FORMAT, "%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                        c->file, cfg->n_heads, cfg->n_kv_heads);
    cfg->head_dim = a->head_dim && !exl_jis_null(o, "head_dim") ? a->head_dim : cfg->hidden_size / cfg->n_heads;
    EXL_TRY(exl_jget_int(c, o, "head_dim", 0, 1, 4096, &cfg->head_dim));
    if (cfg->head_dim < 2 || cfg->head_dim % 2)
        return exl_fail(EXL_ERR_FORMAT, "%s: head_dim %d must be even for rotary embeddings", c->file, cfg->head_dim);
    cfg->max_pos = a->max_pos;
    EXL_TRY(exl_jget_int(c, o, "max_position_embeddings", 0, 1, 1 << 30, &cfg->max_pos));
    cfg->rms_eps = a->rms_eps;
    return exl_jget_num(c, o, "rms_norm_eps", 0, 1, &cfg->rms_eps);
}

/* ---- activation: Gemma models read hidden_activation, the others hidden_act */

static exl_status parse_act(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    int gemma = cfg->arch == EXL_ARCH_GEMMA || cfg->arch == EXL_ARCH_GEMMA2 || cfg->arch == EXL_ARCH_GEMMA3;
    const char *key = gemma ? "hidden_activation" : "hidden_act", *act = NULL;
    EXL_TRY(exl_jget_str(c, o, key, &act));
    if (!act)
        act = gemma ? "gelu_pytorch_tanh" : "silu";
    if (!strcmp(act, "silu") || !strcmp(act, "swish"))
        cfg->act = EXL_ACT_SILU;
    else if (!strcmp(act, "gelu_pytorch_tanh") || !strcmp(act, "gelu_tanh") || !strcmp(act, "gelu_new"))
        cfg->act = EXL_ACT_GELU_TANH;
    else if (!strcmp(act, "gelu"))
        cfg->act = EXL_ACT_GELU;
    else
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: field \"%s%s\" = '%s' is an unsupported activation (exl runs silu, gelu and "
                        "gelu_pytorch_tanh)",
                        c->file, c->section, key, act);
    return EXL_OK;
}

/* ---- the layer's parts: biases, norms, fused projections, Gemma 2/3's attention scaling and soft-capping */

/* A soft-capping value: null means none, absent the default. */
static exl_status get_softcap(const exl_jctx *c, const cJSON *o, const char *key, double dflt, double *out) {
    *out = exl_jis_null(o, key) ? 0 : dflt;
    return exl_jget_num(c, o, key, 0, 1e6, out);
}

static exl_status parse_layout(const exl_jctx *c, const cJSON *o, const arch_info *a, exl_hf_config *cfg) {
    exl_arch arch = cfg->arch;
    cfg->tie_embeddings = a->tie;
    EXL_TRY(exl_jget_bool(c, o, "tie_word_embeddings", &cfg->tie_embeddings));
    int attention_bias = 0;
    if (arch == EXL_ARCH_QWEN2) { /* bias on q, k and v only, always */
        cfg->qkv_bias = 1;
    } else if (arch == EXL_ARCH_QWEN2_MOE) {
        cfg->qkv_bias = 1;
        EXL_TRY(exl_jget_bool(c, o, "qkv_bias", &cfg->qkv_bias));
    } else if (arch != EXL_ARCH_PHI3 && arch != EXL_ARCH_MIXTRAL) {
        EXL_TRY(exl_jget_bool(c, o, "attention_bias", &attention_bias));
        cfg->qkv_bias = cfg->o_bias = attention_bias;
    }
    if (arch == EXL_ARCH_LLAMA)
        EXL_TRY(exl_jget_bool(c, o, "mlp_bias", &cfg->mlp_bias));
    cfg->qk_norm = arch == EXL_ARCH_QWEN3 || arch == EXL_ARCH_QWEN3_MOE || arch == EXL_ARCH_GEMMA3;
    cfg->sandwich_norms = arch == EXL_ARCH_GEMMA2 || arch == EXL_ARCH_GEMMA3;
    cfg->fused_qkv = cfg->fused_gate_up = arch == EXL_ARCH_PHI3;
    cfg->norm_plus_one = arch == EXL_ARCH_GEMMA || cfg->sandwich_norms;
    if (!cfg->sandwich_norms)
        return EXL_OK;
    cfg->query_pre_attn_scalar = 256;
    EXL_TRY(exl_jget_num(c, o, "query_pre_attn_scalar", 1e-6, 1e9, &cfg->query_pre_attn_scalar));
    int gemma2 = arch == EXL_ARCH_GEMMA2;
    EXL_TRY(get_softcap(c, o, "attn_logit_softcapping", gemma2 ? 50.0 : 0.0, &cfg->attn_softcap));
    return get_softcap(c, o, "final_logit_softcapping", gemma2 ? 30.0 : 0.0, &cfg->final_softcap);
}

/* ---- special tokens */

static exl_status add_eos(const exl_jctx *c, exl_hf_config *cfg, const cJSON *e) {
    if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= (1 << 24) ||
        e->valuedouble != (int32_t)e->valuedouble)
        return exl_fail(EXL_ERR_FORMAT, "%s: \"%seos_token_id\" must be a token id or a list of them", c->file,
                        c->section);
    int32_t id = (int32_t)e->valuedouble;
    for (int32_t i = 0; i < cfg->n_eos; i++)
        if (cfg->eos_token_ids[i] == id)
            return EXL_OK;
    if (cfg->n_eos < (int32_t)(sizeof cfg->eos_token_ids / sizeof cfg->eos_token_ids[0]))
        cfg->eos_token_ids[cfg->n_eos++] = id;
    return EXL_OK;
}

exl_status exl_hf_parse_eos(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    const cJSON *eos = exl_jfield(o, "eos_token_id");
    if (!cJSON_IsArray(eos))
        return eos ? add_eos(c, cfg, eos) : EXL_OK;
    for (const cJSON *e = eos->child; e; e = e->next)
        EXL_TRY(add_eos(c, cfg, e));
    return EXL_OK;
}

/* bos_token_id and eos_token_id */
static exl_status parse_tokens(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    if (exl_jis_null(o, "bos_token_id"))
        cfg->bos_token_id = -1;
    EXL_TRY(exl_jget_int(c, o, "bos_token_id", 0, 0, (1 << 24) - 1, &cfg->bos_token_id));
    return exl_hf_parse_eos(c, o, cfg);
}

/* ---- quantization_config / quantize_config.json */

exl_status exl_hf_quant_parse(const char *name, const cJSON *q, exl_quant_config *out) {
    exl_jctx c = {name, "quantization_config."};
    if (!cJSON_IsObject(q))
        return exl_fail(EXL_ERR_FORMAT, "%s: quantization config must be an object", name);
    const char *method = NULL, *fmt = NULL;
    EXL_TRY(exl_jget_str(&c, q, "quant_method", &method));
    EXL_TRY(exl_jget_str(&c, q, "checkpoint_format", &fmt));
    if (!method)
        method = "gptq"; /* quantize_config.json carries no method */
    if (strcmp(method, "gptq") && strcmp(method, "exl2"))
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: unsupported quantization method '%s' (exl reads exl2 and gptq)", name,
                        method);
    out->present = 1;
    snprintf(out->method, sizeof out->method, "%s", method);
    if (!strcmp(method, "exl2")) {
        EXL_TRY(exl_jget_num(&c, q, "bits", 1, 16, &out->exl2_bits));
        EXL_TRY(exl_jget_num(&c, q, "head_bits", 1, 16, &out->exl2_head_bits));
        return EXL_OK;
    }
    if (!out->bits)
        out->bits = 4;
    if (!out->group_size)
        out->group_size = 128;
    EXL_TRY(exl_jget_int(&c, q, "bits", 0, 1, 16, &out->bits));
    EXL_TRY(exl_jget_int(&c, q, "group_size", 0, -1, 1 << 30, &out->group_size));
    if (out->group_size == 0)
        return exl_fail(EXL_ERR_FORMAT, "%s: group_size 0 is not valid", name);
    EXL_TRY(exl_jget_bool(&c, q, "desc_act", &out->desc_act));
    EXL_TRY(exl_jget_bool(&c, q, "sym", &out->sym));
    if (fmt) {
        if (!strcmp(fmt, "gptq_v2"))
            out->gptq_v2 = 1;
        else if (strcmp(fmt, "gptq"))
            return exl_fail(EXL_ERR_UNSUPPORTED, "%s: unsupported GPTQ checkpoint_format '%s'", name, fmt);
    }
    return EXL_OK;
}

/* ---- whole config */

exl_status exl_hf_config_parse(const char *name, const cJSON *root, exl_hf_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    exl_jctx c = {name, ""};
    if (!cJSON_IsObject(root))
        return exl_fail(EXL_ERR_FORMAT, "%s: not a JSON object", name);
    const arch_info *a;
    const cJSON *text;
    EXL_TRY(parse_arch(&c, root, cfg, &a, &text));
    exl_jctx tc = {name, text == root ? "" : "text_config."};
    EXL_TRY(parse_sizes(&tc, text, a, cfg));
    EXL_TRY(exl_hf_parse_layers(&tc, text, cfg));
    EXL_TRY(exl_hf_parse_rope(&tc, text, cfg));
    EXL_TRY(parse_act(&tc, text, cfg));
    EXL_TRY(parse_layout(&tc, text, a, cfg));
    EXL_TRY(exl_hf_parse_moe(&tc, text, cfg));
    cfg->bos_token_id = a->bos;
    if (a->eos >= 0 && !exl_jfield(text, "eos_token_id") && !exl_jis_null(text, "eos_token_id"))
        cfg->eos_token_ids[cfg->n_eos++] = a->eos;
    EXL_TRY(parse_tokens(&tc, text, cfg));
    if (text != root) /* a wrapper's own special tokens */
        EXL_TRY(parse_tokens(&c, root, cfg));
    const char *dtype = NULL;
    EXL_TRY(exl_jget_str(&c, root, "torch_dtype", &dtype));
    if (!dtype)
        EXL_TRY(exl_jget_str(&c, root, "dtype", &dtype));
    snprintf(cfg->torch_dtype, sizeof cfg->torch_dtype, "%s", dtype ? dtype : "");
    const cJSON *q = exl_jfield(root, "quantization_config");
    if (q)
        EXL_TRY(exl_hf_quant_parse(name, q, &cfg->quant));
    return EXL_OK;
}

/* Parse the JSON file at dir/file with fn when it exists. */
static exl_status load_optional(const char *dir, const char *file, exl_hf_config *cfg,
                                exl_status (*fn)(const char *name, const cJSON *root, exl_hf_config *cfg)) {
    char *path = exl_path_join(dir, file);
    if (!path)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    cJSON *root = NULL;
    exl_status st = EXL_OK;
    if (exl_file_exists(path)) {
        st = exl_json_read_file(path, &root);
        if (st == EXL_OK)
            st = fn(path, root, cfg);
    }
    cJSON_Delete(root);
    exl_free(path);
    return st;
}

static exl_status merge_quantize_config(const char *name, const cJSON *root, exl_hf_config *cfg) {
    return exl_hf_quant_parse(name, root, &cfg->quant);
}

exl_status exl_hf_config_load(const char *dir, exl_hf_config *out) {
    char *path = exl_path_join(dir, "config.json");
    if (!path)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    cJSON *root = NULL;
    exl_status st = exl_json_read_file(path, &root);
    if (st == EXL_OK)
        st = exl_hf_config_parse(path, root, out);
    cJSON_Delete(root);
    exl_free(path);
    if (st == EXL_OK)
        st = load_optional(dir, "quantize_config.json", out, merge_quantize_config);
    if (st == EXL_OK)
        st = load_optional(dir, "generation_config.json", out, exl_hf_generation_parse);
    return st;
}
