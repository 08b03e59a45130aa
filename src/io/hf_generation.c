/* hf_generation.c - generation_config.json: its eos ids (joined to config.json's) and the sampling defaults the
 * model's authors chose, kept for the CLI and server. */
#include "io/hf_config.h"

#include "base/error.h"
#include "io/hf_config_parts.h"

exl_status exl_hf_generation_parse(const char *name, const cJSON *g, exl_hf_config *cfg) {
    exl_jctx c = {name, ""};
    if (!cJSON_IsObject(g))
        return exl_fail(EXL_ERR_FORMAT, "%s: not a JSON object", name);
    exl_generation_config *gen = &cfg->gen;
    *gen = (exl_generation_config){1, -1, -1, -1, -1, -1, -1, -1};
    EXL_TRY(exl_jget_bool(&c, g, "do_sample", &gen->do_sample));
    EXL_TRY(exl_jget_num(&c, g, "temperature", 0, 1e6, &gen->temperature));
    EXL_TRY(exl_jget_num(&c, g, "top_p", 0, 1, &gen->top_p));
    EXL_TRY(exl_jget_num(&c, g, "min_p", 0, 1, &gen->min_p));
    EXL_TRY(exl_jget_num(&c, g, "repetition_penalty", 1e-6, 1e6, &gen->repetition_penalty));
    EXL_TRY(exl_jget_int(&c, g, "top_k", 0, 0, 1 << 24, &gen->top_k));
    EXL_TRY(exl_jget_int(&c, g, "max_new_tokens", 0, 0, 1 << 30, &gen->max_new_tokens));
    return exl_hf_parse_eos(&c, g, cfg);
}
