/* test_config.c - config.json as transformers 5 reads it: every round-2 fixture's per-layer facts, the defaults
 * and older forms of each new architecture, generation_config.json, and a clear error for each field value exl
 * does not implement. */
#include "io/hf_config.h"
#include "model/model.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static exl_hf_config cfg; /* ~10 KB: kept off the stack */

static exl_status load_fixture(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "models/%s", name);
    return exl_hf_config_load(exl_test_shared(rel), &cfg);
}

/* Parse JSON written with ' for " (the tests' configs hold no apostrophes). */
static exl_status parse(const char *json_q) {
    char *json = strdup(json_q);
    for (char *p = json; *p; p++)
        if (*p == '\'')
            *p = '"';
    cJSON *root = cJSON_Parse(json);
    free(json);
    if (!root) {
        exl_test_failed(__FILE__, __LINE__, "test JSON does not parse: %s", json_q);
        return EXL_ERR_ARG;
    }
    exl_status st = exl_hf_config_parse("config.json", root, &cfg);
    cJSON_Delete(root);
    return st;
}

/* The config must fail with status want and a one-line message holding needle (and needle2). */
static void expect_error(const char *json_q, exl_status want, const char *needle, const char *needle2) {
    exl_status st = parse(json_q);
    const char *msg = exl_last_error();
    CHECK_MSG(st == want, "%s: status %s, wanted %s (%s)", json_q, exl_status_str(st), exl_status_str(want), msg);
    CHECK_MSG(strstr(msg, needle) != NULL, "message '%s' lacks '%s'", msg, needle);
    if (needle2)
        CHECK_MSG(strstr(msg, needle2) != NULL, "message '%s' lacks '%s'", msg, needle2);
    CHECK_MSG(!strchr(msg, '\n'), "message is not one line: %s", msg);
}

/* "SSSF": which layers slide */
static const char *window_pattern(void) {
    static char buf[EXL_MAX_LAYERS + 1];
    for (int32_t i = 0; i < cfg.n_layers; i++)
        buf[i] = cfg.layers[i].sliding_window ? 'S' : 'F';
    buf[cfg.n_layers] = 0;
    return buf;
}

static const char *moe_pattern(void) {
    static char buf[EXL_MAX_LAYERS + 1];
    for (int32_t i = 0; i < cfg.n_layers; i++)
        buf[i] = cfg.layers[i].moe ? 'M' : 'D';
    buf[cfg.n_layers] = 0;
    return buf;
}

/* ---- the fixtures, as saved by transformers 5.24 */

EXL_TEST(fixture_qwen3) {
    REQUIRE_OK(load_fixture("rand-qwen3"));
    CHECK(cfg.arch == EXL_ARCH_QWEN3 && !strcmp(cfg.model_type, "qwen3"));
    CHECK(cfg.head_dim == 64 && cfg.n_heads == 4 && cfg.n_kv_heads == 2 && cfg.n_layers == 2);
    CHECK(cfg.qk_norm && !cfg.sandwich_norms && !cfg.fused_qkv && !cfg.norm_plus_one);
    CHECK(!cfg.qkv_bias && !cfg.o_bias && cfg.tie_embeddings);
    CHECK(cfg.rope.type == EXL_ROPE_DEFAULT && cfg.rope.theta == 1e6 && cfg.rope_sliding.theta == 1e6);
    CHECK(!strcmp(window_pattern(), "FF") && cfg.sliding_window == 0);
    CHECK(cfg.moe.n_experts == 0 && !strcmp(moe_pattern(), "DD"));
    CHECK(cfg.bos_token_id == 1 && cfg.n_eos == 1 && cfg.eos_token_ids[0] == 2);
    CHECK(cfg.gen.present && cfg.gen.temperature < 0 && cfg.gen.do_sample < 0);
}

