/* model_util.h - test helpers that write model directories: dtype conversions, shards,
 * and deliberately broken variants of a fixture. */
#ifndef EXL_TEST_MODEL_UTIL_H
#define EXL_TEST_MODEL_UTIL_H

#include "exl.h"
#include "io/dtype.h"

/* Copy src_dir's config.json to dst_dir and write its tensors converted to `dtype`
 * (float tensors only) in n_shards files with an index when n_shards > 1. */
exl_status mu_convert_model(const char *src_dir, const char *dst_dir, exl_dtype dtype, int n_shards);
/* Copy a file byte for byte. */
int mu_copy_file(const char *src, const char *dst);
/* Write text to a file. */
int mu_write_file(const char *path, const void *data, size_t n);
/* Read a whole file (malloc'd). */
char *mu_read_file(const char *path, size_t *n);
/* Quantizer parameters for the tests: the model directory `in` into `out`, calibrated on rows x length tokens of
 * tiny.utf8, two threads on the CPU, the rest exl_quantize_default_params' (the calibration list in static memory). */
exl_quantize_params mu_quantize_params_dir(const char *in, const char *out, int32_t rows, int32_t length);
/* The same for the shared model `model` (its path in a static buffer: until the next call). */
exl_quantize_params mu_quantize_params(const char *model, const char *out, int32_t rows, int32_t length);

#endif
