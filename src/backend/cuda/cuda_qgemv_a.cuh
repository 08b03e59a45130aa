/* cuda_qgemv_a.cuh - GEMV-A: the few-row GEMV with the weights as the tensor cores' A operand (qgemv_a_kernel) for a
 * single wide matrix (the head) at 5-16 decode rows, and its launch plan; part of cuda_qgemv.cu (included there: it
 * shares gemv_args, the input transform, the clears and the KV prefetch).
 *
 * Why only there: a single matrix whose 128-column tiles alone fill the SMs (the 7B head's 250 on an H100's 132)
 * is not split by cuda_qmma.cu, so each of its blocks runs the whole input serially; GEMV-A splits it (the head at
 * 5 / 8 / 16 rows 196 / 195 / 195 us there, 115 / 133 / 148 us here, H100, bench/RESULTS.md). Every other matrix
 * of 2-16 rows was faster on qgemv_kernel (2-4 rows) and cuda_qmma.cu (5-16) than here.
 *
 * The decoded weights are the m16 operand of mma.m16n8k16 (16 output features x 16 inputs) and the rows the n8
 * operand (rows 9-16 a second n8 tile), so a decoded weight feeds one mma for up to 8 rows and the work a weight is
 * flat in the rows. A block covers one column tile (256 features) over its range of chunks; warp w takes features
 * 32w .. 32w + 31 as two m16 tiles. Which feature is which row of the m16 tile is free: lane (g, t) takes features
 * 4g .. 4g + 3 (m16 tile m: row g feature 4g + 2m, row g + 8 feature 4g + 2m + 1), so that in the column-tile
 * layout (exl_qw_col: a chunk's word row holds one 32-bit word a feature) its A fragments are 16-byte loads straight
 * from global memory, with no staging and no repacked copy: quarter t (pairs 4t .. 4t + 3, cuda_qdecode.cuh) of its
 * four features, at 4 bits word row t (the warp's load: 4 whole 128-byte rows), at 2 and 8 bits one and two rows,
 * at 6 bits the four rows under the quarter, at 3 and 5 bits all b rows; the scales (and GPTQ zeros) of the four
 * features are one 8-byte load. The mma's k pairs are chunk pairs in the order the loads give them: k step s of a
 * chunk takes chunk pairs 4t + 2s (mma pair t) and 4t + 2s + 1 (mma pair t + 4), for A and B alike, which is the
 * order the activation gather (a_xs_at) stores: rows g and g + 8 of pairs 4t .. 4t + 3 in two 16-byte loads serve
 * both n8 tiles and both m16 tiles.
 *
 * Memory in flight: a warp loads its chunks in batches of one width (a_batch_chunks; the run lengths are in the
 * descriptors), the next batch's loads issued before it multiplies this one: 2-4 KiB a warp at 4 bits, 32-64 KiB an
 * SM with two 8-warp blocks (MB 2, up to 8 rows), half that with one (MB 1: 9-16 rows, whose second n8 tile needs
 * the registers). The chunk descriptors of the block are read into shared memory and each warp's first A_L2_CHUNKS
 * chunks asked of L2 before griddepcontrol.wait (weights are constant), while the earlier kernel ends and the
 * activations are gathered (every row's loads of a pair at once, the input's RMSNorm computed by the block up to
 * a_norm_rows rows, else by a launch of its own first, or the GLU applied). The scales (and zeros) of the block's
 * chunks are copied into shared memory with cp.async while the activations are gathered (a chunk's 256, 512 bytes;
 * 1/8 of a 4-bit chunk's codes, mostly L2 hits), out of the batches' registers.
 * Zeros are exact as in every kernel here ((1024 + q) - (1024 + z) in fp16); products are summed in fp32 by the
 * mma for a chunk and scaled per chunk and feature in fp32. With a split, the blocks add their sums atomically onto
 * outputs zeroed or accumulated (as qgemv_kernel's), else the last block of a column tile adds the partial sums in
 * split order with all its threads (a_merge_splits); bias, slot order in and out, the clears for later launches and
 * the KV prefetch as in qgemv_kernel. */

