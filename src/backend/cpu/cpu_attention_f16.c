/* cpu_attention_f16.c - the CPU's KV cache in fp16 (the default for generation with AVX-512, cpu_backend.c): kv_store
 * rounds the step's rows into their slots, attention reads keys and values as fp16, the step's own included.
 *
 * Slot s (= page * page_size + offset) holds n_kv_heads * head_dim fp16 values. Attention takes the keys in blocks
 * of EXL_CPU_KEYS: the kernels score a block for all the query heads of a KV head at once (the query, prescaled,
 * in registers, one key converted once for every head, no per-key horizontal sum), exponentiate it vectorized and
 * add its values with the block's weights, the online softmax rescaling once per block. Work items are (row, KV
 * head, sequence block) as in cpu_attention.c: with few rows (decode) a row's keys are split into blocks that all
 * threads share, their softmax states merged afterwards. */
#include "backend/cpu/cpu.h"
#include "base/alloc.h"
#include "base/half.h"

#include <math.h>
#include <string.h>

#define BLOCK_MIN 64 /* the fewest keys of a sequence block */
#define ITEMS_PER 8  /* work items per thread that decode aims for */
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
    float *out;
    const float *q;
    const uint16_t *k_cache, *v_cache;
    const exl_batch *b;
    const exl_attn_shape *s;
    int32_t n_blocks; /* sequence blocks per (row, KV head) */
    float *part;      /* n_blocks > 1: [row * n_heads + head][block] of (max, sum, acc[head_dim]) */
    int64_t n_items;  /* rows * KV heads * blocks */
} attn_job;

/* Query heads h0 .. h0+nh-1 (one KV head's) of one row over keys t_begin .. t_end-1; the online softmax state of
 * each head goes to `part` or, when the row has one block, normalized to out. */
static void attend_keys(const attn_job *j, const exl_attn_seq *seq, int32_t row, int32_t h0, int32_t nh,
                        int32_t t_begin, int32_t t_end, int32_t block) {
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
    for (int32_t h = 0; h < nh; h++) {
        const int64_t rh = (int64_t)row * s->n_heads + h0 + h;
        if (j->n_blocks == 1) {
            float inv = l[h] > 0 ? 1.0f / l[h] : 0.0f, *o = j->out + rh * hd;
            for (int32_t d = 0; d < hd; d++)
                o[d] = acc[h * hd + d] * inv;
        } else {
            float *pp = j->part + (rh * j->n_blocks + block) * (hd + 2);
            pp[0] = m[h], pp[1] = l[h];
            memcpy(pp + 2, acc + h * hd, (size_t)hd * sizeof(float));
        }
    }
}

static void attention_task(void *p, int ti, int tn) {
    const attn_job *j = p;
    const exl_attn_shape *s = j->s;
    long i0, i1;
    exl_split_range(j->n_items, ti, tn, 1, &i0, &i1);
    const int32_t nkv = s->n_kv_heads, group = s->n_heads / s->n_kv_heads;
    int32_t si = 0;
    for (long it = i0; it < i1; it++) {
        const int32_t block = (int32_t)(it % j->n_blocks);
        const int32_t kvh = (int32_t)(it / j->n_blocks % nkv), row = (int32_t)(it / j->n_blocks / nkv);
        while (si + 1 < j->b->n_seqs && row >= j->b->seqs[si + 1].q_start)
            si++;
        while (si > 0 && row < j->b->seqs[si].q_start)
            si--;
        const exl_attn_seq *seq = &j->b->seqs[si];
        const int32_t last = seq->n_kv - seq->n_q + (row - seq->q_start); /* causal: keys first..last */
        int32_t first = 0;
        if (s->sliding_window > 0 && last - s->sliding_window + 1 > 0)
            first = last - s->sliding_window + 1;
        long b0, b1;
        exl_split_range(last - first + 1, block, j->n_blocks, EXL_CPU_KEYS, &b0, &b1);
        for (int32_t h = 0; h < group; h += EXL_CPU_HEADS)
            attend_keys(j, seq, row, kvh * group + h, group - h < EXL_CPU_HEADS ? group - h : EXL_CPU_HEADS,
                        first + (int32_t)b0, first + (int32_t)b1, block);
    }
}

/* Rows split into sequence blocks: each head's output from its blocks' softmax states. */
static void merge_blocks(const attn_job *j) {
    const int32_t hd = j->s->head_dim;
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
            const float w = expf(q[0] - mx);
            l += q[1] * w;
            j->be->k->axpy_f32(o, w, q + 2, hd);
        }
        const float inv = l > 0 ? 1.0f / l : 0.0f;
        for (int32_t d = 0; d < hd; d++)
            o[d] *= inv;
    }
}

void exl_cpu_attention_f16(exl_backend *be, float *out, const float *q, const void *k_cache, const void *v_cache,
                           const exl_batch *b, const exl_attn_shape *shape) {
    exl_cpu_backend *cpu = exl_cpu(be);
    attn_job j = {cpu, out, q, k_cache, v_cache, b, shape, 1, NULL, 0};
    /* few rows (decode): split each row's keys into blocks so that every thread has work */
    const int64_t units = (int64_t)b->n_rows * shape->n_kv_heads, want = (int64_t)ITEMS_PER * exl_pool_size(cpu->pool);
    if (units < want) {
        const int64_t by_len = (b->max_kv + BLOCK_MIN - 1) / BLOCK_MIN, by_work = (want + units - 1) / units;
        j.n_blocks = (int32_t)(by_len < by_work ? by_len : by_work);
    }
    if (j.n_blocks > 1) {
        j.part = exl_malloc((size_t)b->n_rows * (size_t)shape->n_heads * (size_t)j.n_blocks *
                            (size_t)(shape->head_dim + 2) * sizeof(float));
        if (!j.part)
            j.n_blocks = 1; /* out of memory: unsplit rows need no scratch */
    }
    j.n_items = units * j.n_blocks;
    exl_pool_run_work(cpu->pool, attention_task, &j, (int64_t)b->n_rows * shape->n_heads * b->max_kv * shape->head_dim);
    if (j.n_blocks > 1)
        merge_blocks(&j);
    exl_free(j.part);
}
