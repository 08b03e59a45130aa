/* test_arch.c - the round-2 architectures beyond test_reference's prompt logits, on the CPU: token-by-token decode
 * (Gemma 3 past its sliding window), and the architectures without fixtures of their own, built from the fixtures'
 * tensors: Qwen2-MoE (Mixtral's experts, its shared expert silenced: Mixtral's reference logits), Gemma 2 (soft-caps,
 * alternate sliding layers), Phi-3 with longrope (short factors within the original context, long ones past it);
 * and the ops they added: soft-capped attention against a plain computation, the experts' routes. */
#include "backend/backend.h"
#include "base/half.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "model_util.h"
#include "ref_util.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1e-4

/* ---- model directories derived from a fixture */

/* A tensor's new name (written to buf) or NULL to leave it out. */
typedef const char *(*rename_fn)(const char *name, char *buf, size_t size);

typedef struct extra_tensor {
    const char *name;
    int64_t rows, cols;
    const uint16_t *f16;
} extra_tensor;

/* dir: config.json of config, and src's tensors as rename names them, plus extra ones (fp16 matrices) */
static int derive(const char *src, const char *dir, const char *config, rename_fn rename, const extra_tensor *extra,
                  int n_extra) {
    char path[4096], buf[256];
    snprintf(path, sizeof path, "%s/config.json", dir);
    if (mu_write_file(path, config, strlen(config)) != 0)
        return 0;
    snprintf(path, sizeof path, "%s/model.safetensors", exl_test_shared(src));
    exl_st_file *f;
    exl_st_writer *w;
    if (exl_st_open(path, &f) != EXL_OK)
        return 0;
    int ok = exl_st_writer_init(&w) == EXL_OK;
    for (int i = 0; ok && i < f->n_tensors; i++) {
        const exl_st_tensor *t = &f->tensors[i];
        const char *name = rename(t->name, buf, sizeof buf);
        ok = !name || exl_st_writer_add(w, name, t->dtype, t->n_dims, t->shape, t->data) == EXL_OK;
    }
    for (int i = 0; ok && i < n_extra; i++) {
        int64_t shape[2] = {extra[i].rows, extra[i].cols};
        ok = exl_st_writer_add(w, extra[i].name, EXL_DTYPE_F16, 2, shape, extra[i].f16) == EXL_OK;
    }
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    ok = ok && exl_st_writer_write(w, path) == EXL_OK;
    exl_st_writer_free(w);
    exl_st_close(f);
    return ok;
}

static exl_model *load(const char *dir) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *m = NULL;
    if (exl_model_load(dir, &p, &m) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "load %s: %s", dir, exl_last_error());
    return m;
}

/* The logits of every position of reference sequence s of ref (its ids), fed `step` tokens a forward step; NULL on
 * failure. *n: the sequence's length. */
static float *run_sequence(exl_model *m, const exl_st_file *ref, const char *s, int32_t step, int32_t *n) {
    char key[32];
    snprintf(key, sizeof key, "ids_%s", s);
    const exl_st_tensor *ids = exl_st_find(ref, key);
    exl_session *ses;
    if (!ids || exl_session_init(m, (int32_t)ids->shape[0], &ses) != EXL_OK)
        return NULL;
    *n = (int32_t)ids->shape[0];
    int32_t vocab = m->cfg.vocab_size;
    float *out = malloc((size_t)*n * vocab * sizeof *out);
    for (int32_t t = 0; out && t < *n; t += step) {
        int32_t k = *n - t < step ? *n - t : step;
        if (exl_session_eval(ses, (const int32_t *)ids->data + t, k, out + (int64_t)t * vocab, NULL) != EXL_OK) {
            free(out);
            out = NULL;
        }
    }
    exl_session_free(ses);
    return out;
}

/* The worst relative error of logits (every position of sequence s) against ref's stored positions, those below
 * split into err[0], the others into err[1]. */
static void seq_errors(const float *logits, const exl_st_file *ref, const char *s, int32_t vocab, int32_t split,
                       double err[2]) {
    char key[32];
    snprintf(key, sizeof key, "logits_%s", s);
    const exl_st_tensor *lg = exl_st_find(ref, key);
    snprintf(key, sizeof key, "pos_%s", s);
    const exl_st_tensor *pos = exl_st_find(ref, key);
    err[0] = err[1] = 0;
    for (int32_t r = 0; lg && r < (int32_t)lg->shape[0]; r++) {
        int32_t p = pos ? ((const int32_t *)pos->data)[r] : r;
        double e = ref_rel_err(logits + (int64_t)p * vocab, (const float *)lg->data + (int64_t)r * vocab, vocab);
        double *w = &err[p >= split];
        *w = e > *w ? e : *w;
    }
}

