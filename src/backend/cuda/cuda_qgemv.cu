/* cuda_qgemv.cu - fused dequantize + GEMV for few rows (the decode case), and the
 * dequantize-to-fp16 kernel for the many-row (cuBLAS) case, over an exl_qmatrix.
 *
 * Decoding: a chunk is 32 rows of one width b in b words per column. Codes are turned
 * into fp16 pairs with one mask-and-or per pair ((code | 0x6400) is 1024 + code), the zero
 * subtracted exactly ((1024 + q) - (1024 + z)), and the pair multiplied with the matching
 * pair of activations (slot order, see exl_cuda_slot_of). Products are summed in fp16 over
 * 8 rows at most, then in fp32, and scaled per chunk in fp32.
 *
 * GEMV grid: x = column tiles of 256 (64 threads x 4 columns, 16-byte loads), y = split of
 * the chunks. The 4 warp pairs of a block take every 4th chunk of the block's range; the
 * block sums them in shared memory; with a split, the last block of a column tile to
 * arrive (counter per tile, reset by it) adds the partial sums in split order, so the
 * result does not depend on timing. */
#include "backend/cuda/cuda_internal.h"

#define CHUNK 32
#define COL_TILE 256
#define GEMV_THREADS 256
#define SUBS (GEMV_THREADS / 64)

/* ---- decoding one chunk of one column */

__device__ __forceinline__ __half2 u32_as_half2(uint32_t u) {
    __half2 h;
    memcpy(&h, &u, 4);
    return h;
}

template <int B>
__device__ __forceinline__ uint32_t extract(const uint32_t (&w)[B], int bit) {
    int lo = bit >> 5, off = bit & 31;
    uint32_t v = off + B <= 32 ? w[lo] >> off : __funnelshift_r(w[lo], w[lo + 1 < B ? lo + 1 : lo], off);
    return v & ((1u << B) - 1);
}

/* Calls f(pair, (q - z) as half2) for the 16 pairs of a chunk; pair p covers slots 2p, 2p+1. */
template <int B, typename F>
__device__ __forceinline__ void decode_chunk(const uint32_t (&w)[B], __half2 zz, F &&f) {
    if constexpr (B == 2 || B == 4 || B == 8) {
        constexpr int V = 32 / B;
        constexpr uint32_t M = (1u << B) - 1, MM = M | (M << 16);
#pragma unroll
        for (int u = 0; u < B; u++)
#pragma unroll
            for (int i = 0; i < V / 2; i++)
                f(u * V / 2 + i, __hsub2(u32_as_half2(((w[u] >> (i * B)) & MM) | 0x64006400u), zz));
    } else {
#pragma unroll
        for (int p = 0; p < 16; p++) {
            uint32_t a = extract<B>(w, p * B), b = extract<B>(w, (p + 16) * B);
            f(p, __hsub2(u32_as_half2(a | (b << 16) | 0x64006400u), zz));
        }
    }
}

__device__ __forceinline__ __half2 zero_pair(const __half *zeros, int64_t at, int bits) {
    float z = zeros ? __half2float(zeros[at]) : (float)(1 << (bits - 1));
    return __float2half2_rn(1024.0f + z);
}

/* ---- GEMV */

template <int R, int B>
__device__ __forceinline__ void gemv_chunk(const uint32_t *qw, int64_t n_pad, int col0, int4 meta,
                                           const __half *scales, const __half *zeros, const __half2 *xs,
                                           int xs_stride, float (&acc)[R][4]) {
    uint4 wv[B];
#pragma unroll
    for (int i = 0; i < B; i++)
        wv[i] = __ldg((const uint4 *)(qw + (int64_t)(meta.x + i) * n_pad + col0));
    const int64_t g0 = (int64_t)meta.z * n_pad + col0;
    uint2 sraw = __ldg((const uint2 *)(scales + g0));
    __half sc[4];
    memcpy(sc, &sraw, 8);
#pragma unroll
    for (int c = 0; c < 4; c++) {
        uint32_t w[B];
#pragma unroll
        for (int i = 0; i < B; i++)
            w[i] = c == 0 ? wv[i].x : c == 1 ? wv[i].y : c == 2 ? wv[i].z : wv[i].w;
        __half2 zz = zero_pair(zeros, g0 + c, B);
        float part[R];
        __half2 h[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            part[r] = 0.0f;
            h[r] = __float2half2_rn(0.0f);
        }
        decode_chunk<B>(w, zz, [&](int p, __half2 q) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                h[r] = __hfma2(q, xs[r * xs_stride + p], h[r]);
                if ((p & 3) == 3) {
                    float2 f = __half22float2(h[r]);
                    part[r] += f.x + f.y;
                    h[r] = __float2half2_rn(0.0f);
                }
            }
        });
        float s = __half2float(sc[c]);
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r][c] += s * part[r];
    }
}

