/* model.h - a loaded model: config, mapped weights, backend handles, forward scratch. */
#ifndef EXL_MODEL_MODEL_H
#define EXL_MODEL_MODEL_H

#include "backend/backend.h"
#include "io/hf_config.h"
#include "io/weights.h"

/* A decoder layer's weights; which of them are there follows cfg (NULL otherwise). */
typedef struct exl_layer {
    exl_vector *attn_norm; /* input_layernorm */
    exl_vector *mlp_norm;  /* the norm before the MLP: post_attention_layernorm, Gemma 2/3's pre_feedforward */
    exl_linear *q, *k, *v, *o;
    exl_linear *qkv;             /* cfg.fused_qkv (Phi-3): one linear giving q, then k, then v (q, k, v are NULL) */
    exl_vector *q_norm, *k_norm; /* cfg.qk_norm: RMSNorm weights of head_dim, applied to each head */
    exl_vector *post_attn_norm;  /* cfg.sandwich_norms: on the attention output before the residual add */
    exl_vector *post_mlp_norm;   /* cfg.sandwich_norms: on the MLP output before the residual add */
    /* dense MLP (a layer that is not MoE) */
    exl_linear *gate, *up, *down;
    exl_linear *gate_up; /* cfg.fused_gate_up (Phi-3): gate rows, then up rows (gate, up are NULL) */
    /* mixture of experts (cfg.layers[i].moe) */
    exl_linear *router;      /* hidden -> n_experts logits */
    exl_expert *experts;     /* cfg.moe.n_experts of them */
    exl_expert shared;       /* Qwen2-MoE: the shared expert every token runs (cfg.moe.shared_ffn) */
    exl_linear *shared_gate; /* Qwen2-MoE: hidden -> 1, the sigmoid weight of the shared expert's output */
} exl_layer;

/* A rope's frequencies in backend memory, for the sequence length they were computed for (dynamic scaling and
 * longrope depend on it). */
typedef struct exl_rope_table {
    float *inv_freq; /* [rot_dim / 2] */
    float attn_factor;
    int32_t seq_len; /* -1: not computed yet */
} exl_rope_table;

/* Buffers for one forward step of up to max_rows tokens (the backend's step_rows), allocated
 * once; the logits grow to the most rows a step has wanted them for. */
typedef struct exl_forward_scratch {
    int32_t max_rows, max_logit_rows;
    float *x, *h, *q, *k, *v, *attn, *gate, *up, *logits;
    float *sel; /* the rows logits are wanted for */
    /* A step's tables, built on the host and uploaded in one copy (build_batch): ids, pos,
     * slots and logit_rows of its rows, then its sequences and their page tables, one after
     * another in table (backend memory) and host_table, table_cap int32s each. The pointers
     * below point into table, where this step put them. */
    int32_t *table, *host_table;
    int32_t table_cap;
    int32_t *ids, *pos, *slots, *page_tables, *logit_rows;
    exl_attn_seq *seqs;
    exl_batch batch; /* this step's (exl_model_begin_step) */
    exl_graph graph; /* this step's nodes */
    /* the rope tables: [0] of cfg.rope, [1] of cfg.rope_sliding where sliding layers use a rope of their own
     * (inv_freq NULL otherwise) */
    exl_rope_table rope[2];
    /* a fused projection's output (Phi-3's qkv_proj, gate_up_proj), before its parts are copied out */
    float *fused;
    /* mixture of experts: the router's logits (then the shared expert's gate), each row's experts and their
     * weights, the experts' scratch (graph.h: moe_experts) */
    float *router, *route_weights, *moe_xs, *moe_gate, *moe_up;
    int32_t *route_ids, *moe_slots;
    /* greedy decode ahead of the host (forward_ahead.c): the rows whose tokens the last
     * exl_model_forward_argmax chose for the next step (0: none), which are at the start of table
     * where the backend has an argmax op, else in host_fed; and, without that op, the results
     * picked on the host, host_logits their logits */
    int32_t fed_rows;
    int32_t host_fed[EXL_ARGMAX_ROWS];
    int32_t host_argmax[EXL_ARGMAX_KEEP][EXL_ARGMAX_ROWS];
    int32_t host_argmax_rows[EXL_ARGMAX_KEEP];
    int64_t host_argmax_issued;
    float *host_logits; /* [host_logit_rows, vocab] */
    int32_t host_logit_rows;
    /* sampled decode ahead of the host (forward_sample.c), without the backend's sample_queue: results as
     * host_argmax's */
    exl_sample_result host_sample[EXL_ARGMAX_KEEP][EXL_ARGMAX_ROWS];
    int32_t host_sample_rows[EXL_ARGMAX_KEEP];
    int64_t host_sample_issued;
} exl_forward_scratch;

