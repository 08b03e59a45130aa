/* test_model_files.c - model directories as they come today: the round-2 architectures' tensors as `exl info` shows
 * them (and that they load for running), a Gemma 3 multimodal checkpoint's text model, a stale shard index (as
 * ExLlamaV2 leaves it), generation_config.json and chat_template.jinja. */
#include "base/notice.h"
#include "model/model.h"
#include "model_util.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

/* notices given while a test runs */
static char notices[4096];

static void take_notice(void *user, const char *text) {
    (void)user;
    snprintf(notices + strlen(notices), sizeof notices - strlen(notices), "%s\n", text);
}

static void capture_notices(void) {
    notices[0] = 0;
    exl_notice_set_handler(take_notice, NULL);
}

static exl_status load(const char *dir, int load_only, exl_model **m) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    p.load_only = load_only;
    *m = NULL;
    return exl_model_load(dir, &p, m);
}

static void copy_to(const char *src_dir, const char *name, const char *dst_dir, const char *dst_name) {
    char a[4096], b[4096];
    snprintf(a, sizeof a, "%s/%s", src_dir, name);
    snprintf(b, sizeof b, "%s/%s", dst_dir, dst_name ? dst_name : name);
    if (mu_copy_file(a, b) != 0)
        exl_test_failed(__FILE__, __LINE__, "cannot copy %s", a);
}

static void write_text(const char *dir, const char *name, const char *text) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (mu_write_file(path, text, strlen(text)) != 0)
        exl_test_failed(__FILE__, __LINE__, "cannot write %s", path);
}

/* ---- the round-2 fixtures: every tensor loaded and shown by exl info, and loaded for running */

static void check_report(exl_model *m, const char *const *needles) {
    char *report = NULL;
    if (exl_model_report(m, &report) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "report: %s", exl_last_error());
        return;
    }
    for (; *needles; needles++)
        CHECK_MSG(strstr(report, *needles) != NULL, "report lacks '%s':\n%s", *needles, report);
    exl_string_free(report);
}

/* the whole model loads for running (test_reference checks its logits) */
static void check_runs(const char *dir) {
    exl_model *m;
    exl_status st = load(dir, 0, &m);
    CHECK_MSG(st == EXL_OK && m, "%s: %s (%s)", dir, exl_status_str(st), exl_last_error());
    exl_model_free(m);
}

EXL_TEST(qwen3_tensors) {
    const char *dir = exl_test_shared("models/rand-qwen3");
    exl_model *m;
    REQUIRE_OK(load(dir, 1, &m));
    for (int i = 0; i < m->cfg.n_layers; i++) {
        const exl_layer *l = &m->layers[i];
        CHECK(l->q && l->k && l->v && l->o && l->q_norm && l->k_norm && l->gate && l->up && l->down);
        CHECK(!l->qkv && !l->post_attn_norm && !l->router && !l->experts);
    }
    static const char *const facts[] = {"architecture: qwen3", "q/k norms per head", "(tied embeddings)", NULL};
    check_report(m, facts);
    exl_model_free(m);
    check_runs(exl_test_shared("models/rand-qwen3"));
}

EXL_TEST(gemma3_tensors) {
    exl_model *m;
    REQUIRE_OK(load(exl_test_shared("models/rand-gemma3"), 1, &m));
    for (int i = 0; i < m->cfg.n_layers; i++) {
        const exl_layer *l = &m->layers[i];
        CHECK(l->attn_norm && l->mlp_norm && l->post_attn_norm && l->post_mlp_norm && l->q_norm && l->k_norm);
    }
    CHECK(m->embed_scale == 16.0f);
    static const char *const facts[] = {"sliding window 48 on 3 of 4 layers (S sliding, F full): SSSF",
                                        "rope:         default, theta 1e+06",
                                        "rope sliding: default, theta 10000",
                                        "RMSNorm (1 + w), q/k norms per head, post-attention and pre/post feed-forward",
                                        "scores scaled by 1/sqrt(64)",
                                        NULL};
    check_report(m, facts);
    exl_model_free(m);
    check_runs(exl_test_shared("models/rand-gemma3"));
}

