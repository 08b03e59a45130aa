/* cuda_split_half.cu - fp32 activations as two fp16 parts (hi + lo), the input of the
 * many-row matmul of dense weights (cuBLAS). */
#include "backend/cuda/cuda_internal.h"

/* x [rows, width] split into hi = fp16(x) at dst[r, i] and lo = fp16(x - hi) at dst[rows + r, i] */

__global__ void split_half_kernel(__half *dst, const float *x, int32_t width, int32_t rows) {
    exl_pdl_start();
    int32_t r = blockIdx.y;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
        float v = x[(int64_t)r * width + i];
        __half hi = __float2half_rn(v);
        dst[(int64_t)r * width + i] = hi;
        dst[(int64_t)(rows + r) * width + i] = __float2half_rn(v - __half2float(hi));
    }
}

void exl_cuda_split_half(exl_cuda_backend *cb, __half *dst, const float *x, int32_t rows, int32_t width) {
    dim3 grid((unsigned)(width + 255) / 256, (unsigned)rows);
    exl_cuda_launch(cb, split_half_kernel, grid, dim3(256), 0, dst, x, width, rows);
    exl_cuda_check_launch(cb, "split into fp16 parts");
}
