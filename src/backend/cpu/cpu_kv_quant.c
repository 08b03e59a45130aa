/* cpu_kv_quant.c - the KV cache on the CPU when either side is quantized (backend/kv_quant.h): kv_store quantizes
 * the step's rows into their slots, attention reads the quantized slots as they are (one key's head decoded at a
 * time, no dequantized copy of the cache). A full-precision side stays rows of the backend's element: fp32 as in
 * cpu_attention.c, or fp16 as in cpu_attention_f16.c (converted a key at a time here).
 *
 * Attention takes the keys and values of the step's own rows from the fp32 k and v (exact, as computed), the
 * earlier ones from the cache. Quantized keys are scored against the query rotated group by group (H q . y);
 * quantized values are summed rotated and turned back once at the end (H sum p y), the exact rows' values apart.
 * Scores are soft-capped after the scaling where the layer asks, as in cpu_attention.c. */
#include "backend/cpu/cpu.h"
#include "backend/kv_quant.h"

#include "base/half.h"

#include <math.h>
#include <string.h>

#define KEY_CHUNK 64
#define MAX_HEAD_DIM 1024

/* One side of a cache layer: fp32 or fp16 rows (half), or quantized slots. */
typedef struct kv_side {
    unsigned char *base;
    size_t slot_bytes, codes_bytes;
    int32_t bits, quant, group, half;
} kv_side;

static kv_side side_of(const exl_backend *be, const void *cache, int32_t bits, int32_t group, int32_t width) {
    kv_side s = {(unsigned char *)(uintptr_t)cache,
                 exl_kv_slot_bytes(width, bits, group, be->kv_elem_bytes),
                 0,
                 bits,
                 exl_kv_quantized(bits),
                 group,
                 !exl_kv_quantized(bits) && be->kv_elem_bytes == sizeof(uint16_t)};
    s.codes_bytes = s.quant ? exl_kv_codes_bytes(width, bits) : 0;
    return s;
}

/* In place: x = H x over n (a power of two) values, H the Walsh-Hadamard matrix over sqrt(n). */
static void hadamard(float *x, int32_t n) {
    for (int32_t len = 1; len < n; len *= 2)
        for (int32_t i = 0; i < n; i += 2 * len)
            for (int32_t j = i; j < i + len; j++) {
                float a = x[j], b = x[j + len];
                x[j] = a + b;
                x[j + len] = a - b;
            }
    float f = 1.0f / sqrtf((float)n);
    for (int32_t i = 0; i < n; i++)
        x[i] *= f;
}

static void hadamard_groups(float *x, int32_t n, int32_t group) {
    for (int32_t g = 0; g < n; g += group)
        hadamard(x + g, group);
}

/* ---- kv_store */

/* Row x (width values) into a quantized slot. */
static void quantize_row(const kv_side *s, unsigned char *slot, const float *x, int32_t width) {
    const int32_t bits = s->bits, G = s->group, top = (1 << bits) - 1;
    const float z = 0.5f * (float)top;
    uint16_t *scales = (uint16_t *)(void *)(slot + s->codes_bytes);
    memset(slot, 0, s->codes_bytes);
    for (int32_t g0 = 0; g0 < width; g0 += G) {
        float y[EXL_KV_MAX_GROUP], mx = 0.0f;
        memcpy(y, x + g0, (size_t)G * sizeof(float));
        hadamard(y, G);
        for (int32_t i = 0; i < G; i++)
            mx = fabsf(y[i]) > mx ? fabsf(y[i]) : mx;
        uint16_t h = exl_f32_to_f16(2.0f * mx / (float)top);
        float sc = exl_f16_to_f32(h), inv = sc > 0.0f ? 1.0f / sc : 0.0f;
        scales[g0 / G] = h;
        for (int32_t i = 0; i < G; i++) {
            long c = lrintf(y[i] * inv + z);
            c = c < 0 ? 0 : c > top ? top : c;
            int64_t bit = (int64_t)(g0 + i) * bits;
            uint32_t v = (uint32_t)c << (bit % 8);
            slot[bit / 8] |= (unsigned char)v;
            if ((bit % 8) + bits > 8)
                slot[bit / 8 + 1] |= (unsigned char)(v >> 8);
        }
    }
}

