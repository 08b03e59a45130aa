/* lora_config.h - a PEFT adapter_config.json as exl reads it: the LoRA settings, checked, with the per-module
 * rank and alpha overrides (rank_pattern, alpha_pattern). */
#ifndef EXL_MODEL_LORA_CONFIG_H
#define EXL_MODEL_LORA_CONFIG_H

#include "exl.h"

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

typedef struct exl_lora_config {
    cJSON *root;
    const char *file; /* for messages */
    int32_t r;
    double alpha;
    int rslora;
    const cJSON *target_modules;               /* a list of module names, or a string (all-linear, a regex), or NULL */
    const cJSON *rank_pattern, *alpha_pattern; /* objects or NULL */
    const cJSON *layers_to_transform;          /* a list of layer numbers, a number, or NULL: every layer */
    const char *base_model_class;              /* auto_mapping.base_model_class, or NULL */
} exl_lora_config;

/* Parse and check the text of an adapter_config.json (file names it in messages; the config keeps no pointer to
 * text). Refused with a message naming the field: another peft_type, DoRA, trained biases, fan_in_fan_out,
 * modules_to_save, a rank or alpha out of range. */
exl_status exl_lora_config_parse(const char *file, const char *text, size_t len, exl_lora_config *out);
void exl_lora_config_free(exl_lora_config *c);
/* 1 if module (a dotted name) is one that key names: equal, or ending in "." key (PEFT's suffix match). */
int exl_lora_module_matches(const char *module, const char *key);
/* 1 if target_modules selects module (a list entry matching it; a string: all-linear, or the module name). */
int exl_lora_config_targets(const exl_lora_config *c, const char *module);
/* The rank and alpha of module: rank_pattern / alpha_pattern's entry for it, else r / lora_alpha. */
int32_t exl_lora_config_rank(const exl_lora_config *c, const char *module);
double exl_lora_config_alpha(const exl_lora_config *c, const char *module);
/* 1 if layer li is one the adapter transforms (layers_to_transform). */
int exl_lora_config_has_layer(const exl_lora_config *c, int32_t li);

#endif
