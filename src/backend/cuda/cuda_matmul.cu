/* cuda_matmul.cu - out = x·W + b on the GPU, alone or fused (exl_cuda_fused_mm).
 *
 * Few rows (decode): a GEMV that streams the weights once (dense fp16, one row: one warp per
 * output, 16-byte loads; quantized, up to 4 rows, and a wide matrix such as the head up to EXL_CUDA_QGEMV_MAX_ROWS:
 * cuda_qgemv.cu, which also fuses norm/GLU/residual). Many rows: for quantized weights the tensor-core kernel of
 * cuda_qmma.cu or, from cb->dequant_rows rows, cuBLAS over weights decoded to fp16 (cuda_qgemm.cu); for dense
 * fp16 weights cuBLAS (fp32 accumulation and output) directly. The activations of many rows are multiplied as
 * fp16 (one part), or with EXL_CUDA_EXACT_PREFILL=1 those of prompt rows as two fp16 parts (x = hi + lo: fp16
 * alone flips near-tied argmaxes of the reference logits). */
#include "backend/cuda/cuda_internal.h"

#include <string.h>

#define DENSE_WARPS 8

/* ---- dense GEMV: warp per output feature, one row (from two rows cuBLAS is faster: 4 rows of
 * a 4096x4096 matrix took 31.7 us here against 15.1 for 16 rows through cuBLAS) */

__global__ void __launch_bounds__(DENSE_WARPS * 32)
    dense_gemv_kernel(float *out, const float *x, const __half *w, int32_t in, int32_t n_out, const float *bias) {
    exl_pdl_start();
    int lane = threadIdx.x % 32;
    int n = blockIdx.x * DENSE_WARPS + threadIdx.x / 32;
    if (n >= n_out)
        return;
    const __half *wr = w + (int64_t)n * in;
    float acc = 0.0f;
    int32_t vec_end = (in % 8 == 0) ? in : 0;
    for (int32_t k = lane * 8; k < vec_end; k += 256) {
        uint4 raw = __ldg((const uint4 *)(wr + k));
        __half2 h[4];
        memcpy(h, &raw, 16);
        float2 f[4];
#pragma unroll
        for (int i = 0; i < 4; i++)
            f[i] = __half22float2(h[i]);
        const float4 *xr = (const float4 *)(x + k);
        float4 a = __ldg(xr), b = __ldg(xr + 1);
        acc += f[0].x * a.x + f[0].y * a.y + f[1].x * a.z + f[1].y * a.w + f[2].x * b.x + f[2].y * b.y + f[3].x * b.z +
               f[3].y * b.w;
    }
    for (int32_t k = vec_end + lane; k < in; k += 32)
        acc += __half2float(wr[k]) * x[k];
    for (int o = 16; o > 0; o >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0)
        out[n] = acc + (bias ? bias[n] : 0.0f);
}

static void dense_gemv(exl_cuda_backend *cb, float *out, const float *x, const exl_linear *w) {
    unsigned blocks = (unsigned)((w->out + DENSE_WARPS - 1) / DENSE_WARPS);
    exl_cuda_launch(cb, dense_gemv_kernel, dim3(blocks), dim3(DENSE_WARPS * 32), 0, out, x, w->w, w->in, w->out,
                    w->bias);
    exl_cuda_check_launch(cb, "dense GEMV");
}

/* ---- many rows: cuBLAS */

/* out[r, j] (+)= the sum over p < parts of c[p * rows + r, j] (+ bias[j]) for the stacked
 * products c [parts * rows, ldc]; with c NULL, out[r, j] += bias[j] */
__global__ void parts_sum_kernel(float *out, int64_t ldo, const float *c, int64_t ldc, int32_t n, int32_t rows,
                                 int32_t parts, const float *bias, int32_t accumulate) {
    exl_pdl_start();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)rows * n)
        return;
    int64_t r = i / n, j = i % n;
    float *o = out + r * ldo + j;
    float v = 0.0f;
    for (int p = 0; c && p < parts; p++)
        v += c[((int64_t)p * rows + r) * ldc + j];
    v += bias ? bias[j] : 0.0f;
    *o = c && !accumulate ? v : *o + v;
}

void exl_cuda_parts_sum(exl_cuda_backend *cb, float *out, int64_t ldo, const float *c, int64_t ldc, int32_t n,
                        int32_t rows, int parts, const float *bias, int accumulate) {
    int64_t total = (int64_t)rows * n;
    exl_cuda_launch(cb, parts_sum_kernel, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, out, ldo, c, ldc, n,
                    rows, parts, bias, accumulate);
    exl_cuda_check_launch(cb, "matmul parts");
}