static void store_side(const kv_side *s, const float *x, const exl_batch *b, int32_t width) {
    for (int32_t r = 0; r < b->n_rows; r++) {
        unsigned char *slot = s->base + (size_t)b->slots[r] * s->slot_bytes;
        if (s->quant)
            quantize_row(s, slot, x + (int64_t)r * width, width);
        else if (s->half)
            for (int32_t i = 0; i < width; i++)
                ((uint16_t *)(void *)slot)[i] = exl_f32_to_f16(x[(int64_t)r * width + i]);
        else
            memcpy(slot, x + (int64_t)r * width, (size_t)width * sizeof(float));
    }
}

void exl_cpu_kv_store_quant(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                            const exl_batch *b, int32_t kv_width) {
    kv_side ks = side_of(be, k_cache, b->kv.k_bits, b->kv.group, kv_width);
    kv_side vs = side_of(be, v_cache, b->kv.v_bits, b->kv.group, kv_width);
    store_side(&ks, k, b, kv_width);
    store_side(&vs, v, b, kv_width);
}

/* ---- attention */

/* Values from `first` (a multiple of the group) to first + n of a quantized slot, as (c - z) s: still rotated. */
static void decode(const kv_side *s, const unsigned char *slot, int32_t first, int32_t n, float *out) {
    const int32_t bits = s->bits, G = s->group;
    const uint32_t mask = (1u << bits) - 1;
    const float z = 0.5f * (float)mask;
    const uint16_t *scales = (const uint16_t *)(const void *)(slot + s->codes_bytes);
    for (int32_t g0 = 0; g0 < n; g0 += G) {
        const float sc = exl_f16_to_f32(scales[(first + g0) / G]);
        if (bits == 4) {
            const unsigned char *c = slot + (first + g0) / 2;
            for (int32_t i = 0; i < G; i += 2) {
                out[g0 + i] = ((float)(c[i / 2] & 15) - z) * sc;
                out[g0 + i + 1] = ((float)(c[i / 2] >> 4) - z) * sc;
            }
        } else if (bits == 8) {
            const unsigned char *c = slot + first + g0;
            for (int32_t i = 0; i < G; i++)
                out[g0 + i] = ((float)c[i] - z) * sc;
        } else {
            for (int32_t i = 0; i < G; i++) {
                int64_t bit = (int64_t)(first + g0 + i) * bits;
                uint32_t w = slot[bit / 8] | (uint32_t)slot[bit / 8 + 1] << 8;
                out[g0 + i] = ((float)((w >> (bit % 8)) & mask) - z) * sc;
            }
        }
    }
}

/* Work items: for one sequence and KV head, up to a block's worth of its queries (rows x the heads that share the KV
 * head), which take each chunk of keys together, so a key is decoded once for all of them. Their state and the
 * chunk's decoded keys and values live on the stack, sized by head_dim (block_sizes). */
#define SCRATCH_FLOATS 32768
#define MAX_CHUNK 64
#define MAX_BLOCK 64

typedef struct {
    exl_cpu_backend *be;
    float *out;
    const float *q, *k, *v; /* this step's rows, fp32 */
    kv_side ks, vs;
    const exl_batch *b;
    const exl_attn_shape *s;
    int32_t chunk, block; /* keys decoded at a time, queries an item takes */
    int64_t n_items;
} qattn_job;

static void block_sizes(int32_t hd, int32_t *chunk, int32_t *block) {
    *chunk = 8192 / hd < 4 ? 4 : 8192 / hd > MAX_CHUNK ? MAX_CHUNK : 8192 / hd;
    int32_t q = (SCRATCH_FLOATS - 2 * *chunk * hd) / (4 * hd + 2 + *chunk);
    *block = q < 1 ? 1 : q > MAX_BLOCK ? MAX_BLOCK : q;
}

/* items of sequence seq (its KV heads times its blocks of queries) */
static int64_t seq_items(const qattn_job *j, const exl_attn_seq *seq) {
    const int32_t per_kv = (int32_t)((int64_t)seq->n_q * (j->s->n_heads / j->s->n_kv_heads));
    return (int64_t)j->s->n_kv_heads * ((per_kv + j->block - 1) / j->block);
}

