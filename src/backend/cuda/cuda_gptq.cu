/* cuda_gptq.cu - the quantizer's GPTQ with EXL2 scales on the device (ops qz_exl2_scales, qz_rows): a group's scale
 * search and a block's row loop, computed as convert/gptq.c computes them on the host, operation for operation (the
 * products and sums rounded where the host's are: explicit fma where its vectorized loop contracts, none where it
 * does not), so that the codes agree; only the total error of a tried maximum is summed in another order.
 *
 * The scale search is three launches: each column's no-clipping scale and their maximum (one block), the rounding
 * error of every column at every tried maximum (a thread per column and maximum, all EXL_EXL2_SCALE_TRIES of them,
 * where the host tries about half), and the pick (one block: the totals in double, the host's coarse-to-fine order
 * of choice over them, the chosen codes and scales). The row loop is one thread per column: row i's value takes
 * the earlier rows' errors in their order (the host spreads each as it goes, the same subtractions in the same order),
 * is rounded, and its error goes to E (the backend's gemm then updates the rows after the block). */
#include "backend/cuda/cuda_internal.h"

#include "format/exl2.h"

#include <cuda_fp16.h>

#define TRIES EXL_EXL2_SCALE_TRIES
#define CANDS EXL_EXL2_SCALE_CANDS
#define PICK_THREADS 512
#define TRY_THREADS 128
#define ROW_COLS 64  /* columns a block of the row loop */
#define MAX_ROWS 128 /* rows of a GPTQ block (gptq.c's BLOCK) */

static __device__ float f16_round(float x) { return __half2float(__float2half_rn(x)); }

/* format/exl2.h's exl_exl2_scale: fp16(fp16(max / 256)·(code + 1)²) */
static __device__ float exl2_scale(float scale_max, int code) {
    float m = f16_round(__fmul_rn(scale_max, 1.0f / 256.0f)), c = (float)(code + 1);
    return f16_round(__fmul_rn(__fmul_rn(m, c), c));
}

/* the tried maximum t (fp16, as a float) */
static __device__ float tried_max(float smax, int t) {
    return f16_round(__fmul_rn(smax > 0 ? smax : 1e-6f, __fadd_rn(0.65f, __fmul_rn(0.025f, (float)t))));
}

/* every column's no-clipping scale, and their largest */
__global__ void exl2_ideal_kernel(float *ideal, float *smax, const float *W, int64_t N, int32_t rows, int bits) {
    __shared__ float sh[PICK_THREADS];
    exl_pdl_start();
    float mid = (float)(1 << (bits - 1)), best = 0;
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
        float lo = 0, hi = 0;
        for (int32_t r = 0; r < rows; r++) {
            float w = W[r * N + n];
            lo = w < lo ? w : lo;
            hi = w > hi ? w : hi;
        }
        float s1 = __fdiv_rn(hi, mid - 1.0f), s2 = __fdiv_rn(-lo, mid), s = s1 > s2 ? s1 : s2;
        ideal[n] = s;
        best = s > best ? s : best;
    }
    sh[threadIdx.x] = best;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s)
            sh[threadIdx.x] = sh[threadIdx.x + s] > sh[threadIdx.x] ? sh[threadIdx.x + s] : sh[threadIdx.x];
        __syncthreads();
    }
    if (threadIdx.x == 0)
        *smax = sh[0];
}

/* column n at tried maximum t (blockIdx.y): the code of least rounding error among the candidates and that error
 * (infinite where no candidate is a valid code) */
__global__ void exl2_try_kernel(float *err, uint8_t *codes, const float *W, const float *ideal, const float *smax,
                                int64_t N, int32_t rows, int bits) {
    exl_pdl_start();
    int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (n >= N)
        return;
    float smf = tried_max(*smax, t);
    int c0 = (int)rintf(__fmul_rn(16.0f, __fsqrt_rn(__fdiv_rn(ideal[n], smf)))) - 1;
    float s[CANDS], inv[CANDS], e[CANDS];
#pragma unroll
    for (int j = 0; j < CANDS; j++) {
        int k = c0 - 2 + j;
        s[j] = exl2_scale(smf, k < 0 ? 0 : k > 15 ? 15 : k);
        inv[j] = s[j] != 0.0f ? __fdiv_rn(1.0f, s[j]) : 0.0f;
        e[j] = 0;
    }
    const float magic = 12582912.0f, z = (float)(1 << (bits - 1)), maxq = (float)((1 << bits) - 1);
    for (int32_t r = 0; r < rows; r++) {
        float x = W[r * N + n];
#pragma unroll
        for (int j = 0; j < CANDS; j++) {
            float q = __fadd_rn(__fsub_rn(fmaf(x, inv[j], magic), magic), z);
            q = q < 0.0f ? 0.0f : q > maxq ? maxq : q;
            float d = fmaf(-__fsub_rn(q, z), s[j], x);
            e[j] = fmaf(d, d, e[j]);
        }
    }
    float best = INFINITY;
    int best_c = 15;
#pragma unroll
    for (int j = 0; j < CANDS; j++) {
        int k = c0 - 2 + j;
        if (k >= 0 && k <= 15 && e[j] < best)
            best = e[j], best_c = k;
    }
    codes[(int64_t)t * N + n] = (uint8_t)best_c;
    err[(int64_t)t * N + n] = best;
}

