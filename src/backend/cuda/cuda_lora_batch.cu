/* cuda_lora_batch.cu - the lora op for decode steps of many uses (32 jobs over a few adapters; r2-lora5, issue 33;
 * the default past the fused path, EXL_CUDA_LORA_BATCH=0: off): two launches, each a wide grid of short blocks, none
 * with a long serial loop (the split path's blocks each walk a whole input row: its down-projection shrink computes
 * the GLU over 11008 inputs once per rank).
 * The uses are taken in by_adapter order (graph.h) 8 at a time, "chunks" (8 uses of one adapter, or of two or more
 * where adapters have other than multiples of 8 uses: a block then takes each adapter's run of the chunk in turn).
 *
 * shrink  block (slice of 128 inputs, chunk): before griddepcontrol.wait each warp loads its first 8 (projection,
 *         rank) pairs' A values over the slice, a float4 a lane (constant within the step: the loads overlap the
 *         kernel before); after it, warp w stages x' of the chunk's use w over the slice (x times the norm's weights,
 *         or act(x) * up: each input's GLU computed once, by one block), adding the slice's sum of squares of x to
 *         ss[u] where there is a norm; then for each pair the 8 uses' dots over the slice, summed over the warp in 9
 *         shuffles (a lane ends with one use's sum), added to t[u, o, j] atomically.
 * expand  block (tile of 256 output columns of one projection, chunk): before the wait each thread loads Bt's values
 *         at its column for the chunk's first adapter (16 ranks; more after the wait); after it, t of the chunk's uses
 *         staged (times scale_u, and 1 / RMS of the row with a norm), and each thread adds sum over j of t[u, j] *
 *         Bt[j, c] to column c of each use's row atomically (reductions: no round trip). The blocks count themselves;
 *         the last sets t, ss and its count back to zero for the next launch, which waits for this one
 *         (griddepcontrol.wait) before it adds to them.
 * A 7B layer, rank 16, 32 uses over 4 adapters: q/k/v 128 shrink and 192 expand blocks, o 128 and 64, gate/up 128
 * and 344, down 344 and 64. The sums run in fp32 as the other paths' (in another order). */
#include "backend/cuda/cuda_lora_batch.cuh"

#include <stdint.h>
#include <stdlib.h>

#define BATCH_THREADS 256
#define BATCH_WARPS (BATCH_THREADS / 32)
#define BATCH_SLICE 128       /* inputs a shrink block sums over: 4 a lane */
#define BATCH_CHUNK 8         /* uses a block takes: a warp each when the shrink stages x' */
#define BATCH_PRE 8           /* pairs a shrink warp loads at a time (the first 8 before it waits) */
#define BATCH_SHRINK_BLOCKS 2 /* shrink blocks an SM holds at once (at most 128 registers a thread; 3: spills) */
#define BATCH_EXPAND_BLOCKS 3 /* expand blocks an SM holds at once (80 registers: 7B gate/up in one wave) */
#define BATCH_BT_PRE 16       /* ranks of Bt an expand thread loads before it waits */
#define BATCH_MAX_RANK 256    /* a chunk's staged t: 8 KB */
#define BATCH_MAX_USES 256    /* more (prompts): the split path */

static_assert(BATCH_WARPS == BATCH_CHUNK, "a shrink warp stages one use of the chunk");
static_assert(BATCH_SLICE == 4 * 32, "a shrink lane takes 4 inputs of the slice");

enum { BATCH_PLAIN, BATCH_NORM, BATCH_GLU };

/* a chunk's uses (by_adapter order): use, row, adapter slot and scale of each, shared by the block */
struct batch_chunk {
    int32_t use[BATCH_CHUNK], row[BATCH_CHUNK], slot[BATCH_CHUNK], n;
    float scale[BATCH_CHUNK];
};

