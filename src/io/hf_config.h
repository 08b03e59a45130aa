/* hf_config.h - a Hugging Face config.json read into a checked C struct. */
#ifndef EXL_IO_HF_CONFIG_H
#define EXL_IO_HF_CONFIG_H

#include "exl.h"

#include <cjson/cJSON.h>

typedef enum exl_arch {
    EXL_ARCH_LLAMA,
    EXL_ARCH_MISTRAL,
    EXL_ARCH_QWEN2,
    EXL_ARCH_GEMMA,
    EXL_ARCH_QWEN3,
    EXL_ARCH_GEMMA2,
    EXL_ARCH_GEMMA3,
    EXL_ARCH_PHI3,
    EXL_ARCH_MIXTRAL,
    EXL_ARCH_QWEN3_MOE,
    EXL_ARCH_QWEN2_MOE,
} exl_arch;

typedef enum exl_rope_type {
    EXL_ROPE_DEFAULT,
    EXL_ROPE_LINEAR,
    EXL_ROPE_DYNAMIC,
    EXL_ROPE_YARN,
    EXL_ROPE_LLAMA3,
    EXL_ROPE_LONGROPE,
} exl_rope_type;

typedef enum exl_act { EXL_ACT_SILU, EXL_ACT_GELU_TANH, EXL_ACT_GELU } exl_act;

/* longrope's short_factor / long_factor hold rot_dim / 2 entries: head_dim is at most 1024 */
#define EXL_ROPE_MAX_FACTORS 512
/* per-layer facts are kept for this many layers (the largest published models have ~130) */
#define EXL_MAX_LAYERS 512

typedef struct exl_rope_config {
    exl_rope_type type;
    double theta;
    double factor;
    double low_freq_factor, high_freq_factor; /* llama3 */
    int32_t original_max_pos;                 /* 0 = unset (yarn, dynamic: max_position_embeddings) */
    double attention_factor;                  /* yarn, longrope; < 0 = derive from factor */
    double beta_fast, beta_slow;              /* yarn */
    double mscale, mscale_all_dim;            /* yarn; 0 = unset */
    int truncate;                             /* yarn */
    double partial_rotary_factor;
    int32_t n_factors;                        /* longrope: entries in each list (rot_dim / 2) */
    float short_factor[EXL_ROPE_MAX_FACTORS]; /* longrope, for sequences up to original_max_pos */
    float long_factor[EXL_ROPE_MAX_FACTORS];  /* longrope, for longer sequences */
} exl_rope_config;

/* What one decoder layer is, from layer_types / max_window_layers / decoder_sparse_step / mlp_only_layers. */
typedef struct exl_layer_config {
    int32_t sliding_window; /* keys a query sees, itself included; 0 = full attention */
    uint8_t sliding;        /* layer_types[i] is "sliding_attention": its rope is rope_sliding */
    uint8_t moe;            /* a sparse mixture-of-experts block instead of the dense MLP */
} exl_layer_config;

typedef struct exl_moe_config {
    int32_t n_experts;    /* 0 = a dense model */
    int32_t top_k;        /* experts per token */
    int32_t expert_ffn;   /* each expert's intermediate size (Mixtral: intermediate_size) */
    int norm_topk_prob;   /* renormalize the top-k routing weights to sum to 1 */
    int32_t shared_ffn;   /* Qwen2-MoE: the shared expert's intermediate size; 0 = none */
    int32_t n_moe_layers; /* layers with a sparse block (the others run a dense MLP of intermediate_size) */
} exl_moe_config;

/* generation_config.json's defaults for sampling (the CLI and server may use them); unset: < 0 */
typedef struct exl_generation_config {
    int present;
    int do_sample; /* -1 unset, 0 greedy, 1 sample */
    double temperature, top_p, min_p, repetition_penalty;
    int32_t top_k;
    int32_t max_new_tokens;
} exl_generation_config;

typedef struct exl_quant_config {
    int present;
    char method[16];  /* "exl2", "gptq" */
    int bits;         /* gptq */
    int group_size;   /* gptq; -1 = one group */
    int desc_act;     /* gptq */
    int sym;          /* gptq */
    int gptq_v2;      /* checkpoint_format == "gptq_v2" */
    double exl2_bits; /* exl2: decoder bits per weight */
    double exl2_head_bits;
} exl_quant_config;

typedef struct exl_hf_config {
    exl_arch arch;
    char model_type[32]; /* config.json's (for a multimodal wrapper, its own: "gemma3") */
    int vision_ignored;  /* the config wraps a text model in a multimodal one (text_config): only the text runs */
    int32_t vocab_size, hidden_size, intermediate_size, n_layers;
    int32_t n_heads, n_kv_heads, head_dim, max_pos;
    double rms_eps;
    exl_rope_config rope;         /* full-attention layers (every layer unless rope_parameters is per layer type) */
    exl_rope_config rope_sliding; /* sliding-window layers (a copy of rope unless given per layer type) */
    exl_act act;
    int tie_embeddings;
    int qkv_bias, o_bias, mlp_bias;
    int qk_norm;                        /* q_norm / k_norm: RMSNorm over each head (Qwen3, Gemma 3) */
    int sandwich_norms;                 /* post-attention and pre/post feed-forward norms (Gemma 2, 3) */
    int fused_qkv, fused_gate_up;       /* qkv_proj and gate_up_proj (Phi-3) */
    int norm_plus_one;                  /* RMSNorm scales by (1 + w) and embeddings by sqrt(hidden) (Gemma family) */
    double query_pre_attn_scalar;       /* attention scores scale by its inverse square root; 0 = head_dim */
    double attn_softcap, final_softcap; /* tanh soft-capping of attention scores / logits; 0 = none */
    int32_t sliding_window;             /* the sliding layers' window; 0 = no layer slides (see layers[]) */
    exl_layer_config layers[EXL_MAX_LAYERS];
    exl_moe_config moe;
    int32_t bos_token_id; /* -1 = none */
    int32_t n_eos;
    int32_t eos_token_ids[8];
    char torch_dtype[16];
    exl_quant_config quant;
    exl_generation_config gen;
} exl_hf_config;

/* Read dir/config.json, dir/quantize_config.json for GPTQ and dir/generation_config.json when present
 * (its eos ids join config.json's). */
exl_status exl_hf_config_load(const char *dir, exl_hf_config *out);
/* Parse from a JSON tree; name is used in messages (for tests and the fuzzer). */
exl_status exl_hf_config_parse(const char *name, const cJSON *root, exl_hf_config *out);
/* Merge a GPTQ quantize_config.json object into cfg->quant. */
exl_status exl_hf_quant_parse(const char *name, const cJSON *q, exl_quant_config *out);
/* Merge a generation_config.json object: sampling defaults into cfg->gen, eos ids into cfg's. */
exl_status exl_hf_generation_parse(const char *name, const cJSON *g, exl_hf_config *cfg);
/* The rope of layer i (rope or rope_sliding). */
const exl_rope_config *exl_hf_layer_rope(const exl_hf_config *cfg, int32_t layer);
const char *exl_arch_name(exl_arch a);
const char *exl_rope_type_name(exl_rope_type t);

#endif
