/* lora_load.c - load a PEFT LoRA adapter for a model: every lora_A / lora_B pair matched to a projection of a decoder
 * layer by its module name (base_model.model.<the linear's prefix>), checked against the linear's shape and the
 * config's targets, scaled (alpha / r, or alpha / sqrt(r) with rsLoRA, per module where the patterns say), and put
 * in backend memory as A [rank, in] and Bt = scaling · B^T [rank, out], fp32; then entered in the model's factor
 * tables under a free slot. */
#include "model/lora.h"
#include "model/lora_config.h"
#include "model/tp.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"
#include "io/json_file.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#define PEFT_PREFIX "base_model.model."

const exl_linear *exl_lora_proj_linear(const exl_layer *l, exl_lora_proj p) {
    switch (p) {
    case EXL_LORA_Q: return l->q;
    case EXL_LORA_K: return l->k;
    case EXL_LORA_V: return l->v;
    case EXL_LORA_QKV: return l->qkv;
    case EXL_LORA_O: return l->o;
    case EXL_LORA_GATE: return l->gate;
    case EXL_LORA_UP: return l->up;
    case EXL_LORA_GATE_UP: return l->gate_up;
    case EXL_LORA_DOWN: return l->down;
    case EXL_LORA_N_PROJ: break;
    }
    return NULL;
}

/* A projection the adapter may update: its module name, shape and where its factors go. */
typedef struct target {
    const char *module; /* the linear's prefix, e.g. model.layers.0.self_attn.q_proj */
    int64_t in, out;
    const exl_st_tensor *a, *b;
    double scaling;
    size_t at; /* float offset of its A, then Bt, in the adapter's memory */
} target;

typedef struct loader {
    exl_model *m;
    const char *dir;
    exl_lora_config cfg;
    exl_st_file *file;
    target *targets; /* [n_layers * EXL_LORA_N_PROJ], module NULL where the layer has no such linear */
    int n_targets;
} loader;

