/* hf_fields.h - typed reads of Hugging Face config fields: an absent field keeps the caller's default, a wrong
 * type or a value out of range is a format error naming the file and the field. */
#ifndef EXL_IO_HF_FIELDS_H
#define EXL_IO_HF_FIELDS_H

#include "exl.h"

#include <cjson/cJSON.h>

/* Where fields are read: the file, and the path of the object inside it ("" or e.g. "rope_parameters.") */
typedef struct exl_jctx {
    const char *file;
    const char *section;
} exl_jctx;

/* The field, or NULL when it is absent or null (null means "the default" for most fields). */
const cJSON *exl_jfield(const cJSON *o, const char *key);
/* The field is present and null (for fields where null and absent differ). */
int exl_jis_null(const cJSON *o, const char *key);

exl_status exl_jget_int(const exl_jctx *c, const cJSON *o, const char *key, int required, long lo, long hi,
                        int32_t *out);
exl_status exl_jget_num(const exl_jctx *c, const cJSON *o, const char *key, double lo, double hi, double *out);
exl_status exl_jget_bool(const exl_jctx *c, const cJSON *o, const char *key, int *out);
exl_status exl_jget_str(const exl_jctx *c, const cJSON *o, const char *key, const char **out);
/* An object-valued field (NULL when absent or null). */
exl_status exl_jget_obj(const exl_jctx *c, const cJSON *o, const char *key, const cJSON **out);
/* A list of numbers into out[0..max): *n gets its length (more than max entries is an error). */
exl_status exl_jget_nums(const exl_jctx *c, const cJSON *o, const char *key, float *out, int32_t max, int32_t *n);

#endif
