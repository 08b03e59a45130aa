/* test_quant_roundtrip.c - pack known codes, load, dequantize exactly, and hold the fused
 * CPU kernels (every ISA) to x·dequant(W): GPTQ at 2, 3, 4, 8 bits, group sizes 32, 128
 * and -1, with and without act-order, sym and asym, v1 and v2; EXL2 with every width
 * mixed in one matrix, a padded output width and a bias. */
#include "quant_util.h"
#include "test.h"

#include "base/half.h"
#include "format/quant.h"

#include <stdlib.h>
#include <string.h>

#define KERNEL_TOL 2e-6 /* fp32 accumulation: the worst seen is 1.0e-6 (one group of 320 rows, asym) */

static int same_matrix(const float *a, const float *b, int64_t n, int64_t *where) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float))) {
            *where = i;
            return 0;
        }
    return 1;
}

static void check_gptq(int bits, int32_t gs, int g_idx_mode, int sym, int v2, int64_t K, int64_t N) {
    tq_gptq t;
    REQUIRE(tq_gptq_make(&t, bits, K, N, gs, g_idx_mode, sym, v2, (uint32_t)(bits * 7919 + gs * 31 + g_idx_mode)));
    exl_linear_src src;
    tq_gptq_src(&t, &src);
    exl_status st = exl_gptq_check(&src);
    CHECK_MSG(st == EXL_OK, "gptq %d-bit gs %d: check: %s", bits, gs, exl_last_error());
    float *w = malloc((size_t)(K * N) * sizeof *w);
    int64_t at = 0;
    if (st == EXL_OK && w && exl_linear_dequant(&src, w) == EXL_OK)
        CHECK_MSG(same_matrix(w, t.W, K * N, &at),
                  "gptq %d-bit gs %d g_idx %d sym %d v2 %d: dequantized W[%lld] = %g, expected %g", bits, gs,
                  g_idx_mode, sym, v2, (long long)at, w[at], t.W[at]);
    int rows[] = {1, 3, 70};
    for (int i = 0; i < 3 && st == EXL_OK; i++) {
        double e = tq_kernel_err(&src, t.W, NULL, rows[i], 17u + (uint32_t)i);
        CHECK_MSG(e >= 0 && e <= KERNEL_TOL, "gptq %d-bit gs %d g_idx %d sym %d v2 %d rows %d: kernel error %.3e", bits,
                  gs, g_idx_mode, sym, v2, rows[i], e);
    }
    free(w);
    tq_gptq_free(&t);
}

EXL_TEST(gptq_all_widths_groups_orders) {
    int bits[] = {2, 3, 4, 8};
    int32_t gss[] = {32, 128, -1};
    for (int b = 0; b < 4; b++)
        for (int g = 0; g < 3; g++)
            for (int mode = 0; mode < 3; mode++)
                for (int sym = 0; sym < 2; sym++)
                    for (int v2 = 0; v2 < 2; v2++)
                        check_gptq(bits[b], gss[g], mode, sym, v2, 320, 96);
}

/* Runs of equal g_idx that start mid-word (random unsorted groups, odd group sizes). */
EXL_TEST(gptq_unaligned_runs) {
    int bits[] = {2, 3, 4, 8};
    for (int b = 0; b < 4; b++) {
        check_gptq(bits[b], 20, 3, 0, 0, 256, 64);
        check_gptq(bits[b], 20, 1, 0, 1, 256, 64);
        check_gptq(bits[b], 7, 0, 1, 0, 128, 32);
    }
}

