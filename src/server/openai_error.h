/* openai_error.h - an error in OpenAI's shape: HTTP status plus
 * {"error": {"message", "type", "param", "code"}}. */
#ifndef EXL_SERVER_OPENAI_ERROR_H
#define EXL_SERVER_OPENAI_ERROR_H

typedef struct exl_oai_error {
    int status;        /* HTTP status, 0 = no error */
    const char *type;  /* "invalid_request_error", "authentication_error", "server_error", ... */
    const char *param; /* the request field at fault, or NULL */
    const char *code;  /* a machine-readable code, or NULL */
    char message[512];
} exl_oai_error;

/* Fill *err; returns -1 so a validator reads `return exl_oai_fail(err, 400, ...);`. */
int exl_oai_fail(exl_oai_error *err, int status, const char *type, const char *param, const char *code, const char *fmt,
                 ...) __attribute__((format(printf, 6, 7)));
/* 400 invalid_request_error naming param. */
int exl_oai_bad_param(exl_oai_error *err, const char *param, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The error object as JSON text (exl_malloc'd; NULL when out of memory). */
char *exl_oai_error_json(const exl_oai_error *err);

#endif
