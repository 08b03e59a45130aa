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

/* Like the group kernel, but against activations quantized to int8 per (row, group) by
 * exl_cpu_q8_quantize (cpu_qact.c): xq is the group's first kernel row of activation row 0,
 * rows ldxq bytes apart, in exl_cpu_q8_order; dx (the int8 step) and xsum (sum of xq) of row r
 * are dx[r * lddx] and xsum[r * lddx]. Only groups for which exl_cpu_q8_group_ok holds. */
typedef void (*exl_cpu_q8_fn)(const exl_qgroup *g, const int32_t *words, int64_t ld, int width, const int8_t *xq,
                              int64_t ldxq, const float *dx, const int32_t *xsum, int64_t lddx, int nr,
                              const float *scale, const float *zero, float *acc, int64_t lda);

/* Groups the int8 path takes: word-aligned, whole 32-row chunks. */
static inline int exl_cpu_q8_group_ok(const exl_qgroup *g) { return (g->bit0 & 31) == 0 && g->n_rows % 32 == 0; }

/* Where kernel row j (0..31) of a 32-row chunk of width `bits` sits in the int8 kernel's
 * activation order: rows four at a time as the kernel builds its code dwords; 4-bit words
 * give their even rows' nibbles first, then the odd ones'. */
static inline int exl_cpu_q8_order(int bits, int j) {
    return bits == 4 ? (j & ~7) + (j & 1 ? 4 + (j & 7) / 2 : (j & 7) / 2) : j;
}

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
    /* The int8-activation decode path (qkernels_q8_avx512.c), NULL where the ISA has none;
     * usable where exl_cpu_q8_for says so. */
    exl_cpu_q8_fn group_q8;
    /* The n activations x[perm[k]] (n a multiple of 32) of a group of `bits`-wide codes to
     * int8 in exl_cpu_q8_order: dst[n], the step dx = max |x| / 127 and the sum of dst. */
    void (*quantize_q8)(const float *x, const int32_t *perm, int64_t n, int bits, int8_t *dst, float *dx,
                        int32_t *xsum);
    /* EXL2 scales of columns n0 .. n0 + width - 1 (n0 even): scale[i] = lut[code of column n0 + i], the 4-bit
     * codes eight to a word of `codes`, column 0 in the low bits */
    void (*exl2_scales)(const float *lut, const uint32_t *codes, int64_t n0, int width, float *scale);
} exl_cpu_qkernels;

extern const exl_cpu_qkernels exl_cpu_qkernels_scalar;
extern const exl_cpu_qkernels exl_cpu_qkernels_avx2;
extern const exl_cpu_qkernels exl_cpu_qkernels_avx512;
void exl_cpu_q8_group_avx512(const exl_qgroup *g, const int32_t *words, int64_t ld, int width, const int8_t *xq,
                             int64_t ldxq, const float *dx, const int32_t *xsum, int64_t lddx, int nr,
                             const float *scale, const float *zero, float *acc, int64_t lda);
void exl_cpu_q8_quantize_avx512(const float *x, const int32_t *perm, int64_t n, int bits, int8_t *dst, float *dx,
                                int32_t *xsum);

void exl_cpu_exl2_scales_scalar(const float *lut, const uint32_t *codes, int64_t n0, int width, float *scale);
/* The quantized table of the same instruction set as a kernels.h table's isa name. */
const exl_cpu_qkernels *exl_cpu_qkernels_for(const char *isa);
/* The table's int8 kernel where this CPU runs it (AVX-512 VNNI), else NULL. */
exl_cpu_q8_fn exl_cpu_q8_for(const exl_cpu_qkernels *qk);

#endif
