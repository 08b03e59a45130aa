/* cuda_lora.cu - the lora op (graph.h): gathered low-rank updates, Punica / S-LoRA style, for 1-3 projections of one
 * input, x' being the input normed or through the GLU on the way where the node says so (the matmuls beside then keep
 * their fusions with the norm and the GLU). One-row decode steps do not come here at all where the plan folds the
 * node into the GEMV of its projections (cuda_lora_fold.cuh; EXL_CUDA_LORA_GEMV=0: not). Three paths, whatever the
 * mix of adapters in the step:
 *
 * fused (decode steps: at most EXL_CUDA_LORA_FUSED_USES uses, default 4, ranks up to 256, and not
 *   EXL_CUDA_DETERMINISTIC), one launch: a block per (use u, span of output columns of one projection o, group of
 *   ranks j). Its warps split the group's dot products t[j] = scale_u * x'[row_u] · A_o,slot(u)[j] over ranks and
 *   input features (float4 loads, a lane's loads in flight together; the norm's sum of squares comes along in the
 *   same loop), then its threads add sum over j of t[j] * Bt_o[j, c] to the span's columns c, 4 a thread at a time,
 *   with atomics (plain adds where the block is the only one adding to them). Every span recomputes its group's t:
 *   no second launch, no scratch, one block-wide exchange. Up to 4 uses (batch 1): groups of 4 ranks (2 for inputs
 *   wider than 8192) and spans of 1024 columns, the most blocks; more uses: all ranks in one group and spans of 1024
 *   columns for each 4 uses, bounding the rereads of A and the atomics. Before it waits for the kernel before (PDL),
 *   a block asks L2 for its factors (constant within a step; ~160 MB fp32 for rank 16 on a 7B model, not resident
 *   between steps). A decode step's update of a group is one launch of a few microseconds instead of two
 *   latency-bound ones (bench/LOG.md).
 * batch (past the fused path, up to 256 uses, the node's by_adapter given, not EXL_CUDA_DETERMINISTIC; off with
 *   EXL_CUDA_LORA_BATCH=0: cuda_lora_batch.cu), two launches of wide grids of short blocks: shrink split over slices
 *   of the input and chunks of 8 uses, expand over column tiles; with EXL_CUDA_LORA_OVERLAP (default 1) the plan runs
 *   the shrink on a second stream beside a matmul (cuda_lora_overlap.cu).
 * split (the rest: more uses, EXL_CUDA_LORA_BATCH=0, or a fixed summation order), two launches:
 *   shrink  one block per (use, projection and rank index): t[u, o, j] = scale_u * x'[row_u] · A_o,slot(u)[j], a
 *           block-wide dot product over the input features (ranks past the adapter's own give 0);
 *   expand  one thread per (row, output column of the projections side by side): out_o[r, c] += sum over r's uses u,
 *           j < rank of t[u, o, j] * Bt_o[j, c], reading Bt's rows along the columns (coalesced), every use of a row
 *           in one thread (no atomics: the result does not depend on the order blocks run in). */
#include "backend/cuda/cuda_internal.h"
#include "backend/cuda/cuda_lora_batch.cuh"

#include <stdint.h>
#include <stdlib.h>

#define SHRINK_THREADS 256
#define EXPAND_THREADS 256

/* the block's sum of v (every thread gets it) */
__device__ __forceinline__ float block_sum(float v, float *warp_sums) {
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads(); /* warp_sums may still be read from a sum before */
    if ((threadIdx.x & 31) == 0)
        warp_sums[threadIdx.x >> 5] = v;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < SHRINK_THREADS / 32; w++)
        total += warp_sums[w];
    return total;
}

/* norm_w: the norm's weights on the device when the node has a norm */
__global__ void __launch_bounds__(SHRINK_THREADS) lora_shrink_kernel(exl_lora_node n, const float *norm_w) {
    exl_pdl_start();
    __shared__ float warp_sums[SHRINK_THREADS / 32];
    const int32_t u = blockIdx.x, o = blockIdx.y / n.max_rank, j = blockIdx.y % n.max_rank;
    float *t = n.t + ((int64_t)u * n.n_out + o) * n.max_rank + j;
    const exl_lora_factors f = n.factors[o][n.use_slot[u]];
    if (j >= f.rank) {
        if (threadIdx.x == 0)
            *t = 0.0f;
        return;
    }
    const int64_t row = (int64_t)n.use_row[u] * n.in_features;
    const float *xr = n.x + row, *a = f.a + (int64_t)j * n.in_features;
    float s = 0.0f, ss = 0.0f;
    for (int32_t i = threadIdx.x; i < n.in_features; i += SHRINK_THREADS) {
        float v = xr[i];
        if (norm_w) {
            ss += v * v;
            v *= norm_w[i];
        } else if (n.up) {
            v = exl_cuda_activate(v, n.act) * n.up[row + i];
        }
        s += v * a[i];
    }
    float total = block_sum(s, warp_sums);
    if (norm_w)
        total *= rsqrtf(block_sum(ss, warp_sums) / n.in_features + n.eps);
    if (threadIdx.x == 0)
        *t = total * n.use_scale[u];
}

