/* cuda_sample.cu - the sample op on the GPU: one token per row chosen where the logits are, so sampled decode moves
 * a few bytes per row instead of a vocabulary of logits. The result is the CPU reference's (cpu_sample.c, which
 * defines it): the same edits, filters and draw, with weights in the same fixed point so every sum is exact.
 *
 * One block per row. Orders (larger key first, lower id first among equals) are never sorted: each filter and the
 * draw need only "the element at which the mass in order first reaches a target". The cuts in logit order and typical
 * sampling take the fast path below (a histogram of buckets, then one bucket sorted); the draws in id order and what
 * the fast path cannot hold use a radix select over the 32-bit keys (four 8-bit passes with shared histograms
 * of integer mass, so the result does not depend on the order of the atomics) and, among the elements with that
 * exact key, a scan in id order (contiguous id ranges per thread, a block-wide prefix sum). There the kept set is a
 * predicate recomputed from the logits on every pass: the cut in logit order (top-k, then top-p), min-p's threshold
 * and the cut in typical order. */
#include "backend/cuda/cuda_internal.h"

#include <math.h>

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
#define BLOCK_SUMS_MAX 5

__device__ __forceinline__ uint32_t sample_key(float f) {
    uint32_t u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

/* f(i, x[i]) for this thread's elements of a row, i = threadIdx.x + k * SAMPLE_THREADS in order, SAMPLE_UNROLL loads
 * issued before any is used: one block a row leaves too few loads in flight otherwise (the H100 spent ~6 us a pass
 * over 32000 logits waiting for them). */
#define SAMPLE_UNROLL 4
template <typename F>
__device__ __forceinline__ void for_each_logit(const float *x, int32_t vocab, F &&f) {
    for (int32_t base = threadIdx.x; base < vocab; base += SAMPLE_THREADS * SAMPLE_UNROLL) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (int k = 0; k < SAMPLE_UNROLL; k++)
            v[k] = base + k * SAMPLE_THREADS < vocab ? x[base + k * SAMPLE_THREADS] : 0.0f;
#pragma unroll
        for (int k = 0; k < SAMPLE_UNROLL; k++)
            if (base + k * SAMPLE_THREADS < vocab)
                f(base + k * SAMPLE_THREADS, v[k]);
    }
}

/* What a row keeps so far, and how its weights are computed. */
struct sample_row {
    const float *x;
    int32_t vocab;
    float lmax, inv_t, min_p;
    double scale;
    float w_zero;               /* 2^-(shift + 1): a weight below it is 0 in fixed point */
    int logit_cut, typical_cut; /* the cuts in force */
    uint32_t cut_key, typ_key;  /* an element is in a cut when its key is above, or equal with id <= *_id */
    int32_t cut_id, typ_id;
    double wsum, ent; /* typical order's distances: q = w / wsum, |-log q - ent| */
};

__device__ __forceinline__ float sample_weight(const sample_row &r, float l) {
    return l > -INFINITY ? expf((l - r.lmax) * r.inv_t) : 0.0f;
}

__device__ __forceinline__ uint64_t sample_fixed(const sample_row &r, float w) {
    /* as the CPU's: exact, shift <= 52; the far tail of a peaked row skips the double-precision conversions */
    return w < r.w_zero ? 0 : __double2ull_rz((double)w * r.scale + 0.5);
}

__device__ __forceinline__ uint32_t typical_key(const sample_row &r, float w) {
    double q = (double)w / r.wsum;
    return sample_key(q > 0 ? -(float)fabs(-log(q) - r.ent) : -INFINITY);
}

/* Whether element i (logit l, weight w) is still a candidate. */
__device__ __forceinline__ bool sample_kept(const sample_row &r, int32_t i, float l, float w) {
    if (!(l > -INFINITY))
        return false;
    if (r.logit_cut) {
        uint32_t k = sample_key(l);
        if (k < r.cut_key || (k == r.cut_key && i > r.cut_id))
            return false;
    }
    if (r.min_p > 0 && !(w >= r.min_p))
        return false;
    if (r.typical_cut) {
        uint32_t k = typical_key(r, w);
        if (k < r.typ_key || (k == r.typ_key && i > r.typ_id))
            return false;
    }
    return true;
}

/* ---------------------------------------------------------------- block-wide sums (fixed order: deterministic) */

__device__ uint64_t block_sum_u64(uint64_t v, uint64_t *s_part) {
    for (int off = 16; off; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();
    if (threadIdx.x % 32 == 0)
        s_part[threadIdx.x / 32] = v;
    __syncthreads();
    /* every warp sums the warps' parts with shuffles (a serial loop over them cost each of the row's many sums) */
    const int lane = threadIdx.x % 32;
    uint64_t t = lane < SAMPLE_WARPS ? s_part[lane] : 0;
    for (int off = 16; off; off >>= 1)
        t += __shfl_xor_sync(0xffffffffu, t, off);
    return t;
}

__device__ double block_sum_f64(double v, double *s_part) {
    for (int off = 16; off; off >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();
    if (threadIdx.x % 32 == 0)
        s_part[threadIdx.x / 32] = v;
    __syncthreads();
    double t = 0;
    for (int w = 0; w < SAMPLE_WARPS; w++)
        t += s_part[w];
    return t;
}

/* The exclusive prefix of v over the threads in order, and the total. */
__device__ uint64_t block_scan_u64(uint64_t v, uint64_t *s_part, uint64_t *total) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    uint64_t inc = v;
    for (int off = 1; off < 32; off <<= 1) {
        uint64_t o = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off)
            inc += o;
    }
    __syncthreads();
    if (lane == 31)
        s_part[warp] = inc;
    __syncthreads();
    uint64_t parts = lane < SAMPLE_WARPS ? s_part[lane] : 0; /* the warps' parts, scanned across the lanes */
    for (int off = 1; off < 32; off <<= 1) {
        uint64_t o = __shfl_up_sync(0xffffffffu, parts, off);
        if (lane >= off)
            parts += o;
    }
    *total = __shfl_sync(0xffffffffu, parts, 31);
    const uint64_t before = __shfl_sync(0xffffffffu, parts, warp > 0 ? warp - 1 : 0);
    return (warp > 0 ? before : 0) + inc - v;
}

struct sample_shared {
    uint32_t hist_lo[256], hist_hi[256]; /* a bin's mass: 32-bit halves, as sample_fast_shared's */
    uint32_t hist_n[256];
    uint64_t part[SAMPLE_WARPS];
    uint64_t parts[BLOCK_SUMS_MAX][SAMPLE_WARPS]; /* block_sums_u64 */
    double dpart[SAMPLE_WARPS];
    float fpart[SAMPLE_WARPS], fmin[SAMPLE_WARPS];
    int32_t ipart[SAMPLE_WARPS];
    uint64_t need;
    uint32_t prefix, ties;
    int32_t found;
};

