/* openai_error.c - building and serializing OpenAI-shaped errors. */
#include "server/openai_error.h"

#include "base/alloc.h"

#include <cjson/cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

__attribute__((format(printf, 6, 0))) static int vfail(exl_oai_error *err, int status, const char *type,
                                                       const char *param, const char *code, const char *fmt,
                                                       va_list ap) {
    err->status = status;
    err->type = type;
    err->param = param;
    err->code = code;
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    return -1;
}

int exl_oai_fail(exl_oai_error *err, int status, const char *type, const char *param, const char *code, const char *fmt,
                 ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(err, status, type, param, code, fmt, ap);
    va_end(ap);
    return -1;
}

int exl_oai_bad_param(exl_oai_error *err, const char *param, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vfail(err, 400, "invalid_request_error", param, NULL, fmt, ap);
    va_end(ap);
    return -1;
}

static cJSON *string_or_null(const char *s) { return s ? cJSON_CreateString(s) : cJSON_CreateNull(); }

char *exl_oai_error_json(const exl_oai_error *err) {
    cJSON *root = cJSON_CreateObject(), *e = cJSON_CreateObject();
    char *out = NULL;
    if (root && e && cJSON_AddItemToObject(root, "error", e)) {
        e = NULL;
        cJSON *o = cJSON_GetObjectItemCaseSensitive(root, "error");
        if (cJSON_AddStringToObject(o, "message", err->message) &&
            cJSON_AddItemToObject(o, "type", string_or_null(err->type)) &&
            cJSON_AddItemToObject(o, "param", string_or_null(err->param)) &&
            cJSON_AddItemToObject(o, "code", string_or_null(err->code))) {
            char *s = cJSON_PrintUnformatted(root);
            out = s ? exl_strdup(s) : NULL;
            cJSON_free(s);
        }
    }
    cJSON_Delete(e);
    cJSON_Delete(root);
    return out;
}
