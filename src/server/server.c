/* server.c - exl_server_start / _stop: load the model and tokenizer (refusing a tokenizer with
 * ids the model does not have), size the generator's KV cache (cache_tokens, or what fits in
 * memory), start the engine thread and the HTTP daemon with the routes as its handlers; on stop,
 * drain. */
#include "server/routes.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#define DEFAULT_CTX_CAP 4096

exl_server_params exl_server_default_params(void) {
    exl_model_params mp = exl_model_default_params();
    return (exl_server_params){.host = "127.0.0.1",
                               .port = 8000,
                               .max_jobs = 32,
                               .cache_k_bits = 16,
                               .cache_v_bits = 16,
                               .device = mp.device,
                               .n_threads = mp.n_threads,
                               .max_body = 4 << 20,
                               .max_connections = 1024,
                               .max_client_connections = 512,
                               .request_timeout_s = 10,
                               .idle_timeout_s = 60,
                               .drain_timeout_s = 5,
                               .http_workers = 4,
                               .max_response_tokens = 1 << 19};
}

static exl_status check_params(const exl_server_params *p) {
    if (!p->model_dir)
        return exl_fail(EXL_ERR_ARG, "server: no model directory");
    if (p->port < 0 || p->port > 65535)
        return exl_fail(EXL_ERR_ARG, "server: port must be in 0..65535");
    if (p->max_jobs < 1 || p->max_jobs > 256)
        return exl_fail(EXL_ERR_ARG, "server: max_jobs must be in 1..256");
    if (p->ctx < 0 || p->max_body < 1 || p->max_connections < 1 || p->request_timeout_s < 1 || p->idle_timeout_s < 1 ||
        p->max_response_tokens < 1 || p->cache_tokens < 0)
        return exl_fail(EXL_ERR_ARG, "server: ctx, max_body, max_connections, request_timeout_s, idle_timeout_s, "
                                     "max_response_tokens and cache_tokens must be positive");
    if (p->max_client_connections < 0 || p->drain_timeout_s < 0)
        return exl_fail(EXL_ERR_ARG, "server: max_client_connections and drain_timeout_s must not be negative");
    if (p->http_workers < 1 || p->http_workers > 256)
        return exl_fail(EXL_ERR_ARG, "server: http_workers must be in 1..256");
    return EXL_OK;
}

static char *base_name(const char *dir) {
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        n--;
    size_t b = n;
    while (b > 0 && dir[b - 1] != '/')
        b--;
    return exl_strndup(dir + b, n - b);
}

/* Pages shorter than this are not worth their bookkeeping */
#define MIN_PAGE_SIZE 16

/* The cache holds cache_tokens, or what fits in memory (on the CPU at most what max_jobs sequences of ctx tokens
 * can use: its pages are touched as they are first used, and a pool larger than that would only make the process
 * grow). max_jobs and ctx are limits, not reservations (jobs take pages as they grow, and wait or are preempted
 * when none is left), but one sequence of ctx tokens must fit. Pages are halved (down to MIN_PAGE_SIZE) while the
 * pool has fewer than two for each of max_jobs jobs. */
static exl_status start_engine(exl_server *srv) {
    const exl_server_params *p = &srv->params;
    exl_generator_params gp = exl_generator_default_params(); /* exl_generator_init checks max_jobs */
    gp.max_jobs = p->max_jobs;
    gp.cache_k_bits = p->cache_k_bits, gp.cache_v_bits = p->cache_v_bits;
    gp.draft_model = srv->draft_model;
    gp.draft_tokens = p->draft_tokens;
    gp.ngram = p->ngram;
    gp.draft_fixed = p->draft_fixed;
    int64_t tokens = p->cache_tokens, token_bytes, draft_bytes = 0;
    EXL_TRY(exl_cache_token_bytes(srv->model, gp.cache_k_bits, gp.cache_v_bits, &token_bytes));
    if (srv->draft_model) /* the draft's cache has as many pages, at 16 bits */
        EXL_TRY(exl_cache_token_bytes(srv->draft_model, 16, 16, &draft_bytes));
    if (!tokens) {
        exl_model_desc d;
        exl_model_describe(srv->model, &d);
        EXL_TRY(exl_cache_fit_tokens(srv->model, gp.cache_k_bits, gp.cache_v_bits, p->gpu_memory, &tokens));
        tokens = tokens * token_bytes / (token_bytes + draft_bytes);
        if (!strcmp(d.backend, "cpu") && tokens > (int64_t)p->max_jobs * srv->ctx)
            tokens = (int64_t)p->max_jobs * srv->ctx;
    }
    if (srv->ctx < gp.page_size)
        gp.page_size = srv->ctx;
    while (gp.page_size / 2 >= MIN_PAGE_SIZE && tokens / gp.page_size < 2 * (int64_t)gp.max_jobs)
        gp.page_size /= 2;
    int64_t pages = tokens / gp.page_size;
    if (pages * gp.page_size < srv->ctx)
        return exl_fail(EXL_ERR_ARG, "server: a kv cache of %lld tokens cannot hold one sequence of %d tokens (ctx)%s",
                        (long long)(pages * gp.page_size), (int)srv->ctx,
                        p->cache_tokens ? "" : ": that is what fits in memory");
    if (pages > INT32_MAX / gp.page_size)
        return exl_fail(EXL_ERR_ARG, "server: a kv cache of %lld tokens is too large", (long long)tokens);
    gp.n_pages = (int32_t)pages;
    srv->cache = (exl_server_cache){pages * gp.page_size, pages * gp.page_size * (token_bytes + draft_bytes),
                                    gp.page_size, gp.cache_k_bits, gp.cache_v_bits};
    return exl_engine_start(srv->model, srv->tok, &gp, &srv->engine);
}

