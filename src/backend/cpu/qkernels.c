/* qkernels.c - the quantized kernel table matching the chosen kernels.h table's ISA. */
#include "backend/cpu/qkernels.h"

#include <string.h>

const exl_cpu_qkernels *exl_cpu_qkernels_for(const char *isa) {
    if (!strcmp(isa, "avx512"))
        return &exl_cpu_qkernels_avx512;
    if (!strcmp(isa, "avx2"))
        return &exl_cpu_qkernels_avx2;
    return &exl_cpu_qkernels_scalar;
}

void exl_cpu_exl2_scales_scalar(const float *lut, const uint32_t *codes, int64_t n0, int width, float *scale) {
    for (int i = 0; i < width; i++) {
        uint64_t n = (uint64_t)(n0 + i);
        scale[i] = lut[(codes[n >> 3] >> (4 * (n & 7))) & 15u];
    }
}

exl_cpu_q8_fn exl_cpu_q8_for(const exl_cpu_qkernels *qk) {
    return qk->group_q8 && __builtin_cpu_supports("avx512vnni") ? qk->group_q8 : NULL;
}
