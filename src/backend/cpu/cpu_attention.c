/* cpu_attention.c - KV cache writes and causal attention over paged K/V on the CPU.
 *
 * Cache layout: slot s (= page * page_size + offset) holds n_kv_heads * head_dim fp32
 * values (a cache with a quantized side goes to cpu_kv_quant.c, an fp16 one to cpu_attention_f16.c). Attention uses an online softmax over chunks of
 * keys, so no score buffer is allocated whatever the context length; keys outside the layer's sliding window are
 * skipped, scores soft-capped where the layer asks. Work items are (row, KV head, sequence block): the query heads
 * sharing a KV head read its keys and values once, and with few rows (decode) each row's keys are split into
 * blocks whose softmax states are merged afterwards, so that all threads share a long context. */
#include "backend/cpu/cpu.h"
#include "backend/kv_quant.h"
#include "base/alloc.h"

#include <math.h>
#include <string.h>

#define KEY_CHUNK 64

void exl_cpu_kv_store(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v, const exl_batch *b,
                      int32_t kv_width) {
    if (exl_kv_quantized(b->kv.k_bits) || exl_kv_quantized(b->kv.v_bits)) {
        exl_cpu_kv_store_quant(be, k_cache, v_cache, k, v, b, kv_width);
        return;
    }
    if (exl_cpu(be)->kv16) {
        exl_cpu_kv_store_f16(be, k_cache, v_cache, k, v, b, kv_width);
        return;
    }
    for (int32_t r = 0; r < b->n_rows; r++) {
        int64_t slot = b->slots[r];
        memcpy((float *)k_cache + slot * kv_width, k + (int64_t)r * kv_width, (size_t)kv_width * sizeof(float));
        memcpy((float *)v_cache + slot * kv_width, v + (int64_t)r * kv_width, (size_t)kv_width * sizeof(float));
    }
}

#define HEADS_MAX 8  /* query heads of one KV head attended together */
#define BLOCK_MIN 64 /* the fewest keys of a sequence block */
#define ITEMS_PER 8  /* work items per thread that decode aims for */

typedef struct {
    exl_cpu_backend *be;
    float *out;
    const float *q;
    const float *k_cache, *v_cache;
    const exl_batch *b;
    const exl_attn_shape *s;
    int32_t n_blocks; /* sequence blocks per (row, KV head) */
    float *part;      /* n_blocks > 1: [row * n_heads + head][block] of (max, sum, acc[head_dim]) */
    int64_t n_items;  /* rows * KV heads * blocks */
} attn_job;

/* Query heads h0 .. h0+nh-1 (one KV head's) of one row over keys t_begin .. t_end-1, each key
 * read once for all of them; the online softmax state of each head goes to `part` or, when the
 * row has one block, normalized to out. */