/* What one linear layer was loaded from (kept for `exl info` and the quantizer); src.name is NULL. */
typedef struct exl_linear_record {
    char name[96];
    exl_linear_src src;
    const exl_linear *w; /* the backend's linear made from it */
} exl_linear_record;

struct exl_model {
    char *dir;
    exl_hf_config cfg;
    exl_weights *weights;
    exl_backend *be;
    exl_linear *embed; /* dense [vocab, hidden] table */
    exl_linear *head;  /* lm_head, or the embedding table when tied */
    exl_vector *final_norm;
    exl_layer *layers;
    exl_linear_record *linears; /* every linear loaded through exl_model_load_linear */
    int32_t n_linears, cap_linears;
    float embed_scale;
    int32_t rot_dim;
    exl_forward_scratch fs;
    struct exl_lora_state *lora; /* LoRA adapters (model/lora.h), NULL until one is loaded */
    struct exl_tp *tp;           /* tensor parallelism (tp.h): the ranks this model is one of, NULL on one device */
    int32_t rank;                /* this model's rank (0: the one the caller holds) */
};

/* A paged KV cache: n_pages pages of page_size token slots per layer, keys and values stored as fmt says
 * (backend/kv_quant.h). */
typedef struct exl_kv_cache {
    int32_t n_pages, page_size, n_layers, kv_width;
    exl_kv_format fmt;
    size_t k_slot_bytes, v_slot_bytes;
    void **k, **v;                  /* per layer, backend memory */
    struct exl_kv_cache *rank_next; /* tensor parallelism: the next rank's shard (its KV heads), or NULL */
} exl_kv_cache;

/* k_bits, v_bits: 16 (or 0), 8, 6 or 4 per key and value. */
exl_status exl_kv_cache_init(exl_model *m, int32_t n_pages, int32_t page_size, int32_t k_bits, int32_t v_bits,
                             exl_kv_cache **out);
void exl_kv_cache_free(exl_model *m, exl_kv_cache *c);
/* Copy the K/V of the first n_slots slots of page src to page dst, in every layer. */
exl_status exl_kv_cache_copy_page(exl_model *m, exl_kv_cache *c, int32_t src, int32_t dst, int32_t n_slots);
/* The same on one rank of a tensor-parallel model alone (the calls above cover every rank). */
exl_status exl_kv_cache_init_local(exl_model *m, int32_t n_pages, int32_t page_size, int32_t k_bits, int32_t v_bits,
                                   exl_kv_cache **out);
void exl_kv_cache_free_local(exl_model *m, exl_kv_cache *c);
exl_status exl_kv_cache_copy_page_local(exl_model *m, exl_kv_cache *c, int32_t src, int32_t dst, int32_t n_slots);
/* The format of a cache of the model with k_bits and v_bits (an error for widths it does not take). */
exl_status exl_kv_cache_format(const exl_model *m, int32_t k_bits, int32_t v_bits, exl_kv_format *fmt);
/* Bytes one token takes in such a cache, all layers, keys and values. */
int64_t exl_kv_cache_token_bytes(const exl_model *m, const exl_kv_format *fmt);
/* An error (EXL_ERR_NOMEM, one line) when a cache of `bytes` for `tokens` cannot fit: more than the GPU has free,
 * more than the host's RAM (kv_size.c). */
exl_status exl_kv_cache_check_fits(const exl_model *m, int64_t bytes, int64_t tokens);

/* One sequence's part of a forward step, as the caller (session, generator) sees it. */
typedef struct exl_seq_step {
    const int32_t *ids; /* n_new host token ids; NULL: the token exl_model_forward_argmax chose in
                           * the step before for this sequence's row (see there) */
    int32_t n_new;
    int32_t n_past;       /* tokens already in the cache */
    const int32_t *pages; /* host page table covering n_past + n_new tokens */
    int32_t n_pages;
    int want_logits; /* 0: none, 1: last new token only, 2: every new token */
} exl_seq_step;

/* The rows of logits a sequence's step asks for. */
static inline int32_t exl_seq_step_logit_rows(const exl_seq_step *st) {
    return st->want_logits == 2 ? st->n_new : st->want_logits ? 1 : 0;
}

