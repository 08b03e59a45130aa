/* cuda_attention.cu - causal attention of new queries over the paged fp16 KV cache.
 *
 * Decode (decode-sized steps, cuda_internal.h: at most EXL_CUDA_DECODE_MAX_Q new tokens per sequence, or
 * EXL_CUDA_VERIFY_MAX_Q in a verification step): "flash decoding". Each block takes one (row, head) and one split
 * of the keys that row sees (the causal mask among a sequence's new tokens); its 4 warps score 32 keys at a time
 * (one key per lane, 16-byte K loads), keep an online softmax, and accumulate V with one
 * output dimension per lane. Splits leave (max, sum, acc) partials that a second kernel
 * merges; for head_dim 64 and 128 a variant loads a warp's 32 K rows into registers and V
 * rows into shared memory at once (attn_decode_fast_kernel), and up to 256 keys take one
 * split of 8 warps with no merge; in steps of one new token a sequence it also does the rope
 * and KV-cache store of that token (exl_cuda_run_rope_attention). Prefill: for head_dim 64 and
 * 128 on sm_80+, tensor cores with fp16 operands (attn_prefill_tc_kernel; hi + lo, ~22 bits, with
 * EXL_CUDA_EXACT_PREFILL=1; its tile source reads the fp16 cache, or a quantized one for cuda_kv_quant.cu);
 * else for head_dim 64, 128 and 256 a block takes 64 queries of one head and 32-64 keys at a
 * time, each thread a 4 x 2-4 tile of scores and 4 rows of the output
 * (attn_prefill_tiled_kernel); other head dims, 16 queries a block and 32 keys at a time,
 * shared by its 4 warps (4 queries each). Soft-capped scores (Gemma 2) take the plain decode and prefill kernels
 * (attn_decode_kernel, attn_prefill_kernel), the only ones that cap them. Keys outside a layer's sliding window are
 * skipped by all. fp32 arithmetic outside the tensor cores. */
#include "backend/cuda/cuda_kv_side.cuh"
#include "backend/cuda/cuda_mma.cuh"

#include <math.h>

#define MAX_HEAD_DIM 256
#define MAX_DPL (MAX_HEAD_DIM / 32) /* output dimensions per lane */
#define ATT_WARPS 4
/* the fast decode kernel's V row stride in halves, and its shared memory for W warps */
#define FAST_VS(hd) ((hd) + 8)
#define FAST_SMEM(hd, w) ((size_t)(w)*KEY_BLOCK * FAST_VS(hd) * sizeof(__half))
/* contexts of up to SHORT_WARPS * KEY_BLOCK keys: one split of SHORT_WARPS warps, a key block each
 * (no combine), where the GPU gives a block their shared memory (exl_cuda_attention_init) */
#define SHORT_WARPS 8
static int short_kernels_ok;
#define Q_TILE 16
#define KEY_BLOCK 32

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Slot of key t of a sequence. */
__device__ __forceinline__ int64_t key_slot(const int32_t *pages, int32_t t, int32_t page_size) {
    return (int64_t)pages[t / page_size] * page_size + t % page_size;
}

__device__ __forceinline__ int find_seq(const exl_attn_seq *seqs, int n_seqs, int row) {
    int s = 0;
    while (s + 1 < n_seqs && row >= seqs[s + 1].q_start)
        s++;
    return s;
}

/* dot of two fp32 vectors in shared memory (hd % 4 == 0, 16-byte aligned) */
__device__ __forceinline__ float dot_q_kf(const float *q, const float *k, int hd) {
    float d = 0.0f;
#pragma unroll 8
    for (int i = 0; i < hd; i += 4) {
        float4 a = *(const float4 *)(q + i), b = *(const float4 *)(k + i);
        d += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    return d;
}

/* dot of an fp32 vector in shared memory with an fp16 row (hd % 8 == 0, 16-byte aligned) */
__device__ __forceinline__ float dot_q_k(const float *q, const __half *k, int hd) {
    float d = 0.0f;
#pragma unroll 8
    for (int i = 0; i < hd; i += 8) {
        uint4 raw = *(const uint4 *)(k + i);
        __half2 h[4];
        memcpy(h, &raw, 16);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float2 f = __half22float2(h[j]);
            d += q[i + 2 * j] * f.x + q[i + 2 * j + 1] * f.y;
        }
    }
    return d;
}

/* The first key a query at position pos sees (sliding window). */
__device__ __forceinline__ int window_first(int pos, int sliding_window) {
    return sliding_window > 0 && pos - sliding_window + 1 > 0 ? pos - sliding_window + 1 : 0;
}

/* The keys [k0, k1) that split `split` of query row `row` attends to (causal, sliding window). */
__device__ __forceinline__ void decode_keys(const exl_attn_seq &seq, int row, int split, int keys_per_split,
                                            int sliding_window, int *k0, int *k1) {
    const int last = seq.n_kv - seq.n_q + (row - seq.q_start);
    const int first = window_first(last, sliding_window);
    *k0 = first + split * keys_per_split;
    *k1 = min(last + 1, *k0 + keys_per_split);
}

/* Where a prompt block works: head blockIdx.y (KV head kvh, KV row width kvw) of sequence
 * blockIdx.z, its queries qt0 .. qt0 + nq - 1 (of bq a block), and the keys they see,
 * [first, last], first rounded down to a multiple of align. */
typedef struct prefill_block {
    exl_attn_seq seq;
    const int32_t *pages;
    int head, kvh, kvw, qt0, nq, past, first, last;
} prefill_block;

/* 0 when the block's tile starts past its sequence's queries (the block has nothing to do) */
__device__ __forceinline__ int prefill_place(const exl_attn_seq *seqs, const int32_t *page_tables,
                                             const exl_attn_shape &sh, int bq, int align, prefill_block *p) {
    p->seq = seqs[blockIdx.z];
    p->qt0 = blockIdx.x * bq;
    if (p->qt0 >= p->seq.n_q)
        return 0;
    p->head = blockIdx.y, p->kvh = p->head / (sh.n_heads / sh.n_kv_heads), p->kvw = sh.n_kv_heads * sh.head_dim;
    p->nq = min(bq, p->seq.n_q - p->qt0);
    p->pages = page_tables + p->seq.page_start;
    p->past = p->seq.n_kv - p->seq.n_q;
    p->last = p->past + p->qt0 + p->nq - 1;
    p->first = window_first(p->past + p->qt0, sh.sliding_window);
    p->first -= p->first % align;
    return 1;
}

/* Dims c .. c + 3 of key `key` of p's KV head (head_dim hd): a row of this step from the fp32
 * k and v (as computed), earlier context from the fp16 cache, zeros past p.last. */
__device__ __forceinline__ void load_kv4(const prefill_block &p, int page_size, int hd, int key, int c, const float *k,
                                         const float *v, const __half *kc, const __half *vc, float4 *kf, float4 *vf) {
    const int64_t kv_off = (int64_t)p.kvh * hd + c;
    *kf = *vf = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (key <= p.last && k && key >= p.past) {
        const int64_t at = (int64_t)(p.seq.q_start + key - p.past) * p.kvw + kv_off;
        *kf = *(const float4 *)(k + at), *vf = *(const float4 *)(v + at);
    } else if (key <= p.last) {
        const int64_t at = key_slot(p.pages, key, page_size) * p.kvw + kv_off;
        const float2 k01 = __half22float2(*(const __half2 *)(kc + at)),
                     k23 = __half22float2(*(const __half2 *)(kc + at + 2));
        const float2 v01 = __half22float2(*(const __half2 *)(vc + at)),
                     v23 = __half22float2(*(const __half2 *)(vc + at + 2));
        *kf = make_float4(k01.x, k01.y, k23.x, k23.y), *vf = make_float4(v01.x, v01.y, v23.x, v23.y);
    }
}

/* Where the output element at i (of rows of width n_heads * head_dim) goes: in place, or at
 * map[i % width] of its row (the slot order of the matmul it feeds, exl_qmatrix.slot_of). */
typedef struct out_order {
    const int32_t *map;
    int width;
} out_order;

__device__ __forceinline__ int64_t out_at(const out_order &oo, int64_t i) {
    return oo.map ? i - i % oo.width + __ldg(oo.map + i % oo.width) : i;
}