/* threads 0..7 fill ch with chunk c's uses (the tables are constant within the step); the caller syncs */
static __device__ __forceinline__ void chunk_load(const exl_lora_node &n, int32_t c, batch_chunk &ch) {
    const int32_t *order = n.by_adapter + 2 + n.n_uses, first = c * BATCH_CHUNK, i = (int32_t)threadIdx.x;
    if (i == 0)
        ch.n = min(BATCH_CHUNK, n.n_uses - first);
    if (i < BATCH_CHUNK && first + i < n.n_uses) {
        const int32_t u = __ldg(order + first + i), row = __ldg(n.use_row + u);
        ch.use[i] = u, ch.row[i] = row, ch.slot[i] = __ldg(n.use_slot + u), ch.scale[i] = __ldg(n.use_scale + u);
    }
}

/* the end of the chunk's run of uses of one adapter that starts at entry b */
static __device__ __forceinline__ int32_t run_end(const batch_chunk &ch, int32_t b) {
    int32_t e = b + 1;
    while (e < ch.n && ch.slot[e] == ch.slot[b])
        e++;
    return e;
}

/* pair p of an adapter's (projection, rank) pairs, the projections' ranks one after another: its A row from input
 * k0, with its projection o and rank j (NULL past the pairs) */
static __device__ __forceinline__ const float *pair_row(const exl_lora_node &n, int32_t slot, int32_t p, int32_t k0,
                                                        int32_t &o, int32_t &j) {
    for (o = 0; o < n.n_out; o++) {
        const exl_lora_factors f = n.factors[o][slot];
        if (p < f.rank) {
            j = p;
            return f.a + (int64_t)p * n.in_features + k0;
        }
        p -= f.rank;
    }
    j = 0;
    return NULL;
}

/* p[k .. k + 4) as a float4, zero at and past len: one 16-byte load where aligned and whole; CONST: data constant
 * within the step (the read-only path), else written by the kernels before (from L2) */
template <bool CONST>
static __device__ __forceinline__ float4 load4(const float *p, int32_t k, int32_t len) {
    if (k + 4 <= len && ((uintptr_t)(p + k) & 15) == 0)
        return CONST ? __ldg((const float4 *)(p + k)) : __ldcg((const float4 *)(p + k));
    float v[4];
#pragma unroll
    for (int e = 0; e < 4; e++)
        v[e] = k + e < len ? (CONST ? __ldg(p + k + e) : __ldcg(p + k + e)) : 0.0f;
    return make_float4(v[0], v[1], v[2], v[3]);
}

static __device__ __forceinline__ float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

static __device__ __forceinline__ float batch_warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* v[0..8) of every lane summed over the warp, halving the values a lane holds at each of the first three steps (4,
 * 2, 1 shuffles, then 2 more): lane l ends with the sum of v[(l >> 2) & 7] */
static __device__ __forceinline__ float warp_sum8(float (&v)[8], int lane) {
    const bool h4 = lane & 16, h3 = lane & 8, h2 = lane & 4;
#pragma unroll
    for (int i = 0; i < 4; i++) /* lanes 16-31 keep v[4..8), 0-15 v[0..4) */
        v[i] = (h4 ? v[i + 4] : v[i]) + __shfl_xor_sync(0xffffffffu, h4 ? v[i] : v[i + 4], 16);
#pragma unroll
    for (int i = 0; i < 2; i++)
        v[i] = (h3 ? v[i + 2] : v[i]) + __shfl_xor_sync(0xffffffffu, h3 ? v[i] : v[i + 2], 8);
    float s = (h2 ? v[1] : v[0]) + __shfl_xor_sync(0xffffffffu, h2 ? v[0] : v[1], 4);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    return s + __shfl_xor_sync(0xffffffffu, s, 1);
}

