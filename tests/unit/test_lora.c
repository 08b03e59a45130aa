/* test_lora.c - LoRA adapters on the CPU: logits of PEFT's fixtures against the reference (alone, weighted together,
 * on an EXL2 base), sequences with different adapters in one step, speculative decoding with adapters, and the
 * one-line errors for bad adapters (and for models split over devices). */
#include "gen_util.h"
#include "model/lora.h"
#include "model_util.h"
#include "test.h"

#include "base/half.h"
#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static exl_model *load_cpu(const char *name) {
    char rel[128];
    snprintf(rel, sizeof rel, "models/%s", name);
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *m = NULL;
    if (exl_model_load(exl_test_shared(rel), &p, &m) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "load %s: %s", name, exl_last_error());
    return m;
}

static exl_lora *load_adapter(exl_model *m, const char *name) {
    char rel[128];
    snprintf(rel, sizeof rel, "models/%s", name);
    exl_lora *lo = NULL;
    if (exl_lora_load(m, exl_test_shared(rel), &lo) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "adapter %s: %s", name, exl_last_error());
    return lo;
}

static exl_st_file *open_ref(void) {
    exl_st_file *f = NULL;
    if (exl_st_open(exl_test_shared("reference/rand-llama-lora.logits.safetensors"), &f) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "%s", exl_last_error());
    return f;
}

/* the largest difference between the logits of sequence s of tag (fed `step` tokens a step) and the reference */
static double seq_diff(exl_model *m, const exl_st_file *ref, const char *tag, const char *s, int32_t step) {
    char key[64];
    snprintf(key, sizeof key, "%s_ids_%s", tag, s);
    const exl_st_tensor *ids = exl_st_find(ref, key);
    snprintf(key, sizeof key, "%s_logits_%s", tag, s);
    const exl_st_tensor *lg = exl_st_find(ref, key);
    snprintf(key, sizeof key, "%s_pos_%s", tag, s);
    const exl_st_tensor *pos = exl_st_find(ref, key);
    int32_t n = ids ? (int32_t)ids->shape[0] : 0, vocab = m->cfg.vocab_size;
    exl_session *ses = NULL;
    float *out = malloc((size_t)n * vocab * sizeof *out);
    double worst = -1;
    if (lg && out && exl_session_init(m, n, &ses) == EXL_OK) {
        worst = 0;
        for (int32_t t = 0; t < n && worst >= 0; t += step) {
            int32_t k = n - t < step ? n - t : step;
            if (exl_session_eval(ses, (const int32_t *)ids->data + t, k, out + (int64_t)t * vocab, NULL) != EXL_OK)
                worst = -1;
        }
        for (int32_t r = 0; worst >= 0 && r < (int32_t)lg->shape[0]; r++) {
            int32_t p = pos ? ((const int32_t *)pos->data)[r] : r;
            for (int32_t v = 0; v < vocab; v++) {
                double d = fabs(out[(int64_t)p * vocab + v] - ((const float *)lg->data)[(int64_t)r * vocab + v]);
                worst = d > worst ? d : worst;
            }
        }
    }
    exl_session_free(ses);
    free(out);
    return worst;
}

static void check_tag(exl_model *m, const exl_st_file *ref, const char *tag) {
    double a = seq_diff(m, ref, tag, "a", 12), b = seq_diff(m, ref, tag, "b", 37), b1 = seq_diff(m, ref, tag, "b", 200);
    CHECK_MSG(a >= 0 && a < 1e-4 && b >= 0 && b < 1e-4 && b1 >= 0 && b1 < 1e-4,
              "%s: logits differ from PEFT's by %g (a), %g (b in steps of 37), %g (b at once)", tag, a, b, b1);
}