template <int R>
__global__ void __launch_bounds__(GEMV_THREADS)
qgemv_kernel(float *out, const float *x, int32_t in, int32_t n_out, exl_qmatrix q, int32_t chunks_per_block,
             const float *bias, float *partial, unsigned *counters) {
    extern __shared__ __half2 xs[]; /* [R][chunks_per_block * 16] */
    __shared__ float red[SUBS][R][COL_TILE];
    __shared__ int is_last;
    const int tid = threadIdx.x, quad = tid % 64, sub = tid / 64;
    const int c0 = blockIdx.y * chunks_per_block;
    const int n_loc = min(chunks_per_block, q.n_chunks - c0);
    const int xs_stride = chunks_per_block * 16;
    const int col0 = blockIdx.x * COL_TILE + quad * 4;

    /* start this thread's weights on their way to L2 while the activations are gathered */
    for (int lc = sub; lc < n_loc; lc += SUBS) {
        int4 meta = __ldg(q.chunks + c0 + lc);
        for (int i = 0; i < meta.y; i++)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(q.qw + (int64_t)(meta.x + i) * q.n_pad + col0));
    }

    /* activations of this block's chunks, gathered into slot order, as fp16 pairs */
    for (int i = tid; i < n_loc * 16; i += GEMV_THREADS) {
        int s0 = q.slot_src[c0 * CHUNK + 2 * i], s1 = q.slot_src[c0 * CHUNK + 2 * i + 1];
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float *xr = x + (int64_t)r * in;
            xs[r * xs_stride + i] = __floats2half2_rn(s0 >= 0 ? xr[s0] : 0.0f, s1 >= 0 ? xr[s1] : 0.0f);
        }
    }
    __syncthreads();

    float acc[R][4];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            acc[r][c] = 0.0f;
    for (int lc = sub; lc < n_loc; lc += SUBS) {
        int4 meta = __ldg(q.chunks + c0 + lc);
        const __half2 *xc = xs + lc * 16;
        switch (meta.y) {
        case 2: gemv_chunk<R, 2>(q.qw, q.n_pad, col0, meta, q.scales, q.zeros, xc, xs_stride, acc); break;
        case 3: gemv_chunk<R, 3>(q.qw, q.n_pad, col0, meta, q.scales, q.zeros, xc, xs_stride, acc); break;
        case 4: gemv_chunk<R, 4>(q.qw, q.n_pad, col0, meta, q.scales, q.zeros, xc, xs_stride, acc); break;
        case 5: gemv_chunk<R, 5>(q.qw, q.n_pad, col0, meta, q.scales, q.zeros, xc, xs_stride, acc); break;
        case 6: gemv_chunk<R, 6>(q.qw, q.n_pad, col0, meta, q.scales, q.zeros, xc, xs_stride, acc); break;
        default: gemv_chunk<R, 8>(q.qw, q.n_pad, col0, meta, q.scales, q.zeros, xc, xs_stride, acc); break;
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            red[sub][r][quad * 4 + c] = acc[r][c];
    __syncthreads();

    const int col = blockIdx.x * COL_TILE + tid;
    float sum[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        sum[r] = 0.0f;
#pragma unroll
        for (int s = 0; s < SUBS; s++)
            sum[r] += red[s][r][tid];
    }
    if (gridDim.y == 1) {
        if (col < n_out)
#pragma unroll
            for (int r = 0; r < R; r++)
                out[(int64_t)r * n_out + col] = sum[r] + (bias ? bias[col] : 0.0f);
        return;
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        partial[((int64_t)blockIdx.y * R + r) * q.n_pad + col] = sum[r];
    __threadfence();
    __syncthreads();
    if (tid == 0)
        is_last = atomicAdd(&counters[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!is_last)
        return;
    __threadfence();
    if (col < n_out)
#pragma unroll
        for (int r = 0; r < R; r++) {
            float t = bias ? bias[col] : 0.0f;
            for (unsigned y = 0; y < gridDim.y; y++)
                t += __ldcg(partial + ((int64_t)y * R + r) * q.n_pad + col);
            out[(int64_t)r * n_out + col] = t;
        }
    if (tid == 0)
        counters[blockIdx.x] = 0;
}

template <int R>
static void launch_gemv(exl_cuda_backend *cb, float *out, const float *x, const exl_linear *w) {
    const exl_qmatrix *q = &w->q;
    int tiles = q->n_pad / COL_TILE;
    int target = 3 * cb->n_sms;
    int split = target / tiles;
    int max_split = (q->n_chunks + 2 * SUBS - 1) / (2 * SUBS); /* at least 2 chunks per sub */
    if (split > max_split)
        split = max_split;
    if (split < 1)
        split = 1;
    int cpb = (q->n_chunks + split - 1) / split;
    int max_cpb = 24576 / (R * 64); /* keep the activations under 24 KiB of shared memory */
    if (cpb > max_cpb)
        cpb = max_cpb;
    split = (q->n_chunks + cpb - 1) / cpb;
    if (split > 1) {
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_partial, &cb->gemv_partial_bytes,
                             (size_t)split * R * q->n_pad * sizeof(float), "GEMV partial sums"))
            return;
        if ((size_t)tiles > cb->gemv_counter_count) {
            size_t bytes = cb->gemv_counter_count * sizeof(unsigned);
            if (!exl_cuda_ensure(cb, (void **)&cb->gemv_counters, &bytes, (size_t)tiles * sizeof(unsigned),
                                 "GEMV counters"))
                return;
            cb->gemv_counter_count = (size_t)tiles;
            if (cudaMemsetAsync(cb->gemv_counters, 0, bytes, cb->stream) != cudaSuccess) {
                exl_cuda_check_launch(cb, "GEMV counters");
                return;
            }
        }
    }
    dim3 grid((unsigned)tiles, (unsigned)split);
    size_t smem = (size_t)R * cpb * 16 * sizeof(__half2);
    qgemv_kernel<R><<<grid, GEMV_THREADS, smem, cb->stream>>>(out, x, w->in, w->out, *q, cpb, w->bias,
                                                              cb->gemv_partial, cb->gemv_counters);
    exl_cuda_check_launch(cb, "quantized GEMV");
}

void exl_cuda_qgemv(exl_cuda_backend *cb, float *out, const float *x, const exl_linear *w, int32_t rows) {
    switch (rows) {
    case 1: launch_gemv<1>(cb, out, x, w); break;
    case 2: launch_gemv<2>(cb, out, x, w); break;
    case 3: launch_gemv<3>(cb, out, x, w); break;
    case 4: launch_gemv<4>(cb, out, x, w); break;
    default:
        for (int32_t r = 0; r < rows; r += 4) {
            int n = rows - r < 4 ? rows - r : 4;
            exl_cuda_qgemv(cb, out + (int64_t)r * w->out, x + (int64_t)r * w->in, w, n);
        }
    }
}

/* ---- dequantize to fp16 [slots, n_pad] (slot order) */

template <int B>
__device__ __forceinline__ void dequant_chunk(__half *dst, const uint32_t *qw, int64_t n_pad, int col0, int4 meta,
                                              const __half *scales, const __half *zeros, int chunk) {
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
        __half2 s2 = __half2half2(scales[g0 + c]);
        decode_chunk<B>(w, zz, [&](int p, __half2 qv) {
            __half2 v = __hmul2(qv, s2);
            base[(int64_t)(2 * p) * n_pad + c] = __low2half(v);
            base[(int64_t)(2 * p + 1) * n_pad + c] = __high2half(v);
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
    switch (meta.y) {
    case 2: dequant_chunk<2>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk); break;
    case 3: dequant_chunk<3>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk); break;
    case 4: dequant_chunk<4>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk); break;
    case 5: dequant_chunk<5>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk); break;
    case 6: dequant_chunk<6>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk); break;
    default: dequant_chunk<8>(dst, q.qw, q.n_pad, col0, meta, q.scales, q.zeros, chunk); break;
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
