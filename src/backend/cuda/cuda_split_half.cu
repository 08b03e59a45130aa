/* cuda_split_half.cu - the fp16 input of the many-row matmuls (cuBLAS): fp32 activations, with the layer's RMSNorm
 * or GLU applied on the way, as one fp16 part (hi, the fast prompt path) or two (x = hi + lo, ~22 bits:
 * EXL_CUDA_EXACT_PREFILL=1 and dense weights there). */
#include "backend/cuda/cuda_internal.h"

#define NORM_THREADS 1024

/* v as hi at dst[at] and, with parts 2, lo = fp16(v - hi) at dst[lo_at + at] */
__device__ __forceinline__ void store_parts(__half *dst, int64_t at, int64_t lo_at, float v, int parts) {
    const __half hi = __float2half_rn(v);
    dst[at] = hi;
    if (parts == 2)
        dst[lo_at + at] = __float2half_rn(v - __half2float(hi));
}

/* x (or act(x) * up) [rows, width]: grid x over the width, y the rows */
__global__ void split_half_kernel(__half *dst, const float *x, const float *up, int32_t act, int32_t width,
                                  int32_t rows, int32_t parts) {
    exl_pdl_start();
    const int64_t r = blockIdx.y, lo_at = (int64_t)rows * width;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
        float v = x[r * width + i];
        if (up)
            v = exl_cuda_activate(v, act) * up[r * width + i];
        store_parts(dst, r * width + i, lo_at, v, parts);
    }
}

/* norm[i] * (x[i] / rms(x)), one block a row (as rmsnorm_kernel in cuda_ops.cu computes it) */
__global__ void split_half_norm_kernel(__half *dst, const float *x, const float *norm, float eps, int32_t width,
                                       int32_t rows, int32_t parts) {
    exl_pdl_start();
    __shared__ float red[NORM_THREADS / 32];
    const int64_t r = blockIdx.x, lo_at = (int64_t)rows * width;
    const float *xr = x + r * width;
    float ss = 0.0f;
#pragma unroll 4
    for (int32_t i = threadIdx.x; i < width; i += blockDim.x)
        ss += xr[i] * xr[i];
    for (int o = 16; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0)
        red[threadIdx.x / 32] = ss;
    __syncthreads();
    ss = threadIdx.x % 32 < NORM_THREADS / 32 ? red[threadIdx.x % 32] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
        ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss / width + eps);
#pragma unroll 4
    for (int32_t i = threadIdx.x; i < width; i += blockDim.x)
        store_parts(dst, r * width + i, lo_at, norm[i] * (xr[i] * inv), parts);
}

void exl_cuda_split_half(exl_cuda_backend *cb, __half *dst, const float *x, const exl_vector *norm, float eps,
                         const float *up, int act, int32_t rows, int32_t width, int parts) {
    if (norm) {
        exl_cuda_launch(cb, split_half_norm_kernel, dim3((unsigned)rows), dim3(NORM_THREADS), 0, dst, x, norm->v, eps,
                        width, rows, parts);
    } else {
        dim3 grid((unsigned)(width + 255) / 256, (unsigned)rows);
        exl_cuda_launch(cb, split_half_kernel, grid, dim3(256), 0, dst, x, up, act, width, rows, parts);
    }
    exl_cuda_check_launch(cb, "fp16 matmul input");
}
