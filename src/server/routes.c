/* routes.c - dispatch by path and method (404 / 405) and the API key (401), all decided from
 * the head before any body is read; the small routes answered from the head: GET / (the web chat),
 * GET /health, GET /metrics, GET /v1/models, GET /v1/models/{id}; and the POST routes handed on. */
#include "server/routes.h"

#include "base/alloc.h"
#include "server/chat_page.h"

#include <cjson/cJSON.h>
#include <string.h>
#include <strings.h>

/* ---------------------------------------------------------------- replies */

void exl_reply_json(exl_http_reply *reply, int status, char *json) {
    if (!json) {
        static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":\"server_error\","
                                  "\"param\":null,\"code\":null}}";
        json = exl_strdup(oom);
        status = 500;
    }
    reply->status = json ? status : 0;
    reply->body = json;
    reply->body_len = json ? strlen(json) : 0;
}

void exl_reply_error(exl_http_reply *reply, const exl_oai_error *err) {
    exl_reply_json(reply, err->status, exl_oai_error_json(err));
}

static char *print(cJSON *o) {
    char *s = o ? cJSON_PrintUnformatted(o) : NULL;
    char *out = s ? exl_strdup(s) : NULL;
    cJSON_free(s);
    cJSON_Delete(o);
    return out;
}

/* ---------------------------------------------------------------- small routes */

static cJSON *model_object(const exl_server *srv) {
    cJSON *m = cJSON_CreateObject();
    if (m && cJSON_AddStringToObject(m, "id", srv->model_name) && cJSON_AddStringToObject(m, "object", "model") &&
        cJSON_AddNumberToObject(m, "created", (double)srv->started) && cJSON_AddStringToObject(m, "owned_by", "exl") &&
        cJSON_AddNumberToObject(m, "max_model_len", srv->ctx))
        return m;
    cJSON_Delete(m);
    return NULL;
}

static void models(exl_server *srv, exl_http_reply *reply) {
    cJSON *o = cJSON_CreateObject(), *m = model_object(srv);
    cJSON *data = o ? cJSON_AddArrayToObject(o, "data") : NULL;
    if (!m || !data || !cJSON_AddStringToObject(o, "object", "list") || !cJSON_AddItemToArray(data, m) ||
        exl_adapters_list(srv, data)) {
        cJSON_Delete(m);
        cJSON_Delete(o);
        o = NULL;
    }
    exl_reply_json(reply, 200, print(o));
}

static void model_not_found(exl_http_reply *reply, const char *name) {
    exl_oai_error err;
    exl_oai_fail(&err, 404, "invalid_request_error", "model", "model_not_found", "The model '%.200s' does not exist",
                 name);
    exl_reply_error(reply, &err);
}

static void health(exl_server *srv, exl_http_reply *reply) {
    exl_generator_stats s;
    exl_engine_stats(srv->engine, &s);
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddStringToObject(o, "status", "ok") || !cJSON_AddStringToObject(o, "model", srv->model_name) ||
        !cJSON_AddNumberToObject(o, "jobs_running", s.jobs_running) ||
        !cJSON_AddNumberToObject(o, "jobs_waiting", s.jobs_waiting) ||
        !cJSON_AddNumberToObject(o, "jobs_finished", (double)s.jobs_finished) ||
        !cJSON_AddNumberToObject(o, "pages_total", s.pages_total) ||
        !cJSON_AddNumberToObject(o, "pages_used", s.pages_used) ||
        !cJSON_AddNumberToObject(o, "pages_cached", s.pages_cached) ||
        !cJSON_AddNumberToObject(o, "tokens_generated", (double)s.tokens_generated)) {
        cJSON_Delete(o);
        o = NULL;
    }
    exl_reply_json(reply, 200, print(o));
}

static void metrics(exl_server *srv, exl_http_reply *reply) {
    exl_generator_stats s;
    exl_engine_stats(srv->engine, &s);
    exl_str out = EXL_STR_INIT;
    if (exl_metrics_write(&out, &srv->metrics, &s, srv->http)) {
        exl_str_free(&out);
        exl_reply_json(reply, 500, NULL);
        return;
    }
    reply->status = 200;
    reply->content_type = "text/plain; version=0.0.4; charset=utf-8";
    reply->body_len = out.len;
    reply->body = exl_str_steal(&out);
}

/* ---------------------------------------------------------------- dispatch */

/* "Bearer KEY" (the scheme in any case, RFC 7235) compared in time independent of where it differs; no key: open. */
static int authorized(const char *key, const char *header) {
    if (!key)
        return 1;
    if (!header || strncasecmp(header, "Bearer", 6) || (header[6] != ' ' && header[6] != '\t'))
        return 0;
    const char *given = header + 6;
    while (*given == ' ' || *given == '\t')
        given++;
    size_t n = strlen(given), m = strlen(key);
    unsigned diff = n != m;
    for (size_t i = 0; i < m; i++)
        diff |= (unsigned char)key[i] ^ (unsigned char)(i < n ? given[i] : 0);
    return diff == 0;
}

