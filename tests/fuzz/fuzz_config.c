/* fuzz_config.c - libFuzzer target: config.json parsing on arbitrary bytes. */
#include "fuzz.h"
#include "io/hf_config.h"
#include "io/json_file.h"
#include "model/model.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    cJSON *root;
    if (exl_json_parse("config.json", (const char *)data, size, &root) != EXL_OK)
        return 0;
    exl_hf_config cfg;
    if (exl_hf_config_parse("config.json", root, &cfg) == EXL_OK) {
        /* the derived rope tables must be computable for any accepted config */
        float inv_freq[512], af;
        int32_t rot = (int32_t)(cfg.head_dim * cfg.rope.partial_rotary_factor) & ~1;
        if (rot >= 2 && rot <= 1024)
            exl_rope_frequencies(&cfg, rot, cfg.max_pos, inv_freq, &af);
    }
    cJSON_Delete(root);
    return 0;
}