#define A_WARPS (COL_TILE / 32) /* a warp per 32 features of the column tile */
#define A_THREADS (A_WARPS * 32)
#define A_L2_CHUNKS 8 /* chunks a warp asks L2 for before griddepcontrol.wait */

/* The activations in shared memory in the order the lanes read them: for rows g and g + 8 (g < 8) and chunk lc, 32
 * pairs, lane (g, t)'s k step s at 8t + 4s .. + 3: (row g, pair 4t + 2s), (row g + 8, same), (row g, 4t + 2s + 1),
 * (row g + 8, same); one 16-byte load a k step (a_multiply takes rows g of both loads for n8 tile 0, rows g + 8 for
 * tile 1). Rows past a.rows are zeros. Row groups g lie a_xs_stride(cpb) pairs apart: 16 bytes past a multiple of
 * 128, so that the two groups a quarter warp loads fall on different banks. */
__host__ __device__ __forceinline__ int a_xs_stride(int cpb) { return cpb * 32 + 4; }

__device__ __forceinline__ int a_xs_at(int xs_stride, int r, int lc, int p) {
    return (r % 8) * xs_stride + lc * 32 + (p / 4) * 8 + ((p / 2) % 2) * 4 + (p % 2) * 2 + r / 8;
}

/* activation pairs a thread has the inputs of read before griddepcontrol.wait (the 7B head's blocks of 64 chunks:
 * 1024 pairs, 4 a thread) */
#define A_PRE_PAIRS 4 /* (sp[0 .. 3] are picked by compares in the gather) */

/* 1 / RMS of each of the R rows into inv (shared memory), by the whole block: every row's loads of a pass in flight
 * together (a.in % 4 == 0: the launcher folds the norm in only then). red has room for 16 warps, twice the block's:
 * its size is part of the static shared memory that a_init takes off each block's share, and so of the chunks a
 * block gets where the share bounds them (a 70B head at 5-8 rows), which stay as they were measured. */
__device__ void a_inv_rms(const gemv_args &a, int R, float *inv) {
    __shared__ float red[2 * A_WARPS][EXL_CUDA_QGEMV_MAX_ROWS];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float ss[EXL_CUDA_QGEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < EXL_CUDA_QGEMV_MAX_ROWS; r++)
        ss[r] = 0.0f;
    for (int i = threadIdx.x; i < a.in / 4; i += A_THREADS) {
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
        for (int w = 0; w < A_WARPS; w++)
            s += red[w][threadIdx.x];
        inv[threadIdx.x] = rsqrtf(s / a.in + a.eps);
    }
    __syncthreads();
}

/* The last block of a column tile adds the splits' partial sums (in split order) and writes the outputs: every thread
 * of the block a few of the tile's R x COL_TILE outputs, the loads of several splits for all of them in flight together
 * (a few memory round trips, where a lane summing its own 16 outputs split by split took ~2 per output) */
