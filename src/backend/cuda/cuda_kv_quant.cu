/* cuda_kv_quant.cu - the KV cache on CUDA when either side is quantized (backend/kv_quant.h): the KV store (with the
 * rope of q and k before it, or without), and attention that reads the quantized slots as they are, with no
 * dequantized copy of the cache. A full-precision side is fp16 rows, as in cuda_attention.cu.
 *
 * Store: a block a (row, KV head); a warp quantizes 32 values of a side at a time, each lane one: the group's Hadamard
 * rotation by shuffles, its largest magnitude by a reduction, then the codes packed by the lanes that own a byte
 * (4 bits: even lanes, 6 bits: every fourth lane, three bytes).
 * Decode (decode-sized steps, cuda_internal.h: verification steps of up to EXL_CUDA_VERIFY_MAX_Q new tokens a
 * sequence too): flash decoding, a block a (row, head) and split of the keys that row sees, 4 warps of 32 keys at a
 * time, a key a lane, scored against the query rotated group by group (sum of code * q less the zero point times
 * the group's sum of q, times the group's scale); the values are summed one dimension a lane, rotated, and turned
 * back once at the end by shuffles. For head_dim 64 and 128 (groups of 32, qk_decode_fast_kernel) each lane fetches
 * its key's K codes into registers and its V slot into the warp's shared tile at once, so 32 keys cost one memory
 * round trip; other head dims read a V code per key and lane (qk_decode_kernel). The step's own keys and values come from the fp32 k and v, as computed.
 * Prefill: head_dim 64 and 128 on sm_80+ take the tensor-core kernel of cuda_attention.cu with a tile source that
 * decodes a group of 32 values a thread and turns it back in registers (exl_cuda_prefill_tc_quant); others, a block
 * takes 16 queries of one head and 32 keys at a time into shared memory as fp32, a warp decoding 32 values of a key
 * (turned back by shuffles) at a time, then as attn_prefill_kernel.
 * Scores are soft-capped where the layer asks, as in cuda_attention.cu. Needs head_dim a multiple of 16 up to 256.
 * fp32 arithmetic outside the tensor cores. */
#include "backend/cuda/cuda_kv_side.cuh"

#include <math.h>

#define QK_WARPS 4
#define QK_KEYS 32 /* keys a warp scores at a time (one a lane), and a prefill tile's keys */
#define QK_MAX_HD 256
#define QK_MAX_DPL (QK_MAX_HD / 32) /* dimensions a lane sums */
#define QK_Q_TILE 16                /* queries of a prefill block */

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

/* Block (r, h): rope of row r's KV head h and of its query heads in place (ROPE), then that head's k and v to the
 * row's slot. A block a KV head: one block a row had each row's whole width quantized one chunk after another, a
 * chain of memory round trips (50 us a layer at batch 1 for a 7B model). */
