/* server.h - the OpenAI-compatible HTTP server (exl serve): its one entry point.
 *
 * A library of its own (exl_server, a layer above libexl that only exl.h reaches into),
 * kept out of exl.h and libexl on purpose: embedders of libexl do not carry the HTTP server.
 * exl_server_start loads the model, starts the engine thread (which owns the generator)
 * and the HTTP daemon (http.h: one event thread for every socket, a few worker threads for
 * the handlers); exl_server_stop drains: it stops accepting, lets the requests in progress
 * finish for up to drain_timeout_s, then cancels what is left (streams end with an SSE error
 * event and [DONE], waiting clients get a 503), stops both and frees all.
 *
 * Routes: POST /v1/completions, POST /v1/chat/completions (SSE when "stream": true),
 * GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize; POST /v1/load_lora_adapter and
 * /v1/unload_lora_adapter with the admin key (adapters.h); and, never needing
 * the API key, GET /health (the generator's jobs and pages) and GET /metrics (Prometheus).
 * Chat prompts are what exl_chat_encode makes of the messages (the model's chat template,
 * else ChatML with its stop marker). Sampling fields a request leaves out take
 * exl_sampling_default(). usage.completion_tokens counts the stop token that ends a
 * completion (as `exl run` does). */
#ifndef EXL_SERVER_H
#define EXL_SERVER_H

#include "exl.h"

/* Receives one line (no newline) per finished request and per server-side problem. */
typedef void (*exl_server_log_fn)(void *ctx, const char *line);

typedef struct exl_server_params {
    const char *model_dir;
    const char *model_name; /* the model id served; NULL = the directory's base name */
    const char *host;       /* address to bind; default "127.0.0.1" */
    int32_t port;           /* 0 = any free port (see exl_server_port); default 8000 */
    const char *api_key;    /* required as "Authorization: Bearer KEY" (any case of "Bearer") on all but
                                /health and /metrics; NULL = open */
    int32_t max_jobs;       /* jobs decoding at once (more wait); default 32 */
    int32_t ctx;            /* tokens per sequence, prompt + completion; 0 = the model's
                                max_position_embeddings capped at 4096 */
    int64_t cache_tokens;   /* KV cache tokens, shared by the jobs (pages are taken as they grow); 0 = what
                                fits in memory (exl_cache_fit_tokens) */
    float gpu_memory;       /* with cache_tokens 0: exl_cache_fit_tokens's memory_fraction; 0 = its default */
    int32_t cache_k_bits, cache_v_bits; /* bits per cached key and value: 16 (default), 8, 6, 4 */
    exl_device device;
    int32_t n_threads;               /* CPU threads; 0 = one per core */
    int64_t max_body;                /* request body limit in bytes (413 beyond); default 4 MiB */
    int32_t max_connections;         /* open connections in all (503 beyond); default 1024 */
    int32_t max_client_connections;  /* per client address (429 beyond); 0 = no cap; default 512 */
    int32_t request_timeout_s;       /* a request's head and body must arrive within this from its
                                       first byte (408); default 10 */
    int32_t idle_timeout_s;          /* idle keep-alive connections, and writes that make no progress; default 60 */
    int32_t drain_timeout_s;         /* on stop, how long requests in progress may go on; default 5 */
    int32_t http_workers;            /* threads running the handlers; default 4 */
    int64_t max_response_tokens;     /* the most a request may ask for: choices x max_tokens x (1 + logprob
                                    entries per token), 400 beyond; default 524288 */
    const char *cors_origin;         /* Access-Control-Allow-Origin: "*" or a comma-separated list of origins;
                                NULL = no CORS */
    const char *const *lora_modules; /* "NAME=DIR[:SCALE]": LoRA adapters a request's "model" selects by NAME */
    int32_t n_lora_modules;
    const char *admin_key;       /* required as "Authorization: Bearer KEY" by POST /v1/load_lora_adapter and
                                    /v1/unload_lora_adapter; NULL = those refuse (403) */
    const char *draft_model_dir; /* speculative decoding: a draft model (same tokenizer), or NULL */
    int32_t draft_tokens;        /* tokens drafted per step; 0 = no drafting (exl_generator_params) */
    int32_t ngram;               /* n-gram drafting (exl_generator_params.ngram); 0 = off */
    int32_t draft_fixed;         /* exl_generator_params.draft_fixed */
    exl_server_log_fn log;       /* may be NULL */
    void *log_ctx;
} exl_server_params;

exl_server_params exl_server_default_params(void);

typedef struct exl_server exl_server;

exl_status exl_server_start(const exl_server_params *params, exl_server **out);
/* The port actually bound (useful with port 0). */
int32_t exl_server_port(const exl_server *srv);
/* The model id clients must name (or omit). */
const char *exl_server_model_name(const exl_server *srv);

/* The KV cache the server took. */
typedef struct exl_server_cache {
    int64_t tokens, bytes;
    int32_t page_size, k_bits, v_bits;
} exl_server_cache;

void exl_server_cache_info(const exl_server *srv, exl_server_cache *out);
void exl_server_stop(exl_server *srv);

#endif
