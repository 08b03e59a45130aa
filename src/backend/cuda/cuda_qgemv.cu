/* cuda_qgemv.cu - fused dequantize + GEMV for few rows (the decode case) over up to three
 * quantized matrices that share their input, with the layer's neighbours fused in: the
 * input's RMSNorm or GLU is applied while the activations are gathered, and the result
 * can be added to the output (the residual). 1-4 rows on CUDA cores, qgemv_kernel, described here (from 5 rows
 * cuda_qmma.cu is faster); a single wide matrix (the head) at 5-16 rows on tensor cores, qgemv_a_kernel
 * (cuda_qgemv_a.cuh, included below).
 *
 * Grid: x = column tiles of 256 (64 threads x 4 columns, 16-byte loads) of all the matrices
 * one after another, y = a split of the input chunks; at most BLOCKS_PER_SM blocks an SM.
 * A block first asks L2 for the weights of its first chunks (a tile's words lie together:
 * exl_qw_col), then gathers its chunks' activations (slot order, fp16 pairs); its 4 warp pairs
 * take every 4th chunk of the block's range and the block sums them in shared memory. With
 * a split, a result added to the output (the residual), or written to outputs that an
 * earlier launch zeroed for it (exl_cuda_fused_mm.clear / out_zeroed: q/k/v and gate/up in
 * decode steps, cleared by the launch that adds into the residual before them), takes each
 * block's sum by an atomic add (fp32; the order of the adds varies from run to run in the
 * last bits); otherwise, or with EXL_CUDA_DETERMINISTIC=1, the last block of a column tile to
 * arrive (counter per tile, reset by it) adds the partial sums in split order. Products are
 * summed in fp16 over 8 rows at most, then in fp32, and scaled per chunk in fp32.
 * Launched with programmatic dependent launch: the L2 requests for those weights, and the
 * activation rows and norm weights of a thread's first pairs, are made before
 * griddepcontrol.wait, while the previous kernel is still running; after it those pairs'
 * values are loaded together with the RMS pass, one memory round trip instead of three (one
 * normed row is kept whole in shared memory by that pass and gathered from there). The last
 * block reads the partial sums eight at a time. A decode GLU's gate and up are stored in the
 * slot order of the matrix they feed (exl_qmatrix.slot_of), as is the decode attention's output
 * for o_proj; that matrix's launch then reads consecutive rows (gemv_args.out_map, x_slots).
 * The q/k/v launch of a decode step also asks L2 for the short sequences' KV cache rows that the
 * attention after it reads (exl_cuda_fused_mm.kv, kv_prefetch). */
#include "backend/cuda/cuda_async.cuh"
#include "backend/cuda/cuda_lora_fold.cuh"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_qdecode.cuh"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define COL_TILE EXL_QW_TILE
#define GEMV_THREADS 256
#define SUBS (GEMV_THREADS / 64)
#define MAX_MATS 3
#define ROWS_PER_LAUNCH 4 /* rows of one launch of qgemv_kernel (more rows: several launches) */
/* chunks of each warp pair asked of L2 before griddepcontrol.wait: enough to cover the wait,
 * while asking for all of a block's weights at once (up to 258 KiB for the 6-bit head) fills
 * the memory queues ahead of the loads that are needed first (see bench/RESULTS.md) */
#define PREFETCH_CHUNKS 2
/* blocks an SM holds at most (occupancy_floor): 3 measured faster than 2 or 4 */
#define BLOCKS_PER_SM 3
#define ACTS_SMEM_MAX 24576 /* bytes of gathered fp16 activations a block holds at most */
#define STAGE_MAX_IN 8192   /* inputs of the largest normed row a one-row block keeps whole */

/* the largest row a one-row launch keeps in shared memory (0: none, the opt-in failed) */
static int stage_max_in;

typedef struct gemv_mat {
    exl_qmatrix q;
    float *out;
    const float *bias;
    int32_t n_out;
    int32_t tile_end; /* column tiles of this and the earlier matrices */
} gemv_mat;

typedef struct gemv_args {
    gemv_mat m[MAX_MATS];
    int32_t n_mats;
    const float *x, *up, *norm;
    float eps;
    int32_t act, in, accumulate;
    int32_t chunks_per_block;
    float *partial;     /* [split][R][tiles * COL_TILE] */
    unsigned *counters; /* [tiles] */
    int32_t stage;      /* one normed row: keep it in shared memory after the activations (in floats) */
    int32_t atomic_add; /* a split's blocks add their sums to the output atomically (accumulated, or
                         * onto outputs an earlier launch zeroed) */
    float *clear[3];    /* zeroed by this launch for a later one (exl_cuda_fused_mm.clear) */
    int64_t n_clear[3];
    const int32_t *out_map;    /* output column c goes to out_map[c] (a GLU's inputs in its slot order) */
    int32_t x_slots;           /* x (and up) are in the slot order of the (one) matrix: slot s reads row s */
    const __half *kv_k, *kv_v; /* exl_cuda_fused_mm.kv, where this launch asks L2 for those rows */
    const exl_attn_seq *kv_seqs;
    const int32_t *kv_pages;
    int32_t kv_n_seqs, kv_page_size, kv_width;
    int32_t rows;       /* qgemv_a_kernel: the rows (up to EXL_CUDA_QGEMV_MAX_ROWS) */
    exl_lora_fold lora; /* one row: the LoRA updates folded in (cuda_lora_fold.cuh; units 0: none) */
} gemv_args;

