/* cuda_kv_quant.cu - the KV cache on CUDA when either side is quantized (backend/kv_quant.h): the KV store (with the
 * rope of q and k before it, or without), and attention that reads the quantized slots as they are, with no
 * dequantized copy of the cache. A full-precision side is fp16 rows, as in cuda_attention.cu.
 *
 * Store: one block a row; a warp quantizes 32 values of a side at a time, each lane one: the group's Hadamard
 * rotation by shuffles, its largest magnitude by a reduction, then the codes packed by the lanes that own a byte
 * (4 bits: even lanes, 6 bits: every fourth lane, three bytes).
 * Decode (at most EXL_CUDA_DECODE_MAX_Q new tokens a sequence): flash decoding as attn_decode_kernel, a block a
 * (row, head) and split of its keys, 4 warps of 32 keys at a time. A lane scores its key against the query rotated
 * group by group (16 codes at a time: sum of code * q less the zero point times their sum of q, times the group's
 * scale); the values are summed one dimension a lane, rotated, and turned back once at the end by shuffles. The
 * step's own keys and values come from the fp32 k and v, as computed.
 * Prefill: a block takes 16 queries of one head and 32 keys at a time into shared memory as fp32, a warp
 * decoding 32 values of a key (turned back by shuffles) at a time; then as attn_prefill_kernel.
 * Scores are soft-capped where the layer asks, as in cuda_attention.cu. Needs head_dim a multiple of 16 up to 256.
 * fp32 arithmetic throughout. */
#include "backend/cuda/cuda_internal.h"
#include "backend/kv_quant.h"

#include <math.h>

#define QK_WARPS 4
#define QK_KEYS 32 /* keys a warp scores at a time (one a lane), and a prefill tile's keys */
#define QK_MAX_HD 256
#define QK_MAX_DPL (QK_MAX_HD / 32) /* dimensions a lane sums */
#define QK_Q_TILE 16                /* queries of a prefill block */
#define FULL 0xffffffffu

/* One side of a cache layer as the kernels read it: fp16 rows (bits 16) or quantized slots. */
typedef struct qk_side {
    unsigned char *base;
    int64_t slot_bytes;
    int32_t codes_bytes, bits;
} qk_side;

static qk_side side_of(const void *cache, int32_t bits, int32_t group, int32_t width) {
    qk_side s;
    s.base = (unsigned char *)(uintptr_t)cache;
    s.bits = exl_kv_quantized(bits) ? bits : 16;
    s.slot_bytes = (int64_t)exl_kv_slot_bytes(width, s.bits, group, sizeof(__half));
    s.codes_bytes = s.bits < 16 ? (int32_t)exl_kv_codes_bytes(width, s.bits) : 0;
    return s;
}

static int kv_quantized(const exl_batch *b) { return exl_kv_quantized(b->kv.k_bits) || exl_kv_quantized(b->kv.v_bits); }

/* x of each lane becomes the Hadamard rotation over its group of g lanes (g = 16 or 32, its own inverse) */
__device__ __forceinline__ float hadamard_lanes(float x, int g) {
    const int lane = threadIdx.x % 32;
    for (int len = 1; len < g; len <<= 1) {
        const float p = __shfl_xor_sync(FULL, x, len);
        x = lane & len ? p - x : x + p;
    }
    return x * (1.0f / sqrtf((float)g));
}

/* ---- store */

