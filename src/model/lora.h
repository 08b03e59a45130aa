/* lora.h - LoRA adapters beside a model's linears: PEFT directories loaded into backend memory (lora_load.c), and
 * each step's low-rank updates, gathered per row from the adapters its sequence uses (lora_step.c). The base
 * weights are never changed: a targeted linear's output gets (x · A^T) · (scaling · B^T) added by a lora node
 * (backend/graph.h), so quantized bases (EXL2, GPTQ) take adapters as dense ones do. */
#ifndef EXL_MODEL_LORA_H
#define EXL_MODEL_LORA_H

#include "model/model.h"

#include <stdatomic.h>

/* Adapters loaded onto one model at once (each holds a slot of every projection's factor table). */
#define EXL_LORA_SLOTS 64

/* The projections an adapter may target, in each decoder layer (Phi-3's fused qkv_proj and gate_up_proj too). */
typedef enum exl_lora_proj {
    EXL_LORA_Q,
    EXL_LORA_K,
    EXL_LORA_V,
    EXL_LORA_QKV,
    EXL_LORA_O,
    EXL_LORA_GATE,
    EXL_LORA_UP,
    EXL_LORA_GATE_UP,
    EXL_LORA_DOWN,
    EXL_LORA_N_PROJ
} exl_lora_proj;

/* What a sequence runs with: adapters and their weights (the weighted sum of their updates). */
typedef struct exl_lora_set {
    exl_lora_use uses[EXL_LORA_MAX_USES];
    int32_t n;
} exl_lora_set;

struct exl_lora {
    exl_model *m;
    char *dir;
    int32_t slot;  /* in the model's tables */
    uint64_t id;   /* unique in the process: a reloaded directory is another adapter */
    int32_t *rank; /* [n_layers * EXL_LORA_N_PROJ], 0 where it targets nothing */
    int32_t *in;   /* [same]: the projection's input features */
    size_t *at;    /* [same]: where its A is in mem (floats), Bt right after A */
    void *mem;     /* backend memory of all its factors */
    int32_t max_rank;
};

/* The model's adapters and the state of the step being built. */
typedef struct exl_lora_state {
    exl_lora *slots[EXL_LORA_SLOTS];
    atomic_int users[EXL_LORA_SLOTS];     /* jobs holding each slot's adapter (exl_lora_set_hold) */
    exl_lora_factors *tables;             /* backend memory [n_layers * EXL_LORA_N_PROJ][EXL_LORA_SLOTS] */
    exl_lora_set fallback;                /* sequences without a set of their own (exl_model_set_lora) */
    const exl_lora_set *const *step_sets; /* the next steps' sequences' sets (exl_lora_step_sets); NULL: fallback */
    int32_t n_step_sets;
    /* this step's uses: row_uses [rows + 1], use_row, use_slot, use_scale [n_uses] in one table */
    int32_t *table, *host_table;
    int32_t table_cap;
    float *t;
    int64_t t_cap;
    int32_t rows, n_uses, max_rank;
    unsigned char *targeted; /* [n_layers * EXL_LORA_N_PROJ]: some use of this step updates it */
} exl_lora_state;

/* An adapter from factors on the host: lo (calloc'd, its m, dir, rank, in, at filled; host as mem will hold it,
 * floats in all) uploaded and entered in a free slot; on failure lo is freed. */
exl_status exl_lora_install(exl_lora *lo, const float *host, size_t floats, exl_lora **out);

/* The sets of the sequences of the steps that follow (n_seqs of them, in step order; NULL or n_seqs 0: every
 * sequence the model's fallback set). The array must stay valid until it is replaced. */
void exl_lora_step_sets(exl_model *m, const exl_lora_set *const *sets, int32_t n_seqs);
/* A step's uses from its sequences' sets, uploaded (exl_model_begin_step calls it). */
exl_status exl_lora_begin_step(exl_model *m, const exl_seq_step *steps, int32_t n_seqs, int32_t rows);
/* The input of projections as a lora node reads it (graph.h): x of `in` features, normed (norm, eps) or through the
 * GLU (up, act) on the way where those are set. */
typedef struct exl_lora_input {
    const float *x;
    int32_t in;
    const exl_vector *norm;
    float eps;
    const float *up;
    int32_t act;
} exl_lora_input;

/* For projections p[0..n) (n <= EXL_LORA_MAX_OUT) of layer li over one input (out[i] = input · w[i]), the lora node
 * adding this step's updates to those some use targets whose w is the model's own (not a candidate's: the
 * quantizer's); none where no projection is left. */
exl_status exl_lora_nodes(exl_model *m, exl_graph *g, int32_t li, int32_t n, const exl_lora_proj *p,
                          const exl_linear *const *w, float *const *out, const int32_t *out_features,
                          const exl_lora_input *in);
/* The model's linear of projection p in layer l (NULL where it has none). */
const exl_linear *exl_lora_proj_linear(const exl_layer *l, exl_lora_proj p);
/* A set from public uses: checked (adapters of this model, at most EXL_LORA_MAX_USES). */
exl_status exl_lora_set_make(const exl_model *m, const exl_lora_use *uses, int32_t n, exl_lora_set *out);
/* A job's set: uses when n > 0, else a copy of the model's fallback set. */
exl_status exl_lora_job_set(const exl_model *m, const exl_lora_use *uses, int32_t n, exl_lora_set *out);
/* Count the set's adapters as held by one more (delta 1) or one less (-1) job. */
void exl_lora_set_hold(const exl_lora_set *s, int delta);
/* A hash of a set (0 for the empty one), for the prefix cache's keys. */
uint64_t exl_lora_set_hash(const exl_lora_set *s);
/* Free the model's adapter state (at model free; every adapter must be freed before). */
void exl_lora_state_free(exl_model *m);

#endif
