/* test_tp.c - tensor parallelism on the CPU: the model split over 2 (and more) ranks, each a CPU backend on its own
 * thread joined by the shared-memory communicator, against Hugging Face's fp32 logits (as test_reference, relative
 * L2 error <= 1e-4 at every stored position), the splits that cannot be made refused with a message, and greedy
 * generation equal to one device's. */
#include "base/alloc.h"
#include "gen_util.h"
#include "model/model.h"
#include "ref_util.h"
#include "test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOL 1e-4

static double compare(const char *name, const exl_model_params *p, int *mism, int *npos) {
    char dir[256], ref[256], dir_path[4096];
    snprintf(dir, sizeof dir, "models/%s", name);
    snprintf(ref, sizeof ref, "reference/%s.logits.safetensors", name);
    snprintf(dir_path, sizeof dir_path, "%s", exl_test_shared(dir));
    return ref_compare_model(dir_path, exl_test_shared(ref), "logits", p, mism, npos);
}

static void check_model(const char *name, int32_t tp) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    p.tp = tp;
    int mism, npos;
    double e = compare(name, &p, &mism, &npos);
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

/* --gpu-split on CPU ranks: whole layers on each (GB shares small enough to spread the fixtures' few layers) */
static void check_layer_split(const char *name, const float *split, int n) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    for (int i = 0; i < n; i++)
        p.gpu_split[i] = split[i];
    int mism, npos;
    double e = compare(name, &p, &mism, &npos);
    printf("    %-40s --gpu-split over %d  %3d positions  max rel err %.2e  argmax mismatches %d\n", name, n, npos, e,
           mism);
    CHECK_MSG(e >= 0 && e <= TOL && npos > 0, "%s --gpu-split: max relative error %.3e > %.0e", name, e, TOL);
}

EXL_TEST(layer_split) {
    const float two[] = {0.0025f, 1}, three[] = {0.0025f, 0.0017f, 1}, none_first[] = {0.0003f, 1};
    const float two_exl2[] = {0.0013f, 1};      /* a layer each (the embedding counts whole on the first) */
    check_layer_split("rand-llama", two, 2);    /* a layer each */
    check_layer_split("rand-gemma3", three, 3); /* 1, 1 and 2 layers */
    check_layer_split("rand-llama-exl2-3.0bpw-h6", two_exl2, 2);
    check_layer_split("rand-qwen3moe", none_first, 2); /* every layer on the second device */
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    p.gpu_split[0] = p.gpu_split[1] = 0.0001f;
    exl_model *m = NULL;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", exl_test_shared("models/rand-llama"));
    CHECK(exl_model_load(dir, &p, &m) == EXL_ERR_NOMEM && !m); /* more than the shares hold */
    CHECK(strstr(exl_last_error(), "--gpu-split") != NULL);
    exl_model_free(m);
}

/* The generator over a split model: greedy jobs sharing a prefix (the prefix cache copies pages on every rank), run
 * together (fed-token decode), give one device's tokens exactly. */
static void generate(int32_t tp, const float *split, gu_result *res, int n) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", exl_test_shared("models/tinystories-656k"));
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    mp.tp = tp;
    for (int i = 0; split && i < 2; i++)
        mp.gpu_split[i] = split[i];
    exl_model *m = NULL;
    exl_tokenizer *tok = NULL;
    if (exl_model_load(dir, &mp, &m) != EXL_OK || exl_tokenizer_load(dir, &tok) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "load: %s", exl_last_error());
        exl_model_free(m);
        return;
    }
    exl_generator *g = gu_generator(m, tok, 64, 16, 0);
    int32_t prompts[4][40];
    exl_job_params p[4];
    for (int i = 0; i < n; i++) {
        gu_random_ids(7, prompts[i], 40, 2048); /* the same 24 first tokens, then each its own */
        gu_random_ids(100 + (uint64_t)i, prompts[i] + 24, 16, 2048);
        p[i] = exl_job_default_params();
        p[i].ids = prompts[i];
        p[i].n_ids = 40;
        p[i].sampling.temperature = 0;
        p[i].max_new_tokens = 24;
        p[i].ignore_eos = 1;
    }
    CHECK(g && gu_run(g, p, n, res) == EXL_OK);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(generator) {
    enum { N = 4 };
    gu_result *one = calloc(N, sizeof *one), *two = calloc(N, sizeof *two), *split = calloc(N, sizeof *split);
    REQUIRE(one && two && split);
    const float halves[] = {0.0018f, 1}; /* a layer each */
    generate(1, NULL, one, N);
    generate(2, NULL, two, N);
    generate(1, halves, split, N);
    for (int i = 0; i < N; i++) {
        CHECK(one[i].n_ids == 24 && two[i].n_ids == 24 && split[i].n_ids == 24);
        CHECK_MSG(!memcmp(one[i].ids, two[i].ids, sizeof one[i].ids), "job %d: --tp 2 tokens differ", i);
        CHECK_MSG(!memcmp(one[i].ids, split[i].ids, sizeof one[i].ids), "job %d: --gpu-split tokens differ", i);
    }
    free(one);
    free(two);
    free(split);
}