__device__ void a_merge_splits(const gemv_args &a, const gemv_mat &M, int tile_col, int64_t width) {
    constexpr int THREADS = A_THREADS, OUTS = EXL_CUDA_QGEMV_MAX_ROWS * COL_TILE / THREADS;
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

/* Activation pair i (inputs s) of every row into xs (a_xs_at; rows R .. 15 zeros): the loads of all rows first, in
 * flight together, then the input transform (input_at's, with the same roundings) */
__device__ __forceinline__ void a_gather_pair(const gemv_args &a, int R, int2 s, const float *inv, __half2 *xs,
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
        xs[a_xs_at(xs_stride, r, i / 16, i % 16)] = __floats2half2_rn(v[r].x, v[r].y);
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

/* word rows of a column's chunk a lane reads for its quarter at B bits, and which */
template <int B>
__host__ __device__ constexpr int a_words(void) {
    return B == 4 || B == 2 ? 1 : B == 8 ? 2 : B == 6 ? 4 : B;
}
template <int B>
__device__ __forceinline__ int a_word_row(int t, int i) {
    if constexpr (B == 6) {
        const int k = 3 * t / 4;
        return i == 0 ? k : i == 1 ? k + 1 : i == 2 ? k + 3 : min(k + 4, 5);
    } else if constexpr (B == 3 || B == 5)
        return i;
    else
        return quarter_first<B>(t) + i;
}
/* chunks a batch: MB 1 (one block an SM, 255 registers): 16 words a lane at 4 bits, 32 at 6 and 8; MB 2 (two
 * blocks an SM, 128 registers): 4 chunks at 2 and 4 bits, 1 at the other widths (more spilled) */
template <int B, int MB>
__host__ __device__ constexpr int a_batch_chunks(void) {
    return B == 4 || B == 2 ? 4 : MB == 2 ? 1 : B == 8 || B == 6 || B == 3 ? 2 : 1;
}

/* t through an asm the compiler cannot move: what derives from it (shift counts, word row offsets of every width)
 * is computed again by each batch, not hoisted out of the chunk loop into registers held all through it (at 128
 * registers those spilled) */
__device__ __forceinline__ int a_opaque(int t) {
    int r;
    asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(t));
    return r;
}

/* word f of each of a quarter's word rows (feature f of the lane's four) */
__device__ __forceinline__ uint32_t a_pick(const uint4 &v, int f) {
    return f == 0 ? v.x : f == 1 ? v.y : f == 2 ? v.z : v.w;
}

/* quarter t of feature f's chunk (the lane's word rows w) as 4 exact (q - z) fp16 pairs */
template <int B>
__device__ __forceinline__ void a_decode(const uint4 (&w)[a_words<B>()], int f, int t, __half2 zz, uint32_t (&pr)[4]) {
    if constexpr (B == 4) {
        quarter4(a_pick(w[0], f), zz, pr);
    } else if constexpr (B == 6) {
        const int off = (24 * t) % 32;
        const uint32_t lo = __funnelshift_r(a_pick(w[0], f), a_pick(w[1], f), off);
        const uint32_t hi = __funnelshift_r(a_pick(w[2], f), a_pick(w[3], f), off);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint32_t v = and_or(lo >> (6 * i), 0x3fu, 0x64006400u);
            pr[i] = half2_bits(__hsub2(u32_as_half2(and_or(hi >> (6 * i) << 16, 0x003f0000u, v)), zz));
        }
    } else {
        uint32_t wq[MAX_WORDS];
#pragma unroll
        for (int i = 0; i < MAX_WORDS; i++)
            wq[i] = i < a_words<B>() ? a_pick(w[i < a_words<B>() ? i : 0], f) : 0u;
        decode_quarter<B>(wq, t, zz, pr);
    }
}

/* The lane's view of a block's work: word row 0 of its features 4g .. 4g + 3, and their scales (zeros: GPTQ) of
 * the block's chunk 0 in shared memory (COL_TILE halves a chunk) */
typedef struct a_lane {
    const uint32_t *w;
    const __half *ss, *zs;
    int t;
} a_lane;

/* One batch: the loads of up to U chunks of B bits */
template <int B, bool GPTQ, int MB>
struct a_batch {
    static constexpr int W = a_words<B>(), U = a_batch_chunks<B, MB>();
    uint4 w[U][W];
};

/* past the n chunks of the batch, its first chunk again (L1 hits): every load unconditional, so that the batch stays
 * in registers */
template <int B, bool GPTQ, int MB>
__device__ __forceinline__ void a_load(const a_lane &L, const int4 *d, int n, a_batch<B, GPTQ, MB> &b) {
    const int t = a_opaque(L.t);
#pragma unroll
    for (int u = 0; u < a_batch<B, GPTQ, MB>::U; u++) {
        const int4 m = u == 0 || u < n ? d[u] : d[0];
#pragma unroll
        for (int i = 0; i < a_batch<B, GPTQ, MB>::W; i++)
            b.w[u][i] = __ldg((const uint4 *)(L.w + (int64_t)(m.x + a_word_row<B>(t, i)) * EXL_QW_TILE));
    }
}