EXL_TEST(fixture_gemma3) {
    REQUIRE_OK(load_fixture("rand-gemma3"));
    CHECK(cfg.arch == EXL_ARCH_GEMMA3 && !strcmp(cfg.model_type, "gemma3_text") && !cfg.vision_ignored);
    CHECK(cfg.n_layers == 4 && cfg.n_kv_heads == 1 && cfg.head_dim == 64);
    CHECK_MSG(!strcmp(window_pattern(), "SSSF"), "windows %s", window_pattern());
    CHECK(cfg.sliding_window == 48 && cfg.layers[0].sliding_window == 48 && cfg.layers[3].sliding_window == 0);
    CHECK(cfg.layers[0].sliding && !cfg.layers[3].sliding);
    CHECK(cfg.rope.theta == 1e6 && cfg.rope_sliding.theta == 1e4);
    CHECK(exl_hf_layer_rope(&cfg, 0)->theta == 1e4 && exl_hf_layer_rope(&cfg, 3)->theta == 1e6);
    CHECK(cfg.qk_norm && cfg.sandwich_norms && cfg.norm_plus_one && cfg.act == EXL_ACT_GELU_TANH);
    CHECK(cfg.query_pre_attn_scalar == 64 && cfg.attn_softcap == 0 && cfg.final_softcap == 0);
    CHECK(cfg.tie_embeddings && cfg.bos_token_id == 1 && cfg.eos_token_ids[0] == 2);
}

EXL_TEST(fixture_phi3) {
    REQUIRE_OK(load_fixture("rand-phi3"));
    CHECK(cfg.arch == EXL_ARCH_PHI3 && cfg.fused_qkv && cfg.fused_gate_up && !cfg.tie_embeddings);
    CHECK(cfg.rope.type == EXL_ROPE_DEFAULT && cfg.rope.partial_rotary_factor == 0.75 && cfg.rope.theta == 1e4);
    CHECK(cfg.head_dim == 64 && (int32_t)(cfg.head_dim * cfg.rope.partial_rotary_factor) == 48);
    CHECK(!strcmp(window_pattern(), "FF") && cfg.rms_eps == 1e-6);
}

EXL_TEST(fixture_mixtral) {
    REQUIRE_OK(load_fixture("rand-mixtral"));
    CHECK(cfg.arch == EXL_ARCH_MIXTRAL && cfg.head_dim == 64 && cfg.rope.theta == 1e6);
    CHECK(cfg.moe.n_experts == 4 && cfg.moe.top_k == 2 && cfg.moe.expert_ffn == 384 && cfg.moe.norm_topk_prob);
    CHECK(cfg.moe.shared_ffn == 0 && cfg.moe.n_moe_layers == 2 && !strcmp(moe_pattern(), "MM"));
    CHECK(!cfg.qk_norm && !strcmp(window_pattern(), "FF"));
}

EXL_TEST(fixture_qwen3moe) {
    REQUIRE_OK(load_fixture("rand-qwen3moe"));
    CHECK(cfg.arch == EXL_ARCH_QWEN3_MOE && cfg.qk_norm && cfg.head_dim == 64);
    CHECK(cfg.moe.n_experts == 8 && cfg.moe.top_k == 2 && cfg.moe.expert_ffn == 128 && cfg.moe.norm_topk_prob);
    CHECK(cfg.intermediate_size == 768 && !strcmp(moe_pattern(), "MM"));
}

EXL_TEST(fixtures_of_round_one_unchanged) {
    REQUIRE_OK(load_fixture("rand-qwen2"));
    CHECK(cfg.arch == EXL_ARCH_QWEN2 && cfg.qkv_bias && !cfg.o_bias && !strcmp(window_pattern(), "FF"));
    REQUIRE_OK(load_fixture("rand-gemma"));
    CHECK(cfg.arch == EXL_ARCH_GEMMA && cfg.norm_plus_one && !cfg.sandwich_norms && !cfg.qk_norm);
    REQUIRE_OK(load_fixture("rand-llama3rope"));
    CHECK(cfg.rope.type == EXL_ROPE_LLAMA3 && cfg.rope.factor == 8 && cfg.rope.original_max_pos == 256);
}