/* merge_warps for W warps and head_dim HD known at compile time, without the per-thread loops
 * over the warps' states: lane w of every warp holds warp w's weight (its max and sum reduced by
 * shuffles), which each output element then takes by a shuffle. */
template <int W, int HD>
__device__ __forceinline__ void merge_warps_fixed(float *out, float *partial, const float *wm, const float *wl,
                                                  const float (*wacc)[HD], int64_t rh, int split, out_order oo,
                                                  int64_t first_at) {
    const int lane = threadIdx.x % 32;
    const float m = lane < W ? wm[lane] : -INFINITY;
    float bm = m;
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1)
        bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
    const float e = m == -INFINITY ? 0.0f : __expf(m - bm);
    float bl = lane < W ? wl[lane] * e : 0.0f;
#pragma unroll
    for (int o = W / 2; o > 0; o >>= 1)
        bl += __shfl_xor_sync(0xffffffffu, bl, o);
    /* lanes 0 .. W - 1 now agree on bm and bl: a single split normalises here */
    const float f = gridDim.y > 1 ? e : bl > 0.0f ? e / bl : 0.0f;
    for (int d = threadIdx.x; d < HD; d += W * 32) {
        float a = 0.0f;
#pragma unroll
        for (int w = 0; w < W; w++)
            a += wacc[w][d] * __shfl_sync(0xffffffffu, f, w);
        if (gridDim.y == 1) {
            out[d == (int)threadIdx.x && first_at >= 0 ? first_at : out_at(oo, rh * HD + d)] = a;
        } else {
            float *pp = partial + (rh * gridDim.y + split) * (HD + 2);
            pp[2 + d] = a;
            if (d == 0) { /* lane 0 */
                pp[0] = bm;
                pp[1] = bl;
            }
        }
    }
}

/* ---- decode */

/* Where a decode block works: its query row and head (blockIdx.x), their KV head, its split's
 * keys [k0, k1) (blockIdx.y), the first key this step wrote (fresh: the ones before it are
 * in the cache since earlier steps) and the sequence's page table. Reads only the batch's
 * tables, so it may run before exl_pdl_wait(). */
typedef struct decode_block {
    int row, head, kvh, k0, k1, fresh;
    const int32_t *pages;
} decode_block;

__device__ __forceinline__ decode_block decode_place(const exl_attn_seq *seqs, int n_seqs, const int32_t *page_tables,
                                                     const exl_attn_shape &sh, int keys_per_split) {
    decode_block d;
    d.row = blockIdx.x / sh.n_heads, d.head = blockIdx.x % sh.n_heads;
    d.kvh = d.head / (sh.n_heads / sh.n_kv_heads);
    const exl_attn_seq seq = seqs[find_seq(seqs, n_seqs, d.row)];
    decode_keys(seq, d.row, blockIdx.y, keys_per_split, sh.sliding_window, &d.k0, &d.k1);
    d.fresh = seq.n_kv - seq.n_q;
    d.pages = page_tables + seq.page_start;
    return d;
}

/* d's query, scaled, into qs (after exl_pdl_wait: the query is this step's) */
__device__ __forceinline__ void load_query(const float *q, float *qs, const decode_block &d, const exl_attn_shape &sh,
                                           int hd) {
    for (int i = threadIdx.x; i < hd; i += blockDim.x)
        qs[i] = q[((int64_t)d.row * sh.n_heads + d.head) * hd + i] * sh.scale;
    __syncthreads();
}

__global__ void __launch_bounds__(ATT_WARPS * 32)
    attn_decode_kernel(float *out, float *partial, const float *q, const __half *kc, const __half *vc,
                       const exl_attn_seq *seqs, int n_seqs, const int32_t *page_tables, exl_attn_shape sh,
                       int keys_per_split) {
    exl_pdl_start();
    __shared__ float qs[MAX_HEAD_DIM];
    __shared__ float wm[ATT_WARPS], wl[ATT_WARPS];
    __shared__ float wacc[ATT_WARPS][MAX_HEAD_DIM];
    const int hd = sh.head_dim, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const decode_block d = decode_place(seqs, n_seqs, page_tables, sh, keys_per_split);
    load_query(q, qs, d, sh, hd);
    const int row = d.row, head = d.head, split = blockIdx.y, kvh = d.kvh, kvw = sh.n_kv_heads * hd;
    const int k0 = d.k0, k1 = d.k1;
    const int32_t *pages = d.pages;

    float m = -INFINITY, l = 0.0f, acc[MAX_DPL];
#pragma unroll
    for (int i = 0; i < MAX_DPL; i++)
        acc[i] = 0.0f;
    for (int t0 = k0 + warp * KEY_BLOCK; t0 < k1; t0 += ATT_WARPS * KEY_BLOCK) {
        int t = t0 + lane;
        int64_t slot = t < k1 ? key_slot(pages, t, sh.page_size) : 0;
        float s = t < k1 ? dot_q_k(qs, kc + slot * kvw + (int64_t)kvh * hd, hd) : -INFINITY;
        if (sh.softcap > 0.0f && t < k1)
            s = sh.softcap * tanhf(s / sh.softcap);
        float nm = fmaxf(m, warp_max(s));
        float p = t < k1 ? __expf(s - nm) : 0.0f;
        float corr = __expf(m - nm);
        l = l * corr + warp_sum(p);
        m = nm;
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++)
            acc[i] *= corr;
        int n = min(KEY_BLOCK, k1 - t0);
#pragma unroll 8
        for (int j = 0; j < n; j++) {
            float pj = __shfl_sync(0xffffffffu, p, j);
            int64_t sj = __shfl_sync(0xffffffffu, slot, j);
            const __half *v = vc + sj * kvw + (int64_t)kvh * hd;
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++)
                if (lane + 32 * i < hd)
                    acc[i] += pj * __half2float(v[lane + 32 * i]);
        }
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < MAX_DPL; i++)
        if (lane + 32 * i < hd)
            wacc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    merge_warps(out, partial, wm, wl, &wacc[0][0], MAX_HEAD_DIM, hd, (int64_t)row * sh.n_heads + head, split);
}

/* The same for head_dim HD (64 or 128), built for latency at short contexts: a lane loads
 * its key's whole K row into registers and its V row into shared memory (cp.async) in one
 * go, so a warp's 32 keys cost one memory round trip instead of one per key. The keys of
 * a warp's first block that earlier steps wrote are fetched before exl_pdl_wait(), while
 * the kernels before it still run; after it, only the query and this step's keys. */
template <int HD>
__device__ __forceinline__ void fetch_key(const __half *kc, const __half *vc, int64_t slot, int kvw, int kvh,
                                          uint4 (&kr)[HD / 8], __half *vrow) {
    const uint4 *ks = (const uint4 *)(kc + slot * kvw + (int64_t)kvh * HD);
    const __half *vs = vc + slot * kvw + (int64_t)kvh * HD;
#pragma unroll
    for (int i = 0; i < HD / 8; i++) {
#if __CUDA_ARCH__ >= 800
        unsigned dst = (unsigned)__cvta_generic_to_shared(vrow + 8 * i);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(vs + 8 * i));
#else
        *(uint4 *)(vrow + 8 * i) = *(const uint4 *)(vs + 8 * i);
#endif
    }
#pragma unroll
    for (int i = 0; i < HD / 8; i++)
        kr[i] = ks[i];
}

/* With ROPE (decode_rope: one new token a sequence), the block also does rope_kv_store's work
 * for its row: it rotates its query and its KV head's new key as loaded, takes that key and
 * value from the fp32 k and v instead of the cache, and the first block of each (row, KV
 * head) writes them to their cache slot for later steps; no other block reads that slot in
 * this step. */
typedef struct decode_rope {
    const float *k, *v;    /* this step's keys (before rope) and values, [rows, kv width] */
    const float *inv_freq; /* half of them */
    float attn_factor;
    int half; /* rot_dim / 2 */
    out_order oo;
} decode_rope;

/* element i (of head_dim) after rope (rotate-half over 2 half, cos / sin tables cs / sn of `half`),
 * from x[i] = xi and its partner x[rope_partner(i)] = xp */