/* Block-wide sums of N values a thread at once: one pair of barriers for all of them. */
template <int N>
__device__ void block_sums_u64(uint64_t (&v)[N], sample_shared *sh) {
    static_assert(N <= BLOCK_SUMS_MAX && SAMPLE_WARPS <= 32, "block_sums_u64");
    const int lane = threadIdx.x % 32;
    for (int k = 0; k < N; k++)
        for (int off = 16; off; off >>= 1)
            v[k] += __shfl_xor_sync(0xffffffffu, v[k], off);
    __syncthreads();
    if (lane == 0)
        for (int k = 0; k < N; k++)
            sh->parts[k][threadIdx.x / 32] = v[k];
    __syncthreads();
    for (int k = 0; k < N; k++) {
        uint64_t t = lane < SAMPLE_WARPS ? sh->parts[k][lane] : 0;
        for (int off = 16; off; off >>= 1)
            t += __shfl_xor_sync(0xffffffffu, t, off);
        v[k] = t;
    }
}

/* *lo, *hi += m as 32-bit halves, the carry out of the low half into the high one: shared memory's 64-bit atomic add
 * is a compare-and-swap loop, which colliding lanes and warps serialize. Exact while the sum stays below 2^64. */
__device__ __forceinline__ void add_mass_halves(unsigned *lo, unsigned *hi, uint64_t m) {
    const unsigned l = (unsigned)m, old = atomicAdd(lo, l);
    const unsigned h = (unsigned)(m >> 32) + (old + l < old ? 1u : 0u);
    if (h)
        atomicAdd(hi, h);
}

/* Adds every lane's mass m (and a count of one) to bin `bin` of the histogram (-1: nothing), one atomic per
 * distinct bin of the warp: the lanes of a bin sum their masses first. Logits crowd into a few bins (the first pass
 * looks at the keys' top byte: sign and exponent), where one atomic per element serialized thousands of them on a
 * single shared address. Integer sums: the result does not depend on the grouping. */
__device__ __forceinline__ void hist_add_warp(sample_shared *sh, int bin, uint64_t m) {
    const unsigned peers = __match_any_sync(0xffffffffu, bin);
    const int lane = threadIdx.x % 32;
    uint64_t sum = 0;
    if (peers == 0xffffffffu) { /* the whole warp in one bin (or none) */
        sum = m;
        for (int off = 16; off; off >>= 1)
            sum += __shfl_xor_sync(0xffffffffu, sum, off);
    } else {
        for (unsigned rest = peers; rest; rest &= rest - 1)
            sum += __shfl_sync(peers, m, __ffs(rest) - 1);
    }
    if (bin >= 0 && lane == __ffs(peers) - 1) {
        if (sum)
            add_mass_halves(&sh->hist_lo[bin], &sh->hist_hi[bin], sum);
        atomicAdd(&sh->hist_n[bin], (unsigned)__popc(peers));
    }
}

/* key of element i for a select: 0 in logit order, 1 in typical order */
__device__ __forceinline__ uint32_t select_key(const sample_row &r, int order, float l, float w) {
    return order ? typical_key(r, w) : sample_key(l);
}

/* Among the kept elements with key K (any key when !match_key), in id order: the id at which the mass (1 each
 * with by_count) first reaches need, or the last such element's when it never does. */
__device__ int32_t scan_ids(const sample_row &r, int order, int match_key, uint32_t K, uint64_t need, int by_count,
                            sample_shared *sh) {
    const int32_t chunk = (r.vocab + SAMPLE_THREADS - 1) / SAMPLE_THREADS;
    const int32_t lo = min(r.vocab, (int32_t)threadIdx.x * chunk), hi = min(r.vocab, lo + chunk);
    uint64_t mine = 0;
    int32_t last = -1;
    for (int32_t i = lo; i < hi; i++) {
        float l = r.x[i], w = sample_weight(r, l);
        if (sample_kept(r, i, l, w) && (!match_key || select_key(r, order, l, w) == K)) {
            mine += by_count ? 1 : sample_fixed(r, w);
            last = i;
        }
    }
    if (threadIdx.x == 0)
        sh->found = -1;
    uint64_t total, before = block_scan_u64(mine, sh->part, &total);
    /* the last element overall, for a need that is never reached (it is not, by construction) */
    int32_t m = last;
    for (int off = 16; off; off >>= 1)
        m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (threadIdx.x % 32 == 0)
        sh->ipart[threadIdx.x / 32] = m;
    __syncthreads();
    if (before < need && before + mine >= need) {
        uint64_t acc = before;
        for (int32_t i = lo; i < hi; i++) {
            float l = r.x[i], w = sample_weight(r, l);
            if (sample_kept(r, i, l, w) && (!match_key || select_key(r, order, l, w) == K)) {
                acc += by_count ? 1 : sample_fixed(r, w);
                if (acc >= need) {
                    sh->found = i;
                    break;
                }
            }
        }
    }
    __syncthreads();
    int32_t id = sh->found;
    if (id < 0)
        for (int w = 0; w < SAMPLE_WARPS; w++)
            id = max(id, sh->ipart[w]);
    __syncthreads();
    return id;
}

/* The element of the kept set at which the mass in order (key descending, id ascending) first reaches need
 * (1 <= need <= the kept total): its key and id. */
__device__ void select_in_order(const sample_row &r, int order, uint64_t need, int by_count, sample_shared *sh,
                                uint32_t *key_out, int32_t *id_out) {
    uint32_t prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS)
            sh->hist_lo[b] = 0, sh->hist_hi[b] = 0, sh->hist_n[b] = 0;
        __syncthreads();
        for (int32_t base = 0; base < r.vocab; base += SAMPLE_THREADS) { /* whole warps: hist_add_warp */
            const int32_t i = base + (int32_t)threadIdx.x;
            int bin = -1;
            uint64_t m = 0;
            if (i < r.vocab) {
                float l = r.x[i], w = sample_weight(r, l);
                if (sample_kept(r, i, l, w)) {
                    uint32_t key = select_key(r, order, l, w);
                    if ((key & mask) == prefix)
                        bin = (int)((key >> shift) & 255), m = by_count ? 1 : sample_fixed(r, w);
                }
            }
            hist_add_warp(sh, bin, m);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            uint64_t cum = 0;
            int b = 255;
            for (; b > 0; b--) {
                const uint64_t m = (uint64_t)sh->hist_hi[b] << 32 | sh->hist_lo[b];
                if (cum + m >= need)
                    break;
                cum += m;
            }
            sh->need = need - cum;
            sh->prefix = prefix | (uint32_t)b << shift;
            sh->ties = sh->hist_n[b];
        }
        __syncthreads();
        prefix = sh->prefix;
        need = sh->need;
        mask |= 255u << shift;
    }
    const uint32_t K = prefix;
    const uint32_t ties = sh->ties;
    __syncthreads();
    *key_out = K;
    if (ties == 1) { /* the usual case: the one element with that key */
        if (threadIdx.x == 0)
            sh->found = -1;
        __syncthreads();
        for (int32_t i = threadIdx.x; i < r.vocab; i += SAMPLE_THREADS) {
            float l = r.x[i], w = sample_weight(r, l);
            if (sample_kept(r, i, l, w) && select_key(r, order, l, w) == K)
                sh->found = i;
        }
        __syncthreads();
        *id_out = sh->found;
        __syncthreads();
        return;
    }
    *id_out = scan_ids(r, order, 1, K, need, by_count, sh);
}

