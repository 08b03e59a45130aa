/* cuda_allreduce.cu - the push all-reduce: tensor parallelism's decode-sized all-reduces (cuda_comm.cu picks it)
 * between GPUs of one process that reach each other's memory, in one kernel of a few microseconds, optionally with
 * the residual add that follows the all-reduce in every layer (cuda_plan.cu fuses the two nodes).
 *
 * Each rank owns a receive buffer: two sets (used by turns, by a round count) of one slot per rank, every float of
 * it "empty" (the NaN 0xffffffff) until written. A block of the kernel owns a slice of the vector: it stores its
 * rank's values of the slice straight into the slot of its rank in every peer's receive buffer (stores over NVLink
 * are posted: no round trip), then polls its own receive buffer (local memory) until every peer's values of the
 * slice are there (no flag: a value that is not "empty" is the value; a value that is the empty pattern is sent as
 * the canonical NaN 0x7fffffff, still a NaN), sums the ranks' values in rank order (every rank gets the same
 * bits), marks the slots empty again, and writes the sum (and adds it to the residual when fused).
 *
 * Why two sets suffice: a peer writes round r + 2's values (the same set as round r) only after it has this rank's
 * values of round r + 1, which this rank sends in a later kernel than the one that read and emptied round r's slots.
 * Each block keeps its own round count in device memory (so CUDA graph replays advance it: nothing of the round is
 * baked into the graph), and every launch has the same number of blocks, so all counts stay equal, on every rank.
 * Co-residency (the ranks' blocks wait for each other): PUSH_BLOCKS small blocks, far fewer than any GPU holds at
 * once. Programmatic dependent launch: the kernel lets the next one start its prologue (the GEMV's weight prefetch)
 * at once, and touches nothing another kernel writes before its wait. A peer that never comes (its rank failed)
 * ends the wait after PUSH_TIMEOUT_NS with a trap (a device error on this rank) rather than a hang.
 *
 * EXL_TP_PUSH_TRACE=1: block 0 of every launch counts its cycles from griddepcontrol.wait to its end (its own sends,
 * the wait for the peers' values, the sums) into a histogram on its device, printed when the communicator is freed:
 * on the rank that arrives first this includes how long the others took to arrive (the ranks' skew), on the last
 * only the transfer; what a step spends outside the kernel (its launch, the grid boundaries) is the rest. */
#include "backend/cuda/cuda_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PUSH_THREADS 128
#define PUSH_EMPTY 0xffffffffu
#define PUSH_FILLED 0x7fffffffu        /* what a value with the empty pattern is sent as */
#define PUSH_TIMEOUT_NS 30000000000ull /* 30 s */
#define TRACE_BINS 64                  /* of TRACE_BIN_NS, the last one everything longer */
#define TRACE_BIN_NS 250
#define TRACE_WORDS (2 + TRACE_BINS) /* calls, cycles in all, the bins; all-reduces', then gathers' */

typedef struct push_args {
    float *recv[EXL_CUDA_PUSH_MAX_RANKS]; /* every rank's receive buffer */
    unsigned *rounds;                     /* this rank's round count, one a block */
    unsigned long long *trace;            /* 2 x TRACE_WORDS, or NULL */
    unsigned cycles_per_bin;              /* SM cycles of TRACE_BIN_NS at the rated clock */
    float *x, *resid;                     /* x = the sum of x over the ranks; resid += it (resid may be NULL) */
    int64_t n, stride;                    /* floats; floats a slot holds */
    int rank, n_ranks;
    /* a gather: x [n / width, width] the output, src this rank's columns [n / width, cols[rank + 1] - cols[rank]] */
    const float *src;
    int64_t width;
    int32_t cols[EXL_CUDA_PUSH_MAX_RANKS + 1];
} push_args;

__device__ __forceinline__ unsigned sendable(float v) {
    const unsigned b = __float_as_uint(v);
    return b == PUSH_EMPTY ? PUSH_FILLED : b;
}