/* ---- the new architectures as users download them (older transformers' fields, defaults) */

EXL_TEST(gemma2_defaults) {
    REQUIRE_OK(parse("{'model_type': 'gemma2', 'num_hidden_layers': 4, 'hidden_size': 256}"));
    CHECK(cfg.arch == EXL_ARCH_GEMMA2 && cfg.head_dim == 256 && cfg.n_heads == 8 && cfg.n_kv_heads == 4);
    CHECK(cfg.attn_softcap == 50 && cfg.final_softcap == 30 && cfg.query_pre_attn_scalar == 256);
    CHECK_MSG(!strcmp(window_pattern(), "SFSF"), "windows %s", window_pattern());
    CHECK(cfg.sliding_window == 4096 && cfg.sandwich_norms && !cfg.qk_norm && cfg.tie_embeddings);
    CHECK(cfg.vocab_size == 256000 && cfg.bos_token_id == 2 && cfg.eos_token_ids[0] == 1);
    /* null turns soft-capping off; layer_types overrides the alternation */
    REQUIRE_OK(parse("{'model_type': 'gemma2', 'num_hidden_layers': 2, 'attn_logit_softcapping': null, "
                     "'final_logit_softcapping': 20.0, 'sliding_window': 16, "
                     "'layer_types': ['full_attention', 'sliding_attention']}"));
    CHECK(cfg.attn_softcap == 0 && cfg.final_softcap == 20 && !strcmp(window_pattern(), "FS"));
    CHECK(cfg.layers[1].sliding_window == 16);
}

EXL_TEST(gemma3_multimodal_checkpoint) {
    /* google/gemma-3-4b-it's config.json (vision_config shortened) */
    REQUIRE_OK(parse("{'architectures': ['Gemma3ForConditionalGeneration'], 'boi_token_index': 255999, "
                     "'eos_token_id': [1, 106], 'image_token_index': 262144, 'model_type': 'gemma3', "
                     "'text_config': {'hidden_size': 2560, 'intermediate_size': 10240, 'model_type': 'gemma3_text', "
                     "'num_hidden_layers': 34, 'rope_scaling': {'factor': 8.0, 'rope_type': 'linear'}, "
                     "'sliding_window': 1024}, 'torch_dtype': 'bfloat16', "
                     "'vision_config': {'hidden_size': 1152, 'model_type': 'siglip_vision_model'}}"));
    CHECK(cfg.arch == EXL_ARCH_GEMMA3 && cfg.vision_ignored && !strcmp(cfg.model_type, "gemma3"));
    CHECK(cfg.n_layers == 34 && cfg.hidden_size == 2560 && cfg.vocab_size == 262208 && cfg.head_dim == 256);
    CHECK(cfg.n_heads == 8 && cfg.n_kv_heads == 4 && cfg.max_pos == 131072);
    CHECK_MSG(!strcmp(window_pattern(), "SSSSSFSSSSSFSSSSSFSSSSSFSSSSSFSSSS"), "windows %s", window_pattern());
    CHECK(cfg.sliding_window == 1024);
    CHECK(cfg.rope.type == EXL_ROPE_LINEAR && cfg.rope.factor == 8 && cfg.rope.theta == 1e6);
    CHECK(cfg.rope_sliding.type == EXL_ROPE_DEFAULT && cfg.rope_sliding.theta == 1e4);
    CHECK(cfg.bos_token_id == 2 && cfg.n_eos == 2 && cfg.eos_token_ids[0] == 1 && cfg.eos_token_ids[1] == 106);
    CHECK(!strcmp(cfg.torch_dtype, "bfloat16") && cfg.attn_softcap == 0);
    /* rope_local_base_freq and sliding_window_pattern of the older gemma3_text configs */
    REQUIRE_OK(parse("{'model_type': 'gemma3_text', 'num_hidden_layers': 4, 'rope_local_base_freq': 5000.0, "
                     "'rope_theta': 2000000.0, 'sliding_window_pattern': 2}"));
    CHECK(!strcmp(window_pattern(), "SFSF") && cfg.rope_sliding.theta == 5000 && cfg.rope.theta == 2e6);
}

