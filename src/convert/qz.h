/* qz.h - the quantizer's internal pieces (the converter behind exl_quantize).
 *
 *   hessian.c     H = 2/n · XᵀX of a linear's calibration inputs
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
 *   calib_run.c   the calibration rows through the model's own layers, a hook on their linears
 *   trial_linear.c  backend linears from the weights being tried
 *   quantize.c    the driver: layer by layer, resumable, writing OUT_DIR
 *
 * Weights are W[k, n] (in x out) fp32 while being quantized. The big products (the Hessian's
 * XᵀX, GPTQ's update of the rows after a block) are the backend's host_gemm (the CPU's or the
 * GPU's, in fp32 either way). */
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
    int64_t n; /* rows accumulated */
    float *H;  /* [K, K], sum of x xᵀ until exl_hessian_finish scales it by 2/n */
} exl_hessian;

exl_status exl_hessian_init(exl_hessian *h, int64_t K);
exl_status exl_hessian_add(exl_hessian *h, const float *x, int64_t rows, exl_backend *be);
void exl_hessian_finish(exl_hessian *h);
/* The identity (round to nearest through the same code path). */
void exl_hessian_identity(exl_hessian *h);
void exl_hessian_free(exl_hessian *h);

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

/* What GPTQ needs of a Hessian, shared by every quantization of the linears that see it. */
typedef struct exl_qz_hinv {
    int64_t K;
    int32_t *perm; /* [K] permuted row r is original row perm[r] (act-order or identity) */
    float *U;      /* [K, K] upper Cholesky factor of the permuted, damped H⁻¹ */
} exl_qz_hinv;

/* act_order sorts rows by diag(H) descending. */
exl_status exl_gptq_prepare(const exl_hessian *H, int act_order, exl_pool *pool, exl_qz_hinv *out);
void exl_qz_hinv_free(exl_qz_hinv *h);
/* Quantize W [K, N] (not modified) with the groups of layout taken in h's row order. */
exl_status exl_gptq_quantize(const float *W, const exl_qz_hinv *h, int64_t N, exl_qz_scheme scheme,
                             const exl_qz_layout *layout, exl_pool *pool, exl_backend *be, exl_qz_result *out);
void exl_qz_result_free(exl_qz_result *r);

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

/* The linears of a block: attention (q, k, v, o) or MLP (gate, up, down). */
typedef struct exl_qz_block_desc {
    const char *suffix; /* "self_attn" / "mlp" */
    int32_t n_linears;
    const char *names[4]; /* "q_proj", ... */
    int64_t K[4], N[4];
} exl_qz_block_desc;

typedef struct exl_qz_recipe {
    double accuracy; /* 1 - relative error of the block's output */
    double total_bits;
    exl_qz_opt opt[4]; /* per linear, in block order */
} exl_qz_recipe;

typedef struct exl_qz_block_meas {
    char name[96]; /* model.layers.N.self_attn */
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
/* measurement.json <-> struct (ExLlamaV2's layout; other blocks are ignored on read). */
exl_status exl_qz_measurement_save(const exl_qz_measurement *m, int32_t last_layer, const char *path);
exl_status exl_qz_measurement_load(const char *path, const exl_qz_block_desc *descs, int32_t n_layers,
                                   exl_qz_measurement *m, int32_t *n_done_layers);

/* ---- optimizer */

/* Pick one recipe per block, minimizing the sum of errors (1 - accuracy) with the total bits at
 * most budget_bits; choice[b] receives the recipe index. EXL_ERR_ARG if even the smallest
 * recipes exceed the budget. */
exl_status exl_qz_optimize(const exl_qz_measurement *m, double budget_bits, int32_t *choice);

/* ---- calibration */

/* rows x length token ids (*ids allocated): windows of the tokenized files, and a few rows
 * of random ids below vocab (see calib.c). */
exl_status exl_qz_calibration(const char *model_dir, const char *const *files, int32_t n_files, int32_t rows,
                              int32_t length, int32_t vocab, int32_t **ids);

/* ---- the calibration rows through the model (calib_run.c) */

/* n_seqs sequences of length tokens, whose hidden states [n_seqs * length, hidden] stay on the host. */
typedef struct exl_qz_runner {
    exl_model *m;
    exl_kv_cache *cache;
    int32_t n_seqs, length;
    int32_t seqs_per_step; /* whole sequences a step takes, or 1 */
    int32_t piece;         /* tokens of a sequence a step takes */
    int32_t pages_per_seq;
    int32_t *pages;      /* [seqs_per_step][pages_per_seq] */
    exl_seq_step *steps; /* [seqs_per_step] */
    float *buf;          /* [step rows, widest linear input]: a hook's rows on the host */
    int32_t *zeros;      /* [piece] the token ids of a layer's steps */
} exl_qz_runner;

exl_status exl_qz_runner_init(exl_qz_runner *r, exl_model *m, int32_t n_seqs, int32_t length);
void exl_qz_runner_free(exl_qz_runner *r);
/* x = the embeddings of ids [n_seqs, length]. */
exl_status exl_qz_run_embed(exl_qz_runner *r, const int32_t *ids, float *x);
/* x_out = decoder layer li with weights `layer` (model.h: exl_model_layer_forward; a block may be left out) over
 * x_in; x_out may be x_in, or NULL where only the hook's inputs are wanted. */
exl_status exl_qz_run_layer(exl_qz_runner *r, const exl_layer *layer, int32_t li, const float *x_in, float *x_out,
                            exl_linear_hook hook, void *user);
/* The head's input (the final norm of x) to the hook. */
exl_status exl_qz_run_head(exl_qz_runner *r, const float *x, exl_linear_hook hook, void *user);

/* An exl_linear_hook that adds the inputs of w[i] to Hessian h[i] (unused entries NULL). */
typedef struct exl_qz_capture {
    exl_qz_runner *r;
    const exl_linear *w[2];
    exl_hessian *h[2];
} exl_qz_capture;
exl_status exl_qz_capture_inputs(void *user, int32_t layer, const exl_linear *w, const float *x, int32_t rows);

/* ---- trial linears (trial_linear.c) */

/* A backend linear of weights W [K, N] (fp32, in x out) with like's shape and bias. */
typedef struct exl_qz_trial {
    float *wt; /* W in the Hugging Face layout [N, K], which w may read */
    exl_linear *w;
} exl_qz_trial;
exl_status exl_qz_trial_init(exl_backend *be, const float *W, const exl_linear_src *like, exl_qz_trial *out);
void exl_qz_trial_free(exl_backend *be, exl_qz_trial *t);

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
