/* cuda_qgemv.cu - fused dequantize + GEMV for few rows (the decode case) over up to three
 * quantized matrices that share their input, with the layer's neighbours fused in: the
 * input's RMSNorm or GLU is applied while the activations are gathered, and the result
 * can be added to the output (the residual).
 *
 * Integer products: each 32-row chunk's activations are quantized twice to int8,
 * x ~ s * (h + l / 254) with h, l in [-127, 127] (about 16 bits of the chunk's largest value),
 * the codes are unpacked to bytes and dp4a multiplies four of them at once with exact int32
 * sums; per chunk and column the two sums, less the zero times the sums of h and l, are
 * scaled once in fp32. The RMSNorm's 1 / rms is a factor of the whole product, applied to
 * the block's sum, so the sum of squares runs beside the rest instead of before it.
 *
 * Work: a block owns 128 columns (32 lanes x 4, 16-byte loads) of one matrix and a piece of
 * its chunks, of one bit width (cuda_quant.cu stores chunks sorted by width); its 8 warps take
 * every 8th chunk of the piece. Before griddepcontrol.wait (programmatic dependent launch), a
 * thread loads all its words of the piece into registers, with their scales and activation
 * rows: the weights stream in while the previous kernel finishes. After it, each warp gathers
 * and quantizes the activations of its own chunks (no block barrier), multiplies, and the
 * block sums its warps in shared memory. The pieces of a column tile are added by the last
 * block to arrive (counter per tile, reset by it), in piece order, so the result does not
 * depend on timing. */
#include "backend/cuda/cuda_qdecode.cuh"

#include <stdlib.h>

#define GEMV_WARPS 8
#define GEMV_THREADS (GEMV_WARPS * 32)
#define TILE_COLS 128
#define MAX_MATS 3
#define MAX_RUNS EXL_QMATRIX_MAX_RUNS
#define ROWS_PER_LAUNCH EXL_CUDA_QGEMV_MAX_ROWS
/* 16-byte words a thread holds in registers for one piece (one row, 4-bit: 4 chunks) */
#ifndef GEMV_WORD_BUDGET
#define GEMV_WORD_BUDGET 16
#endif
#define WORD_BUDGET(R) ((R) == 1 ? GEMV_WORD_BUDGET : GEMV_WORD_BUDGET / 2)
#define CPW_MAX(b, R) ((b) >= WORD_BUDGET(R) ? 1 : WORD_BUDGET(R) / (b))

typedef struct gemv_mat {
    exl_qmatrix q;
    float *out;
    const float *bias;
    int32_t n_out, tiles;
    int32_t tile0, block0;           /* first column tile (global) and first block */
    int32_t run_cpw[MAX_RUNS];       /* chunks per warp in the pieces of each run */
    int32_t run_piece[MAX_RUNS + 1]; /* first piece of each run; the last: pieces in all */
} gemv_mat;

typedef struct gemv_args {
    gemv_mat m[MAX_MATS];
    int32_t n_mats;
    const float *x, *up, *norm;
    float eps;
    int32_t act, in, accumulate;
    float *partial;     /* [piece][R][all tiles * TILE_COLS] */
    unsigned *counters; /* [all tiles] */
    int32_t all_tiles;
} gemv_args;

/* one chunk's quantized activations of one row, in dp4a byte order */
typedef struct __align__(16) act_chunk {
    int8_t hi[32], lo[32];
    float s;
    int32_t sum_hi, sum_lo, pad;
} act_chunk;

template <int R>
struct gemv_smem {
    act_chunk act[GEMV_WARPS][CPW_MAX(2, R)][R];
    float red[GEMV_WARPS][R][TILE_COLS];
    float sumsq[GEMV_WARPS][R];
    int is_last;
};

/* ---- bytes: the codes of a chunk as 8 words of 4 byte-sized codes, and the chunk row of
 * each byte (lane p = 4 v + k is byte k of word v) */

template <int B>
__device__ __forceinline__ int row_of_byte(int p) {
    const int v = p >> 2, k = p & 3;
    if constexpr (B == 2 || B == 4 || B == 8) {
        constexpr int VPW = 8 / B; /* byte words per code word */
        return (v / VPW) * (32 / B) + k * VPW + v % VPW;
    } else {
        return p;
    }
}

__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ uint32_t comp(const uint4 &v, int c) { return c == 0 ? v.x : c == 1 ? v.y : c == 2 ? v.z : v.w; }

