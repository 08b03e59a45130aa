/* test_model_load.c - loading real and broken model directories, and the KV cache.
 * Tolerances: decoding token by token vs one full pass <= 1e-5 relative L2 per
 * position; bf16 model vs its fp32 conversion <= 1e-6; sharded vs single file exact. */
#include "model_util.h"
#include "ref_util.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static exl_model *load_cpu(const char *dir) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *m = NULL;
    if (exl_model_load(dir, &p, &m) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "load %s: %s", dir, exl_last_error());
    return m;
}

/* Logits of every position of ids, one pass. */
static float *full_logits(exl_model *m, const int32_t *ids, int32_t n) {
    exl_model_desc d;
    exl_model_describe(m, &d);
    float *out = malloc((size_t)n * d.vocab_size * sizeof *out);
    exl_session *s;
    if (exl_session_init(m, n, &s) != EXL_OK || exl_session_eval(s, ids, n, out, NULL) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "eval: %s", exl_last_error());
        free(out);
        return NULL;
    }
    exl_session_free(s);
    return out;
}

static const int32_t test_ids[] = {1,   80,  147, 201, 282,  57, 313,  598, 303, 1049, 1468, 267, 628, 333, 94,  1210,
                                   263, 251, 604, 94,  1030, 94, 1030, 94,  436, 220,  1053, 615, 303, 328, 552, 319};
#define N_TEST_IDS ((int32_t)(sizeof test_ids / sizeof test_ids[0]))

static void check_incremental(const char *model) {
    exl_model *m = load_cpu(exl_test_shared(model));
    REQUIRE(m);
    exl_model_desc d;
    exl_model_describe(m, &d);
    float *full = full_logits(m, test_ids, N_TEST_IDS);
    REQUIRE(full);
    exl_session *s;
    REQUIRE_OK(exl_session_init(m, N_TEST_IDS, &s));
    float *step = malloc((size_t)d.vocab_size * sizeof *step);
    double worst = 0;
    /* first a 3-token chunk, then one token at a time */
    REQUIRE_OK(exl_session_eval(s, test_ids, 3, NULL, step));
    worst = ref_rel_err(step, full + 2 * (int64_t)d.vocab_size, d.vocab_size);
    for (int32_t i = 3; i < N_TEST_IDS; i++) {
        REQUIRE_OK(exl_session_eval(s, test_ids + i, 1, NULL, step));
        double e = ref_rel_err(step, full + (int64_t)i * d.vocab_size, d.vocab_size);
        if (e > worst)
            worst = e;
    }
    printf("    %s: token-by-token vs full pass, max rel err %.2e\n", model, worst);
    CHECK_MSG(worst <= 1e-5, "incremental decoding differs: %.3e", worst);
    CHECK(exl_session_length(s) == N_TEST_IDS);
    CHECK(exl_session_eval(s, test_ids, 1, NULL, step) == EXL_ERR_ARG); /* full */
    exl_session_free(s);
    free(step);
    free(full);
    exl_model_free(m);
}

EXL_TEST(incremental_matches_full_llama) { check_incremental("models/rand-llama"); }
EXL_TEST(incremental_matches_full_gemma) { check_incremental("models/rand-gemma"); }
EXL_TEST(incremental_matches_full_tinystories) { check_incremental("models/tinystories-656k"); }

