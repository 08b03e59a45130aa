/* quantize.c - exl_quantize: Hugging Face model -> EXL2 or GPTQ, layer by layer.
 *
 * The calibration rows' hidden states go through the model one decoder layer at a time, in the model's own
 * forward pass (calib_run.c, model.h's exl_model_layer_forward), a hook adding each linear's inputs to its
 * Hessian. EXL2 first measures (unless given a measurement.json): every candidate recipe of each block
 * (self_attn, mlp) is quantized with GPTQ, the block run alone with the candidate's dequantized weights, and the
 * relative error of the hidden states after it recorded, on the unquantized model's states (see measure_block;
 * scored on EVAL_SEQS of the sequences); the optimizer then picks one recipe per block within the budget. The quantizing pass runs each layer on the
 * states of the already-quantized layers before it, and inside a layer each linear sees the outputs of the
 * already-quantized linears before it (o_proj after q/k/v, down after gate/up). Only one layer's fp32 weights
 * and Hessians are held at a time. A layer's linears are qz_layer.c's: fused ones split into ExLlamaV2's parts,
 * a mixture's experts one by one (each with the Hessian of the rows routed to it), measured as one block whose
 * recipe every expert takes. How a layer computes is the model's (model/); the output holds the quantized
 * linears and every other tensor of the input as it is (a mixture's router included). Progress goes to the
 * status callback (qz_status.c).
 *
 * Everything runs on the device parameter's backend: the forward passes, and the big products (Hessians, GPTQ
 * updates) as its host_gemm, in fp32 on the GPU as on the CPU. Scoring a candidate keeps the hidden states on the
 * backend (its evaluation rows uploaded once a block, its trial linears given new weights in place, the error summed
 * there: one wait a forward step); EXL_QUANT_PROFILE=1 prints where each layer's time went (qz_prof.c).
 *
 * Resuming: OUT_DIR/.exl-quant holds state.json (parameters, pass, next layer), the
 * hidden states after the last finished layer, the partial measurement and one
 * safetensors part per finished layer; the last step merges the parts and removes it. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"
#include "base/str.h"
#include "format/quant.h"
#include "io/hf_config.h"
#include "io/json_file.h"
#include "model/model.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Calibration sequences the measuring pass scores each candidate recipe on (the Hessians and reference outputs take
 * all of them). A block's relative output error is an average over many tokens: 4 sequences of 512 tokens (2048
 * tokens x the hidden width) pin it down well enough to rank recipes, and scoring is most of the measuring pass's
 * time (39 candidates a block). */
#define EVAL_SEQS 4

typedef struct qz {
    const exl_quantize_params *p;
    exl_hf_config cfg;
    exl_model *m;    /* the input model on the device parameter's backend */
    exl_backend *be; /* m's: forward passes, host_gemm */
    exl_pool *pool;  /* the CPU backend's, or own_pool */
    exl_pool *own_pool;
    exl_qz_runner run;
    char *work;     /* OUT_DIR/.exl-quant */
    char sig[1024]; /* the parameters a resumed run must match */
    int64_t T, H;
    exl_qz_block_desc desc[3];            /* attention, MLP, experts */
    const exl_qz_block_desc **block_desc; /* [2 * layers] */
    float *x;                             /* [T, H] hidden states */
    float *ref;                           /* [T, H] after a block with the unquantized weights */
    /* the measuring pass scores candidates on EVAL_SEQS of the calibration sequences, spread evenly (all of them
     * when there are no more): their inputs and reference outputs on the host, and their runner */
    int32_t n_eval;
    float *xe, *refe;
    exl_qz_runner run_eval;
    float *dxe, *drefe; /* the evaluation rows' inputs and reference outputs in backend memory (EXL2) */
    exl_qz_layer layer; /* the layer being quantized: its linears, their fp32 weights */
    exl_qz_measurement meas;
    int32_t *choice; /* recipe per block */
    exl_qz_clock clock;
    exl_str report;
} qz;

/* ---- small helpers */

static void progress(qz *q, const char *stage, int32_t done, int32_t total) {
    if (q->p->progress)
        q->p->progress(q->p->progress_user, stage, done, total);
}

static char *work_path(const qz *q, const char *name) { return exl_path_join(q->work, name); }

/* the work file of layer l's quantized tensors */
static char *layer_path(const qz *q, int l) {
    char name[64];
    snprintf(name, sizeof name, "layer_%05d.safetensors", l);
    return work_path(q, name);
}

static double sq_dist(const float *a, const float *b, int64_t n) {
    double e = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        e += d * d;
    }
    return e;
}

static double sq_norm(const float *a, int64_t n) {
    double e = 0;
    for (int64_t i = 0; i < n; i++)
        e += (double)a[i] * a[i];
    return e;
}

/* 1 - the relative error of outputs whose squared distance from the reference is dist (norm: the reference's
 * squared) */
static double accuracy_from(double dist, double norm) {
    double err = norm > 0 ? sqrt(dist / norm) : 0;
    return err < 1 ? 1 - err : 0;
}

static double accuracy_of(const float *y, const float *ref, int64_t n, double norm) {
    return accuracy_from(sq_dist(y, ref, n), norm);
}

/* Round to nearest: no calibration, no forward passes, identity Hessians. */
static int rtn(const qz *q) { return q->p->format == EXL_QUANT_GPTQ && q->p->rtn; }

/* What the quantizer cannot take of a model the forward runs (written to gap; empty: none). */
static void quant_gap(const exl_hf_config *c, char *gap, size_t size) {
    gap[0] = 0;
    if (c->moe.shared_ffn)
        snprintf(gap, size, "a shared expert beside the routed ones");
}

static void free_layer(qz *q) {
    exl_qz_prof_enter(EXL_QZ_PROF_LOAD);
    exl_qz_layer_free(&q->layer);
    exl_qz_prof_leave();
}

static exl_status load_layer(qz *q, int32_t l) {
    exl_qz_prof_enter(EXL_QZ_PROF_LOAD);
    exl_status st = exl_qz_layer_load(q->m, q->be, l, &q->layer);
    exl_qz_prof_leave();
    return st;
}

/* The GPTQ factor of a Hessian (EXL2 always in act-order); rounding to nearest, or a linear that saw no rows (an
 * expert no calibration token chose), takes the identity. */
static exl_status hinv_of(qz *q, exl_hessian *h, exl_qz_hinv *hi) {
    exl_qz_prof_enter(EXL_QZ_PROF_FACTOR);
    exl_status st = EXL_OK;
    if (rtn(q) || h->n == 0)
        exl_hessian_identity(h);
    else
        st = exl_hessian_finish(h);
    if (st == EXL_OK)
        st = exl_gptq_prepare(h, q->p->format == EXL_QUANT_EXL2 || q->p->act_order, q->pool, q->be, hi);
    exl_qz_prof_leave();
    return st;
}

/* Run the layer's block k with linears w (as q->layer.lin) over the hidden states x of all the calibration sequences
 * into x_out (NULL: none), adding the inputs of each linear i of the block with h[i - first] non-NULL to that
 * Hessian; keep (NULL: none) receives the inputs of linear keep_i's (one of those). */
