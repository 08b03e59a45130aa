/* cuda_lora_fold.cuh - a one-row decode step's LoRA updates folded into the GEMV launch of their projections
 * (cuda_qgemv.cu's qgemv_kernel<1>; the plan folds a lora node there, cuda_plan.cu), so that adapters add no launch.
 * Two ways (the kernel's instantiations EXL_LORA_SIDE and EXL_LORA_IN_BLOCK; no adapter: EXL_LORA_NONE, no LoRA
 * code at all), chosen by the launch (cuda_qgemv.cu lora_side_of):
 * - side blocks (exl_lora_side, at the end), where the launch's blocks add their sums to the output atomically
 *   (every decode GEMV of a 7B model but layer 0's q/k/v): the GEMV's blocks store the runs of the dots as below, and
 *   a few extra blocks beside them do the expand (wait for the runs, sum them, add the updates atomically), so that
 *   no GEMV block has the expand's round trips after its chunk loop (0.740 of the no-adapter rate on an H100 against
 *   0.680 with the in-block fold everywhere: bench/RESULTS.md).
 * - in-block (the rest of this file, r2-lora3) elsewhere: where the blocks store their sums (one block a column tile
 *   merges: one split, or outputs neither zeroed nor accumulated), or more runs than a side block stages; the
 *   updates ride on the GEMV's blocks, as follows.
 *
 * The update of a projection's column c is sum over the row's uses u and ranks j of t[u, j] * Bt[j, c], where
 * t[u, j] = scale_u * x' · A[j] (x' the normed or GLU input the GEMV reads). Shrink: the dot products (u, matrix i,
 * rank j) are cut into `pieces` runs of `piece_len` inputs, one run a block (the first `units` blocks of the grid in
 * linear order): before griddepcontrol.wait a block reads its run's A values (constant within a step) and, with a
 * norm, the norm's weights; right after it, its x values, which come while the block does its RMS pass and gathers
 * its activations; its warps sum their products, and after the gather's barrier thread 0 stores the run's sum in
 * t_part, whose every value is EXL_LORA_UNSET (a NaN no arithmetic makes) until its run stores it: the value is its
 * own flag, so no fence or counter holds the publishing warp. Expand: the block that finishes a column tile's sum
 * (the split's first block where the splits add atomically, else the last to arrive, which merges) loads the runs of
 * its matrix, again where one is still unset, sums them into ts (times the use's scale, and 1 / RMS of the row with
 * a norm: the runs leave it out), then adds its column's update to the sum it stores: one memory round trip past the
 * block's own sums (its Bt values are loaded before). The expanding blocks count themselves (sync); the last sets
 * every run back to unset and the count to zero, so that the next launch (a replayed graph too) starts clean: every
 * launch after this one waits for it to finish before it touches them (griddepcontrol.wait).
 *
 * Why this cannot hang: a block that stores runs never waits before it has, and only one block a column tile ever
 * waits, so at most `tiles` blocks wait at once; the plan folds only where tiles < the SMs (each holds at least one
 * block), so some SM always has room for the blocks still to run, which finish or publish. The next kernel's blocks
 * take no room before all of this one's have started (they launch when every block has triggered, at its start). */
#ifndef EXL_CUDA_LORA_FOLD_CUH
#define EXL_CUDA_LORA_FOLD_CUH

#include "backend/cuda/cuda_internal.h"

#define EXL_LORA_FOLD_PRE 2 /* inputs of a run a thread loads around griddepcontrol.wait (more: after the gather) */
#define EXL_LORA_UNSET 0xffffffffu /* a run's sum not stored yet (arithmetic NaNs are 0x7fffffff) */

