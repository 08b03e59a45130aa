/* dtype.h - tensor element types as safetensors names them. */
#ifndef EXL_IO_DTYPE_H
#define EXL_IO_DTYPE_H

#include <stddef.h>

typedef enum exl_dtype {
    EXL_DTYPE_F32,
    EXL_DTYPE_F16,
    EXL_DTYPE_BF16,
    EXL_DTYPE_F64,
    EXL_DTYPE_I64,
    EXL_DTYPE_I32,
    EXL_DTYPE_I16,
    EXL_DTYPE_I8,
    EXL_DTYPE_U8,
    EXL_DTYPE_BOOL,
    EXL_DTYPE_COUNT
} exl_dtype;

size_t exl_dtype_size(exl_dtype t);
const char *exl_dtype_name(exl_dtype t);
/* Returns 0 and sets *out for a known safetensors dtype name, -1 otherwise. */
int exl_dtype_parse(const char *name, exl_dtype *out);

#endif