EXL_TEST(bf16_matches_fp32_conversion_and_shards) {
    char bf[4096], f32[4096], sh[4096];
    snprintf(bf, sizeof bf, "%s", exl_test_tmpdir());
    snprintf(f32, sizeof f32, "%s", exl_test_tmpdir());
    snprintf(sh, sizeof sh, "%s", exl_test_tmpdir());
    char src[4096];
    snprintf(src, sizeof src, "%s", exl_test_shared("models/rand-qwen2"));
    REQUIRE_OK(mu_convert_model(src, bf, EXL_DTYPE_BF16, 1));
    /* the fp32 model is the exact widening of the bf16 one */
    REQUIRE_OK(mu_convert_model(bf, f32, EXL_DTYPE_F32, 1));
    REQUIRE_OK(mu_convert_model(bf, sh, EXL_DTYPE_BF16, 3));
    exl_model *mb = load_cpu(bf), *mf = load_cpu(f32), *ms = load_cpu(sh);
    REQUIRE(mb && mf && ms);
    exl_model_desc d;
    exl_model_describe(mb, &d);
    float *lb = full_logits(mb, test_ids, 12), *lf = full_logits(mf, test_ids, 12), *ls = full_logits(ms, test_ids, 12);
    REQUIRE(lb && lf && ls);
    double e = ref_rel_err(lb, lf, 12 * (int64_t)d.vocab_size);
    printf("    bf16 vs fp32 conversion: rel err %.2e\n", e);
    CHECK_MSG(e <= 1e-6, "bf16 model differs from its fp32 conversion: %.3e", e);
    CHECK_MSG(!memcmp(lb, ls, 12 * (size_t)d.vocab_size * sizeof(float)), "sharded model differs");
    free(lb);
    free(lf);
    free(ls);
    exl_model_free(mb);
    exl_model_free(mf);
    exl_model_free(ms);
}

/* ---- tensors at addresses their type may not be read from in place: a header whose length
 * is not a multiple of 8 (legal, if unusual) puts every tensor 3 bytes off; the model must
 * load and compute exactly what the original does */

static void check_misaligned(const char *model, const char *st_name) {
    char dir[1024], a[4096], b[4096];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    snprintf(a, sizeof a, "%s/config.json", exl_test_shared(model));
    snprintf(b, sizeof b, "%s/config.json", dir);
    REQUIRE(mu_copy_file(a, b) == 0);
    snprintf(a, sizeof a, "%s/%s", exl_test_shared(model), st_name);
    size_t n;
    unsigned char *buf = (unsigned char *)mu_read_file(a, &n);
    REQUIRE(buf && n > 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    unsigned char *out = malloc(n + 3);
    for (int i = 0; i < 8; i++)
        out[i] = (unsigned char)((hlen + 3) >> (8 * i));
    memcpy(out + 8, buf + 8, hlen);
    memcpy(out + 8 + hlen, "   ", 3);
    memcpy(out + 8 + hlen + 3, buf + 8 + hlen, n - 8 - hlen);
    snprintf(b, sizeof b, "%s/%s", dir, st_name);
    CHECK(mu_write_file(b, out, n + 3) == 0);
    free(out);
    free(buf);
    exl_model *orig = load_cpu(exl_test_shared(model)), *moved = load_cpu(dir);
    REQUIRE(orig && moved);
    exl_model_desc d;
    exl_model_describe(orig, &d);
    float *lo = full_logits(orig, test_ids, 8), *lm = full_logits(moved, test_ids, 8);
    REQUIRE(lo && lm);
    CHECK_MSG(!memcmp(lo, lm, 8 * (size_t)d.vocab_size * sizeof(float)), "%s: misaligned copy computes otherwise",
              model);
    free(lo);
    free(lm);
    exl_model_free(orig);
    exl_model_free(moved);
}

EXL_TEST(misaligned_tensors_fp16) { check_misaligned("models/rand-llama", "model.safetensors"); }
EXL_TEST(misaligned_tensors_exl2) { check_misaligned("models/rand-llama-exl2-3.0bpw-h6", "output.safetensors"); }

/* ---- broken model directories: each must fail with a clear message */

static char broken_dir[1024];

/* A fresh copy of rand-llama (config + weights) to break. */
static void make_copy(void) {
    snprintf(broken_dir, sizeof broken_dir, "%s", exl_test_tmpdir());
    char a[4096], b[4096];
    snprintf(a, sizeof a, "%s", exl_test_shared("models/rand-llama/config.json"));
    snprintf(b, sizeof b, "%s/config.json", broken_dir);
    mu_copy_file(a, b);
    snprintf(a, sizeof a, "%s", exl_test_shared("models/rand-llama/model.safetensors"));
    snprintf(b, sizeof b, "%s/model.safetensors", broken_dir);
    mu_copy_file(a, b);
}

static void expect_error(exl_status want, const char *needle1, const char *needle2) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *m = NULL;
    exl_status st = exl_model_load(broken_dir, &p, &m);
    const char *msg = exl_last_error();
    CHECK_MSG(st == want, "status %s, wanted %s (%s)", exl_status_str(st), exl_status_str(want), msg);
    CHECK(m == NULL);
    CHECK_MSG(strstr(msg, needle1) != NULL, "message '%s' lacks '%s'", msg, needle1);
    if (needle2)
        CHECK_MSG(strstr(msg, needle2) != NULL, "message '%s' lacks '%s'", msg, needle2);
    CHECK_MSG(!strchr(msg, '\n'), "message is not one line: %s", msg);
    exl_model_free(m);
}

