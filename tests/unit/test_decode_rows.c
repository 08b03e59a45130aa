/* test_decode_rows.c - decode steps of 2 to 16 sequences at once on the CPU: each row's logits equal those of its
 * sequence's step alone (ref_decode_rows; test_gpu checks the same on the GPU, where 2-16 rows take the GEMV on
 * tensor cores and one row the plain GEMV); on the CPU with its fp32 KV cache and its fp16 one. */
#include "ref_util.h"
#include "test.h"

#include <stdlib.h>

/* kv16: the CPU's KV cache in fp16 (EXL_CPU_KV=fp16, cpu_attention_f16.c) instead of fp32 */
static void check_rows_cache(const char *rel, int kv16) {
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    mp.n_threads = 2;
    exl_model *m;
    if (kv16)
        setenv("EXL_CPU_KV", "fp16", 1);
    exl_status st = exl_model_load(exl_test_shared(rel), &mp, &m);
    if (kv16)
        unsetenv("EXL_CPU_KV");
    REQUIRE_OK(st);
    const int32_t ks[] = {2, 3, 4, 5, 8, 9, 16};
    int mismatch = 0, rows = 0;
    const double e = ref_decode_rows(m, ks, (int)(sizeof ks / sizeof ks[0]), &mismatch, &rows);
    exl_model_free(m);
    REQUIRE(e >= 0);
    CHECK_MSG(rows == 47, "%s: %d rows compared", rel, rows);
    CHECK_MSG(e <= 1e-5, "%s: rows of a step against their sequence alone: rel err %.3e", rel, e);
    CHECK_MSG(mismatch == 0, "%s: %d argmax mismatches", rel, mismatch);
}

static void check_rows(const char *rel) { check_rows_cache(rel, 0); }

EXL_TEST(decode_rows_dense) { check_rows("models/rand-llama"); }
EXL_TEST(decode_rows_exl2) { check_rows("models/rand-llama-exl2-5.0bpw-h8"); }
EXL_TEST(decode_rows_gptq) { check_rows("models/rand-llama-gptq-4bit-g64-sym"); }
EXL_TEST(decode_rows_tinystories) { check_rows("models/tinystories-656k"); }
/* the fp16 cache: its rows alike, Gemma 3's sliding windows too */
EXL_TEST(decode_rows_fp16_cache) {
    check_rows_cache("models/tinystories-656k", 1);
    check_rows_cache("models/rand-llama-exl2-5.0bpw-h8", 1);
    check_rows_cache("models/rand-gemma", 1);
    check_rows_cache("models/rand-gemma3", 1);
}
