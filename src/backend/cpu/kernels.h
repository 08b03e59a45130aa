/* kernels.h - the CPU's SIMD inner loops, one table per instruction set, picked at run time. */
#ifndef EXL_CPU_KERNELS_H
#define EXL_CPU_KERNELS_H

#include <stdint.h>

#define EXL_CPU_MAX_NR 4 /* activation rows a dot kernel handles at once */
#define EXL_CPU_NC 3     /* weight columns a block kernel handles at once */
#define EXL_CPU_KEYS 16  /* keys an fp16 attention kernel takes at once (cpu_attention_f16.c) */
#define EXL_CPU_HEADS 8  /* the most query heads an fp16 attention kernel takes at once */

typedef struct exl_cpu_kernels {
    const char *isa;
    /* out[r] = sum_k x[r * ldx + k] * w[k] for r < nr (1 <= nr <= EXL_CPU_MAX_NR) */
    void (*dot_f32)(const float *x, int64_t ldx, int nr, const float *w, int64_t k, float *out);
    void (*dot_f16)(const float *x, int64_t ldx, int nr, const uint16_t *w, int64_t k, float *out);
    void (*dot_bf16)(const float *x, int64_t ldx, int nr, const uint16_t *w, int64_t k, float *out);
    /* Register-blocked: out[r * EXL_CPU_NC + c] = sum_k x[r * ldx + k] * w[c][k] for r < nr,
     * c < EXL_CPU_NC, bit-identical to dot_* on each column (so whichever kernel a batch
     * uses, a row's result does not depend on its batch). NULL where a table has none. */
    void (*block_f32)(const float *x, int64_t ldx, int nr, const float *const *w, int64_t k, float *out);
    void (*block_f16)(const float *x, int64_t ldx, int nr, const uint16_t *const *w, int64_t k, float *out);
    void (*block_bf16)(const float *x, int64_t ldx, int nr, const uint16_t *const *w, int64_t k, float *out);
    /* y[i] += a * x[i] for i < n, the product rounded before the add (never a fused multiply-add), so that every
     * table and plain C give the same bits (attention's value sums, cpu_attention.c and cpu_kv_quant.c) */
    void (*axpy_f32)(float *y, float a, const float *x, int32_t n);
    /* Attention over fp16 keys and values, a block of n <= EXL_CPU_KEYS keys for nh <= EXL_CPU_HEADS query heads
     * (q, acc: nh rows of hd; s, p: nh rows of EXL_CPU_KEYS). scores_f16: s[h][i] = q[h] . k[i] for i < n (lanes
     * from n on undefined); exp_sum: x[i] = exp(x[i] - m) for i < n, returns their sum; values_f16:
     * acc[h] = corr[h] acc[h] + sum_i p[h][i] v[i]. */
    void (*scores_f16)(const float *q, int nh, const uint16_t *const *k, int n, int32_t hd, float *s);
    float (*exp_sum)(float *x, float m, int n);
    void (*values_f16)(float *acc, int nh, const float *corr, const float *p, const uint16_t *const *v, int n,
                       int32_t hd);
} exl_cpu_kernels;

extern const exl_cpu_kernels exl_cpu_kernels_scalar;
extern const exl_cpu_kernels exl_cpu_kernels_avx2;
extern const exl_cpu_kernels exl_cpu_kernels_avx512;

void exl_cpu_axpy_f32_scalar(float *y, float a, const float *x, int32_t n);
void exl_cpu_scores_f16_scalar(const float *q, int nh, const uint16_t *const *k, int n, int32_t hd, float *s);
float exl_cpu_exp_sum_scalar(float *x, float m, int n);
void exl_cpu_values_f16_scalar(float *acc, int nh, const float *corr, const float *p, const uint16_t *const *v, int n,
                               int32_t hd);

/* The best table this CPU supports; $EXL_CPU_ISA (scalar, avx2, avx512) caps the choice. */
const exl_cpu_kernels *exl_cpu_kernels_best(void);
/* The table for an ISA name if this CPU supports it, else NULL. */
const exl_cpu_kernels *exl_cpu_kernels_named(const char *isa);

#endif
