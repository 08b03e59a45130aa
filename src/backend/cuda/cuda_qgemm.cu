/* cuda_qgemm.cu - quantized matmul for many rows (prefill chunks, big batches) through
 * cuBLAS: the weights are decoded once per matmul into fp16 W[in, width] (a slab of the
 * output columns at a time, natural input order, value scale · (q − z)) and multiplied
 * with the activations' fp16 parts by exl_cuda_gemm_parts (cuda_matmul.cu). Matrices that
 * share their input (q/k/v, gate/up) and fit one slab together are decoded side by side and
 * multiplied in one GEMM; the residual add and bias ride on the kernel that sums the parts.
 * The layer's RMSNorm or GLU is applied while the activations are converted to fp16.
 *
 * The tensor-core kernel of cuda_qmma.cu decodes the codes again for every 32 rows; from
 * EXL_CUDA_DEQUANT_ROWS rows (cb->dequant_rows) decoding once and letting cuBLAS
 * run at its rate is faster. By default a weight is decoded as one fp16 number and the activations are one fp16
 * part: a single GEMM, what ExLlamaV2 and other engines do for prompts. With EXL_CUDA_EXACT_PREFILL=1 a weight is
 * decoded as two, hi + lo: fp16 alone loses ~2^-12 of each weight, which flips near-tied argmaxes of the
 * reference logits; with lo the products hi·hi, lo·hi and hi·lo keep ~22 bits, at three GEMMs. */
#include "backend/cuda/cuda_qdecode.cuh"

#define DQ_COLS 256                    /* columns a block decodes: 64 threads x DQ_COLS_T */
#define DQ_COLS_T 4                    /* columns a thread decodes (one 16-byte load per word row) */
#define DQ_SUBS 4                      /* chunks a block decodes, one per 64 threads */
#define SLAB_BYTES ((size_t)256 << 20) /* fp16 weights (hi and lo) decoded at once, at most */

/* (q - z) of slots 2p, 2p + 1 of one column's chunk of B-bit codes w (pair order of
 * decode_chunk, cuda_qdecode.cuh), exact */
template <int B>
__device__ __forceinline__ __half2 pair_at(const uint32_t (&w)[B], int p, __half2 zz) {
    return __hsub2(u32_as_half2(pair_codes<B>(w, p, 0x64006400u)), zz);
}

/* One chunk of DQ_COLS_T columns into hi and, at lo_at further, lo (lo_at 0: none): w = scale · (q - z) is
 * exact in fp32; hi = fp16(w), lo = fp16((w - hi) · EXL_CUDA_LO_SCALE). One 8-byte store per
 * row and part. */
template <int B>
__device__ __forceinline__ void dequant_chunk(const exl_qmatrix &q, int4 meta, int chunk, int col0, int n0, int32_t end,
                                              int32_t ld, int64_t lo_at, __half *dst) {
    uint32_t w[DQ_COLS_T][B];
#pragma unroll
    for (int i = 0; i < B; i++) {
        uint4 v = __ldg((const uint4 *)(exl_qw_col(q, col0) + (int64_t)(meta.x + i) * EXL_QW_TILE));
        w[0][i] = v.x, w[1][i] = v.y, w[2][i] = v.z, w[3][i] = v.w;
    }
    const int64_t g0 = (int64_t)meta.z * q.n_pad + col0;
    uint2 sraw = __ldg((const uint2 *)(q.scales + g0));
    __half sh[DQ_COLS_T];
    memcpy(sh, &sraw, 8);
    float sc[DQ_COLS_T];
    __half2 zz[DQ_COLS_T];
#pragma unroll
    for (int c = 0; c < DQ_COLS_T; c++)
        sc[c] = __half2float(sh[c]), zz[c] = zero_pair(q.zeros, g0 + c, B);
    const int2 *src = (const int2 *)(q.slot_src + chunk * CHUNK);
    const int j = col0 - n0;
    const bool whole = col0 + DQ_COLS_T <= end;
#pragma unroll
    for (int p = 0; p < 16; p++) {
        int2 sp = __ldg(src + p);
        __half hi[2][DQ_COLS_T], lo[2][DQ_COLS_T];
#pragma unroll
        for (int c = 0; c < DQ_COLS_T; c++) {
            float2 f = __half22float2(pair_at<B>(w[c], p, zz[c]));
            float v[2] = {sc[c] * f.x, sc[c] * f.y};
#pragma unroll
            for (int k = 0; k < 2; k++) {
                hi[k][c] = __float2half_rn(v[k]);
                lo[k][c] = __float2half_rn((v[k] - __half2float(hi[k][c])) * EXL_CUDA_LO_SCALE);
            }
        }
#pragma unroll
        for (int k = 0; k < 2; k++) {
            int row = k ? sp.y : sp.x;
            if (row < 0)
                continue;
            __half *d = dst + (int64_t)row * ld + j;
            if (whole) {
                uint2 u;
                memcpy(&u, hi[k], 8);
                *(uint2 *)d = u;
                if (lo_at) {
                    memcpy(&u, lo[k], 8);
                    *(uint2 *)(d + lo_at) = u;
                }
            } else {
                for (int c = 0; c < DQ_COLS_T && col0 + c < end; c++) {
                    d[c] = hi[k][c];
                    if (lo_at)
                        d[lo_at + c] = lo[k][c];
                }
            }
        }
    }
}

/* dst[in, ld] (hi) and dst[lo_at + ...] (lo, unless lo_at is 0) = the columns n0 .. end of q (dst column 0 is
 * column n0); grid x: column tiles of the slab, y: groups of DQ_SUBS chunks */