/* acc[m][nt][e] += the batch's products: m16 tile m (mma row g: feature 4g + 2m, row g + 8: 4g + 2m + 1), n8 tile
 * nt (rows 8nt ..); the batch's first chunk is the block's chunk k; xa: the activation pairs of chunk 0 (a_xs_at,
 * rows g and g + 8, pairs 4t ..) */
template <int B, bool GPTQ, int NT, int MB>
__device__ __forceinline__ void a_multiply(const a_lane &L, const a_batch<B, GPTQ, MB> &b, int k, int n,
                                           const __half2 *xa, float (&acc)[2][NT][4]) {
    const int t = a_opaque(L.t);
#pragma unroll
    for (int u = 0; u < a_batch<B, GPTQ, MB>::U; u++)
        if (u < n) {
            const int lc = k + u;
            const uint4 x0 = *(const uint4 *)(xa + lc * 32), x1 = *(const uint4 *)(xa + lc * 32 + 4);
            const uint2 sv = *(const uint2 *)(L.ss + lc * COL_TILE);
            __half sh[4], zh[4];
            memcpy(sh, &sv, 8);
            if constexpr (GPTQ) {
                const uint2 zv = *(const uint2 *)(L.zs + lc * COL_TILE);
                memcpy(zh, &zv, 8);
            }
#pragma unroll
            for (int m = 0; m < 2; m++) {
                uint32_t lo[4], hi[4];
                const float zl = GPTQ ? __half2float(zh[2 * m]) : (float)(1 << (B - 1));
                const float zu = GPTQ ? __half2float(zh[2 * m + 1]) : (float)(1 << (B - 1));
                a_decode<B>(b.w[u], 2 * m, t, __float2half2_rn(1024.0f + zl), lo);
                a_decode<B>(b.w[u], 2 * m + 1, t, __float2half2_rn(1024.0f + zu), hi);
                const float sl = __half2float(sh[2 * m]), su = __half2float(sh[2 * m + 1]);
#pragma unroll
                for (int nt = 0; nt < NT; nt++) {
                    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    const uint32_t b00 = nt ? x0.y : x0.x, b01 = nt ? x0.w : x0.z;
                    const uint32_t b10 = nt ? x1.y : x1.x, b11 = nt ? x1.w : x1.z;
                    mma16816(part, lo[0], hi[0], lo[1], hi[1], b00, b01);
                    mma16816(part, lo[2], hi[2], lo[3], hi[3], b10, b11);
                    acc[m][nt][0] = __fmaf_rn(sl, part[0], acc[m][nt][0]);
                    acc[m][nt][1] = __fmaf_rn(sl, part[1], acc[m][nt][1]);
                    acc[m][nt][2] = __fmaf_rn(su, part[2], acc[m][nt][2]);
                    acc[m][nt][3] = __fmaf_rn(su, part[3], acc[m][nt][3]);
                }
            }
        }
}

/* the chunks from k on of one width, at most `most` (<= A_RUN_MAX) of them: the run length the prologue left in
 * desc[k].w */
#define A_RUN_MAX 4
__device__ __forceinline__ int a_run(const int4 *desc, int k, int most) { return min(desc[k].w, most); }

/* The next batch after the one at k of n chunks: its first chunk (k + n) and count (0: the width changes there) */
template <int B>
__device__ __forceinline__ int a_next(const int4 *desc, int k, int n, int n_loc, int most) {
    return k + n < n_loc && desc[k + n].y == B ? a_run(desc, k + n, most) : 0;
}

/* The warp's chunks of width B from k on, while they last: batches of U in two sets of registers taken in turn, the
 * next batch's loads issued before this one is multiplied; returns where the width changes */
