/* layer_load.c - one decoder layer's tensors into exl_layer: attention (separate or fused q/k/v, per-head q/k
 * norms), the norms around it, and a dense MLP (separate or fused gate/up) or a mixture of experts (router, the
 * experts, Qwen2-MoE's shared expert and its gate). Fused tensors stay one linear, with the split sizes implied by
 * the config; where a file holds the parts instead (ExLlamaV2's converter writes Phi-3's qkv_proj as q_proj,
 * k_proj, v_proj and gate_up_proj as gate_proj, up_proj), the parts are loaded as separate linears. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdio.h>

exl_status exl_model_load_norm(exl_model *m, const char *name, int64_t n, exl_vector **out) {
    const exl_st_tensor *t;
    int64_t shape[1] = {n};
    EXL_TRY(exl_weights_get(m->weights, name, EXL_DTYPES_FLOAT, 1, shape, &t));
    exl_dense_src src = {t->dtype, t->data};
    return m->be->ops->vector_init(m->be, &src, n, m->cfg.norm_plus_one ? 1.0f : 0.0f, out);
}

/* prefix + part, in buf */
static const char *cat(char *buf, size_t size, const char *prefix, const char *part) {
    snprintf(buf, size, "%s%s", prefix, part);
    return buf;
}

#define NAME(part) cat(name, sizeof name, prefix, part)

/* Whether the file holds a linear named prefix + part (dense, EXL2 or GPTQ). */
static int has_linear(const exl_model *m, const char *prefix, const char *part) {
    static const char *const kinds[] = {".weight", ".q_weight", ".qweight"};
    char name[512];
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        snprintf(name, sizeof name, "%s%s%s", prefix, part, kinds[i]);
        if (exl_weights_find(m->weights, name))
            return 1;
    }
    return 0;
}

/* prefix: the layer's, "model.layers.<i>." */
static exl_status load_attention(exl_model *m, const char *prefix, exl_layer *l) {
    const exl_hf_config *c = &m->cfg;
    char name[512];
    int64_t hd = c->head_dim, q_out = (int64_t)c->n_heads * hd, kv_out = (int64_t)c->n_kv_heads * hd;
    if (c->fused_qkv && !(has_linear(m, prefix, "self_attn.q_proj") && !has_linear(m, prefix, "self_attn.qkv_proj"))) {
        EXL_TRY(exl_model_load_linear(m, NAME("self_attn.qkv_proj"), c->hidden_size, q_out + 2 * kv_out, c->qkv_bias,
                                      &l->qkv));
    } else {
        EXL_TRY(exl_model_load_linear(m, NAME("self_attn.q_proj"), c->hidden_size, q_out, c->qkv_bias, &l->q));
        EXL_TRY(exl_model_load_linear(m, NAME("self_attn.k_proj"), c->hidden_size, kv_out, c->qkv_bias, &l->k));
        EXL_TRY(exl_model_load_linear(m, NAME("self_attn.v_proj"), c->hidden_size, kv_out, c->qkv_bias, &l->v));
    }
    EXL_TRY(exl_model_load_linear(m, NAME("self_attn.o_proj"), q_out, c->hidden_size, c->o_bias, &l->o));
    if (c->qk_norm) {
        EXL_TRY(exl_model_load_norm(m, NAME("self_attn.q_norm.weight"), hd, &l->q_norm));
        EXL_TRY(exl_model_load_norm(m, NAME("self_attn.k_norm.weight"), hd, &l->k_norm));
    }
    return EXL_OK;
}

static exl_status load_norms(exl_model *m, const char *prefix, exl_layer *l) {
    const exl_hf_config *c = &m->cfg;
    char name[512];
    EXL_TRY(exl_model_load_norm(m, NAME("input_layernorm.weight"), c->hidden_size, &l->attn_norm));
    if (!c->sandwich_norms)
        return exl_model_load_norm(m, NAME("post_attention_layernorm.weight"), c->hidden_size, &l->mlp_norm);
    EXL_TRY(exl_model_load_norm(m, NAME("post_attention_layernorm.weight"), c->hidden_size, &l->post_attn_norm));
    EXL_TRY(exl_model_load_norm(m, NAME("pre_feedforward_layernorm.weight"), c->hidden_size, &l->mlp_norm));
    return exl_model_load_norm(m, NAME("post_feedforward_layernorm.weight"), c->hidden_size, &l->post_mlp_norm);
}

/* The tensor names of a gated MLP's gate, up and down projections. */
static const char *const proj_names[3] = {"gate_proj", "up_proj", "down_proj"};
static const char *const mixtral_names[3] = {"w1", "w3", "w2"};

