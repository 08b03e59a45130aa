/* hessian.c - H = 2/n · XᵀX of the inputs a linear layer saw during calibration. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"

#include <string.h>

exl_status exl_hessian_init(exl_hessian *h, int64_t K) {
    h->K = K;
    h->n = 0;
    h->be = NULL;
    h->dev = NULL;
    if (!(h->H = exl_calloc((size_t)(K * K), sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory for a %lld x %lld Hessian", (long long)K, (long long)K);
    return EXL_OK;
}

static void free_dev(exl_hessian *h) {
    if (h->dev)
        h->be->ops->free(h->be, h->dev);
    h->dev = NULL;
}

void exl_hessian_free(exl_hessian *h) {
    free_dev(h);
    exl_free(h->H);
    h->H = NULL;
}

/* H += XᵀX. exl_hessian_finish reads the upper triangle only: on the CPU that is all that is computed (exl_qz_atb,
 * the quantizer's own kernel); another backend's host_gemm takes the whole at once (one transfer, a fresh H not
 * read). */
exl_status exl_hessian_add(exl_hessian *h, const float *x, int64_t rows, exl_backend *be) {
    int64_t K = h->K;
    exl_pool *pool = exl_backend_cpu_pool(be);
    if (pool) {
        exl_qz_atb(pool, K, K, rows, 1.0f, x, K, x, K, h->H, K, 1);
    } else {
        EXL_TRY(be->ops->host_gemm(be, 1, 0, K, K, rows, 1.0f, x, K, x, K, h->n ? 1.0f : 0.0f, h->H, K));
    }
    h->n += rows;
    return EXL_OK;
}

/* On a backend (a GPU) the sum stays in its memory, and the rows need not come to the host. */
exl_status exl_hessian_add_on(exl_hessian *h, const float *x, int64_t rows, exl_backend *be) {
    int64_t K = h->K;
    if (!h->dev) {
        if (!(h->dev = be->ops->alloc(be, (size_t)(K * K) * sizeof(float))))
            return exl_fail(EXL_ERR_NOMEM, "out of %s memory for a %lld x %lld Hessian", be->name, (long long)K,
                            (long long)K);
        h->be = be;
    }
    EXL_TRY(be->ops->gemm(be, 1, 0, K, K, rows, 1.0f, x, K, x, K, h->n ? 1.0f : 0.0f, h->dev, K));
    h->n += rows;
    return EXL_OK;
}

exl_status exl_hessian_finish(exl_hessian *h) {
    int64_t K = h->K;
    if (h->dev) {
        exl_status st = h->be->ops->download(h->be, h->H, h->dev, (size_t)(K * K) * sizeof(float));
        free_dev(h);
        EXL_TRY(st);
    }
    float s = h->n > 0 ? 2.0f / (float)h->n : 0.0f;
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = i; j < K; j++)
            h->H[j * K + i] = h->H[i * K + j] *= s;
    return EXL_OK;
}

void exl_hessian_identity(exl_hessian *h) {
    free_dev(h);
    memset(h->H, 0, (size_t)(h->K * h->K) * sizeof(float));
    for (int64_t i = 0; i < h->K; i++)
        h->H[i * h->K + i] = 1.0f;
    h->n = 1;
}
