/* lora_config.c - read and check a PEFT adapter_config.json (lora_config.h). */
#include "model/lora_config.h"

#include "base/error.h"
#include "io/hf_fields.h"
#include "io/json_file.h"

#include <string.h>

int exl_lora_module_matches(const char *module, const char *key) {
    size_t m = strlen(module), k = strlen(key);
    if (k == 0 || k > m)
        return 0;
    return strcmp(module + m - k, key) == 0 && (m == k || module[m - k - 1] == '.');
}

/* the entry of pattern (an object of module keys) that matches module, or NULL */
static const cJSON *pattern_entry(const cJSON *pattern, const char *module) {
    for (const cJSON *e = pattern ? pattern->child : NULL; e; e = e->next)
        if (exl_lora_module_matches(module, e->string))
            return e;
    return NULL;
}

int exl_lora_config_targets(const exl_lora_config *c, const char *module) {
    const cJSON *t = c->target_modules;
    if (cJSON_IsString(t))
        return strcmp(t->valuestring, "all-linear") == 0 || strcmp(t->valuestring, module) == 0;
    for (const cJSON *e = t ? t->child : NULL; e; e = e->next)
        if (exl_lora_module_matches(module, e->valuestring))
            return 1;
    return 0;
}

int32_t exl_lora_config_rank(const exl_lora_config *c, const char *module) {
    const cJSON *e = pattern_entry(c->rank_pattern, module);
    return e ? (int32_t)e->valuedouble : c->r;
}

double exl_lora_config_alpha(const exl_lora_config *c, const char *module) {
    const cJSON *e = pattern_entry(c->alpha_pattern, module);
    return e ? e->valuedouble : c->alpha;
}

int exl_lora_config_has_layer(const exl_lora_config *c, int32_t li) {
    const cJSON *l = c->layers_to_transform;
    if (!l)
        return 1;
    if (cJSON_IsNumber(l))
        return (int32_t)l->valuedouble == li;
    for (const cJSON *e = l->child; e; e = e->next)
        if ((int32_t)e->valuedouble == li)
            return 1;
    return 0;
}

/* a pattern object whose every value is a number in [lo, hi] (integers when integral) */
static exl_status check_pattern(const exl_jctx *j, const cJSON *p, const char *key, double lo, double hi,
                                int integral) {
    for (const cJSON *e = p ? p->child : NULL; e; e = e->next)
        if (!cJSON_IsNumber(e) || !(e->valuedouble >= lo && e->valuedouble <= hi) ||
            (integral && e->valuedouble != (double)(int32_t)e->valuedouble))
            return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s.%s\" must be %s in [%g, %g]", j->file, key, e->string,
                            integral ? "an integer" : "a number", lo, hi);
    return EXL_OK;
}

/* a list of strings, a string, or null */
static exl_status check_targets(const exl_jctx *j, const cJSON *t) {
    if (!t || cJSON_IsString(t))
        return EXL_OK;
    if (!cJSON_IsArray(t))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"target_modules\" must be a list of module names", j->file);
    for (const cJSON *e = t->child; e; e = e->next)
        if (!cJSON_IsString(e) || !e->valuestring[0])
            return exl_fail(EXL_ERR_FORMAT, "%s: field \"target_modules\" must be a list of module names", j->file);
    return EXL_OK;
}

static exl_status check_layers(const exl_jctx *j, const cJSON *l) {
    if (!l || (cJSON_IsNumber(l) && l->valuedouble >= 0))
        return EXL_OK;
    int ok = cJSON_IsArray(l);
    for (const cJSON *e = ok ? l->child : NULL; e; e = e->next)
        ok &= cJSON_IsNumber(e) && e->valuedouble >= 0 && e->valuedouble < 1e6;
    return ok ? EXL_OK
              : exl_fail(EXL_ERR_FORMAT, "%s: field \"layers_to_transform\" must be a layer number or a list of them",
                         j->file);
}