static exl_status load(exl_server *srv) {
    const exl_server_params *p = &srv->params;
    exl_model_params mp = exl_model_default_params();
    mp.device = p->device;
    mp.n_threads = p->n_threads;
    EXL_TRY(exl_model_load(p->model_dir, &mp, &srv->model));
    if (p->draft_model_dir)
        EXL_TRY(exl_model_load(p->draft_model_dir, &mp, &srv->draft_model));
    EXL_TRY(exl_tokenizer_load(p->model_dir, &srv->tok));
    exl_model_desc d;
    exl_model_describe(srv->model, &d);
    srv->vocab = d.vocab_size;
    /* a token the model has no row for would fail every request that meets it */
    if (exl_tokenizer_vocab_size(srv->tok) > srv->vocab)
        return exl_fail(EXL_ERR_FORMAT,
                        "server: the tokenizer in %s has token ids up to %d, but the model's vocabulary has %d "
                        "(a tokenizer for another model?)",
                        p->model_dir, (int)exl_tokenizer_vocab_size(srv->tok) - 1, (int)srv->vocab);
    srv->ctx = p->ctx ? p->ctx
               : d.max_position_embeddings > 0 && d.max_position_embeddings < DEFAULT_CTX_CAP
                   ? d.max_position_embeddings
                   : DEFAULT_CTX_CAP;
    if (srv->ctx < 2)
        return exl_fail(EXL_ERR_ARG, "server: ctx must be at least 2 tokens");
    for (int32_t i = 0; i < p->n_lora_modules; i++)
        EXL_TRY(exl_adapters_add_spec(srv, p->lora_modules[i]));
    return start_engine(srv);
}

static exl_status listen_http(exl_server *srv) {
    const exl_server_params *p = &srv->params;
    exl_http_params hp = {.host = srv->host,
                          .port = p->port,
                          .max_body = p->max_body,
                          .max_connections = p->max_connections,
                          .max_client_connections = p->max_client_connections,
                          .request_timeout_s = p->request_timeout_s,
                          .idle_timeout_s = p->idle_timeout_s,
                          .workers = p->http_workers,
                          .cors_origin = srv->cors_origin,
                          .admit = exl_route_admit,
                          .handle = exl_route_handle,
                          .user = srv,
                          .log = p->log,
                          .log_ctx = p->log_ctx};
    EXL_TRY(exl_http_start(&hp, &srv->http));
    srv->port = exl_http_port(srv->http);
    return EXL_OK;
}

exl_status exl_server_start(const exl_server_params *params, exl_server **out) {
    *out = NULL;
    EXL_TRY(check_params(params));
    exl_server *srv = exl_calloc(1, sizeof *srv);
    if (!srv)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    srv->params = *params;
    srv->started = (long long)time(NULL);
    atomic_init(&srv->draining, 0);
    atomic_init(&srv->next_id, (unsigned long long)srv->started << 20);
    exl_metrics_init(&srv->metrics);
    pthread_mutex_init(&srv->runs_mu, NULL);
    exl_adapters_init(&srv->adapters);
    srv->model_name = params->model_name ? exl_strdup(params->model_name) : base_name(params->model_dir);
    srv->host = exl_strdup(params->host ? params->host : "127.0.0.1");
    srv->api_key = params->api_key ? exl_strdup(params->api_key) : NULL;
    srv->cors_origin = params->cors_origin ? exl_strdup(params->cors_origin) : NULL;
    srv->admin_key = params->admin_key ? exl_strdup(params->admin_key) : NULL;
    exl_status st = !srv->model_name || !srv->host || (params->api_key && !srv->api_key) ||
                            (params->admin_key && !srv->admin_key) || (params->cors_origin && !srv->cors_origin)
                        ? exl_fail(EXL_ERR_NOMEM, "out of memory")
                        : EXL_OK;
    if (st == EXL_OK)
        st = load(srv);
    if (st == EXL_OK)
        st = listen_http(srv);
    if (st != EXL_OK) {
        exl_server_stop(srv);
        return st;
    }
    *out = srv;
    return EXL_OK;
}

int32_t exl_server_port(const exl_server *srv) { return srv->port; }

const char *exl_server_model_name(const exl_server *srv) { return srv->model_name; }

static void wait_idle(exl_server *srv, double seconds) {
    double until = exl_http_now() + seconds;
    while (exl_http_busy(srv->http) > 0 && exl_http_now() < until)
        nanosleep(&(struct timespec){.tv_nsec = 10 * 1000 * 1000}, NULL);
}

/* Stop accepting, let the requests in progress finish for up to drain_timeout_s, then cancel
 * what is left and give its answers (503, or an SSE error event and [DONE]) a moment to go out. */
static void drain(exl_server *srv) {
    atomic_store(&srv->draining, 1);
    exl_http_quiesce(srv->http);
    wait_idle(srv, srv->params.drain_timeout_s);
    exl_completions_cancel_all(srv);
    wait_idle(srv, 2.0);
}

void exl_server_cache_info(const exl_server *srv, exl_server_cache *out) { *out = srv->cache; }

void exl_server_stop(exl_server *srv) {
    if (!srv)
        return;
    if (srv->http)
        drain(srv);
    exl_http_stop(srv->http);
    exl_engine_stop(srv->engine); /* the cancelled jobs end at its next step */
    exl_tokenizer_free(srv->tok);
    exl_adapters_free(&srv->adapters);
    exl_model_free(srv->draft_model);
    exl_model_free(srv->model);
    pthread_mutex_destroy(&srv->runs_mu);
    exl_free(srv->model_name);
    exl_free(srv->host);
    exl_free(srv->api_key);
    exl_free(srv->cors_origin);
    exl_free(srv->admin_key);
    exl_free(srv);
}