static exl_st_file *open_ref(const char *model) {
    char rel[256];
    snprintf(rel, sizeof rel, "reference/%s.logits.safetensors", model);
    exl_st_file *f = NULL;
    if (exl_st_open(exl_test_shared(rel), &f) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "%s", exl_last_error());
    return f;
}

/* ---- Gemma 3 token by token: the sliding layers' window in decode steps */

EXL_TEST(gemma3_decode_past_the_window) {
    exl_st_file *ref = open_ref("rand-gemma3");
    exl_model *m = load(exl_test_shared("models/rand-gemma3"));
    REQUIRE(ref && m);
    int32_t n;
    float *logits = run_sequence(m, ref, "b", 1, &n);
    REQUIRE(logits);
    double err[2];
    seq_errors(logits, ref, "b", m->cfg.vocab_size, 48, err);
    printf("    gemma3 decode of %d tokens: max rel err %.2e within the window, %.2e past it\n", n, err[0], err[1]);
    CHECK_MSG(n > 3 * 48 && err[0] <= TOL && err[1] <= TOL, "errors %.3e, %.3e", err[0], err[1]);
    free(logits);
    exl_model_free(m);
    exl_st_close(ref);
}

/* ---- Qwen2-MoE: Mixtral's experts and attention, with a shared expert whose down_proj is zero */

static const char *mixtral_to_qwen2_moe(const char *name, char *buf, size_t size) {
    static const char *const from[] = {".w1.", ".w3.", ".w2."}, *const to[] = {".gate_proj.", ".up_proj.",
                                                                               ".down_proj."};
    const char *moe = strstr(name, "block_sparse_moe.");
    if (!moe)
        return name;
    snprintf(buf, size, "%.*smlp.%s", (int)(moe - name), name, moe + strlen("block_sparse_moe."));
    for (int i = 0; i < 3; i++) {
        char *at = strstr(buf, from[i]);
        if (at) {
            char rest[256];
            snprintf(rest, sizeof rest, "%s", at + strlen(from[i]));
            snprintf(at, size - (size_t)(at - buf), "%s%s", to[i], rest);
        }
    }
    return buf;
}

static const char qwen2_moe_config[] =
    "{\"architectures\": [\"Qwen2MoeForCausalLM\"], \"model_type\": \"qwen2_moe\", \"hidden_size\": 256, "
    "\"intermediate_size\": 384, \"moe_intermediate_size\": 384, \"shared_expert_intermediate_size\": 128, "
    "\"num_experts\": 4, \"num_experts_per_tok\": 2, \"norm_topk_prob\": true, \"qkv_bias\": false, "
    "\"num_hidden_layers\": 2, \"num_attention_heads\": 4, \"num_key_value_heads\": 2, "
    "\"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-06, \"rope_theta\": 1000000.0, "
    "\"tie_word_embeddings\": false, \"vocab_size\": 2048, \"hidden_act\": \"silu\", \"use_sliding_window\": false, "
    "\"bos_token_id\": 1, \"eos_token_id\": 2}";