EXL_TEST(phi3_tensors) {
    exl_model *m;
    REQUIRE_OK(load(exl_test_shared("models/rand-phi3"), 1, &m));
    for (int i = 0; i < m->cfg.n_layers; i++) {
        const exl_layer *l = &m->layers[i];
        CHECK(l->qkv && l->gate_up && l->down && l->o && !l->q && !l->gate && !l->up);
    }
    CHECK(m->rot_dim == 48);
    static const char *const facts[] = {"fused qkv_proj", "fused gate_up_proj", "partial rotary factor 0.75",
                                        "model.layers.0.self_attn.qkv_proj    dense    256 x 512", NULL};
    check_report(m, facts);
    exl_model_free(m);
    check_runs(exl_test_shared("models/rand-phi3"));
}

EXL_TEST(moe_tensors) {
    exl_model *m;
    REQUIRE_OK(load(exl_test_shared("models/rand-mixtral"), 1, &m));
    for (int i = 0; i < m->cfg.n_layers; i++) {
        const exl_layer *l = &m->layers[i];
        CHECK(l->router && l->experts && !l->gate && !l->shared_gate);
        for (int e = 0; l->experts && e < 4; e++)
            CHECK(l->experts[e].gate && l->experts[e].up && l->experts[e].down);
    }
    static const char *const mixtral[] = {"experts:      4 per MoE layer, top-2 (weights renormalized), expert ffn 384",
                                          "3.803 M parameters, 2.623 M active per token",
                                          "model.layers.1.block_sparse_moe.experts.* x12", NULL};
    check_report(m, mixtral);
    exl_model_free(m);
    check_runs(exl_test_shared("models/rand-mixtral"));

    REQUIRE_OK(load(exl_test_shared("models/rand-qwen3moe"), 1, &m));
    CHECK(m->layers[1].router && m->layers[1].experts && m->layers[1].experts[7].down && m->layers[1].q_norm);
    static const char *const qwen[] = {"experts:      8 per MoE layer, top-2 (weights renormalized), expert ffn 128",
                                       "model.layers.0.mlp.experts.* x24", NULL};
    check_report(m, qwen);
    exl_model_free(m);
    check_runs(exl_test_shared("models/rand-qwen3moe"));
}

/* a missing expert is named */
EXL_TEST(missing_expert_tensor_is_named) {
    const char *src = exl_test_shared("models/rand-mixtral");
    char dir[1024], path[4096];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    copy_to(src, "config.json", dir, NULL);
    snprintf(path, sizeof path, "%s/model.safetensors", src);
    size_t n;
    char *buf = mu_read_file(path, &n);
    REQUIRE(buf);
    char *at = strstr(buf + 8, "experts.3.w2.weight");
    REQUIRE(at);
    at[8] = 'x'; /* experts.3.x2.weight */
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    CHECK(mu_write_file(path, buf, n) == 0);
    free(buf);
    exl_model *m;
    exl_status st = load(dir, 0, &m);
    CHECK_MSG(st == EXL_ERR_FORMAT, "%s: %s", exl_status_str(st), exl_last_error());
    CHECK_MSG(strstr(exl_last_error(), "missing tensor 'model.layers.0.block_sparse_moe.experts.3.w2.weight'") ||
                  strstr(exl_last_error(), "missing tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight'"),
              "message: %s", exl_last_error());
    exl_model_free(m);
}

/* ---- a Gemma 3 multimodal checkpoint: config.json's text_config, tensors under language_model.model. */

