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

exl_cpu_q8_fn exl_cpu_q8_for(const exl_cpu_qkernels *qk) {
    return qk->group_q8 && __builtin_cpu_supports("avx512vnni") ? qk->group_q8 : NULL;
}
