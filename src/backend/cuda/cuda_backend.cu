/* cuda_backend.cu - the CUDA backend: device selection, memory (EXL_CUDA_MEMORY_LIMIT), errors, the op table.
 *
 * Exported (C linkage, default visibility; everything else in the library is hidden):
 *   exl_backend_cuda_set_error_sink  - registry.c passes the core's error setter first
 *   exl_backend_cuda_create          - a backend on device 0, or a status with a message
 *   exl_backend_cuda_create_on       - the same on a given device, made current on the calling thread */
#include "backend/cuda/cuda_internal.h"

#include "base/half.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define EXL_CUDA_EXPORT extern "C" __attribute__((visibility("default")))

typedef void (*exl_error_sink)(exl_status st, const char *msg);
static exl_error_sink error_sink;

EXL_CUDA_EXPORT void exl_backend_cuda_set_error_sink(exl_error_sink sink) { error_sink = sink; }

EXL_CUDA_EXPORT int exl_backend_cuda_abi(void) { return EXL_BACKEND_ABI; }

/* ---- errors */

exl_status exl_cuda_fail(exl_status st, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (error_sink)
        error_sink(st, msg);
    return st;
}

void exl_cuda_set_sticky(exl_cuda_backend *cb, exl_status st, const char *fmt, ...) {
    if (cb->sticky != EXL_OK)
        return;
    cb->sticky = st;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cb->sticky_msg, sizeof cb->sticky_msg, fmt, ap);
    va_end(ap);
}

int exl_cuda_check_launch(exl_cuda_backend *cb, const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e == cudaSuccess)
        return 1;
    exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: %s: %s", what, cudaGetErrorString(e));
    return 0;
}

/* EXL_CUDA_MEMORY_LIMIT: the device counts as no larger than this many bytes (0: its own size), to try smaller
 * GPUs on a larger one: the memory op reports that much at most, and allocations past it fail. */
static size_t memory_limit;

/* bytes, or a number with K, M, G or T (binary, also as KiB ...), KB, MB, GB or TB (decimal); 0 on junk */
static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || !(v > 0))
        return 0;
    const char *units = "KMGT", *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
    double scale = 1;
    if (u) {
        int decimal = toupper((unsigned char)end[1]) == 'B';
        for (const char *x = units; x <= u; x++)
            scale *= decimal ? 1e3 : 1024.0;
        end += decimal ? 2 : end[1] == 'i' && toupper((unsigned char)end[2]) == 'B' ? 3 : 1;
    } else if (toupper((unsigned char)*end) == 'B') {
        end++;
    }
    return *end ? 0 : (size_t)(v * scale);
}

static exl_status cu_memory(exl_backend *be, size_t *free_b, size_t *total_b) {
    CUDA_CHECK(cudaMemGetInfo(free_b, total_b), "reading the free memory");
    if (memory_limit && memory_limit < *total_b) {
        size_t used = *total_b - *free_b;
        *total_b = memory_limit;
        *free_b = used < memory_limit ? memory_limit - used : 0;
    }
    return EXL_OK;
}

exl_status exl_cuda_malloc(void **p, size_t bytes, const char *what) {
    *p = NULL;
    size_t free_b = 0, total_b = 0;
    if (memory_limit && cu_memory(NULL, &free_b, &total_b) == EXL_OK && bytes > free_b)
        return exl_cuda_fail(EXL_ERR_NOMEM,
                             "out of GPU memory allocating %.1f MiB for %s (%.1f of %.1f MiB free under "
                             "EXL_CUDA_MEMORY_LIMIT)",
                             bytes / 1048576.0, what, free_b / 1048576.0, total_b / 1048576.0);
    cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
    if (e == cudaSuccess)
        return EXL_OK;
    cudaGetLastError();
    cudaMemGetInfo(&free_b, &total_b);
    *p = NULL;
    if (e == cudaErrorMemoryAllocation)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of GPU memory allocating %.1f MiB for %s (%.1f of %.1f MiB free)",
                             bytes / 1048576.0, what, free_b / 1048576.0, total_b / 1048576.0);
    return exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: allocating %zu bytes for %s: %s", bytes, what, cudaGetErrorString(e));
}