__global__ void __launch_bounds__(EXPAND_THREADS) lora_expand_kernel(exl_lora_node n) {
    exl_pdl_start();
    const int32_t r = blockIdx.y;
    int32_t c = blockIdx.x * EXPAND_THREADS + threadIdx.x, o = 0;
    while (o < n.n_out && c >= n.out_features[o])
        c -= n.out_features[o++];
    if (o >= n.n_out)
        return;
    const int32_t width = n.out_features[o];
    float acc = 0.0f;
    for (int32_t u = n.row_uses[r]; u < n.row_uses[r + 1]; u++) {
        const exl_lora_factors f = n.factors[o][n.use_slot[u]];
        const float *tu = n.t + ((int64_t)u * n.n_out + o) * n.max_rank;
        for (int32_t j = 0; j < f.rank; j++)
            acc += tu[j] * f.bt[(int64_t)j * width + c];
    }
    n.out[o][(int64_t)r * width + c] += acc;
}

/* ---- the fused path */

#define FUSED_THREADS 256
#define FUSED_WARPS (FUSED_THREADS / 32)
#define FUSED_COLS 4 /* output columns a thread */
#define FUSED_TILE (FUSED_THREADS * FUSED_COLS)
#define FUSED_MAX_USES \
    4 /* default of EXL_CUDA_LORA_FUSED_USES (32 uses: 0.48 of no adapter fused, 0.73 in two launches) */
#define FUSED_MAX_RANK 256  /* adapters of higher rank take the two launches */
#define FUSED_USES_A_TILE 4 /* a block a tile for up to 4 uses, 2 tiles for up to 8, ... */

enum { INPUT_PLAIN, INPUT_NORM, INPUT_GLU };

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

/* the block asks L2 for the n floats at p (a request a 128-byte line) */
__device__ __forceinline__ void prefetch_l2(const float *p, int64_t n) {
    for (int64_t i = (int64_t)threadIdx.x * 32; i < n; i += (int64_t)FUSED_THREADS * 32)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
}

/* x' at one feature: x itself, x * norm_w (ss += x^2), or act(x) * up */
template <int MODE>
__device__ __forceinline__ float input_at(float x, float w, int act, float &ss) {
    if (MODE == INPUT_NORM) {
        ss += x * x;
        return x * w;
    }
    if (MODE == INPUT_GLU)
        return exl_cuda_activate(x, act) * w;
    return x;
}

/* one lane's share of x' · a over features first, first + step, ... (in float4 units where vec); ss as input_at */
template <int MODE>
__device__ __forceinline__ float lane_dot(const float *__restrict__ x, const float *__restrict__ w,
                                          const float *__restrict__ a, int32_t in, int act, int vec, int32_t first,
                                          int32_t step, float &ss) {
    float s = 0.0f;
    if (vec) {
        const float4 *__restrict__ x4 = (const float4 *)x, *__restrict__ w4 = (const float4 *)w;
        const float4 *__restrict__ a4 = (const float4 *)a;
#pragma unroll 4
        for (int32_t i = first; i < in / 4; i += step) {
            const float4 xv = x4[i], av = a4[i];
            const float4 wv = MODE == INPUT_PLAIN ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : w4[i];
            s += input_at<MODE>(xv.x, wv.x, act, ss) * av.x + input_at<MODE>(xv.y, wv.y, act, ss) * av.y +
                 input_at<MODE>(xv.z, wv.z, act, ss) * av.z + input_at<MODE>(xv.w, wv.w, act, ss) * av.w;
        }
        return s;
    }
#pragma unroll 4
    for (int32_t i = first; i < in; i += step)
        s += input_at<MODE>(x[i], MODE == INPUT_PLAIN ? 0.0f : w[i], act, ss) * a[i];
    return s;
}

/* grid (n_uses, spans of `span` columns of the projections side by side, groups of rg ranks: 1, 2, 4, 8 or a multiple
 * of 8, at most FUSED_MAX_RANK); with rg <= 8 warp w computes rank j0 + w % rg over part w / rg of the features, with
 * more ranks w, w + 8, ... over all of them; then the block adds the group's update to its span, 1024 columns (4 a
 * thread) at a time: with atomics, or plainly where it is the only block adding to those columns (one group, the
 * row's only use) */
