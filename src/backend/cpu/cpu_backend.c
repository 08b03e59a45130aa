/* cpu_backend.c - the CPU backend's op table, memory and weight handles. */
#include "backend/comm_host.h"
#include "backend/cpu/cpu.h"
#include "backend/cpu/cpu_quant.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"

#include <stdlib.h>
#include <string.h>

static void cpu_destroy(exl_backend *be) {
    exl_pool_free(exl_cpu(be)->pool);
    exl_free_aligned(exl_cpu(be)->q8_scratch);
    exl_host_comm_release(exl_cpu(be)->comm);
    exl_free_aligned(exl_cpu(be)->sample_scratch);
    exl_free(be);
}

static void *cpu_alloc(exl_backend *be, size_t bytes) {
    void *p = exl_malloc_aligned(bytes);
    if (!p)
        exl_fail(EXL_ERR_NOMEM, "out of host memory allocating %zu bytes", bytes);
    return p;
}

static void cpu_free(exl_backend *be, void *p) { exl_free_aligned(p); }

static exl_status cpu_copy(exl_backend *be, void *dst, const void *src, size_t bytes) {
    if (bytes)
        memmove(dst, src, bytes);
    return EXL_OK;
}

static exl_status cpu_synchronize(exl_backend *be) { return EXL_OK; }

static float dense_value(exl_dtype t, const void *data, int64_t i) {
    switch (t) {
    case EXL_DTYPE_F32: return ((const float *)data)[i];
    case EXL_DTYPE_F16: return exl_f16_to_f32(((const uint16_t *)data)[i]);
    case EXL_DTYPE_BF16: return exl_bf16_to_f32(((const uint16_t *)data)[i]);
    default: return 0;
    }
}

static void cpu_linear_free(exl_backend *be, exl_linear *w);

static exl_status cpu_linear_init(exl_backend *be, const exl_linear_src *src, exl_linear **out) {
    exl_linear *w = exl_calloc(1, sizeof *w);
    if (!w)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    w->src = *src;
    w->src.name = NULL; /* the caller's string need not outlive the call */
    if (src->kind != EXL_LINEAR_DENSE) {
        exl_status st = exl_cpu_qmat_init(src, &w->q);
        if (st != EXL_OK) {
            exl_free(w);
            return st;
        }
    }
    if (src->bias) {
        w->bias = exl_malloc((size_t)src->out_features * sizeof(float));
        if (!w->bias) {
            cpu_linear_free(be, w);
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        }
        for (int64_t i = 0; i < src->out_features; i++)
            w->bias[i] = dense_value(src->bias_dtype, src->bias, i);
    }
    *out = w;
    return EXL_OK;
}

static void cpu_linear_free(exl_backend *be, exl_linear *w) {
    if (!w)
        return;
    exl_cpu_qmat_free(w->q);
    exl_free(w->bias);
    exl_free(w);
}

static exl_status cpu_linear_set_dense(exl_backend *be, exl_linear *w, const exl_dense_src *src) {
    if (w->src.kind != EXL_LINEAR_DENSE || src->dtype != w->src.dense.dtype)
        return exl_fail(EXL_ERR_ARG, "linear_set_dense: not a dense linear of that dtype");
    w->src.dense.data = src->data;
    return EXL_OK;
}

/* in order, one double: what the quantizer summed on the host before this op (its results stay bit-identical) */
static exl_status cpu_sq_dist(exl_backend *be, const float *a, const float *b, int64_t n, double *acc) {
    double e = *acc;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        e += d * d;
    }
    *acc = e;
    return EXL_OK;
}

static exl_status cpu_vector_init(exl_backend *be, const exl_dense_src *src, int64_t n, float add, exl_vector **out) {
    exl_vector *v = exl_calloc(1, sizeof *v);
    if (!v || !(v->v = exl_malloc((size_t)n * sizeof(float)))) {
        exl_free(v);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    for (int64_t i = 0; i < n; i++)
        v->v[i] = dense_value(src->dtype, src->data, i) + add;
    *out = v;
    return EXL_OK;
}

static void cpu_vector_free(exl_backend *be, exl_vector *v) {
    if (!v)
        return;
    exl_free(v->v);
    exl_free(v);
}

static const exl_backend_ops cpu_ops = {
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .synchronize = cpu_synchronize,
    .linear_init = cpu_linear_init,
    .linear_free = cpu_linear_free,
    .vector_init = cpu_vector_init,
    .vector_free = cpu_vector_free,
    .embed = exl_cpu_embed,
    .rmsnorm = exl_cpu_rmsnorm,
    .matmul = exl_cpu_matmul,
    .rope = exl_cpu_rope,
    .kv_store = exl_cpu_kv_store,
    .attention = exl_cpu_attention,
    .glu = exl_cpu_glu,
    .add = exl_cpu_add,
    .gather_rows = exl_cpu_gather_rows,
    .copy_cols = exl_cpu_copy_cols,
    .softcap = exl_cpu_softcap,
    .row_gate = exl_cpu_row_gate,
    .moe_route = exl_cpu_moe_route,
    .moe_experts = exl_cpu_moe_experts,
    .host_gemm = exl_cpu_host_gemm,
    .mask_logits = exl_cpu_mask_logits,
    .comm_init = exl_cpu_comm_init,
    .comm_abort = exl_cpu_comm_abort,
    .all_reduce = exl_cpu_all_reduce,
    .gather_cols = exl_cpu_gather_cols,
    .sample = exl_cpu_sample,
    .lora = exl_cpu_lora,
    .linear_set_dense = cpu_linear_set_dense,
    .sq_dist = cpu_sq_dist,
    .gemm = exl_cpu_host_gemm, /* backend memory is host memory */
    .graph_run = exl_cpu_graph_run,
};

exl_pool *exl_backend_cpu_pool(exl_backend *be) { return be->ops == &cpu_ops ? exl_cpu(be)->pool : NULL; }

exl_status exl_backend_cpu_init(int n_threads, exl_backend **out) {
    exl_cpu_backend *be = exl_calloc(1, sizeof *be);
    if (!be)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = exl_pool_init(n_threads, &be->pool);
    if (st != EXL_OK) {
        exl_free(be);
        return st;
    }
    be->k = exl_cpu_kernels_best();
    be->qk = exl_cpu_qkernels_for(be->k->isa);
    /* int8 activations where the CPU has their kernels (AVX-512 VNNI): the fast, approximate default, as
     * llama.cpp's; EXL_CPU_ACT=fp32 picks the exact path (`exl logits` and `exl perplexity` set it by default) */
    const char *act = getenv("EXL_CPU_ACT");
    be->q8 = !(act && !strcmp(act, "fp32")) && exl_cpu_q8_for(be->qk) != NULL;
    be->base.ops = &cpu_ops;
    be->base.name = "cpu";
    /* the KV cache in fp16 where its kernels are vectorized (AVX-512), as llama.cpp's and the GPU's, except on the
     * exact path; EXL_CPU_KV=fp16|fp32 chooses either way */
    const char *kv = getenv("EXL_CPU_KV");
    be->kv16 = kv ? !strcmp(kv, "fp16") : be->q8 && !strcmp(be->k->isa, "avx512");
    be->base.kv_elem_bytes = be->kv16 ? sizeof(uint16_t) : sizeof(float);
    be->base.step_rows = EXL_CPU_STEP_ROWS;
    *out = &be->base;
    return EXL_OK;
}
