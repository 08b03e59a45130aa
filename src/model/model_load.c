/* model_load.c - load a model directory: config, mapped weights, backend handles; and describe it. */
#include "model/model.h"
#include "model/tp.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/notice.h"
#include "model/lora.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

exl_model_params exl_model_default_params(void) {
    exl_model_params p = {EXL_DEVICE_AUTO, 0, 0, 0, {0}};
    return p;
}

/* Where the text model's tensors are: "model." in causal LMs; a multimodal checkpoint's as published (and kept by
 * ExLlamaV2) or as transformers 5 saves it. */
static const char *const text_prefixes[] = {"model.", "language_model.model.", "model.language_model."};
static const char *const head_names[] = {"lm_head", "language_model.lm_head"};

const char *exl_model_text_prefix(const exl_weights *w) {
    char name[64];
    for (size_t i = 0; i < sizeof text_prefixes / sizeof text_prefixes[0]; i++) {
        snprintf(name, sizeof name, "%sembed_tokens.weight", text_prefixes[i]);
        if (exl_weights_find(w, name))
            return text_prefixes[i];
    }
    return text_prefixes[0];
}

/* The lm_head tensors' prefix, or NULL when there are none (tied to the embeddings). EXL2 writes a quantized head
 * even for tied models. */
const char *exl_model_head_name(const exl_weights *w) {
    static const char *const suffixes[] = {".weight", ".q_weight", ".qweight"};
    char name[64];
    for (size_t i = 0; i < sizeof head_names / sizeof head_names[0]; i++)
        for (size_t j = 0; j < sizeof suffixes / sizeof suffixes[0]; j++) {
            snprintf(name, sizeof name, "%s%s", head_names[i], suffixes[j]);
            if (exl_weights_find(w, name))
                return head_names[i];
        }
    return NULL;
}

/* The embedding table, a dense [vocab, hidden] linear (src->name NULL). */
exl_status exl_model_embedding_source(const exl_model *m, const char *prefix, exl_linear_src *src) {
    const exl_hf_config *c = &m->cfg;
    const exl_st_tensor *t;
    char name[64];
    snprintf(name, sizeof name, "%sembed_tokens.weight", prefix);
    int64_t shape[2] = {c->vocab_size, c->hidden_size};
    EXL_TRY(exl_weights_get(m->weights, name, EXL_DTYPES_FLOAT, 2, shape, &t));
    *src = (exl_linear_src){.kind = EXL_LINEAR_DENSE,
                            .in_features = c->hidden_size,
                            .out_features = c->vocab_size,
                            .dense = {t->dtype, t->data}};
    return EXL_OK;
}

exl_status exl_model_linear_source(const exl_model *m, const exl_linear *w, const char **prefix, exl_linear_src *src) {
    for (int32_t i = 0; i < m->n_linears; i++)
        if (m->linears[i].w == w) {
            *prefix = m->linears[i].name;
            *src = m->linears[i].src;
            return EXL_OK;
        }
    if (w != m->head) /* a head of its own is a record */
        return exl_fail(EXL_ERR_ARG, "exl_model_linear_source: not a linear the model loaded");
    *prefix = head_names[0];
    return exl_model_embedding_source(m, exl_model_text_prefix(m->weights), src);
}

static exl_status load_embedding(exl_model *m, const char *prefix) {
    const exl_hf_config *c = &m->cfg;
    exl_linear_src src;
    char name[64];
    EXL_TRY(exl_model_embedding_source(m, prefix, &src));
    snprintf(name, sizeof name, "%sembed_tokens", prefix);
    src.name = name;
    EXL_TRY(m->be->ops->linear_init(m->be, &src, &m->embed));
    /* Gemma multiplies embeddings by sqrt(hidden) rounded to the activation dtype. */
    m->embed_scale = c->norm_plus_one ? sqrtf((float)c->hidden_size) : 1.0f;
    const char *head = exl_model_head_name(m->weights);
    if (head)
        return exl_model_load_linear(m, head, c->hidden_size, c->vocab_size, 0, &m->head);
    if (!c->tie_embeddings)
        return exl_fail(EXL_ERR_FORMAT, "%s: missing tensor 'lm_head.weight' (tie_word_embeddings is false)",
                        m->weights->files[0]->path);
    return m->be->ops->linear_init(m->be, &src, &m->head);
}

static exl_status check_config(const exl_model *m) {
    const exl_hf_config *c = &m->cfg;
    if (c->head_dim > 1024)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s/config.json: head_dim %d is larger than exl supports (1024)", m->dir,
                        c->head_dim);
    if (m->rot_dim < 2 || m->rot_dim > c->head_dim)
        return exl_fail(EXL_ERR_FORMAT, "%s/config.json: partial_rotary_factor gives a rotary size of %d", m->dir,
                        m->rot_dim);
    for (int32_t i = 0; i < c->n_layers; i++)
        if (c->layers[i].sliding && ((int32_t)(c->head_dim * c->rope_sliding.partial_rotary_factor) & ~1) != m->rot_dim)
            return exl_fail(EXL_ERR_UNSUPPORTED,
                            "%s/config.json: the sliding layers' partial_rotary_factor differs from the full "
                            "attention layers' (exl takes one rotary size)",
                            m->dir);
    return EXL_OK;
}

