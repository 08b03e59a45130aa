/* kernels.c - run-time choice of the CPU kernel table (scalar, AVX2, AVX-512). */
#include "backend/cpu/kernels.h"

#include <stdlib.h>
#include <string.h>

static int cpu_has_avx2(void) {
    /* every AVX2 CPU has F16C; clang 14 does not know the "f16c" feature name */
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static int cpu_has_avx512(void) {
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

const exl_cpu_kernels *exl_cpu_kernels_named(const char *isa) {
    __builtin_cpu_init();
    if (!strcmp(isa, "scalar"))
        return &exl_cpu_kernels_scalar;
    if (!strcmp(isa, "avx2"))
        return cpu_has_avx2() ? &exl_cpu_kernels_avx2 : NULL;
    if (!strcmp(isa, "avx512"))
        return cpu_has_avx512() ? &exl_cpu_kernels_avx512 : NULL;
    return NULL;
}

const exl_cpu_kernels *exl_cpu_kernels_best(void) {
    const char *cap = getenv("EXL_CPU_ISA");
    const char *order[] = {"avx512", "avx2", "scalar"};
    int start = 0;
    if (cap)
        for (int i = 0; i < 3; i++)
            if (!strcmp(cap, order[i]))
                start = i;
    for (int i = start; i < 3; i++) {
        const exl_cpu_kernels *k = exl_cpu_kernels_named(order[i]);
        if (k)
            return k;
    }
    return &exl_cpu_kernels_scalar;
}
