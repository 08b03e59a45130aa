/* shard.h - tensor parallelism's split of one linear layer's weights (shard_linear.c): a rank's part of an
 * exl_linear_src, by output columns (q/k/v, gate/up, the head) or by input features (o_proj, down_proj), as a new
 * source over the mapped files where the part is contiguous there, else over copies held in an exl_shard_mem.
 * Quantized layers split only where their groups allow it (a split inside a group is an error that says so). */
#ifndef EXL_MODEL_SHARD_H
#define EXL_MODEL_SHARD_H

#include "exl.h"
#include "format/linear_src.h"

#include <stddef.h>
#include <stdint.h>

/* The copies a rank's sources point into, freed together. */
typedef struct exl_shard_mem {
    void **blocks;
    int32_t n, cap;
} exl_shard_mem;

void exl_shard_mem_free(exl_shard_mem *mem);

/* out = src's output columns cols[0 .. n) in that order (any columns). */
exl_status exl_shard_cols(const exl_linear_src *src, const int32_t *cols, int32_t n, exl_shard_mem *mem,
                          exl_linear_src *out);
/* out = src over the input features features[0 .. n) (ascending); its bias kept only with keep_bias (the ranks'
 * partial products are summed: one of them adds it). An error where the format cannot hold that part alone:
 * GPTQ splits inside a group (without act-order) or inside a packed word, EXL2 features whose permuted rows are
 * not whole groups (exl_shard_rows_fit says which beforehand). */
exl_status exl_shard_rows(const exl_linear_src *src, const int32_t *features, int32_t n, int keep_bias,
                          exl_shard_mem *mem, exl_linear_src *out);
/* 1 when exl_shard_rows can take these features of src. */
int exl_shard_rows_fit(const exl_linear_src *src, const int32_t *features, int32_t n);
/* Rank `rank` of n_ranks's input features of src where the split is free to choose (down_proj, whose input the
 * rank's own gate/up columns make): near-equal parts at boundaries the format allows (EXL2: whole groups of its
 * permuted rows; GPTQ: whole groups, or packed words with act-order; dense: multiples of 32 where possible).
 * *features (exl_malloc'ed, ascending) and *n; an error when src has too few groups for n_ranks parts. */
exl_status exl_shard_plan_rows(const exl_linear_src *src, int32_t rank, int32_t n_ranks, int32_t **features,
                               int32_t *n);

#endif