EXL_TEST(lora_logits_match_peft) {
    exl_st_file *ref = open_ref();
    exl_model *m = load_cpu("rand-llama");
    REQUIRE(ref && m);
    exl_lora *a1 = load_adapter(m, "rand-llama-lora-a1"), *a2 = load_adapter(m, "rand-llama-lora-a2");
    REQUIRE(a1 && a2);
    exl_lora_use one[1] = {{a1, 1}}, two[2] = {{a1, 0.5f}, {a2, 1}};
    REQUIRE_OK(exl_model_set_lora(m, one, 1));
    check_tag(m, ref, "a1");
    one[0].lora = a2;
    REQUIRE_OK(exl_model_set_lora(m, one, 1));
    check_tag(m, ref, "a2");
    REQUIRE_OK(exl_model_set_lora(m, two, 2));
    check_tag(m, ref, "w");
    exl_lora_free(a2); /* a1 stays loaded: freed with the model */
    exl_model_free(m);

    m = load_cpu("rand-llama-exl2-5.0bpw-h8");
    REQUIRE(m);
    a1 = load_adapter(m, "rand-llama-lora-a1");
    REQUIRE(a1);
    one[0].lora = a1;
    REQUIRE_OK(exl_model_set_lora(m, one, 1));
    check_tag(m, ref, "q");
    exl_model_free(m);
    exl_st_close(ref);
}

/* ---- sequences with different adapters in one step */

EXL_TEST(lora_sets_per_sequence_in_one_step) {
    exl_st_file *ref = open_ref();
    exl_model *m = load_cpu("rand-llama");
    REQUIRE(ref && m);
    exl_lora *a1 = load_adapter(m, "rand-llama-lora-a1"), *a2 = load_adapter(m, "rand-llama-lora-a2");
    REQUIRE(a1 && a2);
    const exl_lora_use u1 = {a1, 1}, u2 = {a2, 1}, uw[2] = {{a1, 0.5f}, {a2, 1}};
    exl_lora_set s1, s2, sw, none = {0};
    REQUIRE_OK(exl_lora_set_make(m, &u1, 1, &s1));
    REQUIRE_OK(exl_lora_set_make(m, &u2, 1, &s2));
    REQUIRE_OK(exl_lora_set_make(m, uw, 2, &sw));
    /* four copies of sequence a, each with its own set, in one step; the base's logits from a plain run */
    const exl_st_tensor *ids = exl_st_find(ref, "a1_ids_a");
    REQUIRE(ids);
    const int32_t n = (int32_t)ids->shape[0], vocab = m->cfg.vocab_size;
    exl_kv_cache *cache;
    REQUIRE_OK(exl_kv_cache_init(m, 4, 16, 16, 16, &cache));
    int32_t pages[4] = {0, 1, 2, 3};
    exl_seq_step st[4];
    for (int i = 0; i < 4; i++)
        st[i] = (exl_seq_step){.ids = ids->data, .n_new = n, .pages = &pages[i], .n_pages = 1, .want_logits = 2};
    const exl_lora_set *sets[4] = {&s1, &none, &s2, &sw};
    float *out = malloc((size_t)4 * n * vocab * sizeof *out), *base = malloc((size_t)n * vocab * sizeof *base);
    REQUIRE(out && base);
    exl_lora_step_sets(m, sets, 4);
    exl_status st_ = exl_model_forward(m, cache, st, 4, out);
    CHECK_MSG(st_ == EXL_OK, "%s", exl_last_error());
    st[0].pages = &pages[3];
    CHECK(exl_model_forward(m, cache, st, 1, base) == EXL_OK); /* no sets given: the fallback, none */
    static const char *const tags[4] = {"a1", NULL, "a2", "w"};
    for (int i = 0; i < 4; i++) {
        char key[32];
        const float *want = base;
        if (tags[i]) {
            snprintf(key, sizeof key, "%s_logits_a", tags[i]);
            const exl_st_tensor *lg = exl_st_find(ref, key);
            want = lg ? lg->data : NULL;
        }
        double worst = want ? 0 : 1;
        for (int64_t k = 0; want && k < (int64_t)n * vocab; k++) {
            double d = fabs(out[(int64_t)i * n * vocab + k] - want[k]);
            worst = d > worst ? d : worst;
        }
        CHECK_MSG(worst < 1e-4, "sequence %d (%s) differs by %g in a mixed step", i, tags[i] ? tags[i] : "base", worst);
    }
    free(out);
    free(base);
    exl_kv_cache_free(m, cache);
    exl_model_free(m);
    exl_st_close(ref);
}

