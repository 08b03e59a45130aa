/* hessian.c - H = 2/n · XᵀX of the inputs a linear layer saw during calibration. */
#include "quant/qz.h"

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

typedef struct add_ctx {
    exl_hessian *h;
    const float *x;
    int64_t rows;
} add_ctx;

/* Thread `index` owns rows index, index + count, ... of the upper triangle. */
static void add_task(void *ctx, int index, int count) {
    const add_ctx *c = ctx;
    int64_t K = c->h->K;
    for (int64_t i = index; i < K; i += count) {
        float *Hi = c->h->H + i * K;
        for (int64_t t = 0; t < c->rows; t++) {
            const float *xt = c->x + t * K;
            float a = xt[i];
            if (a == 0.0f)
                continue;
            for (int64_t j = i; j < K; j++)
                Hi[j] += a * xt[j];
        }
    }
}

void exl_hessian_add(exl_hessian *h, const float *x, int64_t rows, exl_pool *pool) {
    add_ctx c = {h, x, rows};
    exl_pool_run_work(pool, add_task, &c, rows * h->K * h->K / 2);
    h->n += rows;
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
