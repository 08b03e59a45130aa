/* graph.h - a forward step as a graph of generic ops, which a backend runs node by node or compiles.
 *
 * The model (src/model/) describes each step as an array of nodes in the order they run. A node is one plain op
 * over fp32 activations in backend memory; it names the buffers it reads and writes, the weights it uses, its
 * sizes, and a tag (decoder layer, which part of it) for messages and hooks:
 *
 *   embed        out[r] = table[ids[r]] * scale                          out [rows, width]
 *   rmsnorm      out = x / rms(x) * w, row by row (out may be x)           x, out [rows, width]
 *   matmul       out = x · W + b, or with accumulate out += x · W + b      x [rows, in], out [rows, out_features]
 *                (accumulate: the residual add)
 *   rope         x rotated in place at positions pos (NeoX layout)        x [rows, n_heads, head_dim]
 *   kv_store     the step's new k and v rows to their cache slots         k, v [batch rows, width]
 *   attention    out = causal attention of q over the paged cache         q, out [batch rows, heads * head_dim]
 *                (k and v: the new rows' keys and values, already stored;
 *                the layer's window, score scale and soft-cap in shape)
 *   glu          x = act(x) * up                                          x, up [rows, width]
 *   add          x += y                                                   n floats
 *   gather_rows  out[i] = x[idx[i]]                                       x [x_rows, width], out [n, width]
 *   copy_cols    out[r] = x[r, col .. col + width - 1] (a fused            x [rows, x_width], out [rows, width]
 *                projection's part)
 *   softcap      x = cap * tanh(x / cap)                                  n floats
 *   row_gate     x[r] *= sigmoid(g[r])                                    x [rows, width], g [rows]
 *   moe_route    the top_k experts of each row by its router logits,      logits [rows, n_experts],
 *                and their weights (softmax over all the experts,         ids, weights [rows, top_k]
 *                renormalized over the chosen ones when asked)
 *   moe_experts  out[r] += sum over r's choices j of weights[r, j] *      x, out [rows, width]
 *                down_e(act(gate_e(x[r])) * up_e(x[r])), e = ids[r, j]
 *   all_reduce   x = the sum of x over the ranks of a tensor-parallel      n floats
 *                model (every rank's backend runs the same node)
 *   gather_cols  out[r, cols[k] .. cols[k + 1]) = rank k's x[r] for every  x [rows, own width],
 *                rank k (the ranks' column slices put side by side)       out [rows, out_width]
 *   lora         out_i[r] += sum over r's adapter uses u of scale_u *     x [rows, in], out_i [rows, out_i]
 *                (x'[r] · A_iu^T) · Bt_iu for 1-3 projections i of x'
 *                (x, x normed, or act(x) * up), the adapters'
 *                low-rank factors gathered per row
 *
 * The model builds a step's graph from parts that stand alone (model.h: the embedding, each decoder layer's nodes
 * by exl_model_layer_graph, the head), so a graph may be one layer as well as a whole step.
 *
 * Contract. Running a graph means running its nodes one after another through the op table's primitive ops:
 * exl_graph_exec (graph_exec.c), the generic executor, does exactly that (an accumulating matmul through the
 * graph's tmp buffer, then add), and a backend without a graph_run op gets it (the CPU's runs it too, fusing
 * neighbouring decode matmuls of one input into one job); with a hook it calls it
 * before each matmul with that node's input (the quantizer's capture; for moe_experts, with each expert's gate, up
 * and down and the rows routed to that expert, computed for the hook before the node runs). A backend with graph_run may compile the
 * graph instead, knowing from the graph alone:
 *   - what each node reads and writes (exl_node_access), so which buffer a later node reads next or overwrites;
 *   - which buffers matter after the graph (outputs); every other activation buffer may hold anything
 *     afterwards (the KV cache always keeps what kv_store wrote).
 * So it may fuse neighbouring nodes, skip writing a buffer that no later node reads, lay a buffer out in an
 * order of its own where only the next node reads it, and replay its compiled form of a graph it has seen
 * (same nodes, same sizes, same buffers). Results equal the executor's up to rounding; a step's rows that are
 * decode tokens (batch max_q 1) may have their matmul inputs rounded to fp16 on the way.
 * Graphs hold no backend concepts: fusions, layouts and launch plans stay inside the backends. */