static void edit_config(const char *from, const char *to) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", broken_dir);
    char *text = mu_read_file(path, NULL);
    char *at = strstr(text, from);
    if (!at) {
        exl_test_failed(__FILE__, __LINE__, "config has no '%s'", from);
        free(text);
        return;
    }
    size_t n = strlen(text) - strlen(from) + strlen(to);
    char *out = malloc(n + 1);
    size_t pre = (size_t)(at - text);
    memcpy(out, text, pre);
    strcpy(out + pre, to);
    strcat(out, at + strlen(from));
    mu_write_file(path, out, strlen(out));
    free(out);
    free(text);
}

/* Rewrite the safetensors header: replace `from` by `to` (same file otherwise). */
static void edit_header(const char *from, const char *to) {
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", broken_dir);
    size_t n;
    unsigned char *buf = (unsigned char *)mu_read_file(path, &n);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    char *hdr = malloc(hlen + 1);
    memcpy(hdr, buf + 8, hlen);
    hdr[hlen] = 0;
    char *at = strstr(hdr, from);
    if (!at) {
        exl_test_failed(__FILE__, __LINE__, "header has no '%s'", from);
        free(hdr);
        free(buf);
        return;
    }
    /* keep the header length: pad the replacement or the rest with spaces */
    size_t lf = strlen(from), lt = strlen(to);
    char *nh = calloc(hlen + lt + 1, 1);
    memcpy(nh, hdr, (size_t)(at - hdr));
    memcpy(nh + (at - hdr), to, lt);
    strcpy(nh + (at - hdr) + lt, at + lf);
    size_t nlen = strlen(nh);
    while (nlen < hlen)
        nh[nlen++] = ' ';
    unsigned char *out = malloc(8 + nlen + (n - 8 - hlen));
    for (int i = 0; i < 8; i++)
        out[i] = (unsigned char)((uint64_t)nlen >> (8 * i));
    memcpy(out + 8, nh, nlen);
    memcpy(out + 8 + nlen, buf + 8 + hlen, n - 8 - hlen);
    mu_write_file(path, out, 8 + nlen + (n - 8 - hlen));
    free(out);
    free(nh);
    free(hdr);
    free(buf);
}

EXL_TEST(missing_directory_and_files) {
    snprintf(broken_dir, sizeof broken_dir, "%s/nonexistent", exl_test_tmpdir());
    expect_error(EXL_ERR_IO, "config.json", "cannot open");
    make_copy();
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", broken_dir);
    remove(path);
    expect_error(EXL_ERR_IO, broken_dir, "no model.safetensors");
}

EXL_TEST(truncated_weights) {
    make_copy();
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", broken_dir);
    size_t n;
    char *buf = mu_read_file(path, &n);
    mu_write_file(path, buf, n - 1000);
    free(buf);
    expect_error(EXL_ERR_FORMAT, "model.safetensors", "truncated");
    mu_write_file(path, "abc", 3);
    expect_error(EXL_ERR_FORMAT, "model.safetensors", "too short");
}

EXL_TEST(header_length_beyond_file) {
    make_copy();
    char path[4096];
    snprintf(path, sizeof path, "%s/model.safetensors", broken_dir);
    size_t n;
    unsigned char *buf = (unsigned char *)mu_read_file(path, &n);
    buf[5] = 0x7f; /* a header length of terabytes */
    mu_write_file(path, buf, n);
    free(buf);
    expect_error(EXL_ERR_FORMAT, "model.safetensors", "header length");
}

EXL_TEST(bad_header_json) {
    make_copy();
    edit_header("\"dtype\"", "\"dtype\"}}}");
    expect_error(EXL_ERR_FORMAT, "model.safetensors", "not a valid JSON");
}