/* Run one step over several sequences. Logits of the requested rows are written to
 * host memory `logits` in order (sequence by sequence), vocab floats each. The total
 * new tokens must not exceed exl_model_max_rows. */
exl_status exl_model_forward(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                             float *logits);
/* The largest k exl_model_forward_top_k takes: 0 when the backend cannot select on its own
 * (the CPU, whose logits are on the host anyway). */
int32_t exl_model_top_k_max(const exl_model *m);
/* As exl_model_forward, but only the k largest logits of each row that wants logits come back
 * (ids, vals [rows, k], larger first, lower id first among equals): the sampler's candidates
 * without moving the whole vocabulary. */
exl_status exl_model_forward_top_k(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                   int32_t k, int32_t *ids, float *vals);
/* Constrained decoding (forward_masked.c): as exl_model_forward (k 0: the logits into `logits`) or
 * exl_model_forward_top_k (k > 0: the head into ids / vals), with the logits of each row masked
 * first. fill(user, masks, rows) writes the rows' bitsets into the HOST buffer masks (rows x
 * exl_mask_words(vocab) words, bit set: keep); it is called once the step is under way, so on an
 * asynchronous device the host computes the masks while the device computes the logits. */
exl_status exl_model_forward_masked(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    exl_logit_mask_fn fill, void *user, uint32_t *masks, int32_t k, int32_t *ids,
                                    float *vals, float *logits);
/* Sampling on the backend (forward_sample.c): as exl_model_forward, but each row that wants logits gets one token
 * from the backend's sample op (backend.h) with params[row] and its edits into out[row]; with fill (constrained
 * decoding, as exl_model_forward_masked's) the logits are masked first. */
exl_status exl_model_forward_sample(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    exl_logit_mask_fn fill, void *user, uint32_t *masks,
                                    const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits,
                                    exl_sample_result *out);
/* Sampled decode that runs ahead of the host: as exl_model_forward_argmax, but each row's token is the sample op's
 * with params[row] and its edits (without masks), fetched by exl_model_sample_wait(*ticket). chained: the step before
 * was one of these, with the same rows; row r then uses params[r].u_next where that step's row r kept more than one
 * candidate (backend.h: sample_queue). Without the backend's op the step runs at once and samples on the host side
 * with the same results. */
exl_status exl_model_forward_sample_ahead(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                          const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits,
                                          int chained, int64_t *ticket);
exl_status exl_model_sample_wait(exl_model *m, int64_t ticket, exl_sample_result *out, int32_t n);
/* Greedy decode that runs ahead of the host. As exl_model_forward, but it only queues the step:
 * each row that wants logits gets the lowest id of its largest logit (-1 where every logit is
 * -inf or NaN), fetched by exl_model_argmax_wait(*ticket) (n: those rows, at most
 * EXL_ARGMAX_ROWS). The next step may feed these tokens without the host having seen them: every
 * sequence of it with ids NULL and n_new 1, one per row of this step in order, its pages growing
 * by at most one each. Queue that step before waiting for this one's tokens and the device never
 * idles between steps. Results of the last EXL_ARGMAX_KEEP steps can be waited for. */
exl_status exl_model_forward_argmax(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    int64_t *ticket);
exl_status exl_model_argmax_wait(exl_model *m, int64_t ticket, int32_t *ids, int32_t n);
/* The layers and the head for a step (forward.c); the logits of the rows that want them are left
 * in m->fs.logits. ahead: keep room in the step tables for a next step fed from this one. */
exl_status exl_model_forward_to_logits(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                       int ahead, int32_t *n_logits);
/* The same on one rank of a tensor-parallel model alone (exl_model_forward_to_logits runs it on every rank). */
exl_status exl_model_step_to_logits(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                    int ahead, int32_t *n_logits);

/* ---- a step as a graph (forward.c; backend/graph.h). A step's graph is built as:
 *   exl_model_begin_step: check the steps, upload their tables (m->fs.batch), empty m->fs.graph for them;
 *   nodes added: the embedding, exl_model_layer_graph for each layer, the head (exl_model_forward_to_logits),
 *   or any part of that (exl_model_layer_forward: one layer);
 *   exl_model_run_graph. */
exl_status exl_model_begin_step(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs, int ahead,
                                int32_t *n_logits);
/* Append decoder layer li, with weights l (the model's own or others of the same shapes; a block whose input norm,
 * attn_norm or mlp_norm, is NULL left out) and the cache's layer li, over the hidden states in m->fs.x of g's batch,
 * to g (layer_graph.c). */