EXL_TEST(qwen2_moe_is_mixtral_with_a_silent_shared_expert) {
    const int64_t hid = 256, ffn = 128;
    uint16_t *gate = malloc(hid * ffn * 2), *up = malloc(hid * ffn * 2), *down = calloc(hid * ffn, 2);
    uint16_t sgate[256];
    for (int64_t i = 0; i < hid * ffn; i++) {
        gate[i] = exl_f32_to_f16(0.05f * sinf((float)i));
        up[i] = exl_f32_to_f16(0.05f * cosf((float)i));
    }
    for (int i = 0; i < hid; i++)
        sgate[i] = exl_f32_to_f16(0.1f * sinf(3.0f * (float)i));
    char names[2][4][96];
    extra_tensor extra[8];
    for (int l = 0; l < 2; l++) {
        static const char *const parts[] = {"shared_expert.gate_proj", "shared_expert.up_proj",
                                            "shared_expert.down_proj", "shared_expert_gate"};
        const int64_t rows[4] = {ffn, ffn, hid, 1}, cols[4] = {hid, hid, ffn, hid};
        const uint16_t *data[4] = {gate, up, down, sgate};
        for (int j = 0; j < 4; j++) {
            snprintf(names[l][j], sizeof names[l][j], "model.layers.%d.mlp.%s.weight", l, parts[j]);
            extra[4 * l + j] = (extra_tensor){names[l][j], rows[j], cols[j], data[j]};
        }
    }
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    REQUIRE(derive("models/rand-mixtral", dir, qwen2_moe_config, mixtral_to_qwen2_moe, extra, 8));
    free(gate), free(up), free(down);
    exl_model *m = load(dir);
    REQUIRE(m);
    CHECK(m->cfg.arch == EXL_ARCH_QWEN2_MOE && m->layers[1].shared_gate && m->layers[0].shared.down);
    exl_model_free(m);
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    int mism, npos;
    double e = ref_compare_model(dir, exl_test_shared("reference/rand-mixtral.logits.safetensors"), "logits", &p, &mism,
                                 &npos);
    printf("    qwen2_moe (mixtral's weights) %d positions  max rel err %.2e\n", npos, e);
    CHECK_MSG(e >= 0 && e <= TOL && npos > 0, "max relative error %.3e", e);
}

/* ---- Gemma 2: Gemma 3's weights without the q/k norms, soft-capped */

static const char *drop_qk_norms(const char *name, char *buf, size_t size) {
    return strstr(name, "q_norm") || strstr(name, "k_norm") ? NULL : name;
}

/* a Gemma 2 model from rand-gemma3 with these soft-caps ("null": none) in a new directory; NULL on failure */
static exl_model *gemma2(const char *attn_cap, const char *final_cap) {
    char config[2048], dir[1024];
    snprintf(config, sizeof config,
             "{\"architectures\": [\"Gemma2ForCausalLM\"], \"model_type\": \"gemma2\", \"hidden_size\": 256, "
             "\"intermediate_size\": 768, \"num_hidden_layers\": 4, \"num_attention_heads\": 4, "
             "\"num_key_value_heads\": 1, \"head_dim\": 64, \"vocab_size\": 2048, \"rms_norm_eps\": 1e-06, "
             "\"query_pre_attn_scalar\": 64, \"sliding_window\": 48, \"hidden_activation\": \"gelu_pytorch_tanh\", "
             "\"rope_theta\": 10000.0, \"max_position_embeddings\": 4096, \"tie_word_embeddings\": true, "
             "\"attn_logit_softcapping\": %s, \"final_logit_softcapping\": %s, \"bos_token_id\": 1, "
             "\"eos_token_id\": 2}",
             attn_cap, final_cap);
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    if (!derive("models/rand-gemma3", dir, config, drop_qk_norms, NULL, 0)) {
        exl_test_failed(__FILE__, __LINE__, "cannot write %s", dir);
        return NULL;
    }
    return load(dir);
}

/* the logits of sequence b of rand-gemma3's reference (its ids) through a Gemma 2 model of these caps */
static float *gemma2_logits(const exl_st_file *ref, const char *attn_cap, const char *final_cap, int32_t *n) {
    exl_model *m = gemma2(attn_cap, final_cap);
    float *out = m ? run_sequence(m, ref, "b", 512, n) : NULL;
    exl_model_free(m);
    return out;
}

static double max_diff(const float *a, const float *b, int64_t n, double *scale) {
    double d = 0;
    *scale = 0;
    for (int64_t i = 0; i < n; i++) {
        d = fabs((double)a[i] - b[i]) > d ? fabs((double)a[i] - b[i]) : d;
        *scale = fabs((double)b[i]) > *scale ? fabs((double)b[i]) : *scale;
    }
    return d;
}

