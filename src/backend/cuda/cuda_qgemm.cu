/* cuda_qgemm.cu - quantized matmul for many rows (prefill chunks, big batches) through
 * cuBLAS: the weights are decoded once per matmul into fp16 W[in, width] (a slab of the
 * output columns at a time, natural input order, value fp16(scale · (q − z))) and multiplied
 * with the activations' two fp16 parts by exl_cuda_gemm_parts (cuda_matmul.cu).
 *
 * The tensor-core kernel of cuda_qmma.cu decodes the codes again for every 32 rows; from
 * EXL_CUDA_DEQUANT_ROWS rows (see exl_cuda_dequant_rows) decoding once and letting cuBLAS
 * run at its rate is faster. The fp16 rounding of scale · (q − z) costs ~2^-12 of each
 * weight, as in ExLlamaV2's own prefill path. */
#include "backend/cuda/cuda_qdecode.cuh"

#include <stdlib.h>

#define DQ_COLS 256          /* columns a block decodes: 64 threads x 4 */
#define DQ_SUBS 4            /* chunks a block decodes, one per 64 threads */
#define SLAB_BYTES (128u << 20) /* fp16 weights decoded at once, at most */

/* Column quad c of the B words of one chunk, decoded and scaled: v[p] holds slots 2p, 2p+1 of
 * column col0 + c. */
template <int B>
__device__ __forceinline__ void decode_column(const uint4 (&wv)[B], int c, __half2 zz, __half2 s2,
                                              __half2 (&v)[16]) {
    uint32_t w[B];
#pragma unroll
    for (int i = 0; i < B; i++)
        w[i] = c == 0 ? wv[i].x : c == 1 ? wv[i].y : c == 2 ? wv[i].z : wv[i].w;
    decode_chunk<B>(w, zz, [&](int p, __half2 qz) { v[p] = __hmul2(qz, s2); });
}

template <int B>
__device__ __forceinline__ void dequant_chunk(const exl_qmatrix &q, int4 meta, int chunk, int col0, int n0,
                                              int32_t end, int32_t ld, __half *dst) {
    uint4 wv[B];
#pragma unroll
    for (int i = 0; i < B; i++)
        wv[i] = __ldg((const uint4 *)(q.qw + (int64_t)(meta.x + i) * q.n_pad + col0));
    const int64_t g0 = (int64_t)meta.z * q.n_pad + col0;
    uint2 sraw = __ldg((const uint2 *)(q.scales + g0));
    __half sc[4];
    memcpy(sc, &sraw, 8);
    __half2 v[4][16];
#pragma unroll
    for (int c = 0; c < 4; c++)
        decode_column<B>(wv, c, zero_pair(q.zeros, g0 + c, B), __half2half2(sc[c]), v[c]);
    const int2 *src = (const int2 *)(q.slot_src + chunk * CHUNK);
    const int j = col0 - n0;
#pragma unroll
    for (int p = 0; p < 16; p++) {
        int2 sp = __ldg(src + p);
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int row = h ? sp.y : sp.x;
            if (row < 0)
                continue;
            __half e[4];
#pragma unroll
            for (int c = 0; c < 4; c++)
                e[c] = h ? __high2half(v[c][p]) : __low2half(v[c][p]);
            __half *d = dst + (int64_t)row * ld + j;
            if (col0 + 4 <= end) {
                uint2 u;
                memcpy(&u, e, 8);
                *(uint2 *)d = u;
            } else {
                for (int c = 0; c < 4 && col0 + c < end; c++)
                    d[c] = e[c];
            }
        }
    }
}

/* dst[in, ld] = the columns n0 .. end of q as fp16; grid x: column tiles of the slab,
 * y: groups of DQ_SUBS chunks */
__global__ void __launch_bounds__(DQ_COLS / 4 * DQ_SUBS)
    dequant_kernel(__half *dst, const __grid_constant__ exl_qmatrix q, int32_t n0, int32_t end, int32_t ld) {
    exl_pdl_start();
    const int quad = threadIdx.x % 64, chunk = blockIdx.y * DQ_SUBS + threadIdx.x / 64;
    const int col0 = n0 + blockIdx.x * DQ_COLS + quad * 4;
    if (chunk >= q.n_chunks || col0 >= end)
        return;
    int4 meta = __ldg(q.chunks + chunk);
    switch (meta.y) {
    case 2: dequant_chunk<2>(q, meta, chunk, col0, n0, end, ld, dst); break;
    case 3: dequant_chunk<3>(q, meta, chunk, col0, n0, end, ld, dst); break;
    case 4: dequant_chunk<4>(q, meta, chunk, col0, n0, end, ld, dst); break;
    case 5: dequant_chunk<5>(q, meta, chunk, col0, n0, end, ld, dst); break;
    case 6: dequant_chunk<6>(q, meta, chunk, col0, n0, end, ld, dst); break;
    default: dequant_chunk<8>(q, meta, chunk, col0, n0, end, ld, dst); break;
    }
}

int32_t exl_cuda_dequant_rows(void) {
    static int32_t rows = 0;
    if (!rows) {
        const char *s = getenv("EXL_CUDA_DEQUANT_ROWS");
        rows = s && atoi(s) > 0 ? atoi(s) : EXL_CUDA_DEQUANT_ROWS_DEFAULT;
    }
    return rows;
}

void exl_cuda_qgemm(exl_cuda_backend *cb, float *out, const float *x, const exl_linear *w, int32_t rows) {
    const exl_qmatrix *q = &w->q;
    const int32_t K = w->in, N = w->out;
    /* slab width: whole column tiles, as many as SLAB_BYTES of fp16 hold (at least one) */
    int64_t per_tile = (int64_t)K * DQ_COLS * sizeof(__half);
    int32_t slab = (int32_t)(SLAB_BYTES / per_tile) * DQ_COLS;
    slab = slab < DQ_COLS ? DQ_COLS : slab;
    slab = slab > q->n_pad ? q->n_pad : slab;
    size_t wbytes = (size_t)K * slab * sizeof(__half), xbytes = 2 * (size_t)rows * K * sizeof(__half);
    if (!exl_cuda_ensure(cb, &cb->scratch, &cb->scratch_bytes, xbytes, "fp16 activations") ||
        !exl_cuda_ensure(cb, (void **)&cb->dequant, &cb->dequant_bytes, wbytes, "fp16 weights"))
        return;
    __half *xh = (__half *)cb->scratch;
    exl_cuda_split_half(cb, xh, x, rows, K);
    for (int32_t n0 = 0; n0 < N; n0 += slab) {
        int32_t width = N - n0 < slab ? N - n0 : slab;
        dim3 grid((unsigned)((width + DQ_COLS - 1) / DQ_COLS), (unsigned)((q->n_chunks + DQ_SUBS - 1) / DQ_SUBS));
        exl_cuda_launch(cb, dequant_kernel, grid, dim3(DQ_COLS / 4 * DQ_SUBS), 0, cb->dequant, *q, n0, n0 + width,
                        slab);
        if (!exl_cuda_check_launch(cb, "quantized matmul (decoding the weights)"))
            return;
        exl_cuda_gemm_parts(cb, out + n0, N, xh, rows, K, cb->dequant, 0, slab, width,
                            w->bias ? w->bias + n0 : NULL);
    }
}
