/* hf_fields.c - typed reads of Hugging Face config fields with messages that name the field. */
#include "io/hf_fields.h"

#include "base/error.h"

#include <math.h>

const cJSON *exl_jfield(const cJSON *o, const char *key) {
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNull(j) ? NULL : j;
}

int exl_jis_null(const cJSON *o, const char *key) { return cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(o, key)); }

exl_status exl_jget_int(const exl_jctx *c, const cJSON *o, const char *key, int required, long lo, long hi,
                        int32_t *out) {
    const cJSON *j = exl_jfield(o, key);
    if (!j)
        return required ? exl_fail(EXL_ERR_FORMAT, "%s: missing field \"%s%s\"", c->file, c->section, key) : EXL_OK;
    if (!cJSON_IsNumber(j) || j->valuedouble != floor(j->valuedouble))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be an integer", c->file, c->section, key);
    if (j->valuedouble < lo || j->valuedouble > hi)
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" = %.0f is out of range [%ld, %ld]", c->file, c->section,
                        key, j->valuedouble, lo, hi);
    *out = (int32_t)j->valuedouble;
    return EXL_OK;
}

exl_status exl_jget_num(const exl_jctx *c, const cJSON *o, const char *key, double lo, double hi, double *out) {
    const cJSON *j = exl_jfield(o, key);
    if (!j)
        return EXL_OK;
    if (!cJSON_IsNumber(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be a number", c->file, c->section, key);
    if (!(j->valuedouble >= lo && j->valuedouble <= hi))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" = %g is out of range [%g, %g]", c->file, c->section, key,
                        j->valuedouble, lo, hi);
    *out = j->valuedouble;
    return EXL_OK;
}

exl_status exl_jget_bool(const exl_jctx *c, const cJSON *o, const char *key, int *out) {
    const cJSON *j = exl_jfield(o, key);
    if (!j)
        return EXL_OK;
    if (!cJSON_IsBool(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be true or false", c->file, c->section, key);
    *out = cJSON_IsTrue(j);
    return EXL_OK;
}

exl_status exl_jget_str(const exl_jctx *c, const cJSON *o, const char *key, const char **out) {
    const cJSON *j = exl_jfield(o, key);
    if (!j)
        return EXL_OK;
    if (!cJSON_IsString(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be a string", c->file, c->section, key);
    *out = j->valuestring;
    return EXL_OK;
}

exl_status exl_jget_obj(const exl_jctx *c, const cJSON *o, const char *key, const cJSON **out) {
    const cJSON *j = exl_jfield(o, key);
    *out = NULL;
    if (!j)
        return EXL_OK;
    if (!cJSON_IsObject(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be an object or null", c->file, c->section, key);
    *out = j;
    return EXL_OK;
}

exl_status exl_jget_nums(const exl_jctx *c, const cJSON *o, const char *key, float *out, int32_t max, int32_t *n) {
    const cJSON *j = exl_jfield(o, key);
    *n = 0;
    if (!j)
        return EXL_OK;
    if (!cJSON_IsArray(j))
        return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be a list of numbers", c->file, c->section, key);
    for (const cJSON *e = j->child; e; e = e->next) {
        if (!cJSON_IsNumber(e) || !isfinite(e->valuedouble) || fabs(e->valuedouble) > 1e30)
            return exl_fail(EXL_ERR_FORMAT, "%s: field \"%s%s\" must be a list of finite numbers", c->file, c->section,
                            key);
        if (*n == max)
            return exl_fail(EXL_ERR_UNSUPPORTED, "%s: field \"%s%s\" has more than %d entries", c->file, c->section,
                            key, max);
        out[(*n)++] = (float)e->valuedouble;
    }
    return EXL_OK;
}