/* 32 values of a row, x of each lane (valid: the lane has one), into the slot's codes at value j0 + lane. */
__device__ __forceinline__ void quantize_lanes(const qk_side &s, unsigned char *slot, float x, int j0, int valid,
                                               int g) {
    const int lane = threadIdx.x % 32, j = j0 + lane, top = (1 << s.bits) - 1;
    x = hadamard_lanes(valid ? x : 0.0f, g);
    float mx = fabsf(x);
    for (int o = 1; o < g; o <<= 1)
        mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
    const __half h = __float2half_rn(2.0f * mx / (float)top);
    const float sc = __half2float(h), inv = sc > 0.0f ? 1.0f / sc : 0.0f;
    const int c = min(max((int)rintf(x * inv + 0.5f * (float)top), 0), top);
    const int c1 = __shfl_down_sync(FULL, c, 1), c2 = __shfl_down_sync(FULL, c, 2), c3 = __shfl_down_sync(FULL, c, 3);
    if (!valid)
        return;
    if (lane % g == 0)
        ((__half *)(slot + s.codes_bytes))[j / g] = h;
    if (s.bits == 8) {
        slot[j] = (unsigned char)c;
    } else if (s.bits == 4) {
        if (j % 2 == 0)
            slot[j / 2] = (unsigned char)(c | c1 << 4);
    } else if (j % 4 == 0) { /* 6 bits: four values in three bytes */
        const uint32_t w = (uint32_t)c | (uint32_t)c1 << 6 | (uint32_t)c2 << 12 | (uint32_t)c3 << 18;
        unsigned char *p = slot + j / 4 * 3;
        p[0] = (unsigned char)w, p[1] = (unsigned char)(w >> 8), p[2] = (unsigned char)(w >> 16);
    }
}

/* Block r: rope of row r's q and k in place (ROPE), then its k and v to their slot. */
template <bool ROPE>
__global__ void kv_store_quant_kernel(float *q, float *k, const float *v, qk_side ks, qk_side vs, const int32_t *slots,
                                      const int32_t *pos, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                      int32_t half, const float *inv_freq, float attn_factor, int32_t group) {
    exl_pdl_start();
    const int32_t r = blockIdx.x, kvw = n_kv_heads * head_dim;
    if (ROPE) {
        const int32_t nq = n_heads * half, nk = n_kv_heads * half;
        for (int32_t t = threadIdx.x; t < nq + nk; t += blockDim.x) {
            const int is_k = t >= nq;
            const int32_t u = is_k ? t - nq : t, h = u / half, i = u % half;
            float *x = is_k ? k + (int64_t)r * kvw + h * head_dim : q + ((int64_t)r * n_heads + h) * head_dim;
            float sn, cs;
            sincosf((float)pos[r] * inv_freq[i], &sn, &cs);
            cs *= attn_factor, sn *= attn_factor;
            const float a = x[i], b = x[i + half];
            x[i] = a * cs - b * sn;
            x[i + half] = b * cs + a * sn;
        }
        __syncthreads(); /* the rotated k, written above, is read below */
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    const int32_t chunks = (kvw + 31) / 32;
    for (int32_t u = warp; u < 2 * chunks; u += n_warps) {
        const int is_v = u >= chunks;
        const qk_side s = is_v ? vs : ks;
        const float *x = (is_v ? v : k) + (int64_t)r * kvw;
        const int32_t j0 = (is_v ? u - chunks : u) * 32, j = j0 + lane;
        unsigned char *slot = s.base + (int64_t)slots[r] * s.slot_bytes;
        const float xv = j < kvw ? x[j] : 0.0f;
        if (s.bits == 16) {
            if (j < kvw)
                ((__half *)slot)[j] = __float2half_rn(xv);
        } else {
            quantize_lanes(s, slot, xv, j0, j < kvw, group);
        }
    }
}

static void launch_store(exl_cuda_backend *cb, float *q, float *k, const float *v, void *k_cache, void *v_cache,
                         const exl_batch *b, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t rot_dim,
                         const float *inv_freq, float attn_factor) {
    const int32_t kvw = n_kv_heads * head_dim;
    if (b->n_rows < 1)
        return;
    if (kvw % 16 || b->kv.group % 16) {
        exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED, "CUDA: a quantized kv cache needs head_dim a multiple of 16");
        return;
    }
    const qk_side ks = side_of(k_cache, b->kv.k_bits, b->kv.group, kvw);
    const qk_side vs = side_of(v_cache, b->kv.v_bits, b->kv.group, kvw);
    if (rot_dim >= 2)
        exl_cuda_launch(cb, kv_store_quant_kernel<true>, dim3((unsigned)b->n_rows), dim3(256), 0, q, k, v, ks, vs,
                        b->d_slots, b->d_pos, n_heads, n_kv_heads, head_dim, rot_dim / 2, inv_freq, attn_factor,
                        b->kv.group);
    else
        exl_cuda_launch(cb, kv_store_quant_kernel<false>, dim3((unsigned)b->n_rows), dim3(256), 0, q, k, v, ks, vs,
                        b->d_slots, b->d_pos, n_heads, n_kv_heads, head_dim, 0, inv_freq, attn_factor, b->kv.group);
    exl_cuda_check_launch(cb, "quantized kv store");
}