/* ---- the input transform */

/* 1 / RMS of each row; with stage (one row, a.in % 4 == 0) the row is also kept there */
template <int R>
__device__ void row_inv_rms(const gemv_args &a, float *inv, float *red, float *stage) {
    for (int r = 0; r < R; r++) {
        const float *xr = a.x + (int64_t)r * a.in;
        float ss = 0.0f;
        if (a.in % 4 == 0) {
#pragma unroll 4
            for (int i = threadIdx.x; i < a.in / 4; i += GEMV_THREADS) {
                float4 v = __ldg((const float4 *)xr + i);
                ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                if (stage)
                    ((float4 *)stage)[i] = v;
            }
        } else {
#pragma unroll 4
            for (int i = threadIdx.x; i < a.in; i += GEMV_THREADS)
                ss += xr[i] * xr[i];
        }
        for (int o = 16; o > 0; o >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (threadIdx.x % 32 == 0)
            red[threadIdx.x / 32] = ss;
        __syncthreads();
        if (threadIdx.x == 0) {
            float t = 0.0f;
            for (int w = 0; w < (GEMV_THREADS / 32); w++)
                t += red[w];
            inv[r] = rsqrtf(t / a.in + a.eps);
        }
        __syncthreads();
    }
}

/* the inputs of pair i of the chunks from c0 on: consecutive rows where x is already in slot
 * order (x_slots), else the matrix's slot_src (-1: padding) */
__device__ __forceinline__ int2 slot_pair(const gemv_args &a, const exl_qmatrix &q, int c0, int i) {
    return a.x_slots ? make_int2(c0 * CHUNK + 2 * i, c0 * CHUNK + 2 * i + 1)
                     : __ldg((const int2 *)(q.slot_src + c0 * CHUNK) + i);
}

/* x, or the GLU of x and up, at input s (0 for padding) */
__device__ __forceinline__ float input_raw(const gemv_args &a, int r, int s) {
    if (s < 0)
        return 0.0f;
    float v = a.x[(int64_t)r * a.in + s];
    return a.up ? exl_cuda_activate(v, a.act) * a.up[(int64_t)r * a.in + s] : v;
}

/* the input transform at input s: the RMSNorm (never set together with up) or input_raw */
template <int R>
__device__ __forceinline__ float input_at(const gemv_args &a, int r, int s, const float *inv) {
    if (a.norm && s >= 0)
        return a.norm[s] * (a.x[(int64_t)r * a.in + s] * inv[r]);
    return input_raw(a, r, s);
}

/* ---- the KV cache rows of the attention after this launch (exl_cuda_fused_mm.kv) */

/* Sequences with at most this many keys have them asked of L2 by the q/k/v launch: the decode
 * attention's blocks fetch their keys only once they are placed, late in that launch, when its
 * weight stream holds the memory; each block asks for its share as its chunk loop ends, so that
 * the rows come while the launch's last blocks leave the memory idle (+1.2% at 128-200 keys,
 * bench/RESULTS.md); 2048 keys (33 MB a layer for a 7B model) asked for at the launch's start
 * crowded its weights out of L2 (-6.6%). */
#define KV_PREFETCH_MAX_KEYS 256

/* this block's share of each (sequence, page) run of K and V rows: one bulk L2 prefetch each
 * (thread 0, after griddepcontrol.wait; the rows it asks for are earlier steps', final) */
__device__ void kv_prefetch(const gemv_args &a) {
#if __CUDA_ARCH__ >= 900
    const int64_t nb = (int64_t)gridDim.x * gridDim.y, b = (int64_t)blockIdx.y * gridDim.x + blockIdx.x;
    const int64_t row_bytes = (int64_t)a.kv_width * sizeof(__half);
    for (int s = 0; s < a.kv_n_seqs; s++) {
        const exl_attn_seq sq = a.kv_seqs[s];
        if (sq.n_kv > KV_PREFETCH_MAX_KEYS)
            continue;
        for (int t0 = 0; t0 < sq.n_kv; t0 += a.kv_page_size) {
            const int64_t slot0 = (int64_t)a.kv_pages[sq.page_start + t0 / a.kv_page_size] * a.kv_page_size;
            const int64_t bytes = min(a.kv_page_size, sq.n_kv - t0) * row_bytes;
            const int64_t share = ((bytes + nb - 1) / nb + 127) / 128 * 128, off = b * share;
            if (off >= bytes)
                continue;
            const unsigned n = (unsigned)min(share, bytes - off);
            const char *k = (const char *)(a.kv_k + slot0 * a.kv_width) + off;
            const char *v = (const char *)(a.kv_v + slot0 * a.kv_width) + off;
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(k), "r"(n) : "memory");
            asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(v), "r"(n) : "memory");
        }
    }