/* ---- bad adapters */

typedef void (*config_edit)(cJSON *config);

/* dir: a1's config as edit changes it, and its tensors but `drop`, those whose name holds `doubled` times 2 (fp32) */
static int derive_adapter_x(const char *dir, config_edit edit, const char *drop, const char *doubled) {
    char path[4096];
    snprintf(path, sizeof path, "%s/adapter_config.json", exl_test_shared("models/rand-llama-lora-a1"));
    size_t len = 0;
    char *text = mu_read_file(path, &len);
    if (!text)
        return 0;
    cJSON *config = cJSON_ParseWithLength(text, len);
    free(text);
    if (!config)
        return 0;
    if (edit)
        edit(config);
    char *out = cJSON_Print(config);
    cJSON_Delete(config);
    snprintf(path, sizeof path, "%s/adapter_config.json", dir);
    int ok = out && mu_write_file(path, out, strlen(out)) == 0;
    free(out);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", exl_test_shared("models/rand-llama-lora-a1"));
    exl_st_file *f = NULL;
    exl_st_writer *w = NULL;
    ok = ok && exl_st_open(path, &f) == EXL_OK && exl_st_writer_init(&w) == EXL_OK;
    float *copies[64];
    int n_copies = 0;
    for (int i = 0; ok && i < f->n_tensors; i++) {
        const exl_st_tensor *t = &f->tensors[i];
        const void *data = t->data;
        if (doubled && strstr(t->name, doubled) && t->dtype == EXL_DTYPE_F32 && n_copies < 64) {
            int64_t n = exl_st_numel(t);
            float *c = copies[n_copies++] = malloc((size_t)n * sizeof *c);
            for (int64_t k = 0; c && k < n; k++)
                c[k] = 2 * ((const float *)t->data)[k];
            data = c;
        }
        ok = (drop && !strcmp(t->name, drop)) ||
             (data && exl_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, data) == EXL_OK);
    }
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    ok = ok && exl_st_writer_write(w, path) == EXL_OK;
    exl_st_writer_free(w);
    exl_st_close(f);
    for (int i = 0; i < n_copies; i++)
        free(copies[i]);
    return ok;
}

static int derive_adapter(const char *dir, config_edit edit, const char *drop) {
    return derive_adapter_x(dir, edit, drop, NULL);
}

/* loading dir onto m fails with a one-line message holding each of the words */
static void expect_error(exl_model *m, const char *dir, const char *const *words, int n_words, int line) {
    exl_lora *lo = NULL;
    exl_status st = exl_lora_load(m, dir, &lo);
    const char *msg = exl_last_error();
    int ok = st != EXL_OK && !lo && !strchr(msg, '\n');
    for (int i = 0; i < n_words; i++)
        ok &= strstr(msg, words[i]) != NULL;
    if (!ok)
        exl_test_failed(__FILE__, line, "adapter %s: status %s, message \"%s\"", dir, exl_status_str(st), msg);
    exl_lora_free(lo);
}

#define EXPECT_ERROR(m, dir, ...)                                                            \
    do {                                                                                     \
        const char *const words_[] = {__VA_ARGS__};                                          \
        expect_error((m), (dir), words_, (int)(sizeof words_ / sizeof words_[0]), __LINE__); \
    } while (0)

static void unknown_target(cJSON *c) {
    cJSON_AddItemToArray(cJSON_GetObjectItem(c, "target_modules"), cJSON_CreateString("w_pack"));
}
static void save_head(cJSON *c) {
    cJSON_ReplaceItemInObject(c, "modules_to_save", cJSON_CreateStringArray((const char *[]){"lm_head"}, 1));
}
static void no_mapping(cJSON *c) { cJSON_DeleteItemFromObject(c, "auto_mapping"); }
static void dora(cJSON *c) { cJSON_ReplaceItemInObject(c, "use_dora", cJSON_CreateTrue()); }
static void wrong_rank(cJSON *c) {
    cJSON *p = cJSON_CreateObject();
    cJSON_AddNumberToObject(p, "k_proj", 4);
    cJSON_ReplaceItemInObject(c, "rank_pattern", p);
}

