/* tp_split.c - the layer split (--gpu-split, tp.h): which decoder layers each device holds (by their tensors' bytes
 * against each device's share), loading a rank's whole layers (rank 0 the embedding, the last rank the head), and a
 * rank's step: its layers between the hand-overs of the hidden states, the logits handed back to rank 0. */
#include "model/tp.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/notice.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- loading: whole layers on each rank */

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define GIB (1024.0 * 1024.0 * 1024.0)
#define PROGRESS_EVERY_S 5.0 /* a loading rank's notice at most this often */
#define PROGRESS_QUIET_S 1.0 /* and when it is done, if it took this long */

/* What the devices of a layer split hold, by the tensors' bytes. */
typedef struct split_bytes {
    uint64_t *layer; /* [n_layers] */
    uint64_t first;  /* the first device's other tensors: the embedding */
    uint64_t last;   /* the last one's: the head and the final norm (and the embedding again for a tied head) */
} split_bytes;

typedef struct rank_load {
    const exl_model_params *p;
    const char *prefix; /* the text model's tensors */
    const split_bytes *bytes;
} rank_load;

/* the bytes of rank k's tensors */
static uint64_t rank_bytes(const exl_tp *tp, const split_bytes *b, int32_t k) {
    uint64_t sum = (k == 0 ? b->first : 0) + (k == tp->n - 1 ? b->last : 0);
    for (int32_t i = tp->layer_bounds[k]; i < tp->layer_bounds[k + 1]; i++)
        sum += b->layer[i];
    return sum;
}

/* refused before loading where the device's free memory cannot hold its share of the weights (rather than out of
 * memory at some layer) */
static exl_status check_room(exl_model *m, uint64_t bytes) {
    size_t free_b = 0, total_b = 0;
    if (!m->be->ops->memory || m->be->ops->memory(m->be, &free_b, &total_b) != EXL_OK || bytes <= free_b)
        return EXL_OK;
    const exl_tp *tp = m->tp;
    return exl_fail(
        EXL_ERR_NOMEM,
        "--gpu-split: device %d gets %.2f GiB of weights (decoder layers %d..%d%s) but has %.2f of %.2f GiB "
        "free: give it a smaller share (the rest of the device also holds the KV cache and scratch)",
        m->rank, (double)bytes / GIB, tp->layer_bounds[m->rank], tp->layer_bounds[m->rank + 1] - 1,
        m->rank == 0           ? ", the embedding"
        : m->rank == tp->n - 1 ? ", the head"
                               : "",
        (double)free_b / GIB, (double)total_b / GIB);
}