int exl_cuda_ensure(exl_cuda_backend *cb, void **buf, size_t *have, size_t bytes, const char *what) {
    if (*have >= bytes && *buf)
        return 1;
    exl_cuda_graph_flush(cb); /* no allocation inside a capture */
    if (*buf) {
        cudaStreamSynchronize(cb->stream);
        cudaFree(*buf);
        *buf = NULL;
        *have = 0;
    }
    if (exl_cuda_malloc(buf, bytes, what) != EXL_OK) {
        exl_cuda_set_sticky(cb, EXL_ERR_NOMEM, "out of GPU memory allocating %.1f MiB for %s", bytes / 1048576.0, what);
        return 0;
    }
    *have = bytes;
    return 1;
}

/* Return (and clear) the sticky error as a status with its message. */
exl_status exl_cuda_take_sticky(exl_cuda_backend *cb) {
    if (cb->sticky == EXL_OK)
        return EXL_OK;
    exl_status st = exl_cuda_fail(cb->sticky, "%s", cb->sticky_msg);
    cb->sticky = EXL_OK;
    cb->sticky_msg[0] = 0;
    return st;
}

/* ---- memory */

static void cu_destroy(exl_backend *be) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb);
    exl_cuda_graph_free(cb);
    cudaStreamSynchronize(cb->stream);
    cudaFree(cb->scratch);
    cudaFree(cb->attn_partial);
    cudaFree(cb->fused_scratch);
    cudaFree(cb->dequant);
    cudaFree(cb->gemm_parts);
    cudaFree(cb->gemv_partial);
    cudaFree(cb->gemv_normed);
    cudaFree(cb->gemv_counters);
    cudaFree(cb->lora_fold);
    cudaFree(cb->lora_sums);
    cudaFree(cb->top_k_buf);
    cudaFree(cb->mask_buf);
    cudaFree(cb->sample_buf);
    cudaFree(cb->host_gemm_buf);
    exl_cuda_moe_free(cb);
    exl_cuda_argmax_free(cb);
    exl_cuda_sample_free(cb);
    exl_cuda_comm_release(cb);
    exl_cuda_lora_side_free(cb);
    cublasDestroy(cb->cublas);
    cudaStreamDestroy(cb->stream);
    free(cb);
}

static void *cu_alloc(exl_backend *be, size_t bytes) {
    void *p;
    exl_cuda_graph_finish(exl_cuda(be));
    return exl_cuda_malloc(&p, bytes, "a buffer") == EXL_OK ? p : NULL;
}

static void cu_free(exl_backend *be, void *p) {
    exl_cuda_graph_forget(exl_cuda(be));
    cudaStreamSynchronize(exl_cuda(be)->stream);
    cudaFree(p);
}

static exl_status cu_upload(exl_backend *be, void *dst, const void *src, size_t bytes) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (!bytes)
        return EXL_OK;
    exl_cuda_graph_finish(cb);
    /* from pageable memory the runtime stages the source before returning, so the caller
     * may reuse it at once; the copy stays ordered with the kernels on the stream */
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, cb->stream), "upload");
    return exl_cuda_take_sticky(cb);
}

static exl_status cu_download(exl_backend *be, void *dst, const void *src, size_t bytes) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb);
    if (bytes)
        CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, cb->stream), "download");
    CUDA_CHECK(cudaStreamSynchronize(cb->stream), "download");
    return exl_cuda_take_sticky(cb);
}

static exl_status cu_synchronize(exl_backend *be) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb);
    CUDA_CHECK(cudaStreamSynchronize(cb->stream), "synchronize");
    return exl_cuda_take_sticky(cb);
}

/* ---- weights */

static float dense_value(exl_dtype t, const void *data, int64_t i) {
    switch (t) {
    case EXL_DTYPE_F32: return ((const float *)data)[i];
    case EXL_DTYPE_F16: return exl_f16_to_f32(((const uint16_t *)data)[i]);
    case EXL_DTYPE_BF16: return exl_bf16_to_f32(((const uint16_t *)data)[i]);
    default: return 0;
    }
}

