/* cuda_qgemv.cu - fused dequantize + GEMV for few rows (the decode case) over up to three
 * quantized matrices that share their input, with the layer's neighbours fused in: the
 * input's RMSNorm or GLU is applied while the activations are gathered, and the result
 * can be added to the output (the residual). One row (up to 4 with EXL_CUDA_GEMV_MMA_ROWS set past 2) on CUDA
 * cores, qgemv_kernel, described here; 2-16 rows on tensor cores, qgemv_mma_kernel (its own section below).
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
    int32_t rows;         /* qgemv_mma_kernel: the rows (2 .. EXL_CUDA_QGEMV_MAX_ROWS), */
    int32_t mma_ring;     /* the bytes of each warp's ring of stages */
    int32_t mma_stages;   /* and the most stages it is cut into */
    int32_t mma_l2_ahead; /* chunks past its ring a warp sequence's tile chunks are asked of L2 (mma_l2_ahead) */
    exl_lora_fold lora;   /* one row: the LoRA updates folded in (cuda_lora_fold.cuh; units 0: none) */
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

/* ---- many rows on tensor cores: qgemv_mma_kernel
 *
 * 2 .. EXL_CUDA_QGEMV_MAX_ROWS rows in one m16 tile, so that every weight is read once for all of them: the codes
 * are decoded as cuda_qmma.cu decodes them (decode_quarter) and multiplied with mma.sync (fp32 accumulation; rows
 * past a.rows are zeros). A block covers one column tile (256 columns) over its range of chunks, with the same split
 * sums as qgemv_kernel, and has MMA_COL_WARPS x KW warps: column warp cw takes columns 32cw .. 32cw + 31 and k warp
 * kw (KW of them) every KW-th chunk of the block's range from kw on; the k warps' sums are added in
 * shared memory at the end. Lane (g, t) decodes quarter t of columns 4g .. 4g + 3 of a chunk: column 4g + j is
 * column g of n-tile j, whose C fragment holds columns 8t + j and 8t + 4 + j. The activations are gathered into
 * shared memory in slot pair order as for qgemv_kernel, rows g and g + 8 interleaved in the A fragments' order
 * (mma_xs_at), so that a k step's fragment is one 16-byte load.
 *
 * The weights stream through a ring of stages in shared memory, one ring a warp, filled by cp.async (16 bytes a
 * lane, L2 only): a stage holds one chunk of the warp's 32 columns (its word rows, 128 bytes each, then the 32
 * scales and zeros of its group), sized for the widest chunk the warp takes, and the ring holds as many stages as
 * fit its bytes (at most a.mma_stages). The warp keeps every stage but the one it multiplies in flight: it waits for
 * chunk k's group alone, then asks for chunk k + stages - 1 into the stage chunk k - 1 left, with no barrier but
 * the warp's own. (Loading a chunk into registers at the top of its iteration, as this kernel first did, kept one
 * chunk a warp in flight, ~8 KiB an SM where the memory wants ~23 KiB: 2.5-7x one row; bench/LOG.md.) The chunk
 * descriptors of the warp are read once into shared memory, and the first stages are asked for before
 * griddepcontrol.wait (weights are constant), so they come while the activations are gathered (every row's loads
 * of a pair at once). One block an SM (its rings take most of the shared memory, its registers most of the file; or
 * two 256-thread blocks with half of each, EXL_CUDA_GEMV_MMA_BLOCKS_PER_SM): the launcher picks the split by the
 * waves of blocks it takes (plan_mma). An RMSNorm before it is computed by every block for up to
 * EXL_CUDA_GEMV_MMA_NORM_ROWS rows (each reads the rows whole), else by a launch of its own first. With a split, the
 * last block of a tile adds the partial sums with all its threads (mma_merge_splits). Nsight Compute of the first
 * version (bench/LOG.md, r2-rows3) found that merge done lane by lane (half of a 2-row q_proj launch with the other
 * SMs idle), the gather's dependent loads repeated per row and 4-way bank conflicts on the stages (mma_word_at). */

#define MMA_COL_WARPS (COL_TILE / 32)
#define MMA_K_WARPS_DEFAULT 2                      /* k warps (EXL_CUDA_GEMV_MMA_K_WARPS) */
#define MMA_ROW_BYTES 128                          /* one word row of a warp's 32 columns */
#define MMA_STAGE_MAX (8 * MMA_ROW_BYTES + 2 * 64) /* an 8-bit chunk with its scales and zeros */
#define MMA_MAX_STAGES 16                          /* the most stages a ring has (mma_stage_count) */
/* stages with 2 k warps or two 1-k-warp blocks an SM (EXL_CUDA_GEMV_MMA_STAGES), twice as many with one 1-k-warp
 * block: 56-60 KiB of 4-bit codes an SM in flight */
#define MMA_STAGES_DEFAULT 8

