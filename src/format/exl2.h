/* exl2.h - the EXL2 layout's two rules every reader shares: where each group lies (the one
 * walk over q_groups) and the scale of a (group, column). Plain inline C, also compiled as
 * the CUDA backend's host C++ (cuda_quant.cu).
 *
 * Groups follow each other down the permuted ("stream") rows: group g holds codes of
 * q_groups[2g] bits from q_weight row q_groups[2g + 1] up to the next group's first row (the
 * last one up to q_rows), so (end - start) * 32 / bits rows. Stream row r is input feature k
 * where q_invperm[k] == r. */
#ifndef EXL_FORMAT_EXL2_H
#define EXL_FORMAT_EXL2_H

#include "base/half.h"
#include "format/linear_src.h"

#include <stdint.h>

/* One group of an EXL2 source, as exl_exl2_next_group walks them in q_groups order. */
typedef struct exl_exl2_group {
    int32_t index;  /* g: -1 before the walk (EXL_EXL2_WALK) */
    int32_t bits;   /* code width (any value: exl_exl2_check rejects the bad ones) */
    int64_t row;    /* first stream row: the rows of the groups before it */
    int64_t n_rows; /* (q_end - q_row) * 32 / bits, 0 when bits < 1 */
    int64_t q_row;  /* first q_weight row: stream row row + j has its code at bit q_row * 32 + j * bits */
    int64_t q_end;  /* one past its last q_weight row */
} exl_exl2_group;

/* The start of a walk: for (exl_exl2_group g = EXL_EXL2_WALK; exl_exl2_next_group(e, &g);) */
#define EXL_EXL2_WALK \
    { -1, 0, 0, 0, 0, 0 }

/* Advance *g to the next group; 0 after the last. */
static inline int exl_exl2_next_group(const exl_exl2_src *e, exl_exl2_group *g) {
    g->row += g->n_rows;
    g->index++;
    if (g->index >= e->n_groups)
        return 0;
    g->bits = e->q_groups[2 * g->index];
    g->q_row = e->q_groups[2 * g->index + 1];
    g->q_end = g->index + 1 < e->n_groups ? e->q_groups[2 * g->index + 3] : e->q_rows;
    g->n_rows = g->bits > 0 && g->q_end > g->q_row ? (g->q_end - g->q_row) * 32 / g->bits : 0;
    return 1;
}

/* The scale of 4-bit scale code `code` in a group whose max scale is scale_max (fp16 bits):
 * fp16(fp16(max / 256) * (code + 1)^2), as fp16 bits; every product is exact in fp32 before
 * the final rounding. */
static inline uint16_t exl_exl2_scale_f16(uint16_t scale_max, uint32_t code) {
    float m = exl_f16_to_f32(exl_f32_to_f16(exl_f16_to_f32(scale_max) / 256.0f));
    float c = (float)(code + 1);
    return exl_f32_to_f16(m * c * c);
}

/* The same scale in fp32. */
static inline float exl_exl2_scale(uint16_t scale_max, uint32_t code) {
    return exl_f16_to_f32(exl_exl2_scale_f16(scale_max, code));
}

/* How exl's quantizer picks a group's scales (convert/gptq.c on the host, a backend's qz_exl2_scales): with m the
 * largest of the columns' no-clipping scales, the maximum is tried at fp16(m·(0.65 + 0.025·t)) for t below
 * EXL_EXL2_SCALE_TRIES; for each, every column takes the code of least squared rounding error among the
 * EXL_EXL2_SCALE_CANDS codes around its own no-clipping scale, and the maximum of least total error wins. The maxima
 * are tried coarse to fine: every COARSE-th from COARSE / 2, then the untried ones less than COARSE from the best. */
#define EXL_EXL2_SCALE_TRIES 20
#define EXL_EXL2_SCALE_COARSE 4
#define EXL_EXL2_SCALE_CANDS 4

/* The 4-bit scale code of (group g, column n); q_scale rows hold n_padded / 8 words. */
static inline uint32_t exl_exl2_scale_code(const exl_exl2_src *e, int64_t g, int64_t n) {
    return ((uint32_t)e->q_scale[g * (e->n_padded / 8) + n / 8] >> (4 * (n % 8))) & 15u;
}

/* The scale of (group g, column n). */
static inline float exl_exl2_column_scale(const exl_exl2_src *e, int64_t g, int64_t n) {
    return exl_exl2_scale(e->q_scale_max[g], exl_exl2_scale_code(e, g, n));
}

#endif
