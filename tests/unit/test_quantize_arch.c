/* test_quantize_arch.c - EXL2 quantization of fused linears and of experts, as ExLlamaV2's converter writes them:
 *
 *   - rand-phi3 (fused qkv_proj, gate_up_proj) and rand-qwen3moe (8 experts, top-2) at 4.0 bpw, head 6, with a
 *     small calibration (12 rows x 64 tokens of tiny.utf8): the output names the fused linears' parts (q_proj,
 *     k_proj, v_proj; gate_proj, up_proj) and each expert (mlp.experts.N.gate_proj, ...) as ExLlamaV2 does, keeps
 *     the router unquantized, measures the experts as one block_sparse_moe (w1, w3, w2) in measurement.json, loads
 *     in exl, and its mean KL from the fp32 reference over sequence b's stored positions stays under 0.15 nats;
 *   - the status callback reports every finished layer of both passes with its blocks' accuracy and bits.
 * Mixtral and GPTQ of all three: test_quantize.c (architectures_beyond_llama_quantize); candidates scored together:
 * test_quantize_shared.c. */
#include "exl.h"
#include "model_util.h"
#include "test.h"

#include "io/safetensors.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define KL_BOUND 0.15

/* more than the 8 sequences the measuring pass scores candidates on */
static exl_quantize_params arch_params(const char *model, const char *out) {
    return mu_quantize_params(model, out, 12, 64);
}

typedef struct layer_log {
    int measured, quantized, blocks_ok;
} layer_log;

static void on_status(void *user, const exl_quantize_status *s) {
    layer_log *g = user;
    if (!s->finished)
        return;
    int ok = s->n_blocks == 2 && s->seconds >= 0;
    for (int k = 0; k < s->n_blocks; k++)
        ok &= s->block[k].name && s->block[k].accuracy > 0 && s->block[k].accuracy <= 1 && s->block[k].bpw > 2 &&
              s->block[k].bpw < 9;
    g->blocks_ok += ok;
    if (!strcmp(s->stage, "measuring"))
        g->measured++;
    else
        g->quantized++;
}

/* Mean KL(reference || model) over sequence b's stored positions. */
static double kl_b(const char *model_dir, const char *ref_path) {
    exl_st_file *ref;
    if (exl_st_open(ref_path, &ref) != EXL_OK)
        return -1;
    const exl_st_tensor *ids = exl_st_find(ref, "ids_b"), *lg = exl_st_find(ref, "logits_b"),
                        *pos = exl_st_find(ref, "pos_b");
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    mp.n_threads = 2;
    exl_model *m = NULL;
    exl_session *s = NULL;
    double kl = -1;
    float *out = NULL;
    if (ids && lg && exl_model_load(model_dir, &mp, &m) == EXL_OK) {
        int32_t n = (int32_t)ids->shape[0], rows = (int32_t)lg->shape[0];
        int64_t vocab = lg->shape[1];
        out = malloc((size_t)n * vocab * sizeof *out);
        if (out && exl_session_init(m, n, &s) == EXL_OK && exl_session_eval(s, ids->data, n, out, NULL) == EXL_OK) {
            kl = 0;
            for (int32_t r = 0; r < rows; r++) {
                const float *want = (const float *)lg->data + r * vocab;
                const float *got = out + (int64_t)(pos ? ((const int32_t *)pos->data)[r] : r) * vocab;
                double mw = want[0], mg = got[0], zw = 0, zg = 0, k = 0;
                for (int64_t v = 1; v < vocab; v++)
                    mw = want[v] > mw ? want[v] : mw, mg = got[v] > mg ? got[v] : mg;
                for (int64_t v = 0; v < vocab; v++)
                    zw += exp(want[v] - mw), zg += exp(got[v] - mg);
                for (int64_t v = 0; v < vocab; v++) {
                    double lw = want[v] - mw - log(zw), lgot = got[v] - mg - log(zg);
                    k += exp(lw) * (lw - lgot);
                }
                kl += k / rows;
            }
        }
    }
    CHECK_MSG(kl >= 0, "%s: cannot run sequence b: %s", model_dir, exl_last_error());
    if (s)
        exl_session_free(s);
    exl_model_free(m);
    free(out);
    exl_st_close(ref);
    return kl;
}

static int has_tensor(const exl_st_file *f, const char *name) { return exl_st_find(f, name) != NULL; }