static exl_status run_block(qz *q, int k, exl_linear *const *w, const float *x, float *x_out, exl_hessian *const *h,
                            int32_t keep_i, float *keep) {
    exl_qz_runner *r = &q->run;
    exl_qz_layer *L = &q->layer;
    exl_layer b = exl_qz_layer_block(L, k, w);
    int32_t first = L->first[k], n = L->first[k + 1] - first;
    const exl_linear **want = h ? exl_calloc((size_t)n, sizeof *want) : NULL;
    if (h && !want)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; h && i < n; i++)
        want[i] = h[i] ? w[first + i] : NULL;
    exl_qz_capture cap = {r, n, want, h, keep ? w[keep_i] : NULL, keep, 0};
    exl_qz_prof_enter(EXL_QZ_PROF_CALIB);
    exl_status st = exl_qz_run_layer(r, &b, L->li, x, x_out, h ? exl_qz_capture_inputs : NULL, &cap);
    exl_qz_prof_leave();
    if (st == EXL_OK && keep && cap.kept != q->T)
        st = exl_fail(EXL_ERR_ARG, "layer %d: %lld of %lld rows of %s's inputs kept", L->li, (long long)cap.kept,
                      (long long)q->T, L->lin[keep_i].name);
    exl_free(want);
    return st;
}

/* The rows of the sequences candidates are scored on: sequence e of n_eval is calibration sequence e·rows/n_eval. */
static void gather_eval(const qz *q, const float *from, float *to) {
    size_t seq = (size_t)q->p->length * (size_t)q->H;
    for (int32_t e = 0; e < q->n_eval; e++)
        memcpy(to + e * seq, from + (size_t)((int64_t)e * q->p->rows / q->n_eval) * seq, seq * sizeof(float));
}

/* Hessians of block k's slots (all, or those of one stage), each fed by the first linear of its slot: hs[slot] and
 * per linear h[i - first] (NULL for the others). */
static exl_status slot_hessians(qz *q, int k, int stage, exl_hessian *hs, exl_hessian **h) {
    exl_qz_layer *L = &q->layer;
    int32_t first = L->first[k];
    for (int32_t i = first; i < L->first[k + 1]; i++) {
        const exl_qz_lin *x = &L->lin[i];
        h[i - first] = NULL;
        if ((stage >= 0 && x->stage != stage) || hs[x->hslot].H)
            continue;
        EXL_TRY(exl_hessian_init(&hs[x->hslot], x->src.in_features));
        h[i - first] = &hs[x->hslot];
    }
    return EXL_OK;
}

/* ---- quantizing one linear */

static exl_status quant_exl2(qz *q, const exl_qz_opt *o, const float *W, const exl_qz_hinv *h, int64_t N,
                             exl_qz_result *r, exl_qz_layout *l) {
    EXL_TRY(exl_exl2_layout(o, h->K, l));
    exl_status st = exl_gptq_quantize(W, h, N, EXL_QZ_EXL2, l, q->pool, q->be, r);
    if (st != EXL_OK)
        exl_qz_layout_free(l);
    return st;
}

/* Quantize linear (name, W, bias) into the part; *Wq receives the dequantized weights. */
static exl_status emit_linear(qz *q, exl_qz_part *part, const char *name, const float *W, const float *bias,
                              const exl_qz_hinv *h, int64_t N, const exl_qz_opt *o, float **Wq, double *bits) {
    int64_t K = h->K;
    char tn[300];
    exl_qz_result r;
    exl_qz_layout l = {0};
    exl_status st;
    if (q->p->format == EXL_QUANT_EXL2) {
        *bits = exl_exl2_opt_bits(o, K, N);
        EXL_TRY(quant_exl2(q, o, W, h, N, &r, &l));
        exl_exl2_tensors t;
        st = exl_exl2_tensors_make(&r, &l, &t);
        if (st == EXL_OK) {
            int64_t s1[2] = {t.Q, t.Np}, s2[1] = {K}, s3[2] = {t.G, t.Np / 8}, s4[1] = {t.G}, s5[1] = {2 * t.G};
            snprintf(tn, sizeof tn, "%s.q_weight", name);
            st = exl_qz_part_own(part, tn, EXL_DTYPE_I32, 2, s1, t.q_weight);
            snprintf(tn, sizeof tn, "%s.q_invperm", name);
            exl_status s = exl_qz_part_own(part, tn, EXL_DTYPE_I32, 1, s2, t.q_invperm);
            st = st ? st : s;
            snprintf(tn, sizeof tn, "%s.q_scale", name);
            s = exl_qz_part_own(part, tn, EXL_DTYPE_I32, 2, s3, t.q_scale);
            st = st ? st : s;
            snprintf(tn, sizeof tn, "%s.q_scale_max", name);
            s = exl_qz_part_own(part, tn, EXL_DTYPE_F16, 1, s4, t.q_scale_max);
            st = st ? st : s;
            snprintf(tn, sizeof tn, "%s.q_groups", name);
            s = exl_qz_part_own(part, tn, EXL_DTYPE_I16, 1, s5, t.q_groups);
            st = st ? st : s;
        }
    } else {
        int gs = q->p->group_size > 0 && q->p->group_size < K ? q->p->group_size : (int)K;
        int32_t G = (int32_t)((K + gs - 1) / gs);
        *bits = (double)K * N * q->p->bits + (double)G * N * (16 + q->p->bits) +
                32.0 * K; /* codes, scales, zeros, g_idx */
        l.n_groups = G;
        l.bits = exl_malloc((size_t)G * sizeof(int32_t));
        l.rows = exl_malloc((size_t)G * sizeof(int32_t));
        if (!l.bits || !l.rows) {
            exl_qz_layout_free(&l);
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        }
        for (int32_t g = 0; g < G; g++) {
            l.bits[g] = q->p->bits;
            l.rows[g] = (int32_t)(K - (int64_t)g * gs < gs ? K - (int64_t)g * gs : gs);
        }
        st = exl_gptq_quantize(W, h, N, q->p->sym ? EXL_QZ_GPTQ_SYM : EXL_QZ_GPTQ_ASYM, &l, q->pool, q->be, &r);
        if (st != EXL_OK) {
            exl_qz_layout_free(&l);
            return st;
        }
        int b = q->p->bits;
        uint8_t *codes = exl_malloc((size_t)(K * N)), *zs = exl_malloc((size_t)G * N);
        int32_t *qweight = exl_malloc((size_t)(K * b / 32) * N * sizeof(int32_t));
        int32_t *qzeros = exl_malloc((size_t)G * (N * b / 32) * sizeof(int32_t));
        int32_t *g_idx = exl_malloc((size_t)K * sizeof(int32_t));
        st = codes && zs && qweight && qzeros && g_idx ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
        if (st == EXL_OK) {
            for (int64_t i = 0; i < K; i++) {
                memcpy(codes + (int64_t)r.perm[i] * N, r.codes + i * N, (size_t)N);
                g_idx[r.perm[i]] = (int32_t)(i / gs);
            }
            for (int64_t i = 0; i < G * N; i++)
                zs[i] = (uint8_t)(r.zeros[i] - 1);
            exl_gptq_pack(b, K, N, G, codes, zs, qweight, qzeros);
            uint16_t *scales = r.scales;
            r.scales = NULL;
            int64_t s1[2] = {K * b / 32, N}, s2[2] = {G, N * b / 32}, s3[2] = {G, N}, s4[1] = {K};
            snprintf(tn, sizeof tn, "%s.qweight", name);
            st = exl_qz_part_own(part, tn, EXL_DTYPE_I32, 2, s1, qweight);
            snprintf(tn, sizeof tn, "%s.qzeros", name);
            exl_status s = exl_qz_part_own(part, tn, EXL_DTYPE_I32, 2, s2, qzeros);
            st = st ? st : s;
            snprintf(tn, sizeof tn, "%s.scales", name);
            s = exl_qz_part_own(part, tn, EXL_DTYPE_F16, 2, s3, scales);
            st = st ? st : s;
            snprintf(tn, sizeof tn, "%s.g_idx", name);
            s = exl_qz_part_own(part, tn, EXL_DTYPE_I32, 1, s4, g_idx);
            st = st ? st : s;
            qweight = qzeros = g_idx = NULL;
        }
        exl_free(codes);
        exl_free(zs);
        exl_free(qweight);
        exl_free(qzeros);
        exl_free(g_idx);
    }
    if (st == EXL_OK && bias) {
        uint16_t *b16 = exl_malloc((size_t)N * sizeof(uint16_t));
        if (!b16)
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        for (int64_t n = 0; b16 && n < N; n++)
            b16[n] = exl_f32_to_f16(bias[n]);
        int64_t s1[1] = {N};
        snprintf(tn, sizeof tn, "%s.bias", name);
        if (b16)
            st = exl_qz_part_own(part, tn, EXL_DTYPE_F16, 1, s1, b16);
    }
    if (st == EXL_OK) {
        *Wq = r.Wq;
        r.Wq = NULL;
    }
    exl_qz_result_free(&r);
    exl_qz_layout_free(&l);
    return st;
}