static void attend_block(const attn_job *j, const exl_attn_seq *seq, int32_t row, int32_t h0, int32_t nh,
                         int32_t t_begin, int32_t t_end, int32_t block) {
    const exl_attn_shape *s = j->s;
    const exl_cpu_kernels *k = j->be->k;
    int32_t hd = s->head_dim, kvw = s->n_kv_heads * hd;
    int32_t kv_head = h0 / (s->n_heads / s->n_kv_heads);
    const int32_t *pages = j->b->d_page_tables + seq->page_start;
    float acc[HEADS_MAX][1024];
    float m[HEADS_MAX], l[HEADS_MAX], sc[HEADS_MAX][KEY_CHUNK];
    for (int32_t h = 0; h < nh; h++) {
        memset(acc[h], 0, (size_t)hd * sizeof(float));
        m[h] = -INFINITY, l[h] = 0;
    }
    const float *vrow[KEY_CHUNK];
    for (int32_t t0 = t_begin; t0 < t_end; t0 += KEY_CHUNK) {
        int32_t n = t_end - t0 < KEY_CHUNK ? t_end - t0 : KEY_CHUNK;
        for (int32_t i = 0; i < n;) { /* keys in consecutive slots of one page, up to EXL_CPU_MAX_NR at a time */
            int32_t t = t0 + i, off = t % s->page_size;
            int nr = n - i < EXL_CPU_MAX_NR ? n - i : EXL_CPU_MAX_NR;
            nr = nr < s->page_size - off ? nr : s->page_size - off;
            int64_t slot = (int64_t)pages[t / s->page_size] * s->page_size + off;
            const float *kr = j->k_cache + slot * kvw + (int64_t)kv_head * hd;
            for (int32_t h = 0; h < nh; h++)
                k->dot_f32(kr, kvw, nr, j->q + ((int64_t)row * s->n_heads + h0 + h) * hd, hd, sc[h] + i);
            for (int r = 0; r < nr; r++, i++)
                vrow[i] = j->v_cache + (slot + r) * kvw + (int64_t)kv_head * hd;
        }
        for (int32_t h = 0; h < nh; h++) {
            float cm = -INFINITY;
            for (int32_t i = 0; i < n; i++) {
                sc[h][i] *= s->scale;
                if (s->softcap > 0)
                    sc[h][i] = s->softcap * tanhf(sc[h][i] / s->softcap);
                cm = sc[h][i] > cm ? sc[h][i] : cm;
            }
            float nm = cm > m[h] ? cm : m[h];
            float corr = expf(m[h] - nm);
            l[h] *= corr;
            if (corr != 1.0f)
                for (int32_t d = 0; d < hd; d++)
                    acc[h][d] *= corr;
            for (int32_t i = 0; i < n; i++) {
                float p = expf(sc[h][i] - nm);
                l[h] += p;
                k->axpy_f32(acc[h], p, vrow[i], hd);
            }
            m[h] = nm;
        }
    }
    for (int32_t h = 0; h < nh; h++) {
        int64_t rh = (int64_t)row * s->n_heads + h0 + h;
        if (j->n_blocks == 1) {
            float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f, *o = j->out + rh * hd;
            for (int32_t d = 0; d < hd; d++)
                o[d] = acc[h][d] * inv;
        } else {
            float *pp = j->part + (rh * j->n_blocks + block) * (hd + 2);
            pp[0] = m[h], pp[1] = l[h];
            memcpy(pp + 2, acc[h], (size_t)hd * sizeof(float));
        }
    }
}

/* Work item it: a row's query heads of one KV head over one block of its keys; si is the sequence of the item
 * before (a hint). */
static void attend_item(const attn_job *j, long it, int32_t *si) {
    const exl_attn_shape *s = j->s;
    int32_t nkv = s->n_kv_heads, group = s->n_heads / s->n_kv_heads;
    int32_t block = (int32_t)(it % j->n_blocks);
    int32_t kvh = (int32_t)(it / j->n_blocks % nkv), row = (int32_t)(it / j->n_blocks / nkv);
    while (*si + 1 < j->b->n_seqs && row >= j->b->seqs[*si + 1].q_start)
        (*si)++;
    while (*si > 0 && row < j->b->seqs[*si].q_start)
        (*si)--;
    const exl_attn_seq *seq = &j->b->seqs[*si];
    int32_t last = seq->n_kv - seq->n_q + (row - seq->q_start); /* causal: keys first..last */
    int32_t first = 0;
    if (s->sliding_window > 0 && last - s->sliding_window + 1 > 0)
        first = last - s->sliding_window + 1;
    long b0, b1;
    exl_split_range(last - first + 1, block, j->n_blocks, KEY_CHUNK, &b0, &b1);
    for (int32_t h = 0; h < group; h += HEADS_MAX)
        attend_block(j, seq, row, kvh * group + h, group - h < HEADS_MAX ? group - h : HEADS_MAX, first + (int32_t)b0,
                     first + (int32_t)b1, block);
}