/* the shared memory address of p, for cp.async */
__device__ __forceinline__ unsigned smem_addr(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

/* 16 bytes from global memory to shared memory, through L2 only (not L1: no lane reads them twice) */
__device__ __forceinline__ void cp_async16(unsigned dst, const void *src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

/* The stage counts a ring may have: this thread's cp.async groups done but the stages - 2 most recent (the count is
 * an immediate; a switch over it became an indirect branch each chunk paid for) */
__device__ __forceinline__ int mma_stage_count(int n) {
    return n >= 16 ? 16 : n >= 12 ? 12 : n >= 8 ? 8 : n >= 6 ? 6 : n >= 4 ? 4 : n >= 3 ? 3 : 2;
}
__device__ __forceinline__ void mma_wait(int stages) { /* the default count first: one test */
    if (stages == MMA_STAGES_DEFAULT)
        cp_async_wait<MMA_STAGES_DEFAULT - 2>();
    else if (stages == 16)
        cp_async_wait<14>();
    else if (stages == 8)
        cp_async_wait<6>();
    else if (stages == 12)
        cp_async_wait<10>();
    else if (stages == 6)
        cp_async_wait<4>();
    else if (stages == 4)
        cp_async_wait<2>();
    else if (stages == 3)
        cp_async_wait<1>();
    else
        cp_async_wait<0>();
}

/* Where a lane's copies of a chunk come from, less the chunk's word row and group: lane l copies 16 bytes of word
 * rows l / 8 and l / 8 + 4 (columns 4 (l % 8) .. + 3 of the warp's 32), and lanes 0-3 the group's scales of columns
 * 8l .. 8l + 7, lanes 4-7 its zeros (GPTQ) */
typedef struct mma_src {
    const uint32_t *words; /* word row 0 */
    const __half *sz;      /* group 0 */
    int row, sz_lanes;     /* l / 8; lanes that copy scales and zeros (4 or 8) */
    int dst;               /* where in a stage the lane's first 16 bytes go (mma_word_at) */
} mma_src;

/* Where in a stage the 16 bytes of word row r of columns 4c .. 4c + 3 (of the warp's 32) lie: the row's eight pieces
 * permuted by row (c ^ 2r), so that the lanes of a quarter warp, which read rows t (4 bits) or k .. k + 4 (6 bits, k =
 * 3t / 4) of columns 4g .. 4g + 3 for g of one pair, hit eight different banks (in column order the four rows of
 * 4-bit quarters were a 4-way conflict: ncu counted 4.5-way conflicts, 37% of the shared-memory wavefronts) */
__device__ __forceinline__ int mma_word_at(int r, int c) { return r * MMA_ROW_BYTES + 16 * (c ^ ((2 * r) & 7)); }

__device__ __forceinline__ mma_src mma_src_of(const exl_qmatrix &q, const uint32_t *wcol, int col, int lane) {
    mma_src m;
    m.words = wcol + (int64_t)(lane / 8) * EXL_QW_TILE + (lane % 8) * 4;
    m.row = lane / 8;
    m.sz_lanes = q.zeros ? 8 : 4;
    m.sz = (lane < 4 ? q.scales : q.zeros ? q.zeros : q.scales) + col + (lane % 4) * 8;
    m.dst = mma_word_at(lane / 8, lane % 8); /* row l / 8 + 4: 4 rows further, the same permutation */
    return m;
}

/* Chunk m of the warp's 32 columns into the stage at `stage`: word row r at r * MMA_ROW_BYTES (its pieces permuted:
 * mma_word_at), then the group's 32 scales (64 bytes) and zeros (GPTQ) */
__device__ __forceinline__ void mma_issue(const mma_src &src, int64_t n_pad, int4 m, unsigned stage, int lane) {
    const uint32_t *w = src.words + (int64_t)m.x * EXL_QW_TILE;
    if (src.row < m.y)
        cp_async16(stage + src.dst, w);
    if (src.row + 4 < m.y)
        cp_async16(stage + src.dst + 4 * MMA_ROW_BYTES, w + 4 * EXL_QW_TILE);
    if (lane < src.sz_lanes)
        cp_async16(stage + m.y * MMA_ROW_BYTES + 16 * lane, src.sz + (int64_t)m.z * n_pad);
}

/* Chunk m of the whole column tile asked of L2: its word rows (m.y KiB in one piece: a tile's rows lie together)
 * and its group's 256 scales and zeros, one bulk prefetch each, through the TMA unit rather than the load/store
 * path the ring's cp.async copies queue in. The ring's copies (each warp 128 bytes of every 1 KiB row, at its own
 * pace) then find the rows in L2, read from DRAM whole and in order. */
__device__ __forceinline__ void mma_l2_ahead(const uint32_t *wtile, const __half *sc, const __half *zr, int64_t n_pad,
                                             int4 m) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(wtile + (int64_t)m.x * EXL_QW_TILE),
                 "r"((unsigned)m.y * EXL_QW_TILE * 4u)
                 : "memory");
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(sc + (int64_t)m.z * n_pad), "r"(2u * COL_TILE)
                 : "memory");
    if (zr)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(zr + (int64_t)m.z * n_pad), "r"(2u * COL_TILE)
                     : "memory");
#endif
}

/* the 4-bit quarter: decode_quarter<4>'s pairs, the odd ones from the codes in place (as decode_chunk does: one
 * shift for two pairs) */
__device__ __forceinline__ void quarter4(uint32_t w, __half2 zz, uint32_t (&pr)[4]) {
    const uint32_t m = magic_1024(), hi = w >> 8;
    const __half2 c = __hsub2(__float2half2_rn(960.0f), zz), s = __float2half2_rn(0.0625f);
    pr[0] = half2_bits(__hsub2(u32_as_half2(and_or<0x000f000fu>(w, m)), zz));
    pr[1] = half2_bits(__hfma2(u32_as_half2(and_or<0x00f000f0u>(w, m)), s, c));
    pr[2] = half2_bits(__hsub2(u32_as_half2(and_or<0x000f000fu>(hi, m)), zz));
    pr[3] = half2_bits(__hfma2(u32_as_half2(and_or<0x00f000f0u>(hi, m)), s, c));
}

/* acc[j] += the products of the chunk in `stage` (B bits; GPTQ: with its zeros) for n-tile j, scaled per column;
 * af: the A fragments of its two k steps */
