/* hf_config_parts.h - the pieces of exl_hf_config_parse other files share: rotary embedding fields (hf_rope.c),
 * the layer and expert layout (hf_layers.c), eos ids (hf_config.c, also read by hf_generation.c). */
#ifndef EXL_IO_HF_CONFIG_PARTS_H
#define EXL_IO_HF_CONFIG_PARTS_H

#include "io/hf_config.h"
#include "io/hf_fields.h"

/* cfg->rope and cfg->rope_sliding from the text model's object o; needs arch, head_dim, max_pos, n_layers and
 * the layers' sliding flags (exl_hf_parse_layers first). */
exl_status exl_hf_parse_rope(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg);
/* Which layers slide and their window (layer_types, sliding_window, use_sliding_window, max_window_layers,
 * sliding_window_pattern); needs arch and n_layers. */
exl_status exl_hf_parse_layers(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg);
/* cfg->moe and which layers are MoE (num_experts, num_experts_per_tok, moe_intermediate_size,
 * decoder_sparse_step, mlp_only_layers, ...); needs arch, n_layers and intermediate_size. */
exl_status exl_hf_parse_moe(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg);
/* eos_token_id (a number or a list): its ids join cfg's (at most 8 in all). */
exl_status exl_hf_parse_eos(const exl_jctx *c, const cJSON *o, exl_hf_config *cfg);

#endif