void exl_cuda_run_kv_store_quant(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                                 const exl_batch *b, int32_t kv_width) {
    /* the group divides head_dim, and the store works on the row: one head of the row's width will do */
    launch_store(exl_cuda(be), NULL, (float *)(uintptr_t)k, v, k_cache, v_cache, b, 1, 1, kv_width, 0, NULL, 1.0f);
}

void exl_cuda_run_rope_kv_store_quant(exl_backend *be, float *q, float *k, const float *v, void *k_cache, void *v_cache,
                                      const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim,
                                      const float *inv_freq, float attn_factor) {
    launch_store(exl_cuda(be), q, k, v, k_cache, v_cache, b, sh->n_heads, sh->n_kv_heads, sh->head_dim, rot_dim,
                 inv_freq, attn_factor);
}

/* ---- reading a slot */

/* 16 consecutive codes of BITS from the 4-byte aligned p (value i at bits i * BITS) */
template <int BITS>
__device__ __forceinline__ void codes16(const unsigned char *p, uint32_t (&c)[16]) {
    constexpr int W = BITS / 2; /* 32-bit words of 16 codes */
    uint32_t w[W];
#pragma unroll
    for (int i = 0; i < W; i++)
        w[i] = __ldg((const uint32_t *)p + i);
#pragma unroll
    for (int i = 0; i < 16; i++) {
        constexpr uint32_t mask = (1u << BITS) - 1;
        const int bit = i * BITS, at = bit / 32, sh = bit % 32;
        uint32_t x = w[at] >> sh;
        if (sh + BITS > 32)
            x |= w[at + 1] << (32 - sh);
        c[i] = x & mask;
    }
}

/* code d of a head's codes at p (any d) */
template <int BITS>
__device__ __forceinline__ uint32_t code_at(const unsigned char *p, int d) {
    const int bit = d * BITS;
    uint32_t x = __ldg(p + bit / 8);
    if (bit % 8 + BITS > 8)
        x |= (uint32_t)__ldg(p + bit / 8 + 1) << 8;
    return (x >> (bit % 8)) & ((1u << BITS) - 1);
}

/* Where one query row's block works: as decode_place in cuda_attention.cu. */
typedef struct qk_block {
    int row, head, kvh, k0, k1, fresh, q_start;
    const int32_t *pages;
} qk_block;

__device__ __forceinline__ int64_t qk_slot(const int32_t *pages, int32_t t, int32_t page_size) {
    return (int64_t)pages[t / page_size] * page_size + t % page_size;
}

