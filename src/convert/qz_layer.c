/* qz_layer.c - a decoder layer's linears as the quantizer takes them, under the names ExLlamaV2's converter gives
 * them: a fused linear (Phi-3's qkv_proj, gate_up_proj) split into its parts (q_proj, k_proj, v_proj; gate_proj,
 * up_proj), each made a backend linear of its own so the layer can run with any part swapped; each expert of a
 * mixture its own three linears (the router stays as it is). And the layer with one block's linears replaced. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"
#include "format/quant.h"

#include <stdio.h>
#include <string.h>

/* A linear's weights W[K, N] and bias (or NULL) in fp32. */
exl_status exl_qz_load_linear(const exl_linear_src *src, float **W, float **bias) {
    int64_t K = src->in_features, N = src->out_features;
    if (!(*W = exl_malloc((size_t)(K * N) * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory for a %lld x %lld linear", (long long)K, (long long)N);
    EXL_TRY(exl_linear_dequant(src, *W));
    if (!src->bias)
        return EXL_OK;
    if (!(*bias = exl_malloc((size_t)N * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int64_t n = 0; n < N; n++)
        switch (src->bias_dtype) {
        case EXL_DTYPE_F16: (*bias)[n] = exl_f16_to_f32(((const uint16_t *)src->bias)[n]); break;
        case EXL_DTYPE_BF16: (*bias)[n] = exl_bf16_to_f32(((const uint16_t *)src->bias)[n]); break;
        default: (*bias)[n] = ((const float *)src->bias)[n]; break;
        }
    return EXL_OK;
}

static exl_qz_lin *next_lin(exl_qz_layer *L, int32_t block, int32_t opt, int32_t stage, int32_t hslot) {
    exl_qz_lin *x = &L->lin[L->n++];
    memset(x, 0, sizeof *x);
    x->block = block;
    x->opt = opt;
    x->stage = stage;
    x->hslot = hslot;
    return x;
}

/* One of the model's linears as it is. */
static exl_status add_whole(exl_qz_layer *L, exl_linear *w, int32_t block, int32_t opt, int32_t stage, int32_t hslot) {
    exl_qz_lin *x = next_lin(L, block, opt, stage, hslot);
    const char *prefix;
    EXL_TRY(exl_model_linear_source(L->m, w, &prefix, &x->src));
    snprintf(x->name, sizeof x->name, "%s", prefix);
    x->own = w;
    return exl_qz_load_linear(&x->src, &x->W, &x->bias);
}

/* A fused linear's n parts (columns of W in order, widths given), named parent.<names[i]>, each a backend linear. */
static exl_status add_parts(exl_qz_layer *L, exl_backend *be, const exl_linear *w, int32_t n, const char *const *names,
                            const int64_t *widths, int32_t block, const int32_t *stage) {
    const char *prefix;
    exl_linear_src src;
    float *W = NULL, *bias = NULL;
    EXL_TRY(exl_model_linear_source(L->m, w, &prefix, &src));
    const char *dot = strrchr(prefix, '.');
    int parent = dot ? (int)(dot - prefix) : 0;
    exl_status st = exl_qz_load_linear(&src, &W, &bias);
    int64_t K = src.in_features, Nall = src.out_features, col = 0;
    for (int32_t i = 0; i < n && st == EXL_OK; i++) {
        exl_qz_lin *x = next_lin(L, block, L->n - L->first[block], stage[i], stage[i]);
        int64_t N = widths[i];
        snprintf(x->name, sizeof x->name, "%.*s.%s", parent, prefix, names[i]);
        x->src = src;
        x->src.out_features = N;
        x->src.bias = NULL;
        if (!(x->W = exl_malloc((size_t)(K * N) * sizeof(float))) ||
            (bias && !(x->bias = exl_malloc((size_t)N * sizeof(float))))) {
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
            break;
        }
        for (int64_t k = 0; k < K; k++)
            memcpy(x->W + k * N, W + k * Nall + col, (size_t)N * sizeof(float));
        if (bias) {
            memcpy(x->bias, bias + col, (size_t)N * sizeof(float));
            x->src.bias = x->bias;
            x->src.bias_dtype = EXL_DTYPE_F32;
        }
        col += N;
        st = exl_qz_trial_init(be, NULL, x->W, &x->src, &x->part);
        x->own = x->part.w;
    }
    exl_free(W);
    exl_free(bias);
    return st;
}

exl_status exl_qz_layer_load(exl_model *m, exl_backend *be, int32_t li, exl_qz_layer *L) {
    const exl_hf_config *c = &m->cfg;
    const exl_layer *ml = &m->layers[li];
    int32_t experts = c->layers[li].moe ? c->moe.n_experts : 0;
    memset(L, 0, sizeof *L);
    L->m = m;
    L->be = be;
    L->li = li;
    L->lin = exl_calloc((size_t)(4 + 3 * (experts ? experts : 1)), sizeof *L->lin);
    L->experts = experts ? exl_calloc((size_t)experts, sizeof *L->experts) : NULL;
    if (!L->lin || (experts && !L->experts))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    int64_t qw = (int64_t)c->n_heads * c->head_dim, kvw = (int64_t)c->n_kv_heads * c->head_dim;
    if (ml->qkv) {
        static const char *const names[3] = {"q_proj", "k_proj", "v_proj"};
        const int64_t widths[3] = {qw, kvw, kvw};
        const int32_t stage[3] = {0, 0, 0};
        EXL_TRY(add_parts(L, be, ml->qkv, 3, names, widths, 0, stage));
    } else {
        EXL_TRY(add_whole(L, ml->q, 0, 0, 0, 0));
        EXL_TRY(add_whole(L, ml->k, 0, 1, 0, 0));
        EXL_TRY(add_whole(L, ml->v, 0, 2, 0, 0));
    }
    EXL_TRY(add_whole(L, ml->o, 0, 3, 1, 1));
    L->first[1] = L->n;
    L->n_slots[0] = 2;
    if (experts) {
        for (int32_t e = 0; e < experts; e++) {
            EXL_TRY(add_whole(L, ml->experts[e].gate, 1, 0, 0, 2 * e));
            EXL_TRY(add_whole(L, ml->experts[e].up, 1, 1, 0, 2 * e));
            EXL_TRY(add_whole(L, ml->experts[e].down, 1, 2, 1, 2 * e + 1));
        }
        L->n_slots[1] = 2 * experts;
    } else {
        if (ml->gate_up) {
            static const char *const names[2] = {"gate_proj", "up_proj"};
            const int64_t widths[2] = {c->intermediate_size, c->intermediate_size};
            const int32_t stage[2] = {0, 0};
            EXL_TRY(add_parts(L, be, ml->gate_up, 2, names, widths, 1, stage));
        } else {
            EXL_TRY(add_whole(L, ml->gate, 1, 0, 0, 0));
            EXL_TRY(add_whole(L, ml->up, 1, 1, 0, 0));
        }
        EXL_TRY(add_whole(L, ml->down, 1, 2, 1, 1));
        L->n_slots[1] = 2;
    }
    L->first[2] = L->n;
    return EXL_OK;
}

void exl_qz_layer_free(exl_qz_layer *L) {
    for (int32_t i = 0; L->lin && i < L->n; i++) {
        exl_qz_trial_free(L->be, &L->lin[i].part);
        exl_free(L->lin[i].W);
        exl_free(L->lin[i].bias);
    }
    exl_free(L->lin);
    exl_free(L->experts);
    memset(L, 0, sizeof *L);
}

exl_layer exl_qz_layer_block(exl_qz_layer *L, int k, exl_linear *const *w) {
    exl_layer b = L->m->layers[L->li];
    if (k == 0) {
        b.mlp_norm = NULL;
        b.qkv = NULL;
        b.q = w[0], b.k = w[1], b.v = w[2], b.o = w[3];
        return b;
    }
    b.attn_norm = NULL;
    int32_t f = L->first[1];
    if (L->experts) {
        for (int32_t e = 0; e < L->m->cfg.moe.n_experts; e++)
            L->experts[e] = (exl_expert){w[f + 3 * e], w[f + 3 * e + 1], w[f + 3 * e + 2]};
        b.experts = L->experts;
        return b;
    }
    b.gate_up = NULL;
    b.gate = w[f], b.up = w[f + 1], b.down = w[f + 2];
    return b;
}