static exl_status load_weights(exl_model *m, const exl_model_params *p) {
    EXL_TRY(exl_weights_open(m->dir, &m->weights));
    if ((p->tp > 1 || p->gpu_split[0] > 0) && !p->load_only)
        return exl_tp_load(m, p);
    EXL_TRY(exl_backend_init(p->device, p->n_threads, &m->be));
    const char *prefix = exl_model_text_prefix(m->weights);
    EXL_TRY(load_embedding(m, prefix));
    char name[64];
    snprintf(name, sizeof name, "%snorm.weight", prefix);
    EXL_TRY(exl_model_load_norm(m, name, m->cfg.hidden_size, &m->final_norm));
    if (!(m->layers = exl_calloc((size_t)m->cfg.n_layers, sizeof *m->layers)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; i < m->cfg.n_layers; i++)
        EXL_TRY(exl_model_load_layer(m, prefix, i));
    if (p->load_only)
        return EXL_OK;
    return exl_model_alloc_forward(m);
}

exl_status exl_model_load(const char *dir, const exl_model_params *params, exl_model **out) {
    *out = NULL;
    exl_model_params p = params ? *params : exl_model_default_params();
    exl_model *m = exl_calloc(1, sizeof *m);
    if (!m || !(m->dir = exl_strdup(dir))) {
        exl_free(m);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    exl_status st = exl_hf_config_load(dir, &m->cfg);
    if (st == EXL_OK) {
        m->rot_dim = (int32_t)(m->cfg.head_dim * m->cfg.rope.partial_rotary_factor) & ~1;
        st = check_config(m);
    }
    if (st == EXL_OK && m->cfg.vision_ignored)
        exl_notice("%s: a %s checkpoint: loading its text model only, the vision tower is ignored", dir,
                   m->cfg.model_type);
    if (st == EXL_OK)
        st = load_weights(m, &p);
    if (st != EXL_OK) {
        exl_model_free(m);
        return st;
    }
    *out = m;
    return EXL_OK;
}

void exl_model_free(exl_model *m) {
    if (!m)
        return;
    exl_tp_free_ranks(m);
    exl_backend *be = m->be;
    if (be) {
        exl_lora_state_free(m);
        exl_model_free_forward(m);
        for (int i = 0; m->layers && i < m->cfg.n_layers; i++)
            exl_model_free_layer(m, &m->layers[i]);
        be->ops->linear_free(be, m->embed);
        be->ops->linear_free(be, m->head);
        be->ops->vector_free(be, m->final_norm);
        be->ops->destroy(be);
    }
    exl_free(m->layers);
    exl_free(m->linears);
    exl_tp_free_last(m);
    exl_weights_close(m->weights);
    exl_free(m->dir);
    exl_free(m);
}

void exl_model_describe(const exl_model *m, exl_model_desc *d) {
    const exl_hf_config *c = m->tp ? &m->tp->full : &m->cfg; /* a rank's holds its own part of the heads */
    memset(d, 0, sizeof *d);
    snprintf(d->arch, sizeof d->arch, "%s", c->model_type);
    d->vocab_size = c->vocab_size;
    d->hidden_size = c->hidden_size;
    d->intermediate_size = c->intermediate_size;
    d->n_layers = c->n_layers;
    d->n_heads = c->n_heads;
    d->n_kv_heads = c->n_kv_heads;
    d->head_dim = c->head_dim;
    d->max_position_embeddings = c->max_pos;
    d->bos_token_id = c->bos_token_id;
    d->n_eos_token_ids = c->n_eos;
    memcpy(d->eos_token_ids, c->eos_token_ids, sizeof d->eos_token_ids);
    d->tied_embeddings = c->tie_embeddings;
    snprintf(d->backend, sizeof d->backend, "%s", m->be->name);
    d->max_step_tokens = exl_model_max_rows(m);
    d->file_bytes = m->weights->total_bytes;
    const exl_generation_config *g = &c->gen;
    d->gen_do_sample = g->present ? g->do_sample : -1;
    d->gen_temperature = g->present ? (float)g->temperature : -1;
    d->gen_top_p = g->present ? (float)g->top_p : -1;
    d->gen_min_p = g->present ? (float)g->min_p : -1;
    d->gen_repetition_penalty = g->present ? (float)g->repetition_penalty : -1;
    d->gen_top_k = g->present ? g->top_k : -1;
    /* decode reads every tensor once per token except the embedding rows it gathers;
     * a tied head reads the embedding table as its weight */
    char name[64];
    snprintf(name, sizeof name, "%sembed_tokens.weight", exl_model_text_prefix(m->weights));
    const exl_st_tensor *emb = exl_weights_find(m->weights, name);
    uint64_t tensors = 0;
    for (int f = 0; f < m->weights->n_files; f++)
        for (int i = 0; i < m->weights->files[f]->n_tensors; i++)
            tensors += m->weights->files[f]->tensors[i].nbytes;
    d->decode_bytes = tensors - (emb && exl_model_head_name(m->weights) ? emb->nbytes : 0);
}

void exl_string_free(char *s) { exl_free(s); }