/* Phi-3.5-mini style: longrope factor lists, the original context outside rope_scaling */
#define PHI3_LONGROPE                                                                                              \
    "{'model_type': 'phi3', 'hidden_size': 256, 'num_attention_heads': 4, 'num_hidden_layers': 2, "                \
    "'max_position_embeddings': 131072, 'original_max_position_embeddings': 4096, 'partial_rotary_factor': 0.75, " \
    "'sliding_window': 262144, 'rope_scaling': {'type': '%s', 'short_factor': [%s], 'long_factor': [%s]}}"

static char *phi3_config(const char *type, int n_short, int n_long) {
    static char buf[4096];
    char s[1024] = "", l[1024] = "";
    for (int i = 0; i < n_short; i++)
        snprintf(s + strlen(s), sizeof s - strlen(s), "%s%g", i ? ", " : "", 1.0 + 0.01 * i);
    for (int i = 0; i < n_long; i++)
        snprintf(l + strlen(l), sizeof l - strlen(l), "%s%g", i ? ", " : "", 1.5 + 0.5 * i);
    snprintf(buf, sizeof buf, PHI3_LONGROPE, type, s, l);
    return buf;
}

EXL_TEST(phi3_longrope) {
    REQUIRE_OK(parse(phi3_config("longrope", 24, 24)));
    const exl_rope_config *r = &cfg.rope;
    CHECK(r->type == EXL_ROPE_LONGROPE && r->n_factors == 24 && r->original_max_pos == 4096);
    CHECK(r->factor == 32 && r->partial_rotary_factor == 0.75 && r->theta == 1e4);
    CHECK(fabsf(r->short_factor[3] - 1.03f) < 1e-6f && r->long_factor[2] == 2.5f);
    CHECK(!strcmp(window_pattern(), "SS") && cfg.sliding_window == 262144);
    /* frequencies: the short factors within the original context, the long ones past it */
    float inv[24], af;
    exl_rope_frequencies(&cfg, &cfg.rope, 48, 100, inv, &af);
    float want = 1.0f / (1.03f * powf(10000.0f, 6.0f / 48.0f));
    CHECK_MSG(fabsf(inv[3] - want) <= 1e-6f * want, "short inv_freq[3] %g, want %g", inv[3], want);
    CHECK_MSG(fabs(af - sqrt(1 + log(32.0) / log(4096.0))) < 1e-6, "attention factor %g", af);
    exl_rope_frequencies(&cfg, &cfg.rope, 48, 5000, inv, &af);
    want = 1.0f / (2.5f * powf(10000.0f, 4.0f / 48.0f));
    CHECK_MSG(fabsf(inv[2] - want) <= 1e-6f * want, "long inv_freq[2] %g, want %g", inv[2], want);
    /* older names of longrope in Phi-3 configs */
    REQUIRE_OK(parse(phi3_config("su", 24, 24)));
    CHECK(cfg.rope.type == EXL_ROPE_LONGROPE);
    expect_error(phi3_config("longrope", 24, 23), EXL_ERR_FORMAT, "longrope needs \"rope_scaling.short_factor\"",
                 "24 entries each");
    expect_error(phi3_config("linear", 0, 0), EXL_ERR_UNSUPPORTED, "\"rope_scaling.rope_type\" = 'linear'",
                 "Phi-3 takes default or longrope");
}