__device__ __forceinline__ int rope_partner(int i, int half) {
    return i < half ? i + half : i < 2 * half ? i - half : i;
}
__device__ __forceinline__ float rope_of(float xi, float xp, int i, int half, const float *cs, const float *sn) {
    if (i < half)
        return xi * cs[i] - xp * sn[i];
    if (i < 2 * half)
        return xi * cs[i - half] + xp * sn[i - half];
    return xi;
}

template <int HD, int W, bool ROPE>
__global__ void __launch_bounds__(W * 32)
    attn_decode_fast_kernel(float *out, float *partial, const float *q, const __half *kc, const __half *vc,
                            const exl_attn_seq *seqs, int n_seqs, const int32_t *page_tables, exl_attn_shape sh,
                            int keys_per_split, decode_rope rp) {
    exl_pdl_trigger();
    constexpr int VS = FAST_VS(HD);                  /* V row stride in halves (16-byte pad) */
    constexpr int PPL = HD / 64;                     /* half2 output pairs per lane */
    extern __shared__ __align__(16) __half vt_dyn[]; /* [W][KEY_BLOCK][VS]: past 48 KiB for W = 8 */
    __half(*vt)[KEY_BLOCK][VS] = (__half(*)[KEY_BLOCK][VS])vt_dyn;
    __shared__ __align__(16) float qs[HD];
    __shared__ float wm[W], wl[W];
    __shared__ float wacc[W][HD];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const decode_block d = decode_place(seqs, n_seqs, page_tables, sh, keys_per_split);
    const int row = d.row, head = d.head, split = blockIdx.y, kvh = d.kvh, kvw = sh.n_kv_heads * HD;
    const int k0 = d.k0, k1 = d.k1;
    const int32_t *pages = d.pages;
    /* where this thread's output element goes (o_proj's slot order: a table read, so before the wait) */
    const int64_t first_at = threadIdx.x < HD ? out_at(rp.oo, ((int64_t)row * sh.n_heads + head) * HD + threadIdx.x)
                                              : -1;

    uint4 kr[HD / 8];
    int t0 = k0 + warp * KEY_BLOCK;
    int64_t slot = t0 + lane < k1 ? key_slot(pages, t0 + lane, sh.page_size) : 0;
    if (t0 + lane < min(k1, d.fresh))
        fetch_key<HD>(kc, vc, slot, kvw, kvh, kr, &vt[warp][lane][0]);
    __shared__ float rcs[ROPE ? HD / 2 : 1], rsn[ROPE ? HD / 2 : 1];
    __shared__ __align__(16) __half fk[ROPE ? HD : 8], fv[ROPE ? HD : 8];
    if constexpr (ROPE) /* the position of the row's query and new key is d.fresh */
        for (int i = threadIdx.x; i < rp.half; i += W * 32) {
            float sv, cv;
            sincosf((float)d.fresh * __ldg(rp.inv_freq + i), &sv, &cv);
            rcs[i] = cv * rp.attn_factor;
            rsn[i] = sv * rp.attn_factor;
        }
    exl_pdl_wait();
    if constexpr (ROPE) {
        __syncthreads();
        const float *qr = q + ((int64_t)row * sh.n_heads + head) * HD;
        const float *kr32 = rp.k + (int64_t)row * kvw + (int64_t)kvh * HD,
                    *vr32 = rp.v + (int64_t)row * kvw + (int64_t)kvh * HD;
        for (int i = threadIdx.x; i < HD; i += W * 32) {
            /* the five loads issued together (rope_at's branches had made them three round trips) */
            const int o = rope_partner(i, rp.half);
            const float qi = qr[i], qo = qr[o], ki = kr32[i], ko = kr32[o], vi = vr32[i];
            qs[i] = rope_of(qi, qo, i, rp.half, rcs, rsn) * sh.scale;
            fk[i] = __float2half_rn(rope_of(ki, ko, i, rp.half, rcs, rsn));
            fv[i] = __float2half_rn(vi);
        }
        __syncthreads();
        if (split == 0 && head % (sh.n_heads / sh.n_kv_heads) == 0) {
            const int64_t at = key_slot(pages, d.fresh, sh.page_size) * kvw + (int64_t)kvh * HD;
            for (int i = threadIdx.x; i < HD; i += W * 32) {
                ((__half *)kc)[at + i] = fk[i];
                ((__half *)vc)[at + i] = fv[i];
            }
        }
    } else {
        load_query(q, qs, d, sh, HD);
    }

    float m = -INFINITY, l = 0.0f;
    float2 acc[PPL];
#pragma unroll
    for (int i = 0; i < PPL; i++)
        acc[i] = make_float2(0.0f, 0.0f);
    for (int first = 1; t0 < k1; t0 += W * KEY_BLOCK, first = 0) {
        const int t = t0 + lane;
        if (!first && t < k1)
            slot = key_slot(pages, t, sh.page_size);
        if (ROPE && t < k1 && t == d.fresh) { /* this step's key and value, as rotated above */
#pragma unroll
            for (int i = 0; i < HD / 8; i++) {
                kr[i] = ((const uint4 *)fk)[i];
                ((uint4 *)&vt[warp][lane][0])[i] = ((const uint4 *)fv)[i];
            }
        } else if (t < k1 && (!first || t >= d.fresh)) {
            fetch_key<HD>(kc, vc, slot, kvw, kvh, kr, &vt[warp][lane][0]);
        }
#if __CUDA_ARCH__ >= 800
        asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;");
#endif
        float s = -INFINITY;
        if (t < k1) {
            s = 0.0f;
#pragma unroll
            for (int i = 0; i < HD / 8; i++) {
                __half2 h[4];
                memcpy(h, &kr[i], 16);
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    float2 f = __half22float2(h[j]);
                    s += qs[8 * i + 2 * j] * f.x + qs[8 * i + 2 * j + 1] * f.y;
                }
            }
        }
        __syncwarp();
        float nm = fmaxf(m, warp_max(s));
        float p = t < k1 ? __expf(s - nm) : 0.0f;
        float corr = __expf(m - nm);
        l = l * corr + warp_sum(p);
        m = nm;
#pragma unroll
        for (int i = 0; i < PPL; i++)
            acc[i].x *= corr, acc[i].y *= corr;
        const int n = min(KEY_BLOCK, k1 - t0);
#pragma unroll 8
        for (int j = 0; j < n; j++) {
            float pj = __shfl_sync(0xffffffffu, p, j);
#pragma unroll
            for (int i = 0; i < PPL; i++) {
                float2 v = __half22float2(*(const __half2 *)&vt[warp][j][2 * (lane + 32 * i)]);
                acc[i].x += pj * v.x;
                acc[i].y += pj * v.y;
            }
        }
        __syncwarp(); /* vt is reused by the warp's next block */
    }
    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PPL; i++) {
        wacc[warp][2 * (lane + 32 * i)] = acc[i].x;
        wacc[warp][2 * (lane + 32 * i) + 1] = acc[i].y;
    }
    __syncthreads();
    merge_warps_fixed<W, HD>(out, partial, wm, wl, wacc, (int64_t)row * sh.n_heads + head, split, rp.oo, first_at);
}

typedef void (*decode_fast_fn)(float *, float *, const float *, const __half *, const __half *, const exl_attn_seq *,
                               int, const int32_t *, exl_attn_shape, int, decode_rope);

/* the fast decode kernel for head_dim hd (64 or 128): one split of SHORT_WARPS, or ATT_WARPS a split */
template <bool ROPE>
static decode_fast_fn fast_kernel(int hd, bool short_ctx) {
    if (hd == 128)
        return short_ctx ? attn_decode_fast_kernel<128, SHORT_WARPS, ROPE>
                         : attn_decode_fast_kernel<128, ATT_WARPS, ROPE>;
    return short_ctx ? attn_decode_fast_kernel<64, SHORT_WARPS, ROPE> : attn_decode_fast_kernel<64, ATT_WARPS, ROPE>;
}

