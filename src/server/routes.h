/* routes.h - what the server answers: finding a request's route (path, method, API key), the
 * HTTP layer's admit and handle callbacks, the JSON and error replies the routes build, and the
 * endpoints that live in their own files. */
#ifndef EXL_SERVER_ROUTES_H
#define EXL_SERVER_ROUTES_H

#include "server/http.h"
#include "server/openai_request.h"
#include "server/server_internal.h"

typedef enum exl_route_kind {
    EXL_ROUTE_HEALTH,
    EXL_ROUTE_METRICS,
    EXL_ROUTE_MODELS,
    EXL_ROUTE_MODEL,
    EXL_ROUTE_COMPLETIONS,
    EXL_ROUTE_CHAT,
    EXL_ROUTE_TOKENIZE,
    EXL_ROUTE_DETOKENIZE,
    EXL_ROUTE_CHAT_PAGE,
    EXL_ROUTE_LOAD_LORA,
    EXL_ROUTE_UNLOAD_LORA,
} exl_route_kind;

/* The route of a request by its path, method and Authorization header: 1 with *kind set, or 0
 * with reply filled (404, 405, 401; 403 for the admin routes of a server without an admin key). Reads only the
 * server's API and admin keys. */
int exl_route_find(const exl_server *srv, const exl_http_request *req, exl_route_kind *kind, exl_http_reply *reply);
/* exl_http_admit_fn: answer the GET routes and every refusal from the head; POSTs read their body. */
int exl_route_admit(void *srv, const exl_http_request *req, exl_http_reply *reply);
/* exl_http_handle_fn: the POST routes. */
void exl_route_handle(void *srv, const exl_http_request *req, exl_http_reply *reply);

/* Fill reply with an OpenAI-shaped error. */
void exl_reply_error(exl_http_reply *reply, const exl_oai_error *err);
/* Fill reply with a JSON body (json is taken over; NULL means out of memory: 500). */
void exl_reply_json(exl_http_reply *reply, int status, char *json);

/* completions.c: POST /v1/completions and /v1/chat/completions. */
void exl_completions(exl_server *srv, exl_oai_kind kind, const exl_http_request *req, exl_http_reply *reply);
/* Cancel the jobs of every completion in progress (their clients get their answers). */
void exl_completions_cancel_all(exl_server *srv);

/* tokenize.c: POST /tokenize and /detokenize. */
void exl_tokenize(exl_server *srv, const exl_http_request *req, exl_http_reply *reply);
void exl_detokenize(exl_server *srv, const exl_http_request *req, exl_http_reply *reply);

#endif
