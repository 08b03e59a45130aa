/* tp_load.c - loading a model over tensor-parallel ranks (tp.h): each rank, on its own thread and backend, loads
 * the embedding, the norms and the routers whole, and its shard (shard.h) of every other linear:
 *   q, k, v by output rows (the rank's heads; its KV heads, or the one its heads share when there are fewer KV
 *   heads than ranks), o_proj by input (the same heads), or, where its EXL2 rows do not follow the heads (an
 *   act-order permutation across them), by output columns over the gathered attention;
 *   down_proj by input where the format allows a split (EXL2 whole groups of its permuted rows, GPTQ whole groups
 *   or words), gate and up by the same columns, so that each rank's GLU gives its down_proj's input;
 *   each expert of a mixture of experts like a dense MLP (every rank holds every expert's part);
 *   the head by vocabulary. */
#include "model/tp.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define TP_MAX_RANKS 16

/* n + 1 boundaries of [0, total) in near-equal parts, multiples of unit where total allows it */
static exl_status split_cols(int64_t total, int32_t n, int64_t unit, int32_t **out) {
    if (!(*out = exl_malloc((size_t)(n + 1) * sizeof(int32_t))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (total % (unit * n))
        unit = 1;
    for (int32_t k = 0; k <= n; k++)
        (*out)[k] = (int32_t)(total / unit * k / n * unit);
    return EXL_OK;
}

/* the ascending integers [lo, hi) into a new array */
static int32_t *range(int64_t lo, int64_t hi) {
    int32_t *r = exl_malloc((size_t)(hi > lo ? hi - lo : 1) * sizeof(int32_t));
    for (int64_t i = lo; r && i < hi; i++)
        r[i - lo] = (int32_t)i;
    return r;
}

/* ---- one rank's layers */

typedef struct rank_load {
    const exl_model_params *p;
    const char *prefix; /* the text model's tensors */
} rank_load;

static exl_tp_rank *rank_of(exl_model *m) { return &m->tp->ranks[m->rank]; }

/* src's output columns cols[0 .. n) as the rank's linear */
static exl_status add_cols(exl_model *m, const exl_linear_src *src, const int32_t *cols, int32_t n, exl_linear **w) {
    exl_linear_src part;
    EXL_TRY(exl_shard_cols(src, cols, n, &rank_of(m)->mem, &part));
    return exl_model_linear_add(m, &part, w);
}

static exl_status add_rows(exl_model *m, const exl_linear_src *src, const int32_t *features, int32_t n,
                           exl_linear **w) {
    exl_linear_src part;
    EXL_TRY(exl_shard_rows(src, features, n, m->rank == 0, &rank_of(m)->mem, &part));
    return exl_model_linear_add(m, &part, w);
}

/* The rank's KV heads: [*first, *first + *count). */
static void kv_heads(const exl_tp *tp, int32_t rank, int32_t *first, int32_t *count) {
    const exl_hf_config *c = &tp->full;
    if (c->n_kv_heads % tp->n == 0) {
        *count = c->n_kv_heads / tp->n;
        *first = rank * *count;
    } else { /* fewer KV heads than ranks: the one the rank's query heads share */
        *count = 1;
        *first = rank * (c->n_heads / tp->n) / (c->n_heads / c->n_kv_heads);
    }
}

static exl_status load_attention(exl_model *m, const char *lp, int32_t li) {
    exl_tp *tp = m->tp;
    const exl_hf_config *c = &tp->full;
    exl_layer *l = &m->layers[li];
    char name[512];
    int64_t hd = c->head_dim, q_all = (int64_t)c->n_heads * hd, kv_all = (int64_t)c->n_kv_heads * hd;
    int32_t q0 = tp->attn_cols[m->rank], q1 = tp->attn_cols[m->rank + 1], kv0, kvn;
    kv_heads(tp, m->rank, &kv0, &kvn);
    int32_t nq = q1 - q0, nkv = kvn * (int32_t)hd;
    int32_t *cols = exl_malloc((size_t)(nq + 2 * nkv) * sizeof(int32_t));
    if (!cols)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; i < nq; i++)
        cols[i] = q0 + i;
    for (int32_t i = 0; i < nkv; i++) {
        cols[nq + i] = (int32_t)(q_all + kv0 * hd + i);
        cols[nq + nkv + i] = (int32_t)(q_all + kv_all + kv0 * hd + i);
    }
    exl_linear_src src;
    exl_status st;
    if (c->fused_qkv) {
        snprintf(name, sizeof name, "%sself_attn.qkv_proj", lp);
        st = exl_model_linear_find(m, name, c->hidden_size, q_all + 2 * kv_all, c->qkv_bias, &src);
        if (st == EXL_OK)
            st = add_cols(m, &src, cols, nq + 2 * nkv, &l->qkv);
    } else {
        static const char *const parts[3] = {"q_proj", "k_proj", "v_proj"};
        exl_linear **ws[3] = {&l->q, &l->k, &l->v};
        st = EXL_OK;
        for (int i = 0; i < 3 && st == EXL_OK; i++) {
            snprintf(name, sizeof name, "%sself_attn.%s", lp, parts[i]);
            st = exl_model_linear_find(m, name, c->hidden_size, i ? kv_all : q_all, c->qkv_bias, &src);
            if (st == EXL_OK) /* k and v columns relative to their own matrix */
                for (int32_t j = 0; i && j < nkv; j++)
                    cols[nq + j] = (int32_t)(kv0 * hd + j);
            if (st == EXL_OK)
                st = add_cols(m, &src, i ? cols + nq : cols, i ? nkv : nq, ws[i]);
        }
    }
    if (st == EXL_OK) {
        snprintf(name, sizeof name, "%sself_attn.o_proj", lp);
        st = exl_model_linear_find(m, name, q_all, c->hidden_size, c->o_bias, &src);
    }
    if (st == EXL_OK) {
        exl_tp_layer *tl = &rank_of(m)->layers[li];
        /* every rank decides alike: o_proj by input where each rank's heads make whole parts of it */
        tl->o_gather = 0;
        for (int32_t k = 0; k < tp->n && !tl->o_gather; k++) {
            int32_t *f = range(tp->attn_cols[k], tp->attn_cols[k + 1]);
            if (!f) {
                st = exl_fail(EXL_ERR_NOMEM, "out of memory");
                break;
            }
            tl->o_gather = src.kind == EXL_LINEAR_EXL2 &&
                           !exl_shard_rows_fit(&src, f, tp->attn_cols[k + 1] - tp->attn_cols[k]);
            exl_free(f);
        }
        if (st == EXL_OK && tl->o_gather) {
            int32_t h0 = tp->hidden_cols[m->rank], h1 = tp->hidden_cols[m->rank + 1];
            int32_t *f = range(h0, h1);
            st = f ? add_cols(m, &src, f, h1 - h0, &l->o) : exl_fail(EXL_ERR_NOMEM, "out of memory");
            exl_free(f);
        } else if (st == EXL_OK) {
            st = add_rows(m, &src, cols, nq, &l->o);
        }
    }
    exl_free(cols);
    EXL_TRY(st);
    if (c->qk_norm) {
        snprintf(name, sizeof name, "%sself_attn.q_norm.weight", lp);
        EXL_TRY(exl_model_load_norm(m, name, hd, &l->q_norm));
        snprintf(name, sizeof name, "%sself_attn.k_norm.weight", lp);
        EXL_TRY(exl_model_load_norm(m, name, hd, &l->k_norm));
    }
    return EXL_OK;
}

/* A gated MLP of width ffn under prefix (names: gate, up, down; or fused gate_up): down_proj split where its
 * format allows, gate and up by the same columns. *width: the rank's part of ffn. */
static exl_status load_gated(exl_model *m, const char *prefix, const char *const names[3], int64_t ffn, int bias,
                             int fused, exl_expert *e, exl_linear **gate_up, int32_t *width) {
    const exl_hf_config *c = &m->tp->full;
    char name[512];
    exl_linear_src down, src;
    snprintf(name, sizeof name, "%s%s", prefix, names[2]);
    EXL_TRY(exl_model_linear_find(m, name, ffn, c->hidden_size, bias, &down));
    int32_t *f, n;
    EXL_TRY(exl_shard_plan_rows(&down, m->rank, m->tp->n, &f, &n));
    int32_t *cols = exl_malloc((size_t)2 * n * sizeof(int32_t));
    exl_status st = cols ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK)
        st = add_rows(m, &down, f, n, &e->down);
    if (st == EXL_OK && fused) {
        for (int32_t i = 0; i < n; i++)
            cols[i] = f[i], cols[n + i] = (int32_t)(ffn + f[i]);
        snprintf(name, sizeof name, "%sgate_up_proj", prefix);
        st = exl_model_linear_find(m, name, c->hidden_size, 2 * ffn, bias, &src);
        if (st == EXL_OK)
            st = add_cols(m, &src, cols, 2 * n, gate_up);
    }
    for (int i = 0; i < 2 && st == EXL_OK && !fused; i++) {
        snprintf(name, sizeof name, "%s%s", prefix, names[i]);
        st = exl_model_linear_find(m, name, c->hidden_size, ffn, bias, &src);
        if (st == EXL_OK)
            st = add_cols(m, &src, f, n, i ? &e->up : &e->gate);
    }
    exl_free(cols);
    exl_free(f);
    *width = n;
    return st;
}