/* ---------------------------------------------------------------- the fast path: buckets, then one bucket sorted */

/* The cuts in logit order (top-k, top-p, with or without min-p) without a radix select over the row.
 * One pass computes every weight once and adds it to a histogram of FAST_BINS buckets of the logit's distance below
 * the maximum, b = min((max - l) * scale, FAST_BINS - 1): monotone in the logit, so every element of a lower bucket
 * comes before every element of a higher one in logit order, and the bucket where a mass (or count) in logit order
 * is reached is found by a scan of the histogram. That bucket's elements (a few dozen in practice: the buckets span
 * the finite logits, or those whose weights are not 0 in fixed point where that is narrower) are gathered into
 * shared memory and sorted (key descending, id ascending), and the exact element is found by a prefix sum among
 * them. The sums are the same integers as the reference's, so the choice is the same; a bucket of more than FAST_CAP
 * elements (long runs of equal logits) falls back to the radix select. A second histogram holds the elements min-p
 * keeps. Typical sampling does the same in typical order, with buckets of the typical distance. */
#define FAST_BINS 4096
#define FAST_CAP 2048
#define FAST_RANK_SORT 256 /* a gathered bucket up to this size is sorted by ranks, larger ones by a bitonic sort */

struct sample_fast_shared {
    /* [0] every finite logit, [1] those min-p keeps; the mass in 32-bit halves (add_mass_halves): a bucket's is
     * below the row's, at most 2^63 (exl_sample_shift) */
    unsigned int mass_lo[2][FAST_BINS], mass_hi[2][FAST_BINS];
    unsigned int count[2][FAST_BINS];
    unsigned long long key[FAST_CAP]; /* the gathered bucket: key << 32 | ~id, sorted descending */
    unsigned long long wi[FAST_CAP];  /* their fixed-point weights, in that order */
    unsigned int mp[FAST_CAP];        /* whether min-p keeps them */
    int n, bucket;                    /* the gathered bucket (-1: none) and its size */
    int found;                        /* a search's bucket or index (-1: none) */
    unsigned long long got_mass, got_count;
};

__device__ __forceinline__ uint64_t fast_mass(const sample_fast_shared *fs, int set, int b) {
    return (uint64_t)fs->mass_hi[set][b] << 32 | fs->mass_lo[set][b];
}

__device__ __forceinline__ void fast_add_mass(sample_fast_shared *fs, int set, int b, uint64_t W) {
    add_mass_halves(&fs->mass_lo[set][b], &fs->mass_hi[set][b], W);
}

__device__ __forceinline__ int fast_bin(float lmax, float bscale, float l) {
    const float d = (lmax - l) * bscale; /* >= 0; NaN (an infinite maximum) goes last */
    return d < (float)(FAST_BINS - 1) ? (int)d : FAST_BINS - 1;
}

/* Typical sampling on the fast path: its set S is the finite logits up to the cut in logit order (key << 32 | ~id at
 * least ckey; 0: no cut) that min-p keeps, q = w / wsum over S, and the buckets are of the typical distance
 * |-log q - ent| (monotone in typical order's key, -distance), over [0, TYPICAL_SPAN). */
#define TYPICAL_SPAN 64.0f
struct typical_set {
    unsigned long long ckey;
    double wsum, ent;
};

__device__ __forceinline__ bool typical_in(const sample_row &r, const typical_set &t, int32_t i, float l, float w) {
    return l > -INFINITY && ((unsigned long long)sample_key(l) << 32 | (uint32_t) ~(uint32_t)i) >= t.ckey &&
           !(r.min_p > 0 && !(w >= r.min_p));
}

/* the distance whose negation typical_key() orders by (infinite where q is 0) */
__device__ __forceinline__ float typical_distance(const typical_set &t, float w) {
    const double q = (double)w / t.wsum;
    return q > 0 ? (float)fabs(-log(q) - t.ent) : INFINITY;
}

__device__ __forceinline__ int typical_bin(float d) {
    const float v = d * ((float)(FAST_BINS - 1) / TYPICAL_SPAN);
    return v < (float)(FAST_BINS - 1) ? (int)v : FAST_BINS - 1;
}

/* The histograms of the finite logits (and of min-p's), or (t) of typical sampling's set by typical distance, the
 * last bucket summed in registers (the far tail, where most of a peaked row lies); returns the total mass. */
__device__ uint64_t fast_histograms(const sample_row &r, float bscale, const typical_set *t, sample_shared *sh,
                                    sample_fast_shared *fs) {
    unsigned int *lo = &fs->mass_lo[0][0], *hi = &fs->mass_hi[0][0], *c = &fs->count[0][0];
    for (int b = threadIdx.x; b < 2 * FAST_BINS; b += SAMPLE_THREADS)
        lo[b] = 0, hi[b] = 0, c[b] = 0;
    if (threadIdx.x == 0)
        fs->bucket = -1;
    __syncthreads();
    uint64_t total = 0, tail_m = 0, tail_c = 0, tail_mp_m = 0, tail_mp_c = 0;
    for_each_logit(r.x, r.vocab, [&](int32_t i, float l) {
        if (!(l > -INFINITY))
            return;
        const float w = sample_weight(r, l);
        if (t && !typical_in(r, *t, i, l, w))
            return;
        const uint64_t W = sample_fixed(r, w);
        const bool mp = !t && r.min_p > 0 && w >= r.min_p;
        const int b = t ? typical_bin(typical_distance(*t, w)) : fast_bin(r.lmax, bscale, l);
        total += W;
        if (b == FAST_BINS - 1) {
            tail_m += W, tail_c++;
            tail_mp_m += mp ? W : 0, tail_mp_c += mp;
            return;
        }
        if (W)
            fast_add_mass(fs, 0, b, W);
        atomicAdd(&fs->count[0][b], 1u);
        if (mp) {
            if (W)
                fast_add_mass(fs, 1, b, W);
            atomicAdd(&fs->count[1][b], 1u);
        }
    });
    uint64_t sums[5] = {total, tail_m, tail_c, tail_mp_m, tail_mp_c};
    block_sums_u64(sums, sh);
    total = sums[0], tail_m = sums[1], tail_c = sums[2], tail_mp_m = sums[3], tail_mp_c = sums[4];
    if (threadIdx.x == 0) {
        fs->mass_lo[0][FAST_BINS - 1] = (unsigned)tail_m, fs->mass_hi[0][FAST_BINS - 1] = (unsigned)(tail_m >> 32);
        fs->mass_lo[1][FAST_BINS - 1] = (unsigned)tail_mp_m,
                                   fs->mass_hi[1][FAST_BINS - 1] = (unsigned)(tail_mp_m >> 32);
        fs->count[0][FAST_BINS - 1] = (unsigned)tail_c, fs->count[1][FAST_BINS - 1] = (unsigned)tail_mp_c;
    }
    __syncthreads();
    return total;
}

/* The bucket of histogram `set` where the count (by_count) or mass in logit order first reaches need, and the mass
 * and count of the buckets before it; -1 when the total is below need. */