__device__ __forceinline__ int qk_window_first(int pos, int window) {
    return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

/* ---- decode */

template <int KB, int VB>
__global__ void __launch_bounds__(QK_WARPS * 32)
    qk_decode_kernel(float *out, float *partial, const float *q, const float *k, const float *v, qk_side ks, qk_side vs,
                     const exl_attn_seq *seqs, int n_seqs, const int32_t *page_tables, exl_attn_shape sh, int32_t group,
                     int keys_per_split) {
    constexpr int KQ = KB < 16 ? KB : 8, VQ = VB < 16 ? VB : 8; /* code widths (unused at 16 bits) */
    exl_pdl_start();
    __shared__ float qp[QK_MAX_HD], qr[QK_MAX_HD], qsum[QK_MAX_HD / 16];
    __shared__ float wm[QK_WARPS], wl[QK_WARPS];
    __shared__ float wacc[QK_WARPS][QK_MAX_HD];
    const int hd = sh.head_dim, kvw = sh.n_kv_heads * hd, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int row = blockIdx.x / sh.n_heads, head = blockIdx.x % sh.n_heads, split = blockIdx.y;
    const int kvh = head / (sh.n_heads / sh.n_kv_heads);
    int s = 0;
    while (s + 1 < n_seqs && row >= seqs[s + 1].q_start)
        s++;
    const exl_attn_seq seq = seqs[s];
    const int32_t *pages = page_tables + seq.page_start;
    const int fresh = seq.n_kv - seq.n_q, last = fresh + row - seq.q_start;
    const int k0 = qk_window_first(last, sh.sliding_window) + split * keys_per_split;
    const int k1 = min(last + 1, k0 + keys_per_split);

    /* the query, scaled: plain, and rotated group by group (warp 0) with the sums of its 16-value chunks */
    for (int i = threadIdx.x; i < hd; i += blockDim.x)
        qp[i] = q[((int64_t)row * sh.n_heads + head) * hd + i] * sh.scale;
    __syncthreads();
    if (warp == 0)
        for (int d0 = 0; d0 < hd; d0 += 32) {
            const int d = d0 + lane;
            const float x = hadamard_lanes(d < hd ? qp[d] : 0.0f, group);
            if (d < hd)
                qr[d] = x;
            float c = x;
            for (int o = 1; o < 16; o <<= 1)
                c += __shfl_xor_sync(FULL, c, o);
            if (lane % 16 == 0 && d < hd)
                qsum[d / 16] = c;
        }
    __syncthreads();

    const float kz = 0.5f * (float)((1 << KQ) - 1), vz = 0.5f * (float)((1 << VQ) - 1);
    float m = -INFINITY, l = 0.0f, accp[QK_MAX_DPL], accr[QK_MAX_DPL];
#pragma unroll
    for (int i = 0; i < QK_MAX_DPL; i++)
        accp[i] = accr[i] = 0.0f;
    for (int t0 = k0 + warp * QK_KEYS; t0 < k1; t0 += QK_WARPS * QK_KEYS) {
        const int t = t0 + lane;
        const int64_t slot = t < k1 && t < fresh ? qk_slot(pages, t, sh.page_size) : 0;
        float sc = -INFINITY;
        if (t < k1 && t >= fresh) { /* this step's key, as computed */
            const float *kr = k + (int64_t)(seq.q_start + t - fresh) * kvw + (int64_t)kvh * hd;
            sc = 0.0f;
            for (int i = 0; i < hd; i++)
                sc += qp[i] * kr[i];
        } else if (t < k1) {
            const unsigned char *sp = ks.base + slot * ks.slot_bytes;
            sc = 0.0f;
            if constexpr (KB == 16) {
                const __half *kr = (const __half *)sp + (int64_t)kvh * hd;
                for (int i = 0; i < hd; i += 2) {
                    const float2 f = __half22float2(*(const __half2 *)(kr + i));
                    sc += qp[i] * f.x + qp[i + 1] * f.y;
                }
            } else {
                const unsigned char *codes = sp + (int64_t)kvh * hd * KQ / 8;
                const __half *scales = (const __half *)(sp + ks.codes_bytes) + kvh * (hd / group);
                for (int c0 = 0; c0 < hd; c0 += 16) {
                    uint32_t c[16];
                    codes16<KQ>(codes + c0 * KQ / 8, c);
                    float a = 0.0f;
#pragma unroll
                    for (int i = 0; i < 16; i++)
                        a += (float)c[i] * qr[c0 + i];
                    sc += __half2float(scales[c0 / group]) * (a - kz * qsum[c0 / 16]);
                }
            }
        }
        if (sh.softcap > 0.0f && t < k1)
            sc = sh.softcap * tanhf(sc / sh.softcap);
        float nm = fmaxf(m, sc);
        for (int o = 16; o > 0; o >>= 1)
            nm = fmaxf(nm, __shfl_xor_sync(FULL, nm, o));
        const float p = t < k1 ? __expf(sc - nm) : 0.0f, corr = __expf(m - nm);
        float ps = p;
        for (int o = 16; o > 0; o >>= 1)
            ps += __shfl_xor_sync(FULL, ps, o);
        l = l * corr + ps;
        m = nm;
#pragma unroll
        for (int i = 0; i < QK_MAX_DPL; i++)
            accp[i] *= corr, accr[i] *= corr;
        const int n = min(QK_KEYS, k1 - t0);
        for (int j = 0; j < n; j++) {
            const float pj = __shfl_sync(FULL, p, j);
            const int64_t sj = __shfl_sync(FULL, slot, j);
            const int tj = t0 + j;
            if (tj >= fresh) {
                const float *vr = v + (int64_t)(seq.q_start + tj - fresh) * kvw + (int64_t)kvh * hd;
#pragma unroll
                for (int i = 0; i < QK_MAX_DPL; i++)
                    if (lane + 32 * i < hd)
                        accp[i] += pj * vr[lane + 32 * i];
            } else if constexpr (VB == 16) {
                const __half *vr = (const __half *)(vs.base + sj * vs.slot_bytes) + (int64_t)kvh * hd;
#pragma unroll
                for (int i = 0; i < QK_MAX_DPL; i++)
                    if (lane + 32 * i < hd)
                        accp[i] += pj * __half2float(vr[lane + 32 * i]);
            } else {
                const unsigned char *sp = vs.base + sj * vs.slot_bytes;
                const unsigned char *codes = sp + (int64_t)kvh * hd * VQ / 8;
                const __half *scales = (const __half *)(sp + vs.codes_bytes) + kvh * (hd / group);
#pragma unroll
                for (int i = 0; i < QK_MAX_DPL; i++) {
                    const int d = lane + 32 * i;
                    if (d < hd)
                        accr[i] += pj * __half2float(scales[d / group]) * ((float)code_at<VQ>(codes, d) - vz);
                }
            }
        }
    }
    /* the rotated sums turned back (the groups of a dimension i are lanes of 32 or 16), added to the plain ones */
#pragma unroll
    for (int i = 0; i < QK_MAX_DPL; i++)
        if (32 * i < hd)
            accp[i] += VB < 16 ? hadamard_lanes(accr[i], group) : 0.0f;
    if (lane == 0)
        wm[warp] = m, wl[warp] = l;
#pragma unroll
    for (int i = 0; i < QK_MAX_DPL; i++)
        if (lane + 32 * i < hd)
            wacc[warp][lane + 32 * i] = accp[i];
    __syncthreads();
    float bm = -INFINITY, bl = 0.0f;
    for (int w = 0; w < QK_WARPS; w++)
        bm = fmaxf(bm, wm[w]);
    for (int w = 0; w < QK_WARPS; w++)
        bl += wm[w] == -INFINITY ? 0.0f : wl[w] * __expf(wm[w] - bm);
    const int64_t rh = (int64_t)row * sh.n_heads + head;
    float *pp = partial + (rh * gridDim.y + split) * (hd + 2);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int w = 0; w < QK_WARPS; w++)
            a += wm[w] == -INFINITY ? 0.0f : wacc[w][d] * __expf(wm[w] - bm);
        if (gridDim.y == 1)
            out[rh * hd + d] = bl > 0.0f ? a / bl : 0.0f;
        else
            pp[2 + d] = a;
    }
    if (gridDim.y > 1 && threadIdx.x == 0)
        pp[0] = bm, pp[1] = bl;
}