static exl_status load_rank_layers(exl_model *m, void *arg) {
    const rank_load *a = arg;
    exl_tp *tp = m->tp;
    int32_t last = tp->n - 1;
    EXL_TRY(exl_backend_init_ordinal(a->p->device, m->rank, exl_tp_rank_threads(tp, a->p), &m->be));
    EXL_TRY(check_room(m, rank_bytes(tp, a->bytes, m->rank)));
    const exl_hf_config *c = &m->cfg;
    exl_linear_src src;
    char name[128];
    if (m->rank == 0) {
        EXL_TRY(exl_model_embedding_source(m, a->prefix, &src));
        snprintf(name, sizeof name, "%sembed_tokens", a->prefix);
        src.name = name;
        EXL_TRY(m->be->ops->linear_init(m->be, &src, &m->embed));
        m->embed_scale = c->norm_plus_one ? sqrtf((float)c->hidden_size) : 1.0f;
    }
    if (m->rank == last) {
        const char *head = exl_model_head_name(m->weights);
        if (head) {
            EXL_TRY(exl_model_load_linear(m, head, c->hidden_size, c->vocab_size, 0, &m->head));
        } else {
            if (!c->tie_embeddings)
                return exl_fail(EXL_ERR_FORMAT, "%s: missing tensor 'lm_head.weight' (tie_word_embeddings is false)",
                                m->dir);
            EXL_TRY(exl_model_embedding_source(m, a->prefix, &src));
            src.name = "lm_head";
            EXL_TRY(m->be->ops->linear_init(m->be, &src, &m->head));
        }
        snprintf(name, sizeof name, "%snorm.weight", a->prefix);
        EXL_TRY(exl_model_load_norm(m, name, c->hidden_size, &m->final_norm));
    }
    if (!(m->layers = exl_calloc((size_t)c->n_layers, sizeof *m->layers)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    const int32_t lo = tp->layer_bounds[m->rank], hi = tp->layer_bounds[m->rank + 1];
    const double start = seconds_now();
    double told = start;
    for (int32_t i = lo; i < hi; i++) {
        EXL_TRY(exl_model_load_layer(m, a->prefix, i));
        const double now = seconds_now();
        if (now - told >= PROGRESS_EVERY_S && i + 1 < hi) {
            exl_notice("--gpu-split: device %d: %d of its %d decoder layers loaded (%.0f s)", m->rank, i + 1 - lo,
                       hi - lo, now - start);
            told = now;
        }
    }
    EXL_TRY(exl_model_alloc_forward(m));
    const double took = seconds_now() - start;
    if (took >= PROGRESS_QUIET_S) /* a small model's load stays quiet */
        exl_notice("--gpu-split: device %d: decoder layers %d..%d loaded, %.2f GiB of weights, in %.1f s", m->rank, lo,
                   hi - 1, (double)rank_bytes(tp, a->bytes, m->rank) / GIB, took);
    return EXL_OK;
}

/* b's bytes (b->layer zeroed, [n_layers]); tensors of no device (another model's, such as a vision tower) left out */
static void layer_bytes(const exl_model *m, const char *prefix, split_bytes *b) {
    const size_t plen = strlen(prefix);
    const char *head = exl_model_head_name(m->weights);
    const size_t hlen = head ? strlen(head) : 0;
    b->first = b->last = 0;
    for (int f = 0; f < m->weights->n_files; f++)
        for (int t = 0; t < m->weights->files[f]->n_tensors; t++) {
            const exl_st_tensor *x = &m->weights->files[f]->tensors[t];
            const char *name = x->name + plen;
            char *end;
            if (head && !strncmp(x->name, head, hlen) && (!x->name[hlen] || x->name[hlen] == '.')) {
                b->last += x->nbytes;
                continue;
            }
            if (strncmp(x->name, prefix, plen))
                continue;
            if (!strncmp(name, "layers.", 7)) {
                long i = strtol(name + 7, &end, 10);
                if (end != name + 7 && *end == '.' && i >= 0 && i < m->cfg.n_layers)
                    b->layer[i] += x->nbytes;
            } else if (!strncmp(name, "embed_tokens", 12)) {
                b->first += x->nbytes;
            } else {
                b->last += x->nbytes; /* the final norm */
            }
        }
    if (!head) /* the head is the embedding (the loader refuses an untied model without one) */
        for (int f = 0; f < m->weights->n_files; f++)
            for (int t = 0; t < m->weights->files[f]->n_tensors; t++) {
                const exl_st_tensor *x = &m->weights->files[f]->tensors[t];
                if (!strncmp(x->name, prefix, plen) && !strncmp(x->name + plen, "embed_tokens", 12))
                    b->last += x->nbytes;
            }
}

/* Layers in order onto the devices: each takes layers while its share (GiB of weights) holds them; the embedding
 * counts on the first, the head on the last. */
static exl_status plan_layers(exl_model *m, const exl_model_params *p, const split_bytes *sb, int32_t n) {
    exl_tp *tp = m->tp;
    if (!(tp->layer_bounds = exl_calloc((size_t)n + 1, sizeof(int32_t))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    double used = (double)sb->first;
    int32_t d = 0;
    for (int32_t i = 0; i < m->cfg.n_layers; i++) {
        while (d < n - 1 && used + (double)sb->layer[i] > p->gpu_split[d] * GIB) {
            tp->layer_bounds[++d] = i;
            used = d == n - 1 ? (double)sb->last : 0;
        }
        used += (double)sb->layer[i];
    }
    if (d < n - 1) /* the layers all fit before the last device: it holds the head alone */
        used = (double)sb->last;
    for (int32_t k = d + 1; k <= n; k++)
        tp->layer_bounds[k] = m->cfg.n_layers;
    if (used > p->gpu_split[n - 1] * GIB)
        return exl_fail(EXL_ERR_NOMEM,
                        "%s: --gpu-split: the model needs %.1f MiB more than the split gives its devices", m->dir,
                        (used - p->gpu_split[n - 1] * GIB) / (1024.0 * 1024.0));
    char text[512];
    int len = snprintf(text, sizeof text, "--gpu-split: decoder layers");
    for (int32_t k = 0; k < n && len > 0 && (size_t)len < sizeof text; k++) {
        int32_t a = tp->layer_bounds[k], b = tp->layer_bounds[k + 1];
        len += a < b ? snprintf(text + len, sizeof text - (size_t)len, "%s %d..%d on device %d", k ? "," : "", a, b - 1,
                                k)
                     : snprintf(text + len, sizeof text - (size_t)len, "%s none on device %d", k ? "," : "", k);
    }
    exl_notice("%s", text);
    return EXL_OK;
}

/* the columns that make rank j own every one of width: [j] * (n + 1) for each sender j, and the last rank's */
static exl_status sender_cols(int32_t n, int32_t width, int32_t senders, int32_t first, int32_t **out) {
    if (!(*out = exl_malloc((size_t)senders * (n + 1) * sizeof(int32_t))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t s = 0; s < senders; s++)
        for (int32_t k = 0; k <= n; k++)
            (*out)[s * (n + 1) + k] = k <= first + s ? 0 : width;
    return EXL_OK;
}

exl_status exl_tp_split_load(exl_model *m, const exl_model_params *p, const char *prefix) {
    exl_tp *tp = m->tp;
    tp->split = 1;
    split_bytes b = {exl_calloc((size_t)m->cfg.n_layers, sizeof(uint64_t)), 0, 0};
    if (!b.layer)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    layer_bytes(m, prefix, &b);
    exl_status st = plan_layers(m, p, &b, tp->n);
    if (st == EXL_OK)
        st = sender_cols(tp->n, m->cfg.hidden_size, tp->n - 1, 0, &tp->send_hidden);
    if (st == EXL_OK)
        st = sender_cols(tp->n, m->cfg.vocab_size, 1, tp->n - 1, &tp->send_vocab);
    rank_load a = {p, prefix, &b};
    if (st == EXL_OK)
        st = exl_tp_each(m, load_rank_layers, &a);
    exl_free(b.layer);
    return st;
}

/* ---- running */

int exl_tp_holds_layer(const exl_model *m, int32_t li) {
    const exl_tp *tp = m->tp;
    return !tp || !tp->split || (li >= tp->layer_bounds[m->rank] && li < tp->layer_bounds[m->rank + 1]);
}

/* The logits' staging room of rank m (the gather's, on a device that stages), before the step launches anything:
 * every host allocation of a split's step comes before its first collective (see exl_tp_split_stage). */
exl_status exl_tp_split_prepare(exl_model *m, int32_t n_logits) {
    exl_tp_rank *r = &m->tp->ranks[m->rank];
    exl_graph *g = &m->fs.graph;
    if (!g->cap_nodes) { /* room for a hand-over stage's one node: adding it cannot fail next to a collective */
        const exl_node none = {.op = EXL_OP_EMBED};
        EXL_TRY(exl_graph_add(g, &none));
        g->n_nodes = 0;
    }
    if (n_logits <= r->head_rows)
        return EXL_OK;
    if (r->head_part)
        m->be->ops->free(m->be, r->head_part);
    r->head_part = NULL;
    r->head_rows = 0;
    size_t floats = (size_t)m->fs.max_logit_rows * (size_t)m->cfg.vocab_size;
    if (!(r->head_part = m->be->ops->alloc(m->be, floats * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "--gpu-split: device %d: out of memory for the logits' staging room (%.1f MiB)",
                        m->rank, (double)(floats * sizeof(float)) / (1024.0 * 1024.0));
    r->head_rows = m->fs.max_logit_rows;
    return EXL_OK;
}

/* stage 2j: rank j's own part (rank 0 the embedding first, the last rank the head after); stage 2j + 1: the hand-over
 * of rank j's hidden states to every rank, or after the last rank's part, its logits to every rank */
static exl_status stage_nodes(exl_model *m, const exl_kv_cache *cache, int32_t n_logits, int32_t stage, exl_graph *g) {
    exl_tp *tp = m->tp;
    exl_forward_scratch *s = &m->fs;
    const exl_hf_config *c = &m->cfg;
    const int32_t rows = s->batch.n_rows, hid = c->hidden_size, last = tp->n - 1, j = stage / 2;
    if (stage % 2 && j < last) { /* rank j's hidden states to every rank (h: free between layers, staging room) */
        const exl_node send = {.op = EXL_OP_GATHER_COLS,
                               .tag = {tp->layer_bounds[j + 1], EXL_PART_HEAD_GATHER},
                               .gather_cols = {s->x, s->x, tp->send_hidden + (size_t)j * (tp->n + 1), rows, hid, tp->n,
                                               m->rank, s->h}};
        return exl_graph_add(g, &send);
    }
    if (stage % 2) { /* the logits back from the last rank */
        if (n_logits < 1)
            return EXL_OK;
        const exl_node back = {.op = EXL_OP_GATHER_COLS,
                               .tag = {-1, EXL_PART_HEAD_GATHER},
                               .gather_cols = {s->logits, s->logits, tp->send_vocab, n_logits, c->vocab_size, tp->n,
                                               m->rank, tp->ranks[m->rank].head_part}};
        EXL_TRY(exl_graph_add(g, &back));
        return exl_graph_output(g, s->logits, (int64_t)n_logits * c->vocab_size);
    }
    if (j != m->rank)
        return EXL_OK;
    if (j == 0) {
        const exl_node embed = {.op = EXL_OP_EMBED,
                                .tag = {-1, EXL_PART_EMBED},
                                .embed = {s->x, m->embed, s->batch.d_ids, rows, hid, m->embed_scale}};
        EXL_TRY(exl_graph_add(g, &embed));
    }
    for (int32_t i = tp->layer_bounds[j]; i < tp->layer_bounds[j + 1]; i++)
        EXL_TRY(exl_model_layer_graph(m, &m->layers[i], i, cache, g));
    if (j < last || n_logits < 1)
        return EXL_OK;
    const exl_node head[] = {
        {.op = EXL_OP_GATHER_ROWS,
         .tag = {-1, EXL_PART_LOGIT_ROWS},
         .gather_rows = {s->sel, s->x, s->logit_rows, n_logits, hid, rows}},
        {.op = EXL_OP_RMSNORM,
         .tag = {-1, EXL_PART_FINAL_NORM},
         .rmsnorm = {s->h, s->sel, m->final_norm, n_logits, hid, (float)c->rms_eps}},
        {.op = EXL_OP_MATMUL,
         .tag = {-1, EXL_PART_HEAD},
         .matmul = {s->logits, s->h, m->head, n_logits, hid, c->vocab_size, 0}},
    };
    for (size_t i = 0; i < sizeof head / sizeof head[0]; i++)
        EXL_TRY(exl_graph_add(g, &head[i]));
    if (c->final_softcap > 0) {
        const exl_node cap = {.op = EXL_OP_SOFTCAP,
                              .tag = {-1, EXL_PART_LOGIT_SOFTCAP},
                              .softcap = {s->logits, (int64_t)n_logits * c->vocab_size, (float)c->final_softcap}};
        EXL_TRY(exl_graph_add(g, &cap));
    }
    return EXL_OK;
}

exl_status exl_tp_split_stage(exl_model *m, const exl_kv_cache *cache, int32_t n_logits, int32_t stage) {
    exl_graph *g = &m->fs.graph;
    float *tmp = g->tmp; /* begin_step's, for every stage */
    const int64_t tmp_floats = g->tmp_floats;
    exl_graph_reset(g, &m->fs.batch);
    g->tmp = tmp;
    g->tmp_floats = tmp_floats;
    EXL_TRY(stage_nodes(m, cache, n_logits, stage, g));
    if (!g->n_nodes)
        return EXL_OK;
    EXL_TRY(exl_model_run_graph(m, g, NULL, NULL));
    return m->be->ops->synchronize(m->be);
}