template <int B, bool GPTQ>
__device__ __forceinline__ void mma_stage_step(const char *stage, int g, int t, const uint4 (&af)[2],
                                               float (&acc)[4][4]) {
    /* 6 bits: quarter t's low codes are the 24 bits from bit 24t of the column's 192, its high codes those from bit
     * 96 + 24t, so the lane reads the two words under each (word rows k, k + 1 and k + 3, k + 4; the last is
     * past the codes for t = 3, where the 24 bits lie in one word: row 5 again) instead of all six, and takes
     * each pair with three shifts and two lop3, not decode_quarter's word selects (562 instructions a chunk) */
    constexpr int NW = B == 6 ? 4 : quarter_words<B>();
    uint4 wv[NW];
    if constexpr (B == 6) {
        const int k = 3 * t / 4;
        wv[0] = *(const uint4 *)(stage + mma_word_at(k, g));
        wv[1] = *(const uint4 *)(stage + mma_word_at(k + 1, g));
        wv[2] = *(const uint4 *)(stage + mma_word_at(k + 3, g));
        wv[3] = *(const uint4 *)(stage + mma_word_at(min(k + 4, 5), g));
    } else {
#pragma unroll
        for (int i = 0; i < NW; i++)
            wv[i] = *(const uint4 *)(stage + mma_word_at(quarter_first<B>(t) + i, g));
    }
    const uint4 sc = *(const uint4 *)(stage + B * MMA_ROW_BYTES + 16 * t); /* columns 8t .. 8t + 7 */
    __half sh[8];
    memcpy(sh, &sc, 16);
    __half2 zz[4];
    if constexpr (GPTQ) {
        const uint2 z = *(const uint2 *)(stage + B * MMA_ROW_BYTES + 64 + 8 * g); /* columns 4g .. 4g + 3 */
        __half zh[4];
        memcpy(zh, &z, 8);
#pragma unroll
        for (int j = 0; j < 4; j++)
            zz[j] = __float2half2_rn(1024.0f + __half2float(zh[j]));
    } else {
#pragma unroll
        for (int j = 0; j < 4; j++)
            zz[j] = __float2half2_rn(1024.0f + (float)(1 << (B - 1)));
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t pr[4];
        uint32_t w[NW];
#pragma unroll
        for (int i = 0; i < NW; i++)
            w[i] = j == 0 ? wv[i].x : j == 1 ? wv[i].y : j == 2 ? wv[i].z : wv[i].w;
        if constexpr (B == 4) {
            quarter4(w[0], zz[j], pr);
        } else if constexpr (B == 6) {
            const int off = (24 * t) % 32;
            const uint32_t lo = __funnelshift_r(w[0], w[1], off), hi = __funnelshift_r(w[2], w[3], off);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const uint32_t v = and_or(lo >> (6 * i), 0x3fu, 0x64006400u);
                pr[i] = half2_bits(__hsub2(u32_as_half2(and_or(hi >> (6 * i) << 16, 0x003f0000u, v)), zz[j]));
            }
        } else {
            uint32_t wq[MAX_WORDS];
#pragma unroll
            for (int i = 0; i < MAX_WORDS; i++)
                wq[i] = i < NW ? w[i < NW ? i : 0] : 0u;
            decode_quarter<B>(wq, t, zz[j], pr);
        }
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        mma16816(part, af[0].x, af[0].y, af[0].z, af[0].w, pr[0], pr[1]);
        mma16816(part, af[1].x, af[1].y, af[1].z, af[1].w, pr[2], pr[3]);
        const float s0 = __half2float(sh[j]), s1 = __half2float(sh[4 + j]);
        /* one fma each (written as a product and a sum, they compiled to two instructions) */
        acc[j][0] = __fmaf_rn(s0, part[0], acc[j][0]);
        acc[j][1] = __fmaf_rn(s1, part[1], acc[j][1]);
        acc[j][2] = __fmaf_rn(s0, part[2], acc[j][2]);
        acc[j][3] = __fmaf_rn(s1, part[3], acc[j][3]);
    }
}

/* the chunk in `stage` by its width: 4 bits (EXL2 near 4 bpw, GPTQ) with one test, then 6 (the heads) */
template <bool GPTQ>
__device__ __forceinline__ void mma_stage_any(int bits, const char *stage, int g, int t, const uint4 (&af)[2],
                                              float (&acc)[4][4]) {
    if (bits == 4)
        mma_stage_step<4, GPTQ>(stage, g, t, af, acc);
    else if (bits == 6)
        mma_stage_step<6, GPTQ>(stage, g, t, af, acc);
    else if (bits == 8)
        mma_stage_step<8, GPTQ>(stage, g, t, af, acc);
    else if (bits == 5)
        mma_stage_step<5, GPTQ>(stage, g, t, af, acc);
    else if (bits == 3)
        mma_stage_step<3, GPTQ>(stage, g, t, af, acc);
    else
        mma_stage_step<2, GPTQ>(stage, g, t, af, acc);
}

/* The activations in shared memory in the A fragments' order: for rows g and g + 8 (g < 8) and chunk lc, 32 pairs,
 * lane (g, t)'s k step s at 8t + 4s .. + 3: (row g, pair 4t + 2s), (row g + 8, same), (row g, 4t + 2s + 1),
 * (row g + 8, same); one 16-byte load a k step. Rows past a.rows are zeros. Row groups g lie mma_xs_stride(cpb) pairs
 * apart: 16 bytes past a multiple of 128, so that the two groups a quarter warp loads fall on different banks. */
__host__ __device__ __forceinline__ int mma_xs_stride(int cpb) { return cpb * 32 + 4; }

__device__ __forceinline__ int mma_xs_at(int xs_stride, int r, int lc, int p) {
    return (r % 8) * xs_stride + lc * 32 + (p / 4) * 8 + ((p / 2) % 2) * 4 + (p % 2) * 2 + r / 8;
}

/* activation pairs a thread of qgemv_mma_kernel has the inputs of read before griddepcontrol.wait (the head of a 7B
 * model: 2048 pairs a block, 4 a thread) */
#define MMA_PRE_PAIRS 4 /* (sp[0 .. 3] are picked by compares in the gather) */

/* 1 / RMS of each of the R rows into inv (shared memory), by the whole block: every row's loads of a pass in flight
 * together (a.in % 4 == 0: the launcher folds the norm in only then) */