#endif
}

/* the buffers zeroed for a later launch's atomic adds (after griddepcontrol.wait: the ops before this one are
 * done), by blocks of `threads` */
__device__ __forceinline__ void clear_later(const gemv_args &a, int threads = GEMV_THREADS) {
    const int64_t stride = (int64_t)gridDim.x * gridDim.y * threads;
    const int64_t me = ((int64_t)blockIdx.y * gridDim.x + blockIdx.x) * threads + threadIdx.x;
#pragma unroll
    for (int b = 0; b < 3; b++)
        for (int64_t i = me; i < a.n_clear[b]; i += stride)
            a.clear[b][i] = 0.0f;
}

/* ---- GEMV */

template <int R, int B>
__device__ __forceinline__ void gemv_chunk(const uint32_t *wcol, int64_t n_pad, int col0, int4 meta,
                                           const __half *scales, const __half *zeros, const __half2 *xs, int xs_stride,
                                           float (&acc)[R][4]) {
    uint4 wv[B];
#pragma unroll
    for (int i = 0; i < B; i++)
        wv[i] = __ldg((const uint4 *)(wcol + (int64_t)(meta.x + i) * EXL_QW_TILE));
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

/* LORA (one row): EXL_LORA_NONE, or how a LoRA update is folded in (cuda_lora_fold.cuh) */
template <int R, int LORA = EXL_LORA_NONE>
__global__ void __launch_bounds__(GEMV_THREADS, R == 1 ? 3 : 2) qgemv_kernel(const __grid_constant__ gemv_args a) {
    extern __shared__ __half2 xs[]; /* [R][chunks_per_block * 16] */
    __shared__ float red[SUBS][R][COL_TILE];
    __shared__ float inv[R], red_rms[GEMV_THREADS / 32];
    __shared__ int is_last;
    const int tid = threadIdx.x, quad = tid % 64, sub = tid / 64;
    /* the runs of the dots in these blocks (both ways), the expand too (in-block) */
    constexpr bool SHRINK = R == 1 && LORA != EXL_LORA_NONE, FOLD = R == 1 && LORA == EXL_LORA_IN_BLOCK;
    if (R == 1 && LORA == EXL_LORA_SIDE && (int)blockIdx.x >= a.lora.side_x0) { /* a side block */
        const exl_lora_side_io io = {a.x,
                                     a.eps,
                                     a.in,
                                     a.n_mats,
                                     a.norm != NULL,
                                     {a.m[0].out, a.m[1].out, a.m[2].out},
                                     {a.m[0].n_out, a.m[1].n_out, a.m[2].n_out},
                                     a.out_map};
        exl_lora_side(a.lora, io, ((int)blockIdx.x - a.lora.side_x0) * (int)gridDim.y + (int)blockIdx.y,
                      a.lora.side_cols * (int)gridDim.y, &red[0][0][0]);
        if (a.kv_k && tid == 0)
            kv_prefetch(a);
        clear_later(a);
        return;
    }
    int mi = 0;
    while (mi + 1 < a.n_mats && (int)blockIdx.x >= a.m[mi].tile_end)
        mi++;
    const gemv_mat &M = a.m[mi];
    const exl_qmatrix &q = M.q;
    const int cpb = a.chunks_per_block;
    const int c0 = blockIdx.y * cpb;
    const int n_loc = max(0, min(cpb, q.n_chunks - c0));
    const int xs_stride = cpb * 16;
    const int col0 = ((int)blockIdx.x - (mi ? a.m[mi - 1].tile_end : 0)) * COL_TILE + quad * 4;

    /* the column this thread sums at the end, and where it goes (a table read, done before the wait) */
    const int tcol = ((int)blockIdx.x - (mi ? a.m[mi - 1].tile_end : 0)) * COL_TILE + tid;
    const int ocol = tcol < M.n_out && a.out_map ? __ldg(a.out_map + tcol) : tcol;
    /* start the first chunks' weights on their way to L2, while the previous kernel finishes */
    const uint32_t *wcol = exl_qw_col(q, col0);
    for (int lc = sub; lc < n_loc && lc < PREFETCH_CHUNKS * SUBS; lc += SUBS) {
        int4 meta = __ldg(q.chunks + c0 + lc);
        for (int i = 0; i < meta.y; i++)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(wcol + (int64_t)(meta.x + i) * EXL_QW_TILE));
    }
    /* this thread's first activation pairs: their rows and norm weights before the wait,
     * their values right after it, in flight together with the RMS pass's loads */
    constexpr int PRE = R == 1 ? 4 : R == 2 ? 2 : 1;
    int2 sp[PRE];
    float2 nw[PRE];
#pragma unroll
    for (int j = 0; j < PRE; j++) {
        const int i = tid + j * GEMV_THREADS;
        sp[j] = make_int2(-1, -1);
        nw[j] = make_float2(1.0f, 1.0f);
        if (i < n_loc * 16) {
            sp[j] = slot_pair(a, q, c0, i);
            if (a.norm)
                nw[j] = make_float2(sp[j].x >= 0 ? __ldg(a.norm + sp[j].x) : 0.0f,
                                    sp[j].y >= 0 ? __ldg(a.norm + sp[j].y) : 0.0f);
        }
    }
    exl_lora_first lrun = {};
    if (SHRINK) {
        lrun = exl_lora_run_start(a.lora, a.n_mats, a.in, a.norm, a.x_slots);
        if (FOLD && blockIdx.y == 0)
            exl_lora_prefetch_bt(a.lora, mi, col0 - quad * 4, M.n_out);
    }
    exl_pdl_start();
    if (SHRINK)
        exl_lora_run_load(lrun, a.x, a.up, a.act);
    /* one normed row: the RMS pass's coalesced loads keep the row in shared memory and the
     * gather reads it there, instead of one scattered global load per input */
    float *stage = R == 1 && a.stage ? (float *)(xs + R * xs_stride) : nullptr;
    float2 xv[PRE][R];
    if (!stage)
#pragma unroll
        for (int j = 0; j < PRE; j++)
#pragma unroll
            for (int r = 0; r < R; r++)
                xv[j][r] = make_float2(input_raw(a, r, sp[j].x), input_raw(a, r, sp[j].y));
    if (a.norm)
        row_inv_rms<R>(a, inv, red_rms, stage);
    if (stage)
#pragma unroll
        for (int j = 0; j < PRE; j++)
            xv[j][0] = make_float2(sp[j].x >= 0 ? stage[sp[j].x] : 0.0f, sp[j].y >= 0 ? stage[sp[j].y] : 0.0f);
#pragma unroll
    for (int j = 0; j < PRE; j++) {
        const int i = tid + j * GEMV_THREADS;
        if (i < n_loc * 16)
#pragma unroll
            for (int r = 0; r < R; r++) {
                float2 v = xv[j][r];
                if (a.norm)
                    v = make_float2(nw[j].x * (v.x * inv[r]), nw[j].y * (v.y * inv[r]));
                xs[r * xs_stride + i] = __floats2half2_rn(v.x, v.y);
            }
    }
    for (int i = tid + PRE * GEMV_THREADS; i < n_loc * 16; i += GEMV_THREADS) {
        int2 sp = slot_pair(a, q, c0, i);
        if (stage) {
            xs[i] = __floats2half2_rn(sp.x >= 0 ? a.norm[sp.x] * (stage[sp.x] * inv[0]) : 0.0f,
                                      sp.y >= 0 ? a.norm[sp.y] * (stage[sp.y] * inv[0]) : 0.0f);
            continue;
        }
#pragma unroll
        for (int r = 0; r < R; r++)
            xs[r * xs_stride + i] = __floats2half2_rn(input_at<R>(a, r, sp.x, inv), input_at<R>(a, r, sp.y, inv));
    }
    if (SHRINK)
        exl_lora_run_sum(a.lora, lrun, a.n_mats, a.in, a.x, a.up, a.norm, a.act, a.x_slots, red_rms);
    __syncthreads();
    if (SHRINK) {
        exl_lora_run_publish(a.lora, lrun.unit, red_rms);
        exl_lora_run_rest(a.lora, a.n_mats, a.in, a.x, a.up, a.norm, a.act, a.x_slots, red_rms);
    }

    float acc[R][4];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            acc[r][c] = 0.0f;
    /* in registers: left as q's fields, each chunk re-read them from the parameter bank
     * (indexed by the matrix) before it could address its weights */
    const int64_t n_pad = q.n_pad;
    const __half *scales = q.scales, *zeros = q.zeros;
    for (int lc = sub; lc < n_loc; lc += SUBS) {
        int4 meta = __ldg(q.chunks + c0 + lc);
        const __half2 *xc = xs + lc * 16;
        /* direct branches on the width: a switch here became a jump table, whose indirect
         * branch (BRX) each chunk paid for; the commonest width (4 bits: EXL2 near 4 bpw, GPTQ)
         * last, which places its code right after these tests, not after all the others'
         * (+1% decode; bench/RESULTS.md) */
        const int bits = meta.y;
        if (bits == 8)
            gemv_chunk<R, 8>(wcol, n_pad, col0, meta, scales, zeros, xc, xs_stride, acc);
        else if (bits == 6)
            gemv_chunk<R, 6>(wcol, n_pad, col0, meta, scales, zeros, xc, xs_stride, acc);
        else if (bits == 5)
            gemv_chunk<R, 5>(wcol, n_pad, col0, meta, scales, zeros, xc, xs_stride, acc);
        else if (bits == 3)
            gemv_chunk<R, 3>(wcol, n_pad, col0, meta, scales, zeros, xc, xs_stride, acc);
        else if (bits == 2)
            gemv_chunk<R, 2>(wcol, n_pad, col0, meta, scales, zeros, xc, xs_stride, acc);
        else
            gemv_chunk<R, 4>(wcol, n_pad, col0, meta, scales, zeros, xc, xs_stride, acc);
    }
    if (a.kv_k && tid == 0)
        kv_prefetch(a);
    clear_later(a);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            red[sub][r][quad * 4 + c] = acc[r][c];
    __syncthreads();

    const int gcol = blockIdx.x * COL_TILE + tid; /* column in the partial sums */
    float sum[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        sum[r] = 0.0f;
#pragma unroll
        for (int s = 0; s < SUBS; s++)
            sum[r] += red[s][r][tid];
    }
    /* the LoRA updates folded in: added by one block a column tile (the split's first where its blocks add, else
     * the one that stores the sum); red is free by then (the expand's first barrier) */
    const float lora_inv = FOLD && a.norm ? inv[0] : 1.0f;
    if (a.atomic_add) {
        if (FOLD && blockIdx.y == 0)
            sum[0] += exl_lora_expand(a.lora, a.n_mats, mi, tcol, M.n_out, lora_inv, &red[0][0][0]);
        /* no partial sums, fence or counter: the adds are done in L2, after the block is gone */
        if (tcol < M.n_out)
#pragma unroll
            for (int r = 0; r < R; r++)
                atomicAdd(M.out + (int64_t)r * M.n_out + ocol,
                          sum[r] + (M.bias && blockIdx.y == 0 ? M.bias[tcol] : 0.0f));
        return;
    }
    if (gridDim.y > 1) {
        const int64_t width = (int64_t)gridDim.x * COL_TILE;
#pragma unroll
        for (int r = 0; r < R; r++)
            a.partial[((int64_t)blockIdx.y * R + r) * width + gcol] = sum[r];
        __threadfence();
        __syncthreads();
        if (tid == 0)
            is_last = atomicAdd(&a.counters[blockIdx.x], 1u) == gridDim.y - 1;
        __syncthreads();
        if (!is_last)
            return;
        __threadfence();
#pragma unroll
        for (int r = 0; r < R; r++) {
            /* eight loads in flight at a time, added in split order */
            sum[r] = 0.0f;
            for (unsigned y0 = 0; y0 < gridDim.y; y0 += 8) {
                float v[8];
#pragma unroll
                for (unsigned e = 0; e < 8; e++)
                    v[e] = y0 + e < gridDim.y ? __ldcg(a.partial + ((int64_t)(y0 + e) * R + r) * width + gcol) : 0.0f;
#pragma unroll
                for (int e = 0; e < 8; e++)
                    sum[r] += v[e];
            }
        }
        if (tid == 0)
            a.counters[blockIdx.x] = 0;
    }
    if (FOLD)
        sum[0] += exl_lora_expand(a.lora, a.n_mats, mi, tcol, M.n_out, lora_inv, &red[0][0][0]);
    if (tcol < M.n_out)
#pragma unroll
        for (int r = 0; r < R; r++) {
            float *dst = M.out + (int64_t)r * M.n_out + ocol;
            *dst = (a.accumulate ? *dst : 0.0f) + sum[r] + (M.bias ? M.bias[tcol] : 0.0f);
        }
}

