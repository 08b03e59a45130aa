/* fuzz_lora_config.c - libFuzzer target: a PEFT adapter_config.json's parsing and the lookups made with what it
 * accepts (targets, per-module rank and alpha, layers) on arbitrary bytes. */
#include "fuzz.h"
#include "model/lora_config.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static const char *const modules[] = {"model.layers.0.self_attn.q_proj", "model.layers.3.mlp.down_proj",
                                          "model.layers.1.self_attn.qkv_proj", "q_proj", ""};
    exl_lora_config c;
    if (exl_lora_config_parse("adapter_config.json", (const char *)data, size, &c) != EXL_OK)
        return 0;
    for (size_t i = 0; i < sizeof modules / sizeof modules[0]; i++) {
        int32_t r = exl_lora_config_rank(&c, modules[i]);
        double alpha = exl_lora_config_alpha(&c, modules[i]);
        if (r < 1 || alpha != alpha)
            __builtin_trap();
        (void)exl_lora_config_targets(&c, modules[i]);
    }
    for (int32_t li = 0; li < 4; li++)
        (void)exl_lora_config_has_layer(&c, li);
    exl_lora_config_free(&c);
    return 0;
}