EXL_TEST(moe_layouts) {
    /* Qwen1.5-MoE style: shared expert, every second layer sparse, one listed as dense */
    REQUIRE_OK(parse("{'model_type': 'qwen2_moe', 'num_hidden_layers': 4, 'num_experts': 4, "
                     "'num_experts_per_tok': 2, 'moe_intermediate_size': 64, 'shared_expert_intermediate_size': 128, "
                     "'decoder_sparse_step': 2, 'mlp_only_layers': [3]}"));
    CHECK(cfg.arch == EXL_ARCH_QWEN2_MOE && cfg.qkv_bias && !cfg.o_bias);
    CHECK(cfg.moe.n_experts == 4 && cfg.moe.shared_ffn == 128 && !cfg.moe.norm_topk_prob);
    CHECK_MSG(!strcmp(moe_pattern(), "DMDD"), "moe layers %s", moe_pattern());
    CHECK(cfg.moe.n_moe_layers == 1);
    /* transformers 4's Qwen3-MoE key num_experts, and the class defaults */
    REQUIRE_OK(parse("{'model_type': 'qwen3_moe', 'num_hidden_layers': 2, 'num_experts': 16}"));
    CHECK(cfg.moe.n_experts == 16 && cfg.moe.top_k == 8 && cfg.moe.expert_ffn == 768 && cfg.head_dim == 64);
    REQUIRE_OK(parse("{'architectures': ['MixtralForCausalLM'], 'num_hidden_layers': 1}"));
    CHECK(cfg.arch == EXL_ARCH_MIXTRAL && cfg.moe.n_experts == 8 && cfg.moe.top_k == 2 && cfg.rms_eps == 1e-5);
}

EXL_TEST(sliding_windows_by_architecture) {
    /* Mistral: a window on every layer unless sliding_window is null */
    REQUIRE_OK(parse("{'model_type': 'mistral', 'num_hidden_layers': 2}"));
    CHECK(!strcmp(window_pattern(), "SS") && cfg.sliding_window == 4096);
    REQUIRE_OK(parse("{'model_type': 'mistral', 'num_hidden_layers': 2, 'sliding_window': null}"));
    CHECK(!strcmp(window_pattern(), "FF"));
    /* Qwen2: only with use_sliding_window, from max_window_layers on */
    REQUIRE_OK(parse("{'model_type': 'qwen2', 'num_hidden_layers': 3, 'sliding_window': 32}"));
    CHECK(!strcmp(window_pattern(), "FFF"));
    REQUIRE_OK(parse("{'model_type': 'qwen2', 'num_hidden_layers': 3, 'sliding_window': 32, "
                     "'use_sliding_window': true, 'max_window_layers': 1}"));
    CHECK(!strcmp(window_pattern(), "FSS") && cfg.layers[2].sliding_window == 32);
    /* rope_parameters per layer type for any architecture with layer_types */
    REQUIRE_OK(parse("{'model_type': 'qwen3', 'num_hidden_layers': 2, 'sliding_window': 8, "
                     "'use_sliding_window': true, 'layer_types': ['sliding_attention', 'full_attention'], "
                     "'rope_parameters': {'full_attention': {'rope_type': 'yarn', 'factor': 4.0, 'rope_theta': 5e5}, "
                     "'sliding_attention': {'rope_type': 'default', 'rope_theta': 1e4}}}"));
    CHECK(exl_hf_layer_rope(&cfg, 0)->theta == 1e4 && exl_hf_layer_rope(&cfg, 1)->type == EXL_ROPE_YARN);
    CHECK(exl_hf_layer_rope(&cfg, 1)->theta == 5e5 && exl_hf_layer_rope(&cfg, 1)->factor == 4);
}

/* ---- what exl does not implement: a clear error naming the field and its value */