#include "backend/cuda/cuda_qgemv_a.cuh"

/* ---- launch */

/* Shared memory a block of qgemv_kernel<R> asks for at least, so that an SM holds no more than
 * BLOCKS_PER_SM of them: with more, the extra weight requests in flight slow every load down
 * (bench/RESULTS.md). 0 where the registers already keep the count down. */
template <int R>
static size_t occupancy_floor(const exl_cuda_backend *cb) {
    /* per device: the shared memory opt-in is (tensor parallelism: a backend a device) */
    static int done[EXL_CUDA_MAX_DEVICES];
    static size_t floor_bytes[EXL_CUDA_MAX_DEVICES];
    const int dev = cb->device >= 0 && cb->device < EXL_CUDA_MAX_DEVICES ? cb->device : 0;
    if (done[dev] && dev == cb->device)
        return floor_bytes[dev];
    done[dev] = 1;
    floor_bytes[dev] = 0;
    int cap = BLOCKS_PER_SM, n = 0, sm_smem = 0, reserved = 0;
    const char *e = getenv("EXL_CUDA_GEMV_BLOCKS_PER_SM");
    if (e)
        cap = atoi(e);
    cudaFuncAttributes fa;
    if (cap < 1 || cudaFuncGetAttributes(&fa, qgemv_kernel<R>) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, qgemv_kernel<R>, GEMV_THREADS, 0) != cudaSuccess ||
        n <= cap || cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, cb->device) ||
        cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, cb->device)) {
        cudaGetLastError();
        return 0;
    }
    size_t want = (size_t)(sm_smem / (cap + 1) - reserved - (int)fa.sharedSizeBytes + 128) / 128 * 128;
    if (want > 48 * 1024 &&
        cudaFuncSetAttribute(qgemv_kernel<R>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)want) != cudaSuccess) {
        cudaGetLastError();
        return 0;
    }
    floor_bytes[dev] = want;
    return want;
}

