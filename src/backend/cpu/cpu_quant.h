/* cpu_quant.h - the CPU backend's view of an EXL2 or GPTQ matrix: column bit streams cut
 * into groups, the activation permutation, and per-group scale lookup tables. */
#ifndef EXL_CPU_QUANT_H
#define EXL_CPU_QUANT_H

#include "backend/backend.h"
#include "backend/cpu/qkernels.h"

typedef struct exl_cpu_qmat {
    const int32_t *words; /* stream words: the mapped file's, or `repacked` */
    int64_t ld;           /* words between stream rows: n_padded (EXL2) or out_features (GPTQ) */
    exl_qgroup *groups;
    int32_t n_groups;
    int32_t *perm;     /* [in_features] activation row of each kernel row */
    int32_t *repacked; /* GPTQ with unsorted g_idx: qweight with rows sorted by group */
    float *lut;        /* EXL2: [n_groups][16] scale of each 4-bit scale code */
} exl_cpu_qmat;

/* Build the view of a source validated by format/ (exl_exl2_check / exl_gptq_check). */
exl_status exl_cpu_qmat_init(const exl_linear_src *src, exl_cpu_qmat **out);
void exl_cpu_qmat_free(exl_cpu_qmat *q);

/* rows of x [rows][K] to int8 for the int8 group kernel (cpu_qact.c): xq [rows][K] in kernel
 * row order, dx and xsum [rows][n_groups]; groups that fail exl_cpu_q8_group_ok are skipped.
 * Part `part` of `parts` of the (row, group) pairs. */
void exl_cpu_q8_quantize(const exl_cpu_qkernels *qk, const exl_cpu_qmat *q, const float *x, int64_t K, int32_t rows,
                         int8_t *xq, float *dx, int32_t *xsum, int part, int parts);

#endif
