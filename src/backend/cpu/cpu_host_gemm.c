/* cpu_host_gemm.c - host_gemm on the CPU (backend.h): C = alpha·op(A)·op(B) + beta·C on host arrays, for
 * host-side work such as the quantizer's Hessians and GPTQ updates.
 *
 * K goes in slices of KC. In each slice every row of op(A) and column of op(B) must be contiguous for the dot
 * kernels: A's rows and transposed B's rows are read in place, the others are copied once per slice into
 * contiguous rows (at [M][kc], bt [N][kc]) across the pool. Then tiles of TM rows x TN columns of C, split
 * across the pool, take the slice's dot products EXL_CPU_MAX_NR rows x EXL_CPU_NC columns at a time (the block
 * kernel, or the dot kernel column by column where the table has none) and add alpha times them to C: the
 * first slice to beta·C (C not read when beta is 0), the others to C. All in fp32. */
#include "backend/cpu/cpu.h"

#include "base/alloc.h"
#include "base/error.h"

#define KC 512 /* inner dimension per slice */
#define TM 32  /* rows of C per tile */
#define TN 96  /* columns of C per tile (a multiple of EXL_CPU_NC) */

typedef struct gemm_job {
    const exl_cpu_kernels *k;
    int trans_a, trans_b;
    int64_t M, N, K;
    float alpha, beta;
    const float *A, *B;
    int64_t lda, ldb;
    float *C;
    int64_t ldc;
    /* the slice: k0 .. k0 + kc, its rows of op(A) (x, ldx apart) and columns of op(B) (w, ldw apart) */
    int64_t k0, kc;
    float *at, *bt;
    const float *x, *w;
    int64_t ldx, ldw;
    int first; /* the first slice: C starts from beta·C */
} gemm_job;

/* dst[i * kc + t] = src[(k0 + t) * ld + i] for i in [i0, i1), t < kc: a slice of a transposed operand's rows. */
static void pack_rows(float *dst, const float *src, int64_t ld, int64_t k0, int64_t kc, long i0, long i1) {
    for (int64_t t = 0; t < kc; t++) {
        const float *s = src + (k0 + t) * ld;
        for (long i = i0; i < i1; i++)
            dst[i * kc + t] = s[i];
    }
}

static void pack_task(void *ctx, int index, int count) {
    const gemm_job *j = ctx;
    long i0, i1;
    if (j->trans_a) {
        exl_split_range((long)j->M, index, count, 1, &i0, &i1);
        pack_rows(j->at, j->A, j->lda, j->k0, j->kc, i0, i1);
    }
    if (!j->trans_b) {
        exl_split_range((long)j->N, index, count, 1, &i0, &i1);
        pack_rows(j->bt, j->B, j->ldb, j->k0, j->kc, i0, i1);
    }
}

/* acc[r * EXL_CPU_NC + c] = x row r · w[c] over kc, r < nr. */
static void dots(const exl_cpu_kernels *k, const float *x, int64_t ldx, int nr, const float *const *w, int64_t kc,
                 float *acc) {
    if (k->block_f32) {
        k->block_f32(x, ldx, nr, w, kc, acc);
        return;
    }
    float col[EXL_CPU_MAX_NR];
    for (int c = 0; c < EXL_CPU_NC; c++) {
        k->dot_f32(x, ldx, nr, w[c], kc, col);
        for (int r = 0; r < nr; r++)
            acc[r * EXL_CPU_NC + c] = col[r];
    }
}

