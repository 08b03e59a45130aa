/* tp.h - tensor parallelism: one model over n ranks (devices), each a model of its own (exl_model with rank k)
 * holding its shard of every layer (tp_load.c), its own backend, forward buffers and KV cache shard, driven by a
 * thread of its own (rank 0: the caller's) through the same forward pass, whose graphs hold the collectives
 * (backend/graph.h: all_reduce, gather_cols). See docs/parallel.md. */
#ifndef EXL_MODEL_TP_H
#define EXL_MODEL_TP_H

#include "model/model.h"
#include "model/shard.h"

#include <pthread.h>

/* Two ways of spreading a model over ranks:
 *   tensor parallelism (--tp N): every layer split over every rank, as above;
 *   a layer split (--gpu-split A,B,...): rank k holds layers [layer_bounds[k], layer_bounds[k + 1]) whole (rank 0
 *   the embedding, the last rank the head), runs them after the rank before it, whose hidden states it receives
 *   through a gather_cols of which the sender owns every column; the logits come back to rank 0 the same way. */

/* How one decoder layer is split on a rank. */
typedef struct exl_tp_layer {
    int32_t ffn;      /* the dense MLP's (or each expert's) width on this rank */
    int32_t o_gather; /* 1: the attention outputs are gathered and o_proj split by output columns (EXL2 act-order
                         rows that do not follow the heads), 0: o_proj split by input and summed */
} exl_tp_layer;

typedef struct exl_tp_rank {
    exl_model *m; /* ranks[0].m is the model the caller holds */
    exl_tp_layer *layers;
    exl_shard_mem mem;
    /* forward buffers of max_rows rows: the summed partial outputs (MoE), zeros, the gathered attention output or
     * a part of the hidden columns (o_gather), the rank's vocabulary slice of the logits */
    float *partial, *zeros, *wide, *part, *head_part;
    int32_t head_rows; /* rows head_part holds */
    /* the worker (ranks >= 1) */
    pthread_t thread;
    int has_thread;
    exl_status st;
    char msg[512];
} exl_tp_rank;

typedef exl_status (*exl_tp_fn)(exl_model *rank_model, void *arg);
typedef struct exl_tp exl_tp;

struct exl_tp {
    int32_t n;
    int no_comm; /* EXL_TP_NO_COMM=1: the graphs leave the collectives out (wrong results: for timing them by
                  * difference, bench/gpu_tp.sh) */
    exl_tp_rank *ranks;
    exl_hf_config full; /* the model's own config (each rank's cfg has its own head and MLP widths) */
    /* column splits, n + 1 boundaries each: the vocabulary (head), the attention output and the hidden size
     * (o_gather layers) */
    int32_t *vocab_cols, *attn_cols, *hidden_cols;
    /* the layer split (split 1): each rank's layers, and for each sender j the columns [(n + 1) * j ..) that make
     * it own all of the hidden states, then the last rank all of the logits */
    int split;
    int32_t *layer_bounds, *send_hidden, *send_vocab;
    /* the workers' job: posted with a generation count, done when every worker has finished it */
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int64_t job_gen;
    int32_t busy;
    int quit;
    int spin; /* GPU ranks: waiting threads poll briefly before they sleep (tp.c) */
    exl_tp_fn fn;
    void *arg;
};

/* Start the threads of ranks 1 .. n - 1 (tp.c), which wait for exl_tp_each's jobs. */
exl_status exl_tp_start_workers(exl_tp *tp);
/* CPU worker threads of each rank's backend: params' (or the cores) shared by the ranks (tp_load.c). */
int exl_tp_rank_threads(const exl_tp *tp, const exl_model_params *params);
/* Load m (its config read, its weights mapped) over params->tp ranks, or the devices of params->gpu_split
 * (tp_load.c). */
exl_status exl_tp_load(exl_model *m, const exl_model_params *params);
/* Free the ranks other than 0, stop the workers; exl_tp_free_last then frees rank 0's shards and the rest, after
 * the model freed its own weights handles. */
void exl_tp_free_ranks(exl_model *m);
void exl_tp_free_last(exl_model *m);
/* Run fn(rank k's model, arg) on every rank at once, each on its own thread (rank 0 on the caller's), and return
 * the first failure (its message on this thread); a failing rank aborts the others' collectives. */
exl_status exl_tp_each(exl_model *m, exl_tp_fn fn, void *arg);
/* The forward step over every rank (forward.c's exl_model_forward_to_logits for a model with ranks). */
exl_status exl_tp_forward_to_logits(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    int ahead, int32_t *n_logits);
/* A layer split's ranks (made, tp->n of them) load their layers (tp_split.c). */
exl_status exl_tp_split_load(exl_model *m, const exl_model_params *params, const char *prefix);
/* 1 when model m (a rank, or a model of one device) holds decoder layer li (a layer split holds some). */
int exl_tp_holds_layer(const exl_model *m, int32_t li);
/* A layer split's step (tp.c) runs in stages, each on every rank at once (exl_tp_each, a host barrier between
 * them), so that no rank allocates while a collective waits on another device (NCCL kernels waiting for a peer and
 * a cudaMalloc / cudaFree on another thread deadlock) and a rank's host failure launches nothing anywhere:
 *   exl_tp_split_prepare after the rank's begin_step: the rest of its host allocations (the logits' staging room);
 *   exl_tp_split_stage for stage 0 .. 2n - 1: 2j rank j's own part (its layers, rank 0 the embedding first, the
 *   last rank the head after), 2j + 1 the hand-over of its hidden states to every rank (the last rank: its logits),
 *   run and waited for. */
exl_status exl_tp_split_prepare(exl_model *m, int32_t n_logits);
exl_status exl_tp_split_stage(exl_model *m, const exl_kv_cache *cache, int32_t n_logits, int32_t stage);
/* The head of a rank: its slice of the vocabulary, gathered into m->fs.logits (forward.c). */
exl_status exl_tp_head_nodes(exl_model *m, int32_t n, exl_graph *g);
/* The KV cache over the ranks (kv_cache.c): each rank's shard, chained through rank_next. */
exl_status exl_tp_kv_cache_init(exl_model *m, int32_t n_pages, int32_t page_size, int32_t k_bits, int32_t v_bits,
                                exl_kv_cache **out);
void exl_tp_kv_cache_free(exl_model *m, exl_kv_cache *c);
exl_status exl_tp_kv_cache_copy_page(exl_model *m, exl_kv_cache *c, int32_t src, int32_t dst, int32_t n_slots);

#endif