/* column-major: cᵀ [n, cols] (+)= alpha · op(A) [n, K] · xhᵀ [K, cols] */
static void gemm_ex(exl_cuda_backend *cb, float *c, int64_t ldc, const __half *xh, int32_t cols, int32_t K,
                    const __half *a, const exl_cuda_f16w *w, int32_t n, float alpha, int accumulate) {
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK_STICKY(cb,
                        cublasGemmEx(cb->cublas, w->trans ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, n, cols, K, &alpha,
                                     a, CUDA_R_16F, (int)w->ld, xh, CUDA_R_16F, K, accumulate ? &one : &zero, c,
                                     CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                        "GEMM");
}

float *exl_cuda_gemm_stacked(exl_cuda_backend *cb, const __half *xh, int32_t xparts, int32_t rows, int32_t K,
                             const exl_cuda_f16w *w, int32_t n, int *parts) {
    *parts = xparts + (w->lo ? 1 : 0);
    if (!exl_cuda_ensure(cb, (void **)&cb->gemm_parts, &cb->gemm_parts_bytes, (size_t)*parts * rows * n * sizeof(float),
                         "matmul products"))
        return NULL;
    gemm_ex(cb, cb->gemm_parts, n, xh, xparts * rows, K, w->hi, w, n, 1.0f, 0);
    if (w->lo)
        gemm_ex(cb, cb->gemm_parts + (int64_t)xparts * rows * n, n, xh, rows, K, w->lo, w, n, 1.0f / EXL_CUDA_LO_SCALE,
                0);
    return cb->gemm_parts;
}

void exl_cuda_gemm_parts(exl_cuda_backend *cb, float *out, int64_t ldo, const __half *xh, int32_t xparts, int32_t rows,
                         int32_t K, const exl_cuda_f16w *w, int32_t n, const float *bias, int accumulate) {
    if (rows <= EXL_CUDA_STACK_ROWS) {
        int parts;
        const float *c = exl_cuda_gemm_stacked(cb, xh, xparts, rows, K, w, n, &parts);
        if (c)
            exl_cuda_parts_sum(cb, out, ldo, c, n, n, rows, parts, bias, accumulate);
        return;
    }
    for (int part = 0; part < xparts; part++)
        gemm_ex(cb, out, ldo, xh + (int64_t)part * rows * K, rows, K, w->hi, w, n, 1.0f, part || accumulate);
    if (w->lo)
        gemm_ex(cb, out, ldo, xh, rows, K, w->lo, w, n, 1.0f / EXL_CUDA_LO_SCALE, 1);
    if (bias)
        exl_cuda_parts_sum(cb, out, ldo, NULL, 0, n, rows, 0, bias, 1);
}

/* The fp16 parts of the activations of many rows: 2 (hi + lo, ~22 bits) for prompt rows with
 * EXL_CUDA_EXACT_PREFILL=1, where quantized weights of decode rows multiply 1 (hi alone, as the GEMV rounds them)
 * and dense weights always 2; 1 otherwise. */
static int act_parts(const exl_cuda_backend *cb, int decode, int dense) {
    return cb->exact_prefill && (!decode || dense) ? 2 : 1;
}

/* out = x · w + b for more rows than the GEMVs take (decode: the rows are decode tokens) */
static void matmul_gemm(exl_cuda_backend *cb, float *out, const float *x, const exl_linear *w, int32_t rows,
                        int decode) {
    const int parts = act_parts(cb, decode, w->kind == EXL_LINEAR_DENSE);
    if (w->kind != EXL_LINEAR_DENSE) {
        exl_cuda_fused_mm f;
        memset(&f, 0, sizeof f);
        f.rows = rows, f.n = 1, f.x = x, f.w[0] = w, f.out[0] = out, f.in_features = w->in;
        f.out_features[0] = w->out, f.decode = decode;
        if (rows >= cb->dequant_rows)
            exl_cuda_qgemm(cb, &f, parts);
        else
            exl_cuda_qmma(cb, out, x, NULL, 0, w, rows, 0, parts);
        return;
    }
    if (!exl_cuda_ensure(cb, &cb->scratch, &cb->scratch_bytes, (size_t)parts * rows * w->in * sizeof(__half),
                         "fp16 activations"))
        return;
    __half *xh = (__half *)cb->scratch;
    exl_cuda_split_half(cb, xh, x, NULL, 0.0f, NULL, 0, rows, w->in, parts);
    exl_cuda_f16w fw = {w->w, NULL, 1, w->in};
    exl_cuda_gemm_parts(cb, out, w->out, xh, parts, rows, w->in, &fw, w->out, w->bias, 0);
}

/* out = x · w + b, by the GEMV that takes it or matmul_gemm */
static void matmul_rows(exl_cuda_backend *cb, float *out, const float *x, const exl_linear *w, int32_t rows,
                        int decode) {
    if (rows < 1)
        return;
    exl_cuda_fused_mm f;
    memset(&f, 0, sizeof f);
    f.rows = rows, f.n = 1, f.x = x, f.w[0] = w, f.out[0] = out, f.decode = decode;
    if (exl_cuda_qgemv_takes(cb, &f))
        exl_cuda_qgemv_fused(cb, &f);
    else if (rows == 1 && w->kind == EXL_LINEAR_DENSE)
        dense_gemv(cb, out, x, w);
    else
        matmul_gemm(cb, out, x, w, rows, decode);
}

void exl_cuda_run_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows) {
    matmul_rows(exl_cuda(be), out, x, w, rows, 0);
}

