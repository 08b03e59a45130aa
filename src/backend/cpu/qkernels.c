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