__global__ void attn_combine_kernel(float *out, const float *partial, int hd, int n_splits, out_order oo) {
    exl_pdl_start();
    const int64_t rh = blockIdx.x;
    const float *pp = partial + rh * n_splits * (hd + 2);
    float m = -INFINITY;
    for (int s = 0; s < n_splits; s++)
        m = fmaxf(m, pp[s * (hd + 2)]);
    float l = 0.0f;
    for (int s = 0; s < n_splits; s++) {
        float ms = pp[s * (hd + 2)];
        l += ms == -INFINITY ? 0.0f : pp[s * (hd + 2) + 1] * __expf(ms - m);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            float ms = pp[s * (hd + 2)];
            a += ms == -INFINITY ? 0.0f : pp[s * (hd + 2) + 2 + d] * __expf(ms - m);
        }
        out[out_at(oo, rh * hd + d)] = l > 0.0f ? a / l : 0.0f;
    }
}

/* ---- prefill */

/* Keys and values are staged in fp32: those of the step's own rows are read from k and v
 * (fp32, as computed) rather than from their fp16 copies in the cache, so a prompt's
 * attention over itself carries no fp16 rounding. */
__global__ void __launch_bounds__(ATT_WARPS * 32)
    attn_prefill_kernel(float *out, const float *q, const float *k, const float *v, const __half *kc, const __half *vc,
                        const exl_attn_seq *seqs, const int32_t *page_tables, exl_attn_shape sh) {
    exl_pdl_start();
    extern __shared__ float smem[];
    const int hd = sh.head_dim, ks = hd + 4;    /* K/V row stride in floats (16-byte pad) */
    float *qs = smem;                           /* [Q_TILE][hd] */
    float *ps = qs + Q_TILE * hd;               /* [ATT_WARPS][4][KEY_BLOCK] */
    float *kt = ps + ATT_WARPS * 4 * KEY_BLOCK; /* [KEY_BLOCK][ks] */
    float *vt = kt + KEY_BLOCK * ks;
    __shared__ int64_t slots[KEY_BLOCK];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    prefill_block P;
    if (!prefill_place(seqs, page_tables, sh, Q_TILE, KEY_BLOCK, &P))
        return;

    for (int i = threadIdx.x; i < Q_TILE * hd; i += blockDim.x) {
        int qi = i / hd;
        const int64_t row = P.seq.q_start + P.qt0 + qi;
        qs[i] = qi < P.nq ? q[(row * sh.n_heads + P.head) * hd + i % hd] * sh.scale : 0.0f;
    }

    float m[4], l[4], acc[4][MAX_DPL];
    int qlast[4], qfirst[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
        int qi = warp * 4 + j;
        qlast[j] = qi < P.nq ? P.past + P.qt0 + qi : -1;
        qfirst[j] = window_first(qlast[j], sh.sliding_window);
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++)
            acc[j][i] = 0.0f;
    }
    float *pw = ps + warp * 4 * KEY_BLOCK;
    for (int t0 = P.first; t0 <= P.last; t0 += KEY_BLOCK) {
        __syncthreads(); /* previous block's K/V no longer in use */
        if (threadIdx.x < KEY_BLOCK) {
            int t = t0 + threadIdx.x;
            slots[threadIdx.x] = t <= P.last ? key_slot(P.pages, t, sh.page_size) : -1;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < KEY_BLOCK * (hd / 8); i += blockDim.x) {
            const int j = i / (hd / 8), c = (i % (hd / 8)) * 8, key = t0 + j;
            float kf[8] = {0, 0, 0, 0, 0, 0, 0, 0}, vf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (slots[j] >= 0 && k && key >= P.past) { /* a row of this step */
                const int64_t at = (int64_t)(P.seq.q_start + key - P.past) * P.kvw + (int64_t)P.kvh * hd + c;
                *(float4 *)kf = *(const float4 *)(k + at), *(float4 *)(kf + 4) = *(const float4 *)(k + at + 4);
                *(float4 *)vf = *(const float4 *)(v + at), *(float4 *)(vf + 4) = *(const float4 *)(v + at + 4);
            } else if (slots[j] >= 0) {
                uint4 kz = *(const uint4 *)(kc + slots[j] * P.kvw + (int64_t)P.kvh * hd + c);
                uint4 vz = *(const uint4 *)(vc + slots[j] * P.kvw + (int64_t)P.kvh * hd + c);
                __half kh[8], vh[8];
                memcpy(kh, &kz, 16);
                memcpy(vh, &vz, 16);
#pragma unroll
                for (int e = 0; e < 8; e++)
                    kf[e] = __half2float(kh[e]), vf[e] = __half2float(vh[e]);
            }
#pragma unroll
            for (int e = 0; e < 8; e += 4) {
                *(float4 *)(kt + j * ks + c + e) = *(float4 *)(kf + e);
                *(float4 *)(vt + j * ks + c + e) = *(float4 *)(vf + e);
            }
        }
        __syncthreads();
        const int t = t0 + lane;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            bool valid = t >= qfirst[j] && t <= qlast[j];
            float s = valid ? dot_q_kf(qs + (warp * 4 + j) * hd, kt + lane * ks, hd) : -INFINITY;
            if (sh.softcap > 0.0f && valid)
                s = sh.softcap * tanhf(s / sh.softcap);
            float nm = fmaxf(m[j], warp_max(s));
            float p = valid ? __expf(s - nm) : 0.0f;
            float corr = nm == -INFINITY ? 1.0f : __expf(m[j] - nm);
            l[j] = l[j] * corr + warp_sum(p);
            m[j] = nm;
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++)
                acc[j][i] *= corr;
            pw[j * KEY_BLOCK + lane] = p;
        }
        __syncwarp();
        for (int kj = 0; kj < KEY_BLOCK; kj++) {
#pragma unroll
            for (int i = 0; i < MAX_DPL; i++) {
                if (lane + 32 * i < hd) {
                    float vv = vt[kj * ks + lane + 32 * i];
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        acc[j][i] += pw[j * KEY_BLOCK + kj] * vv;
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        int qi = warp * 4 + j;
        if (qi >= P.nq)
            continue;
        float *o = out + ((int64_t)(P.seq.q_start + P.qt0 + qi) * sh.n_heads + P.head) * hd;
#pragma unroll
        for (int i = 0; i < MAX_DPL; i++)
            if (lane + 32 * i < hd)
                o[lane + 32 * i] = l[j] > 0.0f ? acc[j][i] / l[j] : 0.0f;
    }
}

/* The same for head_dim HD of 64, 128 or 256, tiled for arithmetic intensity: a block takes
 * BQ = 64 queries of one head and BK keys at a time; thread (tq, tk) of 16 x 16 scores queries
 * 4tq .. 4tq + 3 against keys tk KPT .. (one 4 x KPT tile, the query and key values read as
 * vectors from transposed copies in shared memory), the 16 threads of a query row (a half
 * warp) keep its online softmax, and the same thread accumulates the row's output dims
 * 64 g + 4 tk .. + 3 from the probabilities and the V tile. fp32 throughout, keys and
 * values sourced as in attn_prefill_kernel. */
#define TQ 64 /* queries a tiled block takes */

template <int HD, int BK>
struct prefill_tile {
    static constexpr int KPT = BK / 16; /* keys a thread scores */
    static constexpr int DPT = HD / 16; /* output dims a thread accumulates */
    static constexpr int VS = HD + 4;   /* V row stride (floats) */
    static constexpr int PS = TQ + 4;   /* P row stride */
    static constexpr size_t smem_floats = (size_t)HD * TQ + (size_t)HD * BK + (size_t)BK * VS + (size_t)BK * PS;
};

template <int HD, int BK>
__global__ void __launch_bounds__(256)
    attn_prefill_tiled_kernel(float *out, const float *q, const float *k, const float *v, const __half *kc,
                              const __half *vc, const exl_attn_seq *seqs, const int32_t *page_tables,
                              exl_attn_shape sh) {
    using T = prefill_tile<HD, BK>;
    constexpr int KPT = T::KPT, DPT = T::DPT, VS = T::VS, PS = T::PS;
    exl_pdl_start();
    extern __shared__ float smem[];
    float *qs = smem;         /* [HD][TQ], scaled */
    float *kt = qs + HD * TQ; /* [HD][BK] */
    float *vt = kt + HD * BK; /* [BK][VS] */
    float *pt = vt + BK * VS; /* [BK][PS] */
    const int tq = threadIdx.x / 16, tk = threadIdx.x % 16;
    prefill_block P;
    if (!prefill_place(seqs, page_tables, sh, TQ, BK, &P))
        return;

    for (int i = threadIdx.x; i < TQ * (HD / 4); i += 256) {
        const int qi = i % TQ, c = i / TQ * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (qi < P.nq)
            x = *(const float4 *)(q + ((int64_t)(P.seq.q_start + P.qt0 + qi) * sh.n_heads + P.head) * HD + c);
        qs[(c + 0) * TQ + qi] = x.x * sh.scale, qs[(c + 1) * TQ + qi] = x.y * sh.scale;
        qs[(c + 2) * TQ + qi] = x.z * sh.scale, qs[(c + 3) * TQ + qi] = x.w * sh.scale;
    }

    float m[4], l[4], acc[4][DPT];
    int qlast[4], qfirst[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int qi = tq * 4 + i;
        m[i] = -INFINITY, l[i] = 0.0f;
        qlast[i] = qi < P.nq ? P.past + P.qt0 + qi : -1;
        qfirst[i] = window_first(qlast[i], sh.sliding_window);
#pragma unroll
        for (int d = 0; d < DPT; d++)
            acc[i][d] = 0.0f;
    }
    for (int t0 = P.first; t0 <= P.last; t0 += BK) {
        __syncthreads(); /* the previous tile's K, V and P are no longer read */
        for (int i = threadIdx.x; i < BK * (HD / 4); i += 256) {
            const int j = i % BK, c = i / BK * 4;
            float4 kf, vf;
            load_kv4(P, sh.page_size, HD, t0 + j, c, k, v, kc, vc, &kf, &vf);
            kt[(c + 0) * BK + j] = kf.x, kt[(c + 1) * BK + j] = kf.y;
            kt[(c + 2) * BK + j] = kf.z, kt[(c + 3) * BK + j] = kf.w;
            *(float4 *)(vt + j * VS + c) = vf;
        }
        __syncthreads();
        /* scores of the thread's 4 queries x KPT keys */
        float sc[4][KPT];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int j = 0; j < KPT; j++)
                sc[i][j] = 0.0f;
#pragma unroll 8
        for (int d = 0; d < HD; d++) {
            const float4 a = *(const float4 *)(qs + d * TQ + tq * 4);
            float b[KPT];
            if constexpr (KPT == 4) {
                const float4 b4 = *(const float4 *)(kt + d * BK + tk * 4);
                b[0] = b4.x, b[1] = b4.y, b[2] = b4.z, b[3] = b4.w;
            } else {
                const float2 b2 = *(const float2 *)(kt + d * BK + tk * 2);
                b[0] = b2.x, b[1] = b2.y;
            }
            const float av[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < KPT; j++)
                    sc[i][j] += av[i] * b[j];
        }
        /* online softmax of each query row over the tile (its 16 threads are a half warp) */
        float corr[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < KPT; j++) {
                const int t = t0 + tk * KPT + j;
                if (t < qfirst[i] || t > qlast[i])
                    sc[i][j] = -INFINITY;
                mx = fmaxf(mx, sc[i][j]);
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float nm = fmaxf(m[i], mx);
            float sum = 0.0f;
#pragma unroll
            for (int j = 0; j < KPT; j++) {
                sc[i][j] = nm == -INFINITY || sc[i][j] == -INFINITY ? 0.0f : __expf(sc[i][j] - nm);
                sum += sc[i][j];
            }
#pragma unroll
            for (int o = 8; o > 0; o >>= 1)
                sum += __shfl_xor_sync(0xffffffffu, sum, o);
            corr[i] = nm == -INFINITY ? 1.0f : __expf(m[i] - nm);
            l[i] = l[i] * corr[i] + sum;
            m[i] = nm;
        }
#pragma unroll
        for (int j = 0; j < KPT; j++)
            *(float4 *)(pt + (tk * KPT + j) * PS + tq * 4) = make_float4(sc[0][j], sc[1][j], sc[2][j], sc[3][j]);
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int d = 0; d < DPT; d++)
                acc[i][d] *= corr[i];
        __syncthreads();
        const int n_keys = min(BK, P.last - t0 + 1);
#pragma unroll 4
        for (int j = 0; j < n_keys; j++) {
            const float4 pv = *(const float4 *)(pt + j * PS + tq * 4);
            const float pa[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
            for (int g = 0; g < DPT / 4; g++) {
                const float4 vv = *(const float4 *)(vt + j * VS + g * 64 + tk * 4);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    acc[i][4 * g + 0] += pa[i] * vv.x;
                    acc[i][4 * g + 1] += pa[i] * vv.y;
                    acc[i][4 * g + 2] += pa[i] * vv.z;
                    acc[i][4 * g + 3] += pa[i] * vv.w;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int qi = tq * 4 + i;
        if (qi >= P.nq)
            continue;
        float *o = out + ((int64_t)(P.seq.q_start + P.qt0 + qi) * sh.n_heads + P.head) * HD;
        const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
#pragma unroll
        for (int g = 0; g < DPT / 4; g++)
            *(float4 *)(o + g * 64 + tk * 4) = make_float4(acc[i][4 * g] * inv, acc[i][4 * g + 1] * inv,
                                                           acc[i][4 * g + 2] * inv, acc[i][4 * g + 3] * inv);
    }
}

/* ---- prefill on tensor cores (sm_80+), head_dim 64 and 128: FlashAttention-2's shape with fp16 operands and
 * fp32 accumulation; Exact (EXL_CUDA_EXACT_PREFILL=1): every operand as two fp16 parts, x = hi + lo, and the
 * products hi·hi + hi·lo + lo·hi, so scores and outputs keep ~22 bits as the fp32 kernels do. A block
 * takes 64 queries of one head (16 rows a warp) and 64 keys at a time; Q, K and V tiles sit in
 * shared memory as hi and lo (keys and values from the fp16 cache are exact in hi, lo = 0).
 * Scores stay in mma accumulators; their softmax probabilities are split and fed back as the
 * A operand of P·V. */
#define TC_BQ 64
#define TC_BK 64
#define TC_WARPS 4

/* x as hi and lo fp16 pairs (two consecutive values) */
__device__ __forceinline__ void split2(float x0, float x1, uint32_t &hi, uint32_t &lo) {
    const __half2 h = __floats2half2_rn(x0, x1);
    const float2 b = __half22float2(h);
    const __half2 l = __floats2half2_rn(x0 - b.x, x1 - b.y);
    memcpy(&hi, &h, 4);
    memcpy(&lo, &l, 4);
}

/* c += a·b for operands split in hi and lo parts: hi·hi + hi·lo + lo·hi (lo·lo is below fp32), or without
 * Exact hi·hi alone; b is n-tile h of a pair loaded by one ldsm_x4 */
template <bool Exact>
__device__ __forceinline__ void mma_split(float (&c)[4], const uint32_t (&ah)[4], const uint32_t (&al)[4],
                                          const uint32_t (&bh)[4], const uint32_t (&bl)[4], int h) {
    mma16816a(c, ah, bh[2 * h], bh[2 * h + 1]);
    if constexpr (Exact) {
        mma16816a(c, ah, bl[2 * h], bl[2 * h + 1]);
        mma16816a(c, al, bh[2 * h], bh[2 * h + 1]);
    }
}

/* four fp32 values into a row of hi and (Exact) a row of lo (8 bytes each) */
template <bool Exact>
__device__ __forceinline__ void store_split4(__half *hi, __half *lo, float4 v) {
    uint2 h, l;
    split2(v.x, v.y, h.x, l.x);
    split2(v.z, v.w, h.y, l.y);
    *(uint2 *)hi = h;
    if constexpr (Exact)
        *(uint2 *)lo = l;
}

template <int HD, bool Exact>
struct tc_tile {
    static constexpr int RS = HD + 8; /* row stride in halves: 16-byte rows, ldmatrix without bank conflicts */
    /* Q, K, V: hi and (Exact) lo */
    static constexpr size_t smem_bytes = (size_t)(Exact ? 6 : 3) * 64 * RS * sizeof(__half);
};

/* The tensor-core kernel's tile sources: TC_BK keys from t0 into the K and V tiles as hi and lo. From the fp16 cache,
 * a thread takes 4 dimensions of a key at a time (load_kv4). Without Exact the lo tiles are not written. */
template <int HD, bool Exact>
struct tc_fp16_src {
    const __half *kc, *vc;
    __device__ __forceinline__ void load(const prefill_block &P, int page_size, int t0, const float *k, const float *v,
                                         __half *kh, __half *kl, __half *vh, __half *vl) const {
        constexpr int RS = tc_tile<HD, Exact>::RS;
        for (int i = threadIdx.x; i < TC_BK * (HD / 4); i += TC_WARPS * 32) {
            const int j = i / (HD / 4), c = i % (HD / 4) * 4;
            float4 kf, vf; /* from the fp16 cache: exact in hi */
            load_kv4(P, page_size, HD, t0 + j, c, k, v, kc, vc, &kf, &vf);
            store_split4<Exact>(kh + j * RS + c, kl + j * RS + c, kf);
            store_split4<Exact>(vh + j * RS + c, vl + j * RS + c, vf);
        }
    }
};

/* x (32 values) becomes its Hadamard rotation over 32, in registers (hadamard_lanes' order and scale) */
__device__ __forceinline__ void fwht32(float (&x)[32]) {
#pragma unroll
    for (int len = 1; len < 32; len <<= 1)
#pragma unroll
        for (int i = 0; i < 32; i++)
            if (!(i & len)) {
                const float a = x[i], b = x[i + len];
                x[i] = a + b, x[i + len] = a - b;
            }
#pragma unroll
    for (int i = 0; i < 32; i++)
        x[i] *= 0.17677669529663687f; /* 1 / sqrt(32) */
}

/* the 32 codes of BITS at w (4-byte aligned) read back: (c - z) s */
template <int BITS>
__device__ __forceinline__ void tc_dequant32(const uint32_t *w, float s, float (&x)[32]) {
    uint32_t ww[BITS];
#pragma unroll
    for (int i = 0; i < BITS; i++)
        ww[i] = __ldg(w + i);
    const float z = 0.5f * (float)((1 << BITS) - 1);
#pragma unroll
    for (int i = 0; i < 32; i++)
        x[i] = (qk_code<BITS>(ww, i) - z) * s;
}

/* Dimensions 32 g .. 32 g + 31 of key `key` of P's KV head from side s: this step's rows from the fp32 rows (as
 * computed), earlier ones from the cache (fp16, or decoded and turned back), zeros past P.last. */
template <int HD>
__device__ __forceinline__ void tc_group(const prefill_block &P, int page_size, int key, int g, const float *rows,
                                         const qk_side &s, float (&x)[32]) {
    if (key > P.last) {
#pragma unroll
        for (int i = 0; i < 32; i++)
            x[i] = 0.0f;
    } else if (key >= P.past) {
        const float4 *r = (const float4 *)(rows + (int64_t)(P.seq.q_start + key - P.past) * P.kvw +
                                           (int64_t)P.kvh * HD + 32 * g);
#pragma unroll
        for (int c = 0; c < 8; c++) {
            const float4 f = r[c];
            x[4 * c] = f.x, x[4 * c + 1] = f.y, x[4 * c + 2] = f.z, x[4 * c + 3] = f.w;
        }
    } else {
        const unsigned char *sp = s.base + key_slot(P.pages, key, page_size) * s.slot_bytes;
        const int64_t at = (int64_t)P.kvh * HD + 32 * g; /* the group's first value in the row */
        if (s.bits == 16) {
            const uint4 *h = (const uint4 *)(sp + at * 2);
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const uint4 raw = h[c];
                __half2 hh[4];
                memcpy(hh, &raw, 16);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 f = __half22float2(hh[e]);
                    x[8 * c + 2 * e] = f.x, x[8 * c + 2 * e + 1] = f.y;
                }
            }
            return;
        }
        const float sc = __half2float(((const __half *)(sp + s.codes_bytes))[at / 32]);
        const uint32_t *w = (const uint32_t *)(sp + at * s.bits / 8);
        if (s.bits == 8)
            tc_dequant32<8>(w, sc, x);
        else if (s.bits == 6)
            tc_dequant32<6>(w, sc, x);
        else
            tc_dequant32<4>(w, sc, x);
        fwht32(x);
    }
}