/* grid (slices of BATCH_SLICE inputs, chunks); t and ss zero on entry but for this launch's adds */
template <int MODE>
__global__ void __launch_bounds__(BATCH_THREADS, BATCH_SHRINK_BLOCKS)
    lora_batch_shrink(exl_lora_node n, const float *norm_w, float *t, float *ss) {
    __shared__ batch_chunk ch;
    __shared__ float4 xs[BATCH_CHUNK][32];
    const int32_t k0 = (int32_t)blockIdx.x * BATCH_SLICE, len = min(BATCH_SLICE, n.in_features - k0);
    const int warp = (int)threadIdx.x >> 5, lane = (int)threadIdx.x & 31, kl = 4 * lane;
    chunk_load(n, (int32_t)blockIdx.y, ch);
    __syncthreads();
    float4 pre[BATCH_PRE]; /* the chunk's first adapter: this warp's first pairs */
#pragma unroll
    for (int i = 0; i < BATCH_PRE; i++) {
        int32_t o, j;
        const float *a = pair_row(n, ch.slot[0], warp + i * BATCH_WARPS, k0, o, j);
        pre[i] = a ? load4<true>(a, kl, len) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    const float4 w = MODE == BATCH_NORM ? load4<true>(norm_w + k0, kl, len) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    exl_pdl_trigger();
    exl_pdl_wait();
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (warp < ch.n) { /* x' of use `warp` over the slice */
        const int64_t row = (int64_t)ch.row[warp] * n.in_features + k0;
        v = load4<false>(n.x + row, kl, len);
        if (MODE == BATCH_NORM) {
            const float q = batch_warp_sum(dot4(v, v));
            if (lane == 0)
                atomicAdd(ss + ch.use[warp], q);
            v = make_float4(v.x * w.x, v.y * w.y, v.z * w.z, v.w * w.w);
        } else if (MODE == BATCH_GLU) {
            const float4 up = load4<false>(n.up + row, kl, len);
            v = make_float4(exl_cuda_activate(v.x, n.act) * up.x, exl_cuda_activate(v.y, n.act) * up.y,
                            exl_cuda_activate(v.z, n.act) * up.z, exl_cuda_activate(v.w, n.act) * up.w);
        }
    }
    xs[warp][lane] = v;
    __syncthreads();
    float4 x[BATCH_CHUNK];
#pragma unroll
    for (int uu = 0; uu < BATCH_CHUNK; uu++)
        x[uu] = xs[uu][lane];
    const int32_t mine = (lane >> 2) & 7; /* the use whose sums this lane ends with */
    for (int32_t b = 0; b < ch.n;) {
        const int32_t e = run_end(ch, b), slot = ch.slot[b];
        for (int32_t i0 = 0;; i0 += BATCH_PRE) { /* BATCH_PRE pairs of the warp at a time, their loads together */
            if (b > 0 || i0 > 0) {               /* pre holds the first BATCH_PRE pairs of the first run */
#pragma unroll
                for (int i = 0; i < BATCH_PRE; i++) {
                    int32_t o, j;
                    const float *row = pair_row(n, slot, warp + (i0 + i) * BATCH_WARPS, k0, o, j);
                    pre[i] = row ? load4<true>(row, kl, len) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                }
            }
            int more = 1;
#pragma unroll
            for (int i = 0; i < BATCH_PRE; i++) {
                int32_t o, j;
                if (!pair_row(n, slot, warp + (i0 + i) * BATCH_WARPS, k0, o, j)) {
                    more = 0;
                    break;
                }
                float acc[BATCH_CHUNK];
#pragma unroll
                for (int uu = 0; uu < BATCH_CHUNK; uu++)
                    acc[uu] = dot4(pre[i], x[uu]);
                const float s = warp_sum8(acc, lane);
                if ((lane & 3) == 0 && mine >= b && mine < e)
                    atomicAdd(t + ((int64_t)ch.use[mine] * n.n_out + o) * n.max_rank + j, s);
            }
            if (!more)
                break;
        }
        b = e;
    }
}

/* grid (tiles of BATCH_THREADS columns, each projection's starting at a tile; chunks); count: zero on entry. The
 * updates are added atomically (reductions: no round trip; a load and a store for a row's only use measured no
 * faster, bench/RESULTS.md). */
template <int NORM>
__global__ void __launch_bounds__(BATCH_THREADS, BATCH_EXPAND_BLOCKS)
    lora_batch_expand(exl_lora_node n, float *t, float *ss, unsigned *count) {
    __shared__ batch_chunk ch;
    __shared__ float ts[BATCH_CHUNK * BATCH_MAX_RANK];
    __shared__ int last;
    int32_t tile = (int32_t)blockIdx.x, o = 0;
    while (o < n.n_out - 1 && tile >= (n.out_features[o] + BATCH_THREADS - 1) / BATCH_THREADS)
        tile -= (n.out_features[o++] + BATCH_THREADS - 1) / BATCH_THREADS;
    const int32_t width = n.out_features[o], c = tile * BATCH_THREADS + (int32_t)threadIdx.x;
    chunk_load(n, (int32_t)blockIdx.y, ch);
    __syncthreads();
    float bv[BATCH_BT_PRE]; /* Bt at column c, the chunk's first adapter */
    exl_lora_factors f = n.factors[o][ch.slot[0]];
#pragma unroll
    for (int j = 0; j < BATCH_BT_PRE; j++)
        bv[j] = j < f.rank && c < width ? __ldg(f.bt + (int64_t)j * width + c) : 0.0f;
    exl_pdl_trigger();
    exl_pdl_wait();
    for (int32_t i = (int32_t)threadIdx.x; i < ch.n * n.max_rank; i += BATCH_THREADS) {
        const int32_t uu = i / n.max_rank, j = i % n.max_rank, u = ch.use[uu];
        float s = __ldcg(t + ((int64_t)u * n.n_out + o) * n.max_rank + j) * ch.scale[uu];
        if (NORM)
            s *= rsqrtf(__ldcg(ss + u) / n.in_features + n.eps);
        ts[i] = s;
    }
    __syncthreads(); /* the block's reads of t and ss are done: it counts itself */
    unsigned arrived = 0;
    if (threadIdx.x == 0)
        arrived = atomicAdd(count, 1u);
    for (int32_t b = 0; b < ch.n && c < width;) {
        const int32_t e = run_end(ch, b);
        if (b > 0) {
            f = n.factors[o][ch.slot[b]];
#pragma unroll
            for (int j = 0; j < BATCH_BT_PRE; j++)
                bv[j] = j < f.rank ? __ldg(f.bt + (int64_t)j * width + c) : 0.0f;
        }
        float acc[BATCH_CHUNK];
#pragma unroll
        for (int uu = 0; uu < BATCH_CHUNK; uu++)
            acc[uu] = 0.0f;
#pragma unroll
        for (int j = 0; j < BATCH_BT_PRE; j++)
            if (j < f.rank)
#pragma unroll
                for (int uu = 0; uu < BATCH_CHUNK; uu++)
                    acc[uu] += ts[uu * n.max_rank + j] * bv[j];
        for (int32_t j = BATCH_BT_PRE; j < f.rank; j++) {
            const float bj = __ldg(f.bt + (int64_t)j * width + c);
#pragma unroll
            for (int uu = 0; uu < BATCH_CHUNK; uu++)
                acc[uu] += ts[uu * n.max_rank + j] * bj;
        }
        float *out = n.out[o] + c;
#pragma unroll
        for (int uu = 0; uu < BATCH_CHUNK; uu++)
            if (uu >= b && uu < e)
                atomicAdd(out + (int64_t)ch.row[uu] * width, acc[uu]);
        b = e;
    }
    if (threadIdx.x == 0)
        last = arrived == gridDim.x * gridDim.y - 1;
    __syncthreads();
    if (!last)
        return;
    __threadfence();
    const int64_t nt = (int64_t)n.n_uses * n.n_out * n.max_rank;
    for (int64_t i = threadIdx.x; i < nt + n.n_uses; i += BATCH_THREADS)
        (i < nt ? t[i] : ss[i - nt]) = 0.0f;
    if (threadIdx.x == 0)
        *count = 0;
}

int exl_cuda_lora_scratch(exl_cuda_backend *cb, const exl_lora_node *n, float **t, float **ss, unsigned **sync) {
    const int64_t t_floats = (int64_t)n->n_uses * n->n_out * n->max_rank;
    const size_t bytes = 256 + (size_t)(t_floats + n->n_uses) * sizeof(float);
    if (bytes > cb->lora_sums_bytes) {
        if (!exl_cuda_ensure(cb, &cb->lora_sums, &cb->lora_sums_bytes, bytes, "LoRA sums"))
            return 0;
        if (cudaMemsetAsync(cb->lora_sums, 0, bytes, cb->stream) != cudaSuccess) { /* counters and sums start at 0 */
            exl_cuda_check_launch(cb, "LoRA counters");
            return 0;
        }
    }
    *sync = (unsigned *)cb->lora_sums;
    *t = (float *)((char *)cb->lora_sums + 256);
    *ss = *t + t_floats;
    return 1;
}

int exl_cuda_lora_batch_on(void) {
    const char *e = getenv("EXL_CUDA_LORA_BATCH");
    return !(e && *e && atoi(e) == 0);
}

int exl_cuda_lora_batch_fits(const exl_lora_node *n) {
    return n->by_adapter && n->max_rank <= BATCH_MAX_RANK && n->n_uses <= BATCH_MAX_USES;
}

void exl_cuda_lora_batch_shrink(exl_cuda_backend *cb, const exl_lora_node *n, float *t, float *ss, cudaStream_t stream,
                                int pdl) {
    const unsigned chunks = (unsigned)((n->n_uses + BATCH_CHUNK - 1) / BATCH_CHUNK);
    const dim3 grid((unsigned)((n->in_features + BATCH_SLICE - 1) / BATCH_SLICE), chunks), block(BATCH_THREADS);
    const float *norm_w = n->norm ? n->norm->v : NULL;
    if (n->norm)
        exl_cuda_launch_on(cb, stream, pdl, lora_batch_shrink<BATCH_NORM>, grid, block, 0, *n, norm_w, t, ss);
    else if (n->up)
        exl_cuda_launch_on(cb, stream, pdl, lora_batch_shrink<BATCH_GLU>, grid, block, 0, *n, norm_w, t, ss);
    else
        exl_cuda_launch_on(cb, stream, pdl, lora_batch_shrink<BATCH_PLAIN>, grid, block, 0, *n, norm_w, t, ss);
    exl_cuda_check_launch(cb, "lora batch shrink");
}

void exl_cuda_lora_batch_expand(exl_cuda_backend *cb, const exl_lora_node *n, float *t, float *ss, unsigned *sync) {
    int32_t tiles = 0;
    for (int32_t o = 0; o < n->n_out; o++)
        tiles += (n->out_features[o] + BATCH_THREADS - 1) / BATCH_THREADS;
    const dim3 grid((unsigned)tiles, (unsigned)((n->n_uses + BATCH_CHUNK - 1) / BATCH_CHUNK));
    if (n->norm)
        exl_cuda_launch(cb, lora_batch_expand<1>, grid, dim3(BATCH_THREADS), 0, *n, t, ss, sync);
    else
        exl_cuda_launch(cb, lora_batch_expand<0>, grid, dim3(BATCH_THREADS), 0, *n, t, ss, sync);
    exl_cuda_check_launch(cb, "lora batch expand");
}

void exl_cuda_lora_batch(exl_cuda_backend *cb, const exl_lora_node *n) {
    float *t, *ss;
    unsigned *sync;
    if (!exl_cuda_lora_scratch(cb, n, &t, &ss, &sync))
        return;
    exl_cuda_lora_batch_shrink(cb, n, t, ss, cb->stream, 1);
    exl_cuda_lora_batch_expand(cb, n, t, ss, sync);
}