static const struct {
    const char *path;
    int prefix; /* the path goes on (a model id) */
    exl_route_kind kind;
    const char *method;
    int open; /* no API key needed; 2: the admin key instead */
} ROUTES[] = {
    {"/", 0, EXL_ROUTE_CHAT_PAGE, "GET", 1}, /* the page asks for the key itself */
    {"/health", 0, EXL_ROUTE_HEALTH, "GET", 1},
    {"/metrics", 0, EXL_ROUTE_METRICS, "GET", 1},
    {"/v1/models", 0, EXL_ROUTE_MODELS, "GET", 0},
    {"/v1/models/", 1, EXL_ROUTE_MODEL, "GET", 0},
    {"/v1/completions", 0, EXL_ROUTE_COMPLETIONS, "POST", 0},
    {"/v1/chat/completions", 0, EXL_ROUTE_CHAT, "POST", 0},
    {"/tokenize", 0, EXL_ROUTE_TOKENIZE, "POST", 0},
    {"/detokenize", 0, EXL_ROUTE_DETOKENIZE, "POST", 0},
    {"/v1/load_lora_adapter", 0, EXL_ROUTE_LOAD_LORA, "POST", 2},
    {"/v1/unload_lora_adapter", 0, EXL_ROUTE_UNLOAD_LORA, "POST", 2},
};

int exl_route_find(const exl_server *srv, const exl_http_request *req, exl_route_kind *kind, exl_http_reply *reply) {
    const char *p = req->path;
    exl_oai_error err;
    size_t i = 0, n = sizeof ROUTES / sizeof ROUTES[0];
    while (i < n && (ROUTES[i].prefix ? strncmp(p, ROUTES[i].path, strlen(ROUTES[i].path)) || !p[strlen(ROUTES[i].path)]
                                      : strcmp(p, ROUTES[i].path)))
        i++;
    if (i == n) {
        exl_oai_fail(&err, 404, "invalid_request_error", NULL, "unknown_url", "Unknown request URL: %s %.200s",
                     req->method, p);
        exl_reply_error(reply, &err);
        return 0;
    }
    const char *allow = ROUTES[i].method;
    if (strcmp(req->method, allow) && !(!strcmp(allow, "GET") && !strcmp(req->method, "HEAD"))) {
        exl_oai_fail(&err, 405, "invalid_request_error", NULL, "method_not_allowed",
                     "Method %.32s is not allowed on %.200s (use %s)", req->method, p, allow);
        exl_reply_error(reply, &err);
        reply->allow = allow;
        return 0;
    }
    if (ROUTES[i].open == 2 && !srv->admin_key) {
        exl_oai_fail(&err, 403, "invalid_request_error", NULL, "admin_disabled",
                     "%.200s needs the server to be started with an admin key (--admin-key)", p);
        exl_reply_error(reply, &err);
        return 0;
    }
    if (!authorized(ROUTES[i].open == 2 ? srv->admin_key : ROUTES[i].open ? NULL : srv->api_key, req->authorization)) {
        exl_oai_fail(&err, 401, "invalid_request_error", NULL, "invalid_api_key",
                     req->authorization ? "Incorrect API key provided"
                                        : "Missing API key: send it as 'Authorization: Bearer KEY'");
        exl_reply_error(reply, &err);
        return 0;
    }
    *kind = ROUTES[i].kind;
    return 1;
}

int exl_route_admit(void *server, const exl_http_request *req, exl_http_reply *reply) {
    exl_server *srv = server;
    exl_route_kind kind;
    if (!exl_route_find(srv, req, &kind, reply))
        return 0;
    switch (kind) {
    case EXL_ROUTE_CHAT_PAGE: exl_chat_page(reply); return 0;
    case EXL_ROUTE_HEALTH: health(srv, reply); return 0;
    case EXL_ROUTE_METRICS: metrics(srv, reply); return 0;
    case EXL_ROUTE_MODELS: models(srv, reply); return 0;
    case EXL_ROUTE_MODEL: {
        cJSON *m = strcmp(req->path + 11, srv->model_name) ? exl_adapters_model(srv, req->path + 11)
                                                           : model_object(srv);
        if (!m)
            model_not_found(reply, req->path + 11);
        else
            exl_reply_json(reply, 200, print(m));
        return 0;
    }
    default: break;
    }
    if (atomic_load(&srv->draining)) {
        exl_oai_error err;
        exl_oai_fail(&err, 503, "server_error", NULL, "shutting_down", "the server is shutting down");
        exl_reply_error(reply, &err);
        return 0;
    }
    return 1;
}

void exl_route_handle(void *server, const exl_http_request *req, exl_http_reply *reply) {
    exl_server *srv = server;
    exl_route_kind kind;
    if (!exl_route_find(srv, req, &kind, reply))
        return;
    switch (kind) {
    case EXL_ROUTE_COMPLETIONS: exl_completions(srv, EXL_OAI_COMPLETION, req, reply); break;
    case EXL_ROUTE_CHAT: exl_completions(srv, EXL_OAI_CHAT, req, reply); break;
    case EXL_ROUTE_TOKENIZE: exl_tokenize(srv, req, reply); break;
    case EXL_ROUTE_DETOKENIZE: exl_detokenize(srv, req, reply); break;
    case EXL_ROUTE_LOAD_LORA: exl_adapters_load_route(srv, req, reply); break;
    case EXL_ROUTE_UNLOAD_LORA: exl_adapters_unload_route(srv, req, reply); break;
    default: exl_reply_json(reply, 500, NULL); break; /* GET routes are answered in admit */
    }
}