exl_status exl_model_layer_graph(exl_model *m, const exl_layer *l, int32_t li, const exl_kv_cache *cache, exl_graph *g);
/* Run g: with a hook, node by node through the generic executor (no backend fusions), calling it before each
 * matmul; without, through the backend's graph_run where it has one. */
exl_status exl_model_run_graph(exl_model *m, const exl_graph *g, exl_linear_hook hook, void *user);
/* Run decoder layer li with weights `layer` (the model's own or candidates) over the hidden states of a step (as
 * exl_model_forward's steps: tokens through the paged cache, the ids not read); x in/out [rows, hidden] in
 * m->fs.x. A block whose input norm is NULL (attn_norm: attention, mlp_norm: MLP) is left out, so one block can run
 * alone.
 * With a hook (called with each linear's input rows before its matmul) it runs op by op, without backend fusions
 * (forward_layer.c). */
exl_status exl_model_layer_forward(exl_model *m, const exl_layer *layer, int32_t li, exl_kv_cache *cache,
                                   const exl_seq_step *steps, int32_t n_seqs, exl_linear_hook hook, void *user);
void exl_model_free_ahead(exl_model *m);
/* Tokens one step takes at most: the backend's step_rows (512 on the CPU, 2048 on CUDA), or
 * less where the forward buffers for that many did not fit. */
int32_t exl_model_max_rows(const exl_model *m);
/* The forward buffers (at load): for step_rows tokens, or half as many at a time while memory
 * is short, down to 64. exl_model_free_forward frees them. */
exl_status exl_model_alloc_forward(exl_model *m);
void exl_model_free_forward(exl_model *m);

/* ---- the quantizer's view (forward_layer.c, model_load.c): a step's embeddings, its rows' head input, and where
 * each linear came from; decoder layers one at a time are exl_model_layer_forward's (above) */

/* The embeddings of a step's tokens (steps as exl_model_forward's) into m->fs.x [rows, hidden], rows in step order:
 * the first layer's input. */
exl_status exl_model_embed_step(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs);
/* The head's input, the final norm of the step's rows of m->fs.x, to the hook (as layer n_layers, linear m->head);
 * the head itself is not run. Steps as exl_model_layer_forward's (the ids not read). */
exl_status exl_model_head_input(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs,
                                exl_linear_hook hook, void *user);
/* The tensors linear w of the model was loaded from: *prefix names them (<prefix>.weight, <prefix>.bias, ...; valid
 * while the model is) and *src describes them; a tied head is "lm_head" over the embedding table. EXL_ERR_ARG for a
 * linear the model does not hold. */
exl_status exl_model_linear_source(const exl_model *m, const exl_linear *w, const char **prefix, exl_linear_src *src);

/* Loading pieces (model_load.c, layer_load.c, linear_load.c) */
/* The tensors of linear `prefix` (EXL2, GPTQ or dense, found by name), checked, into *src (src->name: prefix). */
exl_status exl_model_linear_find(exl_model *m, const char *prefix, int64_t in, int64_t out, int has_bias,
                                 exl_linear_src *src);
/* The backend's linear from src, recorded as the model's. */
exl_status exl_model_linear_add(exl_model *m, const exl_linear_src *src, exl_linear **w);
/* The embedding table as a dense [vocab, hidden] linear's source; the text model's tensor prefix ("model.", ...);
 * the lm_head's prefix or NULL when tied (model_load.c). */
exl_status exl_model_embedding_source(const exl_model *m, const char *prefix, exl_linear_src *src);
const char *exl_model_text_prefix(const exl_weights *w);
const char *exl_model_head_name(const exl_weights *w);
exl_status exl_model_load_linear(exl_model *m, const char *prefix, int64_t in, int64_t out, int has_bias,
                                 exl_linear **w);
/* A norm's weights of n values (Gemma's (1 + w) applied). */
exl_status exl_model_load_norm(exl_model *m, const char *name, int64_t n, exl_vector **out);
/* Layer i's tensors, named "<text_prefix>layers.<i>.*" ("model." for causal LMs). */
exl_status exl_model_load_layer(exl_model *m, const char *text_prefix, int32_t i);
void exl_model_free_layer(exl_model *m, exl_layer *l);

/* The frequencies of rope r (cfg.rope or cfg.rope_sliding) for a sequence length (dynamic scaling and longrope
 * depend on it). */
void exl_rope_frequencies(const exl_hf_config *cfg, const exl_rope_config *r, int32_t rot_dim, int32_t seq_len,
                          float *inv_freq, float *attn_factor);

#endif