EXL_TEST(lora_bad_adapters_are_one_line_errors) {
    exl_model *m = load_cpu("rand-llama");
    REQUIRE(m);
    const char *tmp = exl_test_tmpdir();
    char dir[4096];
    const char *v_b = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight";

    snprintf(dir, sizeof dir, "%s/missing", tmp);
    REQUIRE(mkdir(dir, 0755) == 0 && derive_adapter(dir, NULL, v_b));
    EXPECT_ERROR(m, dir, dir, "missing tensor", v_b);

    snprintf(dir, sizeof dir, "%s/unknown", tmp);
    REQUIRE(mkdir(dir, 0755) == 0 && derive_adapter(dir, unknown_target, NULL));
    EXPECT_ERROR(m, dir, dir, "target module \"w_pack\"");

    snprintf(dir, sizeof dir, "%s/save", tmp);
    REQUIRE(mkdir(dir, 0755) == 0 && derive_adapter(dir, save_head, NULL));
    EXPECT_ERROR(m, dir, dir, "modules_to_save", "lm_head");

    snprintf(dir, sizeof dir, "%s/dora", tmp);
    REQUIRE(mkdir(dir, 0755) == 0 && derive_adapter(dir, dora, NULL));
    EXPECT_ERROR(m, dir, dir, "DoRA");

    snprintf(dir, sizeof dir, "%s/rank", tmp);
    REQUIRE(mkdir(dir, 0755) == 0 && derive_adapter(dir, wrong_rank, NULL));
    EXPECT_ERROR(m, dir, dir, "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight", "config's 4");

    snprintf(dir, sizeof dir, "%s/unmapped", tmp);
    REQUIRE(mkdir(dir, 0755) == 0 && derive_adapter(dir, no_mapping, NULL));
    exl_model_free(m);

    /* another architecture: told by the config, or by the tensors where it says nothing */
    m = load_cpu("rand-qwen2");
    REQUIRE(m);
    EXPECT_ERROR(m, exl_test_shared("models/rand-llama-lora-a1"), "rand-llama-lora-a1", "LlamaForCausalLM",
                 "Qwen2ForCausalLM");
    exl_model_free(m);
    m = load_cpu("rand-phi3");
    REQUIRE(m);
    EXPECT_ERROR(m, dir, dir, "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight",
                 "no projection model.layers.0.self_attn.k_proj");
    exl_model_free(m);
    /* another hidden size (TinyStories is a Llama of 128) */
    m = load_cpu("tinystories-656k");
    REQUIRE(m);
    EXPECT_ERROR(m, exl_test_shared("models/rand-llama-lora-a1"), "rand-llama-lora-a1",
                 "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", "[8, 256]", "128 input features");
    exl_model_free(m);
}

/* a model split over ranks (--tp, --gpu-split) refuses adapters: one line naming the adapter and the option */
EXL_TEST(lora_refused_on_split_models) {
    for (int split = 0; split < 2; split++) {
        exl_model_params p = exl_model_default_params();
        p.device = EXL_DEVICE_CPU, p.n_threads = 2;
        if (split)
            p.gpu_split[0] = p.gpu_split[1] = 1;
        else
            p.tp = 2;
        exl_model *m = NULL;
        REQUIRE(exl_model_load(exl_test_shared("models/rand-llama"), &p, &m) == EXL_OK);
        EXPECT_ERROR(m, exl_test_shared("models/rand-llama-lora-a1"), "rand-llama-lora-a1",
                     split ? "--gpu-split" : "--tp");
        exl_model_free(m);
    }
}

/* ---- per-job adapters in the generator */

