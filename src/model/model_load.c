/* model_load.c - load a model directory: config, mapped weights, backend handles. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

exl_model_params exl_model_default_params(void) {
    exl_model_params p = {EXL_DEVICE_AUTO, 0};
    return p;
}

static exl_status load_norm(exl_model *m, const char *name, exl_vector **out) {
    const exl_st_tensor *t;
    int64_t shape[1] = {m->cfg.hidden_size};
    EXL_TRY(exl_weights_get(m->weights, name, EXL_DTYPES_FLOAT, 1, shape, &t));
    exl_dense_src src = {t->dtype, t->data};
    float add = m->cfg.arch == EXL_ARCH_GEMMA ? 1.0f : 0.0f; /* Gemma scales by (1 + w) */
    return m->be->ops->vector_init(m->be, &src, m->cfg.hidden_size, add, out);
}

static exl_status load_layer(exl_model *m, int i) {
    const exl_hf_config *c = &m->cfg;
    exl_layer *l = &m->layers[i];
    char p[256];
    int64_t hd = c->head_dim, q_out = (int64_t)c->n_heads * hd, kv_out = (int64_t)c->n_kv_heads * hd;
#define PREFIX(fmt) (snprintf(p, sizeof p, "model.layers.%d." fmt, i), p)
    EXL_TRY(load_norm(m, PREFIX("input_layernorm.weight"), &l->attn_norm));
    EXL_TRY(load_norm(m, PREFIX("post_attention_layernorm.weight"), &l->mlp_norm));
    EXL_TRY(exl_model_load_linear(m, PREFIX("self_attn.q_proj"), c->hidden_size, q_out, c->qkv_bias, &l->q));
    EXL_TRY(exl_model_load_linear(m, PREFIX("self_attn.k_proj"), c->hidden_size, kv_out, c->qkv_bias, &l->k));
    EXL_TRY(exl_model_load_linear(m, PREFIX("self_attn.v_proj"), c->hidden_size, kv_out, c->qkv_bias, &l->v));
    EXL_TRY(exl_model_load_linear(m, PREFIX("self_attn.o_proj"), q_out, c->hidden_size, c->o_bias, &l->o));
    EXL_TRY(exl_model_load_linear(m, PREFIX("mlp.gate_proj"), c->hidden_size, c->intermediate_size, c->mlp_bias,
                                  &l->gate));
    EXL_TRY(exl_model_load_linear(m, PREFIX("mlp.up_proj"), c->hidden_size, c->intermediate_size, c->mlp_bias,
                                  &l->up));
    EXL_TRY(exl_model_load_linear(m, PREFIX("mlp.down_proj"), c->intermediate_size, c->hidden_size, c->mlp_bias,
                                  &l->down));
#undef PREFIX
    return EXL_OK;
}

/* The embedding table as a dense [vocab, hidden] linear. */
static exl_status embedding_source(const exl_model *m, exl_linear_src *src) {
    const exl_hf_config *c = &m->cfg;
    const exl_st_tensor *t;
    int64_t shape[2] = {c->vocab_size, c->hidden_size};
    EXL_TRY(exl_weights_get(m->weights, "model.embed_tokens.weight", EXL_DTYPES_FLOAT, 2, shape, &t));
    *src = (exl_linear_src){.kind = EXL_LINEAR_DENSE, .in_features = c->hidden_size, .out_features = c->vocab_size,
                            .dense = {t->dtype, t->data}, .name = "model.embed_tokens"};
    return EXL_OK;
}

exl_status exl_model_linear_source(const exl_model *m, const exl_linear *w, const char **prefix, exl_linear_src *src) {
    for (int32_t i = 0; i < m->n_linears; i++)
        if (m->linears[i].w == w) {
            *prefix = m->linears[i].name;
            *src = m->linears[i].src;
            return EXL_OK;
        }
    if (w != m->embed && w != m->head)
        return exl_fail(EXL_ERR_ARG, "exl_model_linear_source: not a linear of this model");
    EXL_TRY(embedding_source(m, src));
    *prefix = w == m->head ? "lm_head" : src->name;
    return EXL_OK;
}