/* A gated MLP under prefix (ending in '.'). */
static exl_status load_gated(exl_model *m, const char *prefix, const char *const names[3], int64_t ffn, int bias,
                             exl_expert *e) {
    char name[512];
    int64_t hidden = m->cfg.hidden_size;
    EXL_TRY(exl_model_load_linear(m, NAME(names[0]), hidden, ffn, bias, &e->gate));
    EXL_TRY(exl_model_load_linear(m, NAME(names[1]), hidden, ffn, bias, &e->up));
    return exl_model_load_linear(m, NAME(names[2]), ffn, hidden, bias, &e->down);
}

static exl_status load_dense_mlp(exl_model *m, const char *prefix, exl_layer *l) {
    const exl_hf_config *c = &m->cfg;
    char name[512];
    if (!c->fused_gate_up || (has_linear(m, prefix, "mlp.gate_proj") && !has_linear(m, prefix, "mlp.gate_up_proj"))) {
        exl_expert e = {0};
        exl_status st = load_gated(m, NAME("mlp."), proj_names, c->intermediate_size, c->mlp_bias, &e);
        l->gate = e.gate;
        l->up = e.up;
        l->down = e.down;
        return st;
    }
    EXL_TRY(exl_model_load_linear(m, NAME("mlp.gate_up_proj"), c->hidden_size, 2 * (int64_t)c->intermediate_size,
                                  c->mlp_bias, &l->gate_up));
    return exl_model_load_linear(m, NAME("mlp.down_proj"), c->intermediate_size, c->hidden_size, c->mlp_bias, &l->down);
}

/* Mixtral: block_sparse_moe.{gate, experts.N.w1/w2/w3}; Qwen MoE: mlp.{gate, experts.N.*_proj, shared_expert.*,
 * shared_expert_gate}. */
static exl_status load_moe(exl_model *m, const char *layer_prefix, exl_layer *l) {
    const exl_hf_config *c = &m->cfg;
    int mixtral = c->arch == EXL_ARCH_MIXTRAL;
    char prefix[400], name[512];
    cat(prefix, sizeof prefix, layer_prefix, mixtral ? "block_sparse_moe." : "mlp.");
    EXL_TRY(exl_model_load_linear(m, NAME("gate"), c->hidden_size, c->moe.n_experts, 0, &l->router));
    if (!(l->experts = exl_calloc((size_t)c->moe.n_experts, sizeof *l->experts)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t e = 0; e < c->moe.n_experts; e++) {
        char expert[448];
        snprintf(expert, sizeof expert, "%sexperts.%d.", prefix, e);
        EXL_TRY(load_gated(m, expert, mixtral ? mixtral_names : proj_names, c->moe.expert_ffn, 0, &l->experts[e]));
    }
    if (!c->moe.shared_ffn)
        return EXL_OK;
    EXL_TRY(load_gated(m, NAME("shared_expert."), proj_names, c->moe.shared_ffn, 0, &l->shared));
    return exl_model_load_linear(m, NAME("shared_expert_gate"), c->hidden_size, 1, 0, &l->shared_gate);
}

#undef NAME

exl_status exl_model_load_layer(exl_model *m, const char *text_prefix, int32_t i) {
    char prefix[256];
    snprintf(prefix, sizeof prefix, "%slayers.%d.", text_prefix, i);
    exl_layer *l = &m->layers[i];
    EXL_TRY(load_norms(m, prefix, l));
    EXL_TRY(load_attention(m, prefix, l));
    return m->cfg.layers[i].moe ? load_moe(m, prefix, l) : load_dense_mlp(m, prefix, l);
}

static void free_expert(exl_backend *be, const exl_expert *e) {
    be->ops->linear_free(be, e->gate);
    be->ops->linear_free(be, e->up);
    be->ops->linear_free(be, e->down);
}

void exl_model_free_layer(exl_model *m, exl_layer *l) {
    exl_backend *be = m->be;
    exl_vector *vs[] = {l->attn_norm, l->mlp_norm, l->q_norm, l->k_norm, l->post_attn_norm, l->post_mlp_norm};
    for (size_t j = 0; j < sizeof vs / sizeof vs[0]; j++)
        be->ops->vector_free(be, vs[j]);
    exl_linear *ws[] = {l->q, l->k, l->v, l->o, l->qkv, l->gate, l->up, l->down, l->gate_up, l->router, l->shared_gate};
    for (size_t j = 0; j < sizeof ws / sizeof ws[0]; j++)
        be->ops->linear_free(be, ws[j]);
    for (int32_t e = 0; l->experts && e < m->cfg.moe.n_experts; e++)
        free_expert(be, &l->experts[e]);
    free_expert(be, &l->shared);
    exl_free(l->experts);
}