EXL_TEST(unsupported_values_are_errors) {
    expect_error("{'model_type': 'qwen3', 'rope_parameters': {'rope_type': 'mrope', 'rope_theta': 1e6}}",
                 EXL_ERR_UNSUPPORTED, "\"rope_parameters.rope_type\" = 'mrope'", "unsupported rope type");
    expect_error("{'model_type': 'gemma3_text', 'num_hidden_layers': 2, 'rope_parameters': {'full_attention': "
                 "{'rope_type': 'default'}, 'sliding_attention': {'rope_type': 'ntk'}}}",
                 EXL_ERR_UNSUPPORTED, "\"rope_parameters.sliding_attention.rope_type\" = 'ntk'", NULL);
    expect_error("{'model_type': 'qwen3', 'num_hidden_layers': 2, 'layer_types': ['full_attention', "
                 "'chunked_attention']}",
                 EXL_ERR_UNSUPPORTED, "\"layer_types\"[1] = 'chunked_attention'", "unsupported layer type");
    expect_error("{'model_type': 'qwen3', 'num_hidden_layers': 3, 'layer_types': ['full_attention']}", EXL_ERR_FORMAT,
                 "\"layer_types\" has 1 entries for 3 layers", NULL);
    expect_error("{'model_type': 'qwen3', 'num_hidden_layers': 1, 'layer_types': ['sliding_attention']}",
                 EXL_ERR_FORMAT, "layer 0 is a sliding_attention layer", "sliding_window");
    expect_error("{'model_type': 'llama', 'hidden_act': 'relu2'}", EXL_ERR_UNSUPPORTED,
                 "\"hidden_act\" = 'relu2' is an unsupported activation", NULL);
    expect_error("{'model_type': 'gemma2', 'hidden_activation': 'gelu_fast'}", EXL_ERR_UNSUPPORTED,
                 "\"hidden_activation\" = 'gelu_fast'", NULL);
    expect_error("{'model_type': 'mixtral', 'num_local_experts': 0}", EXL_ERR_FORMAT, "a mixtral model needs experts",
                 "\"num_local_experts\" is 0");
    expect_error("{'model_type': 'qwen3_moe', 'num_experts': 4, 'num_experts_per_tok': 6}", EXL_ERR_FORMAT,
                 "\"num_experts_per_tok\" = 6 exceeds the 4 experts", NULL);
    expect_error("{'model_type': 'qwen3_moe', 'num_experts': 4, 'num_local_experts': 8}", EXL_ERR_FORMAT, "disagree",
                 NULL);
    expect_error("{'model_type': 'qwen3_moe', 'num_hidden_layers': 2, 'mlp_only_layers': [2]}", EXL_ERR_FORMAT,
                 "\"mlp_only_layers\" must list layer indices below 2", NULL);
    expect_error("{'model_type': 'gemma3_text', 'num_hidden_layers': 2, 'rope_parameters': {'full_attention': "
                 "{'rope_type': 'default'}}}",
                 EXL_ERR_FORMAT, "no entry for layer type \"sliding_attention\"", NULL);
    expect_error("{'model_type': 'gemma3_text', 'use_bidirectional_attention': true}", EXL_ERR_UNSUPPORTED,
                 "\"use_bidirectional_attention\" = true", NULL);
    expect_error("{'model_type': 'gemma3', 'text_config': {'model_type': 'gemma2'}}", EXL_ERR_UNSUPPORTED,
                 "\"text_config.model_type\" = 'gemma2'", NULL);
    expect_error("{'model_type': 'gemma3', 'text_config': {'hidden_act': 'x', 'hidden_activation': 'relu'}}",
                 EXL_ERR_UNSUPPORTED, "\"text_config.hidden_activation\" = 'relu'", NULL);
    expect_error("{'model_type': 'llama', 'num_hidden_layers': 600}", EXL_ERR_FORMAT, "\"num_hidden_layers\" = 600",
                 "out of range");
    expect_error("{'model_type': 'mamba'}", EXL_ERR_UNSUPPORTED, "unsupported architecture 'mamba'", NULL);
    expect_error("{'model_type': 'llama', 'rope_scaling': {'rope_type': 'linear'}}", EXL_ERR_FORMAT,
                 "needs \"rope_scaling.factor\"", NULL);
    expect_error("{'model_type': 'llama', 'eos_token_id': [2, 'x']}", EXL_ERR_FORMAT, "eos_token_id", NULL);
}
