/* cpu_attention_f16.c - the CPU's KV cache in fp16 (the default for generation with AVX-512, cpu_backend.c): kv_store
 * rounds the step's rows into their slots, attention reads keys and values as fp16, the step's own included.
 *
 * Slot s (= page * page_size + offset) holds n_kv_heads * head_dim fp16 values. Attention takes the keys in blocks
 * of EXL_CPU_KEYS: the kernels score a block for all the query heads of a KV head at once (the query, prescaled,
 * in registers, one key converted once for every head, no per-key horizontal sum), exponentiate it vectorized and
 * add its values with the block's weights, the online softmax rescaling once per block. Work items are (row, KV
 * head, sequence block) as in cpu_attention.c: with few rows (decode) a row's keys are split into blocks that all
 * threads share, their softmax states merged afterwards. */
#include "backend/cpu/cpu_attention_split.h"
#include "base/half.h"

#include <math.h>
#include <string.h>

#define MAX_HEAD_DIM 1024

void exl_cpu_kv_store_f16(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                          const exl_batch *b, int32_t kv_width) {
    (void)be;
    for (int32_t r = 0; r < b->n_rows; r++) {
        uint16_t *kd = (uint16_t *)k_cache + b->slots[r] * kv_width, *vd = (uint16_t *)v_cache + b->slots[r] * kv_width;
        const float *ks = k + (int64_t)r * kv_width, *vs = v + (int64_t)r * kv_width;
        for (int32_t i = 0; i < kv_width; i++) {
            kd[i] = exl_f32_to_f16(ks[i]);
            vd[i] = exl_f32_to_f16(vs[i]);
        }
    }
}

typedef struct {
    exl_cpu_backend *be;
    const float *q;
    const uint16_t *k_cache, *v_cache;
    const exl_batch *b;
    const exl_attn_shape *s;
    exl_cpu_attn_split sp;
} attn_job;

/* Query heads h0 .. h0+nh-1 (of the item's KV head) over the item's keys; each head's online softmax state to
 * exl_cpu_attn_store. */
static void attend_keys(const attn_job *j, const exl_cpu_attn_item *it, int32_t h0, int32_t nh) {
    const exl_attn_seq *seq = it->seq;
    const int32_t row = it->row, t_begin = it->t_begin, t_end = it->t_end;
    const exl_attn_shape *s = j->s;
    const exl_cpu_kernels *k = j->be->k;
    const int32_t hd = s->head_dim, kvw = s->n_kv_heads * hd, kv_head = h0 / (s->n_heads / s->n_kv_heads);
    const int32_t *pages = j->b->d_page_tables + seq->page_start;
    float q[EXL_CPU_HEADS * MAX_HEAD_DIM], acc[EXL_CPU_HEADS * MAX_HEAD_DIM];
    float sc[EXL_CPU_HEADS * EXL_CPU_KEYS], m[EXL_CPU_HEADS], l[EXL_CPU_HEADS], corr[EXL_CPU_HEADS];
    const uint16_t *kp[EXL_CPU_KEYS], *vp[EXL_CPU_KEYS];
    const float *qrow = j->q + ((int64_t)row * s->n_heads + h0) * hd;
    const float qscale = s->softcap > 0 ? 1.0f : s->scale; /* soft-capped scores are scaled before the cap */
    for (int32_t i = 0; i < nh * hd; i++)
        q[i] = qrow[i] * qscale;
    memset(acc, 0, (size_t)(nh * hd) * sizeof(float));
    for (int32_t h = 0; h < nh; h++)
        m[h] = -INFINITY, l[h] = 0;
    const int64_t head_off = (int64_t)kv_head * hd;
    int32_t page = t_begin / s->page_size, off = t_begin % s->page_size; /* where key t0 is; walked, not divided */
    for (int32_t t0 = t_begin; t0 < t_end; t0 += EXL_CPU_KEYS) {
        const int n = t_end - t0 < EXL_CPU_KEYS ? t_end - t0 : EXL_CPU_KEYS;
        for (int i = 0; i < n; i++) {
            const int64_t slot = (int64_t)pages[page] * s->page_size + off;
            kp[i] = j->k_cache + slot * kvw + head_off;
            vp[i] = j->v_cache + slot * kvw + head_off;
            if (++off == s->page_size)
                page++, off = 0;
        }
        /* the next block's keys and values on their way while this one is computed (decode reads them from memory,
         * each key's head a few cache lines 2 * kvw bytes apart: too short a stream for the prefetchers) */
        for (int32_t t = t0 + n, p = page, o = off; t < t_end && t < t0 + n + EXL_CPU_KEYS; t++) {
            const int64_t slot = (int64_t)pages[p] * s->page_size + o;
            const char *kn = (const char *)(j->k_cache + slot * kvw + head_off);
            const char *vn = (const char *)(j->v_cache + slot * kvw + head_off);
            for (int32_t b = 0; b < hd * 2; b += 64) {
                __builtin_prefetch(kn + b);
                __builtin_prefetch(vn + b);
            }
            if (++o == s->page_size)
                p++, o = 0;
        }
        k->scores_f16(q, nh, kp, n, hd, sc);
        for (int32_t h = 0; h < nh; h++) {
            float *sh = sc + h * EXL_CPU_KEYS, cm = -INFINITY;
            if (s->softcap > 0)
                for (int i = 0; i < n; i++)
                    sh[i] = s->softcap * tanhf(sh[i] * s->scale / s->softcap);
            for (int i = 0; i < n; i++)
                cm = sh[i] > cm ? sh[i] : cm;
            const float nm = cm > m[h] ? cm : m[h];
            corr[h] = nm == m[h] ? 1.0f : expf(m[h] - nm); /* the running max mostly holds after the first blocks */
            l[h] = l[h] * corr[h] + k->exp_sum(sh, nm, n);
            m[h] = nm;
        }
        k->values_f16(acc, nh, corr, sc, vp, n, hd);
    }
    for (int32_t h = 0; h < nh; h++)
        exl_cpu_attn_store(&j->sp, s, it, h0 + h, m[h], l[h], acc + h * hd);
}

static void attention_task(void *p, int ti, int tn) {
    const attn_job *j = p;
    const exl_attn_shape *s = j->s;
    const int32_t group = s->n_heads / s->n_kv_heads;
    long i0, i1;
    exl_split_range(j->sp.n_items, ti, tn, 1, &i0, &i1);
    int32_t si = 0;
    for (long i = i0; i < i1; i++) {
        const exl_cpu_attn_item it = exl_cpu_attn_item_of(&j->sp, j->b, s, i, EXL_CPU_KEYS, &si);
        for (int32_t h = 0; h < group; h += EXL_CPU_HEADS)
            attend_keys(j, &it, it.kv_head * group + h, group - h < EXL_CPU_HEADS ? group - h : EXL_CPU_HEADS);
    }
}

void exl_cpu_attention_f16(exl_backend *be, float *out, const float *q, const void *k_cache, const void *v_cache,
                           const exl_batch *b, const exl_attn_shape *shape) {
    exl_cpu_backend *cpu = exl_cpu(be);
    attn_job j = {cpu, q, k_cache, v_cache, b, shape, exl_cpu_attn_split_plan(cpu, out, b, shape)};
    exl_pool_run_work(cpu->pool, attention_task, &j, (int64_t)b->n_rows * shape->n_heads * b->max_kv * shape->head_dim);
    exl_cpu_attn_finish(&j.sp, cpu->k, b, shape);
}
