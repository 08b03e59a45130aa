/* adapters.c - the server's named LoRA adapters (adapters.h). */
#include "server/adapters.h"

#include "base/alloc.h"
#include "base/error.h"
#include "server/openai_response.h"
#include "server/routes.h"

#include <stdio.h>
#include <string.h>

void exl_adapters_init(exl_srv_adapters *a) {
    pthread_mutex_init(&a->mu, NULL);
    a->list = NULL;
}

static void free_entry(exl_srv_adapter *e) {
    exl_free(e->name);
    exl_free(e->dir);
    exl_free(e);
}

void exl_adapters_free(exl_srv_adapters *a) {
    while (a->list) {
        exl_srv_adapter *e = a->list;
        a->list = e->next;
        free_entry(e);
    }
    pthread_mutex_destroy(&a->mu);
}

void exl_adapters_lock(exl_srv_adapters *a) { pthread_mutex_lock(&a->mu); }
void exl_adapters_unlock(exl_srv_adapters *a) { pthread_mutex_unlock(&a->mu); }

const exl_srv_adapter *exl_adapters_find(exl_srv_adapters *a, const char *name) {
    for (const exl_srv_adapter *e = a->list; e; e = e->next)
        if (!strcmp(e->name, name))
            return e;
    return NULL;
}

/* ---- loading and unloading (on the engine thread once it runs) */

typedef struct load_call {
    exl_model *model;
    const char *spec; /* DIR[:SCALE] */
    exl_lora_use use;
} load_call;

static exl_status load_on_engine(void *ctx) {
    load_call *c = ctx;
    return exl_lora_load_spec(c->model, c->spec, &c->use);
}

static exl_status free_on_engine(void *ctx) {
    exl_lora_free((exl_lora *)ctx);
    return EXL_OK;
}

static exl_status run_on_engine(exl_server *srv, exl_status (*fn)(void *), void *ctx) {
    return srv->engine ? exl_engine_call(srv->engine, fn, ctx) : fn(ctx);
}

/* load spec as name; EXL_ERR_ARG when the name is taken */
static exl_status add(exl_server *srv, const char *name, const char *spec) {
    exl_srv_adapters *a = &srv->adapters;
    if (!name[0] || !strcmp(name, srv->model_name))
        return exl_fail(EXL_ERR_ARG, "LoRA adapter name \"%s\": empty, or the base model's", name);
    exl_srv_adapter *e = exl_calloc(1, sizeof *e);
    if (!e || !(e->name = exl_strdup(name)) || !(e->dir = exl_strdup(spec))) {
        if (e)
            free_entry(e);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    load_call c = {srv->model, spec, {0}};
    exl_status st = run_on_engine(srv, load_on_engine, &c);
    if (st == EXL_OK)
        e->use = c.use;
    exl_adapters_lock(a);
    if (st == EXL_OK && exl_adapters_find(a, name))
        st = exl_fail(EXL_ERR_ARG, "a LoRA adapter named \"%s\" is loaded already", name);
    if (st == EXL_OK) { /* listed in load order */
        exl_srv_adapter **end = &a->list;
        while (*end)
            end = &(*end)->next;
        *end = e;
    }
    exl_adapters_unlock(a);
    if (st != EXL_OK) {
        if (e->use.lora)
            run_on_engine(srv, free_on_engine, (void *)(uintptr_t)e->use.lora);
        free_entry(e);
    }
    return st;
}

exl_status exl_adapters_add_spec(exl_server *srv, const char *spec) {
    const char *eq = strchr(spec, '=');
    if (!eq || eq == spec || !eq[1])
        return exl_fail(EXL_ERR_ARG, "--lora-modules %s: give NAME=DIR[:SCALE]", spec);
    char *name = exl_strndup(spec, (size_t)(eq - spec));
    if (!name)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = add(srv, name, eq + 1);
    exl_free(name);
    return st;
}

/* ---- /v1/models */

static cJSON *object_of(const exl_server *srv, const exl_srv_adapter *e) {
    cJSON *m = cJSON_CreateObject();
    if (m && cJSON_AddStringToObject(m, "id", e->name) && cJSON_AddStringToObject(m, "object", "model") &&
        cJSON_AddNumberToObject(m, "created", (double)srv->started) && cJSON_AddStringToObject(m, "owned_by", "exl") &&
        cJSON_AddStringToObject(m, "root", e->dir) && cJSON_AddStringToObject(m, "parent", srv->model_name) &&
        cJSON_AddNumberToObject(m, "max_model_len", srv->ctx))
        return m;
    cJSON_Delete(m);
    return NULL;
}

int exl_adapters_list(exl_server *srv, cJSON *data) {
    int rc = 0;
    exl_adapters_lock(&srv->adapters);
    for (const exl_srv_adapter *e = srv->adapters.list; e && !rc; e = e->next) {
        cJSON *m = object_of(srv, e);
        rc = m && cJSON_AddItemToArray(data, m) ? 0 : -1;
        if (rc)
            cJSON_Delete(m);
    }
    exl_adapters_unlock(&srv->adapters);
    return rc;
}

cJSON *exl_adapters_model(exl_server *srv, const char *name) {
    exl_adapters_lock(&srv->adapters);
    const exl_srv_adapter *e = exl_adapters_find(&srv->adapters, name);
    cJSON *m = e ? object_of(srv, e) : NULL;
    exl_adapters_unlock(&srv->adapters);
    return m;
}

/* ---- the admin routes */

/* the body's string field key (required), or NULL with err filled */
static const char *string_field(const cJSON *root, const char *key, exl_oai_error *err) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, key);
    if (cJSON_IsString(f) && f->valuestring[0])
        return f->valuestring;
    exl_oai_bad_param(err, key, "'%s' must be a non-empty string", key);
    return NULL;
}

