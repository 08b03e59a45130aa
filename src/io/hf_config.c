/* hf_config.c - read config.json: architecture, sizes, rope, activation, quantization. */
#include "io/hf_config.h"

#include "base/alloc.h"
#include "base/error.h"
#include "io/json_file.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

const char *exl_arch_name(exl_arch a) {
    static const char *names[] = {"llama", "mistral", "qwen2", "gemma"};
    return (unsigned)a < 4 ? names[a] : "?";
}

const char *exl_rope_type_name(exl_rope_type t) {
    static const char *names[] = {"default", "linear", "dynamic", "yarn", "llama3"};
    return (unsigned)t < 5 ? names[t] : "?";
}

/* ---- typed field access: absent fields keep the default, wrong types are errors */

typedef struct {
    const char *file;
    const char *section; /* "" or "rope_scaling." */
} ctx;

static const cJSON *field(const cJSON *o, const char *key) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNull(j) ? NULL : j;
}

static exl_status get_int(const ctx *c, const cJSON *o, const char *key, int required, long lo, long hi,
                          int32_t *out) {
    const cJSON *j = field(o, key);
    if (!j)
        return required ? exl_fail(EXL_ERR_FORMAT, "%s: missing field \"%s%s\"", c->file, c->section, key) : EXL_OK;
    if (!cJSON_IsNumber(j) || j->valuedouble != floor(j->valuedouble))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be an integer", c->file, c->section, key);
    if (j->valuedouble < lo || j->valuedouble > hi)
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" = %.0f is out of range [%ld, %ld]", c->file, c->section,
                        key, j->valuedouble, lo, hi);
    *out = (int32_t)j->valuedouble;
    return EXL_OK;
}