template <int R>
static void launch(exl_cuda_backend *cb, const gemv_args *a, int split) {
    dim3 grid((unsigned)(a->m[a->n_mats - 1].tile_end + a->lora.side_cols), (unsigned)split);
    size_t smem = (size_t)R * a->chunks_per_block * 16 * sizeof(__half2) + (a->stage ? a->in * sizeof(float) : 0);
    size_t floor = occupancy_floor<R>(cb);
    smem = smem > floor ? smem : floor;
    if (R == 1 && a->lora.units && a->lora.side_cols)
        exl_cuda_launch(cb, qgemv_kernel<1, EXL_LORA_SIDE>, grid, dim3(GEMV_THREADS), smem, *a);
    else if (R == 1 && a->lora.units)
        exl_cuda_launch(cb, qgemv_kernel<1, EXL_LORA_IN_BLOCK>, grid, dim3(GEMV_THREADS), smem, *a);
    else
        exl_cuda_launch(cb, qgemv_kernel<R>, grid, dim3(GEMV_THREADS), smem, *a);
    exl_cuda_check_launch(cb, "quantized GEMV");
}

static void launch_rows(exl_cuda_backend *cb, const gemv_args *a, int split, int rows) {
    switch (rows) {
    case 1: launch<1>(cb, a, split); break;
    case 2: launch<2>(cb, a, split); break;
    case 3: launch<3>(cb, a, split); break;
    default: launch<4>(cb, a, split); break;
    }
}

