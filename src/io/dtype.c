/* dtype.c - names and sizes of tensor element types. */
#include "dtype.h"

#include <string.h>

static const struct {
    const char *name;
    size_t size;
} dtypes[EXL_DTYPE_COUNT] = {
    [EXL_DTYPE_F32] = {"F32", 4},   [EXL_DTYPE_F16] = {"F16", 2}, [EXL_DTYPE_BF16] = {"BF16", 2},
    [EXL_DTYPE_F64] = {"F64", 8},   [EXL_DTYPE_I64] = {"I64", 8}, [EXL_DTYPE_I32] = {"I32", 4},
    [EXL_DTYPE_I16] = {"I16", 2},   [EXL_DTYPE_I8] = {"I8", 1},   [EXL_DTYPE_U8] = {"U8", 1},
    [EXL_DTYPE_BOOL] = {"BOOL", 1},
};

size_t exl_dtype_size(exl_dtype t) { return (unsigned)t < EXL_DTYPE_COUNT ? dtypes[t].size : 0; }

const char *exl_dtype_name(exl_dtype t) { return (unsigned)t < EXL_DTYPE_COUNT ? dtypes[t].name : "?"; }

int exl_dtype_parse(const char *name, exl_dtype *out) {
    for (int i = 0; i < EXL_DTYPE_COUNT; i++)
        if (!strcmp(name, dtypes[i].name)) {
            *out = (exl_dtype)i;
            return 0;
        }
    return -1;
}