__global__ void qk_combine_kernel(float *out, const float *partial, int hd, int n_splits) {
    exl_pdl_start();
    const int64_t rh = blockIdx.x;
    const float *pp = partial + rh * n_splits * (hd + 2);
    float m = -INFINITY, l = 0.0f;
    for (int s = 0; s < n_splits; s++)
        m = fmaxf(m, pp[s * (hd + 2)]);
    for (int s = 0; s < n_splits; s++)
        l += pp[s * (hd + 2)] == -INFINITY ? 0.0f : pp[s * (hd + 2) + 1] * __expf(pp[s * (hd + 2)] - m);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < n_splits; s++) {
            const float ms = pp[s * (hd + 2)];
            a += ms == -INFINITY ? 0.0f : pp[s * (hd + 2) + 2 + d] * __expf(ms - m);
        }
        out[rh * hd + d] = l > 0.0f ? a / l : 0.0f;
    }
}

template <int KB, int VB>
static void launch_decode(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v,
                          const qk_side &ks, const qk_side &vs, const exl_batch *b, const exl_attn_shape *sh) {
    const int64_t items = (int64_t)b->n_rows * sh->n_heads;
    /* b->max_kv is rounded up to EXL_CUDA_KV_BUCKET (exl_cuda_device_batch): the launch stays the same for the
     * next tokens (graph replay), splits past the keys exit at once */
    const int32_t max_kv = b->max_kv > 0 ? b->max_kv : 1;
    int splits = (int)((4 * cb->n_sms + items - 1) / items);
    const int max_splits = (max_kv + 63) / 64;
    splits = splits > max_splits ? max_splits : splits;
    splits = splits > 64 ? 64 : splits < 1 ? 1 : splits;
    int kps = (max_kv + splits - 1) / splits;
    kps = (kps + QK_KEYS - 1) / QK_KEYS * QK_KEYS;
    splits = (max_kv + kps - 1) / kps;
    if (splits > 1 &&
        !exl_cuda_ensure(cb, (void **)&cb->attn_partial, &cb->attn_partial_bytes,
                         (size_t)items * splits * (sh->head_dim + 2) * sizeof(float), "attention partials"))
        return;
    exl_cuda_launch(cb, qk_decode_kernel<KB, VB>, dim3((unsigned)items, (unsigned)splits), dim3(QK_WARPS * 32), 0, out,
                    cb->attn_partial, q, k, v, ks, vs, b->d_seqs, b->n_seqs, b->d_page_tables, *sh, b->kv.group, kps);
    exl_cuda_check_launch(cb, "decode attention (quantized kv cache)");
    if (splits > 1) {
        exl_cuda_launch(cb, qk_combine_kernel, dim3((unsigned)items), dim3(128), 0, out, cb->attn_partial, sh->head_dim,
                        splits);
        exl_cuda_check_launch(cb, "attention combine (quantized kv cache)");
    }
}