template <int MODE>
__global__ void __launch_bounds__(FUSED_THREADS)
    lora_fused_kernel(exl_lora_node n, const float *norm_w, int32_t rg, int32_t span) {
    exl_pdl_trigger();
    __shared__ float dots[FUSED_MAX_RANK], sums[FUSED_WARPS], ts[FUSED_MAX_RANK];
    const int32_t u = blockIdx.x, j0 = (int32_t)blockIdx.z * rg;
    int32_t at = blockIdx.y, o = 0;
    while (o < n.n_out && at >= (n.out_features[o] + span - 1) / span)
        at -= (n.out_features[o++] + span - 1) / span;
    /* the step's use table and the factors are constant within the step: their reads, and the factors' way from
     * memory to L2, may overlap the kernel before; every block waits for it all the same (one that did not could let
     * the kernel after run before the one before has finished) */
    const exl_lora_factors f = o < n.n_out ? n.factors[o][n.use_slot[u]] : exl_lora_factors{NULL, NULL, 0, 0};
    const int32_t nj = min(rg, f.rank - j0), width = o < n.n_out ? n.out_features[o] : 0;
    const int32_t end = min(width, (at + 1) * span);
    if (nj > 0) {
        prefetch_l2(f.a + (int64_t)j0 * n.in_features, (int64_t)nj * n.in_features);
        for (int32_t jj = 0; jj < nj; jj++)
            prefetch_l2(f.bt + (int64_t)(j0 + jj) * width + at * span, end - at * span);
    }
    exl_pdl_wait();
    if (nj <= 0)
        return;
    const int64_t row = n.use_row[u];
    const int alone = gridDim.z == 1 && n.row_uses[row + 1] - n.row_uses[row] == 1;
    const int32_t warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slots = min(rg, FUSED_WARPS);
    const int32_t parts = FUSED_WARPS / slots, part = warp / slots;
    const float *x = n.x + row * n.in_features;
    const float *w = MODE == INPUT_NORM ? norm_w : MODE == INPUT_GLU ? n.up + row * n.in_features : x;
    for (int32_t j = warp % slots; j < nj; j += FUSED_WARPS) {
        const float *a = f.a + (int64_t)(j0 + j) * n.in_features;
        const int vec = n.in_features % 4 == 0 && (((uintptr_t)x | (uintptr_t)w | (uintptr_t)a) & 15) == 0;
        float ss = 0.0f;
        float s = warp_sum(lane_dot<MODE>(x, w, a, n.in_features, n.act, vec, part * 32 + lane, parts * 32, ss));
        if (lane == 0)
            dots[part * rg + j] = s;
        if (MODE == INPUT_NORM && j == 0) { /* the row's sum of squares: rank 0's warps, a part each */
            ss = warp_sum(ss);
            if (lane == 0)
                sums[part] = ss;
        }
    }
    __syncthreads();
    for (int32_t j = threadIdx.x; j < nj; j += FUSED_THREADS) {
        float scale = n.use_scale[u], t = 0.0f, total = 0.0f;
        for (int32_t p = 0; p < parts; p++)
            t += dots[p * rg + j], total += MODE == INPUT_NORM ? sums[p] : 0.0f;
        if (MODE == INPUT_NORM)
            scale *= rsqrtf(total / n.in_features + n.eps);
        ts[j] = t * scale;
    }
    __syncthreads();
    const float *__restrict__ bt = f.bt + (int64_t)j0 * width;
    float *out = n.out[o] + row * width;
    for (int32_t c0 = at * span + threadIdx.x; c0 < end; c0 += FUSED_TILE) {
        float acc[FUSED_COLS];
#pragma unroll
        for (int k = 0; k < FUSED_COLS; k++)
            acc[k] = 0.0f;
        for (int32_t jj = 0; jj < nj; jj++) {
            const float tj = ts[jj];
#pragma unroll
            for (int k = 0; k < FUSED_COLS; k++) {
                const int32_t c = c0 + k * FUSED_THREADS;
                if (c < end)
                    acc[k] += tj * bt[(int64_t)jj * width + c];
            }
        }
#pragma unroll
        for (int k = 0; k < FUSED_COLS; k++)
            if (c0 + k * FUSED_THREADS < end) {
                if (alone)
                    out[c0 + k * FUSED_THREADS] += acc[k];
                else
                    atomicAdd(&out[c0 + k * FUSED_THREADS], acc[k]);
            }
    }
}