static const char *const proj_names[3] = {"gate_proj", "up_proj", "down_proj"};
static const char *const mixtral_names[3] = {"w1", "w3", "w2"};

static exl_status load_mlp(exl_model *m, const char *lp, int32_t li) {
    const exl_hf_config *c = &m->tp->full;
    exl_layer *l = &m->layers[li];
    exl_tp_layer *tl = &rank_of(m)->layers[li];
    char prefix[400], name[512];
    if (!c->layers[li].moe) {
        snprintf(prefix, sizeof prefix, "%smlp.", lp);
        exl_expert e = {0};
        exl_status st = load_gated(m, prefix, proj_names, c->intermediate_size, c->mlp_bias, c->fused_gate_up, &e,
                                   &l->gate_up, &tl->ffn);
        l->gate = e.gate, l->up = e.up, l->down = e.down;
        if (tl->ffn > m->cfg.intermediate_size)
            m->cfg.intermediate_size = tl->ffn;
        return st;
    }
    int mixtral = c->arch == EXL_ARCH_MIXTRAL;
    snprintf(prefix, sizeof prefix, "%s%s", lp, mixtral ? "block_sparse_moe." : "mlp.");
    snprintf(name, sizeof name, "%sgate", prefix);
    EXL_TRY(exl_model_load_linear(m, name, c->hidden_size, c->moe.n_experts, 0, &l->router));
    if (!(l->experts = exl_calloc((size_t)c->moe.n_experts, sizeof *l->experts)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t x = 0; x < c->moe.n_experts; x++) {
        char expert[448];
        int32_t w;
        snprintf(expert, sizeof expert, "%sexperts.%d.", prefix, x);
        EXL_TRY(load_gated(m, expert, mixtral ? mixtral_names : proj_names, c->moe.expert_ffn, 0, 0, &l->experts[x],
                           NULL, &w));
        if (x > 0 && w != tl->ffn)
            return exl_fail(EXL_ERR_UNSUPPORTED,
                            "%s: tensor parallelism splits the experts of layer %d unevenly (%d and %d columns on "
                            "rank %d): their quantization groups differ",
                            expert, li, tl->ffn, w, m->rank);
        tl->ffn = w;
    }
    if (tl->ffn > m->cfg.moe.expert_ffn)
        m->cfg.moe.expert_ffn = tl->ffn;
    if (!c->moe.shared_ffn)
        return EXL_OK;
    snprintf(name, sizeof name, "%sshared_expert.", prefix);
    int32_t w;
    EXL_TRY(load_gated(m, name, proj_names, c->moe.shared_ffn, 0, 0, &l->shared, NULL, &w));
    m->cfg.moe.shared_ffn = w; /* the same split in every layer: its groups are the checkpoint's */
    snprintf(name, sizeof name, "%sshared_expert_gate", prefix);
    return exl_model_load_linear(m, name, c->hidden_size, 1, 0, &l->shared_gate);
}

static exl_status load_norms(exl_model *m, const char *lp, exl_layer *l) {
    char name[512];
    snprintf(name, sizeof name, "%sinput_layernorm.weight", lp);
    EXL_TRY(exl_model_load_norm(m, name, m->cfg.hidden_size, &l->attn_norm));
    snprintf(name, sizeof name, "%spost_attention_layernorm.weight", lp);
    if (!m->cfg.sandwich_norms)
        return exl_model_load_norm(m, name, m->cfg.hidden_size, &l->mlp_norm);
    EXL_TRY(exl_model_load_norm(m, name, m->cfg.hidden_size, &l->post_attn_norm));
    snprintf(name, sizeof name, "%spre_feedforward_layernorm.weight", lp);
    EXL_TRY(exl_model_load_norm(m, name, m->cfg.hidden_size, &l->mlp_norm));
    snprintf(name, sizeof name, "%spost_feedforward_layernorm.weight", lp);
    return exl_model_load_norm(m, name, m->cfg.hidden_size, &l->post_mlp_norm);
}

/* the embedding whole, the head's slice of the vocabulary */
static exl_status load_ends(exl_model *m, const char *prefix) {
    exl_tp *tp = m->tp;
    const exl_hf_config *c = &tp->full;
    exl_linear_src src;
    char name[128];
    EXL_TRY(exl_model_embedding_source(m, prefix, &src));
    snprintf(name, sizeof name, "%sembed_tokens", prefix);
    src.name = name;
    EXL_TRY(m->be->ops->linear_init(m->be, &src, &m->embed));
    m->embed_scale = c->norm_plus_one ? sqrtf((float)c->hidden_size) : 1.0f;
    const char *head = exl_model_head_name(m->weights);
    if (head) {
        EXL_TRY(exl_model_linear_find(m, head, c->hidden_size, c->vocab_size, 0, &src));
    } else if (!c->tie_embeddings) {
        return exl_fail(EXL_ERR_FORMAT, "%s: missing tensor 'lm_head.weight' (tie_word_embeddings is false)", m->dir);
    } else {
        src.name = "lm_head";
    }
    int32_t v0 = tp->vocab_cols[m->rank], v1 = tp->vocab_cols[m->rank + 1];
    int32_t *cols = range(v0, v1);
    if (!cols)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_linear_src part;
    exl_status st = exl_shard_cols(&src, cols, v1 - v0, &rank_of(m)->mem, &part);
    exl_free(cols);
    if (st == EXL_OK)
        st = head ? exl_model_linear_add(m, &part, &m->head) : m->be->ops->linear_init(m->be, &part, &m->head);
    EXL_TRY(st);
    snprintf(name, sizeof name, "%snorm.weight", prefix);
    return exl_model_load_norm(m, name, c->hidden_size, &m->final_norm);
}

/* the rank's buffers beyond the model's own (tp.h) */
static exl_status alloc_buffers(exl_model *m) {
    exl_tp *tp = m->tp;
    exl_tp_rank *r = rank_of(m);
    size_t R = (size_t)m->fs.max_rows, hid = (size_t)tp->full.hidden_size, q_all = (size_t)tp->attn_cols[tp->n];
    size_t wide = hid > q_all ? hid : q_all, part = (size_t)(tp->hidden_cols[m->rank + 1] - tp->hidden_cols[m->rank]);
    exl_backend *be = m->be;
    float *zeros = exl_calloc(R * hid, sizeof(float));
    if (!zeros)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = EXL_OK;
    if (!(r->partial = be->ops->alloc(be, R * wide * sizeof(float))) ||
        !(r->zeros = be->ops->alloc(be, R * hid * sizeof(float))) ||
        !(r->wide = be->ops->alloc(be, R * q_all * sizeof(float))) ||
        !(r->part = be->ops->alloc(be, R * part * sizeof(float))))
        st = exl_fail_prefix(EXL_ERR_NOMEM, "tensor-parallel buffers");
    if (st == EXL_OK)
        st = be->ops->upload(be, r->zeros, zeros, R * hid * sizeof(float));
    exl_free(zeros);
    return st;
}

int exl_tp_rank_threads(const exl_tp *tp, const exl_model_params *p) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    int threads = p->n_threads > 0 ? p->n_threads / tp->n : (int)(cores / tp->n);
    return threads > 0 ? threads : 1;
}