/* the launch's side of the fold (cuda_qgemv.cu sets it: lora_fold_of) */
typedef struct exl_lora_fold {
    const exl_lora_factors *factors[3]; /* matrix i's factors by adapter slot, or NULL (no update) */
    const int32_t *use_slot;
    const float *use_scale;
    const int32_t *slot_of; /* x and up in matrix 0's slot order (x_slots): input k at slot_of[k] */
    float *t_part;          /* [units rounded up to 4], 16-byte aligned: EXL_LORA_UNSET between launches */
    unsigned *sync;         /* expanding blocks done; zero between launches */
    int32_t n_uses, max_rank, pieces, piece_len, units; /* units 0: no fold */
    int32_t side_x0, side_cols; /* side blocks (side_cols 0: in-block fold): grid columns side_x0 .. + side_cols */
} exl_lora_fold;

/* the kernel's instantiations: no adapter (no LoRA code at all), the in-block fold, side blocks */
enum { EXL_LORA_NONE, EXL_LORA_IN_BLOCK, EXL_LORA_SIDE };

/* a run of a dot product */
typedef struct exl_lora_run {
    const float *a; /* A's row j from input k0, NULL: no run, or the adapter has no rank j (the run's sum is 0) */
    int32_t k0, n;
    int unit; /* -1: none */
} exl_lora_run;

/* a block's first run as a thread holds it through the block's start (few registers: the kernel's are counted) */
typedef struct exl_lora_first {
    int32_t at[EXL_LORA_FOLD_PRE]; /* where input k0 + tid + 256 e is in x, -1 past the run */
    float w[EXL_LORA_FOLD_PRE];    /* A's value there (times the norm's weight), then times x' */
    int unit;                      /* -1: none */
} exl_lora_first;

/* the GEMV's own grid columns (the side blocks' come after them) */
__device__ __forceinline__ int exl_lora_grid_x(const exl_lora_fold &L) {
    return L.side_cols ? L.side_x0 : (int)gridDim.x;
}

/* run `unit` into r.a, r.k0, r.n (n_mats matrices of in inputs) */
__device__ __forceinline__ void exl_lora_run_of(const exl_lora_fold &L, int unit, int n_mats, int in, exl_lora_run &r) {
    r.a = NULL, r.k0 = 0, r.n = 0, r.unit = unit;
    const int d = unit / L.pieces, p = unit % L.pieces;
    const int u = d / (n_mats * L.max_rank), i = d / L.max_rank % n_mats, j = d % L.max_rank;
    if (L.factors[i]) {
        const exl_lora_factors f = L.factors[i][__ldg(L.use_slot + u)];
        if (j < f.rank) {
            r.k0 = p * L.piece_len;
            r.n = max(0, min(L.piece_len, in - r.k0));
            r.a = f.a + (int64_t)j * in + r.k0;
        }
    }
}

/* Before griddepcontrol.wait: this block's first run (blocks in linear order; unit = block, then block + blocks, ...
 * where there are more runs than blocks: exl_lora_run_rest) and its constant values: A's times the norm's weights
 * (x' = x * norm, the RMS left to the expand); in the matrices' n_mats, input width in. */
__device__ __forceinline__ exl_lora_first exl_lora_run_start(const exl_lora_fold &L, int n_mats, int in,
                                                             const float *norm, int x_slots) {
    exl_lora_first r;
    exl_lora_run run;
    const int unit = (int)blockIdx.y * exl_lora_grid_x(L) + (int)blockIdx.x;
    r.unit = unit < L.units ? unit : -1;
    run.a = NULL, run.n = 0, run.k0 = 0;
    if (r.unit >= 0)
        exl_lora_run_of(L, unit, n_mats, in, run);
#pragma unroll
    for (int e = 0; e < EXL_LORA_FOLD_PRE; e++) {
        const int k = (int)threadIdx.x + e * 256;
        r.at[e] = -1, r.w[e] = 0.0f;
        if (run.a && k < run.n) {
            r.w[e] = __ldg(run.a + k) * (norm ? __ldg(norm + run.k0 + k) : 1.0f);
            r.at[e] = x_slots ? __ldg(L.slot_of + run.k0 + k) : run.k0 + k;
        }
    }
    return r;
}

/* the expanding block's factors on their way to L2 (before griddepcontrol.wait): rows of Bt for the 256 columns from
 * col0 of matrix i (width columns) */
