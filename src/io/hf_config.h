/* hf_config.h - a Hugging Face config.json read into a checked C struct. */
#ifndef EXL_IO_HF_CONFIG_H
#define EXL_IO_HF_CONFIG_H

#include "exl.h"

#include <cjson/cJSON.h>

typedef enum exl_arch { EXL_ARCH_LLAMA, EXL_ARCH_MISTRAL, EXL_ARCH_QWEN2, EXL_ARCH_GEMMA } exl_arch;

typedef enum exl_rope_type {
    EXL_ROPE_DEFAULT,
    EXL_ROPE_LINEAR,
    EXL_ROPE_DYNAMIC,
    EXL_ROPE_YARN,
    EXL_ROPE_LLAMA3,
} exl_rope_type;

typedef enum exl_act { EXL_ACT_SILU, EXL_ACT_GELU_TANH, EXL_ACT_GELU } exl_act;

typedef struct exl_rope_config {
    exl_rope_type type;
    double theta;
    double factor;
    double low_freq_factor, high_freq_factor; /* llama3 */
    int32_t original_max_pos;                 /* 0 = unset */
    double attention_factor;                  /* yarn; < 0 = derive from factor */
    double beta_fast, beta_slow;              /* yarn */
    double mscale, mscale_all_dim;            /* yarn; 0 = unset */
    int truncate;                             /* yarn */
    double partial_rotary_factor;
} exl_rope_config;

typedef struct exl_quant_config {
    int present;
    char method[16];    /* "exl2", "gptq" */
    int bits;           /* gptq */
    int group_size;     /* gptq; -1 = one group */
    int desc_act;       /* gptq */
    int sym;            /* gptq */
    int gptq_v2;        /* checkpoint_format == "gptq_v2" */
    double exl2_bits;   /* exl2: decoder bits per weight */
    double exl2_head_bits;
} exl_quant_config;

typedef struct exl_hf_config {
    exl_arch arch;
    char model_type[32];
    int32_t vocab_size, hidden_size, intermediate_size, n_layers;
    int32_t n_heads, n_kv_heads, head_dim, max_pos;
    double rms_eps;
    exl_rope_config rope;
    exl_act act;
    int tie_embeddings;
    int qkv_bias, o_bias, mlp_bias;
    int32_t sliding_window; /* 0 = none */
    int32_t bos_token_id;   /* -1 = none */
    int32_t n_eos;
    int32_t eos_token_ids[8];
    char torch_dtype[16];
    exl_quant_config quant;
} exl_hf_config;

/* Read dir/config.json (and dir/quantize_config.json for GPTQ when present). */
exl_status exl_hf_config_load(const char *dir, exl_hf_config *out);
/* Parse from a JSON tree; name is used in messages (for tests and the fuzzer). */
exl_status exl_hf_config_parse(const char *name, const cJSON *root, exl_hf_config *out);
/* Merge a GPTQ quantize_config.json object into cfg->quant. */
exl_status exl_hf_quant_parse(const char *name, const cJSON *q, exl_quant_config *out);
const char *exl_arch_name(exl_arch a);
const char *exl_rope_type_name(exl_rope_type t);

#endif