__device__ int fast_find_bin(int set, int by_count, uint64_t need, sample_shared *sh, sample_fast_shared *fs,
                             uint64_t *before_mass, uint64_t *before_count) {
    constexpr int PER = FAST_BINS / SAMPLE_THREADS;
    const int b0 = threadIdx.x * PER;
    uint64_t lm = 0, lc = 0;
    for (int j = 0; j < PER; j++)
        lm += fast_mass(fs, set, b0 + j), lc += fs->count[set][b0 + j];
    if (threadIdx.x == 0)
        fs->found = -1;
    uint64_t tm, tc;
    uint64_t bm = block_scan_u64(lm, sh->part, &tm);
    uint64_t bc = block_scan_u64(lc, sh->part, &tc);
    const uint64_t before = by_count ? bc : bm, mine = by_count ? lc : lm;
    if (before < need && before + mine >= need) {
        for (int j = 0; j < PER; j++) {
            const uint64_t vm = fast_mass(fs, set, b0 + j), vc = fs->count[set][b0 + j];
            if ((by_count ? bc + vc : bm + vm) >= need) {
                fs->found = b0 + j, fs->got_mass = bm, fs->got_count = bc;
                break;
            }
            bm += vm, bc += vc;
        }
    }
    __syncthreads();
    const int bin = fs->found;
    *before_mass = fs->got_mass, *before_count = fs->got_count;
    __syncthreads();
    return bin;
}

/* The mass and count of histogram `set` over the buckets before `bin`. */
__device__ void fast_below(int set, int bin, sample_shared *sh, sample_fast_shared *fs, uint64_t *mass,
                           uint64_t *count) {
    uint64_t lm = 0, lc = 0;
    for (int b = threadIdx.x; b < bin; b += SAMPLE_THREADS)
        lm += fast_mass(fs, set, b), lc += fs->count[set][b];
    uint64_t sums[2] = {lm, lc};
    block_sums_u64(sums, sh);
    *mass = sums[0], *count = sums[1];
}

/* Bucket `bin`'s elements into fs->key (sorted: logit order, or typical order with t), wi and mp; false when it
 * holds more than FAST_CAP. */
__device__ bool fast_gather(const sample_row &r, float bscale, const typical_set *t, int bin, sample_fast_shared *fs) {
    if (fs->bucket == bin)
        return true;
    const unsigned n = fs->count[0][bin];
    if (n > FAST_CAP)
        return false;
    __syncthreads(); /* every thread has read fs->bucket before it changes */
    if (threadIdx.x == 0)
        fs->n = 0, fs->bucket = bin;
    __syncthreads();
    for_each_logit(r.x, r.vocab, [&](int32_t i, float l) {
        uint32_t key = 0;
        if (!t) {
            if (l > -INFINITY && fast_bin(r.lmax, bscale, l) == bin)
                key = sample_key(l);
        } else if (l > -INFINITY) {
            const float w = sample_weight(r, l);
            if (typical_in(r, *t, i, l, w)) {
                const float d = typical_distance(*t, w);
                key = typical_bin(d) == bin ? sample_key(-d) : 0; /* typical_key()'s */
            }
        }
        if (key) /* every finite logit's key, and typical order's, is above 0 */
            fs->key[atomicAdd(&fs->n, 1)] = (unsigned long long)key << 32 | (uint32_t) ~(uint32_t)i;
    });
    if (n <= FAST_RANK_SORT) { /* the usual bucket: each element's rank among the distinct keys, three barriers */
        __syncthreads();
        for (unsigned j = threadIdx.x; j < n; j += SAMPLE_THREADS) {
            const unsigned long long k = fs->key[j];
            unsigned rank = 0;
            for (unsigned q = 0; q < n; q++)
                rank += fs->key[q] > k;
            fs->wi[rank] = k; /* wi as scratch: the weights come after */
        }
        __syncthreads();
        for (unsigned j = threadIdx.x; j < n; j += SAMPLE_THREADS)
            fs->key[j] = fs->wi[j];
        __syncthreads();
    } else { /* bitonic sort, descending, over a power of two padded with keys below every finite logit's */
        unsigned m = 1;
        while (m < n)
            m <<= 1;
        for (unsigned j = n + threadIdx.x; j < m; j += SAMPLE_THREADS)
            fs->key[j] = 0;
        __syncthreads();
        for (unsigned k = 2; k <= m; k <<= 1)
            for (unsigned j = k >> 1; j > 0; j >>= 1) {
                for (unsigned t = threadIdx.x; t < m; t += SAMPLE_THREADS) {
                    const unsigned o = t ^ j;
                    if (o > t) {
                        const unsigned long long a = fs->key[t], b = fs->key[o];
                        if ((t & k) == 0 ? a < b : a > b)
                            fs->key[t] = b, fs->key[o] = a;
                    }
                }
                __syncthreads();
            }
    }
    for (unsigned j = threadIdx.x; j < n; j += SAMPLE_THREADS) {
        const float w = sample_weight(r, r.x[(uint32_t) ~(uint32_t)fs->key[j]]);
        fs->wi[j] = sample_fixed(r, w);
        fs->mp[j] = r.min_p > 0 && w >= r.min_p;
    }
    __syncthreads();
    return true;
}

/* Among the gathered bucket's elements of `set` (1: min-p's), in order: the index at which the count (by_count)
 * or mass first reaches need (-1: never), and the mass and count up to it, inclusive. One warp, 32 at a time. */
__device__ int fast_find_in_bucket(int set, int by_count, uint64_t need, sample_fast_shared *fs, uint64_t *mass,
                                   uint64_t *count) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        const int n = fs->n;
        uint64_t acc_m = 0, acc_c = 0;
        int found = -1;
        for (int base = 0; base < n && found < 0; base += 32) {
            const int j = base + lane;
            const bool in = j < n && (set == 0 || fs->mp[j]);
            uint64_t im = in ? fs->wi[j] : 0, ic = in ? 1 : 0;
            for (int off = 1; off < 32; off <<= 1) {
                const uint64_t om = __shfl_up_sync(0xffffffffu, im, off), oc = __shfl_up_sync(0xffffffffu, ic, off);
                if (lane >= off)
                    im += om, ic += oc;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, in && (by_count ? acc_c + ic : acc_m + im) >= need);
            const int src = hit ? __ffs(hit) - 1 : 31;
            const uint64_t sm = __shfl_sync(0xffffffffu, im, src), sc = __shfl_sync(0xffffffffu, ic, src);
            acc_m += sm, acc_c += sc;
            if (hit)
                found = base + src;
        }
        if (lane == 0)
            fs->found = found, fs->got_mass = acc_m, fs->got_count = acc_c;
    }
    __syncthreads();
    const int idx = fs->found;
    *mass = fs->got_mass, *count = fs->got_count;
    __syncthreads();
    return idx;
}