/* Where key t of seq reads its K or V head: the step's own fp32 row (*exact), a fp32 cache row, an fp16 one
 * converted into buf (*exact: not rotated), or a quantized slot decoded into buf (rotated); returns the head's
 * values. */
static const float *key_head(const qattn_job *j, const kv_side *s, const float *rows, const exl_attn_seq *seq,
                             int32_t t, int32_t kv_head, float *buf, int *exact) {
    const exl_attn_shape *sh = j->s;
    const int32_t hd = sh->head_dim, kvw = sh->n_kv_heads * hd, fresh = seq->n_kv - seq->n_q;
    *exact = t >= fresh;
    if (t >= fresh)
        return rows + (int64_t)(seq->q_start + t - fresh) * kvw + (int64_t)kv_head * hd;
    const int32_t *pages = j->b->d_page_tables + seq->page_start;
    const int64_t slot = (int64_t)pages[t / sh->page_size] * sh->page_size + t % sh->page_size;
    const unsigned char *p = s->base + (size_t)slot * s->slot_bytes;
    *exact = !s->quant;
    if (s->half) {
        for (int32_t i = 0; i < hd; i++)
            buf[i] = exl_f16_to_f32(((const uint16_t *)(const void *)p)[(int64_t)kv_head * hd + i]);
        return buf;
    }
    if (!s->quant)
        return (const float *)(const void *)p + (int64_t)kv_head * hd;
    decode(s, p, kv_head * hd, hd, buf);
    return buf;
}

/* Queries u0 .. u0 + nq - 1 of (seq, kv_head): query u is row u / G of the sequence with head kv_head * G + u % G
 * (G heads share a KV head). */
static void attend_block(const qattn_job *j, const exl_attn_seq *seq, int32_t kv_head, int32_t u0, int32_t nq) {
    const exl_attn_shape *s = j->s;
    const exl_cpu_kernels *kern = j->be->k;
    const int32_t hd = s->head_dim, G = s->n_heads / s->n_kv_heads, group = j->b->kv.group, kc = j->chunk;
    const int32_t fresh = seq->n_kv - seq->n_q;
    float scratch[SCRATCH_FLOATS];
    float *kbuf = scratch, *vbuf = kbuf + kc * hd, *qp = vbuf + kc * hd, *qr = qp + nq * hd;
    float *acc_exact = qr + nq * hd, *acc_rot = acc_exact + nq * hd, *m = acc_rot + nq * hd, *l = m + nq;
    float *p = l + nq; /* [nq][kc] scores, then probabilities */
    const float *kp[MAX_CHUNK], *vp[MAX_CHUNK];
    int kex[MAX_CHUNK], vex[MAX_CHUNK];
    int32_t first[MAX_BLOCK], last[MAX_BLOCK], lo = INT32_MAX, hi = -1;
    for (int32_t u = 0; u < nq; u++) {
        const int32_t r = (u0 + u) / G, head = kv_head * G + (u0 + u) % G;
        memcpy(qp + u * hd, j->q + ((int64_t)(seq->q_start + r) * s->n_heads + head) * hd, (size_t)hd * sizeof(float));
        memcpy(qr + u * hd, qp + u * hd, (size_t)hd * sizeof(float));
        if (j->ks.quant)
            hadamard_groups(qr + u * hd, hd, group);
        last[u] = fresh + r;
        first[u] = s->sliding_window > 0 && last[u] - s->sliding_window + 1 > 0 ? last[u] - s->sliding_window + 1 : 0;
        lo = first[u] < lo ? first[u] : lo;
        hi = last[u] > hi ? last[u] : hi;
        m[u] = -INFINITY;
        l[u] = 0.0f;
    }
    memset(acc_exact, 0, (size_t)nq * hd * sizeof(float));
    memset(acc_rot, 0, (size_t)nq * hd * sizeof(float));
    for (int32_t t0 = lo; t0 <= hi; t0 += kc) {
        const int32_t n = hi - t0 + 1 < kc ? hi - t0 + 1 : kc;
        for (int32_t i = 0; i < n; i++) {
            kp[i] = key_head(j, &j->ks, j->k, seq, t0 + i, kv_head, kbuf + i * hd, &kex[i]);
            vp[i] = key_head(j, &j->vs, j->v, seq, t0 + i, kv_head, vbuf + i * hd, &vex[i]);
        }
        for (int32_t i = 0; i < n; i++) /* scores of every query, four at a time */
            for (int32_t u = 0; u < nq; u += EXL_CPU_MAX_NR) {
                const int nr = nq - u < EXL_CPU_MAX_NR ? nq - u : EXL_CPU_MAX_NR;
                float d[EXL_CPU_MAX_NR];
                kern->dot_f32((kex[i] ? qp : qr) + u * hd, hd, nr, kp[i], hd, d);
                for (int r = 0; r < nr; r++) {
                    float sc = d[r] * s->scale;
                    if (s->softcap > 0)
                        sc = s->softcap * tanhf(sc / s->softcap);
                    p[(u + r) * kc + i] = sc;
                }
            }
        for (int32_t u = 0; u < nq; u++) {
            const int32_t a = first[u] > t0 ? first[u] - t0 : 0, z = last[u] < t0 + n - 1 ? last[u] - t0 : n - 1;
            if (a > z)
                continue;
            float *pu = p + u * kc, *ae = acc_exact + u * hd, *ar = acc_rot + u * hd, cm = -INFINITY;
            for (int32_t i = a; i <= z; i++)
                cm = pu[i] > cm ? pu[i] : cm;
            const float nm = cm > m[u] ? cm : m[u], corr = expf(m[u] - nm);
            l[u] *= corr;
            for (int32_t d = 0; d < hd; d++) {
                ae[d] *= corr;
                ar[d] *= corr;
            }
            for (int32_t i = a; i <= z; i++) {
                const float pr = expf(pu[i] - nm);
                l[u] += pr;
                kern->axpy_f32(vex[i] ? ae : ar, pr, vp[i], hd);
            }
            m[u] = nm;
        }
    }
    for (int32_t u = 0; u < nq; u++) {
        const int32_t r = (u0 + u) / G, head = kv_head * G + (u0 + u) % G;
        float *o = j->out + ((int64_t)(seq->q_start + r) * s->n_heads + head) * hd;
        float *ar = acc_rot + u * hd;
        if (j->vs.quant)
            hadamard_groups(ar, hd, group);
        const float inv = l[u] > 0 ? 1.0f / l[u] : 0.0f;
        for (int32_t d = 0; d < hd; d++)
            o[d] = (acc_exact[u * hd + d] + ar[d]) * inv;
    }
}