/* greedy jobs for the four sets over one prompt, all at once (one step carries the four), equal to each run
 * alone with the set as the model's; a later job of another set finds no pages of the prompt cached */
EXL_TEST(lora_generator_jobs_with_different_adapters) {
    exl_tokenizer *tok = NULL;
    exl_model *m = gu_load("rand-llama", &tok);
    REQUIRE(m && tok);
    exl_lora *a1 = load_adapter(m, "rand-llama-lora-a1"), *a2 = load_adapter(m, "rand-llama-lora-a2");
    REQUIRE(a1 && a2);
    const exl_lora_use sets[4][2] = {{{a1, 1}}, {{0}}, {{a2, 1}}, {{a1, 0.5f}, {a2, 1}}};
    const int32_t n_uses[4] = {1, 0, 1, 2};
    int32_t prompt[40];
    gu_random_ids(7, prompt, 40, m->cfg.vocab_size);
    exl_job_params jp[4];
    for (int i = 0; i < 4; i++) {
        jp[i] = exl_job_default_params();
        jp[i].ids = prompt, jp[i].n_ids = 40, jp[i].max_new_tokens = 24, jp[i].ignore_eos = 1;
        jp[i].sampling.temperature = 0;
        jp[i].lora = n_uses[i] ? sets[i] : NULL, jp[i].n_lora = n_uses[i];
    }
    gu_result *together = calloc(4, sizeof *together), *alone = calloc(1, sizeof *alone);
    REQUIRE(together && alone);
    exl_generator *g = gu_generator(m, tok, 32, 16, 0);
    REQUIRE(g);
    REQUIRE_OK(gu_run(g, jp, 4, together));
    exl_generator_free(g);
    for (int i = 0; i < 4; i++) {
        REQUIRE_OK(exl_model_set_lora(m, sets[i], n_uses[i]));
        exl_job_params solo = jp[i];
        solo.lora = NULL, solo.n_lora = 0; /* the model's set */
        g = gu_generator(m, tok, 32, 16, 0);
        REQUIRE(g);
        memset(alone, 0, sizeof *alone);
        REQUIRE_OK(gu_run(g, &solo, 1, alone));
        exl_generator_free(g);
        CHECK_MSG(alone->n_ids == together[i].n_ids &&
                      !memcmp(alone->ids, together[i].ids, (size_t)alone->n_ids * sizeof *alone->ids),
                  "set %d: batched tokens differ from its run alone", i);
    }
    REQUIRE_OK(exl_model_set_lora(m, NULL, 0));
    /* the prefix cache keeps adapters apart: base, then a1 (no hit), then a1 again (hits) */
    g = gu_generator(m, tok, 32, 16, 0);
    REQUIRE(g);
    gu_result *r = calloc(3, sizeof *r);
    REQUIRE(r);
    const exl_job_params order[3] = {jp[1], jp[0], jp[0]};
    for (int i = 0; i < 3; i++)
        REQUIRE_OK(gu_run(g, &order[i], 1, &r[i]));
    CHECK_MSG(r[1].n_cached == 0 && r[2].n_cached >= 32, "cached prompt tokens: a1 after the base %d, a1 again %d",
              r[1].n_cached, r[2].n_cached);
    CHECK(r[2].n_ids == together[0].n_ids && !memcmp(r[2].ids, together[0].ids, (size_t)r[2].n_ids * sizeof(int32_t)));
    exl_generator_free(g);
    free(r);
    free(together);
    free(alone);
    exl_model_free(m);
    exl_tokenizer_free(tok);
}

/* speculative decoding (a draft model without adapters, or n-grams): jobs of four sets give plain decoding's tokens,
 * the verify step running each job's adapters */