__device__ __forceinline__ void exl_lora_prefetch_bt(const exl_lora_fold &L, int i, int col0, int width) {
    if (!L.units || !L.factors[i])
        return;
    for (int k = threadIdx.x; k < L.n_uses * L.max_rank * 8; k += blockDim.x) {
        const int u = k / (L.max_rank * 8), j = k / 8 % L.max_rank, line = k % 8;
        const exl_lora_factors f = L.factors[i][__ldg(L.use_slot + u)];
        if (j < f.rank && col0 + line * 32 < width)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(f.bt + (int64_t)j * width + col0 + line * 32));
    }
}

/* x' at x index s: x, or act(x) * up */
__device__ __forceinline__ float exl_lora_input(const float *x, const float *up, int act, int s) {
    const float v = __ldcg(x + s);
    return up ? exl_cuda_activate(v, act) * __ldcg(up + s) : v;
}

/* After griddepcontrol.wait: the run's first x values (into w) */
__device__ __forceinline__ void exl_lora_run_load(exl_lora_first &r, const float *x, const float *up, int act) {
#pragma unroll
    for (int e = 0; e < EXL_LORA_FOLD_PRE; e++)
        if (r.at[e] >= 0)
            r.w[e] *= exl_lora_input(x, up, act, r.at[e]);
}

/* this thread's share of run r's products from the run's input `from` on */
__device__ __forceinline__ float exl_lora_run_dot(const exl_lora_fold &L, const exl_lora_run &r, const float *x,
                                                  const float *up, const float *norm, int act, int x_slots, int from) {
    float s = 0.0f;
    for (int k = (int)threadIdx.x + from; r.a && k < r.n; k += 256) {
        const int at = x_slots ? __ldg(L.slot_of + r.k0 + k) : r.k0 + k;
        s += exl_lora_input(x, up, act, at) * (norm ? __ldg(norm + r.k0 + k) : 1.0f) * __ldg(r.a + k);
    }
    return s;
}

/* Before the block's barrier: each warp's share of the first run's sum into warp_sums[warp] (8 floats) */
__device__ __forceinline__ void exl_lora_run_sum(const exl_lora_fold &L, const exl_lora_first &first, int n_mats,
                                                 int in, const float *x, const float *up, const float *norm, int act,
                                                 int x_slots, float *warp_sums) {
    if (first.unit < 0)
        return;
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < EXL_LORA_FOLD_PRE; e++)
        s += first.w[e];
    exl_lora_run r;
    exl_lora_run_of(L, first.unit, n_mats, in, r);
    s += exl_lora_run_dot(L, r, x, up, norm, act, x_slots, EXL_LORA_FOLD_PRE * 256);
    for (int off = 16; off > 0; off >>= 1)
        s += __shfl_xor_sync(0xffffffffu, s, off);
    if ((threadIdx.x & 31) == 0)
        warp_sums[threadIdx.x >> 5] = s;
}

/* After the barrier: thread 0 publishes the sum of run `unit` (-1: none) */
__device__ __forceinline__ void exl_lora_run_publish(const exl_lora_fold &L, int unit, const float *warp_sums) {
    if (unit < 0 || threadIdx.x != 0)
        return;
    float s = 0.0f;
    for (int w = 0; w < 8; w++)
        s += warp_sums[w];
    __stcg(L.t_part + unit, s);
}

/* After exl_lora_run_publish, all the block's threads: its further runs where there are more than blocks (small
 * matrices, many uses), each summed and published the same way (the barriers reuse warp_sums) */