__device__ __forceinline__ uint64_t now_ns(void) {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

/* V floats (1 or 4) as bits, stored and loaded so that every access goes to memory (L2, or the peer's over NVLink) */
template <int V>
struct bits_of {
    unsigned v[V];
};

template <int V>
__device__ __forceinline__ void store_volatile(float *p, const bits_of<V> &b) {
    if constexpr (V == 4)
        asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(b.v[0]), "r"(b.v[1]),
                     "r"(b.v[2]), "r"(b.v[3])
                     : "memory");
    else
        asm volatile("st.volatile.global.u32 [%0], %1;" ::"l"(p), "r"(b.v[0]) : "memory");
}

template <int V>
__device__ __forceinline__ bits_of<V> load_volatile(const float *p) {
    bits_of<V> b;
    if constexpr (V == 4)
        asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(b.v[0]), "=r"(b.v[1]), "=r"(b.v[2]), "=r"(b.v[3])
                     : "l"(p)
                     : "memory");
    else
        asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(b.v[0]) : "l"(p) : "memory");
    return b;
}

/* this rank's values at x (another kernel's output: past L1) */
template <int V>
__device__ __forceinline__ bits_of<V> own_values(const float *x) {
    bits_of<V> b;
    if constexpr (V == 4) {
        const float4 f = __ldcg((const float4 *)x);
        b.v[0] = sendable(f.x), b.v[1] = sendable(f.y), b.v[2] = sendable(f.z), b.v[3] = sendable(f.w);
    } else {
        b.v[0] = sendable(__ldcg(x));
    }
    return b;
}

/* a peer's values at p once all of them are there */
template <int V>
__device__ __forceinline__ bits_of<V> wait_values(const float *p) {
    uint64_t since = 0;
    for (unsigned spins = 1;; spins++) {
        bits_of<V> b = load_volatile<V>(p);
        bool all = true;
#pragma unroll
        for (int i = 0; i < V; i++)
            all &= b.v[i] != PUSH_EMPTY;
        if (all)
            return b;
        if (spins % 4096 == 0) {
            const uint64_t t = now_ns();
            if (!since)
                since = t;
            else if (t - since > PUSH_TIMEOUT_NS)
                __trap();
        }
    }
}

/* the block's units [u0, u1) of V floats from float `base` on: send (phase 0), or receive, sum, empty (phase 1) */
template <int V>
__device__ __forceinline__ void push_units(const push_args &a, int64_t set, int64_t base, int64_t u0, int64_t u1,
                                           int phase) {
    for (int64_t u = u0 + threadIdx.x; u < u1; u += PUSH_THREADS) {
        const int64_t e = base + u * V;
        const bits_of<V> mine = own_values<V>(a.x + e);
        if (phase == 0) {
            for (int k = 0; k < a.n_ranks; k++)
                if (k != a.rank)
                    store_volatile<V>(a.recv[k] + set + (int64_t)a.rank * a.stride + e, mine);
            continue;
        }
        float s[V], r[V]; /* the residual read before the waits: its latency hidden behind them */
        if (a.resid) {
            if constexpr (V == 4) {
                const float4 f = __ldcg((const float4 *)(a.resid + e));
                r[0] = f.x, r[1] = f.y, r[2] = f.z, r[3] = f.w;
            } else {
                r[0] = __ldcg(a.resid + e);
            }
        }
        for (int k = 0; k < a.n_ranks; k++) {
            float *slot = a.recv[a.rank] + set + (int64_t)k * a.stride + e;
            const bits_of<V> v = k == a.rank ? mine : wait_values<V>(slot);
#pragma unroll
            for (int i = 0; i < V; i++)
                s[i] = k ? s[i] + __uint_as_float(v.v[i]) : __uint_as_float(v.v[i]);
            if (k != a.rank) {
                bits_of<V> empty;
#pragma unroll
                for (int i = 0; i < V; i++)
                    empty.v[i] = PUSH_EMPTY;
                store_volatile<V>(slot, empty);
            }
        }
        if constexpr (V == 4) {
            *(float4 *)(a.x + e) = make_float4(s[0], s[1], s[2], s[3]);
            if (a.resid)
                *(float4 *)(a.resid + e) = make_float4(r[0] + s[0], r[1] + s[1], r[2] + s[2], r[3] + s[3]);
        } else {
            a.x[e] = s[0];
            if (a.resid)
                a.resid[e] = r[0] + s[0];
        }
    }
}

