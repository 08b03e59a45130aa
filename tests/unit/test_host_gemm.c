/* test_host_gemm.c - the CPU backend's host_gemm (the quantizer's fp32 products on host memory) against a
 * double-precision reference: every transpose, leading dimensions wider than the operands (whose padding
 * must stay untouched in C), alpha and beta (0: C not read, so NaN there must not leak), contractions longer
 * than one slice of the CPU's loop, and an empty one (C = beta·C). Relative tolerance 1e-5 of
 * |alpha|·Σ|a·b| + |beta·c0|, on every instruction set this CPU has. */
#include "backend/backend.h"
#include "test.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *name;
    int ta, tb;
    int64_t M, N, K, pad; /* pad: extra columns of every operand's leading dimension */
    float alpha, beta;
    int xtx; /* B is A (the Hessian's XᵀX) */
} gemm_case;

static uint32_t g_seed = 12345;

static float *rnd(int64_t n) {
    float *v = malloc((size_t)n * sizeof *v);
    for (int64_t i = 0; v && i < n; i++) {
        g_seed = g_seed * 1664525u + 1013904223u;
        v[i] = (float)(g_seed >> 8) / (float)(1u << 23) - 1.0f;
    }
    return v;
}

/* The worst relative error over C's M x N, or 1 when a padding column of C changed. */
static double gemm_err(const gemm_case *g, const float *A, int64_t lda, const float *B, int64_t ldb, const float *C0,
                       const float *C, int64_t ldc) {
    double worst = 0;
    for (int64_t m = 0; m < g->M; m++)
        for (int64_t n = 0; n < ldc; n++) {
            int64_t i = m * ldc + n;
            if (n >= g->N) {
                worst = memcmp(&C[i], &C0[i], sizeof *C) ? 1 : worst;
                continue;
            }
            double s = 0, mag = 0;
            for (int64_t k = 0; k < g->K; k++) {
                double a = g->ta ? A[k * lda + m] : A[m * lda + k], ab = a * (g->tb ? B[n * ldb + k] : B[k * ldb + n]);
                s += ab;
                mag += fabs(ab);
            }
            double c0 = g->beta != 0 ? (double)g->beta * C0[i] : 0, scale = fabs(g->alpha) * mag + fabs(c0);
            double e = fabs(C[i] - (g->alpha * s + c0)) / (scale > 0 ? scale : 1);
            worst = e > worst || isnan(e) ? (isnan(e) ? 1 : e) : worst;
        }
    return worst;
}

static void check_cases(const char *isa) {
    static const gemm_case cases[] = {
        {"x·W", 0, 0, 333, 200, 150, 0, 1, 0, 0},
        {"XᵀX", 1, 0, 96, 96, 1500, 0, 1, 1, 1},
        {"W -= UᵀE (sub-block)", 1, 0, 300, 130, 128, 45, -1, 1, 0},
        {"x·Wᵀ", 0, 1, 70, 50, 90, 3, 0.5f, 2, 0},
        {"AᵀBᵀ", 1, 1, 64, 33, 1100, 7, 1, 0.25f, 0},
        {"one row", 0, 0, 1, 700, 40, 1, 1, 0, 0},
        {"one column", 1, 0, 40, 1, 600, 2, 2, 1, 0},
        {"no contraction", 0, 0, 5, 6, 0, 1, 1, 0.5f, 0},
    };
    exl_backend *be;
    REQUIRE_OK(exl_backend_cpu_init(2, &be));
    REQUIRE(be->ops->host_gemm);
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const gemm_case *g = &cases[c];
        int64_t lda = (g->ta ? g->M : g->K) + g->pad, ldb = (g->tb ? g->K : g->N) + g->pad, ldc = g->N + g->pad;
        float *A = rnd((g->ta ? g->K : g->M) * lda + 1);
        float *B = g->xtx ? A : rnd((g->tb ? g->N : g->K) * ldb + 1);
        float *C0 = rnd(g->M * ldc), *C = malloc((size_t)(g->M * ldc) * sizeof *C);
        REQUIRE(A && B && C0 && C);
        for (int64_t m = 0; g->beta == 0 && m < g->M; m++) /* beta 0: C is not read */
            for (int64_t n = 0; n < g->N; n++)
                C0[m * ldc + n] = NAN;
        memcpy(C, C0, (size_t)(g->M * ldc) * sizeof *C);
        REQUIRE_OK(be->ops->host_gemm(be, g->ta, g->tb, g->M, g->N, g->K, g->alpha, A, lda, B, ldb, g->beta, C, ldc));
        double err = gemm_err(g, A, lda, B, ldb, C0, C, ldc);
        CHECK_MSG(err <= 1e-5, "%s: host_gemm %s %lldx%lldx%lld: relative error %.3g", isa, g->name, (long long)g->M,
                  (long long)g->N, (long long)g->K, err);
        if (B != A)
            free(B);
        free(A);
        free(C0);
        free(C);
    }
    be->ops->destroy(be);
}

EXL_TEST(host_gemm_matches_double_reference) {
    const char *old = getenv("EXL_CPU_ISA");
    char *saved = old ? strdup(old) : NULL;
    static const char *const isas[] = {"scalar", "avx2", "avx512"};
    for (size_t i = 0; i < sizeof isas / sizeof isas[0]; i++) {
        setenv("EXL_CPU_ISA", isas[i], 1);
        check_cases(isas[i]);
    }
    if (saved)
        setenv("EXL_CPU_ISA", saved, 1);
    else
        unsetenv("EXL_CPU_ISA");
    free(saved);
}