template <int B, bool GPTQ, int NT, int MB>
__device__ __forceinline__ int a_chunks(const a_lane &L, const int4 *desc, int k, int n_loc, const __half2 *xa,
                                        float (&acc)[2][NT][4]) {
    constexpr int U = a_batch<B, GPTQ, MB>::U;
    a_batch<B, GPTQ, MB> b0, b1;
    int n = a_run(desc, k, U);
    a_load<B, GPTQ, MB>(L, desc + k, n, b0);
#pragma unroll 1
    for (;;) {
        int n2 = a_next<B>(desc, k, n, n_loc, U);
        if (n2)
            a_load<B, GPTQ, MB>(L, desc + k + n, n2, b1);
        a_multiply<B, GPTQ, NT, MB>(L, b0, k, n, xa, acc);
        k += n, n = n2;
        if (!n)
            return k;
        n2 = a_next<B>(desc, k, n, n_loc, U);
        if (n2)
            a_load<B, GPTQ, MB>(L, desc + k + n, n2, b0);
        a_multiply<B, GPTQ, NT, MB>(L, b1, k, n, xa, acc);
        k += n, n = n2;
        if (!n)
            return k;
    }
}

/* the block's chunks by width: direct branches, the commonest (4 bits) first */
template <bool GPTQ, int NT, int MB>
__device__ __forceinline__ void a_all_chunks(const a_lane &L, const int4 *desc, int n_loc, const __half2 *xa,
                                             float (&acc)[2][NT][4]) {
#pragma unroll 1
    for (int k = 0; k < n_loc;) {
        const int bits = desc[k].y;
        if (bits == 4)
            k = a_chunks<4, GPTQ, NT, MB>(L, desc, k, n_loc, xa, acc);
        else if (bits == 6)
            k = a_chunks<6, GPTQ, NT, MB>(L, desc, k, n_loc, xa, acc);
        else if (bits == 8)
            k = a_chunks<8, GPTQ, NT, MB>(L, desc, k, n_loc, xa, acc);
        else if (bits == 5)
            k = a_chunks<5, GPTQ, NT, MB>(L, desc, k, n_loc, xa, acc);
        else if (bits == 3)
            k = a_chunks<3, GPTQ, NT, MB>(L, desc, k, n_loc, xa, acc);
        else
            k = a_chunks<2, GPTQ, NT, MB>(L, desc, k, n_loc, xa, acc);
    }
}

/* NT: n8 tiles (rows 1-8, 9-16); MB: the blocks an SM its registers allow (1: 255 registers, no spill; 2: 128).
 * Built as <1, 2> (up to 8 rows) and <2, 1> (9-16 rows): a_blocks_for. */