/* ---- warp reductions */

__device__ __forceinline__ float warp_max_abs(float v) {
#if __CUDA_ARCH__ >= 800
    return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(fabsf(v))));
#else
    float m = fabsf(v);
    for (int o = 16; o > 0; o >>= 1)
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    return m;
#endif
}

__device__ __forceinline__ int warp_sum(int v) {
#if __CUDA_ARCH__ >= 800
    return __reduce_add_sync(0xffffffffu, v);
#else
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
#endif
}

/* ---- one block */

template <int R, int B>
__device__ __forceinline__ void gemv_block(const gemv_args &a, const gemv_mat &M, int ri, int piece, int tile,
                                           gemv_smem<R> &sm) {
    constexpr int CPW = CPW_MAX(B, R);
    const exl_qmatrix &q = M.q;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int cpw = M.run_cpw[ri];
    const int c_first = q.run_chunk[ri] + (piece - M.run_piece[ri]) * GEMV_WARPS * cpw;
    const int c_end = min(c_first + GEMV_WARPS * cpw, q.run_chunk[ri + 1]);
    const int col0 = tile * TILE_COLS + lane * 4;
    const int n_pad = q.n_pad;

    /* before the wait: weights, scales, zeros, activation rows, norm weights */
    uint4 wv[CPW][B];
    uint2 sc[CPW], zr[CPW];
    int src[CPW];
    float nw[CPW];
#pragma unroll
    for (int i = 0; i < CPW; i++) {
        const int c = c_first + warp + GEMV_WARPS * i;
        src[i] = -1;
        nw[i] = 1.0f;
        if (i < cpw && c < c_end) {
            const uint32_t *w0 = q.qw + (int64_t)(q.run_word[ri] + (c - q.run_chunk[ri]) * B) * n_pad + col0;
#pragma unroll
            for (int u = 0; u < B; u++)
                wv[i][u] = __ldg((const uint4 *)(w0 + (int64_t)u * n_pad));
            src[i] = __ldg(q.slot_src + c * CHUNK + exl_cuda_slot_of(B, row_of_byte<B>(lane)));
            const int64_t g = (int64_t)__ldg(&q.chunks[c].z) * n_pad + col0;
            sc[i] = __ldg((const uint2 *)(q.scales + g));
            if (q.zeros)
                zr[i] = __ldg((const uint2 *)(q.zeros + g));
            if (a.norm && src[i] >= 0)
                nw[i] = __ldg(a.norm + src[i]);
        }
    }
    exl_pdl_start();

    /* the activations this lane quantizes, and its share of the rows' sums of squares */
    float xv[CPW][R];
#pragma unroll
    for (int i = 0; i < CPW; i++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            xv[i][r] = 0.0f;
            if (src[i] >= 0) {
                float v = a.x[(int64_t)r * a.in + src[i]];
                xv[i][r] = a.up ? exl_cuda_activate(v, a.act) * a.up[(int64_t)r * a.in + src[i]] : v * nw[i];
            }
        }
    if (a.norm) {
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float *xr = a.x + (int64_t)r * a.in;
            float ss = 0.0f;
            if (a.in % 4 == 0) {
#pragma unroll 4
                for (int i = threadIdx.x; i < a.in / 4; i += GEMV_THREADS) {
                    float4 v = __ldg((const float4 *)xr + i);
                    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
                }
            } else {
                for (int i = threadIdx.x; i < a.in; i += GEMV_THREADS)
                    ss += xr[i] * xr[i];
            }
            for (int o = 16; o > 0; o >>= 1)
                ss += __shfl_xor_sync(0xffffffffu, ss, o);
            if (lane == 0)
                sm.sumsq[warp][r] = ss;
        }
    }

    /* quantize this warp's chunks (lane = byte position) */
#pragma unroll
    for (int i = 0; i < CPW; i++) {
        if (i >= cpw || c_first + warp + GEMV_WARPS * i >= c_end)
            continue;
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float v = xv[i][r], m = warp_max_abs(v);
            const float inv_s = m > 0.0f ? 127.0f / m : 0.0f, s = m * (1.0f / 127.0f);
            const int h = __float2int_rn(v * inv_s);
            const int l = max(-127, min(127, __float2int_rn((v - (float)h * s) * inv_s * 254.0f)));
            act_chunk &ac = sm.act[warp][i][r];
            ac.hi[lane] = (int8_t)h;
            ac.lo[lane] = (int8_t)l;
            const int sh = warp_sum(h), sl = warp_sum(l);
            if (lane == 0) {
                ac.s = s;
                ac.sum_hi = sh;
                ac.sum_lo = sl;
            }
        }
    }
    __syncwarp();

    float acc[R][4];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int c = 0; c < 4; c++)
            acc[r][c] = 0.0f;
