/* server_internal.h - the server's state, shared by its files (routes, completions, tokenize);
 * see server.h for the outside view. */
#ifndef EXL_SERVER_INTERNAL_H
#define EXL_SERVER_INTERNAL_H

#include "server/adapters.h"
#include "server/engine.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/server.h"

#include <pthread.h>
#include <stdatomic.h>

struct oai_run;

struct exl_server {
    exl_server_params params; /* strings below replace the caller's */
    char *model_name, *host, *api_key, *cors_origin, *admin_key;
    exl_srv_adapters adapters; /* LoRA adapters by name */
    exl_model *model;
    exl_model *draft_model; /* speculative decoding, or NULL */
    exl_tokenizer *tok;
    exl_engine *engine;
    exl_http *http;
    int32_t vocab;
    int32_t ctx;
    exl_server_cache cache;
    int32_t port;
    long long started;     /* unix seconds: the model's "created" */
    atomic_int draining;   /* new requests are refused (503) */
    atomic_ullong next_id; /* response ids and default seeds */
    exl_metrics metrics;
    pthread_mutex_t runs_mu; /* the completions in progress, to cancel on stop */
    struct oai_run *runs;
};

#endif
