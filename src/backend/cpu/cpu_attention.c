/* cpu_attention.c - KV cache writes and causal attention over paged K/V on the CPU.
 *
 * Cache layout: slot s (= page * page_size + offset) holds n_kv_heads * head_dim fp32
 * values (a cache with a quantized side goes to cpu_kv_quant.c, an fp16 one to cpu_attention_f16.c). Attention uses an online softmax over chunks of
 * keys, so no score buffer is allocated whatever the context length; keys outside the layer's sliding window are
 * skipped, scores soft-capped where the layer asks. Work items are (row, KV head, sequence block): the query heads
 * sharing a KV head read its keys and values once, and with few rows (decode) each row's keys are split into
 * blocks whose softmax states are merged afterwards, so that all threads share a long context. */
#include "backend/cpu/cpu_attention_split.h"
#include "backend/kv_quant.h"

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

#define HEADS_MAX 8 /* query heads of one KV head attended together */

typedef struct {
    exl_cpu_backend *be;
    const float *q;
    const float *k_cache, *v_cache;
    const exl_batch *b;
    const exl_attn_shape *s;
    exl_cpu_attn_split sp;
} attn_job;

/* Query heads h0 .. h0+nh-1 (of the item's KV head) over the item's keys, each key read once for all of them;
 * each head's online softmax state to exl_cpu_attn_store. */
static void attend_block(const attn_job *j, const exl_cpu_attn_item *it, int32_t h0, int32_t nh) {
    const exl_attn_seq *seq = it->seq;
    const int32_t row = it->row, t_begin = it->t_begin, t_end = it->t_end;
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
    for (int32_t h = 0; h < nh; h++)
        exl_cpu_attn_store(&j->sp, s, it, h0 + h, m[h], l[h], acc[h]);
}

/* Work item i: a row's query heads of one KV head over one block of its keys; si is the sequence of the item
 * before (a hint). */
static void attend_item(const attn_job *j, long i, int32_t *si) {
    const int32_t group = j->s->n_heads / j->s->n_kv_heads;
    const exl_cpu_attn_item it = exl_cpu_attn_item_of(&j->sp, j->b, j->s, i, KEY_CHUNK, si);
    for (int32_t h = 0; h < group; h += HEADS_MAX)
        attend_block(j, &it, it.kv_head * group + h, group - h < HEADS_MAX ? group - h : HEADS_MAX);
}

/* Unsplit rows (a prompt) cost more the later they come in their sequence (causal), so threads take stripes of
 * STRIPE items in turn rather than one range each (a 512-token prompt on 2 threads: 1 : 3 by ranges); split rows
 * (decode) cost alike and take ranges. */
#define STRIPE 16

static void attention_task(void *p, int ti, int tn) {
    const attn_job *j = p;
    int32_t si = 0;
    if (j->sp.n_blocks == 1) {
        for (long s0 = (long)ti * STRIPE; s0 < j->sp.n_items; s0 += (long)tn * STRIPE)
            for (long it = s0; it < s0 + STRIPE && it < j->sp.n_items; it++)
                attend_item(j, it, &si);
        return;
    }
    long i0, i1;
    exl_split_range(j->sp.n_items, ti, tn, 1, &i0, &i1);
    for (long it = i0; it < i1; it++)
        attend_item(j, it, &si);
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
    attn_job j = {cpu, q, k_cache, v_cache, b, shape, exl_cpu_attn_split_plan(cpu, out, b, shape)};
    exl_pool_run_work(cpu->pool, attention_task, &j,
                      (int64_t)b->n_rows * shape->n_heads * b->max_kv * shape->head_dim * 2);
    exl_cpu_attn_finish(&j.sp, cpu->k, b, shape);
}
