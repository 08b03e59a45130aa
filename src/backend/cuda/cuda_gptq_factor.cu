/* cuda_gptq_factor.cu - the rest of the quantizer's GPTQ on the device: the factor of a Hessian (op qz_factor) and a
 * candidate's trial weights (op qz_set_trial).
 *
 * qz_factor: the permuted, damped Hessian A in double (its lower triangle, column-major for cuBLAS), factored by a
 * right-looking blocked Cholesky: a kernel factors each NB x NB diagonal block in shared memory and flags a pivot
 * that is not > 0, cublasDtrsm solves the panel below it, cublasDsyrk updates the trailing lower triangle. Then
 * L⁻¹ by cublasDtrsm of the identity, and U, its reversal, in fp32. convert/gptq.c's host factor computes the same in
 * double by other blocks and sums (so U differs from it at the level of double rounding before its fp32 rounding).
 * qz_set_trial: the quantized rows (act-order) back to input features and fp16, by 32 x 32 tiles, into the dense
 * linear's [out, in] weights. */
#include "backend/cuda/cuda_internal.h"

#include <cuda_fp16.h>

#define NB 64 /* columns of a diagonal block */
#define DIAG_THREADS 256
#define FILL_THREADS 256
#define TILE 32

/* A(i, j) = H[perm[K-1-i], perm[K-1-j]] (+ damp on the diagonal) for i >= j, column j at A + j·K (H symmetric: read
 * along row perm[K-1-j]) */
__global__ void factor_fill_kernel(double *A, const float *H, const int32_t *perm, int64_t K, double damp) {
    exl_pdl_start();
    int64_t j = blockIdx.y, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < j || i >= K)
        return;
    double v = (double)H[(int64_t)perm[K - 1 - j] * K + perm[K - 1 - i]];
    A[i + j * K] = i == j ? v + damp : v;
}

/* the lower Cholesky factor of the nb x nb block at A (leading dimension ld) in place; *bad = 1 at a pivot not > 0
 * (the factorization goes on with 1 there: its result is not used) */
__global__ void factor_diag_kernel(double *A, int64_t ld, int nb, int *bad) {
    __shared__ double s[NB][NB + 1]; /* s[c][r]: column c, row r */
    exl_pdl_start();
    for (int e = threadIdx.x; e < nb * nb; e += blockDim.x) {
        int r = e % nb, c = e / nb;
        if (r >= c)
            s[c][r] = A[r + c * ld];
    }
    __syncthreads();
    for (int j = 0; j < nb; j++) {
        double d = s[j][j];
        if (!(d > 0)) {
            if (threadIdx.x == 0)
                *bad = 1;
            d = 1;
        }
        d = sqrt(d);
        __syncthreads(); /* every thread read s[j][j] */
        for (int r = j + (int)threadIdx.x; r < nb; r += blockDim.x)
            s[j][r] = r == j ? d : s[j][r] / d;
        __syncthreads();
        int m = nb - j - 1;
        for (int e = threadIdx.x; e < m * m; e += blockDim.x) {
            int r = j + 1 + e % m, c = j + 1 + e / m;
            if (r >= c)
                s[c][r] -= s[j][r] * s[j][c];
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < nb * nb; e += blockDim.x) {
        int r = e % nb, c = e / nb;
        if (r >= c)
            A[r + c * ld] = s[c][r];
    }
}

/* B = the K x K identity (column-major) */
__global__ void factor_identity_kernel(double *B, int64_t K) {
    exl_pdl_start();
    int64_t j = blockIdx.y, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < K)
        B[i + j * K] = i == j ? 1.0 : 0.0;
}

/* U[K-1-i, K-1-j] = X(i, j) for j <= i, 0 above (U row-major, X = L⁻¹ column-major) */
__global__ void factor_u_kernel(float *U, const double *X, int64_t K) {
    exl_pdl_start();
    int64_t j = blockIdx.y, i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < K)
        U[(K - 1 - i) * K + (K - 1 - j)] = j <= i ? (float)X[i + j * K] : 0.0f;
}