/* ---- prefill */

/* dims d0 + lane of key `key` of block P's sequence, K (or V) side s, decoded and turned back into kf (a warp's
 * lanes together: every lane calls it with the same key) */
template <int BITS>
__device__ __forceinline__ float load_key_dim(const qk_side &s, const float *rows, const exl_attn_seq &seq,
                                              const int32_t *pages, const exl_attn_shape &sh, int kvh, int key, int d,
                                              int group) {
    const int hd = sh.head_dim, kvw = sh.n_kv_heads * hd, past = seq.n_kv - seq.n_q;
    if (key >= past) /* this step's row, as computed */
        return d < hd ? rows[(int64_t)(seq.q_start + key - past) * kvw + (int64_t)kvh * hd + d] : 0.0f;
    const unsigned char *sp = s.base + qk_slot(pages, key, sh.page_size) * s.slot_bytes;
    if constexpr (BITS == 16) {
        return d < hd ? __half2float(((const __half *)sp)[(int64_t)kvh * hd + d]) : 0.0f;
    } else {
        const float z = 0.5f * (float)((1 << BITS) - 1);
        float x = 0.0f;
        if (d < hd) {
            const __half *scales = (const __half *)(sp + s.codes_bytes) + kvh * (hd / group);
            x = ((float)code_at<BITS>(sp + (int64_t)kvh * hd * BITS / 8, d) - z) * __half2float(scales[d / group]);
        }
        return hadamard_lanes(x, group);
    }
}