/* Rows m0 .. m1 x columns n0 .. n1 of C. A last partial column block repeats its last column (result dropped). */
static void gemm_tile(const gemm_job *j, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    float acc[EXL_CPU_MAX_NR * EXL_CPU_NC];
    for (int64_t n = n0; n < n1; n += EXL_CPU_NC) {
        int nc = n1 - n < EXL_CPU_NC ? (int)(n1 - n) : EXL_CPU_NC;
        const float *w[EXL_CPU_NC];
        for (int c = 0; c < EXL_CPU_NC; c++)
            w[c] = j->w + (n + (c < nc ? c : nc - 1)) * j->ldw;
        for (int64_t m = m0; m < m1; m += EXL_CPU_MAX_NR) {
            int nr = m1 - m < EXL_CPU_MAX_NR ? (int)(m1 - m) : EXL_CPU_MAX_NR;
            dots(j->k, j->x + m * j->ldx, j->ldx, nr, w, j->kc, acc);
            for (int r = 0; r < nr; r++) {
                float *c = j->C + (m + r) * j->ldc + n;
                for (int i = 0; i < nc; i++) {
                    float base = !j->first ? c[i] : j->beta != 0.0f ? j->beta * c[i] : 0.0f;
                    c[i] = base + j->alpha * acc[r * EXL_CPU_NC + i];
                }
            }
        }
    }
}

static void gemm_task(void *ctx, int index, int count) {
    const gemm_job *j = ctx;
    int64_t tiles_n = (j->N + TN - 1) / TN, tiles = (j->M + TM - 1) / TM * tiles_n;
    long t0, t1;
    exl_split_range((long)tiles, index, count, 1, &t0, &t1);
    for (int64_t t = t0; t < t1; t++) {
        int64_t m0 = t / tiles_n * TM, n0 = t % tiles_n * TN;
        gemm_tile(j, m0, m0 + TM < j->M ? m0 + TM : j->M, n0, n0 + TN < j->N ? n0 + TN : j->N);
    }
}

/* C = beta·C over M x N (no slice to add: K is 0) */
static void scale_c(const gemm_job *j) {
    for (int64_t m = 0; m < j->M; m++)
        for (int64_t n = 0; n < j->N; n++)
            j->C[m * j->ldc + n] = j->beta != 0.0f ? j->beta * j->C[m * j->ldc + n] : 0.0f;
}

exl_status exl_cpu_host_gemm(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                             const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                             int64_t ldc) {
    if (M < 0 || N < 0 || K < 0)
        return exl_fail(EXL_ERR_ARG, "host_gemm: shape %lld x %lld x %lld", (long long)M, (long long)N, (long long)K);
    gemm_job j = {.k = exl_cpu(be)->k,
                  .trans_a = trans_a,
                  .trans_b = trans_b,
                  .M = M,
                  .N = N,
                  .K = K,
                  .alpha = alpha,
                  .beta = beta,
                  .A = A,
                  .B = B,
                  .lda = lda,
                  .ldb = ldb,
                  .C = C,
                  .ldc = ldc};
    if (M == 0 || N == 0)
        return EXL_OK;
    if (K == 0) {
        scale_c(&j);
        return EXL_OK;
    }
    int64_t kc_max = K < KC ? K : KC;
    if (trans_a && !(j.at = exl_malloc((size_t)(M * kc_max) * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "host_gemm: out of memory");
    if (!trans_b && !(j.bt = exl_malloc((size_t)(N * kc_max) * sizeof(float)))) {
        exl_free(j.at);
        return exl_fail(EXL_ERR_NOMEM, "host_gemm: out of memory");
    }
    exl_pool *pool = exl_cpu(be)->pool;
    for (j.k0 = 0; j.k0 < K; j.k0 += KC) {
        j.kc = K - j.k0 < KC ? K - j.k0 : KC;
        j.first = j.k0 == 0;
        if (trans_a || !trans_b)
            exl_pool_run_work(pool, pack_task, &j, ((trans_a ? M : 0) + (trans_b ? 0 : N)) * j.kc);
        j.x = trans_a ? j.at : A + j.k0;
        j.ldx = trans_a ? j.kc : lda;
        j.w = trans_b ? B + j.k0 : j.bt;
        j.ldw = trans_b ? ldb : j.kc;
        exl_pool_run_work(pool, gemm_task, &j, M * N * j.kc);
    }
    exl_free(j.at);
    exl_free(j.bt);
    return EXL_OK;
}