#ifndef EXL_BACKEND_GRAPH_H
#define EXL_BACKEND_GRAPH_H

#include "exl.h"

#include <stdint.h>

typedef struct exl_linear exl_linear; /* backend-owned, opaque (backend.h) */
typedef struct exl_vector exl_vector; /* backend-owned fp32 vector (norm weights) */

/* One expert of a mixture-of-experts block (or a shared expert): a gated MLP. */
typedef struct exl_expert {
    exl_linear *gate, *up, *down;
} exl_expert;

/* ---- one step's batch: several sequences, their new tokens concatenated row-wise */

typedef struct exl_attn_seq {
    int32_t q_start;    /* first row of this sequence in the batch */
    int32_t n_q;        /* new tokens */
    int32_t n_kv;       /* tokens in the cache after this step (the new ones included) */
    int32_t page_start; /* first entry of this sequence's page table in page_tables */
} exl_attn_seq;

/* How the cache that a step's kv_store and attention nodes write and read stores keys and values (its every layer
 * alike): backend/kv_quant.h. A zeroed format is the backend's own element (kv_elem_bytes) on both sides. */
typedef struct exl_kv_format {
    int32_t k_bits, v_bits; /* 8, 6 or 4: quantized in groups; 0 or 16: the backend's own element */
    int32_t group;          /* values per quantization group, a divisor of head_dim (0 when neither side is) */
} exl_kv_format;

typedef struct exl_batch {
    int32_t n_rows, n_seqs;
    int32_t max_q, max_kv;
    /* host copies */
    const exl_attn_seq *seqs;
    const int32_t *pos;   /* [n_rows] position of each row */
    const int32_t *slots; /* [n_rows] cache slot (page * page_size + offset) of each row */
    /* backend copies (identical pointers on the CPU) */
    const exl_attn_seq *d_seqs;
    const int32_t *d_ids, *d_pos, *d_slots, *d_page_tables;
    exl_kv_format kv; /* the cache's */
} exl_batch;

typedef struct exl_attn_shape {
    int32_t n_heads, n_kv_heads, head_dim;
    int32_t page_size;
    int32_t sliding_window; /* keys a query sees, itself included; 0 = all before it */
    float scale;            /* of the scores q·k */
    float softcap;          /* scores (after scale) become softcap * tanh(score / softcap); 0 = none */
} exl_attn_shape;

/* ---- the nodes */

typedef enum exl_op {
    EXL_OP_EMBED,
    EXL_OP_RMSNORM,
    EXL_OP_MATMUL,
    EXL_OP_ROPE,
    EXL_OP_KV_STORE,
    EXL_OP_ATTENTION,
    EXL_OP_GLU,
    EXL_OP_ADD,
    EXL_OP_GATHER_ROWS,
    EXL_OP_COPY_COLS,
    EXL_OP_SOFTCAP,
    EXL_OP_ROW_GATE,
    EXL_OP_MOE_ROUTE,
    EXL_OP_MOE_EXPERTS,
    EXL_OP_ALL_REDUCE,
    EXL_OP_GATHER_COLS,
    EXL_OP_LORA,
} exl_op;

/* Which part of the model a node is, for messages and hooks. */
typedef enum exl_part {
    EXL_PART_OTHER,
    EXL_PART_EMBED,
    EXL_PART_ATTN_NORM,
    EXL_PART_Q,
    EXL_PART_K,
    EXL_PART_V,
    EXL_PART_QKV,
    EXL_PART_Q_NORM,
    EXL_PART_K_NORM,
    EXL_PART_ROPE_Q,
    EXL_PART_ROPE_K,
    EXL_PART_KV_STORE,
    EXL_PART_ATTENTION,
    EXL_PART_O,
    EXL_PART_POST_ATTN_NORM,
    EXL_PART_ATTN_RESIDUAL,
    EXL_PART_MLP_NORM,
    EXL_PART_GATE,
    EXL_PART_UP,
    EXL_PART_GATE_UP,
    EXL_PART_GLU,
    EXL_PART_DOWN,
    EXL_PART_POST_MLP_NORM,
    EXL_PART_MLP_RESIDUAL,
    EXL_PART_ROUTER,
    EXL_PART_ROUTE,
    EXL_PART_EXPERTS,
    EXL_PART_SHARED_GATE,
    EXL_PART_LOGIT_ROWS,
    EXL_PART_FINAL_NORM,
    EXL_PART_HEAD,
    EXL_PART_LOGIT_SOFTCAP,
    EXL_PART_ATTN_REDUCE, /* tensor parallelism: the ranks' attention outputs summed or gathered */
    EXL_PART_MLP_REDUCE,  /* the ranks' MLP outputs summed */
    EXL_PART_HEAD_GATHER, /* the ranks' vocabulary slices of the logits */
} exl_part;