/* The mass and count of the gathered elements of `set` up to index last, inclusive. */
__device__ void fast_sum_in_bucket(int set, int last, sample_shared *sh, sample_fast_shared *fs, uint64_t *mass,
                                   uint64_t *count) {
    uint64_t lm = 0, lc = 0;
    for (int j = threadIdx.x; j <= last; j += SAMPLE_THREADS)
        if (set == 0 || fs->mp[j])
            lm += fs->wi[j], lc++;
    uint64_t sums[2] = {lm, lc};
    block_sums_u64(sums, sh);
    *mass = sums[0], *count = sums[1];
}

/* The element of `set` at which the count (by_count) or mass in logit order first reaches need: its index in the
 * gathered bucket (which it leaves gathered) and the mass and count of `set` up to it, inclusive; -1 to fall back. */
__device__ int fast_select(const sample_row &r, float bscale, const typical_set *t, int set, int by_count,
                           uint64_t need, sample_shared *sh, sample_fast_shared *fs, uint64_t *mass, uint64_t *count) {
    uint64_t bm, bc, im, ic;
    const int bin = fast_find_bin(set, by_count, need, sh, fs, &bm, &bc);
    if (bin < 0 || !fast_gather(r, bscale, t, bin, fs))
        return -1;
    const int idx = fast_find_in_bucket(set, by_count, need - (by_count ? bc : bm), fs, &im, &ic);
    *mass = bm + im, *count = bc + ic;
    return idx;
}

__device__ __forceinline__ uint64_t fast_mass_target(float fraction, uint64_t total) {
    const double t = ceil((double)fraction * (double)total);
    return t < 1 ? 1 : t >= (double)total ? total : (uint64_t)t;
}

/* Typical sampling's cut and the draw in typical order over its set (t.ckey set); false to fall back. */
__device__ bool fast_typical(const exl_sample_params &p, const sample_row &r, typical_set t, double u,
                             sample_shared *sh, sample_fast_shared *fs, exl_sample_result *res) {
    uint64_t mass = 0, count = 0;
    double ws = 0;
    for_each_logit(r.x, r.vocab, [&](int32_t i, float l) {
        const float w = sample_weight(r, l);
        if (typical_in(r, t, i, l, w))
            mass += sample_fixed(r, w), ws += w, count++;
    });
    uint64_t sums[2] = {mass, count};
    block_sums_u64(sums, sh);
    const uint64_t total = sums[0];
    if (sums[1] == 0)
        return false; /* min-p kept nothing: the radix path's answer */
    t.wsum = block_sum_f64(ws, sh->dpart);
    double ent = 0;
    for_each_logit(r.x, r.vocab, [&](int32_t i, float l) {
        const float w = sample_weight(r, l);
        const double q = (double)w / t.wsum;
        if (typical_in(r, t, i, l, w) && q > 0)
            ent -= q * log(q);
    });
    t.ent = block_sum_f64(ent, sh->dpart);
    fast_histograms(r, 0, &t, sh, fs);
    uint64_t kept_mass, kept;
    if (fast_select(r, 0, &t, 0, 0, fast_mass_target(p.typical_p, total), sh, fs, &kept_mass, &kept) < 0)
        return false;
    uint64_t need = 1;
    if (kept > 1) {
        need = (uint64_t)floor(u * (double)kept_mass) + 1;
        need = need > kept_mass ? kept_mass : need;
    }
    uint64_t m, c;
    const int idx = fast_select(r, 0, &t, 0, kept == 1, need, sh, fs, &m, &c);
    if (idx < 0)
        return false;
    res->id = (int32_t) ~(uint32_t)fs->key[idx], res->n_kept = (int32_t)kept;
    return true;
}

/* The row's result by the fast path (top-k and/or top-p, then min-p, then typical; the draw in logit or typical
 * order); false to fall back to the radix select (nothing written but shared memory). r: the row with no cut yet
 * and its min_p set. */
__device__ bool sample_fast(const exl_sample_params &p, const sample_row &r, int32_t n_finite, float lmin, double u,
                            int shift, sample_shared *sh, sample_fast_shared *fs, exl_sample_result *res) {
    /* the buckets span the finite logits, or those whose weight is at least 2^-(shift + 2) (below it W is 0) */
    const float span = fminf((float)(shift + 2) * 0.6931472f * p.temperature, r.lmax - lmin);
    float bscale = (float)(FAST_BINS - 1) / span; /* span 0 (equal logits): all in the first bucket */
    bscale = bscale < 1e30f ? bscale : 1e30f;
    const bool top_k = p.top_k > 0 && p.top_k < r.vocab && n_finite >= p.top_k;
    if (!top_k && !(p.top_p < 1.0f)) /* typical alone */
        return fast_typical(p, r, typical_set{0, 0, 0}, u, sh, fs, res);
    const uint64_t total_all = fast_histograms(r, bscale, NULL, sh, fs);
    uint64_t cut_mass = total_all, cut_count = (uint64_t)n_finite;
    int cut = -1; /* the cut's index in the gathered bucket */
    if (top_k && (cut = fast_select(r, bscale, NULL, 0, 1, (uint64_t)p.top_k, sh, fs, &cut_mass, &cut_count)) < 0)
        return false;
    if (p.top_p < 1.0f) {
        const uint64_t need = fast_mass_target(p.top_p, cut_mass);
        if ((cut = fast_select(r, bscale, NULL, 0, 0, need, sh, fs, &cut_mass, &cut_count)) < 0)
            return false;
    }
    if (p.typical_p < 1.0f)
        return fast_typical(p, r, typical_set{fs->key[cut], 0, 0}, u, sh, fs, res);
    uint64_t total = cut_mass, kept = cut_count;
    const int set = r.min_p > 0 ? 1 : 0;
    if (set) { /* min-p's elements up to the cut, whose bucket is the one gathered */
        uint64_t bm, bc, im, ic;
        fast_below(1, fs->bucket, sh, fs, &bm, &bc);
        fast_sum_in_bucket(1, cut, sh, fs, &im, &ic);
        total = bm + im, kept = bc + ic;
    }
    if (kept == 0) { /* min-p above 1 keeps nothing */
        res->id = -1, res->n_kept = 0;
        return true;
    }
    uint64_t need = 1;
    if (kept > 1) {
        need = (uint64_t)floor(u * (double)total) + 1;
        need = need > total ? total : need;
    }
    uint64_t m, c;
    const int idx = fast_select(r, bscale, NULL, set, kept == 1, need, sh, fs, &m, &c);
    if (idx < 0)
        return false;
    res->id = (int32_t) ~(uint32_t)fs->key[idx], res->n_kept = (int32_t)kept;
    return true;
}

/* ---------------------------------------------------------------- the radix path */

/* The draw in id order over the kept set (no cut in force: temperature or min-p alone): the id at which the mass
 * in id order reaches floor(u * total) + 1 (the one candidate's where one is kept, -1 where none) and the count. One
 * pass over contiguous id ranges, one a warp (its lanes strided, so the loads coalesce), gives the total, the count
 * and each range's prefix; the warp whose range holds the target walks it again, 32 ids at a time. */