template <int NT, int MB>
__global__ void __launch_bounds__(A_THREADS, MB) qgemv_a_kernel(const __grid_constant__ gemv_args a) {
    /* [8][a_xs_stride] activation pairs (a_xs_at), [chunks_per_block] descriptors, then the chunks' scales
     * [chunks_per_block][COL_TILE] and (GPTQ) zeros, the same: a_smem_bytes */
    extern __shared__ uint4 a_smem[];
    __shared__ int is_last;
    __shared__ float inv_rms[EXL_CUDA_QGEMV_MAX_ROWS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32, g = lane / 4, t = lane % 4, R = a.rows;
    int mi = 0;
    while (mi + 1 < a.n_mats && (int)blockIdx.x >= a.m[mi].tile_end)
        mi++;
    const gemv_mat &M = a.m[mi];
    const exl_qmatrix &q = M.q;
    const int cpb = a.chunks_per_block, c0 = blockIdx.y * cpb, n_loc = max(0, min(cpb, q.n_chunks - c0));
    const int xs_stride = a_xs_stride(cpb);
    __half2 *xs = (__half2 *)a_smem;
    int4 *desc = (int4 *)(xs + 8 * xs_stride);
    const int tile_col = ((int)blockIdx.x - (mi ? a.m[mi - 1].tile_end : 0)) * COL_TILE;
    const int col = tile_col + warp * 32; /* the warp's first feature */
    const bool gptq = q.zeros != nullptr;
    __half *scs = (__half *)(desc + cpb), *zrs = scs + (int64_t)cpb * COL_TILE;
    a_lane L;
    L.w = exl_qw_col(q, col + 4 * g);
    L.ss = scs + warp * 32 + 4 * g;
    L.zs = zrs + warp * 32 + 4 * g;
    L.t = t;

    /* the chunk descriptors, each with the run of chunks of its width from it (.w, at most A_RUN_MAX) */
    for (int i = tid; i < n_loc; i += A_THREADS) {
        int4 m = __ldg(q.chunks + c0 + i);
        int run = 1;
        while (run < A_RUN_MAX && i + run < n_loc && __ldg(&q.chunks[c0 + i + run].y) == m.y)
            run++;
        m.w = run;
        desc[i] = m;
    }
    /* this thread's first activation pairs' inputs (constant tables) before the wait */
    const int n_pairs = n_loc * 16;
    int2 sp[A_PRE_PAIRS];
#pragma unroll
    for (int j = 0; j < A_PRE_PAIRS; j++)
        sp[j] = tid + j * A_THREADS < n_pairs ? slot_pair(a, q, c0, tid + j * A_THREADS) : make_int2(-1, -1);
    __syncthreads();
    /* the chunks' scales and zeros for the tile (16 bytes a copy, 32 a chunk), in flight through the gather */
    for (int i = tid; i < n_loc * (COL_TILE / 8); i += A_THREADS) {
        const int c = i / (COL_TILE / 8), p = i % (COL_TILE / 8);
        const int64_t at = (int64_t)desc[c].z * q.n_pad + tile_col + 8 * p;
        exl_cp16(exl_smem_addr(scs + c * COL_TILE + 8 * p), q.scales + at);
        if (gptq)
            exl_cp16(exl_smem_addr(zrs + c * COL_TILE + 8 * p), q.zeros + at);
    }
    exl_cp_commit();
    /* the first A_L2_CHUNKS chunks' words asked of L2 while the previous kernel ends and the activations are
     * gathered (the lanes of a t: a 128-byte row of the warp's features; all of a block's codes in q_proj's split) */
    for (int k = 0; k < n_loc && k < A_L2_CHUNKS; k++) {
        const int4 m = desc[k];
        for (int r = t; r < m.y; r += 4)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(L.w + (int64_t)(m.x + r) * EXL_QW_TILE));
    }
    exl_pdl_start();
    if (a.norm)
        a_inv_rms(a, R, inv_rms);
    for (int j = 0, i = tid; i < n_pairs; j++, i += A_THREADS) {
        const int2 s = j == 0 ? sp[0] : j == 1 ? sp[1] : j == 2 ? sp[2] : j == 3 ? sp[3] : slot_pair(a, q, c0, i);
        a_gather_pair(a, R, s, inv_rms, xs, xs_stride, i);
    }
    exl_cp_wait<0>();
    __syncthreads();

    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                acc[m][nt][e] = 0.0f;
    const __half2 *xa = xs + g * xs_stride + 8 * t;
    if (gptq)
        a_all_chunks<true, NT, MB>(L, desc, n_loc, xa, acc);
    else
        a_all_chunks<false, NT, MB>(L, desc, n_loc, xa, acc);
    if (a.kv_k && tid == 0)
        kv_prefetch(a);
    clear_later(a, A_THREADS);

    /* acc[m][nt][e]: feature col + 4g + 2m + e / 2, row 8nt + 2t + e % 2 */
    if (a.atomic_add) {
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = 8 * nt + 2 * t + e % 2, c = col + 4 * g + 2 * m + e / 2;
                    if (r < R && c < M.n_out)
                        atomicAdd(M.out + (int64_t)r * M.n_out + (a.out_map ? __ldg(a.out_map + c) : c),
                                  acc[m][nt][e] + (M.bias && blockIdx.y == 0 ? M.bias[c] : 0.0f));
                }
        return;
    }
    if (gridDim.y > 1) {
        const int64_t width = (int64_t)gridDim.x * COL_TILE;
        const int gcol = (int)blockIdx.x * COL_TILE + warp * 32 + 4 * g; /* + 2m + e / 2: in the partial sums */
#pragma unroll
        for (int m = 0; m < 2; m++)
#pragma unroll
            for (int nt = 0; nt < NT; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const int r = 8 * nt + 2 * t + e % 2;
                    if (r < R)
                        a.partial[((int64_t)blockIdx.y * R + r) * width + gcol + 2 * m + e / 2] = acc[m][nt][e];
                }
        __threadfence();
        __syncthreads();
        if (tid == 0)
            is_last = atomicAdd(&a.counters[blockIdx.x], 1u) == gridDim.y - 1;
        __syncthreads();
        if (!is_last)
            return;
        __threadfence();
        a_merge_splits(a, M, tile_col, width);
        if (tid == 0)
            a.counters[blockIdx.x] = 0;
        return;
    }
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = 8 * nt + 2 * t + e % 2, c = col + 4 * g + 2 * m + e / 2;
                if (r < R && c < M.n_out) {
                    float *dst = M.out + (int64_t)r * M.n_out + (a.out_map ? __ldg(a.out_map + c) : c);
                    *dst = (a.accumulate ? *dst : 0.0f) + acc[m][nt][e] + (M.bias ? M.bias[c] : 0.0f);
                }
            }
}

