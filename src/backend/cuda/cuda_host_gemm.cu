/* cuda_host_gemm.cu - host_gemm: an fp32 GEMM on host pointers (the quantizer's big products)
 * through cuBLAS in strict fp32 (and gemm, the same on device pointers) (CUBLAS_COMPUTE_32F_PEDANTIC: no TF32 or other reduced
 * precision, so results match the CPU up to fp32 rounding).
 *
 * C is taken in chunks of rows and the contraction in chunks of K, so no staged operand
 * exceeds EXL_CUDA_HOST_GEMM_LIMIT floats (default 2^28 = 1 GiB; the environment variable of
 * that name lowers it, for tests of the chunking). Each C chunk is uploaded (unless beta is 0),
 * accumulated over the K chunks on the device and downloaded; op(B) is uploaded once when K
 * is not split. The staging buffer grows on demand (exl_cuda_ensure) and is kept until the
 * backend is destroyed. Synchronous. */
#include "backend/cuda/cuda_internal.h"

#include <stdlib.h>

#define HOST_GEMM_LIMIT ((int64_t)1 << 28)

static int64_t limit_floats(void) {
    const char *s = getenv("EXL_CUDA_HOST_GEMM_LIMIT");
    long long v = s ? atoll(s) : 0;
    return v > 0 && v < HOST_GEMM_LIMIT ? (int64_t)v : HOST_GEMM_LIMIT;
}

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* A rows x cols block of a row-major host matrix (leading dimension ld) to or from a
 * compact device matrix; one linear copy when the block is contiguous. */
static cudaError_t copy_block(exl_cuda_backend *cb, float *dst, int64_t dld, const float *src, int64_t sld,
                              int64_t rows, int64_t cols, cudaMemcpyKind kind) {
    size_t w = (size_t)cols * sizeof(float);
    if (dld == cols && sld == cols)
        return cudaMemcpyAsync(dst, src, w * (size_t)rows, kind, cb->stream);
    return cudaMemcpy2DAsync(dst, (size_t)dld * sizeof(float), src, (size_t)sld * sizeof(float), w, (size_t)rows, kind,
                             cb->stream);
}

static exl_status put_block(exl_cuda_backend *cb, float *dst, const float *src, int64_t ld, int64_t rows,
                            int64_t cols) {
    CUDA_CHECK(copy_block(cb, dst, cols, src, ld, rows, cols, cudaMemcpyHostToDevice), "host_gemm upload");
    return EXL_OK;
}

static exl_status get_block(exl_cuda_backend *cb, float *dst, int64_t ld, const float *src, int64_t rows,
                            int64_t cols) {
    CUDA_CHECK(copy_block(cb, dst, ld, src, cols, rows, cols, cudaMemcpyDeviceToHost), "host_gemm download");
    CUDA_CHECK(cudaStreamSynchronize(cb->stream), "host_gemm");
    return EXL_OK;
}

/* dC [mc, N] = alpha·op(dA)·op(dB) + beta·dC on compact device matrices. Row-major
 * C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: cuBLAS gets B first. */
static exl_status gemm_chunk(exl_cuda_backend *cb, int trans_a, int trans_b, int64_t mc, int64_t N, int64_t kc,
                             float alpha, const float *dA, const float *dB, float beta, float *dC) {
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasStatus_t s = cublasGemmEx(cb->cublas, op_b, op_a, (int)N, (int)mc, (int)kc, &alpha, dB, CUDA_R_32F,
                                    (int)(trans_b ? kc : N), dA, CUDA_R_32F, (int)(trans_a ? mc : kc), &beta, dC,
                                    CUDA_R_32F, (int)N, CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return exl_cuda_fail(EXL_ERR_DEVICE, "cuBLAS: host_gemm: %s", cublasGetStatusString(s));
    return EXL_OK;
}

exl_status exl_cuda_host_gemm(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                              const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                              int64_t ldc) {
    exl_cuda_backend *cb = exl_cuda(be);
    /* empty products as the CPU takes them: nothing to write, or C = beta * C */
    if (M == 0 || N == 0)
        return EXL_OK;
    if (K == 0 && M > 0 && N > 0) {
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++)
                C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
        return EXL_OK;
    }
    if (M < 1 || N < 1 || K < 1 || N > INT32_MAX)
        return exl_cuda_fail(EXL_ERR_ARG, "host_gemm: unsupported shape %lld x %lld x %lld", (long long)M, (long long)N,
                             (long long)K);
    exl_cuda_graph_finish(cb);
    int64_t lim = limit_floats();
    int64_t kc = min64(K, lim / N > 1 ? lim / N : 1), wide = N > kc ? N : kc;
    int64_t mc = min64(M, lim / wide > 1 ? lim / wide : 1);
    if (!exl_cuda_ensure(cb, (void **)&cb->host_gemm_buf, &cb->host_gemm_bytes,
                         (size_t)(mc * kc + kc * N + mc * N) * sizeof(float), "host_gemm staging"))
        return exl_cuda_take_sticky(cb);
    float *dA = cb->host_gemm_buf, *dB = dA + mc * kc, *dC = dB + kc * N;
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        int64_t mr = min64(mc, M - m0);
        if (beta != 0.0f)
            EXL_TRY(put_block(cb, dC, C + m0 * ldc, ldc, mr, N));
        for (int64_t k0 = 0; k0 < K; k0 += kc) {
            int64_t kr = min64(kc, K - k0);
            EXL_TRY(trans_a ? put_block(cb, dA, A + k0 * lda + m0, lda, kr, mr)
                            : put_block(cb, dA, A + m0 * lda + k0, lda, mr, kr));
            if (m0 == 0 || kc < K) /* with one K chunk, op(B) stays on the device */
                EXL_TRY(trans_b ? put_block(cb, dB, B + k0, ldb, N, kr) : put_block(cb, dB, B + k0 * ldb, ldb, kr, N));
            EXL_TRY(gemm_chunk(cb, trans_a, trans_b, mr, N, kr, alpha, dA, dB, k0 ? 1.0f : beta, dC));
        }
        EXL_TRY(get_block(cb, C + m0 * ldc, ldc, dC, mr, N));
    }
    return EXL_OK;
}

/* The same product on device pointers, queued on the stream (row-major as above: cuBLAS gets B first). */
exl_status exl_cuda_gemm(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C, int64_t ldc) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (M == 0 || N == 0)
        return EXL_OK;
    if (M < 1 || N < 1 || K < 1 || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX)
        return exl_cuda_fail(EXL_ERR_ARG, "gemm: unsupported shape %lld x %lld x %lld", (long long)M, (long long)N,
                             (long long)K);
    exl_cuda_graph_finish(cb);
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasStatus_t s = cublasGemmEx(cb->cublas, op_b, op_a, (int)N, (int)M, (int)K, &alpha, B, CUDA_R_32F, (int)ldb, A,
                                    CUDA_R_32F, (int)lda, &beta, C, CUDA_R_32F, (int)ldc, CUBLAS_COMPUTE_32F_PEDANTIC,
                                    CUBLAS_GEMM_DEFAULT);
    if (s != CUBLAS_STATUS_SUCCESS)
        return exl_cuda_fail(EXL_ERR_DEVICE, "cuBLAS: gemm: %s", cublasGetStatusString(s));
    return exl_cuda_take_sticky(cb);
}