/* Every host allocation of a --tp 2 and a --gpu-split load failing in turn (on whichever rank's thread makes it):
 * the load fails cleanly with EXL_ERR_NOMEM (nothing left waiting or leaked), until none fails. */
EXL_TEST(load_failures) {
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", exl_test_shared("models/tinystories-656k"));
    for (int mode = 0; mode < 2; mode++) {
        exl_model_params mp = exl_model_default_params();
        mp.device = EXL_DEVICE_CPU;
        if (mode)
            mp.gpu_split[0] = 0.0018f, mp.gpu_split[1] = 1;
        else
            mp.tp = 2;
        int failed = 0, loaded = 0;
        for (long n = 0; n < 5000 && !loaded; n++) {
            exl_model *m = NULL;
            exl_alloc_fail_after(n);
            exl_status st = exl_model_load(dir, &mp, &m);
            exl_alloc_fail_after(-1);
            if (st == EXL_OK) {
                loaded = 1;
                exl_model_free(m);
                break;
            }
            CHECK_MSG(st == EXL_ERR_NOMEM && !m, "mode %d, failing allocation %ld: status %d: %s", mode, n, (int)st,
                      exl_last_error());
            failed++;
        }
        printf("    %s: %d failing allocations refused cleanly, then loaded\n", mode ? "--gpu-split" : "--tp 2",
               failed);
        CHECK(loaded && failed > 10);
    }
}

/* Every host allocation of a --gpu-split model's first step failing in turn (on whichever rank's thread makes it):
 * the step fails with EXL_ERR_NOMEM and the failing rank's message, no rank is left waiting in a collective, and
 * the step after it gives the logits of a step that never failed. */
EXL_TEST(split_step_failures) {
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    mp.gpu_split[0] = 0.0018f, mp.gpu_split[1] = 1;
    exl_model *m = NULL;
    REQUIRE_OK(exl_model_load(exl_test_shared("models/tinystories-656k"), &mp, &m));
    exl_kv_cache *cache = NULL;
    REQUIRE_OK(exl_kv_cache_init(m, 2, 16, 16, 16, &cache));
    const int32_t ids[8] = {1, 12, 345, 67, 89, 10, 111, 2}, pages[2] = {0, 1};
    const exl_seq_step step = {ids, 8, 0, pages, 1, 2};
    const size_t floats = (size_t)8 * m->cfg.vocab_size;
    float *want = calloc(floats, sizeof *want), *got = calloc(floats, sizeof *got);
    REQUIRE(want && got);
    int failed = 0, ran = 0;
    for (long n = 0; n < 2000 && !ran; n++) {
        exl_alloc_fail_after(n);
        exl_status st = exl_model_forward(m, cache, &step, 1, got);
        exl_alloc_fail_after(-1);
        if (st == EXL_OK) {
            ran = 1;
            break;
        }
        CHECK_MSG(st == EXL_ERR_NOMEM, "failing allocation %ld: status %d: %s", n, (int)st, exl_last_error());
        failed++;
    }
    REQUIRE_OK(exl_model_forward(m, cache, &step, 1, want)); /* the same positions again */
    printf("    --gpu-split: %d failing allocations in the first step failed it cleanly, then it ran\n", failed);
    CHECK(ran && failed > 0);
    CHECK_MSG(!memcmp(want, got, floats * sizeof *got), "the step after the failures differs");
    free(want);
    free(got);
    exl_kv_cache_free(m, cache);
    exl_model_free(m);
}