EXL_TEST(lora_speculative_decoding_equals_plain) {
    exl_tokenizer *tok = NULL, *dtok = NULL;
    exl_model *m = gu_load("rand-llama", &tok), *d = gu_load("rand-llama-exl2-5.0bpw-h8", &dtok);
    REQUIRE(m && tok && d && dtok);
    exl_lora *a1 = load_adapter(m, "rand-llama-lora-a1"), *a2 = load_adapter(m, "rand-llama-lora-a2");
    REQUIRE(a1 && a2);
    const exl_lora_use sets[4][2] = {{{a1, 1}}, {{0}}, {{a2, 1}}, {{a1, 0.5f}, {a2, 1}}};
    const int32_t n_uses[4] = {1, 0, 1, 2};
    int32_t prompt[4][24];
    exl_job_params jp[4];
    for (int i = 0; i < 4; i++) {
        gu_random_ids(11 + (uint64_t)i, prompt[i], 24, m->cfg.vocab_size);
        jp[i] = exl_job_default_params();
        jp[i].ids = prompt[i], jp[i].n_ids = 24, jp[i].max_new_tokens = 40, jp[i].ignore_eos = 1;
        jp[i].sampling.temperature = 0;
        jp[i].lora = n_uses[i] ? sets[i] : NULL, jp[i].n_lora = n_uses[i];
    }
    gu_result *plain = calloc(4, sizeof *plain), *spec = calloc(4, sizeof *spec);
    REQUIRE(plain && spec);
    for (int mode = 0; mode < 3; mode++) {
        exl_generator_params p = exl_generator_default_params();
        p.n_pages = 64, p.page_size = 16;
        if (mode == 1)
            p.draft_model = d, p.draft_tokens = 4;
        if (mode == 2)
            p.ngram = 2, p.draft_tokens = 4, p.draft_fixed = 1;
        exl_generator *g = NULL;
        REQUIRE_OK(exl_generator_init(m, tok, &p, &g));
        gu_result *res = mode ? spec : plain;
        memset(res, 0, 4 * sizeof *res);
        REQUIRE_OK(gu_run(g, jp, 4, res));
        exl_generator_stats st;
        exl_generator_stats_get(g, &st);
        exl_generator_free(g);
        if (!mode)
            continue;
        CHECK_MSG(st.draft_proposed > 0, "mode %d: nothing drafted", mode);
        for (int i = 0; i < 4; i++)
            CHECK_MSG(spec[i].n_ids == plain[i].n_ids &&
                          !memcmp(spec[i].ids, plain[i].ids, (size_t)plain[i].n_ids * sizeof *plain[i].ids),
                      "mode %d, set %d: speculative tokens differ from plain decoding's", mode, i);
    }
    free(plain);
    free(spec);
    exl_tokenizer_free(dtok);
    exl_model_free(d);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* ---- Phi-3's fused projections: an adapter on qkv_proj, gate_up_proj and down_proj equals its update merged into
 * the weights (in fp32) */

static float small_random(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return ((float)(*s >> 40) / 16777216.0f - 0.5f) * 0.1f;
}

static const char phi3_adapter_config[] = "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"target_modules\": "
                                          "[\"qkv_proj\", \"gate_up_proj\", \"down_proj\"], \"modules_to_save\": null}";

/* adapter_dir: a random r-4 adapter on the fused projections of rand-phi3; merged_dir: rand-phi3 with its update
 * merged (those weights in fp32) */
static int phi3_dirs(const char *adapter_dir, const char *merged_dir) {
    static const char *const mods[] = {"self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.down_proj"};
    const int r = 4;
    const float scaling = 8.0f / 4;
    char path[4096], name[256];
    snprintf(path, sizeof path, "%s/adapter_config.json", adapter_dir);
    if (mu_write_file(path, phi3_adapter_config, strlen(phi3_adapter_config)))
        return 0;
    snprintf(path, sizeof path, "%s/config.json", exl_test_shared("models/rand-phi3"));
    char cfg_dst[4096];
    snprintf(cfg_dst, sizeof cfg_dst, "%s/config.json", merged_dir);
    if (mu_copy_file(path, cfg_dst))
        return 0;
    snprintf(path, sizeof path, "%s/model.safetensors", exl_test_shared("models/rand-phi3"));
    exl_st_file *f = NULL;
    exl_st_writer *wa = NULL, *wm = NULL;
    int ok = exl_st_open(path, &f) == EXL_OK && exl_st_writer_init(&wa) == EXL_OK && exl_st_writer_init(&wm) == EXL_OK;
    float *bufs[32];
    int n_bufs = 0;
    uint64_t seed = 42;
    for (int i = 0; ok && i < f->n_tensors; i++) {
        const exl_st_tensor *t = &f->tensors[i];
        int target = -1;
        for (int k = 0; k < 3; k++)
            if (strstr(t->name, mods[k]) && strstr(t->name, ".weight"))
                target = k;
        if (target < 0 || n_bufs + 3 > 32) {
            ok = exl_st_writer_add(wm, t->name, t->dtype, t->n_dims, t->shape, t->data) == EXL_OK;
            continue;
        }
        const int64_t out = t->shape[0], in = t->shape[1];
        float *a = bufs[n_bufs++] = malloc((size_t)r * in * sizeof(float));
        float *b = bufs[n_bufs++] = malloc((size_t)out * r * sizeof(float));
        float *w = bufs[n_bufs++] = malloc((size_t)out * in * sizeof(float));
        for (int64_t k = 0; k < r * in; k++)
            a[k] = small_random(&seed);
        for (int64_t k = 0; k < out * r; k++)
            b[k] = small_random(&seed);
        for (int64_t o = 0; o < out; o++)
            for (int64_t c = 0; c < in; c++) {
                double d = 0;
                for (int j = 0; j < r; j++)
                    d += (double)b[o * r + j] * a[(int64_t)j * in + c];
                w[o * in + c] = exl_f16_to_f32(((const uint16_t *)t->data)[o * in + c]) + (float)(scaling * d);
            }
        const int64_t sa[2] = {r, in}, sb[2] = {out, r};
        size_t len = strlen(t->name) - strlen(".weight");
        snprintf(name, sizeof name, "base_model.model.%.*s.lora_A.weight", (int)len, t->name);
        ok = exl_st_writer_add(wa, name, EXL_DTYPE_F32, 2, sa, a) == EXL_OK;
        snprintf(name, sizeof name, "base_model.model.%.*s.lora_B.weight", (int)len, t->name);
        ok = ok && exl_st_writer_add(wa, name, EXL_DTYPE_F32, 2, sb, b) == EXL_OK;
        ok = ok && exl_st_writer_add(wm, t->name, EXL_DTYPE_F32, 2, t->shape, w) == EXL_OK;
    }
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", adapter_dir);
    ok = ok && exl_st_writer_write(wa, path) == EXL_OK;
    snprintf(path, sizeof path, "%s/model.safetensors", merged_dir);
    ok = ok && exl_st_writer_write(wm, path) == EXL_OK;
    exl_st_writer_free(wa);
    exl_st_writer_free(wm);
    exl_st_close(f);
    for (int i = 0; i < n_bufs; i++)
        free(bufs[i]);
    return ok;
}

/* the logits of ids (n of them) through model dir (with adapter_dir, when given) */
static float *phi3_logits(const char *dir, const char *adapter_dir, const int32_t *ids, int32_t n) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *m = NULL;
    exl_session *ses = NULL;
    exl_lora *lo = NULL;
    float *out = NULL;
    if (exl_model_load(dir, &p, &m) == EXL_OK && (!adapter_dir || exl_lora_load(m, adapter_dir, &lo) == EXL_OK)) {
        exl_lora_use use = {lo, 1};
        out = malloc((size_t)n * m->cfg.vocab_size * sizeof *out);
        if (exl_model_set_lora(m, &use, lo ? 1 : 0) != EXL_OK || exl_session_init(m, n, &ses) != EXL_OK ||
            exl_session_eval(ses, ids, n, out, NULL) != EXL_OK) {
            free(out);
            out = NULL;
        }
    }
    if (!out)
        exl_test_failed(__FILE__, __LINE__, "%s: %s", dir, exl_last_error());
    exl_session_free(ses);
    exl_model_free(m);
    return out;
}

