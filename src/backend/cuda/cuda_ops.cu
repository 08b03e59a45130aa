/* cuda_ops.cu - element-wise and row ops on the GPU: embed, rmsnorm, rope, glu, add,
 * gather, the quantizer's squared distance, column copies, soft-capping, sigmoid row gates, and the fp16 KV-cache
 * writes (alone or fused with rope; a quantized cache's go to cuda_kv_quant.cu). All fp32 in and out, fp32
 * arithmetic (the squared distance sums in double). */
#include "backend/cuda/cuda_internal.h"

#define ROW_THREADS 256

static inline unsigned blocks_for(int64_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

/* ---- embed: out[r] = table[ids[r]] * scale (fp16 table) */

__global__ void embed_kernel(float *out, const __half *table, const int32_t *ids, int32_t width, float scale) {
    exl_pdl_start();
    int32_t r = blockIdx.y;
    const __half *src = table + (int64_t)ids[r] * width;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
        out[(int64_t)r * width + i] = __half2float(src[i]) * scale;
}

void exl_cuda_run_embed(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows,
                        float scale) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (rows < 1)
        return;
    dim3 grid(blocks_for(table->in, ROW_THREADS), (unsigned)rows);
    exl_cuda_launch(cb, embed_kernel, grid, dim3(ROW_THREADS), 0, out, table->w, ids, table->in, scale);
    exl_cuda_check_launch(cb, "embed");
}

/* ---- rmsnorm: one block per row, wide enough that each thread loads a few values */

#define NORM_THREADS 1024

__device__ __forceinline__ float block_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? red[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__global__ void rmsnorm_kernel(float *out, const float *x, const float *w, int32_t width, float eps) {
    exl_pdl_start();
    __shared__ float red[32];
    const float *xr = x + (int64_t)blockIdx.x * width;
    float *o = out + (int64_t)blockIdx.x * width;
    float ss = 0;
#pragma unroll 4
    for (int32_t i = threadIdx.x; i < width; i += blockDim.x)
        ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / width + eps);
#pragma unroll 4
    for (int32_t i = threadIdx.x; i < width; i += blockDim.x)
        o[i] = w[i] * (xr[i] * inv);
}

void exl_cuda_run_rmsnorm(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                          float eps) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (rows < 1)
        return;
    exl_cuda_launch(cb, rmsnorm_kernel, dim3((unsigned)rows), dim3(NORM_THREADS), 0, out, x, w->v, width, eps);
    exl_cuda_check_launch(cb, "rmsnorm");
}

/* ---- rope (NeoX pairs i, i + rot_dim/2): one thread per (row, head, pair) */

__global__ void rope_kernel(float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim, int32_t half,
                            const float *inv_freq, float attn_factor) {
    exl_pdl_start();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * n_heads * half)
        return;
    int32_t i = (int32_t)(t % half);
    int64_t rh = t / half;
    int32_t r = (int32_t)(rh / n_heads);
    float s, c;
    sincosf((float)pos[r] * inv_freq[i], &s, &c);
    c *= attn_factor;
    s *= attn_factor;
    float *v = x + rh * head_dim;
    float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
}

void exl_cuda_run_rope(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                       int32_t rot_dim, const float *inv_freq, float attn_factor) {
    exl_cuda_backend *cb = exl_cuda(be);
    int64_t n = (int64_t)rows * n_heads * (rot_dim / 2);
    if (n < 1)
        return;
    exl_cuda_launch(cb, rope_kernel, dim3(blocks_for(n, ROW_THREADS)), dim3(ROW_THREADS), 0, x, pos, rows, n_heads,
                    head_dim, rot_dim / 2, inv_freq, attn_factor);
    exl_cuda_check_launch(cb, "rope");
}

/* ---- glu: gate = act(gate) * up; act 0 silu, 1 gelu (tanh), 2 gelu (erf) */

__global__ void glu_kernel(float *gate, const float *up, int64_t n, int act) {
    exl_pdl_start();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n)
        return;
    gate[i] = exl_cuda_activate(gate[i], act) * up[i];
}

void exl_cuda_run_glu(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act) {
    exl_cuda_backend *cb = exl_cuda(be);
    int64_t n = (int64_t)rows * width;
    if (n < 1)
        return;
    exl_cuda_launch(cb, glu_kernel, dim3(blocks_for(n, ROW_THREADS)), dim3(ROW_THREADS), 0, gate, up, n, act);
    exl_cuda_check_launch(cb, "glu");
}

/* ---- add, gather */

__global__ void add_kernel(float *x, const float *y, int64_t n) {
    exl_pdl_start();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] += y[i];
}