/* V floats to memory that other kernels read (x, resid), as floats */
template <int V>
__device__ __forceinline__ void store_floats(float *p, const float (&v)[V]) {
    if constexpr (V == 4)
        *(float4 *)p = make_float4(v[0], v[1], v[2], v[3]);
    else
        p[0] = v[0];
}

/* A gather's units [u0, u1) of V floats (a unit's floats in one row and one rank's columns): this rank's sent to
 * every peer's receive buffer, at the unit's place in the output (phase 0), or a peer's received (phase 1); either
 * way written to the output and added to resid. Only the rank owning a float writes it: one slot a float. */
template <int V>
__device__ __forceinline__ void gather_units(const push_args &a, int64_t set, int64_t u0, int64_t u1, int phase) {
    const int64_t own0 = a.cols[a.rank], own_width = a.cols[a.rank + 1] - own0;
    for (int64_t u = u0 + threadIdx.x; u < u1; u += PUSH_THREADS) {
        const int64_t e = u * V, row = e / a.width, col = e - row * a.width;
        const bool mine = col >= own0 && col < own0 + own_width;
        if (mine != (phase == 0))
            continue;
        bits_of<V> b;
        if (mine) {
            b = own_values<V>(a.src + row * own_width + (col - own0));
            for (int k = 0; k < a.n_ranks; k++)
                if (k != a.rank)
                    store_volatile<V>(a.recv[k] + set + e, b);
        } else {
            float *slot = a.recv[a.rank] + set + e;
            b = wait_values<V>(slot);
            bits_of<V> empty;
#pragma unroll
            for (int i = 0; i < V; i++)
                empty.v[i] = PUSH_EMPTY;
            store_volatile<V>(slot, empty);
        }
        float v[V];
#pragma unroll
        for (int i = 0; i < V; i++)
            v[i] = __uint_as_float(b.v[i]);
        store_floats<V>(a.x + e, v);
        if (a.resid) {
            float r[V];
            if constexpr (V == 4) {
                const float4 f = __ldcg((const float4 *)(a.resid + e));
                r[0] = f.x + v[0], r[1] = f.y + v[1], r[2] = f.z + v[2], r[3] = f.w + v[3];
            } else {
                r[0] = __ldcg(a.resid + e) + v[0];
            }
            store_floats<V>(a.resid + e, r);
        }
    }
}

/* V = 4: the first n / 4 * 4 floats by float4 (x and resid 16-byte aligned), the last n % 4 by the last block;
 * V = 1: every float one by one. GATHER: a gather (gather_units) of n floats, by V (a gather by float4 has no
 * tail: its caller checks that every rank's columns and the rows are whole float4s). */