EXL_TEST(lora_phi3_fused_projections_equal_merged_weights) {
    char adapter[1024], merged[1024];
    snprintf(adapter, sizeof adapter, "%s/adapter", exl_test_tmpdir());
    snprintf(merged, sizeof merged, "%s/merged", exl_test_tmpdir());
    REQUIRE(mkdir(adapter, 0755) == 0 && mkdir(merged, 0755) == 0 && phi3_dirs(adapter, merged));
    int32_t ids[20];
    gu_random_ids(3, ids, 20, 2048);
    float *got = phi3_logits(exl_test_shared("models/rand-phi3"), adapter, ids, 20);
    float *want = phi3_logits(merged, NULL, ids, 20);
    float *base = phi3_logits(exl_test_shared("models/rand-phi3"), NULL, ids, 20);
    REQUIRE(got && want && base);
    double worst = 0, moved = 0;
    for (int64_t k = 0; k < 20 * 2048; k++) {
        double d = fabs(got[k] - want[k]), b = fabs(base[k] - want[k]);
        worst = d > worst ? d : worst;
        moved = b > moved ? b : moved;
    }
    CHECK_MSG(worst < 1e-4 && moved > 1e-2, "adapter vs merged: %g (the update moves logits by %g)", worst, moved);
    free(got), free(want), free(base);
}