/* Upload n fp32 values converted from a dense source (bias, norm weights). */
static exl_status upload_f32(exl_cuda_backend *cb, float **dst, exl_dtype t, const void *data, int64_t n, float add,
                             const char *what) {
    float *h = (float *)malloc((size_t)n * sizeof(float));
    if (!h)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    for (int64_t i = 0; i < n; i++)
        h[i] = dense_value(t, data, i) + add;
    exl_status st = exl_cuda_malloc((void **)dst, (size_t)n * sizeof(float), what);
    if (st == EXL_OK && cudaMemcpy(*dst, h, (size_t)n * sizeof(float), cudaMemcpyHostToDevice) != cudaSuccess)
        st = exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: uploading %s failed", what);
    free(h);
    return st;
}

/* Dense weights go to the device as fp16 [out, in], converted on the host in slices. */
static exl_status upload_dense(exl_cuda_backend *cb, exl_linear *w, const exl_linear_src *src) {
    size_t n = (size_t)src->in_features * (size_t)src->out_features;
    EXL_TRY(exl_cuda_malloc((void **)&w->w, n * sizeof(__half), src->name ? src->name : "a dense weight"));
    const size_t slice = (size_t)1 << 22;
    uint16_t *h = (uint16_t *)malloc(slice * sizeof(uint16_t));
    if (!h)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    exl_status st = EXL_OK;
    for (size_t i0 = 0; i0 < n && st == EXL_OK; i0 += slice) {
        size_t m = n - i0 < slice ? n - i0 : slice;
        if (src->dense.dtype == EXL_DTYPE_F16)
            memcpy(h, (const uint16_t *)src->dense.data + i0, m * sizeof(uint16_t));
        else
            for (size_t i = 0; i < m; i++)
                h[i] = exl_f32_to_f16(dense_value(src->dense.dtype, src->dense.data, (int64_t)(i0 + i)));
        if (cudaMemcpy((uint16_t *)w->w + i0, h, m * sizeof(uint16_t), cudaMemcpyHostToDevice) != cudaSuccess)
            st = exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: uploading %s failed", src->name ? src->name : "weights");
    }
    free(h);
    return st;
}

/* New weights for a dense linear, in the stream's order: fp16 sources copied as they are, others converted on the
 * host in slices (from pageable memory the runtime stages each slice before the copy returns). */
static exl_status cu_linear_set_dense(exl_backend *be, exl_linear *w, const exl_dense_src *src) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb);
    if (w->kind != EXL_LINEAR_DENSE || !w->w)
        return exl_cuda_fail(EXL_ERR_ARG, "linear_set_dense: not a dense linear");
    size_t n = (size_t)w->in * (size_t)w->out;
    if (src->dtype == EXL_DTYPE_F16) {
        CUDA_CHECK(cudaMemcpyAsync(w->w, src->data, n * sizeof(__half), cudaMemcpyHostToDevice, cb->stream),
                   "linear_set_dense");
        return exl_cuda_take_sticky(cb);
    }
    const size_t slice = (size_t)1 << 20;
    uint16_t *h = (uint16_t *)malloc(slice * sizeof(uint16_t));
    if (!h)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    cudaError_t e = cudaSuccess;
    for (size_t i0 = 0; i0 < n && e == cudaSuccess; i0 += slice) {
        size_t m = n - i0 < slice ? n - i0 : slice;
        for (size_t i = 0; i < m; i++)
            h[i] = exl_f32_to_f16(dense_value(src->dtype, src->data, (int64_t)(i0 + i)));
        e = cudaMemcpyAsync((uint16_t *)w->w + i0, h, m * sizeof(uint16_t), cudaMemcpyHostToDevice, cb->stream);
    }
    free(h);
    CUDA_CHECK(e, "linear_set_dense");
    return exl_cuda_take_sticky(cb);
}