/* Rewrite src's safetensors header with every "model." name renamed to prefix + the rest; adds a vision tensor. */
static void write_renamed(const char *src, const char *dst, const char *prefix) {
    size_t n;
    unsigned char *buf = (unsigned char *)mu_read_file(src, &n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    char *hdr = malloc(hlen + 1);
    memcpy(hdr, buf + 8, hlen);
    hdr[hlen] = 0;
    cJSON *root = cJSON_Parse(hdr), *out = cJSON_CreateObject();
    for (cJSON *t = root->child; t; t = t->next) {
        char name[512];
        if (!strncmp(t->string, "model.", 6))
            snprintf(name, sizeof name, "%s%s", prefix, t->string + 6);
        else
            snprintf(name, sizeof name, "%s", t->string);
        cJSON_AddItemToObject(out, name, cJSON_Duplicate(t, 1));
        if (!strcmp(t->string, "model.norm.weight")) /* a vision tower tensor sharing its bytes */
            cJSON_AddItemToObject(out, "vision_tower.vision_model.post_layernorm.weight", cJSON_Duplicate(t, 1));
    }
    char *nh = cJSON_PrintUnformatted(out);
    size_t nlen = strlen(nh), pad = (8 - nlen % 8) % 8, data = n - 8 - hlen;
    unsigned char *o = malloc(8 + nlen + pad + data);
    for (int i = 0; i < 8; i++)
        o[i] = (unsigned char)((uint64_t)(nlen + pad) >> (8 * i));
    memcpy(o + 8, nh, nlen);
    memset(o + 8 + nlen, ' ', pad);
    memcpy(o + 8 + nlen + pad, buf + 8 + hlen, data);
    CHECK(mu_write_file(dst, o, 8 + nlen + pad + data) == 0);
    free(o);
    free(nh);
    cJSON_Delete(out);
    cJSON_Delete(root);
    free(hdr);
    free(buf);
}

EXL_TEST(gemma3_multimodal_text_model) {
    const char *src = exl_test_shared("models/rand-gemma3");
    char dir[1024], a[4096], b[4096];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    snprintf(a, sizeof a, "%s/config.json", src);
    char *text = mu_read_file(a, NULL);
    REQUIRE(text);
    char *config = malloc(strlen(text) + 256);
    sprintf(config,
            "{\"architectures\": [\"Gemma3ForConditionalGeneration\"], \"model_type\": \"gemma3\", "
            "\"eos_token_id\": [2, 106], \"vision_config\": {\"model_type\": \"siglip_vision_model\"}, "
            "\"text_config\": %s}",
            text);
    write_text(dir, "config.json", config);
    free(config);
    free(text);
    static const char *const prefixes[] = {"language_model.model.", "model.language_model."};
    for (int i = 0; i < 2; i++) {
        snprintf(a, sizeof a, "%s/model.safetensors", src);
        snprintf(b, sizeof b, "%s/model.safetensors", dir);
        write_renamed(a, b, prefixes[i]);
        capture_notices();
        exl_model *m;
        exl_status st = load(dir, 1, &m);
        exl_notice_set_handler(NULL, NULL);
        REQUIRE_OK(st);
        CHECK_MSG(strstr(notices, "a gemma3 checkpoint: loading its text model only, the vision tower is ignored"),
                  "notices: %s", notices);
        CHECK(m->cfg.arch == EXL_ARCH_GEMMA3 && m->cfg.n_eos == 2 && m->cfg.eos_token_ids[1] == 106);
        CHECK(m->layers[3].post_mlp_norm && m->layers[0].k_norm && m->final_norm);
        static const char *const facts[] = {"architecture: gemma3 (its gemma3_text text model; the vision tower is "
                                            "ignored)",
                                            "SSSF", NULL};
        check_report(m, facts);
        exl_model_free(m);
    }
}

/* ---- ExLlamaV2 copies the source model's model.safetensors.index.json into its output */

static float *logits_of(exl_model *m, int32_t n) {
    static const int32_t ids[] = {1, 80, 147, 201, 282, 57, 313, 598, 303, 1049, 1468, 267};
    float *out = malloc((size_t)n * m->cfg.vocab_size * sizeof *out);
    exl_session *s;
    if (exl_session_init(m, n, &s) != EXL_OK || exl_session_eval(s, ids, n, out, NULL) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "eval: %s", exl_last_error());
        free(out);
        return NULL;
    }
    exl_session_free(s);
    return out;
}

EXL_TEST(stale_index_uses_the_directory_files) {
    const char *src = exl_test_shared("models/rand-llama-exl2-3.0bpw-h6");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    copy_to(src, "config.json", dir, NULL);
    copy_to(src, "output.safetensors", dir, NULL);
    write_text(dir, "model.safetensors.index.json",
               "{\"metadata\": {\"total_size\": 2621440}, \"weight_map\": {"
               "\"lm_head.weight\": \"model-00002-of-00002.safetensors\", "
               "\"model.embed_tokens.weight\": \"model-00001-of-00002.safetensors\", "
               "\"model.norm.weight\": \"model-00002-of-00002.safetensors\"}}");
    capture_notices();
    exl_model *orig, *stale;
    exl_status st = load(dir, 0, &stale);
    exl_notice_set_handler(NULL, NULL);
    REQUIRE_OK(st);
    CHECK_MSG(strstr(notices, "model.safetensors.index.json names model-00002-of-00002.safetensors, which is not in "
                              "the directory: ignoring the index"),
              "notices: %s", notices);
    CHECK_MSG(strchr(notices, '\n') == notices + strlen(notices) - 1, "not one notice line: %s", notices);
    REQUIRE_OK(load(src, 0, &orig));
    float *lo = logits_of(orig, 12), *ls = logits_of(stale, 12);
    REQUIRE(lo && ls);
    CHECK_MSG(!memcmp(lo, ls, 12 * (size_t)orig->cfg.vocab_size * sizeof(float)),
              "stale-index copy computes otherwise");
    free(lo);
    free(ls);
    exl_model_free(orig);
    exl_model_free(stale);
    /* an index whose shards are all there is still trusted: one naming a file without the tensor is an error */
    write_text(dir, "model.safetensors.index.json",
               "{\"weight_map\": {\"model.embed_tokens.weight\": \"output.safetensors\", "
               "\"model.layers.0.mlp.up_proj.weight\": \"output.safetensors\"}}");
    st = load(dir, 0, &stale);
    CHECK_MSG(st == EXL_ERR_FORMAT && strstr(exl_last_error(), "'model.layers.0.mlp.up_proj.weight' is listed for "
                                                               "output.safetensors but that file does not hold it"),
              "%s: %s", exl_status_str(st), exl_last_error());
    exl_model_free(stale);
}

