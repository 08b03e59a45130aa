/* qz.h - the quantizer's internal pieces (the converter behind exl_quantize).
 *
 *   hessian.c     H = 2/n · XᵀX of a linear's calibration inputs
 *   qz_atb.c      C += alpha·AᵀB on the CPU's threads (the Hessians' XᵀX, GPTQ's updates)
 *   gptq.c        GPTQ (Frantar et al. 2022): rows of W[K, N] quantized one after another in
 *                 act-order, the error of each spread over the rows not yet quantized through
 *                 the upper Cholesky factor of the damped H⁻¹, group by group in blocks of at
 *                 most 128 rows; EXL2 or GPTQ scales
 *   exl2_quant.c  EXL2 recipes (bit widths, row proportions, group sizes) -> group layout,
 *                 bit counts, packed tensors
 *   measure.c     the candidate recipes of each block and their measured output error
 *   optimize.c    one recipe per block within the bits budget
 *   qz_json.c     measurement.json read / write, config.json quantization_config
 *   calib.c       calibration text (and a few rows of random tokens) -> rows of token ids
 *   calib_run.c   the calibration rows through the model's own layers, a hook on their linears; candidates that
 *                 share linears scored together
 *   trial_linear.c  backend linears from the weights being tried
 *   qz_layer.c    a decoder layer's linears under ExLlamaV2's names (fused ones split, experts one by one)
 *   qz_status.c   progress: the stage, the layer, time so far and an estimate of what is left
 *   qz_prof.c     EXL_QUANT_PROFILE: where the wall time of each layer went
 *   quantize.c    the driver: layer by layer, resumable, writing OUT_DIR
 *
 * Weights are W[k, n] (in x out) fp32 while being quantized. The big products (the Hessian's
 * XᵀX, GPTQ's update of the rows after a block) are the backend's host_gemm (the CPU's or the
 * GPU's, in fp32 either way); a large GPTQ on a GPU keeps its rows there (the backend's gemm), and an EXL2 one runs
 * there whole (the backend's qz_exl2_scales and qz_rows). On a GPU the Hessians are summed there (its gemm), factored
 * there (qz_factor), and the measuring pass's candidates written into their trial linears there (qz_set_trial). */
#ifndef EXL_QUANT_QZ_H
#define EXL_QUANT_QZ_H

#include "backend/backend.h"
#include "base/threads.h"
#include "exl.h"
#include "io/weights.h"
#include "model/model.h"

#include <stdint.h>

#include <cjson/cJSON.h>

/* ---- Hessian */

typedef struct exl_hessian {
    int64_t K;
    int64_t n;       /* rows accumulated */
    float *H;        /* [K, K], sum of x xᵀ until exl_hessian_finish scales it by 2/n */
    exl_backend *be; /* where dev lives */
    float *dev;      /* [K, K] the sum on a backend (exl_hessian_add_on) until exl_hessian_finish, or NULL */
} exl_hessian;

exl_status exl_hessian_init(exl_hessian *h, int64_t K);
/* x: host rows */
exl_status exl_hessian_add(exl_hessian *h, const float *x, int64_t rows, exl_backend *be);
/* x: rows in be's memory, summed there by its gemm (a Hessian takes its rows one way or the other, not both) */
exl_status exl_hessian_add_on(exl_hessian *h, const float *x, int64_t rows, exl_backend *be);
exl_status exl_hessian_finish(exl_hessian *h);
/* The identity (round to nearest through the same code path). */
void exl_hessian_identity(exl_hessian *h);
void exl_hessian_free(exl_hessian *h);

/* C [M, N] (row-major, ldc) += alpha·AᵀB for A [rows, M] (lda) and B [rows, N] (ldb), on the pool's threads (qz_atb.c);
 * upper (M == N): only C's upper triangle is wanted (some values below it are added to as well). */
void exl_qz_atb(exl_pool *pool, int64_t M, int64_t N, int64_t rows, float alpha, const float *A, int64_t lda,
                const float *B, int64_t ldb, float *C, int64_t ldc, int upper);

/* ---- GPTQ core */