/* the tried maxima's totals, the host's choice among them, and the chosen maximum's codes and scales */
__global__ void exl2_pick_kernel(uint8_t *scale_codes, uint16_t *scale_max, float *scale, float *zero, const float *err,
                                 const uint8_t *codes, const float *smax, int64_t N, int bits) {
    __shared__ double sh[PICK_THREADS];
    __shared__ double total[TRIES];
    __shared__ int pick;
    exl_pdl_start();
    for (int t = 0; t < TRIES; t++) {
        double v = 0;
        for (int64_t n = threadIdx.x; n < N; n += blockDim.x)
            v += (double)err[(int64_t)t * N + n];
        __syncthreads(); /* sh[0] of the last try read */
        const double sum = exl_block_sum_f64(v, sh);
        if (threadIdx.x == 0)
            total[t] = sum;
    }
    if (threadIdx.x == 0) {
        const int coarse = EXL_EXL2_SCALE_COARSE;
        int best = 0, tried[TRIES] = {0};
        double best_err = INFINITY;
        for (int round = 0; round < 2; round++) {
            int list[TRIES], n_try = 0;
            for (int t = 0; t < TRIES; t++)
                if (!tried[t] && (round ? t > best - coarse && t < best + coarse : t % coarse == coarse / 2))
                    list[n_try++] = t, tried[t] = 1;
            for (int i = 0; i < n_try; i++) {
                int t = list[i];
                if (total[t] < best_err || (total[t] == best_err && t < best))
                    best_err = total[t], best = t;
            }
        }
        pick = best;
        *scale_max = __half_as_ushort(__float2half_rn(tried_max(*smax, best)));
    }
    __syncthreads();
    float smf = tried_max(*smax, pick), mid = (float)(1 << (bits - 1));
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
        uint8_t k = codes[(int64_t)pick * N + n];
        scale_codes[n] = k;
        scale[n] = exl2_scale(smf, k);
        zero[n] = mid;
    }
}

exl_status exl_cuda_qz_exl2_scales(exl_backend *be, const float *W, int64_t N, int32_t rows, int32_t bits,
                                   uint8_t *scale_codes, uint16_t *scale_max, float *scale, float *zero) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (N < 1 || rows < 1 || bits < 2 || bits > 8)
        return exl_cuda_fail(EXL_ERR_ARG, "qz_exl2_scales: %d rows of %lld columns at %d bits", rows, (long long)N,
                             bits);
    exl_cuda_graph_finish(cb);
    size_t floats = (size_t)N * (1 + TRIES) + 1;
    float *work = NULL;
    CUDA_CHECK(cudaMallocAsync((void **)&work, floats * sizeof(float) + (size_t)N * TRIES, cb->stream),
               "qz_exl2_scales");
    float *ideal = work, *err = work + N, *smax = err + N * TRIES;
    uint8_t *codes = (uint8_t *)(smax + 1);
    exl_cuda_launch(cb, exl2_ideal_kernel, dim3(1), dim3(PICK_THREADS), 0, ideal, smax, W, N, rows, (int)bits);
    dim3 grid((unsigned)((N + TRY_THREADS - 1) / TRY_THREADS), TRIES);
    exl_cuda_launch(cb, exl2_try_kernel, grid, dim3(TRY_THREADS), 0, err, codes, W, (const float *)ideal,
                    (const float *)smax, N, rows, (int)bits);
    exl_cuda_launch(cb, exl2_pick_kernel, dim3(1), dim3(PICK_THREADS), 0, scale_codes, scale_max, scale, zero,
                    (const float *)err, (const uint8_t *)codes, (const float *)smax, N, (int)bits);
    exl_cuda_check_launch(cb, "qz_exl2_scales");
    CUDA_CHECK(cudaFreeAsync(work, cb->stream), "qz_exl2_scales");
    return exl_cuda_take_sticky(cb);
}

/* one column of a GPTQ block: each row gets the earlier rows' errors, is rounded, and its error is kept (E, and in
 * shared memory for the later rows) */
__global__ void gptq_rows_kernel(float *W, const float *U, int64_t ldu, int64_t N, int32_t rows, const float *scale,
                                 const float *zero, int bits, uint8_t *codes, float *E) {
    __shared__ float es[MAX_ROWS][ROW_COLS];
    exl_pdl_start();
    int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N)
        return;
    float s = scale[n], z = zero[n], maxq = (float)((1 << bits) - 1);
    float *ec = &es[0][threadIdx.x];
    for (int32_t i = 0; i < rows; i++) {
        float w = W[i * N + n];
        for (int32_t p = 0; p < i; p++)
            w = __fsub_rn(w, __fmul_rn(U[p * ldu + i], ec[p * ROW_COLS]));
        float q = s != 0.0f ? __fadd_rn(rintf(__fdiv_rn(w, s)), z) : z;
        q = q < 0.0f ? 0.0f : q > maxq ? maxq : q;
        float dq = __fmul_rn(__fsub_rn(q, z), s), e = __fdiv_rn(__fsub_rn(w, dq), U[i * ldu + i]);
        codes[i * N + n] = (uint8_t)q;
        W[i * N + n] = dq;
        E[i * N + n] = e;
        ec[i * ROW_COLS] = e;
    }
}

exl_status exl_cuda_qz_rows(exl_backend *be, float *W, const float *U, int64_t ldu, int64_t N, int32_t rows,
                            const float *scale, const float *zero, int32_t bits, uint8_t *codes, float *E) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (N < 1 || rows < 1 || rows > MAX_ROWS || bits < 1 || bits > 8)
        return exl_cuda_fail(EXL_ERR_ARG, "qz_rows: %d rows of %lld columns at %d bits", rows, (long long)N, bits);
    exl_cuda_graph_finish(cb);
    exl_cuda_launch(cb, gptq_rows_kernel, dim3((unsigned)((N + ROW_COLS - 1) / ROW_COLS)), dim3(ROW_COLS), 0, W, U, ldu,
                    N, rows, scale, zero, (int)bits, codes, E);
    exl_cuda_check_launch(cb, "qz_rows");
    return exl_cuda_take_sticky(cb);
}