/* ---- the measuring pass (EXL2) */

/* A linear's candidate weights, kept while candidates go on asking for the same recipe: a block's candidates come
 * level by level, its most sensitive linear one or two levels up (measure.c), so that linear asks for each level in
 * three candidates out of five in a row. Each linear keeps its last WAYS recipes as trial linears; one no candidate
 * asked for in the last KEEP candidates is dropped (the others' levels then hold one or two at a time). */
#define WAYS 4
#define KEEP 3
typedef struct wcache {
    exl_qz_opt opt;
    int32_t valid; /* 0: an empty way */
    exl_qz_trial t;
    int32_t used; /* the last candidate that asked for it */
} wcache;

static void wcache_free(qz *q, wcache *c) {
    exl_qz_prof_enter(EXL_QZ_PROF_TRIAL);
    exl_qz_trial_free(q->be, &c->t);
    exl_qz_prof_leave();
    c->valid = 0;
}

/* Recipe o of linear x into the trial linear t (made with the unquantized weights the first time): on a backend that
 * quantizes there (exl_gptq_quantize_trial) the weights never come back to the host. */
static exl_status quant_trial(qz *q, const exl_qz_opt *o, const exl_qz_lin *x, const exl_qz_hinv *h, exl_qz_trial *t) {
    int64_t N = x->src.out_features;
    exl_qz_layout l;
    exl_status st = EXL_OK;
    if (exl_gptq_trial_on_device(q->be)) {
        if (!t->w) { /* fp16 weights of the model's own (not a part of a fused one) go up as they are */
            int own = !x->part.w && x->src.kind == EXL_LINEAR_DENSE && x->src.dense.dtype == EXL_DTYPE_F16;
            exl_qz_prof_enter(EXL_QZ_PROF_TRIAL);
            st = own ? exl_qz_trial_init_as(q->be, &x->src, t) : exl_qz_trial_init(q->be, q->pool, x->W, &x->src, t);
            exl_qz_prof_leave();
        }
        if (st == EXL_OK)
            st = exl_exl2_layout(o, h->K, &l);
        if (st == EXL_OK) {
            st = exl_gptq_quantize_trial(x->W, h, N, &l, q->be, t->w);
            exl_qz_layout_free(&l);
        }
        return st;
    }
    exl_qz_result res;
    EXL_TRY(quant_exl2(q, o, x->W, h, N, &res, &l));
    exl_qz_prof_enter(EXL_QZ_PROF_TRIAL);
    st = t->w ? exl_qz_trial_set(q->be, q->pool, res.Wq, t) : exl_qz_trial_init(q->be, q->pool, res.Wq, &x->src, t);
    exl_qz_prof_leave();
    exl_qz_result_free(&res);
    exl_qz_layout_free(&l);
    return st;
}

/* The trial linear of recipe o for linear x (its ways c[0 .. WAYS)) as asked by candidate r. An empty way keeps its
 * trial linear for the next recipe (new weights, no allocation); all is freed at the end of the block. */
static exl_status cached_quant(qz *q, wcache *c, int32_t r, const exl_qz_opt *o, const exl_qz_lin *x,
                               const exl_qz_hinv *h, exl_linear **w) {
    wcache *slot = NULL;
    for (int i = 0; i < WAYS; i++)
        if (c[i].valid && !memcmp(&c[i].opt, o, sizeof *o)) {
            c[i].used = r;
            *w = c[i].t.w;
            return EXL_OK;
        }
    for (int i = 0; i < WAYS; i++) {
        if (c[i].valid && c[i].used < r - KEEP)
            c[i].valid = 0;
        if (!slot || (slot->valid && (!c[i].valid || c[i].used < slot->used))) /* an empty way, else the oldest */
            slot = &c[i];
    }
    slot->valid = 0;
    EXL_TRY(quant_trial(q, o, x, h, &slot->t));
    slot->opt = *o;
    slot->valid = 1;
    slot->used = r;
    *w = slot->t.w;
    return EXL_OK;
}

/* Candidates scored together at most (exl_qz_run_layer_errs): their trial linears must all stay cached, which KEEP
 * candidates in a row do (none of theirs is the oldest way). */
#define GROUP KEEP

/* Whether candidates that share a linear's recipe are scored together, skipping what the one before computed: on the
 * CPU (where a forward is the measuring pass's largest part), unless EXL_QUANT_SHARED_FORWARDS=0 (each alone). */
static int shared_forwards(const qz *q) {
    const char *env = getenv("EXL_QUANT_SHARED_FORWARDS");
    return exl_backend_cpu_pool(q->be) && !(env && !strcmp(env, "0"));
}

/* The weights of a block. */
static double desc_weights(const exl_qz_block_desc *d) {
    double w = 0;
    for (int32_t i = 0; i < d->n_linears; i++)
        w += (double)d->K[i] * d->N[i] * d->copies;
    return w;
}

/* The recipe of a measured block a status line shows: the most accurate within the target bits per weight (else the
 * smallest). */
static const exl_qz_recipe *shown_recipe(const qz *q, const exl_qz_block_meas *bm) {
    double w = desc_weights(bm->desc);
    const exl_qz_recipe *best = NULL, *least = NULL;
    for (int32_t r = 0; r < bm->n; r++) {
        const exl_qz_recipe *c = &bm->r[r];
        if (!least || c->total_bits < least->total_bits)
            least = c;
        if (c->total_bits <= q->p->bpw * w && (!best || c->accuracy > best->accuracy))
            best = c;
    }
    return best ? best : least;
}

/* Measure the candidates of block k (0 attention, 1 MLP) of layer l; x advances past it.
 * A candidate's accuracy is 1 - the relative error of the hidden states after the block,
 * residual included (ExLlamaV2's measure): the same output error counts for more where the
 * residual stream is still small, early in the model, where it also has the most layers
 * left to grow through. A mixture's experts all take the candidate's recipe, each quantized
 * with the Hessian of the rows routed to it. */