#pragma unroll
    for (int i = 0; i < CPW; i++) {
        if (i >= cpw || c_first + warp + GEMV_WARPS * i >= c_end)
            continue;
        int qh[R][4], ql[R][4];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                qh[r][c] = ql[r][c] = 0;
        if constexpr (B == 2 || B == 4 || B == 8) {
            constexpr int VPW = 8 / B;
            constexpr uint32_t MASK = B == 8 ? 0xffffffffu : B == 4 ? 0x0f0f0f0fu : 0x03030303u;
#pragma unroll
            for (int u = 0; u < B; u++)
#pragma unroll
                for (int t = 0; t < VPW; t++) {
                    int ah[R], al[R];
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        ah[r] = ((const int *)sm.act[warp][i][r].hi)[u * VPW + t];
                        al[r] = ((const int *)sm.act[warp][i][r].lo)[u * VPW + t];
                    }
#pragma unroll
                    for (int c = 0; c < 4; c++) {
                        const uint32_t v = (comp(wv[i][u], c) >> (B * t)) & MASK;
#pragma unroll
                        for (int r = 0; r < R; r++) {
                            qh[r][c] = dp4a_us(v, ah[r], qh[r][c]);
                            ql[r][c] = dp4a_us(v, al[r], ql[r][c]);
                        }
                    }
                }
        } else {
#pragma unroll
            for (int c = 0; c < 4; c++) {
                uint32_t w[B];
#pragma unroll
                for (int u = 0; u < B; u++)
                    w[u] = comp(wv[i][u], c);
#pragma unroll
                for (int v = 0; v < 8; v++) {
                    const uint32_t bytes = extract<B>(w, (4 * v) * B) | extract<B>(w, (4 * v + 1) * B) << 8 |
                                           extract<B>(w, (4 * v + 2) * B) << 16 | extract<B>(w, (4 * v + 3) * B) << 24;
#pragma unroll
                    for (int r = 0; r < R; r++) {
                        qh[r][c] = dp4a_us(bytes, ((const int *)sm.act[warp][i][r].hi)[v], qh[r][c]);
                        ql[r][c] = dp4a_us(bytes, ((const int *)sm.act[warp][i][r].lo)[v], ql[r][c]);
                    }
                }
            }
        }
        __half scale[4], zero[4];
        memcpy(scale, &sc[i], 8);
        if (q.zeros)
            memcpy(zero, &zr[i], 8);
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int z = q.zeros ? __half2int_rn(zero[c]) : 1 << (B - 1);
            const float s = __half2float(scale[c]);
#pragma unroll
            for (int r = 0; r < R; r++) {
                const act_chunk &ac = sm.act[warp][i][r];
                const float prod = (float)(qh[r][c] - z * ac.sum_hi) + (float)(ql[r][c] - z * ac.sum_lo) * (1.0f / 254.0f);
                acc[r][c] += (ac.s * s) * prod;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++)
        *(float4 *)&sm.red[warp][r][lane * 4] = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    __syncthreads();

    /* the block's sum: thread t adds column t % TILE_COLS of rows t / TILE_COLS, + 2, ... */
    const int col = threadIdx.x % TILE_COLS, r0 = threadIdx.x / TILE_COLS;
    constexpr int RPT = (R + GEMV_THREADS / TILE_COLS - 1) / (GEMV_THREADS / TILE_COLS);
    float sum[RPT];