/* ---- per-module alpha and rank */

static void q_alpha_32(cJSON *c) {
    cJSON *a = cJSON_CreateObject(), *r = cJSON_CreateObject();
    cJSON_AddNumberToObject(a, "model.layers.1.self_attn.q_proj", 32);
    cJSON_AddNumberToObject(r, "q_proj", 8);
    cJSON_ReplaceItemInObject(c, "alpha_pattern", a);
    cJSON_ReplaceItemInObject(c, "rank_pattern", r);
}

/* alpha_pattern doubling layer 1's q_proj update equals B doubled there */
EXL_TEST(lora_alpha_and_rank_patterns) {
    exl_model *m = load_cpu("rand-llama");
    REQUIRE(m);
    char a[1024], b[1024];
    snprintf(a, sizeof a, "%s/pattern", exl_test_tmpdir());
    snprintf(b, sizeof b, "%s/doubled", exl_test_tmpdir());
    REQUIRE(mkdir(a, 0755) == 0 && derive_adapter_x(a, q_alpha_32, NULL, NULL));
    REQUIRE(mkdir(b, 0755) == 0 && derive_adapter_x(b, NULL, NULL, "layers.1.self_attn.q_proj.lora_B"));
    exl_lora *la, *lb;
    REQUIRE_OK(exl_lora_load(m, a, &la));
    REQUIRE_OK(exl_lora_load(m, b, &lb));
    const int32_t ids[8] = {1, 50, 99, 700, 3, 1200, 44, 8};
    float *out[3];
    const exl_lora_use uses[3] = {{la, 1}, {lb, 1}, {NULL, 0}};
    for (int i = 0; i < 3; i++) {
        exl_session *ses;
        out[i] = malloc((size_t)8 * m->cfg.vocab_size * sizeof(float));
        REQUIRE_OK(exl_model_set_lora(m, &uses[i], i < 2));
        REQUIRE_OK(exl_session_init(m, 8, &ses));
        REQUIRE_OK(exl_session_eval(ses, ids, 8, out[i], NULL));
        exl_session_free(ses);
    }
    double same = 0, moved = 0;
    for (int64_t k = 0; k < (int64_t)8 * m->cfg.vocab_size; k++) {
        same = fmax(same, fabs(out[0][k] - out[1][k]));
        moved = fmax(moved, fabs(out[0][k] - out[2][k]));
    }
    CHECK_MSG(same < 1e-4 && moved > 1e-2, "alpha_pattern vs doubled B: %g (vs the base: %g)", same, moved);
    for (int i = 0; i < 3; i++)
        free(out[i]);
    exl_model_free(m);
}