/* ---- slot order (cuda_internal.h) */

const int32_t *exl_cuda_slot_order(const exl_linear *w, int32_t rows, int32_t width) {
    /* the GEMV takes a quantized matmul of up to its rows (plan) */
    if (!w || w->kind == EXL_LINEAR_DENSE || w->in != width || rows < 1 || rows > EXL_CUDA_QGEMV_MAX_ROWS)
        return NULL;
    return w->q.slot_of;
}

enum { GEMV_NONE, GEMV_PLAIN, GEMV_A };

/* Which kernel takes f (GEMV_PLAIN: qgemv_kernel, up to ROWS_PER_LAUNCH rows a launch; GEMV_A: qgemv_a_kernel, a wide
 * matrix at 5-16 rows), GEMV_NONE if none does (5-16 rows of other matrices go to cuda_qmma.cu; prompt rows with
 * EXL_CUDA_EXACT_PREFILL=1 keep ~22 bits there). */
static int gemv_kind(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    if (f->rows < 1 || f->rows > EXL_CUDA_QGEMV_MAX_ROWS || f->n < 1 || f->n > MAX_MATS)
        return GEMV_NONE;
    if (wide_to_a(cb, f) && (f->decode || !cb->exact_prefill))
        return GEMV_A;
    return f->rows <= ROWS_PER_LAUNCH ? GEMV_PLAIN : GEMV_NONE;
}

/* The launch arguments for f (less the per-row-group pointers) and its split; the kernel (gemv_kind), GEMV_NONE if
 * neither takes f. */
static int plan(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f, gemv_args *a, int *split) {
    const int kind = gemv_kind(cb, f);
    if (kind == GEMV_NONE)
        return GEMV_NONE;
    memset(a, 0, sizeof *a);
    int32_t tiles = 0, chunks = 0;
    for (int i = 0; i < f->n; i++) {
        const exl_linear *w = f->w[i];
        if (w->kind == EXL_LINEAR_DENSE || w->in != f->w[0]->in)
            return GEMV_NONE;
        tiles += w->q.n_pad / COL_TILE;
        a->m[i] = (gemv_mat){w->q, f->out[i], w->bias, w->out, tiles};
        chunks = w->q.n_chunks > chunks ? w->q.n_chunks : chunks;
    }
    a->n_mats = f->n;
    a->norm = f->norm ? f->norm->v : NULL;
    a->eps = f->eps;
    a->act = f->act;
    a->in = f->w[0]->in;
    a->stage = f->rows == 1 && f->norm && a->in % 4 == 0 && a->in <= stage_max_in;
    a->accumulate = f->accumulate;
    a->rows = f->rows;
    if (kind == GEMV_A)
        plan_a(cb, tiles, chunks, a, split);
    else {
        /* about 3 blocks per SM, at least 2 chunks per warp pair, activations under 24 KiB and with the static
         * reduction buffer (R KiB x 4) under 46 KiB */
        int R = f->rows < ROWS_PER_LAUNCH ? f->rows : ROWS_PER_LAUNCH;
        int s = 3 * cb->n_sms / tiles, max_split = (chunks + 2 * SUBS - 1) / (2 * SUBS);
        s = s > max_split ? max_split : s < 1 ? 1 : s;
        int smem = 47104 - 4096 * R > ACTS_SMEM_MAX ? ACTS_SMEM_MAX : 47104 - 4096 * R;
        int cpb = (chunks + s - 1) / s, max_cpb = smem / (R * 64);
        a->chunks_per_block = cpb > max_cpb ? max_cpb : cpb;
        *split = (chunks + a->chunks_per_block - 1) / a->chunks_per_block;
    }
    a->atomic_add = *split > 1 && (f->accumulate || f->out_zeroed) && !cb->deterministic;
    a->out_map = f->out_map;
    a->x_slots = f->x_slots;
    return kind;
}