/* From a cache with a quantized side (groups of 32): a thread takes a group of 32 dimensions of a key at a time, the
 * unit its codes are rotated in. */
template <int HD, bool Exact>
struct tc_quant_src {
    qk_side ks, vs;
    __device__ __forceinline__ void load(const prefill_block &P, int page_size, int t0, const float *k, const float *v,
                                         __half *kh, __half *kl, __half *vh, __half *vl) const {
        constexpr int RS = tc_tile<HD, Exact>::RS, G = HD / 32;
        for (int i = threadIdx.x; i < 2 * TC_BK * G; i += TC_WARPS * 32) {
            const int is_v = i >= TC_BK * G, u = is_v ? i - TC_BK * G : i, j = u / G, g = u % G;
            float x[32];
            tc_group<HD>(P, page_size, t0 + j, g, is_v ? v : k, is_v ? vs : ks, x);
            __half *hi = (is_v ? vh : kh) + j * RS + 32 * g, *lo = (is_v ? vl : kl) + j * RS + 32 * g;
#pragma unroll
            for (int c = 0; c < 8; c++)
                store_split4<Exact>(hi + 4 * c, lo + 4 * c,
                                    make_float4(x[4 * c], x[4 * c + 1], x[4 * c + 2], x[4 * c + 3]));
        }
    }
};

