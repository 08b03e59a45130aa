/* linear_src.h - a linear layer's weights as they lie in the files: dense, EXL2 or GPTQ
 * tensors (pointers into the mapped safetensors), which a backend turns into its own
 * exl_linear (backend/backend.h). The layouts are docs/formats.md's; format/quant.h finds,
 * validates and reads them. */
#ifndef EXL_FORMAT_LINEAR_SRC_H
#define EXL_FORMAT_LINEAR_SRC_H

#include "io/dtype.h"

#include <stdint.h>

typedef enum exl_linear_kind { EXL_LINEAR_DENSE, EXL_LINEAR_EXL2, EXL_LINEAR_GPTQ } exl_linear_kind;

/* An unquantized matrix in Hugging Face layout: [out_features, in_features] row-major. */
typedef struct exl_dense_src {
    exl_dtype dtype; /* F32, F16 or BF16 */
    const void *data;
} exl_dense_src;

/* EXL2 tensors (see docs: formats). Validated by format/ (exl_exl2_check) before reaching a
 * backend. */
typedef struct exl_exl2_src {
    const int32_t *q_weight;     /* [q_rows, n_padded] */
    const int32_t *q_invperm;    /* [in] */
    const int32_t *q_scale;      /* [n_groups, n_padded / 8] */
    const uint16_t *q_scale_max; /* fp16 [n_groups] */
    const int16_t *q_groups;     /* [2 * n_groups]: (bits, first q row) */
    int32_t q_rows, n_padded, n_groups;
} exl_exl2_src;

/* GPTQ tensors, validated by format/ (exl_gptq_check). */
typedef struct exl_gptq_src {
    const int32_t *qweight; /* [in * bits / 32, out] */
    const int32_t *qzeros;  /* [n_groups, out * bits / 32] */
    const uint16_t *scales; /* fp16 [n_groups, out] */
    const int32_t *g_idx;   /* [in] or NULL (row k in group k / group_size) */
    int32_t bits, group_size, n_groups;
    int32_t zero_offset; /* 1 for gptq v1 checkpoints, 0 for v2 */
} exl_gptq_src;

typedef struct exl_linear_src {
    exl_linear_kind kind;
    int64_t in_features, out_features;
    exl_dense_src dense;
    exl_exl2_src exl2;
    exl_gptq_src gptq;
    exl_dtype bias_dtype;
    const void *bias; /* [out_features] or NULL */
    const char *name; /* for messages */
} exl_linear_src;

#endif