__device__ int32_t draw_in_id_order(const sample_row &r, double u, sample_shared *sh, int32_t *n_kept) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int32_t span = (r.vocab + SAMPLE_WARPS - 1) / SAMPLE_WARPS;
    const int32_t lo = min(r.vocab, warp * span), hi = min(r.vocab, lo + span);
    uint64_t mine_m = 0, mine_c = 0;
    for (int32_t base = lo + lane; base < hi; base += 32 * SAMPLE_UNROLL) {
        float v[SAMPLE_UNROLL];
#pragma unroll
        for (int k = 0; k < SAMPLE_UNROLL; k++)
            v[k] = base + 32 * k < hi ? r.x[base + 32 * k] : -INFINITY;
#pragma unroll
        for (int k = 0; k < SAMPLE_UNROLL; k++) {
            const float w = sample_weight(r, v[k]);
            if (base + 32 * k < hi && sample_kept(r, base + 32 * k, v[k], w))
                mine_m += sample_fixed(r, w), mine_c++;
        }
    }
    for (int off = 16; off; off >>= 1) {
        mine_m += __shfl_xor_sync(0xffffffffu, mine_m, off);
        mine_c += __shfl_xor_sync(0xffffffffu, mine_c, off);
    }
    if (threadIdx.x == 0)
        sh->found = -1;
    uint64_t total, count; /* the warps' sums, held by their lane 0, scanned in warp order */
    const uint64_t before_m = __shfl_sync(0xffffffffu, block_scan_u64(lane ? 0 : mine_m, sh->part, &total), 0);
    const uint64_t before_c = __shfl_sync(0xffffffffu, block_scan_u64(lane ? 0 : mine_c, sh->part, &count), 0);
    *n_kept = (int32_t)count;
    const bool by_count = count == 1;
    uint64_t need = 1;
    if (count > 1) {
        need = (uint64_t)floor(u * (double)total) + 1;
        need = need > total ? total : need;
    }
    uint64_t acc = by_count ? before_c : before_m;
    if (count > 0 && acc < need && acc + (by_count ? mine_c : mine_m) >= need) { /* warp-uniform */
        for (int32_t base = lo; base < hi; base += 32) {
            const int32_t i = base + lane;
            const float l = i < hi ? r.x[i] : -INFINITY, w = sample_weight(r, l);
            const bool in = i < hi && sample_kept(r, i, l, w);
            uint64_t inc = in ? (by_count ? 1 : sample_fixed(r, w)) : 0;
            for (int off = 1; off < 32; off <<= 1) {
                const uint64_t o = __shfl_up_sync(0xffffffffu, inc, off);
                if (lane >= off)
                    inc += o;
            }
            const unsigned hit = __ballot_sync(0xffffffffu, in && acc + inc >= need);
            if (hit) {
                if (lane == __ffs(hit) - 1)
                    sh->found = i;
                break;
            }
            acc += __shfl_sync(0xffffffffu, inc, 31);
        }
    }
    __syncthreads();
    const int32_t id = sh->found;
    __syncthreads();
    return id;
}

/* The row's result by radix selects (what the fast path does not take: big buckets) or, with no cut in force, the
 * draw in id order. Not inlined: its registers stay out of the fast path's. */
__device__ __noinline__ void sample_radix(const exl_sample_params &p, sample_row r, int32_t n_finite, double u,
                                          sample_shared *sh, exl_sample_result *res) {
    const int tid = threadIdx.x;
    const float *x = r.x;
    const int32_t vocab = r.vocab;
    const bool top_k = p.top_k > 0 && p.top_k < vocab && n_finite >= p.top_k;
    int order = -1; /* the draw's: -1 id order, 0 logit order, 1 typical order */
    if (top_k) {
        select_in_order(r, 0, (uint64_t)p.top_k, 1, sh, &r.cut_key, &r.cut_id);
        r.logit_cut = 1;
        order = 0;
    }
    if (p.top_p < 1.0f) {
        uint64_t mass = 0;
        for (int32_t i = tid; i < vocab; i += SAMPLE_THREADS) {
            float l = x[i], w = sample_weight(r, l);
            mass += sample_kept(r, i, l, w) ? sample_fixed(r, w) : 0;
        }
        uint64_t total = block_sum_u64(mass, sh->part);
        double t = ceil((double)p.top_p * (double)total);
        uint64_t need = t < 1 ? 1 : t >= (double)total ? total : (uint64_t)t;
        uint32_t key;
        int32_t id;
        select_in_order(r, 0, need, 0, sh, &key, &id);
        r.cut_key = key, r.cut_id = id, r.logit_cut = 1;
        order = 0;
    }
    r.min_p = p.min_p;
    if (p.typical_p < 1.0f) {
        uint64_t mass = 0;
        double ws = 0;
        for (int32_t i = tid; i < vocab; i += SAMPLE_THREADS) {
            float l = x[i], w = sample_weight(r, l);
            if (sample_kept(r, i, l, w))
                mass += sample_fixed(r, w), ws += w;
        }
        uint64_t total = block_sum_u64(mass, sh->part);
        r.wsum = block_sum_f64(ws, sh->dpart);
        double ent = 0;
        for (int32_t i = tid; i < vocab; i += SAMPLE_THREADS) {
            float l = x[i], w = sample_weight(r, l);
            double q = (double)w / r.wsum;
            if (sample_kept(r, i, l, w) && q > 0)
                ent -= q * log(q);
        }
        r.ent = block_sum_f64(ent, sh->dpart);
        double t = ceil((double)p.typical_p * (double)total);
        uint64_t need = t < 1 ? 1 : t >= (double)total ? total : (uint64_t)t;
        select_in_order(r, 1, need, 0, sh, &r.typ_key, &r.typ_id);
        r.typical_cut = 1;
        order = 1;
    }
    if (order < 0) {
        res->id = draw_in_id_order(r, u, sh, &res->n_kept);
        return;
    }
    uint64_t mass = 0, count = 0;
    for (int32_t i = tid; i < vocab; i += SAMPLE_THREADS) {
        float l = x[i], w = sample_weight(r, l);
        if (sample_kept(r, i, l, w))
            mass += sample_fixed(r, w), count++;
    }
    uint64_t total = block_sum_u64(mass, sh->part);
    res->n_kept = (int32_t)block_sum_u64(count, sh->part);
    uint64_t need = 1;
    if (res->n_kept > 1) {
        need = (uint64_t)floor(u * (double)total) + 1;
        need = need > total ? total : need;
    }
    if (res->n_kept == 1) { /* the one candidate */
        res->id = scan_ids(r, 0, 0, 0, need, res->n_kept == 1, sh);
    } else {
        uint32_t key;
        select_in_order(r, order, need, 0, sh, &key, &res->id);
    }
}

/* ---------------------------------------------------------------- the kernel */

/* ids, kept: NULL, or (sample_queue) the token table the next step reads and each row's n_kept, kept on the device
 * for a chained launch's choice of uniform */