void exl_cuda_run_add(exl_backend *be, float *x, const float *y, int64_t n) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n < 1)
        return;
    exl_cuda_launch(cb, add_kernel, dim3(blocks_for(n, ROW_THREADS)), dim3(ROW_THREADS), 0, x, y, n);
    exl_cuda_check_launch(cb, "add");
}

__global__ void gather_rows_kernel(float *out, const float *x, const int32_t *idx, int32_t width) {
    exl_pdl_start();
    int32_t r = blockIdx.y;
    const float *src = x + (int64_t)idx[r] * width;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
        out[(int64_t)r * width + i] = src[i];
}

void exl_cuda_run_gather_rows(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n,
                              int32_t width) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n < 1)
        return;
    dim3 grid(blocks_for(width, ROW_THREADS), (unsigned)n);
    exl_cuda_launch(cb, gather_rows_kernel, grid, dim3(ROW_THREADS), 0, out, x, idx, width);
    exl_cuda_check_launch(cb, "gather_rows");
}

/* ---- sq_dist: the sum of squared differences in double, in a fixed order (each block its stride, then one block
 * over the blocks' sums), so a run repeats its results */

#define DIST_BLOCKS ROW_THREADS

__global__ void sq_dist_kernel(double *part, const float *a, const float *b, int64_t n) {
    __shared__ double sh[ROW_THREADS];
    exl_pdl_start();
    double e = 0;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        double d = (double)a[i] - (double)b[i];
        e += d * d;
    }
    double s = exl_block_sum_f64(e, sh);
    if (threadIdx.x == 0)
        part[blockIdx.x] = s;
}

__global__ void sum_parts_kernel(double *part) {
    __shared__ double sh[DIST_BLOCKS];
    exl_pdl_start();
    double s = exl_block_sum_f64(part[threadIdx.x], sh);
    if (threadIdx.x == 0)
        part[DIST_BLOCKS] = s;
}

exl_status exl_cuda_sq_dist(exl_backend *be, const float *a, const float *b, int64_t n, double *acc) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb);
    double *part = NULL, sum = 0;
    CUDA_CHECK(cudaMallocAsync((void **)&part, (DIST_BLOCKS + 1) * sizeof(double), cb->stream), "sq_dist");
    exl_cuda_launch(cb, sq_dist_kernel, dim3(DIST_BLOCKS), dim3(ROW_THREADS), 0, part, a, b, n);
    exl_cuda_launch(cb, sum_parts_kernel, dim3(1), dim3(DIST_BLOCKS), 0, part);
    exl_cuda_check_launch(cb, "sq_dist");
    cudaError_t e = cudaMemcpyAsync(&sum, part + DIST_BLOCKS, sizeof sum, cudaMemcpyDeviceToHost, cb->stream);
    cudaError_t f = cudaFreeAsync(part, cb->stream);
    if (e == cudaSuccess)
        e = f;
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cb->stream);
    CUDA_CHECK(e, "sq_dist");
    *acc += sum;
    return exl_cuda_take_sticky(cb);
}

/* ---- copy_cols, softcap, row_gate */

__global__ void copy_cols_kernel(float *out, const float *x, int32_t width, int32_t x_width, int32_t col) {
    exl_pdl_start();
    int32_t r = blockIdx.y;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
        out[(int64_t)r * width + i] = x[(int64_t)r * x_width + col + i];
}

void exl_cuda_run_copy_cols(exl_backend *be, float *out, const float *x, int32_t rows, int32_t width, int32_t x_width,
                            int32_t col) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (rows < 1 || width < 1)
        return;
    dim3 grid(blocks_for(width, ROW_THREADS), (unsigned)rows);
    exl_cuda_launch(cb, copy_cols_kernel, grid, dim3(ROW_THREADS), 0, out, x, width, x_width, col);
    exl_cuda_check_launch(cb, "copy_cols");
}

__global__ void softcap_kernel(float *x, int64_t n, float cap) {
    exl_pdl_start();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] = cap * tanhf(x[i] / cap);
}

void exl_cuda_run_softcap(exl_backend *be, float *x, int64_t n, float cap) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n < 1)
        return;
    exl_cuda_launch(cb, softcap_kernel, dim3(blocks_for(n, ROW_THREADS)), dim3(ROW_THREADS), 0, x, n, cap);
    exl_cuda_check_launch(cb, "softcap");
}

__global__ void row_gate_kernel(float *x, const float *g, int32_t width) {
    exl_pdl_start();
    int32_t r = blockIdx.y;
    const float s = 1.0f / (1.0f + expf(-g[r]));
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x)
        x[(int64_t)r * width + i] *= s;
}

void exl_cuda_run_row_gate(exl_backend *be, float *x, const float *g, int32_t rows, int32_t width) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (rows < 1 || width < 1)
        return;
    dim3 grid(blocks_for(width, ROW_THREADS), (unsigned)rows);
    exl_cuda_launch(cb, row_gate_kernel, grid, dim3(ROW_THREADS), 0, x, g, width);
    exl_cuda_check_launch(cb, "row_gate");
}