static exl_status measure_block(qz *q, int32_t l, int k) {
    exl_qz_layer *L = &q->layer;
    int32_t first = L->first[k], n = L->first[k + 1] - first, slots = L->n_slots[k];
    exl_qz_block_meas *bm = &q->meas.b[2 * l + k];
    bm->desc = q->block_desc[2 * l + k];
    snprintf(bm->name, sizeof bm->name, "model.layers.%d.%s", l, bm->desc->suffix);
    exl_hessian *hs = exl_calloc((size_t)slots, sizeof *hs), **h = exl_calloc((size_t)n, sizeof *h);
    exl_qz_hinv *hi = exl_calloc((size_t)slots, sizeof *hi);
    wcache *c = exl_calloc((size_t)n * WAYS, sizeof *c);
    exl_linear **own = exl_calloc((size_t)L->n, sizeof *own), **w = exl_calloc((size_t)L->n, sizeof *w);
    exl_qz_cand *cand = exl_calloc(GROUP, sizeof *cand);
    exl_status st = hs && h && hi && c && own && w && cand ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == EXL_OK && i < L->n; i++)
        own[i] = w[i] = L->lin[i].own;
    /* the unquantized block: the states after it, its Hessians */
    if (st == EXL_OK)
        st = slot_hessians(q, k, -1, hs, h);
    if (st == EXL_OK)
        st = run_block(q, k, own, q->x, q->ref, h, 0, NULL);
    for (int32_t s = 0; st == EXL_OK && s < slots; s++)
        st = hinv_of(q, &hs[s], &hi[s]);
    for (int32_t s = 0; hs && s < slots; s++)
        exl_hessian_free(&hs[s]);
    /* candidates are scored on the evaluation sequences, whose inputs and reference outputs go to the backend once */
    int64_t ne = (int64_t)q->n_eval * q->p->length * q->H;
    const float *xe = q->x, *refe = q->ref;
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    if (q->xe) {
        gather_eval(q, q->x, q->xe);
        gather_eval(q, q->ref, q->refe);
        xe = q->xe, refe = q->refe;
    }
    if (st == EXL_OK)
        st = q->be->ops->upload(q->be, q->dxe, xe, (size_t)ne * sizeof(float));
    if (st == EXL_OK)
        st = q->be->ops->upload(q->be, q->drefe, refe, (size_t)ne * sizeof(float));
    exl_qz_prof_leave();
    double norm = st == EXL_OK ? sq_norm(refe, ne) : 0; /* of the hidden states after the block */
    if (st == EXL_OK)
        st = exl_qz_candidates(bm->desc, &bm->r, &bm->n);
    /* candidates in groups of consecutive ones that share a linear's recipe, scored together */
    exl_qz_runner *run = q->xe ? &q->run_eval : &q->run;
    int32_t group = shared_forwards(q) && !L->experts && n <= EXL_QZ_CAND_SAME ? GROUP : 1;
    for (int32_t r0 = 0, m = 0; st == EXL_OK && r0 < bm->n; r0 += m) {
        for (m = 0; st == EXL_OK && m < group && r0 + m < bm->n; m++) {
            int32_t r = r0 + m;
            exl_qz_cand *cd = &cand[m];
            cd->n_same = 0;
            cd->err = 0;
            for (int32_t i = 0; st == EXL_OK && i < n; i++) {
                const exl_qz_lin *x = &L->lin[first + i];
                st = cached_quant(q, c + i * WAYS, r, &bm->r[r].opt[x->opt], x, &hi[x->hslot], &w[first + i]);
                if (m && !memcmp(&bm->r[r].opt[x->opt], &bm->r[r - 1].opt[x->opt], sizeof(exl_qz_opt)))
                    cd->same[cd->n_same++] = w[first + i];
            }
            cd->layer = exl_qz_layer_block(L, k, w);
            if (m && !cd->n_same)
                break; /* it starts the next group (its weights stay cached) */
        }
        exl_qz_prof_enter(EXL_QZ_PROF_CAND);
        if (st == EXL_OK)
            st = m == 1 ? exl_qz_run_layer_err(run, &cand[0].layer, L->li, q->dxe, q->drefe, &cand[0].err)
                        : exl_qz_run_layer_errs(run, cand, m, L->li, q->dxe, q->drefe);
        exl_qz_prof_leave();
        for (int32_t j = 0; st == EXL_OK && j < m; j++)
            bm->r[r0 + j].accuracy = accuracy_from(cand[j].err, norm);
        if (st == EXL_OK)
            exl_qz_clock_step(&q->clock, (k + (double)(r0 + m) / bm->n) / 2);
    }
    for (int32_t i = 0; c && i < n * WAYS; i++)
        wcache_free(q, &c[i]);
    for (int32_t s = 0; hi && s < slots; s++)
        exl_qz_hinv_free(&hi[s]);
    exl_free(hs);
    exl_free(h);
    exl_free(hi);
    exl_free(c);
    exl_free(own);
    exl_free(w);
    exl_free(cand);
    if (st == EXL_OK) {
        float *t = q->x; /* the states after the block become the next block's input */
        q->x = q->ref;
        q->ref = t;
        q->meas.n_blocks = 2 * l + k + 1;
        const exl_qz_recipe *shown = shown_recipe(q, bm);
        exl_qz_clock_block(&q->clock, k, bm->desc->suffix, shown->accuracy, shown->total_bits / desc_weights(bm->desc));
    }
    return st;
}

/* ---- the quantizing pass */

/* The linear after which block k's output is its input plus that linear's output (its only stage-1 linear, o_proj
 * or down_proj, with no post-norm and not in a mixture), where the quantizing pass takes the quantized block's
 * output from that linear's inputs kept in the run before (tail_output): on the CPU, whose backend memory is the
 * host's, and for inputs of at most 2 GiB; -1 otherwise (the block runs once more). */
static int32_t tail_linear(const qz *q, int k) {
    const exl_qz_layer *L = &q->layer;
    const exl_layer *ml = &q->m->layers[L->li];
    if (!exl_backend_cpu_pool(q->be) || rtn(q) || (k ? L->experts || ml->post_mlp_norm : ml->post_attn_norm != NULL))
        return -1;
    int32_t tail = -1;
    for (int32_t i = L->first[k]; i < L->first[k + 1]; i++)
        if (L->lin[i].stage == 1) {
            if (tail >= 0)
                return -1;
            tail = i;
        }
    return tail >= 0 && q->T * L->lin[tail].src.in_features <= ((int64_t)1 << 29) ? tail : -1;
}

/* x += the tail linear w's output over its inputs keep [T, K], in the runner's steps: what running the block again
 * with every linear quantized would give (the same inputs to w, its output added to the residual stream). */
static exl_status tail_output(qz *q, const exl_linear *w, const float *keep, int64_t K) {
    exl_backend *be = q->be;
    int64_t step = (int64_t)q->run.seqs_per_step * q->run.piece;
    float *out = exl_malloc((size_t)(step * q->H) * sizeof(float));
    if (!out)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_qz_prof_enter(EXL_QZ_PROF_CALIB);
    for (int64_t r0 = 0; r0 < q->T; r0 += step) {
        int32_t rows = (int32_t)(q->T - r0 < step ? q->T - r0 : step);
        be->ops->matmul(be, out, keep + r0 * K, w, rows);
        be->ops->add(be, q->x + r0 * q->H, out, (int64_t)rows * q->H);
    }
    exl_status st = be->ops->synchronize(be);
    exl_qz_prof_leave();
    exl_free(out);
    return st;
}

/* Quantize block k of layer l into the part: the stage-0 linears (q, k, v; gate, up; each expert's gate and up)
 * from the block's input, the stage-1 linears (o; down) from the outputs of the quantized stage 0; x advances past
 * the block with all of them quantized. The block's accuracy: against the unquantized block on the same input. */