EXL_TEST(offsets_outside_data) {
    make_copy();
    edit_header("\"data_offsets\":[0,", "\"data_offsets\":[99999990,");
    expect_error(EXL_ERR_FORMAT, "model.safetensors", "data_offsets");
}

EXL_TEST(dtype_shape_mismatch) {
    make_copy();
    /* a dtype whose size disagrees with the byte range */
    edit_header("\"F16\"", "\"F32\"");
    expect_error(EXL_ERR_FORMAT, "model.safetensors", "data_offsets span");
    /* an unknown dtype */
    make_copy();
    edit_header("\"F16\"", "\"Q4\"");
    expect_error(EXL_ERR_FORMAT, "model.safetensors", "unknown dtype");
    /* a tensor with the wrong shape for the config */
    make_copy();
    edit_config("\"intermediate_size\": 768", "\"intermediate_size\": 512");
    expect_error(EXL_ERR_FORMAT, "mlp", "expected [512, 256]");
    /* a valid tensor of a dtype a weight cannot have */
    make_copy();
    edit_header("\"model.norm.weight\":{\"dtype\":\"F16\",\"shape\":[256]",
                "\"model.norm.weight\":{\"dtype\":\"I16\",\"shape\":[256]");
    expect_error(EXL_ERR_FORMAT, "model.norm.weight", "dtype I16");
}

EXL_TEST(missing_tensor) {
    make_copy();
    edit_header("\"lm_head.weight\"", "\"lm_head.weightX\"");
    expect_error(EXL_ERR_FORMAT, "lm_head.weight", "missing tensor");
}

EXL_TEST(unknown_architecture) {
    make_copy();
    edit_config("\"model_type\": \"llama\"", "\"model_type\": \"mamba\"");
    expect_error(EXL_ERR_UNSUPPORTED, "config.json", "unsupported architecture 'mamba'");
}

EXL_TEST(unsupported_rope_type) {
    make_copy();
    edit_config("\"rope_theta\": 10000.0,", "\"rope_theta\": 10000.0, \"rope_scaling\": {\"rope_type\": \"mrope\", "
                                            "\"factor\": 2.0},");
    expect_error(EXL_ERR_UNSUPPORTED, "config.json",
                 "\"rope_scaling.rope_type\" = 'mrope' is an unsupported rope type");
}

EXL_TEST(bad_config_values) {
    make_copy();
    edit_config("\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3");
    expect_error(EXL_ERR_FORMAT, "config.json", "not a multiple");
    make_copy();
    edit_config("\"hidden_size\": 256", "\"hidden_size\": \"256\"");
    expect_error(EXL_ERR_FORMAT, "config.json", "\"hidden_size\" must be an integer");
    make_copy();
    edit_config("\"vocab_size\": 2048,", "\"vocab_size\": 2048,,");
    expect_error(EXL_ERR_FORMAT, "config.json", "invalid JSON near line 2");
}

EXL_TEST(rope_parameters_form) {
    /* transformers v5 writes rope_parameters instead of rope_theta + rope_scaling */
    snprintf(broken_dir, sizeof broken_dir, "%s", exl_test_tmpdir());
    char a[4096], b[4096];
    snprintf(a, sizeof a, "%s", exl_test_shared("models/rand-yarn/model.safetensors"));
    snprintf(b, sizeof b, "%s/model.safetensors", broken_dir);
    REQUIRE(!mu_copy_file(a, b));
    snprintf(a, sizeof a, "%s", exl_test_shared("models/rand-yarn/config.json"));
    snprintf(b, sizeof b, "%s/config.json", broken_dir);
    REQUIRE(!mu_copy_file(a, b));
    edit_config("\"rope_scaling\"", "\"rope_parameters\"");
    edit_config("\"rope_theta\": 10000.0,\n \"tie", "\n \"tie");
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    int mism, npos;
    double e = ref_compare_model(broken_dir, exl_test_shared("reference/rand-yarn.logits.safetensors"), "logits", &p,
                                 &mism, &npos);
    CHECK_MSG(e >= 0 && e <= 1e-4, "rope_parameters form: rel err %.3e", e);
}
