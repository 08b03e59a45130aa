/* fuzz_safetensors.c - libFuzzer target: the safetensors header parser on arbitrary bytes. */
#include "fuzz.h"
#include "io/safetensors.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    exl_st_file *f;
    if (exl_st_parse("fuzz.safetensors", data, size, &f) == EXL_OK) {
        /* every tensor the parser accepts must lie inside the buffer */
        for (int i = 0; i < f->n_tensors; i++) {
            const exl_st_tensor *t = &f->tensors[i];
            const uint8_t *p = t->data;
            if (p < data || p + t->nbytes > data + size)
                __builtin_trap();
            (void)exl_st_find(f, t->name);
        }
        exl_st_close(f);
    }
    return 0;
}