__device__ void mma_inv_rms(const gemv_args &a, int R, int threads, float *inv) {
    __shared__ float red[MMA_COL_WARPS * 2][EXL_CUDA_QGEMV_MAX_ROWS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float ss[EXL_CUDA_QGEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
        ss[r] = 0.0f;
    for (int i = threadIdx.x; i < a.in / 4; i += threads) {
        float4 v[EXL_CUDA_QGEMV_MAX_ROWS];
#pragma unroll
        for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
            v[r] = r < R ? __ldg((const float4 *)(a.x + (int64_t)r * a.in) + i) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
            ss[r] += v[r].x * v[r].x + v[r].y * v[r].y + v[r].z * v[r].z + v[r].w * v[r].w;
    }
#pragma unroll
    for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
        if (r < R) {
            float v = ss[r];
            for (int o = 16; o > 0; o >>= 1)
                v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0)
                red[warp][r] = v;
        }
    __syncthreads();
    if ((int)threadIdx.x < R) {
        float s = 0.0f;
        for (int w = 0; w < threads / 32; w++)
            s += red[w][threadIdx.x];
        inv[threadIdx.x] = rsqrtf(s / a.in + a.eps);
    }
    __syncthreads();
}

/* The last block of a column tile adds the splits' partial sums (in split order) and writes the outputs: every thread
 * of the block a few of the tile's R x COL_TILE outputs, the loads of several splits for all of them in flight together
 * (a few memory round trips, where a lane summing its own 16 outputs split by split took ~2 per output) */
template <int KW>
__device__ void mma_merge_splits(const gemv_args &a, const gemv_mat &M, int tile_col, int64_t width) {
    constexpr int THREADS = MMA_COL_WARPS * KW * 32, OUTS = EXL_CUDA_QGEMV_MAX_ROWS * COL_TILE / THREADS;
    constexpr int YB = 32 / OUTS; /* splits a batch: 32 loads a thread in flight (64 spilled at 128 registers) */
    const int R = a.rows;
    const float *p = a.partial + (int64_t)blockIdx.x * COL_TILE;
    float v[OUTS];
#pragma unroll
    for (int k = 0; k < OUTS; k++)
        v[k] = 0.0f;
    for (unsigned y0 = 0; y0 < gridDim.y; y0 += YB) {
        float u[YB][OUTS];
#pragma unroll
        for (int e = 0; e < YB; e++)
#pragma unroll
            for (int k = 0; k < OUTS; k++) {
                const int o = (int)threadIdx.x + k * THREADS, r = o / COL_TILE;
                u[e][k] = y0 + e < gridDim.y && r < R ? __ldcg(p + ((int64_t)(y0 + e) * R + r) * width + o % COL_TILE)
                                                      : 0.0f;
            }
#pragma unroll
        for (int e = 0; e < YB; e++)
#pragma unroll
            for (int k = 0; k < OUTS; k++)
                v[k] += u[e][k];
    }
#pragma unroll
    for (int k = 0; k < OUTS; k++) {
        const int o = (int)threadIdx.x + k * THREADS, r = o / COL_TILE, c = tile_col + o % COL_TILE;
        if (r < R && c < M.n_out) {
            float *dst = M.out + (int64_t)r * M.n_out + (a.out_map ? __ldg(a.out_map + c) : c);
            *dst = (a.accumulate ? *dst : 0.0f) + v[k] + (M.bias ? M.bias[c] : 0.0f);
        }
    }
}

/* Activation pair i (inputs s) of every row into xs (mma_xs_at; rows R .. 15 zeros): the loads of all rows first, in
 * flight together, then the input transform (input_at's, with the same roundings) */
__device__ __forceinline__ void mma_gather_pair(const gemv_args &a, int R, int2 s, const float *inv, __half2 *xs,
                                                int xs_stride, int i) {
    float2 v[EXL_CUDA_QGEMV_MAX_ROWS], u[EXL_CUDA_QGEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++) {
        const float *xr = a.x + (int64_t)r * a.in;
        v[r] = make_float2(r < R && s.x >= 0 ? __ldg(xr + s.x) : 0.0f, r < R && s.y >= 0 ? __ldg(xr + s.y) : 0.0f);
    }
    if (a.up) {
#pragma unroll
        for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++) {
            const float *ur = a.up + (int64_t)r * a.in;
            u[r] = make_float2(r < R && s.x >= 0 ? __ldg(ur + s.x) : 0.0f, r < R && s.y >= 0 ? __ldg(ur + s.y) : 0.0f);
        }
#pragma unroll
        for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
            v[r] = make_float2(exl_cuda_activate(v[r].x, a.act) * u[r].x, exl_cuda_activate(v[r].y, a.act) * u[r].y);
    } else if (a.norm) {
        const float n0 = s.x >= 0 ? __ldg(a.norm + s.x) : 0.0f, n1 = s.y >= 0 ? __ldg(a.norm + s.y) : 0.0f;
#pragma unroll
        for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
            if (r < R)
                v[r] = make_float2(n0 * (v[r].x * inv[r]), n1 * (v[r].y * inv[r]));
    }
#pragma unroll
    for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
        xs[mma_xs_at(xs_stride, r, i / 16, i % 16)] = __floats2half2_rn(v[r].x, v[r].y);
}

/* KW: the k warps a column warp has. 2 (the default): 512 threads, 16 warps an SM to hide the multiply's latencies,
 * half the split; 1: 256 threads, 8 warps (held to 128 registers for two blocks an SM). 128 registers each, no
 * spill (-Xptxas -v, sm_90, CUDA 13.0; the 6-bit path through decode_quarter's word selects took 153, and 88 bytes
 * spilled at 512 threads). */
