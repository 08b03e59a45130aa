/* trial_linear.c - a backend linear made from fp32 weights the quantizer computed (a candidate's dequantized
 * weights, or the quantized ones), to run the model's own layer with them. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"

exl_status exl_qz_trial_init(exl_backend *be, const float *W, const exl_linear_src *like, exl_qz_trial *out) {
    int64_t K = like->in_features, N = like->out_features;
    out->w = NULL;
    if (!(out->wt = exl_malloc((size_t)(K * N) * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory for a %lld x %lld trial linear", (long long)K, (long long)N);
    for (int64_t n = 0; n < N; n++) /* W [K, N] to the Hugging Face layout [N, K] */
        for (int64_t k = 0; k < K; k++)
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