__device__ __forceinline__ void exl_lora_run_rest(const exl_lora_fold &L, int n_mats, int in, const float *x,
                                                  const float *up, const float *norm, int act, int x_slots,
                                                  float *warp_sums) {
    const int blocks = exl_lora_grid_x(L) * (int)gridDim.y;
    for (int unit = (int)blockIdx.y * exl_lora_grid_x(L) + (int)blockIdx.x + blocks; unit < L.units; unit += blocks) {
        exl_lora_run r;
        exl_lora_run_of(L, unit, n_mats, in, r);
        float s = exl_lora_run_dot(L, r, x, up, norm, act, x_slots, 0);
        for (int off = 16; off > 0; off >>= 1)
            s += __shfl_xor_sync(0xffffffffu, s, off);
        __syncthreads(); /* warp_sums read by the publish before */
        if ((threadIdx.x & 31) == 0)
            warp_sums[threadIdx.x >> 5] = s;
        __syncthreads();
        exl_lora_run_publish(L, unit, warp_sums);
    }
}

#define EXL_LORA_FOLD_BT 16 /* Bt values a thread loads before it waits (the rest after) */

/* The update of column col of matrix i (width columns; col >= width: none) once its runs are stored; all the block's
 * threads call it (barriers), one block a column tile of the launch. inv: 1 / RMS of the row with a norm, else 1; ts:
 * shared scratch of n_uses * max_rank floats, free to overwrite. */
__device__ __forceinline__ float exl_lora_expand(const exl_lora_fold &L, int n_mats, int i, int col, int width,
                                                 float inv, float *ts) {
    const int on = L.factors[i] && col < width;
    float b[EXL_LORA_FOLD_BT];
#pragma unroll
    for (int k = 0; k < EXL_LORA_FOLD_BT; k++) { /* pair k: use k / max_rank, rank k % max_rank */
        const int u = k / L.max_rank, j = k % L.max_rank;
        b[k] = 0.0f;
        if (on && u < L.n_uses) {
            const exl_lora_factors f = L.factors[i][__ldg(L.use_slot + u)];
            if (j < f.rank)
                b[k] = __ldg(f.bt + (int64_t)j * width + col);
        }
    }
    const int n = L.n_uses * L.max_rank;
    for (int k = threadIdx.x; k < n && L.factors[i]; k += blockDim.x) {
        const int u = k / L.max_rank, j = k % L.max_rank;
        const float *t = L.t_part + ((int64_t)(u * n_mats + i) * L.max_rank + j) * L.pieces;
        float s = 0.0f;
        for (int p0 = 0; p0 < L.pieces; p0 += 8) { /* eight loads in flight, added in run order */
            float v[8];
#pragma unroll
            for (int e = 0; e < 8; e++)
                v[e] = p0 + e < L.pieces ? __ldcv(t + p0 + e) : 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                while (__float_as_uint(v[e]) == EXL_LORA_UNSET) { /* its run has not stored it yet */
                    __nanosleep(32);
                    v[e] = __ldcv(t + p0 + e);
                }
                s += v[e];
            }
        }
        ts[k] = s * __ldg(L.use_scale + u) * inv;
    }
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(L.sync, 1u) == gridDim.x - 1) { /* the last: every run unset again */
        const float u = __uint_as_float(EXL_LORA_UNSET);
        for (int k = 0; k < L.units; k += 4) /* 16 bytes a store: t_part is aligned and holds whole 4s */
            __stcg((float4 *)(L.t_part + k), make_float4(u, u, u, u));
        *L.sync = 0;
    }
    float acc = 0.0f;
    if (!on)
        return acc;
#pragma unroll
    for (int k = 0; k < EXL_LORA_FOLD_BT; k++)
        acc += k < n ? ts[k] * b[k] : 0.0f;
    for (int k = EXL_LORA_FOLD_BT; k < n; k++) {
        const int u = k / L.max_rank, j = k % L.max_rank;
        const exl_lora_factors f = L.factors[i][__ldg(L.use_slot + u)];
        if (j < f.rank)
            acc += ts[k] * __ldg(f.bt + (int64_t)j * width + col);
    }
    return acc;
}

/* ---- side blocks: the expand beside the GEMV's own blocks, in launches whose blocks add to the output atomically */

#define EXL_LORA_SIDE_MAX 1024 /* runs at most: staged in the kernel's red (1024 floats) */