template <int HD, bool Exact, class SRC>
__global__ void __launch_bounds__(TC_WARPS * 32)
    attn_prefill_tc_kernel(float *out, const float *q, const float *k, const float *v, SRC src,
                           const exl_attn_seq *seqs, const int32_t *page_tables, exl_attn_shape sh) {
    constexpr int RS = tc_tile<HD, Exact>::RS, NT = TC_BK / 8, DT = HD / 8, LO = Exact ? 1 : 0;
    exl_pdl_start();
    extern __shared__ __align__(16) __half tsm[];
    /* without Exact the lo tiles are not there (each ql, kl, vl is its hi tile, never read) */
    __half *qh = tsm, *ql = qh + LO * TC_BQ * RS, *kh = ql + TC_BQ * RS, *kl = kh + LO * TC_BK * RS;
    __half *vh = kl + TC_BK * RS, *vl = vh + LO * TC_BK * RS;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    prefill_block P;
    if (!prefill_place(seqs, page_tables, sh, TC_BQ, TC_BK, &P))
        return;

    for (int i = threadIdx.x; i < TC_BQ * (HD / 4); i += TC_WARPS * 32) {
        const int r = i / (HD / 4), c = i % (HD / 4) * 4;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (r < P.nq) {
            x = *(const float4 *)(q + ((int64_t)(P.seq.q_start + P.qt0 + r) * sh.n_heads + P.head) * HD + c);
            x.x *= sh.scale, x.y *= sh.scale, x.z *= sh.scale, x.w *= sh.scale;
        }
        store_split4<Exact>(qh + r * RS + c, ql + r * RS + c, x);
    }
    /* this thread's two rows (g and g + 8 of the warp's 16) and their key ranges */
    int rlast[2], rfirst[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int qi = warp * 16 + g + 8 * h;
        rlast[h] = qi < P.nq ? P.past + P.qt0 + qi : -1;
        rfirst[h] = window_first(rlast[h], sh.sliding_window);
    }
    const int warp_last = min(P.past + P.qt0 + warp * 16 + 15, P.last);
    const int warp_first = window_first(P.past + P.qt0 + warp * 16, sh.sliding_window);
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float o[DT][4];
#pragma unroll
    for (int n = 0; n < DT; n++)
        o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    /* ldmatrix lane roles: matrix mi = lane / 8, its row lane % 8 */
    const int mi = lane / 8, mr = lane % 8;

    for (int t0 = P.first; t0 <= P.last; t0 += TC_BK) {
        __syncthreads(); /* the previous tile is no longer read (and Q is in, the first time) */
        src.load(P, sh.page_size, t0, k, v, kh, kl, vh, vl);
        __syncthreads();
        if (t0 > warp_last || t0 + TC_BK <= warp_first)
            continue; /* no key of this tile is seen by the warp's rows */
        /* scores S = Q K^T of the warp's 16 rows and the tile's 64 keys */
        float sc[NT][4];
#pragma unroll
        for (int n = 0; n < NT; n++)
            sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < HD / 16; kk++) {
            uint32_t ah[4], al[4];
            const int qrow = warp * 16 + mr + (mi & 1) * 8, qcol = kk * 16 + (mi >> 1) * 8;
            ldsm_x4<false>(ah, qh + qrow * RS + qcol);
            if constexpr (Exact)
                ldsm_x4<false>(al, ql + qrow * RS + qcol);
#pragma unroll
            for (int np = 0; np < NT / 2; np++) {
                uint32_t bh[4], bl[4];
                const int krow = np * 16 + mr + (mi >> 1) * 8, kcol = kk * 16 + (mi & 1) * 8;
                ldsm_x4<false>(bh, kh + krow * RS + kcol);
                if constexpr (Exact)
                    ldsm_x4<false>(bl, kl + krow * RS + kcol);
#pragma unroll
                for (int h = 0; h < 2; h++)
                    mma_split<Exact>(sc[2 * np + h], ah, al, bh, bl, h);
            }
        }
        /* masks and the online softmax of rows g (h = 0) and g + 8 (h = 1) */
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = -INFINITY;
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const int key = t0 + n * 8 + 2 * t + e;
                    float &x = sc[n][2 * h + e];
                    if (key < rfirst[h] || key > rlast[h])
                        x = -INFINITY;
                    mx = fmaxf(mx, x);
                }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float nm = fmaxf(m[h], mx);
            float sum = 0.0f;