void exl_cuda_qgemv_init(const exl_cuda_backend *cb) {
    const size_t floor = occupancy_floor<1>(cb), want = ACTS_SMEM_MAX + STAGE_MAX_IN * sizeof(float);
    const int most = (int)(want > floor ? want : floor);
    /* the LoRA instantiations take the same launches (a failure: no row staged, as for the plain one) */
    if (cudaFuncSetAttribute(qgemv_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) == cudaSuccess &&
        cudaFuncSetAttribute(qgemv_kernel<1, EXL_LORA_IN_BLOCK>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) ==
            cudaSuccess &&
        cudaFuncSetAttribute(qgemv_kernel<1, EXL_LORA_SIDE>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) ==
            cudaSuccess)
        stage_max_in = STAGE_MAX_IN;
    else if (floor > 0) {
        cudaGetLastError();
        cudaFuncSetAttribute(qgemv_kernel<1, EXL_LORA_IN_BLOCK>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             (int)floor);
        cudaFuncSetAttribute(qgemv_kernel<1, EXL_LORA_SIDE>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)floor);
    }
    cudaGetLastError();
    occupancy_floor<2>(cb);
    occupancy_floor<3>(cb);
    occupancy_floor<4>(cb);
    a_init(cb);
}

int exl_cuda_qgemv_takes(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    gemv_args a;
    int split;
    return plan(cb, f, &a, &split);
}

/* ---- LoRA updates folded into a one-row launch (cuda_lora_fold.cuh) */

/* matrix i's factor table in n (whose output is f's out[i]), or NULL */
static const exl_lora_factors *lora_factors_of(const exl_cuda_fused_mm *f, const exl_lora_node *n, int i) {
    for (int32_t o = 0; o < n->n_out; o++)
        if (n->out[o] == f->out[i] && n->out_features[o] == f->w[i]->out)
            return n->factors[o];
    return NULL;
}

/* The fold's arguments for f and n (units 0 where it does not fit: see exl_cuda_qgemv_lora_fits) */
static exl_lora_fold lora_fold_of(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f, const exl_lora_node *n) {
    exl_lora_fold L;
    memset(&L, 0, sizeof L);
    gemv_args a;
    int split;
    if (!n || plan(cb, f, &a, &split) != GEMV_PLAIN || f->rows != 1 || n->rows != 1 || n->n_uses < 1 ||
        n->max_rank < 1 || n->n_uses * n->max_rank > SUBS * COL_TILE || n->x != f->x || n->up != f->up ||
        n->norm != f->norm || (n->up && n->act != f->act) || (n->norm && n->eps != f->eps) || n->in_features != a.in)
        return L;
    const int32_t tiles = a.m[a.n_mats - 1].tile_end, blocks = tiles * split;
    const int32_t dots = n->n_uses * a.n_mats * n->max_rank;
    if (tiles >= cb->n_sms || (f->x_slots && !f->w[0]->q.slot_of))
        return L;
    int found = 0;
    for (int i = 0; i < a.n_mats; i++)
        found += (L.factors[i] = lora_factors_of(f, n, i)) != NULL;
    if (found != n->n_out)
        return L;
    L.use_slot = n->use_slot, L.use_scale = n->use_scale, L.slot_of = f->x_slots ? f->w[0]->q.slot_of : NULL;
    L.n_uses = n->n_uses, L.max_rank = n->max_rank;
    /* runs for the blocks of the first wave (BLOCKS_PER_SM an SM), which start at once */
    const int32_t first = blocks < BLOCKS_PER_SM * cb->n_sms ? blocks : BLOCKS_PER_SM * cb->n_sms;
    L.pieces = first > dots ? first / dots : 1;
    L.piece_len = (a.in + L.pieces - 1) / L.pieces;
    L.units = dots * L.pieces;
    return L;
}

/* EXL_CUDA_LORA_SIDE=2: side blocks wherever the outputs allow atomic adds (zeroed before, or accumulated: the
 * tests' small matrices, which take no split), the launch's blocks then adding their sums atomically at one split
 * too; else only where they add atomically anyway. Read when a step is launched or captured. */
static int lora_side_forced(void) {
    const char *e = getenv("EXL_CUDA_LORA_SIDE");
    return e && *e && atoi(e) == 2;
}

/* Side blocks (cuda_lora_fold.cuh) where the launch's blocks add their sums atomically (every decode GEMV of a 7B
 * model but layer 0's q/k/v, whose outputs no GEMV before zeroes; 0.740 of the no-adapter rate against the in-block
 * fold's 0.680 on an H100, bench/RESULTS.md): extra grid columns, as many as give each side block about one dot
 * while the grid still fits the GPU at once (BLOCKS_PER_SM an SM; one column at least). Elsewhere the in-block fold:
 * launches whose blocks store their sums (one split, or outputs neither zeroed nor accumulated), and more runs than
 * a side block stages. */