/* ---- kv_store: rows of k and v to their slots, fp16 */

__global__ void kv_store_kernel(__half *kc, __half *vc, const float *k, const float *v, const int32_t *slots,
                                int32_t kv_width) {
    exl_pdl_start();
    int32_t r = blockIdx.y;
    int64_t dst = (int64_t)slots[r] * kv_width, src = (int64_t)r * kv_width;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < kv_width; i += gridDim.x * blockDim.x) {
        kc[dst + i] = __float2half_rn(k[src + i]);
        vc[dst + i] = __float2half_rn(v[src + i]);
    }
}

void exl_cuda_run_kv_store(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                           const exl_batch *b, int32_t kv_width) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (exl_cuda_kv_quantized(b)) {
        exl_cuda_run_kv_store_quant(be, k_cache, v_cache, k, v, b, kv_width);
        return;
    }
    if (b->n_rows < 1)
        return;
    dim3 grid(blocks_for(kv_width, ROW_THREADS), (unsigned)b->n_rows);
    exl_cuda_launch(cb, kv_store_kernel, grid, dim3(ROW_THREADS), 0, (__half *)k_cache, (__half *)v_cache, k, v,
                    b->d_slots, kv_width);
    exl_cuda_check_launch(cb, "kv_store");
}

/* ---- rope on q and k, then k and v to their cache slots (fp16), in one launch: threads
 * [0, nq) rotate q pairs, [nq, nq + nk) rotate k pairs and store both values, then kv_width
 * threads store v and kv_width threads store the k dimensions past rot_dim */

__global__ void rope_kv_store_kernel(float *q, float *k, const float *v, __half *kc, __half *vc, const int32_t *pos,
                                     const int32_t *slots, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                     int32_t half, const float *inv_freq, float attn_factor) {
    exl_pdl_start();
    const int32_t r = blockIdx.y, kvw = n_kv_heads * head_dim;
    const int32_t nq = n_heads * half, nk = n_kv_heads * half;
    const int64_t dst = (int64_t)slots[r] * kvw;
    for (int32_t t = blockIdx.x * blockDim.x + threadIdx.x; t < nq + nk + 2 * kvw; t += gridDim.x * blockDim.x) {
        if (t < nq + nk) {
            const int is_k = t >= nq;
            const int32_t u = is_k ? t - nq : t, h = u / half, i = u % half;
            float *base = is_k ? k + (int64_t)r * kvw + h * head_dim : q + ((int64_t)r * n_heads + h) * head_dim;
            float s, c;
            sincosf((float)pos[r] * inv_freq[i], &s, &c);
            c *= attn_factor;
            s *= attn_factor;
            float a = base[i], b = base[i + half];
            float na = a * c - b * s, nb = b * c + a * s;
            base[i] = na;
            base[i + half] = nb;
            if (is_k) {
                kc[dst + h * head_dim + i] = __float2half_rn(na);
                kc[dst + h * head_dim + i + half] = __float2half_rn(nb);
            }
        } else if (t < nq + nk + kvw) {
            const int32_t j = t - nq - nk;
            vc[dst + j] = __float2half_rn(v[(int64_t)r * kvw + j]);
        } else {
            const int32_t j = t - nq - nk - kvw;
            if (j % head_dim >= 2 * half)
                kc[dst + j] = __float2half_rn(k[(int64_t)r * kvw + j]);
        }
    }
}

void exl_cuda_run_rope_kv_store(exl_backend *be, float *q, float *k, const float *v, void *k_cache, void *v_cache,
                                const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim, const float *inv_freq,
                                float attn_factor) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (exl_cuda_kv_quantized(b)) {
        exl_cuda_run_rope_kv_store_quant(be, q, k, v, k_cache, v_cache, b, sh, rot_dim, inv_freq, attn_factor);
        return;
    }
    if (b->n_rows < 1)
        return;
    int64_t n = (int64_t)(sh->n_heads + sh->n_kv_heads) * (rot_dim / 2) + 2 * (int64_t)sh->n_kv_heads * sh->head_dim;
    dim3 grid(blocks_for(n, ROW_THREADS), (unsigned)b->n_rows);
    exl_cuda_launch(cb, rope_kv_store_kernel, grid, dim3(ROW_THREADS), 0, q, k, v, (__half *)k_cache, (__half *)v_cache,
                    b->d_pos, b->d_slots, sh->n_heads, sh->n_kv_heads, sh->head_dim, rot_dim / 2, inv_freq,
                    attn_factor);
    exl_cuda_check_launch(cb, "rope + KV store");
}