static exl_status load_rank(exl_model *m, void *arg) {
    const rank_load *a = arg;
    exl_tp *tp = m->tp;
    EXL_TRY(exl_backend_init_ordinal(a->p->device, m->rank, exl_tp_rank_threads(tp, a->p), &m->be));
    int32_t kvn, kv0;
    kv_heads(tp, m->rank, &kv0, &kvn);
    m->cfg.n_heads = tp->full.n_heads / tp->n;
    m->cfg.n_kv_heads = kvn;
    m->cfg.intermediate_size = 1;
    m->cfg.moe.expert_ffn = 1;
    EXL_TRY(load_ends(m, a->prefix));
    if (!(m->layers = exl_calloc((size_t)m->cfg.n_layers, sizeof *m->layers)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        char lp[256];
        snprintf(lp, sizeof lp, "%slayers.%d.", a->prefix, i);
        EXL_TRY(load_norms(m, lp, &m->layers[i]));
        EXL_TRY(load_attention(m, lp, i));
        EXL_TRY(load_mlp(m, lp, i));
    }
    EXL_TRY(exl_model_alloc_forward(m));
    return alloc_buffers(m);
}

/* ---- the ranks */

static exl_status check_split(const exl_model *m, int32_t n) {
    const exl_hf_config *c = &m->cfg;
    if (n < 1 || n > TP_MAX_RANKS)
        return exl_fail(EXL_ERR_ARG, "--tp %d: between 1 and %d devices", n, TP_MAX_RANKS);
    if (c->n_heads % n)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: --tp %d cannot split %d attention heads evenly", m->dir, n,
                        c->n_heads);
    if (c->n_kv_heads % n && n % c->n_kv_heads)
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: --tp %d cannot split %d KV heads evenly, nor give each device one of them whole", m->dir,
                        n, c->n_kv_heads);
    if (c->vocab_size < n || c->hidden_size < n)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: --tp %d: the model is too small to split", m->dir, n);
    return EXL_OK;
}