template <int KW>
__global__ void __launch_bounds__(MMA_COL_WARPS *KW * 32, 3 - KW)
    qgemv_mma_kernel(const __grid_constant__ gemv_args a) {
    /* [8][mma_xs_stride] activation pairs (mma_xs_at), [chunks_per_block] descriptors, [MMA_COL_WARPS * KW][a.mma_ring]
     * stages */
    extern __shared__ uint4 mma_smem[];
    __shared__ int is_last;
    __shared__ float inv_rms[EXL_CUDA_QGEMV_MAX_ROWS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4, R = a.rows;
    const int cw = warp % MMA_COL_WARPS, kw = warp / MMA_COL_WARPS;
    int mi = 0;
    while (mi + 1 < a.n_mats && (int)blockIdx.x >= a.m[mi].tile_end)
        mi++;
    const gemv_mat &M = a.m[mi];
    const exl_qmatrix &q = M.q;
    const int cpb = a.chunks_per_block, c0 = blockIdx.y * cpb, n_loc = max(0, min(cpb, q.n_chunks - c0));
    const int xs_stride = mma_xs_stride(cpb);
    __half2 *xs = (__half2 *)mma_smem;
    int4 *desc = (int4 *)(xs + 8 * xs_stride);
    char *ring = (char *)(desc + cpb) + (int64_t)warp * a.mma_ring;
    const int tile_col = ((int)blockIdx.x - (mi ? a.m[mi - 1].tile_end : 0)) * COL_TILE;
    const int col = tile_col + cw * 32; /* the warp's first column */
    const bool gptq = q.zeros != nullptr;
    const mma_src src = mma_src_of(q, exl_qw_col(q, col), col, lane);
    const int64_t n_pad = q.n_pad;

    /* the warp's chunks (kw, kw + KW, ... of the block's): descriptors, the widest, the stages that fit */
    const int nk = n_loc > kw ? (n_loc - kw + KW - 1) / KW : 0;
    int widest = 1;
    for (int i = lane; i < nk; i += 32) {
        const int4 m = __ldg(q.chunks + c0 + kw + i * KW);
        desc[kw + i * KW] = m;
        widest = max(widest, m.y);
    }
    for (int o = 16; o > 0; o >>= 1)
        widest = max(widest, __shfl_xor_sync(0xffffffffu, widest, o));
    __syncwarp();
    const int stage_bytes = widest * MMA_ROW_BYTES + (gptq ? 128 : 64);
    const int stages = mma_stage_count(min(a.mma_stages, a.mma_ring / stage_bytes)); /* the ring holds 2 at least */
    const unsigned ring_at = smem_addr(ring);
    /* stages 0 .. stages - 2 asked for before the wait; one group each, empty past the warp's chunks */
    for (int s = 0; s < stages - 1; s++) {
        if (s < nk)
            mma_issue(src, n_pad, desc[kw + s * KW], ring_at + s * stage_bytes, lane);
        cp_async_commit();
    }
    /* the whole tile's next chunks of this k warp's sequence asked of L2 by one lane (column warp 0's first) */
    const bool l2_lane = a.mma_l2_ahead > 0 && cw == 0 && lane == 0;
    const uint32_t *wtile = exl_qw_col(q, tile_col);
    const __half *sc_tile = q.scales + tile_col, *z_tile = gptq ? q.zeros + tile_col : nullptr;
    for (int s = stages - 1; l2_lane && s < nk && s < stages - 1 + a.mma_l2_ahead; s++)
        mma_l2_ahead(wtile, sc_tile, z_tile, n_pad, desc[kw + s * KW]);
    /* this thread's first activation pairs' inputs (constant tables) before the wait; their values after it, every
     * row's loads of a pair in flight together */
    const int n_pairs = n_loc * 16, threads = MMA_COL_WARPS * KW * 32;
    int2 sp[MMA_PRE_PAIRS];
#pragma unroll
    for (int j = 0; j < MMA_PRE_PAIRS; j++)
        sp[j] = tid + j * threads < n_pairs ? slot_pair(a, q, c0, tid + j * threads) : make_int2(-1, -1);
    exl_pdl_start();
    if (a.norm)
        mma_inv_rms(a, R, threads, inv_rms);
    for (int j = 0, i = tid; i < n_pairs; j++, i += threads) {
        /* by compares, not an index: sp stays in registers (as a local array it took a stack frame) */
        const int2 s = j == 0 ? sp[0] : j == 1 ? sp[1] : j == 2 ? sp[2] : j == 3 ? sp[3] : slot_pair(a, q, c0, i);
        mma_gather_pair(a, R, s, inv_rms, xs, xs_stride, i);
    }
    __syncthreads();

    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 4; e++)
            acc[j][e] = 0.0f;
    for (int k = 0, at = 0; k < nk; k++, at = at + 1 == stages ? 0 : at + 1) {
        /* chunk k's stage arrived (this lane's copies), every lane's copies visible and every lane done with the
         * stage chunk k - 1 used, which then takes chunk k + stages - 1 */
        mma_wait(stages);
        __syncwarp();
        const int next = k + stages - 1, next_at = at == 0 ? stages - 1 : at - 1;
        if (next < nk)
            mma_issue(src, n_pad, desc[kw + next * KW], ring_at + next_at * stage_bytes, lane);
        cp_async_commit();
        if (l2_lane && next + a.mma_l2_ahead < nk)
            mma_l2_ahead(wtile, sc_tile, z_tile, n_pad, desc[kw + (next + a.mma_l2_ahead) * KW]);
        const int lc = kw + k * KW;
        /* A: rows g and g + 8, pairs 4t .. 4t + 3 (k step s: pairs 4t + 2s, 4t + 2s + 1) */
        const uint4 *xa = (const uint4 *)(xs + g * xs_stride + lc * 32 + 8 * t);
        const uint4 af[2] = {xa[0], xa[1]};
        const char *stage = ring + at * stage_bytes;
        if (gptq)
            mma_stage_any<true>(desc[lc].y, stage, g, t, af, acc);
        else
            mma_stage_any<false>(desc[lc].y, stage, g, t, af, acc);
    }
    cp_async_wait<0>();
    if (a.kv_k && tid == 0)
        kv_prefetch(a);
    clear_later(a, MMA_COL_WARPS * KW * 32);

    /* the k warps' sums added: k warps 1 .. leave theirs in their own rings, k warp 0 adds them */
    float *red = (float *)ring;
    if (kw > 0)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                red[(j * 4 + e) * 32 + lane] = acc[j][e];
    __syncthreads();
    if (kw == 0)
        for (int w = 1; w < KW; w++) {
            const float *other = (const float *)((const char *)red + (int64_t)w * MMA_COL_WARPS * a.mma_ring);
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    acc[j][e] += other[(j * 4 + e) * 32 + lane];
        }

    /* acc[j][e] (k warp 0): row g + 8 (e / 2), column col + 8t + 4 (e % 2) + j */
    if (a.atomic_add) {
        if (kw > 0)
            return;
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = g + 8 * (e / 2), c = col + 8 * t + 4 * (e % 2) + j;
                if (r < R && c < M.n_out)
                    atomicAdd(M.out + (int64_t)r * M.n_out + (a.out_map ? __ldg(a.out_map + c) : c),
                              acc[j][e] + (M.bias && blockIdx.y == 0 ? M.bias[c] : 0.0f));
            }
        return;
    }
    if (gridDim.y > 1) {
        const int64_t width = (int64_t)gridDim.x * COL_TILE;
        const int gcol = (int)blockIdx.x * COL_TILE + cw * 32 + 8 * t; /* + 4 (e % 2) + j: in the partial sums */
        if (kw == 0)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = g + 8 * (e / 2);
                    if (r < R)
                        a.partial[((int64_t)blockIdx.y * R + r) * width + gcol + 4 * (e % 2) + j] = acc[j][e];
                }
        __threadfence();
        __syncthreads();
        if (tid == 0)
            is_last = atomicAdd(&a.counters[blockIdx.x], 1u) == gridDim.y - 1;
        __syncthreads();
        if (!is_last)
            return;
        __threadfence();
        mma_merge_splits<KW>(a, M, tile_col, width);
        if (tid == 0)
            a.counters[blockIdx.x] = 0;
        return;
    }
    if (kw > 0)
        return;
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int r = g + 8 * (e / 2), c = col + 8 * t + 4 * (e % 2) + j;
            if (r < R && c < M.n_out) {
                float *dst = M.out + (int64_t)r * M.n_out + (a.out_map ? __ldg(a.out_map + c) : c);
                *dst = (a.accumulate ? *dst : 0.0f) + acc[j][e] + (M.bias ? M.bias[c] : 0.0f);
            }
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

enum { GEMV_NONE, GEMV_PLAIN, GEMV_MMA, GEMV_A };

