/* cpu_attention.c - KV cache writes and causal attention over paged K/V on the CPU.
 *
 * Cache layout: slot s (= page * page_size + offset) holds n_kv_heads * head_dim fp32
 * values (a cache with a quantized side goes to cpu_kv_quant.c). Attention uses an online softmax over chunks of
 * keys, so no score buffer is allocated whatever the context length; keys outside the layer's sliding window are
 * skipped, scores soft-capped where the layer asks. */
#include "backend/cpu/cpu.h"
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
    for (int32_t r = 0; r < b->n_rows; r++) {
        int64_t slot = b->slots[r];
        memcpy((float *)k_cache + slot * kv_width, k + (int64_t)r * kv_width, (size_t)kv_width * sizeof(float));
        memcpy((float *)v_cache + slot * kv_width, v + (int64_t)r * kv_width, (size_t)kv_width * sizeof(float));
    }
}

typedef struct {
    exl_cpu_backend *be;
    float *out;
    const float *q;
    const float *k_cache, *v_cache;
    const exl_batch *b;
    const exl_attn_shape *s;
    int64_t n_items; /* rows * heads */
} attn_job;

static void attend_one(const attn_job *j, const exl_attn_seq *seq, int32_t row, int32_t head) {
    const exl_attn_shape *s = j->s;
    int32_t hd = s->head_dim, kvw = s->n_kv_heads * hd;
    int32_t kv_head = head / (s->n_heads / s->n_kv_heads);
    const float *q = j->q + ((int64_t)row * s->n_heads + head) * hd;
    float *o = j->out + ((int64_t)row * s->n_heads + head) * hd;
    int32_t qi = row - seq->q_start;
    int32_t last = seq->n_kv - seq->n_q + qi; /* causal: keys 0..last */
    int32_t first = 0;
    if (s->sliding_window > 0 && last - s->sliding_window + 1 > 0)
        first = last - s->sliding_window + 1;
    const int32_t *pages = j->b->d_page_tables + seq->page_start;
    float acc[1024];
    memset(acc, 0, (size_t)hd * sizeof(float));
    float m = -INFINITY, l = 0;
    float sc[KEY_CHUNK];
    const float *vrow[KEY_CHUNK];
    for (int32_t t0 = first; t0 <= last; t0 += KEY_CHUNK) {
        int32_t n = last - t0 + 1 < KEY_CHUNK ? last - t0 + 1 : KEY_CHUNK;
        float cm = -INFINITY;
        for (int32_t i = 0; i < n;) { /* keys in consecutive slots of one page, up to EXL_CPU_MAX_NR at a time */
            int32_t t = t0 + i, off = t % s->page_size;
            int nr = n - i < EXL_CPU_MAX_NR ? n - i : EXL_CPU_MAX_NR;
            nr = nr < s->page_size - off ? nr : s->page_size - off;
            int64_t slot = (int64_t)pages[t / s->page_size] * s->page_size + off;
            j->be->k->dot_f32(j->k_cache + slot * kvw + (int64_t)kv_head * hd, kvw, nr, q, hd, sc + i);
            for (int r = 0; r < nr; r++, i++) {
                vrow[i] = j->v_cache + (slot + r) * kvw + (int64_t)kv_head * hd;
                sc[i] *= s->scale;
                if (s->softcap > 0)
                    sc[i] = s->softcap * tanhf(sc[i] / s->softcap);
                if (sc[i] > cm)
                    cm = sc[i];
            }
        }
        float nm = cm > m ? cm : m;
        float corr = expf(m - nm);
        l *= corr;
        for (int32_t d = 0; d < hd; d++)
            acc[d] *= corr;
        for (int32_t i = 0; i < n; i++) {
            float p = expf(sc[i] - nm);
            l += p;
            const float *v = vrow[i];
            for (int32_t d = 0; d < hd; d++)
                acc[d] += p * v[d];
        }
        m = nm;
    }
    float inv = l > 0 ? 1.0f / l : 0.0f;
    for (int32_t d = 0; d < hd; d++)
        o[d] = acc[d] * inv;
}

static void attention_task(void *p, int ti, int tn) {
    const attn_job *j = p;
    long i0, i1;
    exl_split_range(j->n_items, ti, tn, 1, &i0, &i1);
    int32_t nh = j->s->n_heads;
    int32_t si = 0;
    for (long it = i0; it < i1; it++) {
        int32_t row = (int32_t)(it / nh), head = (int32_t)(it % nh);
        while (si + 1 < j->b->n_seqs && row >= j->b->seqs[si + 1].q_start)
            si++;
        while (si > 0 && row < j->b->seqs[si].q_start)
            si--;
        attend_one(j, &j->b->seqs[si], row, head);
    }
}

void exl_cpu_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v, const void *k_cache,
                       const void *v_cache, const exl_batch *b, const exl_attn_shape *shape) {
    if (exl_kv_quantized(b->kv.k_bits) || exl_kv_quantized(b->kv.v_bits)) {
        exl_cpu_attention_quant(be, out, q, k, v, k_cache, v_cache, b, shape);
        return;
    }
    (void)k, (void)v; /* the cache is fp32: the new rows' cached copies are exact */
    attn_job j = {exl_cpu(be), out, q, k_cache, v_cache, b, shape, (int64_t)b->n_rows * shape->n_heads};
    exl_pool_run_work(exl_cpu(be)->pool, attention_task, &j, j.n_items * (int64_t)b->max_kv * shape->head_dim * 2);
}
