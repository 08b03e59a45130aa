/* qkernels.h - the CPU's fused quantized matmul inner loop (EXL2 and GPTQ), one table per
 * instruction set, picked at run time like kernels.h.
 *
 * A quantized matrix is seen as column bit streams (see format/qstream.h) cut into groups of
 * consecutive stream rows; every group has one code width and, per column, one scale and
 * one zero point, so W[row, n] = (code - zero[n]) * scale[n]. A kernel call handles one
 * group for one tile of `tile` consecutive columns and up to `max_nr` activation rows:
 *
 *   acc[r][i] += scale[i] * sum_row x[r][perm[row]] * (code[row, n0 + i] - 2^(b-1) - zero[i])
 *
 * (zero relative to the code midpoint) computed as scale * (sum x*c - zero * sum x) with
 * the centered code c = code - 2^(b-1), dequantizing in registers and
 * accumulating in fp32. Activations are gathered through perm (EXL2's row permutation,
 * GPTQ's act-order), so the weights are never un-permuted. */
#ifndef EXL_CPU_QKERNELS_H
#define EXL_CPU_QKERNELS_H

#include <stdint.h>

typedef struct exl_qgroup {
    int32_t g;    /* index of the group's scales and zeros */
    int32_t bits; /* 2..8 */
    int64_t row0; /* first kernel row: activations are x[perm[row]] */
    int64_t n_rows;
    int64_t bit0; /* stream bit of row0's code */
} exl_qgroup;

#define EXL_QTILE_MAX 64 /* the widest tile of any table */
#define EXL_QNR_MAX 4    /* the most rows of any table */

typedef struct exl_cpu_qkernels {
    const char *isa;
    int tile;   /* columns per call */
    int max_nr; /* activation rows per call */
    /* words: the first stream word of the tile's first column; stream rows are ld words
     * apart; columns >= width are neither read nor meaningful. x rows are ldx apart;
     * acc is [nr] rows of tile values, lda floats apart; scale and zero (relative to 2^(b-1)) hold tile values. */
    void (*group)(const exl_qgroup *g, const int32_t *words, int64_t ld, int width, const int32_t *perm, const float *x,
                  int64_t ldx, int nr, const float *scale, const float *zero, float *acc, int64_t lda);
    /* dst[i] = fp16 src[i] as fp32 */
    void (*f16_to_f32)(const uint16_t *src, float *dst, int n);
} exl_cpu_qkernels;

extern const exl_cpu_qkernels exl_cpu_qkernels_scalar;
extern const exl_cpu_qkernels exl_cpu_qkernels_avx2;
extern const exl_cpu_qkernels exl_cpu_qkernels_avx512;

/* The quantized table of the same instruction set as a kernels.h table's isa name. */
const exl_cpu_qkernels *exl_cpu_qkernels_for(const char *isa);

#endif
