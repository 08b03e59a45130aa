/* linear_load.c - find a linear layer's tensors and hand them to the backend.
 *
 * The format is detected per layer by tensor name: <prefix>.q_weight is EXL2,
 * <prefix>.qweight is GPTQ, <prefix>.weight is unquantized. */
#include "model/model.h"

#include "base/error.h"

#include <stdio.h>

static exl_status load_bias(exl_model *m, const char *prefix, int64_t out, exl_linear_src *src) {
    char name[512];
    snprintf(name, sizeof name, "%s.bias", prefix);
    const exl_st_tensor *t;
    int64_t shape[1] = {out};
    EXL_TRY(exl_weights_get(m->weights, name, EXL_DTYPES_FLOAT, 1, shape, &t));
    src->bias = t->data;
    src->bias_dtype = t->dtype;
    return EXL_OK;
}

exl_status exl_model_load_linear(exl_model *m, const char *prefix, int64_t in, int64_t out, int has_bias,
                                 exl_linear **w) {
    char name[512];
    exl_linear_src src = {0};
    src.in_features = in;
    src.out_features = out;
    src.name = prefix;
    snprintf(name, sizeof name, "%s.q_weight", prefix);
    int is_exl2 = exl_weights_find(m->weights, name) != NULL;
    snprintf(name, sizeof name, "%s.qweight", prefix);
    int is_gptq = exl_weights_find(m->weights, name) != NULL;
    if (is_exl2 || is_gptq)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: %s quantized layers are not supported yet", prefix,
                        is_exl2 ? "EXL2" : "GPTQ");
    snprintf(name, sizeof name, "%s.weight", prefix);
    const exl_st_tensor *t;
    int64_t shape[2] = {out, in};
    EXL_TRY(exl_weights_get(m->weights, name, EXL_DTYPES_FLOAT, 2, shape, &t));
    src.kind = EXL_LINEAR_DENSE;
    src.dense.dtype = t->dtype;
    src.dense.data = t->data;
    if (has_bias)
        EXL_TRY(load_bias(m, prefix, out, &src));
    return m->be->ops->linear_init(m->be, &src, w);
}