/* what a side block reads and where it adds (the GEMV's inputs and outputs) */
typedef struct exl_lora_side_io {
    const float *x;
    float eps;
    int32_t in, n_mats, norm; /* norm: the runs leave out 1 / RMS of x */
    float *out[3];
    int32_t width[3];       /* 0 past n_mats */
    const int32_t *out_map; /* the GEMV's: output column c of a matrix goes to out_map[c] */
} exl_lora_side_io;

/* global column c of the matrices side by side: its matrix i and column in it (selects, not indexing: the struct
 * stays in registers) */
__device__ __forceinline__ int exl_lora_col_of(const exl_lora_side_io &io, int c, int &i) {
    const int w0 = io.width[0], w01 = w0 + io.width[1];
    i = io.n_mats > 1 && c >= w0 ? (io.n_mats > 2 && c >= w01 ? 2 : 1) : 0;
    return i == 0 ? c : i == 1 ? c - w0 : c - w01;
}

/* matrix i's width and output (selects, as exl_lora_col_of) */
__device__ __forceinline__ int exl_lora_width_of(const exl_lora_side_io &io, int i) {
    return i == 0 ? io.width[0] : i == 1 ? io.width[1] : io.width[2];
}
__device__ __forceinline__ float *exl_lora_out_of(const exl_lora_side_io &io, int i) {
    return i == 0 ? io.out[0] : i == 1 ? io.out[1] : io.out[2];
}

/* One side block (`side` of `sides`, grid columns side_x0 on; all its threads; it calls griddepcontrol's start
 * itself). The GEMV's own blocks store the runs of the dots as in the in-block fold (the shrink stays spread over the
 * whole first wave: a side block summing whole dots takes 10-50 us, bench/LOG.md r2-lora4) and skip the expand.
 * Before the wait a side block asks L2 for its columns' rows of Bt (constant within a step); after it, every thread
 * loads its share of all the runs at once (again where one is still unset) into ts, with a norm also its share of the
 * row's sum of squares (1 / RMS: the runs leave it out); the dots' sums (pieces a dot, in run order) times scale_u
 * and 1 / RMS go back into ts; the block counts itself (the last resets the runs and the count for the next launch,
 * as exl_lora_expand) and adds its share of the columns' updates (sum over uses and ranks of t * Bt) atomically.
 * Why it cannot hang: only side blocks wait, for the GEMV's blocks, which store their runs before their chunk loop
 * and never wait; a block not yet placed gets an SM when others finish. ts: shared scratch of EXL_LORA_SIDE_MAX
 * floats (L.units at most). */
__device__ __forceinline__ void exl_lora_side(const exl_lora_fold &L, const exl_lora_side_io &io, int side, int sides,
                                              float *ts) {
    const int D = L.n_uses * io.n_mats * L.max_rank, tid = (int)threadIdx.x;
    const int cols = io.width[0] + io.width[1] + io.width[2]; /* 0 past n_mats */
    const int per = ((cols + sides - 1) / sides + 31) / 32 * 32, c_begin = side * per;
    const int c_end = min(cols, c_begin + per);
    const int lines = (max(0, c_end - c_begin) + 31) / 32, pairs = L.n_uses * L.max_rank;
    for (int k = tid; k < pairs * lines; k += (int)blockDim.x) {
        const int u = k / lines / L.max_rank, j = k / lines % L.max_rank, i0 = c_begin + k % lines * 32;
        int i;
        const int c = exl_lora_col_of(io, i0, i);
        if (!L.factors[i])
            continue;
        const exl_lora_factors f = L.factors[i][__ldg(L.use_slot + u)];
        if (j < f.rank)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(f.bt + (int64_t)j * exl_lora_width_of(io, i) + c));
    }
    exl_pdl_start();
    /* the runs (4 a thread at most) and the sum of squares, their loads in flight together */
    float v[EXL_LORA_SIDE_MAX / 256];