static void check_exl2(int32_t G, const int32_t *bits, const int32_t *rows, int64_t N, int with_bias) {
    int64_t K = 0;
    for (int32_t g = 0; g < G; g++)
        K += rows[g];
    tq_exl2 t;
    REQUIRE(tq_exl2_make(&t, K, N, G, bits, rows, with_bias, (uint32_t)(K * 131 + N)));
    exl_linear_src src;
    tq_exl2_src(&t, &src);
    exl_status st = exl_exl2_check(&src);
    CHECK_MSG(st == EXL_OK, "exl2 K %lld N %lld: check: %s", (long long)K, (long long)N, exl_last_error());
    float *w = malloc((size_t)(K * N) * sizeof *w), *bias = malloc((size_t)N * sizeof *bias);
    for (int64_t n = 0; bias && n < N; n++)
        bias[n] = t.bias ? exl_f16_to_f32(t.bias[n]) : 0.0f;
    int64_t at = 0;
    if (st == EXL_OK && w && exl_linear_dequant(&src, w) == EXL_OK)
        CHECK_MSG(same_matrix(w, t.W, K * N, &at), "exl2 K %lld N %lld: dequantized W[%lld] = %g, expected %g",
                  (long long)K, (long long)N, (long long)at, w[at], t.W[at]);
    int nrows[] = {1, 2, 5, 67};
    for (int i = 0; i < 4 && st == EXL_OK && bias; i++) {
        double e = tq_kernel_err(&src, t.W, bias, nrows[i], 5u + (uint32_t)i);
        CHECK_MSG(e >= 0 && e <= KERNEL_TOL, "exl2 K %lld N %lld rows %d: kernel error %.3e", (long long)K,
                  (long long)N, nrows[i], e);
    }
    free(w);
    free(bias);
    tq_exl2_free(&t);
}

EXL_TEST(exl2_all_widths_mixed) {
    /* every width, sorted as the converter writes them, group sizes differing per width */
    int32_t bits[] = {8, 8, 6, 5, 4, 4, 3, 2, 2};
    int32_t rows[] = {32, 4, 16, 32, 128, 8, 96, 16, 48};
    check_exl2(9, bits, rows, 100, 1);
    check_exl2(9, bits, rows, 64, 0);
    /* unsorted widths and one group per width */
    int32_t bits2[] = {3, 8, 2, 6, 4, 5};
    int32_t rows2[] = {32, 64, 32, 48, 64, 32};
    check_exl2(6, bits2, rows2, 160, 1);
}

EXL_TEST(exl2_uniform_widths) {
    int32_t widths[] = {2, 3, 4, 5, 6, 8};
    for (int i = 0; i < 6; i++) {
        int32_t bits[4], rows[4];
        for (int g = 0; g < 4; g++) {
            bits[g] = widths[i];
            rows[g] = widths[i] == 6 ? 48 : 32;
        }
        check_exl2(4, bits, rows, 32, 0);
    }
}

/* The int8-activation path (the CPU default with AVX-512 VNNI; the runner sets EXL_CPU_ACT=fp32): every width through its int8
 * kernel, mixed with groups it leaves to the exact kernel (8 and 16 rows), within the error
 * of rounding the activations to int8 (~0.4% for these uniform ones), one row to a prompt. */
EXL_TEST(exl2_int8_activations) {
    int32_t bits[] = {8, 8, 6, 5, 4, 4, 3, 2, 2};
    int32_t rows[] = {32, 8, 64, 32, 128, 16, 96, 32, 64};
    int64_t K = 0, N = 200;
    for (int g = 0; g < 9; g++)
        K += rows[g];
    tq_exl2 t;
    REQUIRE(tq_exl2_make(&t, K, N, 9, bits, rows, 0, 77u));
    exl_linear_src src;
    tq_exl2_src(&t, &src);
    REQUIRE(exl_exl2_check(&src) == EXL_OK);
    setenv("EXL_CPU_ACT", "int8", 1);
    int nrows[] = {1, 3, 16, 70};
    for (int i = 0; i < 4; i++) {
        double e = tq_kernel_err(&src, t.W, NULL, nrows[i], 9u + (uint32_t)i);
        CHECK_MSG(e >= 0 && e <= 1e-2, "int8 rows %d: error %.3e", nrows[i], e);
        if (__builtin_cpu_supports("avx512vnni"))
            CHECK_MSG(e > KERNEL_TOL, "rows %d: the int8 path was not taken", nrows[i]);
    }
    setenv("EXL_CPU_ACT", "fp32", 1);
    tq_exl2_free(&t);
}