#pragma unroll
    for (int j = 0; j < RPT; j++) {
        const int r = r0 + j * (GEMV_THREADS / TILE_COLS);
        sum[j] = 0.0f;
        if (r < R) {
#pragma unroll
            for (int w = 0; w < GEMV_WARPS; w++)
                sum[j] += sm.red[w][r][col];
            if (a.norm) {
                float ss = 0.0f;
#pragma unroll
                for (int w = 0; w < GEMV_WARPS; w++)
                    ss += sm.sumsq[w][r];
                sum[j] *= rsqrtf(ss / a.in + a.eps);
            }
        }
    }
    const int pieces = M.run_piece[q.n_runs];
    const int gcol = (M.tile0 + tile) * TILE_COLS + col; /* column in the partial sums */
    if (pieces > 1) {
        const int64_t width = (int64_t)a.all_tiles * TILE_COLS;
#pragma unroll
        for (int j = 0; j < RPT; j++) {
            const int r = r0 + j * (GEMV_THREADS / TILE_COLS);
            if (r < R)
                a.partial[((int64_t)piece * R + r) * width + gcol] = sum[j];
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0)
            sm.is_last = atomicAdd(&a.counters[M.tile0 + tile], 1u) == (unsigned)pieces - 1;
        __syncthreads();
        if (!sm.is_last)
            return;
        __threadfence();
#pragma unroll
        for (int j = 0; j < RPT; j++) {
            const int r = r0 + j * (GEMV_THREADS / TILE_COLS);
            sum[j] = 0.0f;
            if (r < R)
                for (int p = 0; p < pieces; p++)
                    sum[j] += __ldcg(a.partial + ((int64_t)p * R + r) * width + gcol);
        }
        if (threadIdx.x == 0)
            a.counters[M.tile0 + tile] = 0;
    }
    const int tcol = tile * TILE_COLS + col;
    if (tcol < M.n_out)
#pragma unroll
        for (int j = 0; j < RPT; j++) {
            const int r = r0 + j * (GEMV_THREADS / TILE_COLS);
            if (r < R) {
                float *dst = M.out + (int64_t)r * M.n_out + tcol;
                *dst = (a.accumulate ? *dst : 0.0f) + sum[j] + (M.bias ? M.bias[tcol] : 0.0f);
            }
        }
}

template <int R>
__global__ void __launch_bounds__(GEMV_THREADS, 2) qgemv_kernel(const __grid_constant__ gemv_args a) {
    __shared__ gemv_smem<R> sm;
    int mi = 0;
    while (mi + 1 < a.n_mats && (int)blockIdx.x >= a.m[mi + 1].block0)
        mi++;
    const gemv_mat &M = a.m[mi];
    const int local = (int)blockIdx.x - M.block0, piece = local / M.tiles, tile = local % M.tiles;
    int ri = 0;
    while (ri + 1 < M.q.n_runs && piece >= M.run_piece[ri + 1])
        ri++;
    switch (M.q.run_bits[ri]) {
    case 2: gemv_block<R, 2>(a, M, ri, piece, tile, sm); break;
    case 3: gemv_block<R, 3>(a, M, ri, piece, tile, sm); break;
    case 4: gemv_block<R, 4>(a, M, ri, piece, tile, sm); break;
    case 5: gemv_block<R, 5>(a, M, ri, piece, tile, sm); break;
    case 6: gemv_block<R, 6>(a, M, ri, piece, tile, sm); break;
    default: gemv_block<R, 8>(a, M, ri, piece, tile, sm); break;
    }
}

/* ---- launch */

template <int R>
static void launch(exl_cuda_backend *cb, const gemv_args *a, int blocks) {
    exl_cuda_launch(cb, qgemv_kernel<R>, dim3((unsigned)blocks), dim3(GEMV_THREADS), 0, *a);
    exl_cuda_check_launch(cb, "quantized GEMV");
}

static void launch_rows(exl_cuda_backend *cb, const gemv_args *a, int blocks, int rows) {
    switch (rows) {
    case 1: launch<1>(cb, a, blocks); break;
    case 2: launch<2>(cb, a, blocks); break;
    case 3: launch<3>(cb, a, blocks); break;
    default: launch<4>(cb, a, blocks); break;
    }
}

/* Pieces of every run for chunks-per-warp at most `cap`; returns the blocks of all matrices. */
static int assign_pieces(gemv_args *a, int rows, int cap) {
    int blocks = 0;
    for (int i = 0; i < a->n_mats; i++) {
        gemv_mat *m = &a->m[i];
        int pieces = 0;
        for (int r = 0; r < m->q.n_runs; r++) {
            int b = m->q.run_bits[r], cpw = rows == 1 ? CPW_MAX(b, 1) : CPW_MAX(b, 2);
            cpw = cpw > cap ? cap : cpw;
            int per_piece = GEMV_WARPS * cpw, chunks = m->q.run_chunk[r + 1] - m->q.run_chunk[r];
            m->run_cpw[r] = cpw;
            m->run_piece[r] = pieces;
            pieces += (chunks + per_piece - 1) / per_piece;
        }
        m->run_piece[m->q.n_runs] = pieces;
        m->block0 = blocks;
        blocks += pieces * m->tiles;
    }
    return blocks;
}

