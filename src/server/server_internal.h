/* server_internal.h - the server's state, shared by its files (http, routes,
 * completions); see server.h for the outside view. */
#ifndef EXL_SERVER_INTERNAL_H
#define EXL_SERVER_INTERNAL_H

#include "server/engine.h"
#include "server/server.h"

#include <stdatomic.h>

struct MHD_Daemon;

struct exl_server {
    exl_server_params params; /* strings below replace the caller's */
    char *model_name, *host, *api_key;
    exl_model *model;
    exl_tokenizer *tok;
    exl_engine *engine;
    struct MHD_Daemon *mhd;
    int32_t vocab;
    int32_t ctx;
    int32_t port;
    long long started;        /* unix seconds: the model's "created" */
    atomic_int stopping;      /* waiting requests give up */
    atomic_ullong next_id;    /* response ids and default seeds */
};

/* One line to the log callback, if any. */
void exl_server_log(const exl_server *srv, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