/* the rows qgemv_a_kernel takes (EXL_CUDA_GEMV_A=1; EXL_CUDA_GEMV_A_ROWS=LO or LO-HI, default 2-16, LO 1 for an A/B
 * of one row, which then folds no LoRA update; off: lo 0),
 * its blocks an SM and the shared memory a block may ask for */
static int a_rows_lo, a_rows_hi, a_sm_blocks = 2, a_smem_share[3];

/* the blocks an SM of the variant that takes rows: 9-16 rows always the one-block one (two n8 tiles at 128 registers
 * spilled a whole 4-bit batch, stored as soon as loaded: the warp waited for every load) */
static int a_blocks_for(int32_t rows) { return rows > 8 ? 1 : a_sm_blocks; }

/* 1 if f is one wide matrix at WIDE_A_MIN_ROWS+ rows that qgemv_a_kernel takes: its 128-column tiles alone
 * fill the SMs (the 7B head's 250 on an H100's 132), so cuda_qmma.cu would not split it and each of its blocks would
 * run the whole input serially (the head at 8 / 16 rows: 198 us there, 103 / 134 us on GEMV-A, bench/RESULTS.md).
 * Default on (H100, 2026-11-28: the head at 5 / 8 / 16 rows 196 / 195 / 195 us -> 115 / 133 / 148 us);
 * EXL_CUDA_QMMA_WIDE_A=0 (read at each call) keeps it on cuda_qmma.cu. */
#define WIDE_A_MIN_ROWS 5
static int wide_to_a(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    if (f->n != 1 || f->rows < WIDE_A_MIN_ROWS || (f->w[0]->out + 127) / 128 <= cb->n_sms)
        return 0;
    const char *e = getenv("EXL_CUDA_QMMA_WIDE_A");
    return !e || strcmp(e, "0");
}

/* Which kernel takes f (GEMV_PLAIN: qgemv_kernel, up to ROWS_PER_LAUNCH rows a launch; GEMV_MMA: qgemv_mma_kernel,
 * from cb->gemv_mma_rows rows; GEMV_A: qgemv_a_kernel, EXL_CUDA_GEMV_A's rows or a wide matrix), GEMV_NONE if none
 * does (prompt rows past ROWS_PER_LAUNCH with EXL_CUDA_EXACT_PREFILL=1 keep ~22 bits in cuda_qmma.cu). */
static int gemv_kind(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    if (f->rows < 1 || f->rows > EXL_CUDA_QGEMV_MAX_ROWS || f->n < 1 || f->n > MAX_MATS)
        return GEMV_NONE;
    if (((a_rows_lo > 0 && f->rows >= a_rows_lo && f->rows <= a_rows_hi) || wide_to_a(cb, f)) &&
        (f->decode || !cb->exact_prefill))
        return GEMV_A;
    if (f->rows > 1 && f->rows >= cb->gemv_mma_rows && (f->decode || !cb->exact_prefill))
        return GEMV_MMA;
    return f->rows <= ROWS_PER_LAUNCH ? GEMV_PLAIN : GEMV_NONE;
}

/* the shared memory a block of qgemv_mma_kernel may ask for (0: the opt-in failed, 48 KiB), the most stages of its
 * rings (EXL_CUDA_GEMV_MMA_STAGES, 2 .. MMA_MAX_STAGES), the blocks a launch aims at (EXL_CUDA_GEMV_MMA_BLOCKS; 0:
 * one an SM; the tests set 1, so that each warp's ring goes round several times on the small fixtures), its k warps
 * (EXL_CUDA_GEMV_MMA_K_WARPS) */
static int mma_smem_max, mma_stages = MMA_STAGES_DEFAULT, mma_blocks, mma_k_warps = MMA_K_WARPS_DEFAULT;
/* blocks of qgemv_mma_kernel an SM holds (EXL_CUDA_GEMV_MMA_BLOCKS_PER_SM): 1, or 2 with 1 k warp (256 threads, at
 * most 128 registers: two blocks' registers fill the file), each with half the shared memory, so that one block's
 * start and end overlap the other's chunks, and the next launch's blocks start (programmatic dependent launch) while
 * this one's last blocks run */
static int mma_sm_blocks = 1;
/* the most rows whose RMSNorm a qgemv_mma_kernel block computes itself (EXL_CUDA_GEMV_MMA_NORM_ROWS; more: a launch
 * of its own first): each block reads the rows whole, rows x in x 4 bytes (8 rows of a 7B model: 128 KiB a block,
 * 33 MB of L2 reads for gate and up's 258 blocks), where the launch of its own costs a kernel's start and end */
#define MMA_NORM_ROWS_DEFAULT 8
static int mma_norm_rows = MMA_NORM_ROWS_DEFAULT;
/* chunks past a ring's that its warp sequence's whole-tile chunks are asked of L2 by bulk prefetches
 * (EXL_CUDA_GEMV_MMA_L2_AHEAD; 0: none). ncu of the ring alone: DRAM at 11-21% of its peak on q_proj and gate cold
 * with 7 stages of 16 warps asked for, each warp 128 bytes of every 1 KiB row at its own pace. */
#define MMA_L2_AHEAD_DEFAULT 8
static int mma_l2_chunks = MMA_L2_AHEAD_DEFAULT;

/* the dynamic shared memory of a qgemv_mma_kernel block: activations, descriptors, rings */
static size_t mma_smem_bytes(int cpb, int ring) {
    return (size_t)8 * mma_xs_stride(cpb) * sizeof(__half2) + (size_t)cpb * sizeof(int4) +
           (size_t)MMA_COL_WARPS * mma_k_warps * ring;
}

/* A block's start (descriptors, the first stages, the activations: ~3 memory round trips) in the time an SM
 * streams a chunk of a tile (4 KiB at 4 bits, ~0.2 us at 1/132 of 3 TB/s) */
#define MMA_START_CHUNKS 8

/* qgemv_mma_kernel's split and rings. One block an SM: the split whose waves of blocks (ceil(tiles * split /
 * n_sms)) times a block's time (its chunks + MMA_START_CHUNKS) is least, the smaller on a tie (fewer sums to add;
 * q_proj of a 7B model: 16 tiles x 8 splits, one wave; gate and up together: 86 x 3, two), with fewer chunks a
 * block where the activations (16 rows: 2 KiB a chunk) and rings of mma_stages 4-bit stages would not fit (a 70B
 * down_proj: 896 chunks, 7 splits); the rings take the rest of the shared memory, up to mma_stages of the widest
 * chunk. */
