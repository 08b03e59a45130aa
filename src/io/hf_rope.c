/* hf_rope.c - the rotary embedding settings of config.json, read as transformers 5 reads them: a flat
 * rope_parameters object, one per layer type ({"full_attention": {...}, "sliding_attention": {...}}), or the
 * older rope_theta + rope_scaling fields; defaults per architecture. */
#include "io/hf_config_parts.h"

#include "base/error.h"
#include "io/hf_fields.h"

#include <stdio.h>
#include <string.h>

static const char *const type_names[] = {"default", "linear", "dynamic", "yarn", "llama3", "longrope"};

const char *exl_rope_type_name(exl_rope_type t) {
    return (unsigned)t < sizeof type_names / sizeof type_names[0] ? type_names[t] : "?";
}

/* What the top level of the config says about every rope (the fields transformers moves into each). */
typedef struct rope_top {
    double theta;                 /* rope_theta, or the architecture's default */
    double partial_rotary_factor; /* < 0 = not given */
    int32_t original_max_pos;     /* Phi-3's top-level original_max_position_embeddings; 0 = not given */
} rope_top;

static exl_status parse_type(const exl_jctx *c, const cJSON *s, const exl_hf_config *cfg, exl_rope_type *out) {
    const char *type = NULL;
    EXL_TRY(exl_jget_str(c, s, "rope_type", &type));
    if (!type)
        EXL_TRY(exl_jget_str(c, s, "type", &type));
    if (!type)
        type = "default";
    /* Phi-3 configs of older transformers name longrope "su" or "yarn" */
    if (cfg->arch == EXL_ARCH_PHI3 && (!strcmp(type, "su") || !strcmp(type, "yarn")))
        type = "longrope";
    for (size_t i = 0; i < sizeof type_names / sizeof type_names[0]; i++) {
        if (!strcmp(type, type_names[i])) {
            *out = (exl_rope_type)i;
            if (cfg->arch == EXL_ARCH_PHI3 && *out != EXL_ROPE_DEFAULT && *out != EXL_ROPE_LONGROPE)
                return exl_fail(EXL_ERR_UNSUPPORTED,
                                "%s: field \"%srope_type\" = '%s': Phi-3 takes default or longrope", c->file,
                                c->section, type);
            return EXL_OK;
        }
    }
    return exl_fail(EXL_ERR_UNSUPPORTED,
                    "%s: field \"%srope_type\" = '%s' is an unsupported rope type (exl supports default, linear, "
                    "dynamic, yarn, llama3, longrope)",
                    c->file, c->section, type);
}

static exl_status parse_longrope(const exl_jctx *c, const cJSON *s, const exl_hf_config *cfg, exl_rope_config *r) {
    int32_t want = (int32_t)(cfg->head_dim * r->partial_rotary_factor) / 2, n_long = 0;
    EXL_TRY(exl_jget_nums(c, s, "short_factor", r->short_factor, EXL_ROPE_MAX_FACTORS, &r->n_factors));
    EXL_TRY(exl_jget_nums(c, s, "long_factor", r->long_factor, EXL_ROPE_MAX_FACTORS, &n_long));
    if (r->n_factors != want || n_long != want)
        return exl_fail(EXL_ERR_FORMAT,
                        "%s: longrope needs \"%sshort_factor\" and \"%slong_factor\" of %d entries each (rotary "
                        "size / 2), got %d and %d",
                        c->file, c->section, c->section, want, r->n_factors, n_long);
    for (int32_t i = 0; i < want; i++)
        if (!(r->short_factor[i] > 0 && r->long_factor[i] > 0))
            return exl_fail(EXL_ERR_FORMAT, "%s: longrope factors in \"%s\" must be positive", c->file, c->section);
    r->factor = -1;
    EXL_TRY(exl_jget_num(c, s, "factor", 1e-6, 1e6, &r->factor));
    if (r->factor < 0) /* transformers: the ratio of the context lengths */
        r->factor = (double)cfg->max_pos / r->original_max_pos;
    return EXL_OK;
}

