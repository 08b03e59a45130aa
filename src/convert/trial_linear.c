/* trial_linear.c - a backend linear made from fp32 weights the quantizer computed (a candidate's dequantized
 * weights, or the quantized ones), to run the model's own layer with them. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"

#define TILE 32

typedef struct transpose_ctx {
    const float *W; /* [K, N] */
    void *wt;       /* [N, K] fp32, or fp16 when half */
    int64_t K, N;
    int half;
} transpose_ctx;

/* This thread's rows of wt, by tiles (a column walk of W would miss the cache every step). */
static void transpose_task(void *ctx, int index, int count) {
    const transpose_ctx *c = ctx;
    int64_t K = c->K, N = c->N;
    long n_begin, n_end;
    exl_split_range((long)N, index, count, TILE, &n_begin, &n_end);
    for (int64_t n0 = n_begin; n0 < n_end; n0 += TILE)
        for (int64_t k0 = 0; k0 < K; k0 += TILE)
            for (int64_t n = n0; n < n_end && n < n0 + TILE; n++)
                for (int64_t k = k0; k < K && k < k0 + TILE; k++) {
                    float v = c->W[k * N + n];
                    if (c->half)
                        ((uint16_t *)c->wt)[n * K + k] = exl_f32_to_f16(v);
                    else
                        ((float *)c->wt)[n * K + k] = v;
                }
}

/* wt = W transposed (fp16 off the CPU) */
static void transpose(exl_backend *be, exl_pool *pool, const float *W, void *wt, int64_t K, int64_t N) {
    transpose_ctx c = {W, wt, K, N, exl_backend_cpu_pool(be) == NULL};
    if (pool)
        exl_pool_run_work(pool, transpose_task, &c, K * N);
    else
        transpose_task(&c, 0, 1);
}

exl_status exl_qz_trial_init(exl_backend *be, exl_pool *pool, const float *W, const exl_linear_src *like,
                             exl_qz_trial *out) {
    int64_t K = like->in_features, N = like->out_features;
    /* the CPU runs fp32 weights as they are; another backend stores dense weights as fp16, converted here across the
     * pool rather than by its upload on one thread */
    int half = exl_backend_cpu_pool(be) == NULL;
    out->w = NULL;
    out->K = K;
    out->N = N;
    if (!(out->wt = exl_malloc((size_t)(K * N) * (half ? sizeof(uint16_t) : sizeof(float)))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory for a %lld x %lld trial linear", (long long)K, (long long)N);
    transpose(be, pool, W, out->wt, K, N);
    exl_linear_src src = *like;
    src.kind = EXL_LINEAR_DENSE;
    src.dense = (exl_dense_src){half ? EXL_DTYPE_F16 : EXL_DTYPE_F32, out->wt};
    exl_status st = be->ops->linear_init(be, &src, &out->w);
    if (st != EXL_OK)
        exl_qz_trial_free(be, out);
    return st;
}

exl_status exl_qz_trial_init_as(exl_backend *be, const exl_linear_src *like, exl_qz_trial *out) {
    out->w = NULL;
    out->wt = NULL;
    out->K = like->in_features;
    out->N = like->out_features;
    return be->ops->linear_init(be, like, &out->w);
}

exl_status exl_qz_trial_set(exl_backend *be, exl_pool *pool, const float *W, exl_qz_trial *t) {
    transpose(be, pool, W, t->wt, t->K, t->N);
    exl_dense_src src = {exl_backend_cpu_pool(be) ? EXL_DTYPE_F32 : EXL_DTYPE_F16, t->wt};
    return be->ops->linear_set_dense(be, t->w, &src);
}

void exl_qz_trial_free(exl_backend *be, exl_qz_trial *t) {
    if (t->w)
        be->ops->linear_free(be, t->w);
    exl_free(t->wt);
    t->w = NULL;
    t->wt = NULL;
}
