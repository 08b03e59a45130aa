/* hessian.c - H = 2/n · XᵀX of the inputs a linear layer saw during calibration. */
#include "convert/qz.h"

#include "backend/cpu/kernels.h"
#include "base/alloc.h"
#include "base/error.h"

#include <string.h>

exl_status exl_hessian_init(exl_hessian *h, int64_t K) {
    h->K = K;
    h->n = 0;
    if (!(h->H = exl_calloc((size_t)(K * K), sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory for a %lld x %lld Hessian", (long long)K, (long long)K);
    return EXL_OK;
}

void exl_hessian_free(exl_hessian *h) {
    exl_free(h->H);
    h->H = NULL;
}

/* Rows of x are taken CHUNK at a time, transposed so each input feature's values are
 * contiguous, and the upper triangle of H gains their dot products through the CPU's
 * SIMD kernels (backend/cpu/kernels.h), tiles of rows of H split across the pool. */
#define CHUNK 128

typedef struct add_ctx {
    exl_hessian *h;
    const float *xt; /* [K, CHUNK] */
    int64_t n;       /* rows in this chunk */
    const exl_cpu_kernels *k;
} add_ctx;

/* H[i .. i+nr, j .. j+EXL_CPU_NC] += the tile's dot products, upper triangle only. */
static void add_tile(const add_ctx *c, int64_t i, int nr, int64_t j) {
    int64_t K = c->h->K;
    float acc[EXL_CPU_MAX_NR * EXL_CPU_NC];
    const float *w[EXL_CPU_NC];
    for (int b = 0; b < EXL_CPU_NC; b++)
        w[b] = c->xt + (j + b < K ? j + b : K - 1) * CHUNK;
    if (c->k->block_f32)
        c->k->block_f32(c->xt + i * CHUNK, CHUNK, nr, w, c->n, acc);
    else
        for (int b = 0; b < EXL_CPU_NC; b++) {
            float col[EXL_CPU_MAX_NR];
            c->k->dot_f32(c->xt + i * CHUNK, CHUNK, nr, w[b], c->n, col);
            for (int a = 0; a < nr; a++)
                acc[a * EXL_CPU_NC + b] = col[a];
        }
    for (int a = 0; a < nr; a++)
        for (int b = 0; b < EXL_CPU_NC && j + b < K; b++)
            if (j + b >= i + a)
                c->h->H[(i + a) * K + j + b] += acc[a * EXL_CPU_NC + b];
}

/* Thread `index` owns the tiles of rows index, index + count, ... (in units of
 * EXL_CPU_MAX_NR rows), which spreads the triangle's work evenly. */
static void add_task(void *ctx, int index, int count) {
    const add_ctx *c = ctx;
    int64_t K = c->h->K;
    for (int64_t i = (int64_t)index * EXL_CPU_MAX_NR; i < K; i += (int64_t)count * EXL_CPU_MAX_NR) {
        int nr = K - i < EXL_CPU_MAX_NR ? (int)(K - i) : EXL_CPU_MAX_NR;
        for (int64_t j = i; j < K; j += EXL_CPU_NC)
            add_tile(c, i, nr, j);
    }
}

/* The whole of H (both triangles; exl_hessian_finish mirrors the upper one) += XᵀX at once;
 * a fresh H (n = 0, all zeros) is not uploaded. */
static exl_status add_accel(exl_hessian *h, const float *x, int64_t rows, exl_backend *accel) {
    int64_t K = h->K;
    EXL_TRY(accel->ops->host_gemm(accel, 1, 0, K, K, rows, 1.0f, x, K, x, K, h->n ? 1.0f : 0.0f, h->H, K));
    h->n += rows;
    return EXL_OK;
}

exl_status exl_hessian_add(exl_hessian *h, const float *x, int64_t rows, exl_pool *pool, exl_backend *accel) {
    int64_t K = h->K;
    if (accel && rows * K * K >= EXL_HOST_GEMM_MIN_WORK)
        return add_accel(h, x, rows, accel);
    float *xt = exl_malloc((size_t)(K * CHUNK) * sizeof(float));
    if (!xt)
        return exl_fail(EXL_ERR_NOMEM, "out of memory for the Hessian (K = %lld)", (long long)K);
    add_ctx c = {h, xt, 0, exl_cpu_kernels_best()};
    for (int64_t t0 = 0; t0 < rows; t0 += CHUNK) {
        c.n = rows - t0 < CHUNK ? rows - t0 : CHUNK;
        for (int64_t t = 0; t < c.n; t++)
            for (int64_t i = 0; i < K; i++)
                xt[i * CHUNK + t] = x[(t0 + t) * K + i];
        exl_pool_run_work(pool, add_task, &c, c.n * K * K / 2);
    }
    exl_free(xt);
    h->n += rows;
    return EXL_OK;
}

void exl_hessian_finish(exl_hessian *h) {
    int64_t K = h->K;
    float s = h->n > 0 ? 2.0f / (float)h->n : 0.0f;
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = i; j < K; j++)
            h->H[j * K + i] = h->H[i * K + j] *= s;
}

void exl_hessian_identity(exl_hessian *h) {
    memset(h->H, 0, (size_t)(h->K * h->K) * sizeof(float));
    for (int64_t i = 0; i < h->K; i++)
        h->H[i * h->K + i] = 1.0f;
    h->n = 1;
}