/* Quantize `model` at 4.0 bpw / head 6 into a fresh directory; check names (want present, unwanted absent), the
 * measurement's block keys, the layer reports and the KL bound. */
static void check_model(const char *model, const char *const *want, int n_want, const char *const *unwanted,
                        int n_unwanted, const char *block_key, const char *const *meas_keys, int n_meas_keys) {
    char out[1200], path[1300], ref[1300];
    snprintf(out, sizeof out, "%s/%s-exl2", exl_test_tmpdir(), model);
    exl_quantize_params p = arch_params(model, out);
    layer_log log = {0};
    p.status = on_status;
    p.status_user = &log;
    exl_status st = exl_quantize(&p, NULL);
    CHECK_MSG(st == EXL_OK, "%s: exl_quantize: %s", model, exl_last_error());
    if (st != EXL_OK)
        return;
    CHECK_MSG(log.measured == 2 && log.quantized == 2 && log.blocks_ok == 4,
              "%s: layer reports: %d measured, %d quantized, %d with both blocks' accuracy and bits", model,
              log.measured, log.quantized, log.blocks_ok);
    snprintf(path, sizeof path, "%s/output.safetensors", out);
    exl_st_file *f;
    REQUIRE_OK(exl_st_open(path, &f));
    for (int i = 0; i < n_want; i++)
        CHECK_MSG(has_tensor(f, want[i]), "%s: the output lacks %s", model, want[i]);
    for (int i = 0; i < n_unwanted; i++)
        CHECK_MSG(!has_tensor(f, unwanted[i]), "%s: the output holds %s", model, unwanted[i]);
    exl_st_close(f);
    snprintf(path, sizeof path, "%s/measurement.json", out);
    char *text = mu_read_file(path, NULL);
    cJSON *j = text ? cJSON_Parse(text) : NULL;
    free(text);
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(j, "measurement"), block_key);
    const cJSON *first = cJSON_GetArrayItem(list, 0);
    CHECK_MSG(first, "%s: measurement.json has no %s", model, block_key);
    for (int i = 0; first && i < n_meas_keys; i++)
        CHECK_MSG(cJSON_GetObjectItemCaseSensitive(first, meas_keys[i]), "%s: %s's recipes lack %s", model, block_key,
                  meas_keys[i]);
    cJSON_Delete(j);
    snprintf(ref, sizeof ref, "%s/%s.logits.safetensors", exl_test_shared("reference"), model);
    double kl = kl_b(out, ref);
    printf("    %s exl2 4.0 bpw h6: mean KL %.4f nats over sequence b\n", model, kl);
    CHECK_MSG(kl >= 0 && kl <= KL_BOUND, "%s: mean KL %.4f nats, bound %.2f", model, kl, KL_BOUND);
}

EXL_TEST(phi3_fused_linears_quantize_as_exllamav2_parts) {
    static const char *const want[] = {"model.layers.0.self_attn.q_proj.q_weight",
                                       "model.layers.0.self_attn.k_proj.q_weight",
                                       "model.layers.1.self_attn.v_proj.q_invperm",
                                       "model.layers.1.mlp.gate_proj.q_scale",
                                       "model.layers.0.mlp.up_proj.q_groups",
                                       "model.layers.0.mlp.down_proj.q_weight",
                                       "lm_head.q_weight"};
    static const char *const unwanted[] = {"model.layers.0.self_attn.qkv_proj.weight",
                                           "model.layers.0.self_attn.qkv_proj.q_weight",
                                           "model.layers.0.mlp.gate_up_proj.weight"};
    static const char *const keys[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
    check_model("rand-phi3", want, 7, unwanted, 3, "model.layers.1.self_attn", keys, 4);
}

EXL_TEST(qwen3moe_experts_quantize_one_by_one) {
    static const char *const want[] = {"model.layers.0.mlp.experts.0.gate_proj.q_weight",
                                       "model.layers.0.mlp.experts.7.up_proj.q_weight",
                                       "model.layers.1.mlp.experts.3.down_proj.q_scale_max",
                                       "model.layers.1.mlp.gate.weight", "model.layers.1.self_attn.q_norm.weight"};
    static const char *const unwanted[] = {"model.layers.0.mlp.experts.0.gate_proj.weight",
                                           "model.layers.1.mlp.gate.q_weight"};
    static const char *const keys[] = {"w1", "w3", "w2"};
    check_model("rand-qwen3moe", want, 5, unwanted, 2, "model.layers.0.block_sparse_moe", keys, 3);
}