template <int KB, int VB>
__global__ void __launch_bounds__(QK_WARPS * 32)
    qk_prefill_kernel(float *out, const float *q, const float *k, const float *v, qk_side ks, qk_side vs,
                      const exl_attn_seq *seqs, const int32_t *page_tables, exl_attn_shape sh, int32_t group) {
    exl_pdl_start();
    extern __shared__ float smem[];
    const int hd = sh.head_dim, rs = hd + 1; /* K/V row stride in floats: a lane a row, each in its own bank */
    float *qs = smem;                        /* [QK_Q_TILE][hd] */
    float *ps = qs + QK_Q_TILE * hd;         /* [QK_WARPS][4][QK_KEYS] */
    float *kt = ps + QK_WARPS * 4 * QK_KEYS; /* [QK_KEYS][rs] */
    float *vt = kt + QK_KEYS * rs;           /* [QK_KEYS][rs] */
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const exl_attn_seq seq = seqs[blockIdx.z];
    const int qt0 = blockIdx.x * QK_Q_TILE;
    if (qt0 >= seq.n_q)
        return;
    const int head = blockIdx.y, kvh = head / (sh.n_heads / sh.n_kv_heads), nq = min(QK_Q_TILE, seq.n_q - qt0);
    const int32_t *pages = page_tables + seq.page_start;
    const int past = seq.n_kv - seq.n_q, last = past + qt0 + nq - 1;
    int first = qk_window_first(past + qt0, sh.sliding_window);
    first -= first % QK_KEYS;

    for (int i = threadIdx.x; i < QK_Q_TILE * hd; i += blockDim.x) {
        const int qi = i / hd;
        qs[i] = qi < nq ? q[((int64_t)(seq.q_start + qt0 + qi) * sh.n_heads + head) * hd + i % hd] * sh.scale : 0.0f;
    }
    float m[4], l[4], acc[4][QK_MAX_DPL];
    int qlast[4], qfirst[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int qi = warp * 4 + j;
        m[j] = -INFINITY, l[j] = 0.0f;
        qlast[j] = qi < nq ? past + qt0 + qi : -1;
        qfirst[j] = qk_window_first(qlast[j], sh.sliding_window);
#pragma unroll
        for (int i = 0; i < QK_MAX_DPL; i++)
            acc[j][i] = 0.0f;
    }
    float *pw = ps + warp * 4 * QK_KEYS;
    const int chunks = (hd + 31) / 32;
    for (int t0 = first; t0 <= last; t0 += QK_KEYS) {
        __syncthreads(); /* the previous tile's K and V are no longer read */
        for (int u = warp; u < QK_KEYS * chunks; u += QK_WARPS) {
            const int j = u / chunks, d = u % chunks * 32 + lane, key = t0 + j;
            float kf = 0.0f, vf = 0.0f;
            if (key <= last) { /* the same for the whole warp */
                kf = load_key_dim<KB>(ks, k, seq, pages, sh, kvh, key, d, group);
                vf = load_key_dim<VB>(vs, v, seq, pages, sh, kvh, key, d, group);
            }
            if (d < hd)
                kt[j * rs + d] = kf, vt[j * rs + d] = vf;
        }
        __syncthreads();
        const int t = t0 + lane;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const bool valid = t >= qfirst[j] && t <= qlast[j];
            float s = -INFINITY;
            if (valid) {
                const float *qrow = qs + (warp * 4 + j) * hd, *krow = kt + lane * rs;
                s = 0.0f;
                for (int i = 0; i < hd; i++)
                    s += qrow[i] * krow[i];
                if (sh.softcap > 0.0f)
                    s = sh.softcap * tanhf(s / sh.softcap);
            }
            float nm = fmaxf(m[j], s);
            for (int o = 16; o > 0; o >>= 1)
                nm = fmaxf(nm, __shfl_xor_sync(FULL, nm, o));
            const float p = valid ? __expf(s - nm) : 0.0f;
            float sum = p;
            for (int o = 16; o > 0; o >>= 1)
                sum += __shfl_xor_sync(FULL, sum, o);
            const float corr = nm == -INFINITY ? 1.0f : __expf(m[j] - nm);
            l[j] = l[j] * corr + sum;
            m[j] = nm;
#pragma unroll
            for (int i = 0; i < QK_MAX_DPL; i++)
                acc[j][i] *= corr;
            pw[j * QK_KEYS + lane] = p;
        }
        __syncwarp();
        for (int kj = 0; kj < QK_KEYS; kj++) {
#pragma unroll
            for (int i = 0; i < QK_MAX_DPL; i++)
                if (lane + 32 * i < hd) {
                    const float vv = vt[kj * rs + lane + 32 * i];
#pragma unroll
                    for (int j = 0; j < 4; j++)
                        acc[j][i] += pw[j * QK_KEYS + kj] * vv;
                }
        }
        __syncwarp();
    }
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int qi = warp * 4 + j;
        if (qi >= nq)
            continue;
        float *o = out + ((int64_t)(seq.q_start + qt0 + qi) * sh.n_heads + head) * hd;
