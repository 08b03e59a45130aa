/* cuda_qgemv_a.cuh - the few-row GEMV with the weights as the tensor cores' A operand (qgemv_a_kernel), part of
 * cuda_qgemv.cu (included there: it shares gemv_args, the activation gather and the split merge).
 *
 * 2 .. EXL_CUDA_QGEMV_MAX_ROWS rows (EXL_CUDA_GEMV_A=1, rows EXL_CUDA_GEMV_A_ROWS): the decoded weights are the m16
 * operand of mma.m16n8k16 (16 output features x 16 inputs) and the rows the n8 operand (rows 9-16 a second n8
 * tile), so a decoded weight feeds one mma for up to 8 rows and the work a weight is flat in the rows, where
 * qgemv_mma_kernel (rows as the m16 operand) decodes the same weights for the B operand and pays per row for a full
 * m16 tile. A block covers one column tile (256 features) over its range of chunks; warp w takes features 32w ..
 * 32w + 31 as two m16 tiles. Which feature is which row of the m16 tile is free: lane (g, t) takes features 4g ..
 * 4g + 3 (m16 tile m: row g feature 4g + 2m, row g + 8 feature 4g + 2m + 1), so that in the column-tile layout
 * (exl_qw_col: a chunk's word row holds one 32-bit word a feature) its A fragments are 16-byte loads straight from
 * global memory, with no staging and no repacked copy: quarter t (pairs 4t .. 4t + 3, cuda_qdecode.cuh) of its four
 * features, at 4 bits word row t (the warp's load: 4 whole 128-byte rows), at 2 and 8 bits one and two rows, at 6
 * bits the four rows under the quarter (qgemv_mma_kernel's trick), at 3 and 5 bits all b rows; the scales (and
 * GPTQ zeros) of the four features are one 8-byte load. The mma's k pairs are chunk pairs in the order the loads
 * give them: k step s of a chunk takes chunk pairs 4t + 2s (mma pair t) and 4t + 2s + 1 (mma pair t + 4), for A and
 * B alike, which is the order the activation gather (mma_xs_at) already stores: rows g and g + 8 of pairs 4t ..
 * 4t + 3 in two 16-byte loads serve both n8 tiles and both m16 tiles.
 *
 * Memory in flight: a warp loads its chunks in batches of one width (a_batch_chunks; the run lengths are in the
 * descriptors), the next batch's loads issued before it multiplies this one: 2-4 KiB a warp at 4 bits, 32-64 KiB an
 * SM with two 8-warp blocks (MB 2, up to 8 rows), half that with one (MB 1: EXL_CUDA_GEMV_A_BLOCKS_PER_SM=1, and
 * 9-16 rows, whose second n8 tile needs the registers). The chunk descriptors of the block are read into shared
 * memory and each warp's first A_L2_CHUNKS chunks asked of L2 before griddepcontrol.wait (weights are constant),
 * while the earlier kernel ends and the activations are gathered.
 * Zeros are exact as in every kernel here ((1024 + q) - (1024 + z) in fp16); products are summed in fp32 by the
 * mma for a chunk and scaled per chunk and feature in fp32. Splits, atomic adds, the merge, the norm and GLU of the
 * input, slot order, the residual add, bias, clears and KV prefetch are qgemv_mma_kernel's (same arguments). The
 * scales (and zeros) of the block's chunks are copied into shared memory with cp.async while the activations are
 * gathered (a chunk's 256, 512 bytes; 1/8 of a 4-bit chunk's codes, mostly L2 hits), out of the batches' registers. */

#define A_WARPS (COL_TILE / 32) /* a warp per 32 features of the column tile */
#define A_THREADS (A_WARPS * 32)
#define A_L2_CHUNKS 8 /* chunks a warp asks L2 for before griddepcontrol.wait */

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
 * nt (rows 8nt ..); the batch's first chunk is the block's chunk k; xa: the activation pairs of chunk 0 (mma_xs_at,
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

/* NT: n8 tiles (rows 1-8, 9-16); MB: the blocks an SM its registers allow (1: 255 registers, no spill; 2: 128) */
template <int NT, int MB>
__global__ void __launch_bounds__(A_THREADS, MB) qgemv_a_kernel(const __grid_constant__ gemv_args a) {
    /* [8][mma_xs_stride] activation pairs (mma_xs_at), [chunks_per_block] descriptors, then the chunks' scales
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
    const int xs_stride = mma_xs_stride(cpb);
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
    int2 sp[MMA_PRE_PAIRS];
#pragma unroll
    for (int j = 0; j < MMA_PRE_PAIRS; j++)
        sp[j] = tid + j * A_THREADS < n_pairs ? slot_pair(a, q, c0, tid + j * A_THREADS) : make_int2(-1, -1);
    __syncthreads();
    /* the chunks' scales and zeros for the tile (16 bytes a copy, 32 a chunk), in flight through the gather */
    for (int i = tid; i < n_loc * (COL_TILE / 8); i += A_THREADS) {
        const int c = i / (COL_TILE / 8), p = i % (COL_TILE / 8);
        const int64_t at = (int64_t)desc[c].z * q.n_pad + tile_col + 8 * p;
        cp_async16(smem_addr(scs + c * COL_TILE + 8 * p), q.scales + at);
        if (gptq)
            cp_async16(smem_addr(zrs + c * COL_TILE + 8 * p), q.zeros + at);
    }
    cp_async_commit();
    /* the first A_L2_CHUNKS chunks' words asked of L2 while the previous kernel ends and the activations are
     * gathered (the lanes of a t: a 128-byte row of the warp's features; all of a block's codes in q_proj's split) */
    for (int k = 0; k < n_loc && k < A_L2_CHUNKS; k++) {
        const int4 m = desc[k];
        for (int r = t; r < m.y; r += 4)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(L.w + (int64_t)(m.x + r) * EXL_QW_TILE));
    }
    exl_pdl_start();
    if (a.norm)
        mma_inv_rms(a, R, A_THREADS, inv_rms);
    for (int j = 0, i = tid; i < n_pairs; j++, i += A_THREADS) {
        const int2 s = j == 0 ? sp[0] : j == 1 ? sp[1] : j == 2 ? sp[2] : j == 3 ? sp[3] : slot_pair(a, q, c0, i);
        mma_gather_pair(a, R, s, inv_rms, xs, xs_stride, i);
    }
    cp_async_wait<0>();
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
        mma_merge_splits<1>(a, M, tile_col, width);
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