static exl_status quant_block(qz *q, exl_qz_part *part, int32_t l, int k) {
    exl_qz_layer *L = &q->layer;
    int32_t first = L->first[k], n = L->first[k + 1] - first, slots = L->n_slots[k];
    const exl_qz_recipe *rc = q->choice ? &q->meas.b[2 * l + k].r[q->choice[2 * l + k]] : NULL;
    exl_hessian *hs = exl_calloc((size_t)slots, sizeof *hs), **h = exl_calloc((size_t)n, sizeof *h);
    exl_qz_hinv *hi = exl_calloc((size_t)slots, sizeof *hi);
    exl_qz_trial *t = exl_calloc((size_t)n, sizeof *t);
    float **Wq = exl_calloc((size_t)n, sizeof *Wq);
    exl_linear **w = exl_calloc((size_t)L->n, sizeof *w);
    exl_status st = hs && h && hi && t && Wq && w ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == EXL_OK && i < L->n; i++)
        w[i] = L->lin[i].own;
    double bits = 0, weights = 0;
    int32_t tail = st == EXL_OK ? tail_linear(q, k) : -1;
    float *keep = tail >= 0 ? exl_malloc((size_t)(q->T * L->lin[tail].src.in_features) * sizeof(float)) : NULL;
    for (int stage = 0; stage < 2 && st == EXL_OK; stage++) {
        st = slot_hessians(q, k, stage, hs, h);
        /* stage 0 runs the unquantized block: its output is the reference */
        if (st == EXL_OK && !rtn(q))
            st = run_block(q, k, w, q->x, stage ? NULL : q->ref, h, tail, stage ? keep : NULL);
        for (int32_t i = 0; i < n && st == EXL_OK; i++) {
            const exl_qz_lin *x = &L->lin[first + i];
            if (x->stage != stage)
                continue;
            if (!hi[x->hslot].U && hs[x->hslot].H) {
                st = hinv_of(q, &hs[x->hslot], &hi[x->hslot]);
                exl_hessian_free(&hs[x->hslot]);
            }
            double b = 0;
            if (st == EXL_OK)
                st = emit_linear(q, part, x->name, x->W, x->bias, &hi[x->hslot], x->src.out_features,
                                 rc ? &rc->opt[x->opt] : NULL, &Wq[i], &b);
            bits += b;
            weights += (double)x->src.in_features * x->src.out_features;
            exl_qz_prof_enter(EXL_QZ_PROF_TRIAL);
            if (st == EXL_OK && !rtn(q))
                st = exl_qz_trial_init(q->be, q->pool, Wq[i], &x->src, &t[i]);
            exl_qz_prof_leave();
            if (st == EXL_OK && !rtn(q))
                w[first + i] = t[i].w;
            exl_qz_clock_step(&q->clock, (k + (double)(i + 1) / n) / 2);
        }
    }
    double acc = -1;
    if (st == EXL_OK && !rtn(q)) {
        st = keep ? tail_output(q, w[tail], keep, L->lin[tail].src.in_features)
                  : run_block(q, k, w, q->x, q->x, NULL, 0, NULL);
        exl_qz_prof_enter(EXL_QZ_PROF_ACCURACY);
        acc = accuracy_of(q->x, q->ref, q->T * q->H, sq_norm(q->ref, q->T * q->H));
        exl_qz_prof_leave();
    }
    if (st == EXL_OK)
        exl_qz_clock_block(&q->clock, k, q->block_desc[2 * l + k]->suffix, acc, bits / weights);
    for (int32_t s = 0; hs && s < slots; s++) {
        exl_hessian_free(&hs[s]);
        exl_qz_hinv_free(&hi[s]);
    }
    for (int32_t i = 0; t && i < n; i++) {
        exl_qz_trial_free(q->be, &t[i]);
        exl_free(Wq[i]);
    }
    exl_free(hs);
    exl_free(h);
    exl_free(hi);
    exl_free(t);
    exl_free(Wq);
    exl_free(w);
    exl_free(keep);
    return st;
}

static exl_status quant_layer(qz *q, int32_t l) {
    exl_qz_part part;
    EXL_TRY(exl_qz_part_init(&part));
    exl_status st = quant_block(q, &part, l, 0);
    if (st == EXL_OK)
        st = quant_block(q, &part, l, 1);
    char *path = layer_path(q, l);
    if (st == EXL_OK)
        st = path ? exl_qz_part_write(&part, path) : exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_free(path);
    exl_qz_part_free(&part);
    return st;
}

/* Whether w is a linear the quantizer leaves as it is: a mixture's router (and Qwen2-MoE's shared-expert gate). */
static int kept_linear(const qz *q, const exl_linear *w) {
    for (int32_t l = 0; l < q->cfg.n_layers; l++)
        if (w == q->m->layers[l].router || w == q->m->layers[l].shared_gate)
            return 1;
    return 0;
}

/* A tensor of the input that a quantized linear replaces: the weight or bias of a decoder layer's linear (routers
 * excepted), or of the head when EXL2 quantizes it. */
static int replaced(const qz *q, const exl_st_tensor *t) {
    for (int32_t i = 0; i < q->m->n_linears; i++) {
        const exl_linear_record *r = &q->m->linears[i];
        if ((r->w == q->m->head && q->p->format != EXL_QUANT_EXL2) || kept_linear(q, r->w))
            continue;
        if (t->data == r->src.dense.data || (r->src.bias && t->data == r->src.bias))
            return 1;
    }
    return 0;
}

/* Every tensor no quantized linear replaces (embeddings, norms, an unquantized head), and the head quantized
 * (EXL2: even when tied to the embeddings). */
static exl_status write_head(qz *q) {
    exl_qz_part part;
    EXL_TRY(exl_qz_part_init(&part));
    exl_status st = EXL_OK;
    const exl_weights *wt = q->m->weights;
    for (int f = 0; f < wt->n_files && st == EXL_OK; f++)
        for (int i = 0; i < wt->files[f]->n_tensors && st == EXL_OK; i++)
            if (!replaced(q, &wt->files[f]->tensors[i]))
                st = exl_qz_part_copy(&part, wt, wt->files[f]->tensors[i].name);
    if (st == EXL_OK && q->p->format == EXL_QUANT_EXL2) {
        const char *prefix;
        exl_linear_src src;
        float *W = NULL, *bias = NULL, *Wq = NULL;
        exl_hessian h = {0};
        exl_qz_hinv hi = {0};
        st = exl_model_linear_source(q->m, q->m->head, &prefix, &src);
        if (st == EXL_OK)
            st = exl_qz_load_linear(&src, &W, &bias);
        if (st == EXL_OK)
            st = exl_hessian_init(&h, q->H);
        const exl_linear *want[1] = {q->m->head};
        exl_hessian *hp[1] = {&h};
        exl_qz_capture cap = {&q->run, 1, want, hp, NULL, NULL, 0};
        if (st == EXL_OK)
            st = exl_qz_run_head(&q->run, q->x, exl_qz_capture_inputs, &cap);
        if (st == EXL_OK)
            st = hinv_of(q, &h, &hi);
        exl_qz_opt o = {1, {q->p->head_bits}, {1}, {32}};
        double bits = 0;
        if (st == EXL_OK)
            st = emit_linear(q, &part, prefix, W, NULL, &hi, q->cfg.vocab_size, &o, &Wq, &bits);
        exl_hessian_free(&h);
        exl_qz_hinv_free(&hi);
        exl_free(W);
        exl_free(bias);
        exl_free(Wq);
    }
    char *path = work_path(q, "head.safetensors");
    if (st == EXL_OK)
        st = path ? exl_qz_part_write(&part, path) : exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_free(path);
    exl_qz_part_free(&part);
    return st;
}

/* ---- state of a run (resumable) */

static exl_status save_state(qz *q, int pass, int32_t next) {
    exl_qz_prof_enter(EXL_QZ_PROF_SAVE);
    char *xs = work_path(q, "states.bin"), *sj = work_path(q, "state.json"), tmp[4200];
    exl_status st = xs && sj ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK) {
        snprintf(tmp, sizeof tmp, "%s.tmp", xs);
        FILE *f = fopen(tmp, "wb");
        int ok = f && fwrite(q->x, sizeof(float), (size_t)(q->T * q->H), f) == (size_t)(q->T * q->H);
        ok = f && !fclose(f) && ok;
        if (!ok || rename(tmp, xs))
            st = exl_fail(EXL_ERR_IO, "%s: cannot write", xs);
    }
    if (st == EXL_OK) {
        cJSON *j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "parameters", q->sig);
        cJSON_AddNumberToObject(j, "pass", pass);
        cJSON_AddNumberToObject(j, "next_layer", next);
        st = exl_qz_write_json(j, sj);
        cJSON_Delete(j);
    }
    exl_free(xs);
    exl_free(sj);
    exl_qz_prof_leave();
    return st;
}