static exl_status load_embedding(exl_model *m) {
    const exl_hf_config *c = &m->cfg;
    exl_linear_src src;
    EXL_TRY(embedding_source(m, &src));
    EXL_TRY(m->be->ops->linear_init(m->be, &src, &m->embed));
    /* Gemma multiplies embeddings by sqrt(hidden) rounded to the activation dtype. */
    m->embed_scale = c->arch == EXL_ARCH_GEMMA ? sqrtf((float)c->hidden_size) : 1.0f;
    /* The head: lm_head when present (EXL2 writes a quantized one even for tied models). */
    int has_head = exl_weights_find(m->weights, "lm_head.weight") || exl_weights_find(m->weights, "lm_head.q_weight") ||
                   exl_weights_find(m->weights, "lm_head.qweight");
    if (has_head)
        return exl_model_load_linear(m, "lm_head", c->hidden_size, c->vocab_size, 0, &m->head);
    if (!c->tie_embeddings)
        return exl_fail(EXL_ERR_FORMAT, "%s: missing tensor 'lm_head.weight' (tie_word_embeddings is false)",
                        m->weights->files[0]->path);
    return m->be->ops->linear_init(m->be, &src, &m->head);
}

static exl_status check_config(const exl_model *m) {
    const exl_hf_config *c = &m->cfg;
    if (c->head_dim > 1024)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s/config.json: head_dim %d is larger than exl supports (1024)",
                        m->dir, c->head_dim);
    if (m->rot_dim < 2 || m->rot_dim > c->head_dim)
        return exl_fail(EXL_ERR_FORMAT, "%s/config.json: partial_rotary_factor gives a rotary size of %d", m->dir,
                        m->rot_dim);
    return EXL_OK;
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
    if (st == EXL_OK)
        st = exl_weights_open(dir, &m->weights);
    if (st == EXL_OK)
        st = exl_backend_init(p.device, p.n_threads, &m->be);
    if (st == EXL_OK)
        st = load_embedding(m);
    if (st == EXL_OK)
        st = load_norm(m, "model.norm.weight", &m->final_norm);
    if (st == EXL_OK && !(m->layers = exl_calloc((size_t)m->cfg.n_layers, sizeof *m->layers)))
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int i = 0; st == EXL_OK && i < m->cfg.n_layers; i++)
        st = load_layer(m, i);
    if (st == EXL_OK)
        st = exl_model_alloc_forward(m);
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
    exl_backend *be = m->be;
    if (be) {
        exl_model_free_forward(m);
        for (int i = 0; m->layers && i < m->cfg.n_layers; i++) {
            exl_layer *l = &m->layers[i];
            be->ops->vector_free(be, l->attn_norm);
            be->ops->vector_free(be, l->mlp_norm);
            exl_linear *ws[] = {l->q, l->k, l->v, l->o, l->gate, l->up, l->down};
            for (size_t j = 0; j < sizeof ws / sizeof ws[0]; j++)
                be->ops->linear_free(be, ws[j]);
        }
        be->ops->linear_free(be, m->embed);
        be->ops->linear_free(be, m->head);
        be->ops->vector_free(be, m->final_norm);
        be->ops->destroy(be);
    }
    exl_free(m->layers);
    exl_free(m->linears);
    exl_weights_close(m->weights);
    exl_free(m->dir);
    exl_free(m);
}

void exl_model_describe(const exl_model *m, exl_model_desc *d) {
    const exl_hf_config *c = &m->cfg;
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
    /* decode reads every tensor once per token except the embedding rows it gathers;
     * a tied head reads the embedding table as its weight */
    const exl_st_tensor *emb = exl_weights_find(m->weights, "model.embed_tokens.weight");
    uint64_t tensors = 0;
    for (int f = 0; f < m->weights->n_files; f++)
        for (int i = 0; i < m->weights->files[f]->n_tensors; i++)
            tensors += m->weights->files[f]->tensors[i].nbytes;
    int tied_head = !exl_weights_find(m->weights, "lm_head.weight") && !exl_weights_find(m->weights, "lm_head.q_weight") &&
                    !exl_weights_find(m->weights, "lm_head.qweight");
    d->decode_bytes = tensors - (emb && !tied_head ? emb->nbytes : 0);
}

void exl_string_free(char *s) { exl_free(s); }
