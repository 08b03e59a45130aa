/* weights.h - the tensors of a model directory: one safetensors file or an indexed set of shards. */
#ifndef EXL_IO_WEIGHTS_H
#define EXL_IO_WEIGHTS_H

#include "io/safetensors.h"

typedef struct exl_weights {
    exl_st_file **files;
    int n_files;
    uint64_t total_bytes; /* sum of file sizes */
} exl_weights;

/* Opens dir/model.safetensors.index.json (all shards it names), else dir/model.safetensors,
 * else the single *.safetensors file in dir (e.g. EXL2's output.safetensors). An index that names a
 * file the directory lacks (ExLlamaV2 copies its source's index) is ignored with a notice, and every
 * *.safetensors file in dir is opened instead. */
exl_status exl_weights_open(const char *dir, exl_weights **out);
void exl_weights_close(exl_weights *w);
const exl_st_tensor *exl_weights_find(const exl_weights *w, const char *name);
/* Find a tensor and check its dtype set and shape; a missing tensor or a mismatch is
 * a format error naming the tensor and file. n_dims < 0 skips the shape check;
 * a shape entry < 0 matches any size. allowed_dtypes is a bit mask of (1 << exl_dtype). */
exl_status exl_weights_get(const exl_weights *w, const char *name, unsigned allowed_dtypes, int n_dims,
                           const int64_t *shape, const exl_st_tensor **out);

#define EXL_DTYPES_FLOAT ((1u << EXL_DTYPE_F32) | (1u << EXL_DTYPE_F16) | (1u << EXL_DTYPE_BF16))

#endif