/* The launch arguments for f (less the per-row-group pointers) and its block count; 0 if the
 * kernel does not take f. */
static int plan(const exl_cuda_backend *cb, const exl_matmul_fused *f, gemv_args *a, int *blocks) {
    if (f->rows < 1 || f->rows > EXL_CUDA_QGEMV_MAX_ROWS || f->n < 1 || f->n > MAX_MATS)
        return 0;
    memset(a, 0, sizeof *a);
    int32_t tiles = 0;
    for (int i = 0; i < f->n; i++) {
        const exl_linear *w = f->w[i];
        if (w->kind == EXL_LINEAR_DENSE || w->in != f->w[0]->in || w->q.n_runs < 1)
            return 0;
        gemv_mat *m = &a->m[i];
        m->q = w->q;
        m->out = f->out[i];
        m->bias = w->bias;
        m->n_out = w->out;
        m->tiles = w->q.n_pad / TILE_COLS;
        m->tile0 = tiles;
        tiles += m->tiles;
    }
    a->n_mats = f->n;
    a->all_tiles = tiles;
    a->norm = f->norm ? f->norm->v : NULL;
    a->eps = f->eps;
    a->act = f->act;
    a->in = f->w[0]->in;
    a->accumulate = f->accumulate;
    /* the most chunks per warp (weights in flight per thread) that still gives every SM
     * cb->gemv_blocks_per_sm blocks */
    int cap = CPW_MAX(2, 1);
    *blocks = assign_pieces(a, f->rows, cap);
    while (cap > 1 && *blocks < cb->gemv_blocks_per_sm * cb->n_sms) {
        cap = (cap + 1) / 2;
        *blocks = assign_pieces(a, f->rows, cap);
    }
    return 1;
}

int exl_cuda_qgemv_takes(const exl_cuda_backend *cb, const exl_matmul_fused *f) {
    gemv_args a;
    int blocks;
    return plan(cb, f, &a, &blocks);
}

void exl_cuda_qgemv_fused(exl_cuda_backend *cb, const exl_matmul_fused *f) {
    gemv_args a;
    int blocks;
    if (!plan(cb, f, &a, &blocks)) {
        exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED, "quantized GEMV: this matmul does not fit the kernel");
        return;
    }
    int pieces = 1;
    for (int i = 0; i < a.n_mats; i++)
        pieces = a.m[i].run_piece[a.m[i].q.n_runs] > pieces ? a.m[i].run_piece[a.m[i].q.n_runs] : pieces;
    if (pieces > 1) {
        int R = f->rows < ROWS_PER_LAUNCH ? f->rows : ROWS_PER_LAUNCH;
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_partial, &cb->gemv_partial_bytes,
                             (size_t)pieces * R * a.all_tiles * TILE_COLS * sizeof(float), "GEMV partial sums"))
            return;
        if ((size_t)a.all_tiles > cb->gemv_counter_count) {
            size_t bytes = cb->gemv_counter_count * sizeof(unsigned);
            if (!exl_cuda_ensure(cb, (void **)&cb->gemv_counters, &bytes, (size_t)a.all_tiles * sizeof(unsigned),
                                 "GEMV counters"))
                return;
            cb->gemv_counter_count = (size_t)a.all_tiles;
            if (cudaMemsetAsync(cb->gemv_counters, 0, bytes, cb->stream) != cudaSuccess) {
                exl_cuda_check_launch(cb, "GEMV counters");
                return;
            }
        }
        a.partial = cb->gemv_partial;
        a.counters = cb->gemv_counters;
    }
    /* ROWS_PER_LAUNCH rows per launch (the weights are read once per launch) */
    for (int32_t r = 0; r < f->rows; r += ROWS_PER_LAUNCH) {
        gemv_args part = a;
        part.x = f->x + (int64_t)r * a.in;
        part.up = f->up ? f->up + (int64_t)r * a.in : NULL;
        for (int i = 0; i < f->n; i++)
            part.m[i].out = f->out[i] + (int64_t)r * f->w[i]->out;
        launch_rows(cb, &part, blocks, f->rows - r < ROWS_PER_LAUNCH ? f->rows - r : ROWS_PER_LAUNCH);
    }
}
