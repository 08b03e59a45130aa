/* safetensors.h - memory-mapped safetensors files with a fully validated header. */
#ifndef EXL_IO_SAFETENSORS_H
#define EXL_IO_SAFETENSORS_H

#include "exl.h"
#include "io/dtype.h"

#include <stdint.h>

#define EXL_MAX_DIMS 8

typedef struct exl_st_tensor {
    char *name;
    exl_dtype dtype;
    int n_dims;
    int64_t shape[EXL_MAX_DIMS];
    uint64_t offset; /* from the start of the data section */
    uint64_t nbytes;
    const void *data; /* inside the mapping (NULL for header-only parses) */
    const char *path; /* the file it lives in */
} exl_st_tensor;

typedef struct exl_st_file {
    char *path;
    void *map;
    size_t size;
    void *aligned;          /* the tensors' copy when the file's were misaligned, or NULL */
    exl_st_tensor *tensors; /* sorted by name */
    int n_tensors;
} exl_st_file;

/* Map and validate a file: header length within the file, JSON well-formed, every
 * tensor's dtype known, shape consistent with its byte range, range inside the data. Tensors
 * whose bytes are not aligned to their element size in the file (a header length that is not
 * a multiple of 8) are copied once to aligned memory, so data is always safe to read as its type. */
exl_status exl_st_open(const char *path, exl_st_file **out);
void exl_st_close(exl_st_file *f);
/* Parse a whole file image held in memory (used by exl_st_open and the fuzzer). The
 * tensors' data pointers point into buf; path is used in messages only. */
exl_status exl_st_parse(const char *path, const uint8_t *buf, size_t size, exl_st_file **out);
const exl_st_tensor *exl_st_find(const exl_st_file *f, const char *name);
int64_t exl_st_numel(const exl_st_tensor *t);

/* Writing: collect tensors, then write them in one file (data is copied from the given
 * pointers at write time, which must stay valid until then). */
typedef struct exl_st_writer exl_st_writer;
exl_status exl_st_writer_init(exl_st_writer **out);
exl_status exl_st_writer_add(exl_st_writer *w, const char *name, exl_dtype dtype, int n_dims, const int64_t *shape,
                             const void *data);
exl_status exl_st_writer_write(exl_st_writer *w, const char *path);
/* Set the header's __metadata__ to {"format": "pt"} (what transformers and AutoGPTQ write). */
void exl_st_writer_format_pt(exl_st_writer *w);
void exl_st_writer_free(exl_st_writer *w);

#endif