exl_status exl_cuda_qz_factor(exl_backend *be, float *U, const float *H, const int32_t *perm, int64_t K, double damp,
                              int *ok) {
    exl_cuda_backend *cb = exl_cuda(be);
    *ok = 0;
    if (K < 1 || K > 65535)
        return exl_cuda_fail(EXL_ERR_ARG, "qz_factor: unsupported size %lld", (long long)K);
    exl_cuda_graph_finish(cb);
    size_t kk = (size_t)K * (size_t)K;
    char *work = NULL;
    CUDA_CHECK(cudaMallocAsync((void **)&work, 2 * kk * sizeof(double) + kk * sizeof(float) + (size_t)K * 4 + 16,
                               cb->stream),
               "qz_factor");
    double *A = (double *)work, *B = A + kk;
    float *Hd = (float *)(B + kk);
    int32_t *pd = (int32_t *)(Hd + kk);
    int *bad = (int *)(pd + K), flag = 0;
    cudaError_t e = cudaMemcpyAsync(Hd, H, kk * sizeof(float), cudaMemcpyHostToDevice, cb->stream);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(pd, perm, (size_t)K * sizeof(int32_t), cudaMemcpyHostToDevice, cb->stream);
    if (e == cudaSuccess)
        e = cudaMemsetAsync(bad, 0, sizeof(int), cb->stream);
    dim3 grid((unsigned)((K + FILL_THREADS - 1) / FILL_THREADS), (unsigned)K);
    if (e == cudaSuccess) {
        exl_cuda_launch(cb, factor_fill_kernel, grid, dim3(FILL_THREADS), 0, A, (const float *)Hd, (const int32_t *)pd,
                        K, damp);
        const double one = 1.0, minus_one = -1.0;
        for (int64_t k0 = 0; k0 < K; k0 += NB) {
            int nb = (int)(K - k0 < NB ? K - k0 : NB);
            int rows = (int)(K - k0 - nb);
            double *a11 = A + k0 + k0 * K;
            exl_cuda_launch(cb, factor_diag_kernel, dim3(1), dim3(DIAG_THREADS), 0, a11, K, nb, bad);
            if (rows == 0)
                break;
            double *a21 = a11 + nb, *a22 = a21 + (int64_t)nb * K;
            CUBLAS_CHECK_STICKY(cb,
                                cublasDtrsm(cb->cublas, CUBLAS_SIDE_RIGHT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_T,
                                            CUBLAS_DIAG_NON_UNIT, rows, nb, &one, a11, (int)K, a21, (int)K),
                                "qz_factor panel");
            CUBLAS_CHECK_STICKY(cb,
                                cublasDsyrk(cb->cublas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, rows, nb, &minus_one, a21,
                                            (int)K, &one, a22, (int)K),
                                "qz_factor update");
        }
        exl_cuda_check_launch(cb, "qz_factor");
        e = cudaMemcpyAsync(&flag, bad, sizeof(int), cudaMemcpyDeviceToHost, cb->stream);
    }
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cb->stream);
    if (e == cudaSuccess && !flag) {
        exl_cuda_launch(cb, factor_identity_kernel, grid, dim3(FILL_THREADS), 0, B, K);
        const double one = 1.0;
        CUBLAS_CHECK_STICKY(cb,
                            cublasDtrsm(cb->cublas, CUBLAS_SIDE_LEFT, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N,
                                        CUBLAS_DIAG_NON_UNIT, (int)K, (int)K, &one, A, (int)K, B, (int)K),
                            "qz_factor inverse");
        exl_cuda_launch(cb, factor_u_kernel, grid, dim3(FILL_THREADS), 0, U, (const double *)B, K);
        exl_cuda_check_launch(cb, "qz_factor");
        *ok = 1;
    }
    cudaError_t f = cudaFreeAsync(work, cb->stream);
    CUDA_CHECK(e != cudaSuccess ? e : f, "qz_factor");
    exl_status st = exl_cuda_take_sticky(cb);
    if (st != EXL_OK)
        *ok = 0;
    return st;
}

/* the linear's w[n, perm[r]] = fp16(W[r, n]) over a 32 x 32 tile (rows r, columns n) */
__global__ void set_trial_kernel(__half *w, const float *W, const int32_t *perm, int64_t K, int64_t N) {
    __shared__ float t[TILE][TILE + 1];
    exl_pdl_start();
    int64_t r0 = (int64_t)blockIdx.y * TILE, n0 = (int64_t)blockIdx.x * TILE;
    for (int d = threadIdx.y; d < TILE; d += blockDim.y) {
        int64_t r = r0 + d, n = n0 + threadIdx.x;
        if (r < K && n < N)
            t[d][threadIdx.x] = W[r * N + n];
    }
    __syncthreads();
    for (int d = threadIdx.y; d < TILE; d += blockDim.y) {
        int64_t n = n0 + d, r = r0 + threadIdx.x;
        if (r < K && n < N)
            w[n * K + perm[r]] = __float2half_rn(t[threadIdx.x][d]);
    }
}

exl_status exl_cuda_qz_set_trial(exl_backend *be, exl_linear *w, const float *W, const int32_t *perm) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (w->kind != EXL_LINEAR_DENSE || !w->w)
        return exl_cuda_fail(EXL_ERR_ARG, "qz_set_trial: not a dense linear");
    exl_cuda_graph_finish(cb);
    int64_t K = w->in, N = w->out;
    dim3 grid((unsigned)((N + TILE - 1) / TILE), (unsigned)((K + TILE - 1) / TILE));
    exl_cuda_launch(cb, set_trial_kernel, grid, dim3(TILE, 8), 0, w->w, W, perm, K, N);
    exl_cuda_check_launch(cb, "qz_set_trial");
    return exl_cuda_take_sticky(cb);
}