/* 1 with *pass, *next and q->x when OUT_DIR holds a run with the same parameters. */
static exl_status load_state(qz *q, int *found, int *pass, int32_t *next) {
    char *sj = work_path(q, "state.json"), *xs = work_path(q, "states.bin");
    *found = 0;
    cJSON *j = NULL;
    exl_status st = sj && xs ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK && exl_file_exists(sj) && exl_json_read_file(sj, &j) == EXL_OK) {
        const cJSON *ps = cJSON_GetObjectItemCaseSensitive(j, "parameters");
        const cJSON *pa = cJSON_GetObjectItemCaseSensitive(j, "pass"),
                    *nx = cJSON_GetObjectItemCaseSensitive(j, "next_layer");
        if (!cJSON_IsString(ps) || strcmp(ps->valuestring, q->sig) || !cJSON_IsNumber(pa) || !cJSON_IsNumber(nx))
            st = exl_fail(EXL_ERR_STATE,
                          "%s holds an unfinished run with other parameters (%s); remove it or repeat them",
                          q->p->out_dir, cJSON_IsString(ps) ? ps->valuestring : "?");
        else {
            FILE *f = fopen(xs, "rb");
            int ok = f && fread(q->x, sizeof(float), (size_t)(q->T * q->H), f) == (size_t)(q->T * q->H);
            if (f)
                fclose(f);
            if (!ok)
                st = exl_fail(EXL_ERR_IO, "%s: missing or truncated", xs);
            *found = ok;
            *pass = pa->valueint;
            *next = nx->valueint;
        }
    }
    cJSON_Delete(j);
    exl_free(sj);
    exl_free(xs);
    return st;
}

static int dir_is_empty(const char *path) {
    DIR *d = opendir(path);
    if (!d)
        return 1;
    struct dirent *e;
    int empty = 1;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            empty = 0;
    closedir(d);
    return empty;
}

static exl_status remove_work(qz *q, int32_t n_layers) {
    for (int32_t l = -4; l < n_layers; l++) {
        static const char *const extra[] = {"states.bin", "state.json", "measurement.json", "head.safetensors"};
        char *path = l < 0 ? work_path(q, extra[l + 4]) : layer_path(q, l);
        if (path)
            unlink(path);
        exl_free(path);
    }
    return rmdir(q->work) ? exl_fail(EXL_ERR_IO, "%s: cannot remove", q->work) : EXL_OK;
}

/* ---- setup and the passes */