/* ---- fused matmuls: the fused GEMV, or the ops one by one through fused_scratch
 * ([rows, in] normed input, then [rows, out] products to add) */

/* 1 if f's matrices are all quantized of one input width: cuda_qmma.cu or cuda_qgemm.cu add to
 * the outputs themselves */
static int all_quantized(const exl_cuda_fused_mm *f) {
    for (int i = 0; i < f->n; i++)
        if (f->w[i]->kind == EXL_LINEAR_DENSE || f->w[i]->in != f->w[0]->in)
            return 0;
    return 1;
}

/* 1 if f's matrices go through cuda_qgemm.cu together (quantized, many rows) */
static int qgemm_takes(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    return f->rows >= cb->dequant_rows && all_quantized(f);
}

size_t exl_cuda_fused_scratch_need(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    if (exl_cuda_qgemv_takes(cb, f) || qgemm_takes(cb, f))
        return 0;
    size_t n = f->norm ? (size_t)f->rows * f->in_features : 0;
    if (f->accumulate && !all_quantized(f))
        for (int i = 0; i < f->n; i++)
            n = n > (size_t)f->rows * f->out_features[i] ? n : (size_t)f->rows * f->out_features[i];
    return n;
}

void exl_cuda_run_matmul_fused(exl_backend *be, const exl_cuda_fused_mm *f) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (f->rows < 1)
        return;
    if (exl_cuda_qgemv_takes(cb, f)) {
        exl_cuda_qgemv_fused(cb, f);
        return;
    }
    if (f->x_slots || f->out_map || f->out_zeroed || f->n_clear[0] || f->n_clear[1] || f->n_clear[2]) {
        /* the plan gives these only to matmuls the GEMV takes */
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "internal: a GEMV's slot order or zeroing reached another matmul");
        return;
    }
    const int quantized = all_quantized(f), qgemm = qgemm_takes(cb, f);
    if (qgemm) { /* the norm or GLU applied by its fp16 conversion */
        exl_cuda_qgemm(cb, f, act_parts(cb, f->decode, 0));
        return;
    }
    const float *xin = f->x, *up = NULL; /* up: the GLU left to cuda_qmma.cu's activation gather */
    if (f->norm) {
        exl_cuda_run_rmsnorm(be, cb->fused_scratch, f->x, f->norm, f->rows, f->in_features, f->eps);
        xin = cb->fused_scratch;
    } else if (f->up && quantized) {
        up = f->up;
    } else if (f->up) { /* in place, as the unfused forward pass does */
        exl_cuda_run_glu(be, (float *)f->x, f->up, f->rows, f->in_features, f->act);
    }
    if (quantized) {
        for (int i = 0; i < f->n; i++)
            exl_cuda_qmma(cb, f->out[i], xin, up, f->act, f->w[i], f->rows, f->accumulate, act_parts(cb, f->decode, 0));
        return;
    }
    for (int i = 0; i < f->n; i++) {
        if (f->accumulate) {
            matmul_rows(cb, cb->fused_scratch, xin, f->w[i], f->rows, f->decode);
            exl_cuda_run_add(be, f->out[i], cb->fused_scratch, (int64_t)f->rows * f->out_features[i]);
        } else {
            matmul_rows(cb, f->out[i], xin, f->w[i], f->rows, f->decode);
        }
    }
}