#pragma unroll
            for (int n = 0; n < NT; n++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float &x = sc[n][2 * h + e];
                    x = nm == -INFINITY || x == -INFINITY ? 0.0f : __expf(x - nm);
                    sum += x;
                }
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            corr[h] = nm == -INFINITY ? 1.0f : __expf(m[h] - nm);
            l[h] = l[h] * corr[h] + sum;
            m[h] = nm;
        }
#pragma unroll
        for (int n = 0; n < DT; n++)
            o[n][0] *= corr[0], o[n][1] *= corr[0], o[n][2] *= corr[1], o[n][3] *= corr[1];
            /* O += P V, 16 keys a step: the score accumulators of n-tiles 2kk, 2kk + 1 are P's A fragment */
#pragma unroll
        for (int kk = 0; kk < TC_BK / 16; kk++) {
            uint32_t ph[4], pl[4];
            split2(sc[2 * kk][0], sc[2 * kk][1], ph[0], pl[0]);
            split2(sc[2 * kk][2], sc[2 * kk][3], ph[1], pl[1]);
            split2(sc[2 * kk + 1][0], sc[2 * kk + 1][1], ph[2], pl[2]);
            split2(sc[2 * kk + 1][2], sc[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
            for (int np = 0; np < DT / 2; np++) {
                uint32_t bh[4], bl[4];
                const int vrow = kk * 16 + mr + (mi & 1) * 8, vcol = np * 16 + (mi >> 1) * 8;
                ldsm_x4<true>(bh, vh + vrow * RS + vcol);
                if constexpr (Exact)
                    ldsm_x4<true>(bl, vl + vrow * RS + vcol);
#pragma unroll
                for (int h = 0; h < 2; h++)
                    mma_split<Exact>(o[2 * np + h], ph, pl, bh, bl, h);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int qi = warp * 16 + g + 8 * h;
        if (qi >= P.nq)
            continue;
        float *orow = out + ((int64_t)(P.seq.q_start + P.qt0 + qi) * sh.n_heads + P.head) * HD;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
#pragma unroll
        for (int n = 0; n < DT; n++)
            *(float2 *)(orow + n * 8 + 2 * t) = make_float2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
    }
}

template <int HD, bool Exact, class SRC>
static void launch_prefill_tc(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v, SRC src,
                              const exl_batch *b, const exl_attn_shape *sh) {
    const size_t smem = tc_tile<HD, Exact>::smem_bytes;
    static size_t allowed[EXL_CUDA_MAX_DEVICES];
    if (!exl_cuda_smem_opt_in(cb, (const void *)attn_prefill_tc_kernel<HD, Exact, SRC>, smem, allowed)) {
        exl_cuda_check_launch(cb, "attention shared memory");
        return;
    }
    dim3 grid((unsigned)((b->max_q + TC_BQ - 1) / TC_BQ), (unsigned)sh->n_heads, (unsigned)b->n_seqs);
    exl_cuda_launch(cb, attn_prefill_tc_kernel<HD, Exact, SRC>, grid, dim3(TC_WARPS * 32), smem, out, q, k, v, src,
                    b->d_seqs, b->d_page_tables, *sh);
    exl_cuda_check_launch(cb, "prefill attention (tensor cores)");
}

template <int HD, int BK>
static void launch_prefill_tiled(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v,
                                 const __half *kc, const __half *vc, const exl_batch *b, const exl_attn_shape *sh) {
    const size_t smem = prefill_tile<HD, BK>::smem_floats * sizeof(float);
    static size_t allowed[EXL_CUDA_MAX_DEVICES];
    if (!exl_cuda_smem_opt_in(cb, (const void *)attn_prefill_tiled_kernel<HD, BK>, smem, allowed)) {
        exl_cuda_check_launch(cb, "attention shared memory");
        return;
    }
    dim3 grid((unsigned)((b->max_q + TQ - 1) / TQ), (unsigned)sh->n_heads, (unsigned)b->n_seqs);
    exl_cuda_launch(cb, attn_prefill_tiled_kernel<HD, BK>, grid, dim3(256), smem, out, q, k, v, kc, vc, b->d_seqs,
                    b->d_page_tables, *sh);
    exl_cuda_check_launch(cb, "prefill attention");
}

/* ---- dispatch */

static void launch_decode(exl_cuda_backend *cb, float *out, const float *q, const __half *kc, const __half *vc,
                          const exl_batch *b, const exl_attn_shape *sh, const decode_rope *rp);

void exl_cuda_run_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                            const void *k_cache, const void *v_cache, const exl_batch *b, const exl_attn_shape *sh) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (exl_cuda_kv_quantized(b)) {
        exl_cuda_run_attention_quant(be, out, q, k, v, k_cache, v_cache, b, sh);
        return;
    }
    if (b->n_rows < 1)
        return;
    if (sh->head_dim > MAX_HEAD_DIM || sh->head_dim % 8 || sh->n_kv_heads < 1 || sh->n_heads % sh->n_kv_heads) {
        exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED,
                            "CUDA attention needs head_dim a multiple of 8 up to %d and heads a multiple of kv heads "
                            "(got %d, %d/%d)",
                            MAX_HEAD_DIM, sh->head_dim, sh->n_heads, sh->n_kv_heads);
        return;
    }
    const __half *kc = (const __half *)k_cache, *vc = (const __half *)v_cache;
    const int tiled = (sh->head_dim == 64 || sh->head_dim == 128 || sh->head_dim == 256) && !(sh->softcap > 0.0f);
    if (exl_cuda_prompt_piece(b) && tiled) {
        const int tc = cb->sm_major >= 8 && !cb->prefill_attention_fp32;
        if (sh->head_dim == 64 && tc && cb->exact_prefill)
            launch_prefill_tc<64, true>(cb, out, q, k, v, tc_fp16_src<64, true>{kc, vc}, b, sh);
        else if (sh->head_dim == 64 && tc)
            launch_prefill_tc<64, false>(cb, out, q, k, v, tc_fp16_src<64, false>{kc, vc}, b, sh);
        else if (sh->head_dim == 128 && tc && cb->exact_prefill)
            launch_prefill_tc<128, true>(cb, out, q, k, v, tc_fp16_src<128, true>{kc, vc}, b, sh);
        else if (sh->head_dim == 128 && tc)
            launch_prefill_tc<128, false>(cb, out, q, k, v, tc_fp16_src<128, false>{kc, vc}, b, sh);
        else if (sh->head_dim == 64)
            launch_prefill_tiled<64, 64>(cb, out, q, k, v, kc, vc, b, sh);
        else if (sh->head_dim == 128)
            launch_prefill_tiled<128, 32>(cb, out, q, k, v, kc, vc, b, sh);
        else
            launch_prefill_tiled<256, 32>(cb, out, q, k, v, kc, vc, b, sh);
        return;
    }
    if (exl_cuda_prompt_piece(b)) {
        size_t smem = (size_t)Q_TILE * sh->head_dim * sizeof(float) + ATT_WARPS * 4 * KEY_BLOCK * sizeof(float) +
                      2 * KEY_BLOCK * (size_t)(sh->head_dim + 4) * sizeof(float);
        static size_t allowed[EXL_CUDA_MAX_DEVICES];
        if (!exl_cuda_smem_opt_in(cb, (const void *)attn_prefill_kernel, smem, allowed)) {
            exl_cuda_check_launch(cb, "attention shared memory");
            return;
        }
        dim3 grid((unsigned)((b->max_q + Q_TILE - 1) / Q_TILE), (unsigned)sh->n_heads, (unsigned)b->n_seqs);
        exl_cuda_launch(cb, attn_prefill_kernel, grid, dim3(ATT_WARPS * 32), smem, out, q, k, v, kc, vc, b->d_seqs,
                        b->d_page_tables, *sh);
        exl_cuda_check_launch(cb, "prefill attention");
        return;
    }
    launch_decode(cb, out, q, kc, vc, b, sh, NULL);
}