/* One rope from the object s (NULL: none given), the top-level fields and theta_default. */
static exl_status parse_one(const exl_jctx *c, const cJSON *s, const rope_top *top, double theta_default,
                            const exl_hf_config *cfg, exl_rope_config *r) {
    memset(r, 0, sizeof *r);
    r->type = EXL_ROPE_DEFAULT;
    r->theta = theta_default;
    r->factor = 1.0;
    r->low_freq_factor = 1.0;
    r->high_freq_factor = 4.0;
    r->attention_factor = -1;
    r->beta_fast = 32;
    r->beta_slow = 1;
    r->truncate = 1;
    r->partial_rotary_factor = 1.0;
    EXL_TRY(exl_jget_num(c, s, "rope_theta", 1e-3, 1e12, &r->theta));
    EXL_TRY(exl_jget_num(c, s, "partial_rotary_factor", 1e-3, 1.0, &r->partial_rotary_factor));
    if (top->partial_rotary_factor > 0) /* transformers writes the top-level value over the object's */
        r->partial_rotary_factor = top->partial_rotary_factor;
    EXL_TRY(parse_type(c, s, cfg, &r->type));
    if (r->type == EXL_ROPE_DEFAULT)
        return EXL_OK;
    EXL_TRY(exl_jget_int(c, s, "original_max_position_embeddings", 0, 1, 1 << 30, &r->original_max_pos));
    if (top->original_max_pos) /* Phi-3 keeps it outside rope_scaling, and transformers prefers that one */
        r->original_max_pos = top->original_max_pos;
    if (!r->original_max_pos && (r->type == EXL_ROPE_LLAMA3 || r->type == EXL_ROPE_LONGROPE))
        r->original_max_pos = cfg->max_pos;
    EXL_TRY(exl_jget_num(c, s, "attention_factor", 1e-6, 1e6, &r->attention_factor));
    if (r->type == EXL_ROPE_LONGROPE)
        return parse_longrope(c, s, cfg, r);
    r->factor = 0;
    EXL_TRY(exl_jget_num(c, s, "factor", 1e-6, 1e6, &r->factor));
    if (r->factor == 0)
        return exl_fail(EXL_ERR_FORMAT, "%s: rope type '%s' needs \"%sfactor\"", c->file, exl_rope_type_name(r->type),
                        c->section);
    EXL_TRY(exl_jget_num(c, s, "low_freq_factor", 1e-6, 1e6, &r->low_freq_factor));
    EXL_TRY(exl_jget_num(c, s, "high_freq_factor", 1e-6, 1e6, &r->high_freq_factor));
    EXL_TRY(exl_jget_num(c, s, "beta_fast", 1e-6, 1e6, &r->beta_fast));
    EXL_TRY(exl_jget_num(c, s, "beta_slow", 1e-6, 1e6, &r->beta_slow));
    EXL_TRY(exl_jget_num(c, s, "mscale", 0, 1e6, &r->mscale));
    EXL_TRY(exl_jget_num(c, s, "mscale_all_dim", 0, 1e6, &r->mscale_all_dim));
    EXL_TRY(exl_jget_bool(c, s, "truncate", &r->truncate));
    if (r->type == EXL_ROPE_LLAMA3 && r->high_freq_factor == r->low_freq_factor)
        return exl_fail(EXL_ERR_FORMAT, "%s: llama3 rope needs \"%shigh_freq_factor\" != low_freq_factor", c->file,
                        c->section);
    return EXL_OK;
}

/* rope_parameters given per layer type: every key names a layer type. */
static int is_per_type(const cJSON *p) {
    if (!p || !p->child)
        return 0;
    for (const cJSON *e = p->child; e; e = e->next)
        if (strcmp(e->string, "full_attention") && strcmp(e->string, "sliding_attention"))
            return 0;
    return 1;
}

static int any_layer(const exl_hf_config *cfg, int sliding) {
    for (int32_t i = 0; i < cfg->n_layers; i++)
        if (cfg->layers[i].sliding == sliding)
            return 1;
    return 0;
}

/* The rope of one layer type from a per-type rope_parameters object. */
static exl_status parse_type_entry(const exl_jctx *c, const cJSON *p, const char *type, const rope_top *top,
                                   double theta_default, const exl_hf_config *cfg, exl_rope_config *r) {
    char section[64];
    snprintf(section, sizeof section, "%s%s.", c->section, type);
    exl_jctx tc = {c->file, section};
    const cJSON *s;
    EXL_TRY(exl_jget_obj(c, p, type, &s));
    if (!s && any_layer(cfg, !strcmp(type, "sliding_attention")))
        return exl_fail(EXL_ERR_FORMAT,
                        "%s: \"rope_parameters\" has no entry for layer type \"%s\", which "
                        "layer_types uses",
                        c->file, type);
    return parse_one(&tc, s, top, theta_default, cfg, r);
}

exl_status exl_hf_parse_rope(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg) {
    int gemma3 = cfg->arch == EXL_ARCH_GEMMA3;
    double theta_default = cfg->arch == EXL_ARCH_MIXTRAL || gemma3 ? 1e6 : 1e4;
    double local_theta = 1e4; /* Gemma 3's sliding layers: rope_local_base_freq */
    rope_top top = {theta_default, -1, 0};
    EXL_TRY(exl_jget_num(c, o, "rope_theta", 1e-3, 1e12, &top.theta));
    EXL_TRY(exl_jget_num(c, o, "partial_rotary_factor", 1e-3, 1.0, &top.partial_rotary_factor));
    if (cfg->arch == EXL_ARCH_PHI3) {
        top.original_max_pos = 4096; /* Phi3Config's default */
        EXL_TRY(exl_jget_int(c, o, "original_max_position_embeddings", 0, 1, 1 << 30, &top.original_max_pos));
    }
    if (gemma3)
        EXL_TRY(exl_jget_num(c, o, "rope_local_base_freq", 1e-3, 1e12, &local_theta));

    const cJSON *params, *scaling;
    EXL_TRY(exl_jget_obj(c, o, "rope_parameters", &params));
    EXL_TRY(exl_jget_obj(c, o, "rope_scaling", &scaling));
    if (is_per_type(params)) {
        exl_jctx pc = {c->file, "rope_parameters."};
        EXL_TRY(parse_type_entry(&pc, params, "full_attention", &top, top.theta, cfg, &cfg->rope));
        return parse_type_entry(&pc, params, "sliding_attention", &top, gemma3 ? local_theta : top.theta, cfg,
                                &cfg->rope_sliding);
    }
    /* one rope for every layer: the older rope_scaling wins over rope_parameters, as in transformers */
    const cJSON *s = scaling ? scaling : params;
    exl_jctx sc = {c->file, scaling ? "rope_scaling." : "rope_parameters."};
    EXL_TRY(parse_one(&sc, s, &top, top.theta, cfg, &cfg->rope));
    if (!gemma3) {
        cfg->rope_sliding = cfg->rope;
        return EXL_OK;
    }
    /* Gemma 3: the given rope is the full-attention layers'; the sliding ones default to local_theta */
    return parse_one(&sc, NULL, &top, local_theta, cfg, &cfg->rope_sliding);
}

const exl_rope_config *exl_hf_layer_rope(const exl_hf_config *cfg, int32_t layer) {
    return cfg->layers[layer].sliding ? &cfg->rope_sliding : &cfg->rope;
}