static exl_status collect_targets(loader *L) {
    exl_model *m = L->m;
    L->n_targets = m->cfg.n_layers * EXL_LORA_N_PROJ;
    if (!(L->targets = exl_calloc((size_t)L->n_targets, sizeof *L->targets)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t li = 0; li < m->cfg.n_layers; li++)
        for (int p = 0; p < EXL_LORA_N_PROJ; p++) {
            const exl_linear *w = exl_lora_proj_linear(&m->layers[li], (exl_lora_proj)p);
            if (!w)
                continue;
            target *t = &L->targets[li * EXL_LORA_N_PROJ + p];
            exl_linear_src src;
            EXL_TRY(exl_model_linear_source(m, w, &t->module, &src));
            t->in = src.in_features, t->out = src.out_features;
        }
    return EXL_OK;
}

static target *find_target(loader *L, const char *module, size_t len) {
    for (int i = 0; i < L->n_targets; i++)
        if (L->targets[i].module && strlen(L->targets[i].module) == len && !memcmp(L->targets[i].module, module, len))
            return &L->targets[i];
    return NULL;
}

/* the config's architecture against config.json's */
static exl_status check_architecture(loader *L) {
    if (!L->cfg.base_model_class)
        return EXL_OK;
    char *path = exl_path_join(L->m->dir, "config.json");
    cJSON *root = NULL;
    if (!path)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = exl_json_read_file(path, &root);
    exl_free(path);
    EXL_TRY(st);
    const cJSON *arch = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    const cJSON *first = cJSON_IsArray(arch) ? arch->child : NULL;
    if (cJSON_IsString(first) && strcmp(first->valuestring, L->cfg.base_model_class) != 0)
        st = exl_fail(EXL_ERR_ARG, "adapter %s: made for %s (auto_mapping.base_model_class), the model is %s", L->dir,
                      L->cfg.base_model_class, first->valuestring);
    cJSON_Delete(root);
    return st;
}

/* every target module the config names is a projection of the model */
static exl_status check_target_names(loader *L) {
    const cJSON *t = L->cfg.target_modules;
    for (const cJSON *e = cJSON_IsArray(t) ? t->child : NULL; e; e = e->next) {
        int found = 0;
        for (int i = 0; i < L->n_targets && !found; i++)
            found = L->targets[i].module && exl_lora_module_matches(L->targets[i].module, e->valuestring);
        if (!found)
            return exl_fail(EXL_ERR_ARG,
                            "adapter %s: target module \"%s\" is no attention or MLP projection of this %s model",
                            L->dir, e->valuestring, L->m->cfg.model_type);
    }
    return EXL_OK;
}

/* each tensor of the file to its projection, checked */
static exl_status match_tensors(loader *L) {
    static const char pre[] = PEFT_PREFIX, sa[] = ".lora_A.weight", sb[] = ".lora_B.weight";
    for (int i = 0; i < L->file->n_tensors; i++) {
        const exl_st_tensor *t = &L->file->tensors[i];
        size_t n = strlen(t->name), lp = sizeof pre - 1, ls = sizeof sa - 1;
        int is_a = n > lp + ls && !strcmp(t->name + n - ls, sa), is_b = n > lp + ls && !strcmp(t->name + n - ls, sb);
        if (strncmp(t->name, pre, lp) != 0 || !(is_a || is_b))
            return exl_fail(EXL_ERR_UNSUPPORTED,
                            "adapter %s: tensor %s is no LoRA factor (base_model.model.<module>.lora_A/B.weight)",
                            L->dir, t->name);
        target *g = find_target(L, t->name + lp, n - lp - ls);
        if (!g)
            return exl_fail(EXL_ERR_ARG, "adapter %s: tensor %s: this %s model has no projection %.*s", L->dir, t->name,
                            L->m->cfg.model_type, (int)(n - lp - ls), t->name + lp);
        if (t->n_dims != 2 || (t->dtype != EXL_DTYPE_F32 && t->dtype != EXL_DTYPE_F16 && t->dtype != EXL_DTYPE_BF16))
            return exl_fail(EXL_ERR_FORMAT, "adapter %s: tensor %s must be a 2-d float tensor", L->dir, t->name);
        if (is_a ? t->shape[1] != g->in : t->shape[0] != g->out)
            return exl_fail(EXL_ERR_ARG, "adapter %s: tensor %s is [%lld, %lld], but %s has %lld %s features", L->dir,
                            t->name, (long long)t->shape[0], (long long)t->shape[1], g->module,
                            (long long)(is_a ? g->in : g->out), is_a ? "input" : "output");
        *(is_a ? &g->a : &g->b) = t;
    }
    return EXL_OK;
}

/* every targeted projection has both factors of one rank, the rank the config gives it; its scaling */
static exl_status check_pairs(loader *L) {
    const exl_lora_config *c = &L->cfg;
    for (int i = 0; i < L->n_targets; i++) {
        target *g = &L->targets[i];
        if (!g->module)
            continue;
        int wanted = exl_lora_config_targets(c, g->module) && exl_lora_config_has_layer(c, i / EXL_LORA_N_PROJ);
        if (!g->a && !g->b && !wanted)
            continue;
        if (!g->a || !g->b)
            return exl_fail(EXL_ERR_FORMAT, "adapter %s: missing tensor " PEFT_PREFIX "%s.lora_%s.weight", L->dir,
                            g->module, g->a ? "B" : "A");
        int64_t rank = g->a->shape[0];
        if (g->b->shape[1] != rank || rank != exl_lora_config_rank(c, g->module))
            return exl_fail(EXL_ERR_FORMAT,
                            "adapter %s: tensor " PEFT_PREFIX "%s.lora_B.weight: rank %lld, lora_A's %lld, the "
                            "config's %d",
                            L->dir, g->module, (long long)g->b->shape[1], (long long)rank,
                            exl_lora_config_rank(c, g->module));
        double alpha = exl_lora_config_alpha(c, g->module);
        g->scaling = alpha / (c->rslora ? sqrt((double)rank) : (double)rank);
    }
    return EXL_OK;
}

static float element(const exl_st_tensor *t, int64_t i) {
    switch (t->dtype) {
    case EXL_DTYPE_F16: return exl_f16_to_f32(((const uint16_t *)t->data)[i]);
    case EXL_DTYPE_BF16: return exl_bf16_to_f32(((const uint16_t *)t->data)[i]);
    default: return ((const float *)t->data)[i];
    }
}

/* the factors on the host (exl_malloc'd), as mem will hold them; the lora's ranks and offsets */
static exl_status host_factors(loader *L, exl_lora *lo, float **host_out, size_t *floats_out) {
    size_t floats = 0;
    for (int i = 0; i < L->n_targets; i++) {
        target *g = &L->targets[i];
        if (!g->a)
            continue;
        g->at = floats;
        floats += (size_t)g->a->shape[0] * (size_t)(g->in + g->out);
    }
    if (floats == 0)
        return exl_fail(EXL_ERR_FORMAT, "adapter %s: no LoRA factors for any projection of the model", L->dir);
    float *host = exl_malloc(floats * sizeof(float));
    if (!host)
        return exl_fail(EXL_ERR_NOMEM, "adapter %s: out of memory", L->dir);
    *host_out = host;
    *floats_out = floats;
    for (int i = 0; i < L->n_targets; i++) {
        const target *g = &L->targets[i];
        if (!g->a)
            continue;
        int64_t rank = g->a->shape[0];
        float *a = host + g->at, *bt = a + rank * g->in;
        for (int64_t k = 0; k < rank * g->in; k++)
            a[k] = element(g->a, k);
        for (int64_t o = 0; o < g->out; o++)
            for (int64_t j = 0; j < rank; j++)
                bt[j * g->out + o] = (float)(g->scaling * element(g->b, o * rank + j));
        lo->rank[i] = (int32_t)rank;
        lo->in[i] = (int32_t)g->in;
        lo->at[i] = g->at;
    }
    return EXL_OK;
}

/* the model's adapter state and factor tables, on the first load */
static exl_status ensure_state(exl_model *m) {
    if (m->lora)
        return EXL_OK;
    exl_lora_state *s = exl_calloc(1, sizeof *s);
    size_t entries = (size_t)m->cfg.n_layers * EXL_LORA_N_PROJ * EXL_LORA_SLOTS;
    exl_lora_factors *zero = exl_calloc(entries, sizeof *zero);
    if (s)
        s->targeted = exl_calloc((size_t)m->cfg.n_layers * EXL_LORA_N_PROJ, 1);
    exl_status st = s && zero && s->targeted ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK && !(s->tables = m->be->ops->alloc(m->be, entries * sizeof *zero)))
        st = exl_fail_prefix(EXL_ERR_NOMEM, "LoRA tables");
    if (st == EXL_OK)
        st = m->be->ops->upload(m->be, s->tables, zero, entries * sizeof *zero);
    exl_free(zero);
    if (st == EXL_OK) {
        m->lora = s;
        return EXL_OK;
    }
    if (s && s->tables)
        m->be->ops->free(m->be, s->tables);
    if (s)
        exl_free(s->targeted);
    exl_free(s);
    return st;
}