static void reply_ok(exl_http_reply *reply, const char *what, const char *name) {
    cJSON *o = cJSON_CreateObject();
    char *s = NULL;
    if (o && cJSON_AddStringToObject(o, "status", "ok") && cJSON_AddStringToObject(o, what, name))
        s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    exl_reply_json(reply, 200, s ? exl_strdup(s) : NULL);
    cJSON_free(s);
}

void exl_adapters_load_route(exl_server *srv, const exl_http_request *req, exl_http_reply *reply) {
    exl_oai_error err = {0};
    cJSON *root = exl_oai_json_parse(req->body, req->body_len, &err);
    const char *name = root ? string_field(root, "lora_name", &err) : NULL;
    const char *path = name ? string_field(root, "lora_path", &err) : NULL;
    const cJSON *scale = root ? cJSON_GetObjectItemCaseSensitive(root, "scale") : NULL;
    if (path && scale && !cJSON_IsNumber(scale))
        path = NULL, exl_oai_bad_param(&err, "scale", "'scale' must be a number");
    if (path) {
        char spec[4096];
        if (scale)
            snprintf(spec, sizeof spec, "%s:%.9g", path, scale->valuedouble);
        else
            snprintf(spec, sizeof spec, "%s", path);
        exl_status st = add(srv, name, spec);
        if (st == EXL_OK)
            reply_ok(reply, "loaded", name);
        else if (st == EXL_ERR_NOMEM)
            exl_oai_fail(&err, 500, "server_error", NULL, NULL, "%s", exl_last_error());
        else
            exl_oai_fail(&err, 400, "invalid_request_error", "lora_path", "invalid_adapter", "%s", exl_last_error());
    }
    cJSON_Delete(root);
    if (err.status)
        exl_reply_error(reply, &err);
}

void exl_adapters_unload_route(exl_server *srv, const exl_http_request *req, exl_http_reply *reply) {
    exl_oai_error err = {0};
    cJSON *root = exl_oai_json_parse(req->body, req->body_len, &err);
    const char *name = root ? string_field(root, "lora_name", &err) : NULL;
    exl_srv_adapter *gone = NULL;
    if (name) {
        exl_srv_adapters *a = &srv->adapters;
        exl_adapters_lock(a);
        exl_srv_adapter **link = &a->list;
        while (*link && strcmp((*link)->name, name))
            link = &(*link)->next;
        if (!*link)
            exl_oai_fail(&err, 404, "invalid_request_error", "lora_name", "model_not_found",
                         "No LoRA adapter named '%.200s' is loaded", name);
        else if (exl_lora_users((*link)->use.lora) > 0)
            exl_oai_fail(&err, 409, "invalid_request_error", "lora_name", "adapter_in_use",
                         "LoRA adapter '%.200s' is in use by %d jobs; try again when they are done", name,
                         (int)exl_lora_users((*link)->use.lora));
        else {
            gone = *link;
            *link = gone->next;
        }
        exl_adapters_unlock(a);
    }
    if (gone) { /* no request can find it any more, and no job holds it */
        run_on_engine(srv, free_on_engine, (void *)(uintptr_t)gone->use.lora);
        reply_ok(reply, "unloaded", gone->name);
        free_entry(gone);
    }
    cJSON_Delete(root);
    if (err.status)
        exl_reply_error(reply, &err);
}
