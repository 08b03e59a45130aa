/* routes.h - what the server answers: the dispatch by path (the HTTP layer's handler), the
 * JSON and error replies the routes build, and the completions endpoints. */
#ifndef EXL_SERVER_ROUTES_H
#define EXL_SERVER_ROUTES_H

#include "server/http.h"
#include "server/openai_request.h"
#include "server/server_internal.h"

/* Answer one request (an exl_http_handler; user is the exl_server). */
void exl_route(void *srv, const exl_http_request *req, exl_http_reply *reply);
/* Fill reply with an OpenAI-shaped error. */
void exl_reply_error(exl_http_reply *reply, const exl_oai_error *err);
/* Fill reply with a JSON body (json is taken over; NULL means out of memory: 500). */
void exl_reply_json(exl_http_reply *reply, int status, char *json);

/* completions.c: POST /v1/completions and /v1/chat/completions. */
void exl_completions(exl_server *srv, exl_oai_kind kind, const exl_http_request *req, exl_http_reply *reply);

#endif