typedef struct exl_node_tag {
    int32_t layer; /* decoder layer, -1 outside the layers */
    exl_part part;
} exl_node_tag;

typedef struct exl_embed_node {
    float *out;
    const exl_linear *table; /* dense [vocab, width] */
    const int32_t *ids;      /* [rows] */
    int32_t rows, width;
    float scale;
} exl_embed_node;

typedef struct exl_rmsnorm_node {
    float *out;
    const float *x;
    const exl_vector *w;
    int32_t rows, width;
    float eps;
} exl_rmsnorm_node;

typedef struct exl_matmul_node {
    float *out; /* never x */
    const float *x;
    const exl_linear *w;
    int32_t rows, in_features, out_features; /* of w */
    int32_t accumulate;
} exl_matmul_node;

typedef struct exl_rope_node {
    float *x;
    const int32_t *pos;    /* [rows] */
    const float *inv_freq; /* [rot_dim / 2]; cos and sin are multiplied by attn_factor */
    int32_t rows, n_heads, head_dim, rot_dim;
    float attn_factor;
} exl_rope_node;

typedef struct exl_kv_store_node {
    void *k_cache, *v_cache; /* the layer's: page slots of width values, as the batch's kv format says */
    const float *k, *v;
    int32_t width;
} exl_kv_store_node;

typedef struct exl_attention_node {
    float *out;
    const float *q, *k, *v;
    const void *k_cache, *v_cache;
    exl_attn_shape shape;
} exl_attention_node;

typedef struct exl_glu_node {
    float *x;
    const float *up;
    int32_t rows, width, act;
} exl_glu_node;

typedef struct exl_add_node {
    float *x;
    const float *y;
    int64_t n;
} exl_add_node;

typedef struct exl_gather_rows_node {
    float *out;
    const float *x;
    const int32_t *idx; /* [n] */
    int32_t n, width, x_rows;
} exl_gather_rows_node;

typedef struct exl_copy_cols_node {
    float *out;
    const float *x;
    int32_t rows, width, x_width, col;
} exl_copy_cols_node;

typedef struct exl_softcap_node {
    float *x;
    int64_t n;
    float cap;
} exl_softcap_node;

typedef struct exl_row_gate_node {
    float *x;
    const float *g; /* [rows] */
    int32_t rows, width;
} exl_row_gate_node;

typedef struct exl_moe_route_node {
    float *weights;      /* [rows, top_k] */
    int32_t *ids;        /* [rows, top_k]: the chosen experts, larger logit first, lower id first among equals */
    const float *logits; /* [rows, n_experts] */
    int32_t rows, n_experts, top_k;
    int32_t renormalize; /* 1: the chosen weights divided by their sum */
} exl_moe_route_node;

/* The experts run on the rows that chose them: xs, gate and up are scratch of rows * top_k rows (backend memory
 * no other node touches, which the backend may use as it likes: gathered inputs, products), slots of
 * 2 * rows * top_k int32s. */
typedef struct exl_moe_experts_node {
    float *out;                /* [rows, width], added to */
    const float *x;            /* [rows, width] */
    const int32_t *ids;        /* [rows, top_k] */
    const float *weights;      /* [rows, top_k] */
    const exl_expert *experts; /* host array of n_experts, each gate and up [width -> ffn], down [ffn -> width] */
    int32_t rows, width, ffn, n_experts, top_k, act;
    float *xs;        /* [rows * top_k, width] */
    float *gate, *up; /* [rows * top_k, ffn] */
    int32_t *slots;   /* [2 * rows * top_k] */
} exl_moe_experts_node;