template <int V, bool GATHER>
__global__ void __launch_bounds__(PUSH_THREADS) push_all_reduce_kernel(const push_args a) {
    exl_pdl_trigger(); /* every block of this kernel is resident once the next one may start */
    exl_pdl_wait();
    const long long t0 = a.trace && blockIdx.x == 0 && threadIdx.x == 0 ? clock64() : 0;
    /* every thread reads the block's round (the previous launch's, past L1), in flight with its first values; the
     * block's last __syncthreads orders these reads before the update */
    const unsigned round = *(volatile const unsigned *)(a.rounds + blockIdx.x);
    const int64_t set = (int64_t)(round & 1) * a.n_ranks * a.stride;
    const int64_t units = a.n / V, per = (units + gridDim.x - 1) / gridDim.x;
    const int64_t u0 = min(units, per * blockIdx.x), u1 = min(units, u0 + per);
    const bool tail = !GATHER && V > 1 && blockIdx.x == gridDim.x - 1;
    for (int phase = 0; phase < 2; phase++) {
        if constexpr (GATHER) {
            gather_units<V>(a, set, u0, u1, phase);
            continue;
        }
        push_units<V>(a, set, 0, u0, u1, phase);
        if (tail)
            push_units<1>(a, set, units * V, 0, a.n - units * V, phase);
    }
    __syncthreads();
    if (threadIdx.x == 0)
        a.rounds[blockIdx.x] = round + 1;
    if (t0) {
        const unsigned long long cycles = (unsigned long long)(clock64() - t0);
        const unsigned long long bin = cycles / a.cycles_per_bin;
        unsigned long long *t = a.trace + (GATHER ? TRACE_WORDS : 0);
        atomicAdd(t, 1ull);
        atomicAdd(t + 1, cycles);
        atomicAdd(t + 2 + (bin < TRACE_BINS ? bin : TRACE_BINS - 1), 1ull);
    }
}

exl_status exl_cuda_push_alloc(exl_cuda_push *p, int32_t rank, int32_t n_ranks, int64_t max_floats) {
    const size_t bytes = 2 * (size_t)n_ranks * (size_t)max_floats * sizeof(float);
    EXL_TRY(exl_cuda_malloc((void **)&p->recv[rank], bytes, "the all-reduce's receive buffer"));
    EXL_TRY(
        exl_cuda_malloc((void **)&p->rounds[rank], EXL_CUDA_PUSH_BLOCKS * sizeof(unsigned), "the all-reduce's rounds"));
    if (cudaMemset(p->recv[rank], 0xff, bytes) != cudaSuccess ||
        cudaMemset(p->rounds[rank], 0, EXL_CUDA_PUSH_BLOCKS * sizeof(unsigned)) != cudaSuccess)
        return exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: clearing the all-reduce's buffers: %s",
                             cudaGetErrorString(cudaGetLastError()));
    p->max_floats = max_floats;
    const char *trace = getenv("EXL_TP_PUSH_TRACE");
    if (trace && !strcmp(trace, "1")) {
        const size_t tb = 2 * TRACE_WORDS * sizeof(unsigned long long);
        EXL_TRY(exl_cuda_malloc((void **)&p->trace[rank], tb, "the all-reduce's trace"));
        int khz = 0, device = 0;
        cudaGetDevice(&device);
        cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
        p->cycles_per_bin[rank] = khz > 0 ? (unsigned)((long long)khz * TRACE_BIN_NS / 1000000) : 1;
        if (cudaMemset(p->trace[rank], 0, tb) != cudaSuccess)
            return exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: clearing the all-reduce's trace: %s",
                                 cudaGetErrorString(cudaGetLastError()));
    }
    return EXL_OK;
}

/* the trace of rank k on stderr, as the core's notices look (this library has no notice handler): for each kind,
 * launches, mean and percentiles of block 0's time in the kernel */
static void trace_print(const exl_cuda_push *p, int32_t k) {
    unsigned long long all[2 * TRACE_WORDS];
    if (cudaMemcpy(all, p->trace[k], sizeof all, cudaMemcpyDeviceToHost) != cudaSuccess) {
        cudaGetLastError();
        return;
    }
    for (int kind = 0; kind < 2; kind++) {
        const unsigned long long *t = all + kind * TRACE_WORDS;
        if (!t[0])
            continue;
        double pct[3] = {0.5, 0.9, 0.99}, at[3] = {0, 0, 0};
        for (int q = 0; q < 3; q++) {
            unsigned long long seen = 0;
            for (int b = 0; b < TRACE_BINS; b++) {
                seen += t[2 + b];
                if ((double)seen >= pct[q] * (double)t[0]) {
                    at[q] = (b + 1) * TRACE_BIN_NS / 1000.0;
                    break;
                }
            }
        }
        const double ns_per_cycle = (double)TRACE_BIN_NS / p->cycles_per_bin[k];
        fprintf(stderr,
                "exl: push %s trace, rank %d: %llu launches, block 0 in the kernel (after its wait) mean %.2f us, "
                "median <= %.2f, p90 <= %.2f, p99 <= %.2f us (at the rated SM clock)\n",
                kind ? "gather" : "all-reduce", k, t[0], (double)t[1] / (double)t[0] * ns_per_cycle / 1000.0, at[0],
                at[1], at[2]);
    }
}