/* ---- the launch */

/* 1 if f is one wide matrix at WIDE_A_MIN_ROWS+ rows: its 128-column tiles (cuda_qmma.cu's) alone fill the SMs.
 * Default on (H100, 2026-11-28: the head at 5 / 8 / 16 rows 196 / 195 / 195 us -> 115 / 133 / 148 us);
 * EXL_CUDA_QMMA_WIDE_A=0 (read at each call, for an A/B) keeps it on cuda_qmma.cu. */
#define WIDE_A_MIN_ROWS 5
static int wide_to_a(const exl_cuda_backend *cb, const exl_cuda_fused_mm *f) {
    if (f->n != 1 || f->rows < WIDE_A_MIN_ROWS || (f->w[0]->out + 127) / 128 <= cb->n_sms)
        return 0;
    const char *e = getenv("EXL_CUDA_QMMA_WIDE_A");
    return !e || strcmp(e, "0");
}

/* the most rows whose RMSNorm a block computes itself (EXL_CUDA_GEMV_A_NORM_ROWS; more: a launch of its own first):
 * each block reads the rows whole, rows x in x 4 bytes (8 rows of a 7B model: 128 KiB a block) */
#define A_NORM_ROWS_DEFAULT 8
static int a_norm_rows = A_NORM_ROWS_DEFAULT;

/* the shared memory a block may ask for with 1 and 2 blocks an SM (0: the opt-in failed, 48 KiB) */
static int a_smem_share[3];

/* the blocks an SM of the variant that takes rows: up to 8 two (128 registers; a few reloads a batch, more in the
 * 6- and 8-bit paths), 9-16 one (two n8 tiles at 128 registers spilled a whole 4-bit batch, stored as soon as
 * loaded: the warp waited for every load) */
static int a_blocks_for(int32_t rows) { return rows > 8 ? 1 : 2; }

/* the dynamic shared memory of a block: activations, descriptors, scales (and GPTQ zeros) */
static size_t a_smem_bytes(int cpb, bool gptq) {
    return (size_t)8 * a_xs_stride(cpb) * sizeof(__half2) + (size_t)cpb * sizeof(int4) +
           (size_t)cpb * COL_TILE * sizeof(__half) * (gptq ? 2 : 1);
}

/* any of a's matrices with zeros (GPTQ) */
static bool a_gptq(const gemv_args *a) {
    bool z = false;
    for (int i = 0; i < a->n_mats; i++)
        z = z || a->m[i].q.zeros != NULL;
    return z;
}

/* A block's start (descriptors, scales, the activations: ~3 memory round trips) in the time an SM streams a chunk
 * of a tile (4 KiB at 4 bits, ~0.2 us at 1/132 of 3 TB/s) */
#define A_START_CHUNKS 8

/* The split: the one whose waves of blocks (ceil(tiles * split / slots), a_blocks_for blocks an SM) times a block's
 * time (its chunks + A_START_CHUNKS) is least, the smaller on a tie (the 7B head: 125 tiles x 2 up to 8 rows, one
 * wave; x 1 at 9-16 rows), with fewer chunks a block where its shared memory would not fit its share */