/* Tensor parallelism (docs/parallel.md): the collectives over the ranks whose backends joined one communicator
 * (backend.h: comm_init). Every rank's graph has the same collectives in the same order. */
typedef struct exl_all_reduce_node {
    float *x;
    int64_t n;
} exl_all_reduce_node;

typedef struct exl_gather_cols_node {
    float *out;          /* [rows, out_width] */
    const float *x;      /* [rows, cols[rank + 1] - cols[rank]]: this rank's slice */
    const int32_t *cols; /* host array of n_ranks + 1: rank k's columns of out are [cols[k], cols[k + 1]) */
    int32_t rows, out_width, n_ranks, rank;
    float *tmp; /* backend scratch of rows * out_width floats the backend may stage the slices in */
} exl_gather_cols_node;
/* One adapter's factors for one projection (backend memory): the update of a row x is (x · A^T) · Bt, the adapter's
 * scaling (alpha / r, or alpha / sqrt(r)) already in Bt. rank 0: the adapter leaves the projection alone. */
typedef struct exl_lora_factors {
    const float *a;  /* [rank, in] */
    const float *bt; /* [rank, out] */
    int32_t rank, pad_;
} exl_lora_factors;

/* Gathered low-rank updates (Punica / S-LoRA) after 1-3 projections of one input (q, k and v; gate and up). The input
 * is x itself, or what a norm or a GLU before the projections makes of it (so that the backend may fuse those into
 * the projections' matmuls, which then need not write it): with norm, x / rms(x) * norm (eps); with up (one
 * output), act(x) * up. Each row uses its own adapters, the uses of row r being row_uses[r] .. row_uses[r + 1] - 1, one use u naming the adapter
 * slot use_slot[u] (an entry of each projection's factors) and the weight use_scale[u]; use_row[u] is the row of
 * use u. t is scratch of n_uses * n_out * max_rank floats. by_adapter (or NULL), the uses grouped by adapter for a
 * backend that reads each adapter's factors once for all its rows (Punica's SGMV): n_seg, seg[n_uses + 1],
 * order[n_uses] (segment i is uses order[seg[i] .. seg[i + 1]), all of one slot; seg past n_seg is n_uses). */
#define EXL_LORA_MAX_OUT 3
typedef struct exl_lora_node {
    float *out[EXL_LORA_MAX_OUT];                      /* [rows, out_features[i]], added to */
    const exl_lora_factors *factors[EXL_LORA_MAX_OUT]; /* backend memory, [n_slots] each */
    int32_t out_features[EXL_LORA_MAX_OUT];
    int32_t n_out;
    const float *x;          /* [rows, in_features] */
    const exl_vector *norm;  /* or NULL */
    const float *up;         /* [rows, in_features] or NULL */
    float eps;               /* norm's */
    int32_t act;             /* up's: as glu's */
    const int32_t *row_uses; /* backend memory, [rows + 1] */
    const int32_t *use_row, *use_slot;
    const float *use_scale;
    const int32_t *by_adapter;
    float *t;
    int32_t rows, in_features, n_uses, max_rank;
} exl_lora_node;

typedef struct exl_node {
    exl_op op;
    exl_node_tag tag;
    union {
        exl_embed_node embed;
        exl_rmsnorm_node rmsnorm;
        exl_matmul_node matmul;
        exl_rope_node rope;
        exl_kv_store_node kv_store;
        exl_attention_node attention;
        exl_glu_node glu;
        exl_add_node add;
        exl_gather_rows_node gather_rows;
        exl_copy_cols_node copy_cols;
        exl_softcap_node softcap;
        exl_row_gate_node row_gate;
        exl_moe_route_node moe_route;
        exl_moe_experts_node moe_experts;
        exl_all_reduce_node all_reduce;
        exl_gather_cols_node gather_cols;
        exl_lora_node lora;
    };
} exl_node;

/* A range of floats in backend memory. */
typedef struct exl_span {
    const float *p;
    int64_t n;
} exl_span;

#define EXL_GRAPH_MAX_OUTPUTS 4

