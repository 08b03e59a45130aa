/* fuzz_config.c - libFuzzer target: config.json (and generation_config.json) parsing on arbitrary bytes. */
#include "fuzz.h"
#include "io/hf_config.h"
#include "io/json_file.h"
#include "model/model.h"

#include <stddef.h>
#include <stdint.h>

static exl_hf_config cfg; /* ~10 KB */

/* The derived rope tables must be computable for any accepted config, for every layer's rope, within and past
 * the original context (longrope switches factor lists there). */
static void rope_tables(void) {
    float inv_freq[512], af;
    for (int32_t i = 0; i < cfg.n_layers; i++) {
        const exl_rope_config *r = exl_hf_layer_rope(&cfg, i);
        if (i > 0 && r == exl_hf_layer_rope(&cfg, i - 1))
            continue;
        int32_t rot = (int32_t)(cfg.head_dim * r->partial_rotary_factor) & ~1;
        if (rot < 2 || rot > 1024)
            continue;
        exl_rope_frequencies(&cfg, r, rot, cfg.max_pos, inv_freq, &af);
        exl_rope_frequencies(&cfg, r, rot, r->original_max_pos + 1, inv_freq, &af);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cJSON *root;
    if (exl_json_parse("config.json", (const char *)data, size, &root) != EXL_OK)
        return 0;
    if (exl_hf_config_parse("config.json", root, &cfg) == EXL_OK) {
        rope_tables();
        /* the same bytes as a generation_config.json merged into it */
        exl_hf_generation_parse("generation_config.json", root, &cfg);
    }
    cJSON_Delete(root);
    return 0;
}
