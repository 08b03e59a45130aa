/* qz_atb.c - C += alpha·AᵀB on the CPU's threads, for the quantizer's Hessians (XᵀX, the upper triangle) and GPTQ's
 * updates of the rows after a block (W -= UᵀE).
 *
 * A [rows, M] and B [rows, N] are read in place, row by row: tiles of TI x TJ values of C accumulate in registers
 * as outer products of the pieces A[r, i0 .. i0 + TI] and B[r, j0 .. j0 + TJ], over RC rows at a time (their pieces
 * stay in L1), then add alpha times the sums to C. Rows of tiles go to the pool's threads in turn (in the upper
 * triangle their work shrinks down it). What is left beyond the whole tiles goes one dot product at a time. The
 * backend's host_gemm (a dot-product form) packs both operands transposed for every call; this is 2-3x less CPU
 * time for the Hessians. */
#include "convert/qz.h"

#include <string.h>

#define TI 6
#define TJ 16
#define RC 64

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SIMD_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SIMD_CLONES
#endif

typedef struct atb_job {
    int64_t M, N, rows;
    float alpha;
    const float *A, *B;
    int64_t lda, ldb;
    float *C;
    int64_t ldc;
    int upper;
} atb_job;

/* C[i0 .. i0 + TI, j0 .. j0 + TJ] += alpha · the tile's sums over rows r0 .. r1 */
SIMD_CLONES static void atb_tile(const atb_job *j, int64_t r0, int64_t r1, int64_t i0, int64_t j0) {
    float acc[TI][TJ] = {{0}};
    for (int64_t r = r0; r < r1; r++) {
        const float *a = j->A + r * j->lda + i0;
        float b[TJ];
        memcpy(b, j->B + r * j->ldb + j0, sizeof b);
#pragma GCC unroll 6
        for (int t = 0; t < TI; t++) {
            float s = a[t];
#pragma GCC unroll 16
            for (int c = 0; c < TJ; c++)
                acc[t][c] += s * b[c];
        }
    }
    for (int t = 0; t < TI; t++)
        for (int c = 0; c < TJ; c++)
            j->C[(i0 + t) * j->ldc + j0 + c] += j->alpha * acc[t][c];
}

/* C[i, c] += alpha · A[:, i] · B[:, c] */
static void atb_one(const atb_job *j, int64_t i, int64_t c) {
    float s = 0;
    for (int64_t r = 0; r < j->rows; r++)
        s += j->A[r * j->lda + i] * j->B[r * j->ldb + c];
    j->C[i * j->ldc + c] += j->alpha * s;
}

/* the first column of row i (or of its tile row) the product needs */
static int64_t first_col(const atb_job *j, int64_t i) { return j->upper ? i : 0; }

static void atb_task(void *ctx, int index, int count) {
    const atb_job *j = ctx;
    int64_t mi = j->M / TI * TI, nj = j->N / TJ * TJ;
    for (int64_t i0 = (int64_t)index * TI; i0 < mi; i0 += (int64_t)count * TI) {
        for (int64_t r0 = 0; r0 < j->rows; r0 += RC)
            for (int64_t j0 = first_col(j, i0) / TJ * TJ; j0 < nj; j0 += TJ)
                atb_tile(j, r0, r0 + RC < j->rows ? r0 + RC : j->rows, i0, j0);
        for (int64_t i = i0; i < i0 + TI; i++)
            for (int64_t c = nj > first_col(j, i) ? nj : first_col(j, i); c < j->N; c++)
                atb_one(j, i, c);
    }
    for (int64_t i = mi + index; i < j->M; i += count)
        for (int64_t c = first_col(j, i); c < j->N; c++)
            atb_one(j, i, c);
}

void exl_qz_atb(exl_pool *pool, int64_t M, int64_t N, int64_t rows, float alpha, const float *A, int64_t lda,
                const float *B, int64_t ldb, float *C, int64_t ldc, int upper) {
    atb_job j = {M, N, rows, alpha, A, B, lda, ldb, C, ldc, upper};
    exl_pool_run_work(pool, atb_task, &j, rows * M * N / (upper ? 2 : 1));
}
