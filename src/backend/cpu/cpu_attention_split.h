/* cpu_attention_split.h - the work split the CPU's fp32 and fp16 attention share: items (row, KV head, sequence
 * block); with few rows (decode) each row's keys are cut into blocks that every thread shares, each block leaving
 * its online-softmax state in `part`, merged into the output afterwards. */
#ifndef EXL_CPU_ATTENTION_SPLIT_H
#define EXL_CPU_ATTENTION_SPLIT_H

#include "backend/cpu/cpu.h"

typedef struct exl_cpu_attn_split {
    float *out;       /* [rows, n_heads, head_dim] */
    int32_t n_blocks; /* sequence blocks per (row, KV head) */
    float *part;      /* n_blocks > 1: [row * n_heads + head][block] of (max, sum, acc[head_dim]) */
    int64_t n_items;  /* rows * KV heads * blocks */
} exl_cpu_attn_split;

/* One work item: the query heads of KV head kv_head of one row over keys t_begin .. t_end-1 of its sequence. */
typedef struct exl_cpu_attn_item {
    const exl_attn_seq *seq;
    int32_t row, kv_head, block, t_begin, t_end;
} exl_cpu_attn_item;

/* The split of a batch's attention over the pool's threads (part allocated when rows are split; a failed allocation
 * leaves them whole); release with exl_cpu_attn_finish. */
exl_cpu_attn_split exl_cpu_attn_split_plan(exl_cpu_backend *cpu, float *out, const exl_batch *b,
                                           const exl_attn_shape *s);
/* Item it, its blocks' key ranges in multiples of granule; *si is the sequence of the item before (a hint). */
exl_cpu_attn_item exl_cpu_attn_item_of(const exl_cpu_attn_split *sp, const exl_batch *b, const exl_attn_shape *s,
                                       int64_t it, int32_t granule, int32_t *si);
/* A query head's softmax state after its item (max m, sum l, unnormalized acc[head_dim]): normalized into the
 * output, or kept in part for the merge. */
void exl_cpu_attn_store(const exl_cpu_attn_split *sp, const exl_attn_shape *s, const exl_cpu_attn_item *item,
                        int32_t head, float m, float l, const float *acc);
/* Split rows: each head's output from its blocks' states; then part is freed. */
void exl_cpu_attn_finish(exl_cpu_attn_split *sp, const exl_cpu_kernels *k, const exl_batch *b, const exl_attn_shape *s);

#endif