static exl_status setup(qz *q) {
    const exl_quantize_params *p = q->p;
    if (!p->in_dir || !p->out_dir)
        return exl_fail(EXL_ERR_ARG, "quantize: need an input and an output directory");
    EXL_TRY(exl_hf_config_load(p->in_dir, &q->cfg));
    q->clock.n_layers = q->cfg.n_layers;
    if (q->cfg.quant.present)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s is already quantized (%s); give an unquantized model", p->in_dir,
                        q->cfg.quant.method);
    char gap[96];
    quant_gap(&q->cfg, gap, sizeof gap);
    if (gap[0])
        return exl_fail(
            EXL_ERR_UNSUPPORTED,
            "%s: a %s model: the quantizer takes attention of q, k, v, o and MLPs or experts of gate, up, down, not %s",
            p->in_dir, q->cfg.model_type, gap);
    if (p->format == EXL_QUANT_EXL2 && (p->head_bits < 2 || p->head_bits > 8 || p->head_bits == 7))
        return exl_fail(EXL_ERR_ARG, "head bits must be 2-6 or 8 (got %d)", p->head_bits);
    if (p->format == EXL_QUANT_GPTQ && p->bits != 2 && p->bits != 3 && p->bits != 4 && p->bits != 8)
        return exl_fail(EXL_ERR_ARG, "GPTQ bits must be 2, 3, 4 or 8 (got %d)", p->bits);
    if (p->rows < 1 || p->length < 2)
        return exl_fail(EXL_ERR_ARG, "calibration needs rows >= 1 and length >= 2");
    const exl_hf_config *c = &q->cfg;
    q->H = c->hidden_size;
    q->T = (int64_t)p->rows * p->length;
    int64_t H = q->H, qw = (int64_t)c->n_heads * c->head_dim, kvw = (int64_t)c->n_kv_heads * c->head_dim,
            F = c->intermediate_size, E = c->moe.expert_ffn;
    /* the blocks as measurement.json names them (ExLlamaV2's module keys) */
    q->desc[0] = (exl_qz_block_desc){"self_attn",       4, {"q_proj", "k_proj", "v_proj", "o_proj"}, {H, H, H, qw},
                                     {qw, kvw, kvw, H}, 1};
    q->desc[1] = (exl_qz_block_desc){"mlp", 3, {"gate_proj", "up_proj", "down_proj"}, {H, H, F}, {F, F, H}, 1};
    q->desc[2] = (exl_qz_block_desc){"block_sparse_moe", 3, {"w1", "w3", "w2"}, {H, H, E}, {E, E, H}, c->moe.n_experts};
    if (!(q->block_desc = exl_calloc((size_t)c->n_layers * 2, sizeof *q->block_desc)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; l < c->n_layers; l++) {
        q->block_desc[2 * l] = &q->desc[0];
        q->block_desc[2 * l + 1] = &q->desc[c->layers[l].moe ? 2 : 1];
    }
    int used[3] = {1, 0, 0};
    for (int32_t l = 0; l < c->n_layers; l++)
        used[c->layers[l].moe ? 2 : 1] = 1;
    for (int k = 0; k < 3; k++) {
        const exl_qz_block_desc *d = &q->desc[k];
        if (!used[k])
            continue;
        for (int32_t i = 0; i < d->n_linears; i++)
            if (p->format == EXL_QUANT_EXL2 ? d->K[i] % 32 : (d->K[i] % 32 || d->N[i] * p->bits % 32))
                return exl_fail(EXL_ERR_UNSUPPORTED,
                                "%s: %s has %lld x %lld features; the packed layout needs multiples of 32", p->in_dir,
                                d->names[i], (long long)d->K[i], (long long)d->N[i]);
    }
    exl_str sig = EXL_STR_INIT;
    char *in_abs = realpath(p->in_dir, NULL); /* a run is resumed only on the model it started on */
    exl_str_printf(&sig, "model=%s layers=%d hidden=%d vocab=%d ", in_abs ? in_abs : p->in_dir, q->cfg.n_layers,
                   q->cfg.hidden_size, q->cfg.vocab_size);
    free(in_abs);
    if (p->format == EXL_QUANT_EXL2)
        exl_str_printf(&sig, "exl2 bpw=%.4f head_bits=%d measurement=%s", p->bpw, p->head_bits,
                       p->measurement ? p->measurement : "-");
    else
        exl_str_printf(&sig, "gptq bits=%d group_size=%d act_order=%d sym=%d rtn=%d", p->bits, p->group_size,
                       p->act_order, p->sym, p->rtn);
    exl_str_printf(&sig, " rows=%d length=%d", p->rows, p->length);
    for (int32_t i = 0; i < p->n_calibration; i++)
        exl_str_printf(&sig, " %s", p->calibration[i]);
    snprintf(q->sig, sizeof q->sig, "%s", sig.data ? sig.data : "");
    exl_str_free(&sig);
    if (!(q->work = exl_path_join(p->out_dir, ".exl-quant")))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    /* on the GPU when the device parameter gets one (AUTO without a GPU: the CPU, silently; CUDA
     * without one: the error) */
    exl_model_params mp = exl_model_default_params();
    mp.device = p->device;
    mp.n_threads = p->n_threads;
    EXL_TRY(exl_model_load(p->in_dir, &mp, &q->m));
    q->be = q->m->be;
    exl_qz_prof_init(q->be);
    /* GPTQ's own parallel work: on the CPU backend's threads where the model runs on the CPU */
    if (!(q->pool = exl_backend_cpu_pool(q->be))) {
        EXL_TRY(exl_pool_init(p->n_threads, &q->own_pool));
        q->pool = q->own_pool;
    }
    exl_str_printf(&q->report, "device: %s\n", q->be->name);
    EXL_TRY(exl_qz_runner_init(&q->run, q->m, p->rows, p->length));
    q->run.tick = exl_qz_clock_tick;
    q->run.tick_user = &q->clock;
    size_t states = (size_t)(q->T * q->H) * sizeof(float);
    if (!(q->x = exl_malloc(states)) || !(q->ref = exl_malloc(states)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory for %lld hidden states", (long long)q->T);
    q->n_eval = p->rows < EVAL_SEQS ? p->rows : EVAL_SEQS;
    size_t eval = (size_t)q->n_eval * (size_t)p->length * (size_t)q->H * sizeof(float);
    if (p->format == EXL_QUANT_EXL2 &&
        (!(q->dxe = q->be->ops->alloc(q->be, eval)) || !(q->drefe = q->be->ops->alloc(q->be, eval))))
        return exl_fail(EXL_ERR_NOMEM, "out of %s memory for the evaluation rows", q->be->name);
    if (p->format == EXL_QUANT_EXL2 && q->n_eval < p->rows) {
        if (!(q->xe = exl_malloc(eval)) || !(q->refe = exl_malloc(eval)))
            return exl_fail(EXL_ERR_NOMEM, "out of memory for the evaluation rows");
        EXL_TRY(exl_qz_runner_init(&q->run_eval, q->m, q->n_eval, p->length));
        q->run_eval.tick = exl_qz_clock_tick;
        q->run_eval.tick_user = &q->clock;
    }
    if (!(q->meas.b = exl_calloc((size_t)c->n_layers * 2, sizeof *q->meas.b)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    return EXL_OK;
}

/* x = the calibration rows' embeddings (zeros when rounding to nearest). */
static exl_status embed_rows(qz *q) {
    int32_t *ids = NULL;
    if (rtn(q)) {
        memset(q->x, 0, (size_t)(q->T * q->H) * sizeof(float));
        return EXL_OK;
    }
    exl_qz_clock_stage(&q->clock, "calibrating", 0);
    EXL_TRY(exl_qz_calibration(q->p->in_dir, q->p->calibration, q->p->n_calibration, q->p->rows, q->p->length,
                               q->cfg.vocab_size, &ids, NULL, NULL));
    exl_status st = exl_qz_run_embed(&q->run, ids, q->x);
    exl_free(ids);
    return st;
}

static const char *base_name(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

/* quantization_config.calibration: rows and length, and every file (its name, the rows whose window starts in it,
 * its tokens), and the rows of random tokens. */
static exl_status add_calibration(qz *q, cJSON *qc) {
    const exl_quantize_params *p = q->p;
    int32_t *ids = NULL, *rows = exl_calloc((size_t)p->n_calibration + 1, sizeof *rows);
    int64_t *tokens = exl_calloc((size_t)p->n_calibration + 1, sizeof *tokens);
    exl_status st = rows && tokens ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK)
        st = exl_qz_calibration(p->in_dir, p->calibration, p->n_calibration, p->rows, p->length, q->cfg.vocab_size,
                                &ids, rows, tokens);
    if (st == EXL_OK) {
        cJSON *cal = cJSON_AddObjectToObject(qc, "calibration");
        cJSON_AddNumberToObject(cal, "rows", p->rows);
        cJSON_AddNumberToObject(cal, "length", p->length);
        cJSON_AddStringToObject(cal, "dataset", p->n_calibration == 1 ? base_name(p->calibration[0]) : "(files)");
        cJSON *files = cJSON_AddArrayToObject(cal, "files");
        for (int32_t f = 0; f < p->n_calibration; f++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddStringToObject(e, "name", base_name(p->calibration[f]));
            cJSON_AddNumberToObject(e, "rows", rows[f]);
            cJSON_AddNumberToObject(e, "length", p->length);
            cJSON_AddNumberToObject(e, "tokens", (double)tokens[f]);
            cJSON_AddItemToArray(files, e);
        }
        cJSON_AddNumberToObject(cal, "random_rows", rows[p->n_calibration]);
    }
    exl_free(ids);
    exl_free(rows);
    exl_free(tokens);
    return st;
}

static exl_status finish(qz *q) {
    const exl_quantize_params *p = q->p;
    int32_t L = q->cfg.n_layers;
    char **parts = exl_calloc((size_t)L + 1, sizeof *parts);
    exl_status st = parts ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; l <= L && st == EXL_OK; l++)
        if (!(parts[l] = l < L ? layer_path(q, l) : work_path(q, "head.safetensors")))
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    char *out = exl_path_join(p->out_dir, p->format == EXL_QUANT_EXL2 ? "output.safetensors" : "model.safetensors");
    progress(q, "writing", 0, 1);
    if (st == EXL_OK)
        st = out ? exl_qz_merge(parts, L + 1, out) : exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t l = 0; parts && l <= L; l++)
        exl_free(parts[l]);
    exl_free(parts);
    exl_free(out);
    if (st == EXL_OK)
        st = exl_qz_copy_files(p->in_dir, p->out_dir);
    cJSON *qc = cJSON_CreateObject();
    if (p->format == EXL_QUANT_EXL2) {
        cJSON_AddStringToObject(qc, "quant_method", "exl2");
        cJSON_AddStringToObject(qc, "version", "0.3.2");
        cJSON_AddNumberToObject(qc, "bits", p->bpw);
        cJSON_AddNumberToObject(qc, "head_bits", p->head_bits);
        if (st == EXL_OK)
            st = add_calibration(q, qc);
    } else {
        cJSON_AddStringToObject(qc, "quant_method", "gptq");
        cJSON_AddNumberToObject(qc, "bits", p->bits);
        cJSON_AddNumberToObject(qc, "group_size", p->group_size);
        cJSON_AddBoolToObject(qc, "desc_act", p->act_order);
        cJSON_AddBoolToObject(qc, "sym", p->sym);
        cJSON_AddStringToObject(qc, "checkpoint_format", "gptq");
        if (st == EXL_OK && !rtn(q))
            st = add_calibration(q, qc);
        char *qp = exl_path_join(p->out_dir, "quantize_config.json");
        if (st == EXL_OK)
            st = qp ? exl_qz_write_json(qc, qp) : exl_fail(EXL_ERR_NOMEM, "out of memory");
        exl_free(qp);
    }
    if (st == EXL_OK)
        st = exl_qz_write_config(p->in_dir, p->out_dir, qc);
    else
        cJSON_Delete(qc);
    if (st == EXL_OK)
        st = remove_work(q, L);
    progress(q, "writing", 1, 1);
    return st;
}

static void report_choice(qz *q) {
    double bits = 0, weights = 0;
    for (int32_t b = 0; b < q->meas.n_blocks; b++) {
        const exl_qz_recipe *r = &q->meas.b[b].r[q->choice[b]];
        const exl_qz_block_desc *d = q->meas.b[b].desc;
        double w = desc_weights(d);
        bits += r->total_bits;
        weights += w;
        exl_str_printf(&q->report, "%-28s %.3f bpw, accuracy %.4f:", q->meas.b[b].name, r->total_bits / w, r->accuracy);
        for (int32_t i = 0; i < d->n_linears; i++) {
            exl_str_printf(&q->report, " %s", d->names[i]);
            for (int32_t k = 0; k < r->opt[i].n; k++)
                exl_str_printf(&q->report, "%s%d", k ? "/" : "=", r->opt[i].bits[k]);
        }
        exl_str_puts(&q->report, "\n");
    }
    exl_str_printf(&q->report, "decoder layers: %.4f bits per weight (target %.4f)\n", bits / weights, q->p->bpw);
}

static exl_status run(qz *q) {
    const exl_quantize_params *p = q->p;
    int32_t L = q->cfg.n_layers;
    int found = 0, pass = 0;
    int32_t next = 0;
    struct stat sb;
    if (!stat(q->work, &sb))
        EXL_TRY(load_state(q, &found, &pass, &next));
    if (!found && !dir_is_empty(p->out_dir))
        return exl_fail(EXL_ERR_STATE, "%s: the output directory is not empty", p->out_dir);
    exl_qz_clock_plan(&q->clock,
                      found                                            ? (pass == 0 ? next : L)
                      : p->format == EXL_QUANT_EXL2 && !p->measurement ? 0
                                                                       : L,
                      found && pass == 1 ? next : 0);
    if (!found) {
        EXL_TRY(embed_rows(q));
        if ((mkdir(p->out_dir, 0777) && errno != EEXIST) || (mkdir(q->work, 0777) && errno != EEXIST))
            return exl_fail(EXL_ERR_IO, "%s: cannot create the directory", q->work);
        pass = p->format == EXL_QUANT_EXL2 && !p->measurement ? 0 : 1;
        next = 0;
        EXL_TRY(save_state(q, pass, next));
    }
    char *mpath = work_path(q, "measurement.json");
    if (!mpath)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    const char *msrc = p->measurement ? p->measurement : mpath;
    exl_status st = EXL_OK;
    if (p->format == EXL_QUANT_EXL2 && (p->measurement || (pass == 0 && next > 0) || pass == 1)) {
        int32_t done;
        exl_qz_measurement_free(&q->meas);
        st = exl_qz_measurement_load(msrc, q->block_desc, L, &q->meas, &done);
        if (st == EXL_OK && (pass == 1 ? done < L : done < next))
            st = exl_fail(EXL_ERR_FORMAT, "%s: measures %d of %d layers", msrc, done, pass == 1 ? L : next);
        if (st == EXL_OK && pass == 0)
            q->meas.n_blocks = 2 * next;
        if (st == EXL_OK && !(q->meas.b = exl_realloc(q->meas.b, (size_t)L * 2 * sizeof *q->meas.b)))
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        if (st == EXL_OK)
            memset(q->meas.b + q->meas.n_blocks, 0, (size_t)(2 * L - q->meas.n_blocks) * sizeof *q->meas.b);
    }
    for (int32_t l = next; st == EXL_OK && pass == 0 && l < L; l++) {
        progress(q, "measuring", l, L);
        exl_qz_clock_stage(&q->clock, "measuring", l);
        st = load_layer(q, l);
        if (st == EXL_OK)
            st = measure_block(q, l, 0);
        if (st == EXL_OK)
            st = measure_block(q, l, 1);
        free_layer(q);
        /* a layer is reported once a run killed after it goes on from the next (the last: from its
         * measurement.json, the states of the next pass not made yet) */
        exl_qz_prof_enter(EXL_QZ_PROF_SAVE);
        if (st == EXL_OK)
            st = exl_qz_measurement_save(&q->meas, l, mpath);
        exl_qz_prof_leave();
        if (st == EXL_OK && l + 1 < L)
            st = save_state(q, 0, l + 1);
        if (st == EXL_OK)
            exl_qz_clock_layer_done(&q->clock);
        exl_qz_prof_report("measuring", l);
        if (st == EXL_OK && l + 1 == L) {
            progress(q, "measuring", L, L);
            char *final = exl_path_join(p->out_dir, "measurement.json");
            st = final ? exl_qz_measurement_save(&q->meas, L, final) : exl_fail(EXL_ERR_NOMEM, "out of memory");
            exl_free(final);
            exl_qz_clock_plan(&q->clock, L, 0);
            if (st == EXL_OK)
                st = embed_rows(q);
            if (st == EXL_OK)
                st = save_state(q, 1, 0);
            pass = 1;
            next = 0;
        }
    }
    if (st == EXL_OK && p->format == EXL_QUANT_EXL2) {
        if (!(q->choice = exl_malloc((size_t)L * 2 * sizeof(int32_t))))
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        double weights = 0;
        for (int32_t b = 0; b < 2 * L; b++)
            weights += desc_weights(q->block_desc[b]);
        if (st == EXL_OK && (st = exl_qz_optimize(&q->meas, p->bpw * weights, q->choice)) != EXL_OK)
            st = exl_fail(EXL_ERR_ARG,
                          "%.3f bits per weight cannot be reached: the smallest candidate recipes need more", p->bpw);
        if (st == EXL_OK)
            report_choice(q);
    }
    for (int32_t l = next; st == EXL_OK && l < L; l++) {
        progress(q, "quantizing", l, L);
        exl_qz_clock_stage(&q->clock, "quantizing", l);
        st = load_layer(q, l);
        if (st == EXL_OK)
            st = quant_layer(q, l);
        free_layer(q);
        if (st == EXL_OK)
            st = save_state(q, 1, l + 1);
        if (st == EXL_OK)
            exl_qz_clock_layer_done(&q->clock);
        exl_qz_prof_report("quantizing", l);
    }
    if (st == EXL_OK) {
        progress(q, "quantizing", L, L);
        exl_qz_clock_stage(&q->clock, "head", L);
        st = write_head(q);
        exl_qz_prof_report("head", L);
    }
    if (st == EXL_OK) {
        exl_qz_clock_stage(&q->clock, "writing", L);
        st = finish(q);
    }

    exl_free(mpath);
    return st;
}

exl_quantize_params exl_quantize_default_params(void) {
    return (exl_quantize_params){.format = EXL_QUANT_EXL2,
                                 .bpw = 4.0,
                                 .head_bits = 6,
                                 .bits = 4,
                                 .group_size = 128,
                                 .rows = 32,
                                 .length = 512,
                                 .device = EXL_DEVICE_AUTO};
}

exl_status exl_quantize(const exl_quantize_params *params, char **report) {
    if (report)
        *report = NULL;
    qz q = {0};
    q.p = params;
    exl_qz_clock_init(&q.clock, params, 0);
    exl_status st = setup(&q);
    if (st == EXL_OK)
        st = run(&q);
    if (st == EXL_OK && report)
        *report = exl_str_steal(&q.report);
    exl_str_free(&q.report);
    free_layer(&q);
    exl_free(q.choice);
    exl_qz_measurement_free(&q.meas);
    exl_free(q.x);
    exl_free(q.ref);
    exl_qz_runner_free(&q.run);
    exl_qz_runner_free(&q.run_eval);
    exl_free(q.xe);
    exl_free(q.refe);
    if (q.dxe)
        q.be->ops->free(q.be, q.dxe);
    if (q.drefe)
        q.be->ops->free(q.be, q.drefe);
    exl_free(q.block_desc);
    exl_qz_prof_init(NULL);
    exl_model_free(q.m);
    if (q.own_pool)
        exl_pool_free(q.own_pool);
    exl_free(q.work);
    return st;
}