typedef enum exl_qz_scheme {
    EXL_QZ_EXL2,      /* (q - 2^(b-1)) · fp16(max/256)·(c+1)², 4-bit c per (group, column) */
    EXL_QZ_GPTQ_SYM,  /* (q - 2^(b-1)) · scale[g, n] */
    EXL_QZ_GPTQ_ASYM, /* (q - zero[g, n]) · scale[g, n] */
} exl_qz_scheme;

/* Groups in permuted-row order: group g covers rows[g] rows coded with bits[g] bits. */
typedef struct exl_qz_layout {
    int32_t n_groups;
    int32_t *bits, *rows;
} exl_qz_layout;

void exl_qz_layout_free(exl_qz_layout *l);

typedef struct exl_qz_result {
    int64_t K, N;
    int32_t *perm;        /* [K] permuted row r holds original row perm[r] */
    uint8_t *codes;       /* [K, N] by permuted row */
    uint8_t *scale_codes; /* EXL2 [G, N] */
    uint16_t *scale_max;  /* EXL2 fp16 [G] */
    uint16_t *scales;     /* GPTQ fp16 [G, N] */
    uint8_t *zeros;       /* GPTQ [G, N] (the zero point, not the stored zero - 1) */
    float *Wq;            /* [K, N] dequantized, original row order */
} exl_qz_result;

/* Damping added to H before it is inverted, as a fraction of its mean diagonal:
 * EXL_QZ_DAMP + EXL_QZ_DAMP_PER_DIM·K/n for a K x K Hessian of n rows. Calibration text pins
 * H down only roughly (all the more when n is not much larger than K: the sample covariance
 * then spreads its eigenvalues by about sqrt(K/n)), and a lightly damped H lets GPTQ push
 * the error into input directions the calibration rarely saw but other inputs use. On
 * rand-llama with 1% damping GPTQ lost to round-to-nearest; ExLlamaV2 damps by 12%. */
#define EXL_QZ_DAMP 0.3
#define EXL_QZ_DAMP_PER_DIM 3.0

/* The weights of a linear quantized with a Hessian on a backend (exl_gptq_quantize_trial), kept there while the
 * Hessian lives: the candidate recipes of a linear then need no upload. */
#define EXL_QZ_DEV_SOURCES 3
typedef struct exl_qz_dev_source {
    const float *W; /* the host's weights this is a copy of (NULL: none) */
    int64_t N;
    float *dev; /* [K, N] */
    int64_t used;
} exl_qz_dev_source;

/* U in a backend's memory, put there by its factor on the backend or by the first quantization that updates its rows
 * on that backend (gptq.c), the room the quantizations of its linears there reuse, its order of rows there and the
 * weights of its linears. */
typedef struct exl_qz_hinv_dev {
    exl_backend *be;
    float *U;   /* NULL: not there yet */
    void *work; /* NULL: none yet */
    size_t work_bytes;
    int32_t *perm; /* [2K] the order of rows, then its inverse (NULL: not there yet) */
    exl_qz_dev_source src[EXL_QZ_DEV_SOURCES];
    int64_t uses;
} exl_qz_hinv_dev;

/* What GPTQ needs of a Hessian, shared by every quantization of the linears that see it. */
typedef struct exl_qz_hinv {
    int64_t K;
    int32_t *perm;        /* [K] permuted row r is original row perm[r] (act-order or identity) */
    float *U;             /* [K, K] upper Cholesky factor of the permuted, damped H⁻¹ */
    exl_qz_hinv_dev *dev; /* U on a backend */
} exl_qz_hinv;

/* act_order sorts rows by diag(H) descending. be (NULL: the host's threads) factors H where it has the op
 * (qz_factor; EXL_QUANT_DEVICE_FACTOR=0: on the host), leaving U there too. */
exl_status exl_gptq_prepare(const exl_hessian *H, int act_order, exl_pool *pool, exl_backend *be, exl_qz_hinv *out);
void exl_qz_hinv_free(exl_qz_hinv *h);
/* Quantize W [K, N] (not modified) with the groups of layout taken in h's row order. */
exl_status exl_gptq_quantize(const float *W, const exl_qz_hinv *h, int64_t N, exl_qz_scheme scheme,
                             const exl_qz_layout *layout, exl_pool *pool, exl_backend *be, exl_qz_result *out);