/* ---- generation_config.json */

EXL_TEST(generation_config_merges_eos_and_keeps_sampling) {
    const char *src = exl_test_shared("models/rand-llama");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    copy_to(src, "config.json", dir, NULL);
    copy_to(src, "model.safetensors", dir, NULL);
    write_text(dir, "generation_config.json",
               "{\"bos_token_id\": 1, \"do_sample\": true, \"eos_token_id\": [7, 2, 9], \"temperature\": 0.6, "
               "\"top_k\": 20, \"top_p\": 0.95, \"repetition_penalty\": 1.1, \"transformers_version\": \"5.24.0\"}");
    exl_model *m;
    REQUIRE_OK(load(dir, 0, &m));
    exl_model_desc d;
    exl_model_describe(m, &d);
    CHECK_MSG(d.n_eos_token_ids == 3 && d.eos_token_ids[0] == 2 && d.eos_token_ids[1] == 7 && d.eos_token_ids[2] == 9,
              "eos: %d ids, %d %d %d", d.n_eos_token_ids, d.eos_token_ids[0], d.eos_token_ids[1], d.eos_token_ids[2]);
    CHECK(d.gen_do_sample == 1 && d.gen_temperature == 0.6f && d.gen_top_k == 20 && d.gen_top_p == 0.95f);
    CHECK(d.gen_repetition_penalty == 1.1f && d.gen_min_p < 0);
    static const char *const facts[] = {"tokens:       bos 1, eos 2 7 9",
                                        "generation:   sample temperature 0.6 top_k 20 top_p 0.95 "
                                        "repetition_penalty 1.1",
                                        NULL};
    check_report(m, facts);
    exl_model_free(m);
    /* without one: nothing set */
    REQUIRE_OK(load(exl_test_shared("models/tinystories-656k"), 0, &m));
    exl_model_describe(m, &d);
    CHECK(d.gen_temperature < 0 && d.gen_top_k < 0 && d.gen_do_sample < 0);
    exl_model_free(m);
    /* a wrong type is an error naming the file and the field */
    write_text(dir, "generation_config.json", "{\"temperature\": \"hot\"}");
    exl_status st = load(dir, 0, &m);
    CHECK_MSG(st == EXL_ERR_FORMAT && strstr(exl_last_error(), "generation_config.json: field \"temperature\" must be "
                                                               "a number"),
              "%s: %s", exl_status_str(st), exl_last_error());
    exl_model_free(m);
}

/* ---- chat_template.jinja (transformers 5 writes the template there) */

EXL_TEST(chat_template_jinja_file) {
    const char *src = exl_test_shared("tokenizers/qwen3");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    copy_to(src, "tokenizer.json", dir, NULL);
    copy_to(src, "tokenizer_config.json", dir, NULL);
    write_text(dir, "chat_template.jinja",
               "{%- for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
               "{%- if add_generation_prompt %}[assistant]{% endif %}");
    exl_tokenizer *tok;
    REQUIRE_OK(exl_tokenizer_load(dir, &tok));
    exl_chat_message msgs[] = {{.role = "system", .content = "Be brief."}, {.role = "user", .content = "Hi"}};
    char *text = NULL;
    REQUIRE_OK(exl_chat_apply(tok, msgs, 2, 1, NULL, &text));
    CHECK_MSG(!strcmp(text, "[system] Be brief.\n[user] Hi\n[assistant]"), "rendered: %s", text);
    exl_string_free(text);
    exl_tokenizer_free(tok);
}