typedef struct exl_graph {
    exl_node *nodes; /* in the order they run */
    int32_t n_nodes, cap_nodes;
    const exl_batch *batch; /* the step's sequences, which kv_store and attention read (NULL: none) */
    exl_span outputs[EXL_GRAPH_MAX_OUTPUTS];
    int32_t n_outputs;
    /* for the generic executor: backend memory of rows x out_features floats for each accumulating matmul,
     * which it computes there before adding it to out (never such a node's x or out), or NULL */
    float *tmp;
    int64_t tmp_floats;
} exl_graph;

/* Building one (graph.c): reset empties it for a new step (keeping its node array); add appends a copy of n;
 * output marks n floats at p as an output. */
void exl_graph_reset(exl_graph *g, const exl_batch *batch);
exl_status exl_graph_add(exl_graph *g, const exl_node *n);
exl_status exl_graph_output(exl_graph *g, const float *p, int64_t n);
void exl_graph_free(exl_graph *g);

/* Called by the generic executor with each matmul's input rows (backend memory, fp32 [rows, in]) before it
 * runs, when set; a failure stops the graph there. */
typedef exl_status (*exl_linear_hook)(void *user, int32_t layer, const exl_linear *w, const float *x, int32_t rows);
/* The generic executor (graph_exec.c): the nodes one after another through be's primitive ops. */
struct exl_backend;
exl_status exl_graph_exec(struct exl_backend *be, const exl_graph *g, exl_linear_hook hook, void *user);

/* What a node reads and writes, each a span of activations (the KV cache, the weights, the batch's tables and a
 * node's own scratch not counted; batch_rows: the rows of the graph's batch; int32 tables such as the experts'
 * ids as spans of as many floats). A node that reads and writes a buffer (accumulate, rope, in place) lists it
 * among both. Inline: backends built apart from the core use it too. */
typedef struct exl_node_access {
    exl_span reads[4], writes[3];
    int32_t n_reads, n_writes;
} exl_node_access;