#pragma unroll
    for (int e = 0; e < EXL_LORA_SIDE_MAX / 256; e++) {
        const int k = e * (int)blockDim.x + tid;
        v[e] = k < L.units ? __ldcv(L.t_part + k) : 0.0f;
    }
    float ss = 0.0f;
    if (io.norm && io.in % 4 == 0 && ((uintptr_t)io.x & 15) == 0) {
#pragma unroll 4
        for (int k = tid; k < io.in / 4; k += (int)blockDim.x) {
            const float4 x = __ldcg((const float4 *)io.x + k);
            ss += x.x * x.x + x.y * x.y + x.z * x.z + x.w * x.w;
        }
    } else if (io.norm) {
#pragma unroll 4
        for (int k = tid; k < io.in; k += (int)blockDim.x) {
            const float x = __ldcg(io.x + k);
            ss += x * x;
        }
    }
#pragma unroll
    for (int e = 0; e < EXL_LORA_SIDE_MAX / 256; e++) {
        const int k = e * (int)blockDim.x + tid;
        if (k >= L.units)
            continue;
        while (__float_as_uint(v[e]) == EXL_LORA_UNSET) { /* its block has not stored it yet */
            __nanosleep(32);
            v[e] = __ldcv(L.t_part + k);
        }
        ts[k] = v[e];
    }
    float inv = 1.0f;
    if (io.norm) {
        for (int off = 16; off > 0; off >>= 1)
            ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if ((tid & 31) == 0)
            ts[EXL_LORA_SIDE_MAX - 1 - (tid >> 5)] = ss; /* past the runs: units <= EXL_LORA_SIDE_MAX - 8 */
    }
    __syncthreads();
    if (io.norm) {
        ss = 0.0f;
        for (int w = 0; w < (int)blockDim.x / 32; w++)
            ss += ts[EXL_LORA_SIDE_MAX - 1 - w];
        inv = rsqrtf(ss / io.in + io.eps);
    }
    /* each dot's pieces summed in run order (a thread holds up to 4 dots), then back into ts[d] */
    float t[EXL_LORA_SIDE_MAX / 256];
#pragma unroll
    for (int e = 0; e < EXL_LORA_SIDE_MAX / 256; e++) {
        const int d = e * (int)blockDim.x + tid;
        t[e] = 0.0f;
        for (int p = 0; d < D && p < L.pieces; p++)
            t[e] += ts[d * L.pieces + p];
        if (d < D)
            t[e] *= __ldg(L.use_scale + d / (io.n_mats * L.max_rank)) * inv;
    }
    __syncthreads();
#pragma unroll
    for (int e = 0; e < EXL_LORA_SIDE_MAX / 256; e++) {
        const int d = e * (int)blockDim.x + tid;
        if (d < D)
            ts[d] = t[e];
    }
    __syncthreads();
    if (tid == 0 && atomicAdd(L.sync, 1u) == (unsigned)sides - 1) { /* the last: every run unset again */
        const float u = __uint_as_float(EXL_LORA_UNSET);
        for (int k = 0; k < L.units; k += 4) /* 16 bytes a store: t_part is aligned and holds whole 4s */
            __stcg((float4 *)(L.t_part + k), make_float4(u, u, u, u));
        *L.sync = 0;
    }
    for (int g = c_begin + tid; g < c_end; g += (int)blockDim.x) {
        int i;
        const int c = exl_lora_col_of(io, g, i);
        if (!L.factors[i])
            continue;
        const int width = exl_lora_width_of(io, i);
        float acc = 0.0f;
        for (int u = 0; u < L.n_uses; u++) {
            const exl_lora_factors f = L.factors[i][__ldg(L.use_slot + u)];
            const float *tu = ts + (u * io.n_mats + i) * L.max_rank;
            const float *bt = f.bt + c;
#pragma unroll 8
            for (int j = 0; j < f.rank; j++)
                acc += tu[j] * __ldg(bt + (int64_t)j * width);
        }
        atomicAdd(exl_lora_out_of(io, i) + (io.out_map ? __ldg(io.out_map + c) : c), acc);
    }
}

#endif