static exl_status make_ranks(exl_model *m, int32_t n) {
    exl_tp *tp = exl_calloc(1, sizeof *tp);
    if (!tp)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    m->tp = tp;
    tp->n = n;
    tp->full = m->cfg;
    const char *no_comm = getenv("EXL_TP_NO_COMM");
    tp->no_comm = no_comm && !strcmp(no_comm, "1");
    pthread_mutex_init(&tp->lock, NULL);
    pthread_cond_init(&tp->cond, NULL);
    if (!(tp->ranks = exl_calloc((size_t)n, sizeof *tp->ranks)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    tp->ranks[0].m = m;
    const exl_hf_config *c = &m->cfg;
    EXL_TRY(split_cols(c->vocab_size, n, 32, &tp->vocab_cols));
    EXL_TRY(split_cols((int64_t)c->n_heads * c->head_dim, n, c->head_dim, &tp->attn_cols));
    EXL_TRY(split_cols(c->hidden_size, n, 32, &tp->hidden_cols));
    for (int32_t k = 0; k < n; k++) {
        exl_model *r = k ? exl_calloc(1, sizeof *r) : m;
        if (!r)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        tp->ranks[k].m = r;
        if (k) {
            r->dir = m->dir; /* borrowed from rank 0, like the weights */
            r->cfg = m->cfg;
            r->weights = m->weights;
            r->rot_dim = m->rot_dim;
            r->tp = tp;
            r->rank = k;
        }
        if (!(tp->ranks[k].layers = exl_calloc((size_t)c->n_layers, sizeof *tp->ranks[k].layers)))
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    return exl_tp_start_workers(tp);
}

static int32_t split_devices(const exl_model_params *p) {
    int32_t n = 0;
    while (n < EXL_MAX_GPU_SPLIT && p->gpu_split[n] > 0)
        n++;
    return n;
}

exl_status exl_tp_load(exl_model *m, const exl_model_params *p) {
    int32_t layer_split = split_devices(p);
    if (layer_split && p->tp > 1)
        return exl_fail(EXL_ERR_UNSUPPORTED, "--gpu-split and --tp together are not supported yet");
    rank_load a = {p, exl_model_text_prefix(m->weights)};
    if (layer_split) {
        if (layer_split < 2)
            return exl_fail(EXL_ERR_ARG, "--gpu-split: give the share of at least two devices");
        EXL_TRY(make_ranks(m, layer_split));
        EXL_TRY(exl_tp_split_load(m, p, a.prefix));
    } else {
        EXL_TRY(check_split(m, p->tp));
        EXL_TRY(make_ranks(m, p->tp));
        EXL_TRY(exl_tp_each(m, load_rank, &a));
    }
    exl_tp *tp = m->tp;
    exl_backend *bes[TP_MAX_RANKS];
    for (int32_t k = 0; k < tp->n; k++) {
        bes[k] = tp->ranks[k].m->be;
        if (strcmp(bes[k]->name, bes[0]->name))
            return exl_fail(EXL_ERR_DEVICE, "--tp %d: rank %d runs on the %s, rank 0 on the %s (too few GPUs?)", tp->n,
                            k, bes[k]->name, bes[0]->name);
    }
    if (!bes[0]->ops->comm_init)
        return exl_fail(EXL_ERR_UNSUPPORTED, "the %s backend has no tensor parallelism", bes[0]->name);
    EXL_TRY(bes[0]->ops->comm_init(bes, tp->n));
    pthread_mutex_lock(&tp->lock);               /* the workers read it under the lock */
    tp->spin = strcmp(bes[0]->name, "cpu") != 0; /* CPU ranks' threads are the compute's own */
    pthread_mutex_unlock(&tp->lock);
    return EXL_OK;
}

/* ---- freeing */

static void free_buffers(exl_model *m) {
    exl_tp_rank *r = rank_of(m);
    float *bufs[] = {r->partial, r->zeros, r->wide, r->part, r->head_part};
    for (size_t i = 0; m->be && i < sizeof bufs / sizeof bufs[0]; i++)
        if (bufs[i])
            m->be->ops->free(m->be, bufs[i]);
    r->partial = r->zeros = r->wide = r->part = r->head_part = NULL;
}

/* a rank k >= 1: its model; rank 0: the buffers (the model frees the rest) */
static exl_status free_rank(exl_model *m, void *arg) {
    (void)arg;
    free_buffers(m);
    if (m->rank == 0)
        return EXL_OK;
    exl_backend *be = m->be;
    if (be) {
        exl_model_free_forward(m);
        for (int32_t i = 0; m->layers && i < m->cfg.n_layers; i++)
            exl_model_free_layer(m, &m->layers[i]);
        be->ops->linear_free(be, m->embed);
        be->ops->linear_free(be, m->head);
        be->ops->vector_free(be, m->final_norm);
        be->ops->destroy(be);
        m->be = NULL;
    }
    exl_free(m->layers);
    exl_free(m->linears);
    m->layers = NULL;
    m->linears = NULL;
    return EXL_OK;
}

void exl_tp_free_ranks(exl_model *m) {
    exl_tp *tp = m->tp;
    if (!tp || !tp->ranks)
        return;
    exl_tp_each(m, free_rank, NULL);
    pthread_mutex_lock(&tp->lock);
    tp->quit = 1;
    pthread_cond_broadcast(&tp->cond);
    pthread_mutex_unlock(&tp->lock);
    for (int32_t k = 1; k < tp->n; k++) {
        exl_tp_rank *r = &tp->ranks[k];
        if (r->has_thread)
            pthread_join(r->thread, NULL);
        r->has_thread = 0;
        if (r->m)
            free_rank(r->m, NULL); /* a rank whose thread never started */
    }
}

void exl_tp_free_last(exl_model *m) {
    exl_tp *tp = m->tp;
    if (!tp)
        return;
    for (int32_t k = 0; tp->ranks && k < tp->n; k++) {
        exl_tp_rank *r = &tp->ranks[k];
        exl_shard_mem_free(&r->mem);
        exl_free(r->layers);
        if (k)
            exl_free(r->m);
    }
    exl_free(tp->ranks);
    exl_free(tp->vocab_cols);
    exl_free(tp->attn_cols);
    exl_free(tp->hidden_cols);
    exl_free(tp->layer_bounds);
    exl_free(tp->send_hidden);
    exl_free(tp->send_vocab);
    pthread_mutex_destroy(&tp->lock);
    pthread_cond_destroy(&tp->cond);
    exl_free(tp);
    m->tp = NULL;
}