/* features exl does not run: refused by name */
static exl_status check_unsupported(const exl_jctx *j, const cJSON *root) {
    const char *type = "LORA", *bias = "none";
    int dora = 0, fan_in_fan_out = 0, lora_bias = 0;
    EXL_TRY(exl_jget_str(j, root, "peft_type", &type));
    EXL_TRY(exl_jget_str(j, root, "bias", &bias));
    EXL_TRY(exl_jget_bool(j, root, "use_dora", &dora));
    EXL_TRY(exl_jget_bool(j, root, "fan_in_fan_out", &fan_in_fan_out));
    EXL_TRY(exl_jget_bool(j, root, "lora_bias", &lora_bias));
    if (strcmp(type, "LORA") != 0)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: peft_type \"%s\": only LORA adapters are supported", j->file, type);
    if (dora)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: use_dora: DoRA adapters are not supported", j->file);
    if (strcmp(bias, "none") != 0 || lora_bias)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: bias \"%s\": adapters with trained biases are not supported", j->file,
                        lora_bias ? "lora_bias" : bias);
    if (fan_in_fan_out)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: fan_in_fan_out: transposed (Conv1D) adapters are not supported",
                        j->file);
    const cJSON *save = exl_jfield(root, "modules_to_save");
    if (save && !(cJSON_IsArray(save) && !save->child))
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: modules_to_save: the adapter replaces whole modules (%s), which exl does not load; "
                        "merge them into the base model instead",
                        j->file, cJSON_IsArray(save) && cJSON_IsString(save->child) ? save->child->valuestring : "...");
    return EXL_OK;
}

exl_status exl_lora_config_parse(const char *file, const char *text, size_t len, exl_lora_config *out) {
    memset(out, 0, sizeof *out);
    out->file = file;
    EXL_TRY(exl_json_parse(file, text, len, &out->root));
    const cJSON *root = out->root;
    const exl_jctx j = {file, ""};
    exl_status st = cJSON_IsObject(root) ? EXL_OK : exl_fail(EXL_ERR_FORMAT, "%s: not a JSON object", file);
    if (st == EXL_OK)
        st = check_unsupported(&j, root);
    if (st == EXL_OK)
        st = exl_jget_int(&j, root, "r", 1, 1, 65536, &out->r);
    out->alpha = out->r;
    if (st == EXL_OK)
        st = exl_jget_num(&j, root, "lora_alpha", -1e9, 1e9, &out->alpha);
    if (st == EXL_OK)
        st = exl_jget_bool(&j, root, "use_rslora", &out->rslora);
    out->target_modules = exl_jfield(root, "target_modules");
    if (st == EXL_OK)
        st = check_targets(&j, out->target_modules);
    if (st == EXL_OK)
        st = exl_jget_obj(&j, root, "rank_pattern", &out->rank_pattern);
    if (st == EXL_OK)
        st = check_pattern(&j, out->rank_pattern, "rank_pattern", 1, 65536, 1);
    if (st == EXL_OK)
        st = exl_jget_obj(&j, root, "alpha_pattern", &out->alpha_pattern);
    if (st == EXL_OK)
        st = check_pattern(&j, out->alpha_pattern, "alpha_pattern", -1e9, 1e9, 0);
    out->layers_to_transform = exl_jfield(root, "layers_to_transform");
    if (st == EXL_OK)
        st = check_layers(&j, out->layers_to_transform);
    const cJSON *mapping = NULL;
    if (st == EXL_OK)
        st = exl_jget_obj(&j, root, "auto_mapping", &mapping);
    if (st == EXL_OK && mapping) {
        const exl_jctx jm = {file, "auto_mapping."};
        st = exl_jget_str(&jm, mapping, "base_model_class", &out->base_model_class);
    }
    if (st != EXL_OK)
        exl_lora_config_free(out);
    return st;
}

void exl_lora_config_free(exl_lora_config *c) {
    cJSON_Delete(c->root);
    memset(c, 0, sizeof *c);
}
