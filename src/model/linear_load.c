/* linear_load.c - find a linear layer's tensors and hand them to the backend.
 *
 * The format is detected per layer by tensor name: <prefix>.q_weight is EXL2,
 * <prefix>.qweight is GPTQ, <prefix>.weight is unquantized; one model may mix them.
 * The quantized layouts are parsed and validated by format/. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"
#include "format/quant.h"

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

static exl_status load_dense(exl_model *m, const char *prefix, exl_linear_src *src) {
    char name[512];
    snprintf(name, sizeof name, "%s.weight", prefix);
    const exl_st_tensor *t;
    int64_t shape[2] = {src->out_features, src->in_features};
    EXL_TRY(exl_weights_get(m->weights, name, EXL_DTYPES_FLOAT, 2, shape, &t));
    src->kind = EXL_LINEAR_DENSE;
    src->dense.dtype = t->dtype;
    src->dense.data = t->data;
    return EXL_OK;
}

static exl_status record(exl_model *m, const exl_linear_src *src, const exl_linear *w) {
    if (m->n_linears == m->cap_linears) {
        int32_t cap = m->cap_linears ? 2 * m->cap_linears : 16;
        exl_linear_record *r = exl_realloc(m->linears, (size_t)cap * sizeof *r);
        if (!r)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        m->linears = r;
        m->cap_linears = cap;
    }
    exl_linear_record *r = &m->linears[m->n_linears++];
    snprintf(r->name, sizeof r->name, "%s", src->name);
    r->src = *src;
    r->src.name = NULL; /* the record array moves as it grows: use r->name */
    r->w = w;
    return EXL_OK;
}

exl_status exl_model_linear_find(exl_model *m, const char *prefix, int64_t in, int64_t out, int has_bias,
                                 exl_linear_src *out_src) {
    char name[512];
    exl_linear_src src = {0};
    src.in_features = in;
    src.out_features = out;
    src.name = prefix;
    snprintf(name, sizeof name, "%s.q_weight", prefix);
    int is_exl2 = exl_weights_find(m->weights, name) != NULL;
    snprintf(name, sizeof name, "%s.qweight", prefix);
    int is_gptq = exl_weights_find(m->weights, name) != NULL;
    if (is_exl2 && is_gptq)
        return exl_fail(EXL_ERR_FORMAT, "%s: both EXL2 (q_weight) and GPTQ (qweight) tensors", prefix);
    if (is_exl2)
        EXL_TRY(exl_exl2_load(m->weights, prefix, &src));
    else if (is_gptq)
        EXL_TRY(exl_gptq_load(m->weights, &m->cfg.quant, prefix, &src));
    else
        EXL_TRY(load_dense(m, prefix, &src));
    if (has_bias)
        EXL_TRY(load_bias(m, prefix, out, &src));
    *out_src = src;
    return EXL_OK;
}

exl_status exl_model_linear_add(exl_model *m, const exl_linear_src *src, exl_linear **w) {
    EXL_TRY(m->be->ops->linear_init(m->be, src, w));
    return record(m, src, *w);
}

exl_status exl_model_load_linear(exl_model *m, const char *prefix, int64_t in, int64_t out, int has_bias,
                                 exl_linear **w) {
    exl_linear_src src;
    EXL_TRY(exl_model_linear_find(m, prefix, in, out, has_bias, &src));
    return exl_model_linear_add(m, &src, w);
}