static void plan_mma(const exl_cuda_backend *cb, int32_t tiles, int32_t chunks, gemv_args *a, int *split) {
    const int budget = mma_smem_max > 0 ? mma_smem_max : 48 * 1024;
    const int64_t slots = mma_blocks > 0 ? mma_blocks : (int64_t)cb->n_sms * mma_sm_blocks;
    int s = 1;
    int64_t best = -1;
    for (int c = 1; c <= chunks && c <= 4 * slots; c++) {
        const int64_t waves = ((int64_t)tiles * c + slots - 1) / slots,
                      cost = waves * ((chunks + c - 1) / c + MMA_START_CHUNKS);
        if (best < 0 || cost < best)
            best = cost, s = c;
    }
    /* rings for all the stages of 4-bit GPTQ chunks at least (two 8-bit ones if more) */
    const int ring_min = mma_stages * (4 * MMA_ROW_BYTES + 128) > 2 * MMA_STAGE_MAX
                             ? mma_stages * (4 * MMA_ROW_BYTES + 128)
                             : 2 * MMA_STAGE_MAX;
    int cpb = (chunks + s - 1) / s;
    while (cpb > 1 && mma_smem_bytes(cpb, ring_min) > (size_t)budget)
        cpb--;
    a->chunks_per_block = cpb;
    *split = (chunks + cpb - 1) / cpb;
    int ring = (int)((budget - mma_smem_bytes(cpb, 0)) / (MMA_COL_WARPS * mma_k_warps)) / 128 * 128;
    a->mma_ring = ring < mma_stages * MMA_STAGE_MAX ? ring : mma_stages * MMA_STAGE_MAX;
    a->mma_stages = mma_stages;
    a->mma_l2_ahead = mma_l2_chunks;
}

/* the dynamic shared memory of a qgemv_a_kernel block: activations, descriptors, scales (and GPTQ zeros) */
static size_t a_smem_bytes(int cpb, bool gptq) {
    return (size_t)8 * mma_xs_stride(cpb) * sizeof(__half2) + (size_t)cpb * sizeof(int4) +
           (size_t)cpb * COL_TILE * sizeof(__half) * (gptq ? 2 : 1);
}

/* any of a's matrices with zeros (GPTQ) */
static bool a_gptq(const gemv_args *a) {
    bool z = false;
    for (int i = 0; i < a->n_mats; i++)
        z = z || a->m[i].q.zeros != NULL;
    return z;
}

/* qgemv_a_kernel's split: as plan_mma's (the fewest waves of blocks times a block's chunks and start), a_sm_blocks
 * blocks an SM, with fewer chunks a block where its activations would not fit */
static void plan_a(const exl_cuda_backend *cb, int32_t tiles, int32_t chunks, gemv_args *a, int *split) {
    const int mb = a_blocks_for(a->rows), budget = a_smem_share[mb] > 0 ? a_smem_share[mb] : 48 * 1024;
    const int64_t slots = mma_blocks > 0 ? mma_blocks : (int64_t)cb->n_sms * mb;
    int s = 1;
    int64_t best = -1;
    for (int c = 1; c <= chunks && c <= 4 * slots; c++) {
        const int64_t waves = ((int64_t)tiles * c + slots - 1) / slots,
                      cost = waves * ((chunks + c - 1) / c + MMA_START_CHUNKS);
        if (best < 0 || cost < best)
            best = cost, s = c;
    }
    int cpb = (chunks + s - 1) / s;
    while (cpb > 1 && a_smem_bytes(cpb, a_gptq(a)) > (size_t)budget)
        cpb--;
    a->chunks_per_block = cpb;
    *split = (chunks + cpb - 1) / cpb;
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
    if (kind == GEMV_MMA)
        plan_mma(cb, tiles, chunks, a, split);
    else if (kind == GEMV_A)
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

/* qgemv_a_kernel's rows (EXL_CUDA_GEMV_A, EXL_CUDA_GEMV_A_ROWS), and its variant for up to 8 rows: two blocks an SM
 * (128 registers; a few reloads a batch, more in the 6- and 8-bit paths) or with EXL_CUDA_GEMV_A_BLOCKS_PER_SM=1 one
 * (226 registers, no spill); each block at most its share of the SM's shared memory */
static void a_init(const exl_cuda_backend *cb) {
    const char *e = getenv("EXL_CUDA_GEMV_A");
    a_rows_lo = a_rows_hi = 0;
    if (e && atoi(e) == 1) {
        a_rows_lo = 2, a_rows_hi = EXL_CUDA_QGEMV_MAX_ROWS;
        e = getenv("EXL_CUDA_GEMV_A_ROWS");
        int lo = 0, hi = 0;
        const int n = e ? sscanf(e, "%d-%d", &lo, &hi) : 0;
        if (n >= 1 && lo >= 1 && lo <= EXL_CUDA_QGEMV_MAX_ROWS)
            a_rows_lo = lo;
        if (n == 2 && hi >= a_rows_lo && hi <= EXL_CUDA_QGEMV_MAX_ROWS)
            a_rows_hi = hi;
    }
    e = getenv("EXL_CUDA_GEMV_A_BLOCKS_PER_SM");
    a_sm_blocks = e && atoi(e) == 1 ? 1 : 2;
    /* each variant's share of the SM's shared memory */
    int sm_smem = 0, reserved = 0;
    cudaFuncAttributes fa[3] = {};
    void (*const k[3])(gemv_args) = {qgemv_a_kernel<1, 1>, qgemv_a_kernel<1, 2>, qgemv_a_kernel<2, 1>};
    const int blocks[3] = {1, 2, 1};
    a_smem_share[1] = a_smem_share[2] = 0;
    int ok = cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, cb->device) == cudaSuccess &&
             cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, cb->device) == cudaSuccess;
    for (int i = 0; i < 3 && ok; i++)
        ok = cudaFuncGetAttributes(&fa[i], k[i]) == cudaSuccess;
    int stat = 0;
    for (int i = 0; i < 3; i++)
        stat = (int)fa[i].sharedSizeBytes > stat ? (int)fa[i].sharedSizeBytes : stat;
    for (int mb = 1; mb <= 2 && ok; mb++) {
        const int share = (sm_smem / mb - reserved - stat) / 128 * 128;
        int set = share > 0;
        for (int i = 0; i < 3 && set; i++)
            if (blocks[i] == mb)
                set = cudaFuncSetAttribute(k[i], cudaFuncAttributeMaxDynamicSharedMemorySize, share) == cudaSuccess;
        a_smem_share[mb] = set ? share : 0;
    }
    cudaGetLastError();
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
    const char *e = getenv("EXL_CUDA_GEMV_MMA_K_WARPS");
    mma_k_warps = e && (atoi(e) == 1 || atoi(e) == 2) ? atoi(e) : MMA_K_WARPS_DEFAULT;
    int optin = 0;
    cudaFuncAttributes f1 = {}, f2 = {};
    mma_smem_max = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, cb->device) == cudaSuccess &&
        cudaFuncGetAttributes(&f1, qgemv_mma_kernel<1>) == cudaSuccess &&
        cudaFuncGetAttributes(&f2, qgemv_mma_kernel<2>) == cudaSuccess) {
        const int most = optin -
                         (int)(f1.sharedSizeBytes > f2.sharedSizeBytes ? f1.sharedSizeBytes : f2.sharedSizeBytes);
        if (cudaFuncSetAttribute(qgemv_mma_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) ==
                cudaSuccess &&
            cudaFuncSetAttribute(qgemv_mma_kernel<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, most) == cudaSuccess)
            mma_smem_max = most;
    }
    cudaGetLastError();
    /* two 256-thread blocks an SM: each half the shared memory (less what the SM reserves a block) */
    e = getenv("EXL_CUDA_GEMV_MMA_BLOCKS_PER_SM");
    mma_sm_blocks = 1;
    int sm_smem = 0, reserved = 0;
    if (e && atoi(e) == 2 && mma_k_warps == 1 && mma_smem_max > 0 &&
        cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, cb->device) == cudaSuccess &&
        cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, cb->device) == cudaSuccess) {
        const int half = (sm_smem / 2 - reserved - (int)f1.sharedSizeBytes) / 128 * 128;
        mma_smem_max = half < mma_smem_max ? half : mma_smem_max;
        mma_sm_blocks = 2;
    }
    cudaGetLastError();
    e = getenv("EXL_CUDA_GEMV_MMA_STAGES");
    /* the same bytes in flight an SM: twice the stages for one 256-thread block */
    mma_stages = mma_k_warps == 1 && mma_sm_blocks == 1 ? 2 * MMA_STAGES_DEFAULT : MMA_STAGES_DEFAULT;
    if (e && atoi(e) >= 2)
        mma_stages = atoi(e) < MMA_MAX_STAGES ? atoi(e) : MMA_MAX_STAGES;
    e = getenv("EXL_CUDA_GEMV_MMA_BLOCKS");
    mma_blocks = e && atoi(e) > 0 ? atoi(e) : 0;
    e = getenv("EXL_CUDA_GEMV_MMA_NORM_ROWS");
    mma_norm_rows = e ? atoi(e) : MMA_NORM_ROWS_DEFAULT;
    e = getenv("EXL_CUDA_GEMV_MMA_L2_AHEAD");
    mma_l2_chunks = e && atoi(e) >= 0 ? atoi(e) : MMA_L2_AHEAD_DEFAULT;
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