void exl_qz_result_free(exl_qz_result *r);
/* Whether be quantizes with EXL2 scales into a trial linear wholly on its own memory (exl_gptq_quantize_trial). */
int exl_gptq_trial_on_device(const exl_backend *be);
/* W [K, N] (the host's, unchanged while h lives: its copy on the backend is kept with h) quantized with EXL2 scales in
 * the groups of layout, the dequantized weights into the dense trial linear w (made by be's linear_init with in K,
 * out N), all on the backend: nothing comes back. */
exl_status exl_gptq_quantize_trial(const float *W, const exl_qz_hinv *h, int64_t N, const exl_qz_layout *layout,
                                   exl_backend *be, exl_linear *w);

/* ---- EXL2 recipes */

#define EXL_QZ_MAX_WIDTHS 4

typedef struct exl_qz_opt {
    int32_t n;
    int32_t bits[EXL_QZ_MAX_WIDTHS]; /* descending */
    double prop[EXL_QZ_MAX_WIDTHS];
    int32_t gs[EXL_QZ_MAX_WIDTHS];
} exl_qz_opt;

/* The group layout of a recipe over K rows (K a multiple of 32): widths in descending order,
 * each given ceil(prop·K / gs) groups (capped by the rows left), the last width the rest. */
exl_status exl_exl2_layout(const exl_qz_opt *o, int64_t K, exl_qz_layout *out);
/* Storage bits of a K x N linear under a recipe (the formats.md counting rule). */
double exl_exl2_opt_bits(const exl_qz_opt *o, int64_t K, int64_t N);
/* The EXL2 tensors of a quantized linear, in the ExLlamaV2 layout (allocated; free each). */
typedef struct exl_exl2_tensors {
    int32_t Q, G, Np;
    int32_t *q_weight, *q_invperm, *q_scale;
    uint16_t *q_scale_max;
    int16_t *q_groups;
} exl_exl2_tensors;
exl_status exl_exl2_tensors_make(const exl_qz_result *r, const exl_qz_layout *l, exl_exl2_tensors *t);
void exl_exl2_tensors_free(exl_exl2_tensors *t);

/* ---- measurement */

/* The linears of a block, as measurement.json names them: attention (q, k, v, o), MLP (gate, up, down), or a
 * mixture of experts (ExLlamaV2's block_sparse_moe: w1, w3, w2 = gate, up, down, one recipe for every expert). */
typedef struct exl_qz_block_desc {
    const char *suffix; /* "self_attn" / "mlp" / "block_sparse_moe" */
    int32_t n_linears;
    const char *names[4]; /* "q_proj", ... */
    int64_t K[4], N[4];
    int32_t copies; /* of each linear: the experts of a mixture, 1 otherwise */
} exl_qz_block_desc;

typedef struct exl_qz_recipe {
    double accuracy; /* 1 - relative error of the block's output */
    double total_bits;
    exl_qz_opt opt[4]; /* per linear, in block order */
} exl_qz_recipe;

typedef struct exl_qz_block_meas {
    char name[96]; /* model.layers.N.self_attn */
    const exl_qz_block_desc *desc;
    int32_t n;
    exl_qz_recipe *r;
} exl_qz_block_meas;

typedef struct exl_qz_measurement {
    int32_t n_blocks; /* 2 per decoder layer */
    exl_qz_block_meas *b;
} exl_qz_measurement;

/* The candidate recipes for a block (n_out filled; array allocated). */
exl_status exl_qz_candidates(const exl_qz_block_desc *d, exl_qz_recipe **out, int32_t *n_out);
void exl_qz_measurement_free(exl_qz_measurement *m);
/* measurement.json <-> struct (ExLlamaV2's layout; other blocks are ignored on read). descs: the blocks' of each
 * layer, [2 * n_layers]. */
exl_status exl_qz_measurement_save(const exl_qz_measurement *m, int32_t last_layer, const char *path);
exl_status exl_qz_measurement_load(const char *path, const exl_qz_block_desc *const *descs, int32_t n_layers,
                                   exl_qz_measurement *m, int32_t *n_done_layers);

/* ---- optimizer */

/* Pick one recipe per block, minimizing the sum of errors (1 - accuracy) with the total bits at
 * most budget_bits; choice[b] receives the recipe index. EXL_ERR_ARG if even the smallest
 * recipes exceed the budget. */
exl_status exl_qz_optimize(const exl_qz_measurement *m, double budget_bits, int32_t *choice);

