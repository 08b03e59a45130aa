/* routes.c - dispatch by body size (413), path and method (404 / 405), the API key (401),
 * and the small routes: GET /health, GET /v1/models, GET /v1/models/{id}. */
#include "server/routes.h"

#include "base/alloc.h"

#include <cjson/cJSON.h>
#include <string.h>

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
    if (!m || !data || !cJSON_AddStringToObject(o, "object", "list") || !cJSON_AddItemToArray(data, m)) {
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

/* ---------------------------------------------------------------- dispatch */

/* "Bearer KEY" compared in time independent of where it differs. */
static int authorized(const exl_server *srv, const char *header) {
    if (!srv->api_key)
        return 1;
    if (!header || strncmp(header, "Bearer ", 7))
        return 0;
    const char *given = header + 7, *key = srv->api_key;
    size_t n = strlen(given), m = strlen(key);
    unsigned diff = n != m;
    for (size_t i = 0; i < m; i++)
        diff |= (unsigned char)key[i] ^ (unsigned char)(i < n ? given[i] : 0);
    return diff == 0;
}

void exl_route(void *server, const exl_http_request *req, exl_http_reply *reply) {
    exl_server *srv = server;
    const char *p = req->path, *allow = NULL;
    exl_oai_error err;
    if (req->too_large) {
        exl_oai_fail(&err, 413, "invalid_request_error", NULL, "request_too_large",
                     "the request body is larger than %lld bytes", (long long)srv->params.max_body);
        exl_reply_error(reply, &err);
        return;
    }
    int kind = -1; /* 0 health, 1 models, 2 one model, 3 completions, 4 chat */
    if (!strcmp(p, "/health"))
        kind = 0, allow = "GET";
    else if (!strcmp(p, "/v1/models"))
        kind = 1, allow = "GET";
    else if (!strncmp(p, "/v1/models/", 11) && p[11])
        kind = 2, allow = "GET";
    else if (!strcmp(p, "/v1/completions"))
        kind = 3, allow = "POST";
    else if (!strcmp(p, "/v1/chat/completions"))
        kind = 4, allow = "POST";
    if (kind < 0) {
        exl_oai_fail(&err, 404, "invalid_request_error", NULL, "unknown_url", "Unknown request URL: %s %.200s",
                     req->method, p);
        exl_reply_error(reply, &err);
        return;
    }
    if (strcmp(req->method, allow) && !(!strcmp(allow, "GET") && !strcmp(req->method, "HEAD"))) {
        exl_oai_fail(&err, 405, "invalid_request_error", NULL, "method_not_allowed",
                     "Method %s is not allowed on %s (use %s)", req->method, p, allow);
        exl_reply_error(reply, &err);
        reply->allow = allow;
        return;
    }
    if (kind > 0 && !authorized(srv, req->authorization)) {
        exl_oai_fail(&err, 401, "invalid_request_error", NULL, "invalid_api_key",
                     req->authorization ? "Incorrect API key provided"
                                        : "Missing API key: send it as 'Authorization: Bearer KEY'");
        exl_reply_error(reply, &err);
        return;
    }
    switch (kind) {
    case 0: health(srv, reply); break;
    case 1: models(srv, reply); break;
    case 2:
        if (strcmp(p + 11, srv->model_name))
            model_not_found(reply, p + 11);
        else
            exl_reply_json(reply, 200, print(model_object(srv)));
        break;
    default: exl_completions(srv, kind == 3 ? EXL_OAI_COMPLETION : EXL_OAI_CHAT, req, reply); break;
    }
}