static void lora_side_of(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f, gemv_args *a, int split) {
    exl_lora_fold *L = &a->lora;
    const int32_t dots = L->n_uses * a->n_mats * L->max_rank, tiles = a->m[a->n_mats - 1].tile_end;
    if (!L->units || L->units > EXL_LORA_SIDE_MAX - 8) /* the runs and 8 sums of squares in red */
        return;
    if (lora_side_forced() && (f->accumulate || f->out_zeroed) && !cb->deterministic)
        a->atomic_add = 1;
    if (!a->atomic_add)
        return;
    int32_t cols = (dots + split - 1) / split;
    while (cols > 1 && (int64_t)(tiles + cols) * split > (int64_t)BLOCKS_PER_SM * cb->n_sms)
        cols--;
    L->side_x0 = tiles, L->side_cols = cols;
}

int exl_cuda_qgemv_lora_fits(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f, const exl_lora_node *n) {
    return lora_fold_of(cb, f, n).units > 0;
}

void exl_cuda_qgemv_fused(exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    gemv_args a;
    int split;
    const int kind = plan(cb, f, &a, &split);
    if (kind == GEMV_NONE) {
        exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED, "quantized GEMV: this matmul does not fit the kernel");
        return;
    }
    int32_t tiles = a.m[a.n_mats - 1].tile_end;
    if (split > 1 && !a.atomic_add) {
        int R = kind != GEMV_PLAIN || f->rows < ROWS_PER_LAUNCH ? f->rows : ROWS_PER_LAUNCH;
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_partial, &cb->gemv_partial_bytes,
                             (size_t)split * R * tiles * COL_TILE * sizeof(float), "GEMV partial sums"))
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
        a.partial = cb->gemv_partial;
        a.counters = cb->gemv_counters;
    }
    if (f->lora) {
        a.lora = lora_fold_of(cb, f, f->lora);
        lora_side_of(cb, f, &a, split);
        const size_t bytes = 256 + (size_t)(a.lora.units + 3) / 4 * 4 * sizeof(float);
        if (!a.lora.units) {
            exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "internal: a LoRA update folded into a GEMV it does not fit");
            return;
        }
        if (bytes > cb->lora_fold_bytes) {
            if (!exl_cuda_ensure(cb, (void **)&cb->lora_fold, &cb->lora_fold_bytes, bytes, "LoRA partial sums"))
                return;
            /* the counter at 0, every run unset (EXL_LORA_UNSET) */
            if (cudaMemsetAsync(cb->lora_fold, 0, 256, cb->stream) != cudaSuccess ||
                cudaMemsetAsync((char *)cb->lora_fold + 256, 0xff, bytes - 256, cb->stream) != cudaSuccess) {
                exl_cuda_check_launch(cb, "LoRA counters");
                return;
            }
        }
        a.lora.sync = (unsigned *)cb->lora_fold;
        a.lora.t_part = (float *)((char *)cb->lora_fold + 256);
    }
    /* the clears are done by the first launch (not with EXL_CUDA_DETERMINISTIC=1, whose merges never add onto
     * them) */
    for (int i = 0; i < 3 && !cb->deterministic; i++)
        if (f->n_clear[i] > 0)
            a.clear[i] = f->clear[i], a.n_clear[i] = f->n_clear[i];
    /* the attention's cache rows: one launch, a few sequences (more would crowd L2), rows of whole 16-byte pieces */
    const int one_launch = kind != GEMV_PLAIN || f->rows <= ROWS_PER_LAUNCH;
    if (f->kv.k_cache && one_launch && f->kv.n_seqs <= ROWS_PER_LAUNCH && f->kv.width % 8 == 0 && f->kv.page_size > 0) {
        a.kv_k = (const __half *)f->kv.k_cache, a.kv_v = (const __half *)f->kv.v_cache;
        a.kv_seqs = f->kv.seqs, a.kv_pages = f->kv.page_tables;
        a.kv_n_seqs = f->kv.n_seqs, a.kv_page_size = f->kv.page_size, a.kv_width = f->kv.width;
    }
    if (kind == GEMV_A) {
        a_launch(cb, f, &a, split);
        return;
    }
    /* ROWS_PER_LAUNCH rows per launch (the weights are read once per launch) */
    for (int32_t r = 0; r < f->rows; r += ROWS_PER_LAUNCH) {
        gemv_args part = a;
        part.x = f->x + (int64_t)r * a.in;
        part.up = f->up ? f->up + (int64_t)r * a.in : NULL;
        for (int i = 0; i < f->n; i++)
            part.m[i].out = f->out[i] + (int64_t)r * f->w[i]->out;
        if (r > 0)
            for (int i = 0; i < 3; i++)
                part.clear[i] = NULL, part.n_clear[i] = 0;
        launch_rows(cb, &part, split, f->rows - r < ROWS_PER_LAUNCH ? f->rows - r : ROWS_PER_LAUNCH);
    }
}
