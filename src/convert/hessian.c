/* hessian.c - H = 2/n · XᵀX of the inputs a linear layer saw during calibration. */
#include "convert/qz.h"

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

/* Rows of H a product takes on the CPU (see exl_hessian_add). */
#define STRIPE 128

/* H += XᵀX; a fresh H (n = 0, all zeros) is not read. exl_hessian_finish reads the upper triangle only: on the CPU
 * that is computed alone, in stripes of STRIPE rows from the diagonal on (each value the same dot product as in the
 * whole product, about 0.55-0.6 of its work); another backend's host_gemm takes the whole at once (one transfer). */
exl_status exl_hessian_add(exl_hessian *h, const float *x, int64_t rows, exl_backend *be) {
    int64_t K = h->K;
    float beta = h->n ? 1.0f : 0.0f;
    if (!exl_backend_cpu_pool(be))
        EXL_TRY(be->ops->host_gemm(be, 1, 0, K, K, rows, 1.0f, x, K, x, K, beta, h->H, K));
    for (int64_t i0 = 0; exl_backend_cpu_pool(be) && i0 < K; i0 += STRIPE) {
        int64_t m = K - i0 < STRIPE ? K - i0 : STRIPE;
        EXL_TRY(be->ops->host_gemm(be, 1, 0, m, K - i0, rows, 1.0f, x + i0, K, x + i0, K, beta, h->H + i0 * K + i0, K));
    }
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