EXL_TEST(gemma2_soft_caps_and_alternate_windows) {
    exl_model *m = gemma2("50.0", "30.0");
    REQUIRE(m);
    for (int32_t i = 0; i < 4; i++)
        CHECK(m->cfg.layers[i].sliding == (i % 2 == 0) && m->cfg.layers[i].sliding_window == (i % 2 == 0) * 48);
    CHECK(!m->layers[0].q_norm && m->layers[0].post_attn_norm && m->layers[3].post_mlp_norm);
    CHECK(m->fs.rope[1].inv_freq == NULL); /* one rope for all layers */
    exl_model_free(m);

    exl_st_file *ref = open_ref("rand-gemma3");
    REQUIRE(ref);
    int32_t n = 0;
    float *none = gemma2_logits(ref, "null", "null", &n), *huge = gemma2_logits(ref, "1e6", "null", &n);
    float *capped = gemma2_logits(ref, "0.5", "null", &n), *final = gemma2_logits(ref, "null", "2.0", &n);
    REQUIRE(none && huge && capped && final);
    const int64_t total = (int64_t)n * 2048;
    /* a cap far above every score changes nothing; one below them changes the attention */
    double scale, d = max_diff(huge, none, total, &scale);
    CHECK_MSG(d <= 1e-5 * scale, "attention capped at 1e6: logits moved by %.3e (of %.3e)", d, scale);
    d = max_diff(capped, none, total, &scale);
    CHECK_MSG(d >= 1e-2 * scale, "attention capped at 0.5: logits moved by only %.3e (of %.3e)", d, scale);
    /* the final cap is 2 tanh(logits / 2) of the uncapped logits */
    for (int64_t i = 0; i < total; i++)
        none[i] = 2.0f * tanhf(none[i] / 2.0f);
    d = max_diff(final, none, total, &scale);
    CHECK_MSG(d <= 1e-6 && scale < 2.0, "final cap: off by %.3e, largest %.3f", d, scale);
    free(none), free(huge), free(capped), free(final);
    exl_st_close(ref);
}

/* ---- Phi-3 with longrope: the original context 100, short factors 1 (the default rope), long ones `long_f` */

static const char *keep(const char *name, char *buf, size_t size) { return name; }

static exl_model *phi3_longrope(float long_f) {
    char config[4096], shorts[256] = "", longs[256] = "", dir[1024];
    for (int i = 0; i < 24; i++) { /* rot_dim 48 / 2 */
        snprintf(shorts + strlen(shorts), sizeof shorts - strlen(shorts), "%s1.0", i ? ", " : "");
        snprintf(longs + strlen(longs), sizeof longs - strlen(longs), "%s%.1f", i ? ", " : "", long_f);
    }
    snprintf(config, sizeof config,
             "{\"architectures\": [\"Phi3ForCausalLM\"], \"model_type\": \"phi3\", \"hidden_size\": 256, "
             "\"intermediate_size\": 768, \"num_hidden_layers\": 2, \"num_attention_heads\": 4, "
             "\"num_key_value_heads\": 2, \"max_position_embeddings\": 4096, "
             "\"original_max_position_embeddings\": 100, \"partial_rotary_factor\": 0.75, \"rms_norm_eps\": 1e-06, "
             "\"rope_theta\": 10000.0, \"hidden_act\": \"silu\", \"tie_word_embeddings\": false, "
             "\"vocab_size\": 2048, \"sliding_window\": null, \"bos_token_id\": 1, \"eos_token_id\": 2, "
             "\"rope_scaling\": {\"type\": \"longrope\", \"short_factor\": [%s], \"long_factor\": [%s], "
             "\"attention_factor\": 1.0}}",
             shorts, longs);
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    if (!derive("models/rand-phi3", dir, config, keep, NULL, 0)) {
        exl_test_failed(__FILE__, __LINE__, "cannot write %s", dir);
        return NULL;
    }
    return load(dir);
}

EXL_TEST(phi3_longrope_switches_past_the_original_context) {
    exl_st_file *ref = open_ref("rand-phi3");
    REQUIRE(ref);
    /* long factors of 1 too: the default rope at every length, the reference's logits */
    exl_model *m = phi3_longrope(1.0f);
    REQUIRE(m);
    CHECK(m->cfg.rope.type == EXL_ROPE_LONGROPE);
    int32_t n;
    double err[2];
    float *logits = run_sequence(m, ref, "b", 512, &n);
    REQUIRE(logits);
    seq_errors(logits, ref, "b", m->cfg.vocab_size, n, err);
    CHECK_MSG(err[0] <= TOL, "longrope of factors 1: %.3e", err[0]);
    free(logits);
    exl_model_free(m);
    /* long factors of 2, token by token: the reference's logits up to position 99 (short factors), others past
     * it, where the long factors take over */
    REQUIRE((m = phi3_longrope(2.0f)));
    REQUIRE((logits = run_sequence(m, ref, "b", 1, &n)));
    seq_errors(logits, ref, "b", m->cfg.vocab_size, 100, err);
    printf("    phi3 longrope decode: max rel err %.2e within the original context, %.2e past it\n", err[0], err[1]);
    CHECK_MSG(n > 100 && err[0] <= TOL && err[1] >= 1e-2, "errors %.3e, %.3e", err[0], err[1]);
    free(logits);
    exl_model_free(m);
    exl_st_close(ref);
}