/* ---- calibration */

/* rows x length token ids (*ids allocated): windows of the tokenized files, and a few rows
 * of random ids below vocab (see calib.c). file_rows (NULL or n_files + 1): the rows whose window starts in each
 * file, then the random rows; file_tokens (NULL or n_files): each file's tokens. */
exl_status exl_qz_calibration(const char *model_dir, const char *const *files, int32_t n_files, int32_t rows,
                              int32_t length, int32_t vocab, int32_t **ids, int32_t *file_rows, int64_t *file_tokens);

/* ---- the calibration rows through the model (calib_run.c) */

/* n_seqs sequences of length tokens, whose hidden states [n_seqs * length, hidden] stay on the host. */
typedef struct exl_qz_runner {
    exl_model *m;
    exl_kv_cache *cache;
    int32_t n_seqs, length;
    int32_t seqs_per_step; /* whole sequences a step takes, or 1 */
    int32_t piece;         /* tokens of a sequence a step takes */
    int32_t pages_per_seq;
    int32_t *pages;           /* [seqs_per_step][pages_per_seq] */
    exl_seq_step *steps;      /* [seqs_per_step] */
    float *buf;               /* [step rows, widest linear input]: a hook's rows on the host */
    int32_t *zeros;           /* [piece] the token ids of a layer's steps */
    void (*tick)(void *user); /* NULL, or called after every step (progress) */
    void *tick_user;
} exl_qz_runner;

exl_status exl_qz_runner_init(exl_qz_runner *r, exl_model *m, int32_t n_seqs, int32_t length);
void exl_qz_runner_free(exl_qz_runner *r);
/* x = the embeddings of ids [n_seqs, length]. */
exl_status exl_qz_run_embed(exl_qz_runner *r, const int32_t *ids, float *x);
/* x_out = decoder layer li with weights `layer` (model.h: exl_model_layer_forward; a block may be left out) over
 * x_in; x_out may be x_in, or NULL where only the hook's inputs are wanted. */
exl_status exl_qz_run_layer(exl_qz_runner *r, const exl_layer *layer, int32_t li, const float *x_in, float *x_out,
                            exl_linear_hook hook, void *user);
/* The squared distance of decoder layer li's output over x_in (backend memory, r's rows) from ref (backend memory,
 * as many rows) added to *err: the hidden states stay on the backend, one wait a step (sq_dist). */
exl_status exl_qz_run_layer_err(exl_qz_runner *r, const exl_layer *layer, int32_t li, const float *x_in,
                                const float *ref, double *err);
/* A candidate of a block scored with others (exl_qz_run_layer_errs): decoder layer li with its weights, the linears it
 * runs with the same weights as the candidate before it in the call, and its squared distance (added to). */
#define EXL_QZ_CAND_SAME 4
typedef struct exl_qz_cand {
    exl_layer layer;
    const exl_linear *same[EXL_QZ_CAND_SAME];
    int32_t n_same;
    double err;
} exl_qz_cand;
/* exl_qz_run_layer_err for n candidates: where each step takes whole sequences, step by step, each candidate right
 * after the one before it over the step's rows, skipping the nodes of its graph that compute what they computed
 * there and whose outputs the step's buffers still hold (the shared linears and what only they feed: q and k and
 * their rope, or gate, up and the GLU): the same nodes over the same values, so the same errors; else one candidate
 * after another (exl_qz_run_layer_err). For the CPU backend (whose graph_run runs an accumulating matmul through the
 * graph's tmp, as the generic executor does). */
exl_status exl_qz_run_layer_errs(exl_qz_runner *r, exl_qz_cand *c, int32_t n, int32_t li, const float *x_in,
                                 const float *ref);
/* The head's input (the final norm of x) to the hook. */
exl_status exl_qz_run_head(exl_qz_runner *r, const float *x, exl_linear_hook hook, void *user);

/* An exl_linear_hook that adds the inputs of w[i] to Hessian h[i], i < n (an expert's: the rows routed to it); the
 * inputs of keep_w (one of the w[i], or NULL) also go to keep, row after row (kept counts them). */
