/* adapters.h - the server's LoRA adapters by name: those of --lora-modules NAME=DIR[:SCALE], and those loaded or
 * unloaded at run time through POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's shapes, guarded by
 * the admin key). A request whose "model" names an adapter runs with it (vLLM's convention); GET /v1/models lists
 * them after the base model. Loading and unloading change the model, so they run on the engine thread between
 * steps; an adapter that jobs still hold is not unloaded (409). */
#ifndef EXL_SERVER_ADAPTERS_H
#define EXL_SERVER_ADAPTERS_H

#include "server/http.h"

#include <cjson/cJSON.h>
#include <pthread.h>

struct exl_server;

typedef struct exl_srv_adapter {
    char *name, *dir;
    exl_lora_use use;
    struct exl_srv_adapter *next;
} exl_srv_adapter;

typedef struct exl_srv_adapters {
    pthread_mutex_t mu; /* the list; held from finding an adapter until its jobs are submitted */
    exl_srv_adapter *list;
} exl_srv_adapters;

void exl_adapters_init(exl_srv_adapters *a);
/* The names (the adapters themselves go with the model). */
void exl_adapters_free(exl_srv_adapters *a);
/* Load "NAME=DIR[:SCALE]" (--lora-modules). */
exl_status exl_adapters_add_spec(struct exl_server *srv, const char *spec);
void exl_adapters_lock(exl_srv_adapters *a);
void exl_adapters_unlock(exl_srv_adapters *a);
/* The adapter called name (under the lock), or NULL. */
const exl_srv_adapter *exl_adapters_find(exl_srv_adapters *a, const char *name);
/* GET /v1/models: each adapter's model object appended to data; -1 when out of memory. */
int exl_adapters_list(struct exl_server *srv, cJSON *data);
/* GET /v1/models/{name} of an adapter: its object, or NULL when there is none. */
cJSON *exl_adapters_model(struct exl_server *srv, const char *name);
/* POST /v1/load_lora_adapter {"lora_name", "lora_path", "scale"?} and /v1/unload_lora_adapter {"lora_name"}. */
void exl_adapters_load_route(struct exl_server *srv, const exl_http_request *req, exl_http_reply *reply);
void exl_adapters_unload_route(struct exl_server *srv, const exl_http_request *req, exl_http_reply *reply);

#endif