#pragma unroll
        for (int i = 0; i < QK_MAX_DPL; i++)
            if (lane + 32 * i < hd)
                o[lane + 32 * i] = l[j] > 0.0f ? acc[j][i] / l[j] : 0.0f;
    }
}

template <int KB, int VB>
static void launch_prefill(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v,
                           const qk_side &ks, const qk_side &vs, const exl_batch *b, const exl_attn_shape *sh) {
    const size_t smem = ((size_t)QK_Q_TILE * sh->head_dim + QK_WARPS * 4 * QK_KEYS +
                         2 * (size_t)QK_KEYS * (sh->head_dim + 1)) *
                        sizeof(float);
    static size_t allowed = 48 * 1024;
    if (smem > allowed) {
        if (cudaFuncSetAttribute(qk_prefill_kernel<KB, VB>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
            cudaSuccess) {
            exl_cuda_check_launch(cb, "attention shared memory (quantized kv cache)");
            return;
        }
        allowed = smem;
    }
    const dim3 grid((unsigned)((b->max_q + QK_Q_TILE - 1) / QK_Q_TILE), (unsigned)sh->n_heads, (unsigned)b->n_seqs);
    exl_cuda_launch(cb, qk_prefill_kernel<KB, VB>, grid, dim3(QK_WARPS * 32), smem, out, q, k, v, ks, vs, b->d_seqs,
                    b->d_page_tables, *sh, b->kv.group);
    exl_cuda_check_launch(cb, "prefill attention (quantized kv cache)");
}

/* ---- dispatch: a kernel for each pair of widths */

typedef void (*qk_launcher)(exl_cuda_backend *, float *, const float *, const float *, const float *, const qk_side &,
                            const qk_side &, const exl_batch *, const exl_attn_shape *);

template <int KB, int VB>
static void launch(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v, const qk_side &ks,
                   const qk_side &vs, const exl_batch *b, const exl_attn_shape *sh) {
    if (b->max_q > EXL_CUDA_DECODE_MAX_Q)
        launch_prefill<KB, VB>(cb, out, q, k, v, ks, vs, b, sh);
    else
        launch_decode<KB, VB>(cb, out, q, k, v, ks, vs, b, sh);
}

template <int KB>
static qk_launcher launcher_v(int vb) {
    return vb == 8 ? launch<KB, 8> : vb == 6 ? launch<KB, 6> : vb == 4 ? launch<KB, 4> : launch<KB, 16>;
}

static qk_launcher launcher(int kb, int vb) {
    return kb == 8 ? launcher_v<8>(vb) : kb == 6 ? launcher_v<6>(vb) : kb == 4 ? launcher_v<4>(vb) : launcher_v<16>(vb);
}

void exl_cuda_run_attention_quant(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                                  const void *k_cache, const void *v_cache, const exl_batch *b,
                                  const exl_attn_shape *sh) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (b->n_rows < 1)
        return;
    if (sh->head_dim % 16 || sh->head_dim > QK_MAX_HD || b->kv.group % 16 || sh->head_dim % b->kv.group ||
        sh->n_kv_heads < 1 || sh->n_heads % sh->n_kv_heads) {
        exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED,
                            "CUDA attention over a quantized kv cache needs head_dim a multiple of 16 up to %d and "
                            "heads a multiple of kv heads (got %d, %d/%d)",
                            QK_MAX_HD, sh->head_dim, sh->n_heads, sh->n_kv_heads);
        return;
    }
    const int32_t kvw = sh->n_kv_heads * sh->head_dim;
    const qk_side ks = side_of(k_cache, b->kv.k_bits, b->kv.group, kvw);
    const qk_side vs = side_of(v_cache, b->kv.v_bits, b->kv.group, kvw);
    launcher(ks.bits, vs.bits)(cb, out, q, k, v, ks, vs, b, sh);
}

int exl_cuda_kv_quantized(const exl_batch *b) { return kv_quantized(b); }