void exl_cuda_push_free(exl_cuda_push *p, int32_t n_ranks) {
    for (int32_t k = 0; k < n_ranks; k++) {
        if (p->trace[k]) {
            trace_print(p, k);
            cudaFree(p->trace[k]);
            p->trace[k] = NULL;
        }
        cudaFree(p->recv[k]);
        cudaFree(p->rounds[k]);
        p->recv[k] = NULL;
        p->rounds[k] = NULL;
    }
}

/* the arguments of both kinds of launch (the gather's own fields zero) */
static push_args args_of(const exl_cuda_backend *cb, const exl_cuda_push *p, int32_t n_ranks, float *x, float *resid,
                         int64_t n) {
    push_args a;
    memset(&a, 0, sizeof a);
    for (int32_t k = 0; k < n_ranks; k++)
        a.recv[k] = p->recv[k];
    a.rounds = p->rounds[cb->rank];
    a.trace = p->trace[cb->rank];
    a.cycles_per_bin = p->cycles_per_bin[cb->rank] ? p->cycles_per_bin[cb->rank] : 1;
    a.x = x, a.resid = resid, a.n = n, a.stride = p->max_floats;
    a.rank = cb->rank, a.n_ranks = n_ranks;
    return a;
}

void exl_cuda_push_all_reduce(exl_cuda_backend *cb, const exl_cuda_push *p, int32_t n_ranks, float *x, float *resid,
                              int64_t n) {
    const push_args a = args_of(cb, p, n_ranks, x, resid, n);
    const int aligned = !(((uintptr_t)x | (uintptr_t)resid) % 16);
    if (aligned)
        exl_cuda_launch(cb, push_all_reduce_kernel<4, false>, dim3(EXL_CUDA_PUSH_BLOCKS), dim3(PUSH_THREADS), 0, a);
    else
        exl_cuda_launch(cb, push_all_reduce_kernel<1, false>, dim3(EXL_CUDA_PUSH_BLOCKS), dim3(PUSH_THREADS), 0, a);
    exl_cuda_check_launch(cb, "all_reduce (push)");
}

void exl_cuda_push_gather(exl_cuda_backend *cb, const exl_cuda_push *p, const exl_gather_cols_node *g, float *resid) {
    push_args a = args_of(cb, p, g->n_ranks, g->out, resid, (int64_t)g->rows * g->out_width);
    a.src = g->x, a.width = g->out_width;
    int whole = !(((uintptr_t)g->out | (uintptr_t)g->x | (uintptr_t)resid) % 16) && g->out_width % 4 == 0;
    for (int32_t k = 0; k <= g->n_ranks; k++) {
        a.cols[k] = g->cols[k];
        whole &= g->cols[k] % 4 == 0;
    }
    if (whole)
        exl_cuda_launch(cb, push_all_reduce_kernel<4, true>, dim3(EXL_CUDA_PUSH_BLOCKS), dim3(PUSH_THREADS), 0, a);
    else
        exl_cuda_launch(cb, push_all_reduce_kernel<1, true>, dim3(EXL_CUDA_PUSH_BLOCKS), dim3(PUSH_THREADS), 0, a);
    exl_cuda_check_launch(cb, "gather_cols (push)");
}