static inline exl_node_access exl_node_access_of(const exl_node *n, int32_t batch_rows) {
    exl_node_access a;
    a.n_reads = a.n_writes = 0;
#define EXL_READS_(ptr, count) (a.reads[a.n_reads].p = (ptr), a.reads[a.n_reads++].n = (count))
#define EXL_WRITES_(ptr, count) (a.writes[a.n_writes].p = (ptr), a.writes[a.n_writes++].n = (count))
    switch (n->op) {
    case EXL_OP_EMBED: EXL_WRITES_(n->embed.out, (int64_t)n->embed.rows * n->embed.width); break;
    case EXL_OP_RMSNORM:
        EXL_READS_(n->rmsnorm.x, (int64_t)n->rmsnorm.rows * n->rmsnorm.width);
        EXL_WRITES_(n->rmsnorm.out, (int64_t)n->rmsnorm.rows * n->rmsnorm.width);
        break;
    case EXL_OP_MATMUL:
        EXL_READS_(n->matmul.x, (int64_t)n->matmul.rows * n->matmul.in_features);
        if (n->matmul.accumulate)
            EXL_READS_(n->matmul.out, (int64_t)n->matmul.rows * n->matmul.out_features);
        EXL_WRITES_(n->matmul.out, (int64_t)n->matmul.rows * n->matmul.out_features);
        break;
    case EXL_OP_ROPE:
        EXL_READS_(n->rope.x, (int64_t)n->rope.rows * n->rope.n_heads * n->rope.head_dim);
        EXL_WRITES_(n->rope.x, (int64_t)n->rope.rows * n->rope.n_heads * n->rope.head_dim);
        break;
    case EXL_OP_KV_STORE:
        EXL_READS_(n->kv_store.k, (int64_t)batch_rows * n->kv_store.width);
        EXL_READS_(n->kv_store.v, (int64_t)batch_rows * n->kv_store.width);
        break;
    case EXL_OP_ATTENTION: {
        const exl_attn_shape *s = &n->attention.shape;
        EXL_READS_(n->attention.q, (int64_t)batch_rows * s->n_heads * s->head_dim);
        EXL_READS_(n->attention.k, (int64_t)batch_rows * s->n_kv_heads * s->head_dim);
        EXL_READS_(n->attention.v, (int64_t)batch_rows * s->n_kv_heads * s->head_dim);
        EXL_WRITES_(n->attention.out, (int64_t)batch_rows * s->n_heads * s->head_dim);
        break;
    }
    case EXL_OP_GLU:
        EXL_READS_(n->glu.x, (int64_t)n->glu.rows * n->glu.width);
        EXL_READS_(n->glu.up, (int64_t)n->glu.rows * n->glu.width);
        EXL_WRITES_(n->glu.x, (int64_t)n->glu.rows * n->glu.width);
        break;
    case EXL_OP_ADD:
        EXL_READS_(n->add.x, n->add.n);
        EXL_READS_(n->add.y, n->add.n);
        EXL_WRITES_(n->add.x, n->add.n);
        break;
    case EXL_OP_GATHER_ROWS:
        EXL_READS_(n->gather_rows.x, (int64_t)n->gather_rows.x_rows * n->gather_rows.width);
        EXL_WRITES_(n->gather_rows.out, (int64_t)n->gather_rows.n * n->gather_rows.width);
        break;
    case EXL_OP_COPY_COLS:
        EXL_READS_(n->copy_cols.x, (int64_t)n->copy_cols.rows * n->copy_cols.x_width);
        EXL_WRITES_(n->copy_cols.out, (int64_t)n->copy_cols.rows * n->copy_cols.width);
        break;
    case EXL_OP_SOFTCAP:
        EXL_READS_(n->softcap.x, n->softcap.n);
        EXL_WRITES_(n->softcap.x, n->softcap.n);
        break;
    case EXL_OP_ROW_GATE:
        EXL_READS_(n->row_gate.x, (int64_t)n->row_gate.rows * n->row_gate.width);
        EXL_READS_(n->row_gate.g, n->row_gate.rows);
        EXL_WRITES_(n->row_gate.x, (int64_t)n->row_gate.rows * n->row_gate.width);
        break;
    case EXL_OP_MOE_ROUTE: {
        const exl_moe_route_node *r = &n->moe_route;
        EXL_READS_(r->logits, (int64_t)r->rows * r->n_experts);
        EXL_WRITES_(r->weights, (int64_t)r->rows * r->top_k);
        EXL_WRITES_((const float *)(const void *)r->ids, (int64_t)r->rows * r->top_k);
        break;
    }
    case EXL_OP_MOE_EXPERTS: {
        const exl_moe_experts_node *e = &n->moe_experts;
        EXL_READS_(e->x, (int64_t)e->rows * e->width);
        EXL_READS_((const float *)(const void *)e->ids, (int64_t)e->rows * e->top_k);
        EXL_READS_(e->weights, (int64_t)e->rows * e->top_k);
        EXL_READS_(e->out, (int64_t)e->rows * e->width);
        EXL_WRITES_(e->out, (int64_t)e->rows * e->width);
        break;
    }
    case EXL_OP_ALL_REDUCE:
        EXL_READS_(n->all_reduce.x, n->all_reduce.n);
        EXL_WRITES_(n->all_reduce.x, n->all_reduce.n);
        break;
    case EXL_OP_GATHER_COLS: {
        const exl_gather_cols_node *c = &n->gather_cols;
        EXL_READS_(c->x, (int64_t)c->rows * (c->cols[c->rank + 1] - c->cols[c->rank]));
        EXL_WRITES_(c->out, (int64_t)c->rows * c->out_width);
        break;
    }
    case EXL_OP_LORA:
        EXL_READS_(n->lora.x, (int64_t)n->lora.rows * n->lora.in_features);
        if (n->lora.up)
            EXL_READS_(n->lora.up, (int64_t)n->lora.rows * n->lora.in_features);
        for (int32_t o = 0; o < n->lora.n_out && o < EXL_LORA_MAX_OUT; o++) {
            EXL_READS_(n->lora.out[o], (int64_t)n->lora.rows * n->lora.out_features[o]);
            EXL_WRITES_(n->lora.out[o], (int64_t)n->lora.rows * n->lora.out_features[o]);
        }
        break;
    }
#undef EXL_READS_
#undef EXL_WRITES_
    return a;
}

/* 1 if two spans share a float */
static inline int exl_spans_overlap(exl_span a, exl_span b) {
    return a.n > 0 && b.n > 0 && a.p < b.p + b.n && b.p < a.p + a.n;
}

#endif