static void plan_a(const exl_cuda_backend *cb, int32_t tiles, int32_t chunks, gemv_args *a, int *split) {
    const int mb = a_blocks_for(a->rows), budget = a_smem_share[mb] > 0 ? a_smem_share[mb] : 48 * 1024;
    const int64_t slots = (int64_t)cb->n_sms * mb;
    int s = 1;
    int64_t best = -1;
    for (int c = 1; c <= chunks && c <= 4 * slots; c++) {
        const int64_t waves = ((int64_t)tiles * c + slots - 1) / slots,
                      cost = waves * ((chunks + c - 1) / c + A_START_CHUNKS);
        if (best < 0 || cost < best)
            best = cost, s = c;
    }
    int cpb = (chunks + s - 1) / s;
    while (cpb > 1 && a_smem_bytes(cpb, a_gptq(a)) > (size_t)budget)
        cpb--;
    a->chunks_per_block = cpb;
    *split = (chunks + cpb - 1) / cpb;
}

/* at backend creation: the norm rule, and each variant's share of the SM's shared memory (its blocks an SM) */
static void a_init(const exl_cuda_backend *cb) {
    const char *e = getenv("EXL_CUDA_GEMV_A_NORM_ROWS");
    a_norm_rows = e ? atoi(e) : A_NORM_ROWS_DEFAULT;
    int sm_smem = 0, reserved = 0;
    cudaFuncAttributes fa[2] = {};
    void (*const k[2])(gemv_args) = {qgemv_a_kernel<1, 2>, qgemv_a_kernel<2, 1>};
    const int blocks[2] = {2, 1};
    a_smem_share[1] = a_smem_share[2] = 0;
    int ok = cudaDeviceGetAttribute(&sm_smem, cudaDevAttrMaxSharedMemoryPerMultiprocessor, cb->device) == cudaSuccess &&
             cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, cb->device) == cudaSuccess;
    for (int i = 0; i < 2 && ok; i++)
        ok = cudaFuncGetAttributes(&fa[i], k[i]) == cudaSuccess;
    int stat = 0;
    for (int i = 0; i < 2; i++)
        stat = (int)fa[i].sharedSizeBytes > stat ? (int)fa[i].sharedSizeBytes : stat;
    for (int mb = 1; mb <= 2 && ok; mb++) {
        const int share = (sm_smem / mb - reserved - stat) / 128 * 128;
        int set = share > 0;
        for (int i = 0; i < 2 && set; i++)
            if (blocks[i] == mb)
                set = cudaFuncSetAttribute(k[i], cudaFuncAttributeMaxDynamicSharedMemorySize, share) == cudaSuccess;
        a_smem_share[mb] = set ? share : 0;
    }
    cudaGetLastError();
}

/* f's launch, planned into a (its split sums' buffers set): rows past a_norm_rows, or of a width not a multiple of
 * 4, normed first by a launch of their own (every block would read them whole) */
static void a_launch(exl_cuda_backend *cb, const exl_cuda_fused_mm *f, gemv_args *a, int split) {
    a->x = f->x;
    a->up = f->up;
    if (f->norm && (f->rows > a_norm_rows || a->in % 4)) {
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_normed, &cb->gemv_normed_bytes,
                             (size_t)EXL_CUDA_QGEMV_MAX_ROWS * a->in * sizeof(float), "GEMV normed input"))
            return;
        exl_cuda_run_rmsnorm(&cb->base, cb->gemv_normed, f->x, f->norm, f->rows, a->in, f->eps);
        a->x = cb->gemv_normed, a->norm = NULL;
    }
    const dim3 grid((unsigned)a->m[a->n_mats - 1].tile_end, (unsigned)split);
    exl_cuda_launch(cb, f->rows > 8 ? qgemv_a_kernel<2, 1> : qgemv_a_kernel<1, 2>, grid, dim3(A_THREADS),
                    a_smem_bytes(a->chunks_per_block, a_gptq(a)), *a);
    exl_cuda_check_launch(cb, "quantized GEMV (weights as A)");
}