template <bool ROPE>
__global__ void kv_store_quant_kernel(float *q, float *k, const float *v, qk_side ks, qk_side vs, const int32_t *slots,
                                      const int32_t *pos, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim,
                                      int32_t half, const float *inv_freq, float attn_factor, int32_t group) {
    exl_pdl_start();
    const int32_t r = blockIdx.x, h = blockIdx.y, kvw = n_kv_heads * head_dim;
    if (ROPE) {
        const int32_t per_kv = n_heads / n_kv_heads, nq = per_kv * half;
        for (int32_t t = threadIdx.x; t < nq + half; t += blockDim.x) {
            const int is_k = t >= nq;
            const int32_t u = is_k ? t - nq : t, i = u % half;
            float *x = is_k ? k + (int64_t)r * kvw + (int64_t)h * head_dim
                            : q + ((int64_t)r * n_heads + (int64_t)h * per_kv + u / half) * head_dim;
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
    const int32_t chunks = (head_dim + 31) / 32, at = h * head_dim; /* the head's first value in the row */
    for (int32_t u = warp; u < 2 * chunks; u += n_warps) {
        const int is_v = u >= chunks;
        const qk_side s = is_v ? vs : ks;
        const float *x = (is_v ? v : k) + (int64_t)r * kvw + at;
        const int32_t j0 = (is_v ? u - chunks : u) * 32, j = j0 + lane;
        unsigned char *slot = s.base + (int64_t)slots[r] * s.slot_bytes;
        const float xv = j < head_dim ? x[j] : 0.0f;
        if (s.bits == 16) {
            if (j < head_dim)
                ((__half *)slot)[at + j] = __float2half_rn(xv);
        } else {
            quantize_lanes(s, slot, xv, at + j0, j < head_dim, group);
        }
    }
}

static void launch_store(exl_cuda_backend *cb, float *q, float *k, const float *v, void *k_cache, void *v_cache,
                         const exl_batch *b, int32_t n_heads, int32_t n_kv_heads, int32_t head_dim, int32_t rot_dim,
                         const float *inv_freq, float attn_factor) {
    const int32_t kvw = n_kv_heads * head_dim;
    if (b->n_rows < 1)
        return;
    if (kvw % 16 || b->kv.group % 16 || head_dim % b->kv.group) {
        exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED, "CUDA: a quantized kv cache needs head_dim a multiple of 16");
        return;
    }
    const qk_side ks = side_of(k_cache, b->kv.k_bits, b->kv.group, kvw);
    const qk_side vs = side_of(v_cache, b->kv.v_bits, b->kv.group, kvw);
    const dim3 grid((unsigned)b->n_rows, (unsigned)n_kv_heads), block(128);
    if (rot_dim >= 2)
        exl_cuda_launch(cb, kv_store_quant_kernel<true>, grid, block, 0, q, k, v, ks, vs, b->d_slots, b->d_pos, n_heads,
                        n_kv_heads, head_dim, rot_dim / 2, inv_freq, attn_factor, b->kv.group);
    else
        exl_cuda_launch(cb, kv_store_quant_kernel<false>, grid, block, 0, q, k, v, ks, vs, b->d_slots, b->d_pos,
                        n_heads, n_kv_heads, head_dim, 0, inv_freq, attn_factor, b->kv.group);
    exl_cuda_check_launch(cb, "quantized kv store");
}

void exl_cuda_run_kv_store_quant(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                                 const exl_batch *b, int32_t kv_width) {
    /* without a rope the heads do not matter, only the groups: a block a piece of 32 values (16 for groups of 16) */
    const int32_t piece = kv_width % 32 == 0 ? 32 : 16;
    launch_store(exl_cuda(be), NULL, (float *)(uintptr_t)k, v, k_cache, v_cache, b, kv_width / piece, kv_width / piece,
                 piece, 0, NULL, 1.0f);
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
    merge_warps(out, partial, wm, wl, &wacc[0][0], QK_MAX_HD, hd, (int64_t)row * sh.n_heads + head, split);
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

/* ---- decode, head_dim 64 and 128 (groups of 32): each lane fetches its key's K codes and scales into registers and
 * its V slot into the warp's shared tile at once, so a warp's 32 keys cost one memory round trip (as
 * attn_decode_fast_kernel does for fp16 rows) instead of one per key */

/* A head's part of a slot: its codes (or fp16 values), its scales, and the V tile's row of both. */
template <int HD, int BITS>
struct qk_head {
    static constexpr int CODE_BYTES = BITS < 16 ? HD * BITS / 8 : HD * 2;
    static constexpr int SCALE_BYTES = BITS < 16 ? HD / 32 * 2 : 0;
    static constexpr int ROW = (CODE_BYTES + SCALE_BYTES + 15) / 16 * 16;
};

__device__ __forceinline__ void qk_copy16(unsigned char *dst, const unsigned char *src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
#else
    *(uint4 *)dst = *(const uint4 *)src;
#endif
}

__device__ __forceinline__ void qk_copy4(unsigned char *dst, const unsigned char *src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((unsigned)__cvta_generic_to_shared(dst)), "l"(src));
#else
    *(uint32_t *)dst = *(const uint32_t *)src;
#endif
}

__device__ __forceinline__ void qk_copy_wait(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;");
#endif
}

/* Key slot `slot`'s K part of KV head kvh into kr (codes or fp16 values) and ksc (scales), its V part into vrow. */
template <int HD, int KB, int VB>
__device__ __forceinline__ void qk_fetch(const qk_side &ks, const qk_side &vs, int64_t slot, int kvh,
                                         uint4 (&kr)[qk_head<HD, KB>::CODE_BYTES / 16], uint32_t (&ksc)[HD / 64],
                                         unsigned char *vrow) {
    using K = qk_head<HD, KB>;
    using V = qk_head<HD, VB>;
    const unsigned char *kp = ks.base + slot * ks.slot_bytes, *vp = vs.base + slot * vs.slot_bytes;
#pragma unroll
    for (int i = 0; i < V::CODE_BYTES / 16; i++)
        qk_copy16(vrow + 16 * i, vp + (int64_t)kvh * V::CODE_BYTES + 16 * i);
#pragma unroll
    for (int i = 0; i < V::SCALE_BYTES / 4; i++)
        qk_copy4(vrow + V::CODE_BYTES + 4 * i, vp + vs.codes_bytes + kvh * V::SCALE_BYTES + 4 * i);
    const uint4 *kc = (const uint4 *)(kp + (int64_t)kvh * K::CODE_BYTES);
#pragma unroll
    for (int i = 0; i < K::CODE_BYTES / 16; i++)
        kr[i] = __ldg(kc + i);
    if constexpr (KB < 16) {
        const uint32_t *sc = (const uint32_t *)(kp + ks.codes_bytes + kvh * K::SCALE_BYTES);
#pragma unroll
        for (int i = 0; i < HD / 64; i++)
            ksc[i] = __ldg(sc + i);
    }
}

/* code of dimension d of a V row in shared memory */
template <int BITS>
__device__ __forceinline__ float qk_vcode(const unsigned char *row, int d) {
    if constexpr (BITS == 8)
        return (float)row[d];
    if constexpr (BITS == 4)
        return (float)((row[d >> 1] >> ((d & 1) * 4)) & 15);
    const int bit = d * 6;
    const uint32_t x = (uint32_t)row[bit >> 3] | (uint32_t)row[(bit >> 3) + 1] << 8;
    return (float)((x >> (bit & 7)) & 63);
}

template <int HD, int KB, int VB>
__global__ void __launch_bounds__(QK_WARPS * 32)
    qk_decode_fast_kernel(float *out, float *partial, const float *q, const float *k, const float *v, qk_side ks,
                          qk_side vs, const exl_attn_seq *seqs, int n_seqs, const int32_t *page_tables,
                          exl_attn_shape sh, int keys_per_split) {
    using K = qk_head<HD, KB>;
    using V = qk_head<HD, VB>;
    constexpr int DPL = HD / 32; /* dimensions a lane sums: lane + 32 i, so group i is lanes 0..31 */
    exl_pdl_start();
    __shared__ __align__(16) unsigned char vt[QK_WARPS][QK_KEYS][V::ROW];
    __shared__ float qp[HD], qr[HD], qg[DPL];
    __shared__ float wm[QK_WARPS], wl[QK_WARPS];
    __shared__ float wacc[QK_WARPS][HD];
    const int kvw = sh.n_kv_heads * HD, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
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

    /* the query, scaled: plain, and rotated group by group (warp 0) with each group's sum */
    for (int i = threadIdx.x; i < HD; i += blockDim.x)
        qp[i] = q[((int64_t)row * sh.n_heads + head) * HD + i] * sh.scale;
    __syncthreads();
    if (warp == 0)
#pragma unroll
        for (int g = 0; g < DPL; g++) {
            const float x = hadamard_lanes(qp[32 * g + lane], 32);
            qr[32 * g + lane] = x;
            float c = x;
            for (int o = 16; o > 0; o >>= 1)
                c += __shfl_xor_sync(FULL, c, o);
            if (lane == 0)
                qg[g] = c;
        }
    __syncthreads();

    const float kz = 0.5f * (float)((1 << (KB < 16 ? KB : 1)) - 1), vz = 0.5f * (float)((1 << (VB < 16 ? VB : 1)) - 1);
    float m = -INFINITY, l = 0.0f, accp[DPL], accr[DPL];
#pragma unroll
    for (int i = 0; i < DPL; i++)
        accp[i] = accr[i] = 0.0f;
    for (int t0 = k0 + warp * QK_KEYS; t0 < k1; t0 += QK_WARPS * QK_KEYS) {
        const int t = t0 + lane;
        uint4 kr[K::CODE_BYTES / 16];
        uint32_t ksc[HD / 64];
        if (t < k1 && t < fresh)
            qk_fetch<HD, KB, VB>(ks, vs, qk_slot(pages, t, sh.page_size), kvh, kr, ksc, &vt[warp][lane][0]);
        qk_copy_wait();
        float sc = -INFINITY;
        if (t < k1 && t >= fresh) { /* this step's key, as computed */
            const float *kr32 = k + (int64_t)(seq.q_start + t - fresh) * kvw + (int64_t)kvh * HD;
            sc = 0.0f;
            for (int i = 0; i < HD; i++)
                sc += qp[i] * kr32[i];
        } else if (t < k1) {
            sc = 0.0f;
            if constexpr (KB == 16) {
#pragma unroll
                for (int i = 0; i < HD / 8; i++) {
                    __half2 h[4];
                    memcpy(h, &kr[i], 16);
#pragma unroll
                    for (int j = 0; j < 4; j++) {
                        const float2 f = __half22float2(h[j]);
                        sc += qp[8 * i + 2 * j] * f.x + qp[8 * i + 2 * j + 1] * f.y;
                    }
                }
            } else {
                uint32_t w[K::CODE_BYTES / 4];
                memcpy(w, kr, sizeof w);
                __half scl[HD / 32];
                memcpy(scl, ksc, sizeof scl);
#pragma unroll
                for (int g = 0; g < DPL; g++) {
                    float a = 0.0f;
#pragma unroll
                    for (int i = 0; i < 32; i++)
                        a += qk_code<KB>(w, 32 * g + i) * qr[32 * g + i];
                    sc += __half2float(scl[g]) * (a - kz * qg[g]);
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
        for (int i = 0; i < DPL; i++)
            accp[i] *= corr, accr[i] *= corr;
        __syncwarp(); /* every lane's V row is in */
        const int n = min(QK_KEYS, k1 - t0);
        for (int j = 0; j < n; j++) {
            const float pj = __shfl_sync(FULL, p, j);
            const unsigned char *vrow = &vt[warp][j][0];
            if (t0 + j >= fresh) {
                const float *vr = v + (int64_t)(seq.q_start + t0 + j - fresh) * kvw + (int64_t)kvh * HD;
#pragma unroll
                for (int i = 0; i < DPL; i++)
                    accp[i] += pj * vr[lane + 32 * i];
            } else if constexpr (VB == 16) {
#pragma unroll
                for (int i = 0; i < DPL; i++)
                    accp[i] += pj * __half2float(((const __half *)vrow)[lane + 32 * i]);
            } else {
                const __half *scl = (const __half *)(vrow + V::CODE_BYTES);
#pragma unroll
                for (int i = 0; i < DPL; i++)
                    accr[i] += pj * __half2float(scl[i]) * (qk_vcode<VB>(vrow, lane + 32 * i) - vz);
            }
        }
        __syncwarp(); /* the tile is reused by the warp's next keys */
    }
#pragma unroll
    for (int i = 0; i < DPL; i++)
        accp[i] += VB < 16 ? hadamard_lanes(accr[i], 32) : 0.0f;
    if (lane == 0)
        wm[warp] = m, wl[warp] = l;
#pragma unroll
    for (int i = 0; i < DPL; i++)
        wacc[warp][lane + 32 * i] = accp[i];
    __syncthreads();
    merge_warps(out, partial, wm, wl, &wacc[0][0], HD, HD, (int64_t)row * sh.n_heads + head, split);
}

template <int KB, int VB>
static void launch_decode(exl_cuda_backend *cb, float *out, const float *q, const float *k, const float *v,
                          const qk_side &ks, const qk_side &vs, const exl_batch *b, const exl_attn_shape *sh) {
    const int64_t items = (int64_t)b->n_rows * sh->n_heads;
    /* b->max_kv is rounded up to EXL_CUDA_KV_BUCKET (exl_cuda_device_batch): the launch stays the same for the
     * next tokens (graph replay), splits past the keys exit at once */
    const int32_t max_kv = b->max_kv > 0 ? b->max_kv : 1;
    /* 8 blocks an SM (the fp16 kernel takes 4): a quantized key costs more arithmetic than its bytes, and more warps
     * in flight hide it (7B, 4 bits, context 32k: 136 tok/s against 104 with 4) */
    int splits = (int)((8 * cb->n_sms + items - 1) / items);
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
    const dim3 grid((unsigned)items, (unsigned)splits);
    if (b->kv.group == 32 && sh->head_dim == 128)
        exl_cuda_launch(cb, qk_decode_fast_kernel<128, KB, VB>, grid, dim3(QK_WARPS * 32), 0, out, cb->attn_partial, q,
                        k, v, ks, vs, b->d_seqs, b->n_seqs, b->d_page_tables, *sh, kps);
    else if (b->kv.group == 32 && sh->head_dim == 64)
        exl_cuda_launch(cb, qk_decode_fast_kernel<64, KB, VB>, grid, dim3(QK_WARPS * 32), 0, out, cb->attn_partial, q,
                        k, v, ks, vs, b->d_seqs, b->n_seqs, b->d_page_tables, *sh, kps);
    else
        exl_cuda_launch(cb, qk_decode_kernel<KB, VB>, grid, dim3(QK_WARPS * 32), 0, out, cb->attn_partial, q, k, v, ks,
                        vs, b->d_seqs, b->n_seqs, b->d_page_tables, *sh, b->kv.group, kps);
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
    static size_t allowed[EXL_CUDA_MAX_DEVICES];
    if (!exl_cuda_smem_opt_in(cb, (const void *)qk_prefill_kernel<KB, VB>, smem, allowed)) {
        exl_cuda_check_launch(cb, "attention shared memory (quantized kv cache)");
        return;
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
    if (exl_cuda_prompt_piece(b)) {
        if (!exl_cuda_prefill_tc_quant(cb, out, q, k, v, ks, vs, b, sh))
            launch_prefill<KB, VB>(cb, out, q, k, v, ks, vs, b, sh);
    } else {
        launch_decode<KB, VB>(cb, out, q, k, v, ks, vs, b, sh);
    }
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

int exl_cuda_kv_quantized(const exl_batch *b) {
    return exl_kv_quantized(b->kv.k_bits) || exl_kv_quantized(b->kv.v_bits);
}
