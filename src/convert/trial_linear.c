/* trial_linear.c - a backend linear made from fp32 weights the quantizer computed (a candidate's dequantized
 * weights, or the quantized ones), to run the model's own layer with them. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"

#define TILE 32

exl_status exl_qz_trial_init(exl_backend *be, const float *W, const exl_linear_src *like, exl_qz_trial *out) {
    int64_t K = like->in_features, N = like->out_features;
    out->w = NULL;
    if (!(out->wt = exl_malloc((size_t)(K * N) * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory for a %lld x %lld trial linear", (long long)K, (long long)N);
    /* W [K, N] to the Hugging Face layout [N, K], by tiles (a column walk of W would miss the cache every step) */
    for (int64_t k0 = 0; k0 < K; k0 += TILE)
        for (int64_t n0 = 0; n0 < N; n0 += TILE)
            for (int64_t n = n0; n < N && n < n0 + TILE; n++)
                for (int64_t k = k0; k < K && k < k0 + TILE; k++)
                    out->wt[n * K + k] = W[k * N + n];
    exl_linear_src src = *like;
    src.kind = EXL_LINEAR_DENSE;
    src.dense = (exl_dense_src){EXL_DTYPE_F32, out->wt};
    exl_status st = be->ops->linear_init(be, &src, &out->w);
    if (st != EXL_OK)
        exl_qz_trial_free(be, out);
    return st;
}

void exl_qz_trial_free(exl_backend *be, exl_qz_trial *t) {
    if (t->w)
        be->ops->linear_free(be, t->w);
    exl_free(t->wt);
    t->w = NULL;
    t->wt = NULL;
}