/* Unsplit rows (a prompt) cost more the later they come in their sequence (causal), so threads take stripes of
 * STRIPE items in turn rather than one range each (a 512-token prompt on 2 threads: 1 : 3 by ranges); split rows
 * (decode) cost alike and take ranges. */
#define STRIPE 16

static void attention_task(void *p, int ti, int tn) {
    const attn_job *j = p;
    int32_t si = 0;
    if (j->n_blocks == 1) {
        for (long s0 = (long)ti * STRIPE; s0 < j->n_items; s0 += (long)tn * STRIPE)
            for (long it = s0; it < s0 + STRIPE && it < j->n_items; it++)
                attend_item(j, it, &si);
        return;
    }
    long i0, i1;
    exl_split_range(j->n_items, ti, tn, 1, &i0, &i1);
    for (long it = i0; it < i1; it++)
        attend_item(j, it, &si);
}

/* Rows split into sequence blocks: each head's output from its blocks' softmax states. */
static void merge_blocks(const attn_job *j) {
    int32_t hd = j->s->head_dim;
    for (int64_t rh = 0; rh < (int64_t)j->b->n_rows * j->s->n_heads; rh++) {
        const float *pp = j->part + rh * j->n_blocks * (hd + 2);
        float mx = -INFINITY, l = 0, *o = j->out + rh * hd;
        for (int32_t b = 0; b < j->n_blocks; b++)
            mx = pp[b * (hd + 2)] > mx ? pp[b * (hd + 2)] : mx;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int32_t b = 0; b < j->n_blocks; b++) {
            const float *q = pp + b * (hd + 2);
            if (q[1] <= 0)
                continue;
            float w = expf(q[0] - mx);
            l += q[1] * w;
            j->be->k->axpy_f32(o, w, q + 2, hd);
        }
        float inv = l > 0 ? 1.0f / l : 0.0f;
        for (int32_t d = 0; d < hd; d++)
            o[d] *= inv;
    }
}

void exl_cpu_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v, const void *k_cache,
                       const void *v_cache, const exl_batch *b, const exl_attn_shape *shape) {
    if (exl_kv_quantized(b->kv.k_bits) || exl_kv_quantized(b->kv.v_bits)) {
        exl_cpu_attention_quant(be, out, q, k, v, k_cache, v_cache, b, shape);
        return;
    }
    if (exl_cpu(be)->kv16) {
        exl_cpu_attention_f16(be, out, q, k_cache, v_cache, b, shape);
        return;
    }
    (void)k, (void)v; /* the cache is fp32: the new rows' cached copies are exact */
    exl_cpu_backend *cpu = exl_cpu(be);
    attn_job j = {cpu, out, q, k_cache, v_cache, b, shape, 1, NULL, 0};
    /* few rows (decode): split each row's keys into blocks so that every thread has work */
    int64_t units = (int64_t)b->n_rows * shape->n_kv_heads, want = (int64_t)ITEMS_PER * exl_pool_size(cpu->pool);
    if (units < want) {
        int64_t by_len = (b->max_kv + BLOCK_MIN - 1) / BLOCK_MIN, by_work = (want + units - 1) / units;
        j.n_blocks = (int32_t)(by_len < by_work ? by_len : by_work);
    }
    if (j.n_blocks > 1) {
        j.part = exl_malloc((size_t)b->n_rows * (size_t)shape->n_heads * (size_t)j.n_blocks *
                            (size_t)(shape->head_dim + 2) * sizeof(float));
        if (!j.part)
            j.n_blocks = 1; /* out of memory: unsplit rows need no scratch */
    }
    j.n_items = units * j.n_blocks;
    exl_pool_run_work(cpu->pool, attention_task, &j,
                      (int64_t)b->n_rows * shape->n_heads * b->max_kv * shape->head_dim * 2);
    if (j.n_blocks > 1)
        merge_blocks(&j);
    exl_free(j.part);
}