static void attention_task(void *arg, int ti, int tn) {
    const qattn_job *j = arg;
    long i0, i1;
    exl_split_range(j->n_items, ti, tn, 1, &i0, &i1);
    const int32_t G = j->s->n_heads / j->s->n_kv_heads;
    int32_t si = 0;
    int64_t base = 0; /* items of the sequences before si */
    for (long it = i0; it < i1; it++) {
        while (it >= base + seq_items(j, &j->b->seqs[si]))
            base += seq_items(j, &j->b->seqs[si++]);
        const exl_attn_seq *seq = &j->b->seqs[si];
        const int32_t per_kv = seq->n_q * G, blocks = (per_kv + j->block - 1) / j->block;
        const int32_t kv_head = (int32_t)((it - base) / blocks), u0 = (int32_t)((it - base) % blocks) * j->block;
        attend_block(j, seq, kv_head, u0, per_kv - u0 < j->block ? per_kv - u0 : j->block);
    }
}

void exl_cpu_attention_quant(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                             const void *k_cache, const void *v_cache, const exl_batch *b,
                             const exl_attn_shape *shape) {
    const int32_t width = shape->n_kv_heads * shape->head_dim;
    qattn_job j = {.be = exl_cpu(be),
                   .out = out,
                   .q = q,
                   .k = k,
                   .v = v,
                   .ks = side_of(be, k_cache, b->kv.k_bits, b->kv.group, width),
                   .vs = side_of(be, v_cache, b->kv.v_bits, b->kv.group, width),
                   .b = b,
                   .s = shape};
    block_sizes(shape->head_dim, &j.chunk, &j.block);
    for (int32_t i = 0; i < b->n_seqs; i++)
        j.n_items += seq_items(&j, &b->seqs[i]);
    exl_pool_run_work(exl_cpu(be)->pool, attention_task, &j,
                      (int64_t)b->n_rows * shape->n_heads * (int64_t)b->max_kv * shape->head_dim * 4);
}