__global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_kernel(exl_sample_result *out, float *logits, int32_t vocab, const exl_sample_params *params,
                  const exl_logit_edit *edits, float *orig, int shift, int32_t *ids, int32_t *kept, int chained) {
    exl_pdl_start();
    __shared__ sample_shared sh;
    extern __shared__ __align__(16) unsigned char sample_dynamic[];
    sample_fast_shared *fs = (sample_fast_shared *)sample_dynamic;
    const exl_sample_params p = params[blockIdx.x];
    const double u = chained && kept[blockIdx.x] > 1 ? p.u_next : p.u; /* read before tid 0 writes it, below */
    float *x = logits + (int64_t)blockIdx.x * vocab;
    const exl_logit_edit *e = edits + p.first_edit;
    const int32_t n_edits = p.n_bias + p.n_penalized + p.n_banned;
    const int tid = threadIdx.x;

    /* the unedited log-sum-exp and logits of edited ids, for the log-probability */
    float lse = 0;
    if (p.want_logprob) {
        float m = -INFINITY;
        for (int32_t i = tid; i < vocab; i += SAMPLE_THREADS)
            m = fmaxf(m, x[i]);
        for (int off = 16; off; off >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        if (tid % 32 == 0)
            sh.fpart[tid / 32] = m;
        __syncthreads();
        m = -INFINITY;
        for (int w = 0; w < SAMPLE_WARPS; w++)
            m = fmaxf(m, sh.fpart[w]);
        double s = 0;
        for (int32_t i = tid; i < vocab; i += SAMPLE_THREADS)
            s += exp((double)x[i] - m);
        lse = m + (float)log(block_sum_f64(s, sh.dpart));
        for (int32_t i = tid; i < n_edits; i += SAMPLE_THREADS)
            orig[p.first_edit + i] = x[e[i].id];
        __syncthreads();
    }

    /* edits: biases in order, then the penalized ids (distinct), then the bans */
    if (tid == 0)
        for (int32_t i = 0; i < p.n_bias; i++)
            x[e[i].id] += e[i].v;
    __syncthreads();
    for (int32_t i = tid; i < p.n_penalized; i += SAMPLE_THREADS) {
        const exl_logit_edit pe = e[p.n_bias + i];
        float l = x[pe.id];
        if (p.repetition_penalty != 1.0f)
            l = l > 0 ? l / p.repetition_penalty : l * p.repetition_penalty;
        x[pe.id] = l - __fmul_rn(p.frequency_penalty, pe.v) - p.presence_penalty; /* rounded, not fused: the CPU's */
    }
    __syncthreads();
    for (int32_t i = tid; i < p.n_banned; i += SAMPLE_THREADS)
        x[e[p.n_bias + p.n_penalized + i].id] = -INFINITY;
    __syncthreads();

    /* the argmax (lowest id among equals), the finite count and the least finite logit */
    float bv = -INFINITY, lo = INFINITY;
    int32_t bi = -1, finite = 0;
    for_each_logit(x, vocab, [&](int32_t i, float v) {
        if (v > bv)
            bv = v, bi = i;
        finite += v > -INFINITY;
        lo = v > -INFINITY ? fminf(lo, v) : lo;
    });
    for (int off = 16; off; off >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        int32_t oi = __shfl_xor_sync(0xffffffffu, bi, off);
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi)))
            bv = ov, bi = oi;
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
    }
    if (tid % 32 == 0)
        sh.fpart[tid / 32] = bv, sh.ipart[tid / 32] = bi, sh.fmin[tid / 32] = lo;
    int32_t n_finite = (int32_t)block_sum_u64((uint64_t)finite, sh.part); /* synchronizes fpart, ipart, fmin */
    for (int w = 0; w < SAMPLE_WARPS; w++) {
        float ov = sh.fpart[w];
        int32_t oi = sh.ipart[w];
        if (oi >= 0 && (bi < 0 || ov > bv || (ov == bv && oi < bi)))
            bv = ov, bi = oi;
        lo = fminf(lo, sh.fmin[w]);
    }
    __syncthreads();

    exl_sample_result res = {-1, 0, 0, 0};
    if (bi >= 0 && p.temperature <= 0) {
        res.id = bi, res.n_kept = 1;
    } else if (bi >= 0) {
        sample_row r = {};
        r.x = x;
        r.vocab = vocab;
        r.lmax = bv;
        r.inv_t = 1.0f / p.temperature;
        r.scale = ldexp(1.0, shift);
        r.w_zero = ldexpf(1.0f, -(shift + 1));
        const bool top_k = p.top_k > 0 && p.top_k < vocab && n_finite >= p.top_k;
        sample_row fast_row = r;
        fast_row.min_p = p.min_p;
        const bool fast = (top_k || p.top_p < 1.0f || p.typical_p < 1.0f) &&
                          sample_fast(p, fast_row, n_finite, lo, u, shift, &sh, fs, &res);
        if (!fast)
            sample_radix(p, r, n_finite, u, &sh, &res);
    }
    if (tid == 0) {
        if (p.want_logprob && res.id >= 0) {
            float raw = x[res.id];
            for (int32_t i = 0; i < n_edits; i++) /* the first edit of the id saw its unedited logit */
                if (e[i].id == res.id) {
                    raw = orig[p.first_edit + i];
                    break;
                }
            res.logprob = raw - lse;
        }
        out[blockIdx.x] = res;
        if (ids) {
            ids[blockIdx.x] = res.id < 0 ? 0 : res.id;
            kept[blockIdx.x] = res.n_kept;
        }
    }
}

static exl_status check_edits(int32_t rows, int32_t vocab, const exl_sample_params *params, const exl_logit_edit *edits,
                              int32_t n_edits) {
    for (int32_t r = 0; r < rows; r++) {
        const exl_sample_params *p = &params[r];
        int64_t end = (int64_t)p->first_edit + p->n_bias + p->n_penalized + p->n_banned;
        if (p->first_edit < 0 || p->n_bias < 0 || p->n_penalized < 0 || p->n_banned < 0 || end > n_edits)
            return exl_cuda_fail(EXL_ERR_ARG, "sample: row %d's edits lie outside the %d given", r, n_edits);
        for (int64_t e = p->first_edit; e < end; e++)
            if (edits[e].id < 0 || edits[e].id >= vocab)
                return exl_cuda_fail(EXL_ERR_ARG, "sample: row %d edits token %d of a vocabulary of %d", r, edits[e].id,
                                     vocab);
    }
    return EXL_OK;
}

/* The settings and edits copied down (in stream order: a launch queued before has read its own) and the kernel
 * launched, its results to d_out, or where launch_out points when that is set. */
