/* test_layer_run.c - the quantizer's host-side layer runner (model/layer_run.h), composed into a
 * whole model, against Hugging Face's logits: the calibration activations it feeds GPTQ must be
 * the model's own. Tolerance: relative L2 error <= 1e-4 at every stored position of sequence a. */
#include "io/hf_config.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "model/layer_run.h"
#include "ref_util.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

static void check_model(const char *name) {
    char dir[1024], ref_path[1024], nm[256];
    snprintf(dir, sizeof dir, "%s", exl_test_shared(name));
    snprintf(nm, sizeof nm, "reference/%s.logits.safetensors", strrchr(name, '/') + 1);
    snprintf(ref_path, sizeof ref_path, "%s", exl_test_shared(nm));
    exl_hf_config cfg;
    REQUIRE_OK(exl_hf_config_load(dir, &cfg));
    exl_weights *w;
    REQUIRE_OK(exl_weights_open(dir, &w));
    exl_st_file *ref;
    REQUIRE_OK(exl_st_open(ref_path, &ref));
    const exl_st_tensor *ids = exl_st_find(ref, "ids_a"), *want = exl_st_find(ref, "logits_a");
    if (!ids) { /* tinystories names its sequences 0, 1, 2 */
        ids = exl_st_find(ref, "ids_0");
        want = exl_st_find(ref, "logits_0");
    }
    REQUIRE(ids && want);
    int32_t T = (int32_t)ids->shape[0];
    exl_pool *pool;
    exl_backend *be;
    REQUIRE_OK(exl_pool_init(0, &pool));
    REQUIRE_OK(exl_backend_cpu_init(0, &be));
    exl_lrun r;
    REQUIRE_OK(exl_lrun_init(&r, &cfg, pool, 1, T));
    r.be = be;
    int64_t H = cfg.hidden_size, F = cfg.intermediate_size, hd = cfg.head_dim;
    int64_t QW = cfg.n_heads * hd, KW = cfg.n_kv_heads * hd;
    float *x = calloc((size_t)(T * H), 4), *h = calloc((size_t)(T * H), 4), *q = calloc((size_t)(T * QW), 4);
    float *k = calloc((size_t)(T * KW), 4), *v = calloc((size_t)(T * KW), 4), *a = calloc((size_t)(T * QW), 4);
    float *g = calloc((size_t)(T * F), 4), *u = calloc((size_t)(T * F), 4), *o = calloc((size_t)(T * H), 4);
    float *logits = calloc((size_t)T * cfg.vocab_size, 4);
    REQUIRE_OK(exl_lrun_embed(&r, w, ids->data, x));
    for (int l = 0; l < cfg.n_layers; l++) {
        char p[256];
        float *n1, *n2, *Wq, *Wk, *Wv, *Wo, *Wg, *Wu, *Wd, *bq = NULL, *bk = NULL, *bv = NULL;
#define NAME(s) (snprintf(p, sizeof p, "model.layers.%d.%s", l, s), p)
        REQUIRE_OK(exl_lrun_load_norm(&r, w, NAME("input_layernorm.weight"), &n1));
        REQUIRE_OK(exl_lrun_load_norm(&r, w, NAME("post_attention_layernorm.weight"), &n2));
        REQUIRE_OK(exl_lrun_load_linear(w, NAME("self_attn.q_proj.weight"), H, QW, &Wq));
        REQUIRE_OK(exl_lrun_load_linear(w, NAME("self_attn.k_proj.weight"), H, KW, &Wk));
        REQUIRE_OK(exl_lrun_load_linear(w, NAME("self_attn.v_proj.weight"), H, KW, &Wv));
        REQUIRE_OK(exl_lrun_load_linear(w, NAME("self_attn.o_proj.weight"), QW, H, &Wo));
        REQUIRE_OK(exl_lrun_load_linear(w, NAME("mlp.gate_proj.weight"), H, F, &Wg));
        REQUIRE_OK(exl_lrun_load_linear(w, NAME("mlp.up_proj.weight"), H, F, &Wu));
        REQUIRE_OK(exl_lrun_load_linear(w, NAME("mlp.down_proj.weight"), F, H, &Wd));
        if (cfg.qkv_bias) {
            REQUIRE_OK(exl_lrun_load_vector(w, NAME("self_attn.q_proj.bias"), QW, 0, &bq));
            REQUIRE_OK(exl_lrun_load_vector(w, NAME("self_attn.k_proj.bias"), KW, 0, &bk));
            REQUIRE_OK(exl_lrun_load_vector(w, NAME("self_attn.v_proj.bias"), KW, 0, &bv));
        }
#undef NAME
        exl_lrun_rmsnorm(&r, h, x, n1, T);
        exl_lrun_matmul(&r, q, h, Wq, bq, T, H, QW);
        exl_lrun_matmul(&r, k, h, Wk, bk, T, H, KW);
        exl_lrun_matmul(&r, v, h, Wv, bv, T, H, KW);
        exl_lrun_attention(&r, a, q, k, v);
        exl_lrun_matmul(&r, o, a, Wo, NULL, T, QW, H);
        for (int64_t i = 0; i < T * H; i++)
            x[i] += o[i];
        exl_lrun_rmsnorm(&r, h, x, n2, T);
        exl_lrun_matmul(&r, g, h, Wg, NULL, T, H, F);
        exl_lrun_matmul(&r, u, h, Wu, NULL, T, H, F);
        exl_lrun_glu(&r, g, u, T * F);
        exl_lrun_matmul(&r, o, g, Wd, NULL, T, F, H);
        for (int64_t i = 0; i < T * H; i++)
            x[i] += o[i];
        float *all[] = {n1, n2, Wq, Wk, Wv, Wo, Wg, Wu, Wd, bq, bk, bv};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            free(all[i]);
    }
    float *nf, *head;
    REQUIRE_OK(exl_lrun_load_norm(&r, w, "model.norm.weight", &nf));
    REQUIRE_OK(exl_lrun_load_linear(w, exl_weights_find(w, "lm_head.weight") ? "lm_head.weight" : "model.embed_tokens.weight",
                                    H, cfg.vocab_size, &head));
    exl_lrun_rmsnorm(&r, h, x, nf, T);
    exl_lrun_matmul(&r, logits, h, head, NULL, T, H, cfg.vocab_size);
    double worst = 0;
    for (int32_t t = 0; t < T; t++) {
        double e = ref_rel_err(logits + (int64_t)t * cfg.vocab_size, (const float *)want->data + (int64_t)t * cfg.vocab_size,
                               cfg.vocab_size);
        worst = e > worst ? e : worst;
    }
    printf("    %s: layer runner vs transformers, max rel err %.2e\n", name, worst);
    CHECK_MSG(worst <= 1e-4, "%s: layer runner differs from the reference: %.3e", name, worst);
    free(nf);
    free(head);
    float *bufs[] = {x, h, q, k, v, a, g, u, o, logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        free(bufs[i]);
    exl_lrun_free(&r);
    exl_pool_free(pool);
    be->ops->destroy(be);
    exl_st_close(ref);
    exl_weights_close(w);
}

EXL_TEST(layer_runner_llama) { check_model("models/rand-llama"); }
EXL_TEST(layer_runner_qwen2) { check_model("models/rand-qwen2"); }
EXL_TEST(layer_runner_gemma) { check_model("models/rand-gemma"); }
EXL_TEST(layer_runner_tinystories) { check_model("models/tinystories-656k"); }