typedef struct exl_qz_capture {
    exl_qz_runner *r;
    int32_t n;
    const exl_linear *const *w;
    exl_hessian *const *h;
    const exl_linear *keep_w;
    float *keep;
    int64_t kept;
} exl_qz_capture;
exl_status exl_qz_capture_inputs(void *user, int32_t layer, const exl_linear *w, const float *x, int32_t rows);

/* ---- trial linears (trial_linear.c) */

/* A backend linear of weights W [K, N] (fp32, in x out) with like's shape and bias; pool (NULL: none) converts. */
typedef struct exl_qz_trial {
    void *wt; /* W in the Hugging Face layout [N, K] (fp32 on the CPU, fp16 elsewhere), which w may read */
    exl_linear *w;
    int64_t K, N;
} exl_qz_trial;
exl_status exl_qz_trial_init(exl_backend *be, exl_pool *pool, const float *W, const exl_linear_src *like,
                             exl_qz_trial *out);
/* A trial linear made from like itself (its own weights and bias): no host copy (t->wt NULL), for new weights that come
 * from the backend (exl_gptq_quantize_trial), not exl_qz_trial_set. */
exl_status exl_qz_trial_init_as(exl_backend *be, const exl_linear_src *like, exl_qz_trial *out);
/* New weights W [K, N] for a trial linear t (no allocation: the backend's linear_set_dense, in order with the work
 * queued before). */
exl_status exl_qz_trial_set(exl_backend *be, exl_pool *pool, const float *W, exl_qz_trial *t);
void exl_qz_trial_free(exl_backend *be, exl_qz_trial *t);

/* ---- a decoder layer's linears (qz_layer.c) */

/* A linear's weights W[K, N] and bias (NULL if none) in fp32 (allocated). */
exl_status exl_qz_load_linear(const exl_linear_src *src, float **W, float **bias);

typedef struct exl_qz_lin {
    char name[160];     /* the output's tensor prefix (ExLlamaV2's: a fused linear's parts and each expert by name) */
    exl_linear_src src; /* shape; a part's bias is the fp32 one below */
    float *W, *bias;    /* [K, N], [N] or NULL */
    exl_linear *own;    /* the unquantized linear: the model's, or a part made a linear of its own */
    exl_qz_trial part;
    int32_t block; /* 0 attention, 1 MLP or experts */
    int32_t opt;   /* which of its block's recipe linears (exl_qz_block_desc order) */
    int32_t stage; /* 0: sees the block's input; 1: sees what the stage-0 linears made (o_proj, down) */
    int32_t hslot; /* the block's Hessian its inputs go to: the stage (dense), 2 x expert + stage (experts) */
} exl_qz_lin;

typedef struct exl_qz_layer {
    exl_model *m;
    exl_backend *be;
    int32_t li;
    int32_t n, first[3]; /* lin[first[k] .. first[k + 1]) are block k's */
    exl_qz_lin *lin;
    int32_t n_slots[2];  /* Hessians of each block */
    exl_expert *experts; /* a mixture's experts for exl_qz_layer_block (NULL: a dense MLP) */
} exl_qz_layer;

exl_status exl_qz_layer_load(exl_model *m, exl_backend *be, int32_t li, exl_qz_layer *out);
void exl_qz_layer_free(exl_qz_layer *L);
/* Decoder layer li with block k (0 attention, 1 MLP) alone, run with linears w (indexed as L->lin); the layer's
 * other weights (norms, router) its own. */
exl_layer exl_qz_layer_block(exl_qz_layer *L, int k, exl_linear *const *w);

/* ---- progress (qz_status.c) */

typedef struct exl_qz_clock {
    const exl_quantize_params *p;
    int32_t n_layers, measure_from, quant_from; /* the plan: the first layer each pass has left (n_layers: none) */
    const char *stage;
    int32_t layer, pass; /* pass 0 measuring, 1 the rest */
    double fraction;     /* of the layer */
    double start, layer_start, last_call;
    double seconds[2];
    int32_t layers[2]; /* finished in this run, per pass */
    int32_t n_blocks;
    const char *block_name[2];
    double accuracy[2], bpw[2];
} exl_qz_clock;