__global__ void __launch_bounds__(DQ_COLS / DQ_COLS_T * DQ_SUBS)
    dequant_kernel(__half *dst, const __grid_constant__ exl_qmatrix q, int32_t n0, int32_t end, int32_t ld,
                   int64_t lo_at) {
    exl_pdl_start();
    const int lanes = DQ_COLS / DQ_COLS_T;
    const int chunk = blockIdx.y * DQ_SUBS + threadIdx.x / lanes;
    const int col0 = n0 + blockIdx.x * DQ_COLS + (threadIdx.x % lanes) * DQ_COLS_T;
    if (chunk >= q.n_chunks || col0 >= end)
        return;
    int4 meta = __ldg(q.chunks + chunk);
    switch (meta.y) {
    case 2: dequant_chunk<2>(q, meta, chunk, col0, n0, end, ld, lo_at, dst); break;
    case 3: dequant_chunk<3>(q, meta, chunk, col0, n0, end, ld, lo_at, dst); break;
    case 4: dequant_chunk<4>(q, meta, chunk, col0, n0, end, ld, lo_at, dst); break;
    case 5: dequant_chunk<5>(q, meta, chunk, col0, n0, end, ld, lo_at, dst); break;
    case 6: dequant_chunk<6>(q, meta, chunk, col0, n0, end, ld, lo_at, dst); break;
    default: dequant_chunk<8>(q, meta, chunk, col0, n0, end, ld, lo_at, dst); break;
    }
}

static void dequant(exl_cuda_backend *cb, __half *dst, const exl_qmatrix *q, int32_t n0, int32_t end, int32_t ld,
                    int64_t lo_at) {
    dim3 grid((unsigned)((end - n0 + DQ_COLS - 1) / DQ_COLS), (unsigned)((q->n_chunks + DQ_SUBS - 1) / DQ_SUBS));
    exl_cuda_launch(cb, dequant_kernel, grid, dim3(DQ_COLS / DQ_COLS_T * DQ_SUBS), 0, dst, *q, n0, end, ld, lo_at);
    exl_cuda_check_launch(cb, "quantized matmul (decoding the weights)");
}

void exl_cuda_qgemm(exl_cuda_backend *cb, const exl_cuda_fused_mm *f, int parts) {
    const int n = f->n, accumulate = f->accumulate, with_lo = cb->exact_prefill;
    const exl_linear *const *w = f->w;
    const int32_t K = w[0]->in, rows = f->rows;
    int64_t together = 0; /* the matrices side by side, each from a column tile boundary */
    for (int i = 0; i < n; i++)
        together += w[i]->q.n_pad;
    /* one slab: all the matrices, or whole column tiles of one, as many as SLAB_BYTES hold */
    const size_t tile_bytes = (with_lo ? 2 : 1) * (size_t)K * DQ_COLS * sizeof(__half);
    const int fused = rows <= EXL_CUDA_STACK_ROWS && (size_t)together / DQ_COLS * tile_bytes <= SLAB_BYTES;
    int64_t slab = (int64_t)(SLAB_BYTES / tile_bytes) * DQ_COLS;
    slab = slab < DQ_COLS ? DQ_COLS : slab;
    for (int i = 0; i < n && !fused; i++)
        slab = slab > w[i]->q.n_pad ? w[i]->q.n_pad : slab;
    if (fused)
        slab = together;
    const int64_t lo_at = with_lo ? (int64_t)K * slab : 0;
    if (!exl_cuda_ensure(cb, &cb->scratch, &cb->scratch_bytes, (size_t)parts * rows * K * sizeof(__half),
                         "fp16 activations") ||
        !exl_cuda_ensure(cb, (void **)&cb->dequant, &cb->dequant_bytes,
                         (with_lo ? 2 : 1) * (size_t)K * slab * sizeof(__half), "fp16 weights"))
        return;
    __half *xh = (__half *)cb->scratch;
    exl_cuda_split_half(cb, xh, f->x, f->norm, f->eps, f->up, f->act, rows, K, parts);
    exl_cuda_f16w fw = {cb->dequant, with_lo ? cb->dequant + lo_at : NULL, 0, slab};
    if (fused) {
        for (int64_t i = 0, at = 0; i < n; at += w[i]->q.n_pad, i++)
            dequant(cb, cb->dequant + at, &w[i]->q, 0, w[i]->out, (int32_t)slab, lo_at);
        int n_parts;
        const float *c = exl_cuda_gemm_stacked(cb, xh, parts, rows, K, &fw, (int32_t)slab, &n_parts);
        for (int64_t i = 0, at = 0; c && i < n; at += w[i]->q.n_pad, i++)
            exl_cuda_parts_sum(cb, f->out[i], w[i]->out, c + at, slab, w[i]->out, rows, n_parts, w[i]->bias,
                               accumulate);
        return;
    }
    for (int i = 0; i < n; i++)
        for (int32_t n0 = 0, N = w[i]->out; n0 < N; n0 += (int32_t)slab) {
            int32_t width = N - n0 < slab ? N - n0 : (int32_t)slab;
            dequant(cb, cb->dequant, &w[i]->q, n0, n0 + width, (int32_t)slab, lo_at);
            exl_cuda_gemm_parts(cb, f->out[i] + n0, N, xh, parts, rows, K, &fw, width,
                                w[i]->bias ? w[i]->bias + n0 : NULL, accumulate);
        }
}