static exl_status launch_sample(exl_cuda_backend *cb, exl_sample_result **d_out, exl_sample_result *launch_out,
                                float *logits, int32_t rows, int32_t vocab, const exl_sample_params *params,
                                const exl_logit_edit *edits, int32_t n_edits, int32_t *ids, int chained) {
    exl_cuda_graph_finish(cb);
    size_t p_bytes = (size_t)rows * sizeof *params, r_bytes = (size_t)rows * sizeof **d_out;
    size_t e_bytes = (size_t)n_edits * sizeof *edits, o_bytes = (size_t)n_edits * sizeof(float);
    size_t bytes = r_bytes + p_bytes + e_bytes + o_bytes;
    if (!exl_cuda_ensure(cb, &cb->sample_buf, &cb->sample_bytes, bytes, "sampling settings"))
        return exl_cuda_take_sticky(cb);
    char *base = (char *)cb->sample_buf;
    *d_out = (exl_sample_result *)base;
    exl_sample_params *d_params = (exl_sample_params *)(base + r_bytes);
    exl_logit_edit *d_edits = (exl_logit_edit *)(base + r_bytes + p_bytes);
    float *d_orig = (float *)(base + r_bytes + p_bytes + e_bytes);
    CUDA_CHECK(cudaMemcpyAsync(d_params, params, p_bytes, cudaMemcpyHostToDevice, cb->stream), "sampling settings");
    if (e_bytes)
        CUDA_CHECK(cudaMemcpyAsync(d_edits, edits, e_bytes, cudaMemcpyHostToDevice, cb->stream), "logit edits");
    const size_t smem = sizeof(sample_fast_shared);
    static size_t allowed[EXL_CUDA_MAX_DEVICES];
    if (!exl_cuda_smem_opt_in(cb, (const void *)sample_kernel, smem, allowed)) {
        exl_cuda_check_launch(cb, "sample shared memory");
        return exl_cuda_take_sticky(cb);
    }
    exl_cuda_launch(cb, sample_kernel, dim3((unsigned)rows), dim3(SAMPLE_THREADS), smem,
                    launch_out ? launch_out : *d_out, logits, vocab, (const exl_sample_params *)d_params,
                    (const exl_logit_edit *)d_edits, d_orig, exl_sample_shift(vocab), ids,
                    ids ? cb->sample_kept : (int32_t *)NULL, chained);
    exl_cuda_check_launch(cb, "sample");
    return EXL_OK;
}

exl_status exl_cuda_sample(exl_backend *be, exl_sample_result *out, float *logits, int32_t rows, int32_t vocab,
                           const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits) {
    exl_cuda_backend *cb = exl_cuda(be);
    EXL_TRY(check_edits(rows, vocab, params, edits, n_edits));
    if (rows <= 0)
        return EXL_OK;
    exl_sample_result *d_out;
    EXL_TRY(launch_sample(cb, &d_out, NULL, logits, rows, vocab, params, edits, n_edits, NULL, 0));
    CUDA_CHECK(cudaMemcpyAsync(out, d_out, (size_t)rows * sizeof *out, cudaMemcpyDeviceToHost, cb->stream),
               "sampled tokens");
    CUDA_CHECK(cudaStreamSynchronize(cb->stream), "sample");
    return exl_cuda_take_sticky(cb);
}

/* ---------------------------------------------------------------- queued ahead of the host */

static int queue_ready(exl_cuda_backend *cb) {
    if (cb->sample_ring)
        return 1;
    exl_cuda_graph_flush(cb); /* no allocation inside a capture */
    cudaError_t e = cudaHostAlloc((void **)&cb->sample_ring,
                                  sizeof(exl_sample_result) * EXL_ARGMAX_KEEP * EXL_ARGMAX_ROWS, cudaHostAllocMapped);
    if (e == cudaSuccess)
        e = cudaMalloc((void **)&cb->sample_kept, EXL_ARGMAX_ROWS * sizeof(int32_t));
    if (e == cudaSuccess)
        e = cudaMemsetAsync(cb->sample_kept, 0, EXL_ARGMAX_ROWS * sizeof(int32_t), cb->stream);
    for (int i = 0; i < EXL_ARGMAX_KEEP && e == cudaSuccess; i++)
        e = cudaEventCreateWithFlags(&cb->sample_done[i], cudaEventDisableTiming);
    if (e != cudaSuccess) {
        cudaGetLastError();
        exl_cuda_sample_free(cb);
        exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: setting up sampled tokens ahead of the host: %s", cudaGetErrorString(e));
        return 0;
    }
    return 1;
}

void exl_cuda_sample_free(exl_cuda_backend *cb) {
    for (int i = 0; i < EXL_ARGMAX_KEEP; i++)
        if (cb->sample_done[i])
            cudaEventDestroy(cb->sample_done[i]), cb->sample_done[i] = NULL;
    cudaFreeHost(cb->sample_ring);
    cudaFree(cb->sample_kept);
    cb->sample_ring = NULL;
    cb->sample_kept = NULL;
}

int64_t exl_cuda_sample_queue(exl_backend *be, int32_t *ids, float *logits, int32_t rows, int32_t vocab,
                              const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits,
                              int chained) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (rows < 1 || rows > EXL_ARGMAX_ROWS || vocab < 1) {
        exl_cuda_fail(EXL_ERR_ARG, "sample_queue: %d rows of %d (1 .. %d rows)", rows, vocab, EXL_ARGMAX_ROWS);
        return -1;
    }
    if (check_edits(rows, vocab, params, edits, n_edits) != EXL_OK)
        return -1;
    if (!queue_ready(cb))
        return -1;
    int slot = (int)(cb->sample_issued % EXL_ARGMAX_KEEP);
    exl_sample_result *ring = NULL, *d_out;
    if (cudaHostGetDevicePointer((void **)&ring, cb->sample_ring, 0) != cudaSuccess) {
        cudaGetLastError();
        exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: sampled tokens are not mapped for the GPU");
        return -1;
    }
    if (launch_sample(cb, &d_out, ring + slot * EXL_ARGMAX_ROWS, logits, rows, vocab, params, edits, n_edits, ids,
                      chained) != EXL_OK)
        return -1;
    cudaError_t e = cudaEventRecord(cb->sample_done[slot], cb->stream);
    if (e != cudaSuccess) {
        exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: sample event: %s", cudaGetErrorString(e));
        return -1;
    }
    if (exl_cuda_take_sticky(cb) != EXL_OK)
        return -1;
    cb->sample_rows[slot] = rows;
    return cb->sample_issued++;
}

exl_status exl_cuda_sample_wait(exl_backend *be, int64_t ticket, exl_sample_result *out, int32_t rows) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb); /* what was queued after the ticket runs while the host waits */
    if (ticket < 0 || ticket >= cb->sample_issued || cb->sample_issued - ticket > EXL_ARGMAX_KEEP)
        return exl_cuda_fail(EXL_ERR_ARG, "sample_wait: ticket %lld is not among the last %d of %lld",
                             (long long)ticket, EXL_ARGMAX_KEEP, (long long)cb->sample_issued);
    int slot = (int)(ticket % EXL_ARGMAX_KEEP);
    if (rows != cb->sample_rows[slot])
        return exl_cuda_fail(EXL_ERR_ARG, "sample_wait: ticket %lld has %d rows, not %d", (long long)ticket,
                             cb->sample_rows[slot], rows);
    CUDA_CHECK(cudaEventSynchronize(cb->sample_done[slot]), "waiting for sampled tokens");
    EXL_TRY(exl_cuda_take_sticky(cb));
    const volatile exl_sample_result *r = cb->sample_ring + slot * EXL_ARGMAX_ROWS;
    for (int32_t i = 0; i < rows; i++)
        out[i] = (exl_sample_result){r[i].id, r[i].n_kept, r[i].logprob, 0};
    return EXL_OK;
}