/* ---- the ops: soft-capped attention, routes */

EXL_TEST(softcapped_attention_with_a_window) {
    enum { N = 20, HEADS = 2, HD = 8, PAGE = 32, WINDOW = 7 };
    const float scale = 0.35f, cap = 1.5f;
    exl_backend *be;
    REQUIRE_OK(exl_backend_cpu_init(1, &be));
    float q[N * HEADS * HD], k[N * HD], v[N * HD], out[N * HEADS * HD];
    float *kc = calloc(PAGE * HD, sizeof(float)), *vc = calloc(PAGE * HD, sizeof(float));
    for (int i = 0; i < N * HEADS * HD; i++)
        q[i] = 3.0f * sinf(0.7f * (float)i);
    for (int i = 0; i < N * HD; i++)
        k[i] = 2.0f * cosf(1.3f * (float)i), v[i] = sinf(0.3f * (float)i + 1.0f);
    int32_t pos[N], page = 0;
    for (int i = 0; i < N; i++)
        pos[i] = i;
    exl_attn_seq seq = {0, N, N, 0};
    exl_batch b = {N, 1, N, N, &seq, pos, pos, &seq, NULL, pos, pos, &page};
    exl_attn_shape sh = {HEADS, 1, HD, PAGE, WINDOW, scale, cap};
    be->ops->kv_store(be, kc, vc, k, v, &b, HD);
    be->ops->attention(be, out, q, k, v, kc, vc, &b, &sh);
    double worst = 0;
    for (int t = 0; t < N; t++)
        for (int h = 0; h < HEADS; h++) {
            double s[N], mx = -INFINITY, sum = 0, want[HD] = {0};
            int first = t - WINDOW + 1 > 0 ? t - WINDOW + 1 : 0;
            for (int j = first; j <= t; j++) {
                double d = 0;
                for (int i = 0; i < HD; i++)
                    d += (double)q[(t * HEADS + h) * HD + i] * k[j * HD + i];
                s[j] = cap * tanh(d * scale / cap);
                mx = s[j] > mx ? s[j] : mx;
            }
            for (int j = first; j <= t; j++)
                sum += exp(s[j] - mx);
            for (int j = first; j <= t; j++)
                for (int i = 0; i < HD; i++)
                    want[i] += exp(s[j] - mx) / sum * v[j * HD + i];
            for (int i = 0; i < HD; i++) {
                double e = fabs(want[i] - out[(t * HEADS + h) * HD + i]);
                worst = e > worst ? e : worst;
            }
        }
    CHECK_MSG(worst <= 1e-5, "soft-capped attention off by %.3e", worst);
    free(kc), free(vc);
    be->ops->destroy(be);
}

EXL_TEST(moe_routes) {
    exl_backend *be;
    REQUIRE_OK(exl_backend_cpu_init(1, &be));
    /* row 0: a tie between experts 1 and 3 (the lower id first); row 1: a NaN, never chosen */
    float logits[2][5] = {{0.5f, 2.0f, -1.0f, 2.0f, 1.0f}, {NAN, -3.0f, 0.0f, -1.0f, 4.0f}};
    float w[2][3];
    int32_t ids[2][3];
    for (int renorm = 0; renorm < 2; renorm++) {
        exl_moe_route_node r = {&w[0][0], &ids[0][0], &logits[0][0], 2, 5, 3, renorm};
        be->ops->moe_route(be, &r);
        CHECK(ids[0][0] == 1 && ids[0][1] == 3 && ids[0][2] == 4);
        CHECK(ids[1][0] == 4 && ids[1][1] == 2 && ids[1][2] == 3);
        double sum = 0, chosen = 0;
        for (int e = 0; e < 5; e++)
            sum += exp(logits[0][e]);
        for (int j = 0; j < 3; j++)
            chosen += exp(logits[0][ids[0][j]]);
        for (int j = 0; j < 3; j++) {
            double want = exp(logits[0][ids[0][j]]) / (renorm ? chosen : sum);
            CHECK_MSG(fabs(w[0][j] - want) <= 1e-6, "renormalize %d: weight %d = %g, want %g", renorm, j, w[0][j],
                      want);
        }
    }
    be->ops->destroy(be);
}