static void free_lora(exl_lora *lo) {
    if (lo->mem)
        lo->m->be->ops->free(lo->m->be, lo->mem);
    exl_free(lo->rank);
    exl_free(lo->in);
    exl_free(lo->at);
    exl_free(lo->dir);
    exl_free(lo);
}

/* the lora's factors into its slot of every projection's table (or zeros: clear) */
static exl_status write_slot(exl_lora *lo, int clear) {
    exl_model *m = lo->m;
    int n = m->cfg.n_layers * EXL_LORA_N_PROJ;
    const float *base = lo->mem;
    for (int i = 0; i < n; i++) {
        exl_lora_factors f = {0};
        if (lo->rank[i] && !clear) {
            f.a = base + lo->at[i];
            f.bt = f.a + (size_t)lo->rank[i] * (size_t)lo->in[i];
            f.rank = lo->rank[i];
        }
        EXL_TRY(m->be->ops->upload(m->be, m->lora->tables + (size_t)i * EXL_LORA_SLOTS + lo->slot, &f, sizeof f));
    }
    return EXL_OK;
}

static exl_status load(loader *L, exl_lora *lo, float **host, size_t *floats) {
    char *path = exl_path_join(L->dir, "adapter_config.json"), *text = NULL;
    size_t len = 0;
    exl_status st = path ? exl_file_read(path, &text, &len) : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK)
        st = exl_lora_config_parse(path, text, len, &L->cfg);
    exl_free(text);
    exl_free(path);
    EXL_TRY(st);
    EXL_TRY(check_architecture(L));
    EXL_TRY(collect_targets(L));
    if (!(path = exl_path_join(L->dir, "adapter_model.safetensors")))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    st = exl_st_open(path, &L->file);
    exl_free(path);
    EXL_TRY(st);
    EXL_TRY(match_tensors(L));
    EXL_TRY(check_target_names(L));
    EXL_TRY(check_pairs(L));
    if (!(lo->rank = exl_calloc((size_t)L->n_targets, sizeof *lo->rank)) ||
        !(lo->in = exl_calloc((size_t)L->n_targets, sizeof *lo->in)) ||
        !(lo->at = exl_calloc((size_t)L->n_targets, sizeof *lo->at)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    return host_factors(L, lo, host, floats);
}

/* adapters run on one device: a model split over ranks (tp.h) refuses them */
static exl_status check_one_device(const exl_model *m, const char *dir) {
    if (!m->tp)
        return EXL_OK;
    return exl_fail(EXL_ERR_UNSUPPORTED, "adapter %s: LoRA adapters do not run on a model split over devices (%s)", dir,
                    m->tp->split ? "--gpu-split" : "--tp");
}

exl_status exl_lora_install(exl_lora *lo, const float *host, size_t floats, exl_lora **out) {
    static atomic_uint_fast64_t next_id = 1;
    exl_model *m = lo->m;
    exl_backend *be = m->be;
    lo->id = atomic_fetch_add(&next_id, 1);
    lo->slot = -1;
    for (int32_t i = 0; i < m->cfg.n_layers * EXL_LORA_N_PROJ; i++)
        lo->max_rank = lo->rank[i] > lo->max_rank ? lo->rank[i] : lo->max_rank;
    exl_status st = check_one_device(m, lo->dir);
    if (st == EXL_OK)
        st = ensure_state(m);
    if (st == EXL_OK && !(lo->mem = be->ops->alloc(be, floats * sizeof(float))))
        st = exl_fail_prefix(EXL_ERR_NOMEM, "adapter %s", lo->dir);
    if (st == EXL_OK)
        st = be->ops->upload(be, lo->mem, host, floats * sizeof(float));
    for (int32_t s = 0; st == EXL_OK && s < EXL_LORA_SLOTS && lo->slot < 0; s++)
        if (!m->lora->slots[s])
            lo->slot = s;
    if (st == EXL_OK && lo->slot < 0)
        st = exl_fail(EXL_ERR_STATE, "adapter %s: %d adapters are loaded already", lo->dir, EXL_LORA_SLOTS);
    if (st == EXL_OK)
        st = write_slot(lo, 0);
    if (st != EXL_OK) {
        free_lora(lo);
        return st;
    }
    m->lora->slots[lo->slot] = lo;
    *out = lo;
    return EXL_OK;
}

exl_status exl_lora_load(exl_model *m, const char *dir, exl_lora **out) {
    *out = NULL;
    if (!m->layers)
        return exl_fail(EXL_ERR_STATE, "adapter %s: the model was loaded for inspection only", dir);
    EXL_TRY(check_one_device(m, dir));
    exl_lora *lo = exl_calloc(1, sizeof *lo);
    if (!lo || !(lo->dir = exl_strdup(dir))) {
        exl_free(lo);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    lo->m = m;
    loader L = {.m = m, .dir = dir};
    float *host = NULL;
    size_t floats = 0;
    exl_status st = load(&L, lo, &host, &floats);
    exl_lora_config_free(&L.cfg);
    exl_st_close(L.file);
    exl_free(L.targets);
    if (st == EXL_OK)
        st = exl_lora_install(lo, host, floats, out);
    else
        free_lora(lo);
    exl_free(host);
    return st;
}

void exl_lora_free(exl_lora *lo) {
    if (!lo)
        return;
    exl_lora_state *s = lo->m->lora;
    write_slot(lo, 1); /* a failure leaves a table entry no set can reach: the slot is free either way */
    s->slots[lo->slot] = NULL;
    for (int32_t i = s->fallback.n - 1; i >= 0; i--)
        if (s->fallback.uses[i].lora == lo)
            s->fallback.uses[i] = s->fallback.uses[--s->fallback.n];
    free_lora(lo);
}

void exl_lora_state_free(exl_model *m) {
    exl_lora_state *s = m->lora;
    if (!s)
        return;
    for (int32_t i = 0; i < EXL_LORA_SLOTS; i++)
        if (s->slots[i])
            exl_lora_free(s->slots[i]);
    exl_backend *be = m->be;
    if (s->tables)
        be->ops->free(be, s->tables);
    if (s->table)
        be->ops->free(be, s->table);
    if (s->t)
        be->ops->free(be, s->t);
    exl_free(s->host_table);
    exl_free(s->targeted);
    exl_free(s);
    m->lora = NULL;
}