/* EXL_CUDA_LORA_SIDE: 1 (default) side blocks where the launch's blocks add atomically anyway (they sum the runs the
 * GEMV's blocks leave and add the updates: 0.740 of the no-adapter rate against the in-block fold's 0.680 on an
 * H100, bench/RESULTS.md), 0 the in-block fold in every launch, 2 side blocks wherever the outputs allow atomic adds
 * (zeroed before, or accumulated: the tests' small matrices, which take no split); read when a step is launched or
 * captured */
static int lora_side_mode(void) {
    const char *e = getenv("EXL_CUDA_LORA_SIDE");
    return e && *e ? atoi(e) : 1;
}

/* Side blocks (cuda_lora_fold.cuh) where the launch's blocks add their sums atomically: the dots whole (one piece)
 * and extra grid columns, as many as give each side block about one dot while the grid still fits the GPU at once
 * (BLOCKS_PER_SM an SM; one column at least) */
static void lora_side_of(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f, gemv_args *a, int split) {
    exl_lora_fold *L = &a->lora;
    const int32_t dots = L->n_uses * a->n_mats * L->max_rank, tiles = a->m[a->n_mats - 1].tile_end;
    const int mode = lora_side_mode();
    if (mode == 0 || !L->units || L->units > EXL_LORA_SIDE_MAX - 8) /* the runs and 8 sums of squares in red */
        return;
    if (mode == 2 && (f->accumulate || f->out_zeroed) && !cb->deterministic)
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
    if (kind == GEMV_MMA || kind == GEMV_A) {
        a.x = f->x;
        a.up = f->up;
        if (f->norm && (f->rows > mma_norm_rows || a.in % 4)) { /* normed first by one launch: every block would read
                                                                    * all rows whole */
            if (!exl_cuda_ensure(cb, (void **)&cb->gemv_normed, &cb->gemv_normed_bytes,
                                 (size_t)EXL_CUDA_QGEMV_MAX_ROWS * a.in * sizeof(float), "GEMV normed input"))
                return;
            exl_cuda_run_rmsnorm(&cb->base, cb->gemv_normed, f->x, f->norm, f->rows, a.in, f->eps);
            a.x = cb->gemv_normed, a.norm = NULL;
        }
        if (kind == GEMV_A) {
            const dim3 grid((unsigned)tiles, (unsigned)split);
            const size_t smem = a_smem_bytes(a.chunks_per_block, a_gptq(&a));
            if (f->rows > 8)
                exl_cuda_launch(cb, qgemv_a_kernel<2, 1>, grid, dim3(A_THREADS), smem, a);
            else
                exl_cuda_launch(cb, a_sm_blocks == 1 ? qgemv_a_kernel<1, 1> : qgemv_a_kernel<1, 2>, grid,
                                dim3(A_THREADS), smem, a);
            exl_cuda_check_launch(cb, "quantized GEMV (weights as A)");
            return;
        }
        const size_t smem = mma_smem_bytes(a.chunks_per_block, a.mma_ring);
        const dim3 grid((unsigned)tiles, (unsigned)split), block(MMA_COL_WARPS * 32 * mma_k_warps);
        if (mma_k_warps == 1)
            exl_cuda_launch(cb, qgemv_mma_kernel<1>, grid, block, smem, a);
        else
            exl_cuda_launch(cb, qgemv_mma_kernel<2>, grid, block, smem, a);
        exl_cuda_check_launch(cb, "quantized GEMV (tensor cores)");
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