static void cu_linear_free(exl_backend *be, exl_linear *w) {
    if (!w)
        return;
    exl_cuda_graph_forget(exl_cuda(be));
    cudaStreamSynchronize(exl_cuda(be)->stream);
    cudaFree(w->w);
    cudaFree(w->bias);
    exl_cuda_qmatrix_free(&w->q);
    free(w);
}

static exl_status cu_linear_init(exl_backend *be, const exl_linear_src *src, exl_linear **out) {
    exl_cuda_backend *cb = exl_cuda(be);
    *out = NULL;
    exl_cuda_graph_finish(cb);
    if (src->in_features < 1 || src->out_features < 1 || src->in_features > INT32_MAX || src->out_features > INT32_MAX)
        return exl_cuda_fail(EXL_ERR_ARG, "%s: bad shape", src->name ? src->name : "linear");
    exl_linear *w = (exl_linear *)calloc(1, sizeof *w);
    if (!w)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    w->kind = src->kind;
    w->in = (int32_t)src->in_features;
    w->out = (int32_t)src->out_features;
    exl_status st;
    if (src->kind == EXL_LINEAR_DENSE) {
        if (src->dense.dtype != EXL_DTYPE_F16 && src->dense.dtype != EXL_DTYPE_BF16 &&
            src->dense.dtype != EXL_DTYPE_F32)
            st = exl_cuda_fail(EXL_ERR_UNSUPPORTED, "%s: dense weights must be F32, F16 or BF16", src->name);
        else
            st = upload_dense(cb, w, src);
    } else {
        st = exl_cuda_qmatrix_init(cb, src, &w->q);
    }
    if (st == EXL_OK && src->bias)
        st = upload_f32(cb, &w->bias, src->bias_dtype, src->bias, src->out_features, 0.0f, "a bias");
    if (st != EXL_OK) {
        cu_linear_free(be, w);
        return st;
    }
    *out = w;
    return EXL_OK;
}

static exl_status cu_vector_init(exl_backend *be, const exl_dense_src *src, int64_t n, float add, exl_vector **out) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_vector *v = (exl_vector *)calloc(1, sizeof *v);
    if (!v)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    exl_status st = upload_f32(exl_cuda(be), &v->v, src->dtype, src->data, n, add, "a norm weight");
    if (st != EXL_OK) {
        free(v);
        return st;
    }
    *out = v;
    return EXL_OK;
}

static void cu_vector_free(exl_backend *be, exl_vector *v) {
    if (!v)
        return;
    exl_cuda_graph_forget(exl_cuda(be));
    cudaStreamSynchronize(exl_cuda(be)->stream);
    cudaFree(v->v);
    free(v);
}

static const exl_backend_ops cuda_ops = {
    cu_destroy,
    cu_alloc,
    cu_free,
    cu_upload,
    cu_download,
    cu_synchronize,
    cu_linear_init,
    cu_linear_free,
    cu_vector_init,
    cu_vector_free,
    exl_cuda_embed,
    exl_cuda_rmsnorm,
    exl_cuda_matmul,
    exl_cuda_rope,
    exl_cuda_kv_store,
    exl_cuda_attention,
    exl_cuda_glu,
    exl_cuda_add,
    exl_cuda_gather_rows,
    exl_cuda_copy_cols,
    exl_cuda_softcap,
    exl_cuda_row_gate,
    exl_cuda_moe_route,
    exl_cuda_moe_experts,
    exl_cuda_graph_run,
    exl_cuda_host_gemm,
    exl_cuda_top_k,
    exl_cuda_argmax,
    exl_cuda_argmax_wait,
    cu_memory,
    exl_cuda_mask_logits,
    exl_cuda_comm_init,
    exl_cuda_comm_abort,
    exl_cuda_all_reduce,
    exl_cuda_gather_cols,
    exl_cuda_sample,
    exl_cuda_lora,
    cu_linear_set_dense,
    exl_cuda_sq_dist,
    exl_cuda_gemm,
    exl_cuda_sample_queue,
    exl_cuda_sample_wait,
    exl_cuda_qz_exl2_scales,
    exl_cuda_qz_rows,
    exl_cuda_qz_factor,
    exl_cuda_qz_set_trial,
};

