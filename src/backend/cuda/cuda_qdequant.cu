/* cuda_qdequant.cu - quantized matrices dequantized to fp16 (hi + lo), and fp32 activations
 * gathered to fp16 (hi + lo), for the many-row (cuBLAS) matmul path. */
#include "backend/cuda/cuda_qdecode.cuh"

/* ---- dequantize to fp16 [slots, n_pad] (slot order) as two parts, hi = fp16(w) and then
 * lo = fp16(w - hi): with both, the GEMMs see the weights to ~22 bits, so prefill logits
 * keep the argmax of an fp32 reference even at near ties */

template <int B>
__device__ __forceinline__ void dequant_chunk(__half *dst, const uint32_t *qw, int64_t n_pad, int col0, int4 meta,
                                              const __half *scales, const __half *zeros, int chunk,
                                              int64_t lo_off) {
    uint4 wv[B];
#pragma unroll
    for (int i = 0; i < B; i++)
        wv[i] = __ldg((const uint4 *)(qw + (int64_t)(meta.x + i) * n_pad + col0));
    const int64_t g0 = (int64_t)meta.z * n_pad + col0;
    __half *base = dst + (int64_t)chunk * CHUNK * n_pad + col0;
#pragma unroll
    for (int c = 0; c < 4; c++) {
        uint32_t w[B];
#pragma unroll
        for (int i = 0; i < B; i++)
            w[i] = c == 0 ? wv[i].x : c == 1 ? wv[i].y : c == 2 ? wv[i].z : wv[i].w;
        __half2 zz = zero_pair(zeros, g0 + c, B);
        float s = __half2float(scales[g0 + c]);
        decode_chunk<B>(w, zz, [&](int p, __half2 qv) {
            float2 v = __half22float2(qv); /* q - z, exact */
            v.x *= s, v.y *= s;
            __half h0 = __float2half_rn(v.x), h1 = __float2half_rn(v.y);
            int64_t at = (int64_t)(2 * p) * n_pad + c;
            base[at] = h0;
            base[at + n_pad] = h1;
            base[lo_off + at] = __float2half_rn(v.x - __half2float(h0));
            base[lo_off + at + n_pad] = __float2half_rn(v.y - __half2float(h1));
        });
    }
}

__global__ void qdequant_kernel(__half *dst, exl_qmatrix q) {
    int quad = blockIdx.x * blockDim.x + threadIdx.x;
    int chunk = blockIdx.y;
    if (quad * 4 >= q.n_pad)
        return;
    int4 meta = q.chunks[chunk];
    int col0 = quad * 4;
    const int64_t lo_off = (int64_t)q.n_chunks * CHUNK * q.n_pad;
    switch (meta.y) {
    case 2: dequant_chunk<2>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk, lo_off); break;
    case 3: dequant_chunk<3>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk, lo_off); break;
    case 4: dequant_chunk<4>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk, lo_off); break;
    case 5: dequant_chunk<5>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk, lo_off); break;
    case 6: dequant_chunk<6>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk, lo_off); break;
    default: dequant_chunk<8>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk, lo_off); break;
    }
}

void exl_cuda_qdequant(exl_cuda_backend *cb, __half *dst, const exl_linear *w) {
    const exl_qmatrix *q = &w->q;
    dim3 grid((unsigned)(q->n_pad / 4 + 127) / 128, (unsigned)q->n_chunks);
    qdequant_kernel<<<grid, 128, 0, cb->stream>>>(dst, *q);
    exl_cuda_check_launch(cb, "dequantize");
}

/* ---- activations to fp16, gathered: x[r, idx[i]] (idx NULL: identity, -1: 0) split into
 * hi = fp16(x) at dst[r, i] and lo = fp16(x - hi) at dst[rows + r, i] */

__global__ void gather_half_kernel(__half *dst, const float *x, const int32_t *idx, int32_t in, int32_t width,
                                   int32_t rows) {
    int32_t r = blockIdx.y;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
        int32_t s = idx ? idx[i] : i;
        float v = s >= 0 ? x[(int64_t)r * in + s] : 0.0f;
        __half hi = __float2half_rn(v);
        dst[(int64_t)r * width + i] = hi;
        dst[(int64_t)(rows + r) * width + i] = __float2half_rn(v - __half2float(hi));
    }
}

void exl_cuda_gather_half(exl_cuda_backend *cb, __half *dst, const float *x, const int32_t *idx, int32_t rows,
                          int32_t in, int32_t width) {
    dim3 grid((unsigned)(width + 255) / 256, (unsigned)rows);
    gather_half_kernel<<<grid, 256, 0, cb->stream>>>(dst, x, idx, in, width, rows);
    exl_cuda_check_launch(cb, "gather to fp16");
}