void exl_qz_clock_init(exl_qz_clock *c, const exl_quantize_params *p, int32_t n_layers);
void exl_qz_clock_plan(exl_qz_clock *c, int32_t measure_from, int32_t quant_from);
/* A stage (and layer) begins. */
void exl_qz_clock_stage(exl_qz_clock *c, const char *stage, int32_t layer);
/* fraction of the layer done. */
void exl_qz_clock_step(exl_qz_clock *c, double fraction);
/* Work goes on (a runner's tick: user is the clock): a status call when the last is half a second old. */
void exl_qz_clock_tick(void *user);
/* Block k of the layer is done: its accuracy (< 0: not measured) and bits per weight. */
void exl_qz_clock_block(exl_qz_clock *c, int k, const char *name, double accuracy, double bpw);
void exl_qz_clock_layer_done(exl_qz_clock *c);

/* ---- profile (qz_prof.c): EXL_QUANT_PROFILE=1 prints where each layer's wall time went */

typedef enum exl_qz_prof_part {
    EXL_QZ_PROF_CALIB,    /* forwards of all the calibration rows (Hessians, reference states, the quantized block) */
    EXL_QZ_PROF_CAND,     /* the measuring pass's candidate forwards */
    EXL_QZ_PROF_TRANSFER, /* hidden states to and from the backend */
    EXL_QZ_PROF_HESSIAN,  /* a linear's inputs downloaded and added to its Hessian */
    EXL_QZ_PROF_FACTOR,   /* GPTQ's factor of the damped inverse Hessian */
    EXL_QZ_PROF_GPTQ,     /* GPTQ outside the parts below (its results' host memory, taken and given back) */
    EXL_QZ_PROF_SCALES,   /* a group's scales (EXL2: the scale search) */
    EXL_QZ_PROF_ROWS,     /* the row loop of a block (rounding, the error spread within the block) */
    EXL_QZ_PROF_UPDATE,   /* the rows after a block updated */
    EXL_QZ_PROF_TRIAL,    /* trial linears built, uploaded and freed */
    EXL_QZ_PROF_ACCURACY, /* a candidate's or a block's accuracy */
    EXL_QZ_PROF_PERMUTE,  /* GPTQ's rows put in act-order and back (host copies, or the backend's gather) */
    EXL_QZ_PROF_LOAD,     /* a layer's linears read from the model as fp32, and freed */
    EXL_QZ_PROF_SAVE,     /* what a resumed run needs written (the hidden states, the measurement) */
    EXL_QZ_PROF_SHARED,   /* candidate forwards that skip what the candidate before computed (exl_qz_run_layer_errs) */
    EXL_QZ_PROF_N
} exl_qz_prof_part;

/* Reads EXL_QUANT_PROFILE; be: the backend waited for at each switch of parts (NULL: the profile off). */
void exl_qz_prof_init(exl_backend *be);
void exl_qz_prof_enter(exl_qz_prof_part part);
void exl_qz_prof_leave(void);
/* A notice with the time of each part since the last report (or init), then counts from zero. */
void exl_qz_prof_report(const char *stage, int32_t layer);

/* ---- output (writer.c) */

/* One safetensors file being assembled; buffers handed to _own are freed with the part. */
typedef struct exl_qz_part {
    exl_st_writer *w;
    void **owned;
    int32_t n_owned, cap_owned;
} exl_qz_part;

exl_status exl_qz_part_init(exl_qz_part *p);
/* Add a tensor whose data the part takes ownership of (freed by exl_qz_part_free, even on failure). */
exl_status exl_qz_part_own(exl_qz_part *p, const char *name, int dtype, int n_dims, const int64_t *shape, void *data);
/* Add a tensor of a mapped input file as it is. */
exl_status exl_qz_part_copy(exl_qz_part *p, const exl_weights *w, const char *name);
exl_status exl_qz_part_write(exl_qz_part *p, const char *path);
void exl_qz_part_free(exl_qz_part *p);
/* All tensors of the given safetensors files in one file. */
exl_status exl_qz_merge(char *const *paths, int32_t n, const char *out_path);
/* Copy every regular file of in_dir except weights, configs and measurement to out_dir. */
exl_status exl_qz_copy_files(const char *in_dir, const char *out_dir);
/* in_dir/config.json with quantization_config = q (taken over) as out_dir/config.json. */
exl_status exl_qz_write_config(const char *in_dir, const char *out_dir, cJSON *q);
/* Write a JSON tree to path (through a temporary file and rename). */
exl_status exl_qz_write_json(const cJSON *j, const char *path);

#endif
