/* test_reference.c - fp32 CPU logits against Hugging Face transformers' fp32 logits.
 * Tolerance: relative L2 error <= 1e-4 at every stored position of every sequence. */
#include "ref_util.h"
#include "test.h"

#include <stdio.h>
#include <string.h>

#define TOL 1e-4

static void check_model(const char *name) {
    char dir[256], ref[256];
    snprintf(dir, sizeof dir, "models/%s", name);
    snprintf(ref, sizeof ref, "reference/%s.logits.safetensors", name);
    char dir_path[4096];
    snprintf(dir_path, sizeof dir_path, "%s", exl_test_shared(dir));
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    int mism, npos;
    double e = ref_compare_model(dir_path, exl_test_shared(ref), "logits", &p, &mism, &npos);
    printf("    %-24s %3d positions  max rel err %.2e  argmax mismatches %d\n", name, npos, e, mism);
    CHECK_MSG(e >= 0 && e <= TOL, "%s: max relative error %.3e > %.0e", name, e, TOL);
    CHECK_MSG(npos > 0, "%s: no positions compared", name);
}

EXL_TEST(tinystories) { check_model("tinystories-656k"); }
EXL_TEST(rand_llama) { check_model("rand-llama"); }
EXL_TEST(rand_qwen2) { check_model("rand-qwen2"); }
EXL_TEST(rand_gemma) { check_model("rand-gemma"); }
EXL_TEST(rand_linrope) { check_model("rand-linrope"); }
EXL_TEST(rand_llama3rope) { check_model("rand-llama3rope"); }
EXL_TEST(rand_yarn) { check_model("rand-yarn"); }
EXL_TEST(rand_qwen3) { check_model("rand-qwen3"); }
EXL_TEST(rand_gemma3) { check_model("rand-gemma3"); }
EXL_TEST(rand_phi3) { check_model("rand-phi3"); }
EXL_TEST(rand_mixtral) { check_model("rand-mixtral"); }
EXL_TEST(rand_qwen3moe) { check_model("rand-qwen3moe"); }