/* decode attention, with rope_kv_store's work for the row done by each block (rp) or not */
static void launch_decode(exl_cuda_backend *cb, float *out, const float *q, const __half *kc, const __half *vc,
                          const exl_batch *b, const exl_attn_shape *sh, const decode_rope *rp) {
    int64_t items = (int64_t)b->n_rows * sh->n_heads;
    /* sized for max_kv rounded up to the bucket: splits past the keys exit at once, and the
     * launch stays the same for the next tokens (graph replay) */
    int32_t max_kv = (b->max_kv + EXL_CUDA_KV_BUCKET - 1) / EXL_CUDA_KV_BUCKET * EXL_CUDA_KV_BUCKET;
    const int fast = (sh->head_dim == 128 || sh->head_dim == 64) && !(sh->softcap > 0.0f);
    /* short contexts: one split of SHORT_WARPS warps, a block of keys each (all of them fetched
     * before the wait), writing the output itself: no combine kernel (+3% at context 128) */
    const int short_ctx = fast && short_kernels_ok && max_kv <= SHORT_WARPS * KEY_BLOCK;
    int splits = 1, kps = max_kv;
    if (!short_ctx) {
        splits = (int)((4 * cb->n_sms + items - 1) / items);
        const int max_splits = (max_kv + 63) / 64;
        splits = splits > max_splits ? max_splits : splits;
        splits = splits > 64 ? 64 : splits < 1 ? 1 : splits;
        kps = (max_kv + splits - 1) / splits;
        kps = (kps + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
        splits = (max_kv + kps - 1) / kps;
    }
    if (splits > 1 &&
        !exl_cuda_ensure(cb, (void **)&cb->attn_partial, &cb->attn_partial_bytes,
                         (size_t)items * splits * (sh->head_dim + 2) * sizeof(float), "attention partials"))
        return;
    const dim3 grid((unsigned)items, (unsigned)splits);
    if (fast) {
        const int w = short_ctx ? SHORT_WARPS : ATT_WARPS;
        const decode_fast_fn k = rp ? fast_kernel<true>(sh->head_dim, short_ctx)
                                    : fast_kernel<false>(sh->head_dim, short_ctx);
        exl_cuda_launch(cb, k, grid, dim3(w * 32), FAST_SMEM(sh->head_dim, w), out, cb->attn_partial, q, kc, vc,
                        b->d_seqs, b->n_seqs, b->d_page_tables, *sh, kps, rp ? *rp : decode_rope{});
    } else {
        exl_cuda_launch(cb, attn_decode_kernel, grid, dim3(ATT_WARPS * 32), 0, out, cb->attn_partial, q, kc, vc,
                        b->d_seqs, b->n_seqs, b->d_page_tables, *sh, kps);
    }
    exl_cuda_check_launch(cb, "decode attention");
    if (splits > 1) {
        exl_cuda_launch(cb, attn_combine_kernel, dim3((unsigned)items), dim3(128), 0, out, cb->attn_partial,
                        sh->head_dim, splits, rp ? rp->oo : out_order{});
        exl_cuda_check_launch(cb, "attention combine");
    }
}

int exl_cuda_prefill_tc_quant(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v,
                              const qk_side &ks, const qk_side &vs, const exl_batch *b, const exl_attn_shape *sh) {
    if (cb->sm_major < 8 || cb->prefill_attention_fp32 || b->kv.group != 32 || sh->softcap > 0.0f || b->n_rows < 1)
        return 0;
    if (sh->head_dim == 64 && cb->exact_prefill)
        launch_prefill_tc<64, true>(cb, out, q, k, v, tc_quant_src<64, true>{ks, vs}, b, sh);
    else if (sh->head_dim == 64)
        launch_prefill_tc<64, false>(cb, out, q, k, v, tc_quant_src<64, false>{ks, vs}, b, sh);
    else if (sh->head_dim == 128 && cb->exact_prefill)
        launch_prefill_tc<128, true>(cb, out, q, k, v, tc_quant_src<128, true>{ks, vs}, b, sh);
    else if (sh->head_dim == 128)
        launch_prefill_tc<128, false>(cb, out, q, k, v, tc_quant_src<128, false>{ks, vs}, b, sh);
    else
        return 0;
    return 1;
}

int exl_cuda_rope_attention_fuses(const exl_cuda_backend *cb, const exl_batch *b, const exl_attn_shape *sh,
                                  int32_t rot_dim) {
    /* one new token a sequence, a head_dim of the fast decode kernel, and blocks for at most about one wave (past
     * that the rope kernel's one pass costs less than each block's own: 64 rows of a 7B model lost 2.6% fused,
     * bench/RESULTS.md); an fp16 cache (the kernel writes fp16 rows) */
    if (exl_cuda_kv_quantized(b))
        return 0;
    return b->n_rows >= 1 && b->max_q == 1 && (sh->head_dim == 64 || sh->head_dim == 128) && !(sh->softcap > 0.0f) &&
           rot_dim >= 2 && rot_dim <= sh->head_dim && sh->n_kv_heads >= 1 && sh->n_heads % sh->n_kv_heads == 0 &&
           (int64_t)b->n_rows * sh->n_heads <= 4 * (int64_t)cb->n_sms;
}

void exl_cuda_run_rope_attention(exl_backend *be, float *out, float *q, float *k, const float *v, void *k_cache,
                                 void *v_cache, const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim,
                                 const float *inv_freq, float attn_factor, const int32_t *out_order) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (exl_cuda_rope_attention_fuses(cb, b, sh, rot_dim)) {
        decode_rope rp = {k, v, inv_freq, attn_factor, rot_dim / 2, {out_order, sh->n_heads * sh->head_dim}};
        launch_decode(cb, out, q, (const __half *)k_cache, (const __half *)v_cache, b, sh, &rp);
        return;
    }
    if (out_order) { /* the plan gives an order only where the one launch takes the step */
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "internal: an attention output order without the fused kernel");
        return;
    }
    exl_cuda_run_rope_kv_store(be, q, k, v, k_cache, v_cache, b, sh, rot_dim, inv_freq, attn_factor);
    exl_cuda_run_attention(be, out, q, k, v, k_cache, v_cache, b, sh);
}

void exl_cuda_attention_init(void) {
    /* the short-context decode kernels hold more than the default 48 KiB of shared memory
     * (68 KiB for head_dim 128: not on sm_75, whose blocks have 64 KiB at most) */
    short_kernels_ok = 1;
    for (int hd = 64; hd <= 128; hd += 64)
        short_kernels_ok = short_kernels_ok &&
                           cudaFuncSetAttribute(fast_kernel<false>(hd, true),
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)FAST_SMEM(hd, SHORT_WARPS)) == cudaSuccess &&
                           cudaFuncSetAttribute(fast_kernel<true>(hd, true),
                                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                (int)FAST_SMEM(hd, SHORT_WARPS)) == cudaSuccess;
    cudaGetLastError();
}