/* ---- creation */

EXL_CUDA_EXPORT exl_status exl_backend_cuda_create_on(int device, exl_backend **out) {
    *out = NULL;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return exl_cuda_fail(EXL_ERR_DEVICE, "no CUDA device: %s", cudaGetErrorString(e));
    if (n < 1)
        return exl_cuda_fail(EXL_ERR_DEVICE, "no CUDA device found");
    if (device < 0 || device >= n)
        return exl_cuda_fail(EXL_ERR_DEVICE, "no CUDA device %d (%d found)", device, n);
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, device), "reading device properties");
    if (prop.major * 10 + prop.minor < 75)
        return exl_cuda_fail(EXL_ERR_UNSUPPORTED, "GPU %s has compute capability %d.%d; exl needs 7.5 or newer",
                             prop.name, prop.major, prop.minor);
    CUDA_CHECK(cudaSetDevice(device), "selecting the device");
    const char *limit = getenv("EXL_CUDA_MEMORY_LIMIT");
    memory_limit = limit && *limit ? parse_size(limit) : 0;
    if (limit && *limit && !memory_limit)
        return exl_cuda_fail(EXL_ERR_ARG, "EXL_CUDA_MEMORY_LIMIT=%s is not a size (such as 24GiB)", limit);
    exl_cuda_backend *cb = (exl_cuda_backend *)calloc(1, sizeof *cb);
    if (!cb)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    cb->device = device;
    cb->n_sms = prop.multiProcessorCount;
    cb->sm_major = prop.major;
    const char *pa = getenv("EXL_CUDA_PREFILL_ATTENTION");
    cb->prefill_attention_fp32 = pa && !strcmp(pa, "fp32");
    cb->pdl = prop.major >= 9 && !(getenv("EXL_CUDA_PDL") && !strcmp(getenv("EXL_CUDA_PDL"), "0"));
    const char *graphs = getenv("EXL_CUDA_GRAPHS"), *dq = getenv("EXL_CUDA_DEQUANT_ROWS");
    cb->graphs_off = graphs && !strcmp(graphs, "0");
    const char *det = getenv("EXL_CUDA_DETERMINISTIC");
    cb->deterministic = det && strcmp(det, "0") != 0;
    const char *moe = getenv("EXL_CUDA_MOE_DEVICE");
    cb->moe_host_routes = moe && !strcmp(moe, "0");
    cb->dequant_rows = dq && atoi(dq) > 0 ? atoi(dq) : EXL_CUDA_DEQUANT_ROWS_DEFAULT;
    const char *qrows = getenv("EXL_CUDA_QROWS");
    cb->qrows = !qrows || !*qrows ? EXL_CUDA_QROWS_AUTO : !strcmp(qrows, "1") ? EXL_CUDA_QROWS_ALL : EXL_CUDA_QROWS_OFF;
    const char *exact = getenv("EXL_CUDA_EXACT_PREFILL");
    cb->exact_prefill = exact && strcmp(exact, "0") != 0;
    e = cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking);
    if (e != cudaSuccess) {
        free(cb);
        return exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: creating a stream on %s: %s", prop.name, cudaGetErrorString(e));
    }
    cublasStatus_t s = cublasCreate(&cb->cublas);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasSetStream(cb->cublas, cb->stream);
    if (s != CUBLAS_STATUS_SUCCESS) {
        cudaStreamDestroy(cb->stream);
        free(cb);
        return exl_cuda_fail(EXL_ERR_DEVICE, "cuBLAS: initialising on %s: %s", prop.name, cublasGetStatusString(s));
    }
    cb->base.ops = &cuda_ops;
    cb->base.name = "cuda";
    cb->base.kv_elem_bytes = sizeof(__half);
    cb->base.step_rows = EXL_CUDA_STEP_ROWS;
    exl_cuda_qgemv_init(cb);
    exl_cuda_attention_init();
    *out = &cb->base;
    return EXL_OK;
}

EXL_CUDA_EXPORT exl_status exl_backend_cuda_create(exl_backend **out) { return exl_backend_cuda_create_on(0, out); }
