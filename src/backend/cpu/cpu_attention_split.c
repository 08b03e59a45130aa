/* cpu_attention_split.c - the work split the CPU's fp32 and fp16 attention share (cpu_attention_split.h). */
#include "backend/cpu/cpu_attention_split.h"
#include "base/alloc.h"

#include <math.h>
#include <string.h>

#define BLOCK_MIN 64 /* the fewest keys of a sequence block */
#define ITEMS_PER 8  /* work items per thread that decode aims for */

exl_cpu_attn_split exl_cpu_attn_split_plan(exl_cpu_backend *cpu, float *out, const exl_batch *b,
                                           const exl_attn_shape *s) {
    exl_cpu_attn_split sp = {out, 1, NULL, 0};
    /* few rows (decode): split each row's keys into blocks so that every thread has work */
    const int64_t units = (int64_t)b->n_rows * s->n_kv_heads, want = (int64_t)ITEMS_PER * exl_pool_size(cpu->pool);
    if (units < want) {
        const int64_t by_len = (b->max_kv + BLOCK_MIN - 1) / BLOCK_MIN, by_work = (want + units - 1) / units;
        sp.n_blocks = (int32_t)(by_len < by_work ? by_len : by_work);
    }
    if (sp.n_blocks > 1) {
        sp.part = exl_malloc((size_t)b->n_rows * (size_t)s->n_heads * (size_t)sp.n_blocks * (size_t)(s->head_dim + 2) *
                             sizeof(float));
        if (!sp.part)
            sp.n_blocks = 1; /* out of memory: unsplit rows need no scratch */
    }
    sp.n_items = units * sp.n_blocks;
    return sp;
}

exl_cpu_attn_item exl_cpu_attn_item_of(const exl_cpu_attn_split *sp, const exl_batch *b, const exl_attn_shape *s,
                                       int64_t it, int32_t granule, int32_t *si) {
    exl_cpu_attn_item item;
    item.block = (int32_t)(it % sp->n_blocks);
    item.kv_head = (int32_t)(it / sp->n_blocks % s->n_kv_heads);
    item.row = (int32_t)(it / sp->n_blocks / s->n_kv_heads);
    while (*si + 1 < b->n_seqs && item.row >= b->seqs[*si + 1].q_start)
        (*si)++;
    while (*si > 0 && item.row < b->seqs[*si].q_start)
        (*si)--;
    item.seq = &b->seqs[*si];
    const int32_t last = item.seq->n_kv - item.seq->n_q + (item.row - item.seq->q_start); /* causal: keys ..last */
    int32_t first = 0;
    if (s->sliding_window > 0 && last - s->sliding_window + 1 > 0)
        first = last - s->sliding_window + 1;
    long b0, b1;
    exl_split_range(last - first + 1, item.block, sp->n_blocks, granule, &b0, &b1);
    item.t_begin = first + (int32_t)b0, item.t_end = first + (int32_t)b1;
    return item;
}

void exl_cpu_attn_store(const exl_cpu_attn_split *sp, const exl_attn_shape *s, const exl_cpu_attn_item *item,
                        int32_t head, float m, float l, const float *acc) {
    const int32_t hd = s->head_dim;
    const int64_t rh = (int64_t)item->row * s->n_heads + head;
    if (sp->n_blocks == 1) {
        const float inv = l > 0 ? 1.0f / l : 0.0f;
        float *o = sp->out + rh * hd;
        for (int32_t d = 0; d < hd; d++)
            o[d] = acc[d] * inv;
    } else {
        float *pp = sp->part + (rh * sp->n_blocks + item->block) * (hd + 2);
        pp[0] = m, pp[1] = l;
        memcpy(pp + 2, acc, (size_t)hd * sizeof(float));
    }
}

void exl_cpu_attn_finish(exl_cpu_attn_split *sp, const exl_cpu_kernels *k, const exl_batch *b,
                         const exl_attn_shape *s) {
    const int32_t hd = s->head_dim;
    for (int64_t rh = 0; sp->n_blocks > 1 && rh < (int64_t)b->n_rows * s->n_heads; rh++) {
        const float *pp = sp->part + rh * sp->n_blocks * (hd + 2);
        float mx = -INFINITY, l = 0, *o = sp->out + rh * hd;
        for (int32_t bl = 0; bl < sp->n_blocks; bl++)
            mx = pp[bl * (hd + 2)] > mx ? pp[bl * (hd + 2)] : mx;
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int32_t bl = 0; bl < sp->n_blocks; bl++) {
            const float *q = pp + bl * (hd + 2);
            if (q[1] <= 0)
                continue;
            const float w = expf(q[0] - mx);
            l += q[1] * w;
            k->axpy_f32(o, w, q + 2, hd);
        }
        const float inv = l > 0 ? 1.0f / l : 0.0f;
        for (int32_t d = 0; d < hd; d++)
            o[d] *= inv;
    }
    exl_free(sp->part);
    sp->part = NULL;
}