static exl_status get_num(const ctx *c, const cJSON *o, const char *key, double lo, double hi, double *out) {
    const cJSON *j = field(o, key);
    if (!j)
        return EXL_OK;
    if (!cJSON_IsNumber(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be a number", c->file, c->section, key);
    if (!(j->valuedouble >= lo && j->valuedouble <= hi))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" = %g is out of range", c->file, c->section, key,
                        j->valuedouble);
    *out = j->valuedouble;
    return EXL_OK;
}

static exl_status get_bool(const ctx *c, const cJSON *o, const char *key, int *out) {
    const cJSON *j = field(o, key);
    if (!j)
        return EXL_OK;
    if (!cJSON_IsBool(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be true or false", c->file, c->section, key);
    *out = cJSON_IsTrue(j);
    return EXL_OK;
}

static exl_status get_str(const ctx *c, const cJSON *o, const char *key, const char **out) {
    const cJSON *j = field(o, key);
    if (!j)
        return EXL_OK;
    if (!cJSON_IsString(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be a string", c->file, c->section, key);
    *out = j->valuestring;
    return EXL_OK;
}

/* ---- architecture */

static exl_status parse_arch(const ctx *c, const cJSON *root, exl_hf_config *cfg) {
    static const struct {
        const char *model_type, *class_name;
        exl_arch arch;
    } known[] = {
        {"llama", "LlamaForCausalLM", EXL_ARCH_LLAMA},
        {"mistral", "MistralForCausalLM", EXL_ARCH_MISTRAL},
        {"qwen2", "Qwen2ForCausalLM", EXL_ARCH_QWEN2},
        {"gemma", "GemmaForCausalLM", EXL_ARCH_GEMMA},
    };
    const char *model_type = NULL, *class_name = NULL;
    EXL_TRY(get_str(c, root, "model_type", &model_type));
    const cJSON *archs = field(root, "architectures");
    if (archs) {
        if (!cJSON_IsArray(archs) || (archs->child && !cJSON_IsString(archs->child)))
            return exl_fail(EXL_ERR_FORMAT, "%s: field \"architectures\" must be a list of strings", c->file);
        if (archs->child)
            class_name = archs->child->valuestring;
    }
    if (!model_type && !class_name)
        return exl_fail(EXL_ERR_FORMAT, "%s: neither \"model_type\" nor \"architectures\" is given", c->file);
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        if ((model_type && !strcmp(model_type, known[i].model_type)) ||
            (!model_type && !strcmp(class_name, known[i].class_name))) {
            cfg->arch = known[i].arch;
            snprintf(cfg->model_type, sizeof cfg->model_type, "%s", known[i].model_type);
            return EXL_OK;
        }
    }
    return exl_fail(EXL_ERR_UNSUPPORTED,
                    "%s: unsupported architecture '%s' (exl runs llama, mistral, qwen2 and gemma)", c->file,
                    model_type ? model_type : class_name);
}

/* ---- rope: rope_parameters (new) or rope_theta + rope_scaling (old) */

static exl_status parse_rope(const ctx *c, const cJSON *root, exl_hf_config *cfg) {
    exl_rope_config *r = &cfg->rope;
    r->type = EXL_ROPE_DEFAULT;
    r->theta = 10000.0;
    r->factor = 1.0;
    r->low_freq_factor = 1.0;
    r->high_freq_factor = 4.0;
    r->attention_factor = -1;
    r->beta_fast = 32;
    r->beta_slow = 1;
    r->truncate = 1;
    r->partial_rotary_factor = 1.0;
    EXL_TRY(get_num(c, root, "rope_theta", 1e-3, 1e12, &r->theta));
    EXL_TRY(get_num(c, root, "partial_rotary_factor", 1e-3, 1.0, &r->partial_rotary_factor));
    const cJSON *s = field(root, "rope_parameters");
    const char *section = "rope_parameters.";
    if (!s) {
        s = field(root, "rope_scaling");
        section = "rope_scaling.";
    }
    if (!s)
        return EXL_OK;
    if (!cJSON_IsObject(s))
        return exl_fail(EXL_ERR_FORMAT, "%s: \"%.*s\" must be an object or null", c->file, (int)strlen(section) - 1,
                        section);
    ctx sc = {c->file, section};
    const char *type = NULL;
    EXL_TRY(get_str(&sc, s, "rope_type", &type));
    if (!type)
        EXL_TRY(get_str(&sc, s, "type", &type));
    EXL_TRY(get_num(&sc, s, "rope_theta", 1e-3, 1e12, &r->theta));
    EXL_TRY(get_num(&sc, s, "partial_rotary_factor", 1e-3, 1.0, &r->partial_rotary_factor));
    if (!type || !strcmp(type, "default"))
        return EXL_OK;
    if (!strcmp(type, "linear"))
        r->type = EXL_ROPE_LINEAR;
    else if (!strcmp(type, "dynamic"))
        r->type = EXL_ROPE_DYNAMIC;
    else if (!strcmp(type, "yarn"))
        r->type = EXL_ROPE_YARN;
    else if (!strcmp(type, "llama3"))
        r->type = EXL_ROPE_LLAMA3;
    else
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: unsupported rope type '%s' (exl supports default, linear, dynamic, yarn, llama3)",
                        c->file, type);
    r->factor = 0;
    EXL_TRY(get_num(&sc, s, "factor", 1e-6, 1e6, &r->factor));
    if (r->factor == 0)
        return exl_fail(EXL_ERR_FORMAT, "%s: rope type '%s' needs \"%sfactor\"", c->file, type, section);
    EXL_TRY(get_num(&sc, s, "low_freq_factor", 1e-6, 1e6, &r->low_freq_factor));
    EXL_TRY(get_num(&sc, s, "high_freq_factor", 1e-6, 1e6, &r->high_freq_factor));
    EXL_TRY(get_int(&sc, s, "original_max_position_embeddings", 0, 1, 1 << 30, &r->original_max_pos));
    EXL_TRY(get_num(&sc, s, "attention_factor", 1e-6, 1e6, &r->attention_factor));
    EXL_TRY(get_num(&sc, s, "beta_fast", 1e-6, 1e6, &r->beta_fast));
    EXL_TRY(get_num(&sc, s, "beta_slow", 1e-6, 1e6, &r->beta_slow));
    EXL_TRY(get_num(&sc, s, "mscale", 0, 1e6, &r->mscale));
    EXL_TRY(get_num(&sc, s, "mscale_all_dim", 0, 1e6, &r->mscale_all_dim));
    EXL_TRY(get_bool(&sc, s, "truncate", &r->truncate));
    if (r->type == EXL_ROPE_LLAMA3 && !r->original_max_pos)
        return exl_fail(EXL_ERR_FORMAT, "%s: llama3 rope needs \"%soriginal_max_position_embeddings\"", c->file,
                        section);
    if (r->type == EXL_ROPE_LLAMA3 && r->high_freq_factor == r->low_freq_factor)
        return exl_fail(EXL_ERR_FORMAT, "%s: llama3 rope needs high_freq_factor != low_freq_factor", c->file);
    return EXL_OK;
}

/* ---- activation */

static exl_status parse_act(const ctx *c, const cJSON *root, exl_hf_config *cfg) {
    const char *act = NULL, *act2 = NULL;
    EXL_TRY(get_str(c, root, "hidden_act", &act));
    EXL_TRY(get_str(c, root, "hidden_activation", &act2));
    if (cfg->arch == EXL_ARCH_GEMMA) /* transformers' Gemma reads hidden_activation, default gelu tanh */
        act = act2 ? act2 : "gelu_pytorch_tanh";
    if (!act)
        act = "silu";
    if (!strcmp(act, "silu") || !strcmp(act, "swish"))
        cfg->act = EXL_ACT_SILU;
    else if (!strcmp(act, "gelu_pytorch_tanh") || !strcmp(act, "gelu_tanh") || !strcmp(act, "gelu_new"))
        cfg->act = EXL_ACT_GELU_TANH;
    else if (!strcmp(act, "gelu"))
        cfg->act = EXL_ACT_GELU;
    else
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: unsupported activation '%s'", c->file, act);
    return EXL_OK;
}

/* ---- quantization_config / quantize_config.json */

exl_status exl_hf_quant_parse(const char *name, const cJSON *q, exl_quant_config *out) {
    ctx c = {name, "quantization_config."};
    if (!cJSON_IsObject(q))
        return exl_fail(EXL_ERR_FORMAT, "%s: quantization config must be an object", name);
    const char *method = NULL, *fmt = NULL;
    EXL_TRY(get_str(&c, q, "quant_method", &method));
    EXL_TRY(get_str(&c, q, "checkpoint_format", &fmt));
    if (!method)
        method = "gptq"; /* quantize_config.json carries no method */
    if (strcmp(method, "gptq") && strcmp(method, "exl2"))
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: unsupported quantization method '%s' (exl reads exl2 and gptq)",
                        name, method);
    out->present = 1;
    snprintf(out->method, sizeof out->method, "%s", method);
    if (!strcmp(method, "exl2")) {
        EXL_TRY(get_num(&c, q, "bits", 1, 16, &out->exl2_bits));
        EXL_TRY(get_num(&c, q, "head_bits", 1, 16, &out->exl2_head_bits));
        return EXL_OK;
    }
    if (!out->bits)
        out->bits = 4;
    if (!out->group_size)
        out->group_size = 128;
    EXL_TRY(get_int(&c, q, "bits", 0, 1, 16, &out->bits));
    EXL_TRY(get_int(&c, q, "group_size", 0, -1, 1 << 30, &out->group_size));
    if (out->group_size == 0)
        return exl_fail(EXL_ERR_FORMAT, "%s: group_size 0 is not valid", name);
    EXL_TRY(get_bool(&c, q, "desc_act", &out->desc_act));
    EXL_TRY(get_bool(&c, q, "sym", &out->sym));
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
    ctx c = {name, ""};
    if (!cJSON_IsObject(root))
        return exl_fail(EXL_ERR_FORMAT, "%s: not a JSON object", name);
    EXL_TRY(parse_arch(&c, root, cfg));
    EXL_TRY(get_int(&c, root, "vocab_size", 1, 1, 1 << 24, &cfg->vocab_size));
    EXL_TRY(get_int(&c, root, "hidden_size", 1, 1, 1 << 17, &cfg->hidden_size));
    EXL_TRY(get_int(&c, root, "intermediate_size", 1, 1, 1 << 20, &cfg->intermediate_size));
    EXL_TRY(get_int(&c, root, "num_hidden_layers", 1, 1, 4096, &cfg->n_layers));
    EXL_TRY(get_int(&c, root, "num_attention_heads", 1, 1, 4096, &cfg->n_heads));
    cfg->n_kv_heads = cfg->n_heads;
    EXL_TRY(get_int(&c, root, "num_key_value_heads", 0, 1, 4096, &cfg->n_kv_heads));
    if (cfg->n_heads % cfg->n_kv_heads)
        return exl_fail(EXL_ERR_FORMAT, "%s: num_attention_heads (%d) is not a multiple of num_key_value_heads (%d)",
                        name, cfg->n_heads, cfg->n_kv_heads);
    cfg->head_dim = cfg->hidden_size / cfg->n_heads;
    EXL_TRY(get_int(&c, root, "head_dim", 0, 1, 4096, &cfg->head_dim));
    if (cfg->head_dim % 2)
        return exl_fail(EXL_ERR_FORMAT, "%s: head_dim %d must be even for rotary embeddings", name, cfg->head_dim);
    cfg->max_pos = 2048;
    EXL_TRY(get_int(&c, root, "max_position_embeddings", 0, 1, 1 << 30, &cfg->max_pos));
    cfg->rms_eps = 1e-6;
    EXL_TRY(get_num(&c, root, "rms_norm_eps", 0, 1, &cfg->rms_eps));
    EXL_TRY(parse_rope(&c, root, cfg));
    EXL_TRY(parse_act(&c, root, cfg));
    cfg->tie_embeddings = cfg->arch == EXL_ARCH_GEMMA; /* transformers' defaults per architecture */
    EXL_TRY(get_bool(&c, root, "tie_word_embeddings", &cfg->tie_embeddings));
    int attention_bias = 0;
    EXL_TRY(get_bool(&c, root, "attention_bias", &attention_bias));
    cfg->qkv_bias = attention_bias || cfg->arch == EXL_ARCH_QWEN2;
    cfg->o_bias = attention_bias && cfg->arch != EXL_ARCH_QWEN2;
    EXL_TRY(get_bool(&c, root, "mlp_bias", &cfg->mlp_bias));
    int use_sw = cfg->arch == EXL_ARCH_MISTRAL;
    EXL_TRY(get_bool(&c, root, "use_sliding_window", &use_sw));
    int32_t sw = 0;
    EXL_TRY(get_int(&c, root, "sliding_window", 0, 0, 1 << 30, &sw));
    cfg->sliding_window = use_sw ? sw : 0;
    cfg->bos_token_id = -1;
    EXL_TRY(get_int(&c, root, "bos_token_id", 0, 0, 1 << 24, &cfg->bos_token_id));
    const cJSON *eos = field(root, "eos_token_id");
    if (cJSON_IsArray(eos)) {
        for (const cJSON *e = eos->child; e; e = e->next) {
            if (!cJSON_IsNumber(e) || e->valuedouble < 0 || e->valuedouble >= (1 << 24))
                return exl_fail(EXL_ERR_FORMAT, "%s: \"eos_token_id\" entries must be token ids", name);
            if (cfg->n_eos < 8)
                cfg->eos_token_ids[cfg->n_eos++] = (int32_t)e->valuedouble;
        }
    } else if (eos) {
        int32_t id;
        EXL_TRY(get_int(&c, root, "eos_token_id", 0, 0, 1 << 24, &id));
        cfg->eos_token_ids[cfg->n_eos++] = id;
    }
    const char *dtype = NULL;
    EXL_TRY(get_str(&c, root, "torch_dtype", &dtype));
    if (!dtype)
        EXL_TRY(get_str(&c, root, "dtype", &dtype));
    snprintf(cfg->torch_dtype, sizeof cfg->torch_dtype, "%s", dtype ? dtype : "");
    const cJSON *q = field(root, "quantization_config");
    if (q)
        EXL_TRY(exl_hf_quant_parse(name, q, &cfg->quant));
    return EXL_OK;
}

exl_status exl_hf_config_load(const char *dir, exl_hf_config *out) {
    char *path = exl_path_join(dir, "config.json");
    char *qpath = exl_path_join(dir, "quantize_config.json");
    if (!path || !qpath) {
        exl_free(path);
        exl_free(qpath);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    cJSON *root = NULL, *qroot = NULL;
    exl_status st = exl_json_read_file(path, &root);
    if (st == EXL_OK)
        st = exl_hf_config_parse(path, root, out);
    if (st == EXL_OK && exl_file_exists(qpath)) {
        st = exl_json_read_file(qpath, &qroot);
        if (st == EXL_OK)
            st = exl_hf_quant_parse(qpath, qroot, &out->quant);
    }
    cJSON_Delete(root);
    cJSON_Delete(qroot);
    exl_free(path);
    exl_free(qpath);
    return st;
}