/* EXL_CUDA_LORA_FUSED_USES: steps with at most this many uses take the fused path (0: never); read at each call (a
 * captured step does not call again), so that a benchmark may compare the paths */
static int32_t fused_max_uses(void) {
    const char *e = getenv("EXL_CUDA_LORA_FUSED_USES");
    const int32_t max = e && *e ? atoi(e) : FUSED_MAX_USES;
    return max < 0 ? 0 : max;
}

static void run_fused(exl_cuda_backend *cb, const exl_lora_node *n) {
    int32_t rg, span;
    if (n->n_uses <= FUSED_USES_A_TILE) { /* the most blocks: 4 ranks a block (2 for inputs wider than 8192) */
        rg = n->in_features > 8192 ? 2 : 4;
        while (rg > 1 && rg / 2 >= n->max_rank)
            rg /= 2;
        span = FUSED_TILE;
    } else { /* the fewest reads and atomics: all ranks in a block, spans of a tile for each 4 uses */
        rg = 1;
        while (rg < n->max_rank && rg < FUSED_WARPS)
            rg *= 2;
        rg = rg < n->max_rank ? (n->max_rank + FUSED_WARPS - 1) / FUSED_WARPS * FUSED_WARPS : rg;
        span = FUSED_TILE * (1 + (n->n_uses - 1) / FUSED_USES_A_TILE);
    }
    int32_t spans = 0;
    for (int32_t o = 0; o < n->n_out; o++)
        spans += (n->out_features[o] + span - 1) / span;
    const dim3 grid((unsigned)n->n_uses, (unsigned)spans, (unsigned)((n->max_rank + rg - 1) / rg));
    const float *norm_w = n->norm ? n->norm->v : NULL;
    if (n->norm)
        exl_cuda_launch(cb, lora_fused_kernel<INPUT_NORM>, grid, dim3(FUSED_THREADS), 0, *n, norm_w, rg, span);
    else if (n->up)
        exl_cuda_launch(cb, lora_fused_kernel<INPUT_GLU>, grid, dim3(FUSED_THREADS), 0, *n, norm_w, rg, span);
    else
        exl_cuda_launch(cb, lora_fused_kernel<INPUT_PLAIN>, grid, dim3(FUSED_THREADS), 0, *n, norm_w, rg, span);
    exl_cuda_check_launch(cb, "lora");
}

/* ---- folded into the GEMV (cuda_lora_fold.cuh) */

/* EXL_CUDA_LORA_GEMV=0: one-row steps keep the lora launches; read when a plan is compiled (a benchmark may compare
 * the paths with steps of different graphs) */
int exl_cuda_lora_fold_on(const exl_cuda_backend *cb) {
    const char *e = getenv("EXL_CUDA_LORA_GEMV");
    return !cb->deterministic && !(e && *e && atoi(e) == 0);
}

/* ---- the op */

static int empty(const exl_lora_node *n) { return n->n_uses < 1 || n->rows < 1 || n->n_out < 1 || n->max_rank < 1; }

static int takes_fused(const exl_cuda_backend *cb, const exl_lora_node *n) {
    return n->n_uses <= fused_max_uses() && n->max_rank <= FUSED_MAX_RANK && !cb->deterministic;
}

int exl_cuda_lora_batch_takes(const exl_cuda_backend *cb, const exl_lora_node *n) {
    return !empty(n) && !takes_fused(cb, n) && !cb->deterministic && exl_cuda_lora_batch_on() &&
           exl_cuda_lora_batch_fits(n);
}

void exl_cuda_run_lora(exl_backend *be, const exl_lora_node *n) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (empty(n))
        return;
    if (takes_fused(cb, n)) {
        run_fused(cb, n);
        return;
    }
    if (exl_cuda_lora_batch_takes(cb, n)) {
        exl_cuda_lora_batch(cb, n);
        return;
    }
    int32_t total = 0;
    for (int32_t o = 0; o < n->n_out; o++)
        total += n->out_features[o];
    exl_cuda_launch(cb, lora_shrink_kernel, dim3((unsigned)n->n_uses, (unsigned)(n->n_out * n->max_rank)),
                    dim3(SHRINK_THREADS), 0, *n, (const float *)(n->norm ? n->norm->v : NULL));
    exl_cuda_check_launch(cb, "lora shrink");
    dim3 grid((unsigned)((total + EXPAND_THREADS - 1) / EXPAND_THREADS), (unsigned)n->rows);
    exl_cuda_launch(cb, lora_expand_kernel, grid, dim3(EXPAND_THREADS), 0, *n);
    exl_cuda_check_launch(cb, "lora expand");
}
