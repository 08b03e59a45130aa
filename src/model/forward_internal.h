/* forward_internal.h - forward.c's pieces that forward_layer.c runs one layer at a time. */
#ifndef EXL_MODEL_FORWARD_INTERNAL_H
#define EXL_MODEL_FORWARD_INTERNAL_H

#include "model/model.h"

/* A hook on the inputs of a layer's linears (fn may be NULL). Where one is given, the layer runs op by op: no
 * fused matmuls, no fused rope + attention (whose outputs a backend may lay out its own way). */
typedef struct exl_layer_hook {
    exl_linear_hook fn;
    void *user;
    int32_t layer; /* passed to fn */
} exl_layer_hook;

/* Check a step's sequences, upload its tables and fill *b (exl_model_forward's first part); n_logits: the rows that
 * want logits. ahead: as exl_model_forward_to_logits. */
exl_status exl_model_step_batch(exl_model *m, exl_kv_cache *cache, const exl_seq_step *steps, int32_t n_seqs, int ahead,
                                exl_batch *b, int32_t *n_logits);
/* Decoder layer li with weights l on m->fs.x over batch b (a block whose first linear is NULL is left out);
 * n_logits: the rows of logits that follow the last layer (its split sums may clear them). hook: NULL, or as above. */
exl_status exl_model_run_layer(exl_model *m, const exl_layer *l, exl_kv_cache *cache, int li, const exl_batch *b,
                               int32_t n_logits, const exl_layer_hook *hook);

#endif
