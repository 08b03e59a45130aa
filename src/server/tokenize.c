/* tokenize.c - POST /tokenize and POST /detokenize (shaped as vLLM's):
 *   /tokenize   {"prompt": "text", "add_special_tokens": true}  or a chat request's
 *               {"messages": [...], "add_generation_prompt": true}
 *               -> {"tokens": [ids], "count": n, "max_model_len": ctx}
 *   /detokenize {"tokens": [ids]} -> {"prompt": "text"}
 * "model", when given, must name the served model. Token lists are bounded by the body size. */
#include "server/routes.h"

#include "base/alloc.h"
#include "base/error.h"
#include "server/openai_response.h"

#include <math.h>
#include <string.h>

/* The body's JSON object with "model" checked; NULL with the reply filled. */
static cJSON *parse_body(exl_server *srv, const exl_http_request *req, exl_http_reply *reply) {
    exl_oai_error err;
    cJSON *root = exl_oai_json_parse(req->body, req->body_len, &err);
    if (root && !cJSON_IsObject(root))
        exl_oai_bad_param(&err, NULL, "the request body must be a JSON object");
    else if (root) {
        const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
        if (!model || cJSON_IsNull(model) || (cJSON_IsString(model) && !strcmp(model->valuestring, srv->model_name)))
            return root;
        if (cJSON_IsString(model)) { /* an adapter's tokens are its base's */
            exl_adapters_lock(&srv->adapters);
            int known = exl_adapters_find(&srv->adapters, model->valuestring) != NULL;
            exl_adapters_unlock(&srv->adapters);
            if (known)
                return root;
        }
        if (!cJSON_IsString(model))
            exl_oai_bad_param(&err, "model", "'model' must be a string");
        else
            exl_oai_fail(&err, 404, "invalid_request_error", "model", "model_not_found",
                         "The model '%.200s' does not exist (this server has '%s')", model->valuestring,
                         srv->model_name);
    }
    cJSON_Delete(root);
    exl_reply_error(reply, &err);
    return NULL;
}

/* An optional boolean field: 1/0, or -1 with err filled. */
static int flag(const cJSON *root, const char *name, int dflt, exl_oai_error *err) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!f || cJSON_IsNull(f))
        return dflt;
    if (!cJSON_IsBool(f))
        return exl_oai_bad_param(err, name, "'%s' must be a boolean", name);
    return cJSON_IsTrue(f);
}

static int encode_chat(exl_server *srv, const exl_http_request *req, const cJSON *root, exl_chat_prompt *out,
                       exl_oai_error *err) {
    int gen = flag(root, "add_generation_prompt", 1, err);
    if (gen < 0)
        return -1;
    exl_oai_request chat;
    if (exl_oai_request_parse(EXL_OAI_CHAT, req->body, req->body_len, srv->vocab, &chat, err))
        return -1;
    exl_status st = exl_chat_encode(srv->tok, chat.messages, chat.n_messages, gen, NULL, out);
    exl_oai_request_free(&chat);
    if (st != EXL_OK)
        return st == EXL_ERR_NOMEM ? exl_oai_fail(err, 500, "server_error", NULL, NULL, "out of memory")
                                   : exl_oai_bad_param(err, "messages", "%s", exl_last_error());
    return 0;
}

static int encode_prompt(exl_server *srv, const cJSON *root, int32_t **ids, int32_t *n, exl_oai_error *err) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(root, "prompt");
    if (!cJSON_IsString(p))
        return exl_oai_bad_param(err, "prompt", "'prompt' (a string) or 'messages' is required");
    int special = flag(root, "add_special_tokens", 1, err);
    if (special < 0)
        return -1;
    if (exl_tokenizer_encode(srv->tok, p->valuestring, strlen(p->valuestring), special, ids, n) != EXL_OK)
        return exl_oai_bad_param(err, "prompt", "%s", exl_last_error());
    return 0;
}

static char *tokens_json(const int32_t *ids, int32_t n, int32_t ctx) {
    exl_str o = EXL_STR_INIT;
    int rc = exl_str_puts(&o, "{\"tokens\":[");
    for (int32_t i = 0; i < n && !rc; i++)
        rc = exl_str_printf(&o, i ? ",%d" : "%d", (int)ids[i]);
    rc = rc || exl_str_printf(&o, "],\"count\":%d,\"max_model_len\":%d}", (int)n, (int)ctx);
    char *json = rc ? NULL : exl_str_steal(&o);
    exl_str_free(&o);
    return json;
}

void exl_tokenize(exl_server *srv, const exl_http_request *req, exl_http_reply *reply) {
    cJSON *root = parse_body(srv, req, reply);
    if (!root)
        return;
    exl_oai_error err;
    exl_chat_prompt chat = {0};
    int32_t *ids = NULL, n = 0;
    int rc = cJSON_GetObjectItemCaseSensitive(root, "messages") ? encode_chat(srv, req, root, &chat, &err)
                                                                : encode_prompt(srv, root, &ids, &n, &err);
    cJSON_Delete(root);
    if (rc)
        exl_reply_error(reply, &err);
    else
        exl_reply_json(reply, 200, ids ? tokens_json(ids, n, srv->ctx) : tokens_json(chat.ids, chat.n_ids, srv->ctx));
    exl_ids_free(ids);
    exl_chat_prompt_free(&chat);
}

/* ids as text, with its length (a <0x00> token makes a NUL inside it). */
static exl_status decode(const exl_tokenizer *tok, const int32_t *ids, int32_t n, exl_str *out) {
    exl_detokenizer *d;
    EXL_TRY(exl_detokenizer_init(tok, 0, &d));
    exl_status st = EXL_OK;
    const char *text;
    size_t len;
    for (int32_t i = 0; i <= n && st == EXL_OK; i++) {
        st = i < n ? exl_detokenizer_push(d, ids[i], &text, &len) : exl_detokenizer_flush(d, &text, &len);
        if (st == EXL_OK && exl_str_append(out, text, len))
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    exl_detokenizer_free(d);
    return st;
}

void exl_detokenize(exl_server *srv, const exl_http_request *req, exl_http_reply *reply) {
    cJSON *root = parse_body(srv, req, reply);
    if (!root)
        return;
    exl_oai_error err = {0};
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(root, "tokens");
    int n = cJSON_IsArray(t) ? cJSON_GetArraySize(t) : -1, k = 0;
    int32_t *ids = n >= 0 ? exl_malloc((size_t)(n ? n : 1) * sizeof *ids) : NULL;
    for (const cJSON *e = n > 0 ? t->child : NULL; ids && e; e = e->next, k++) {
        if (!cJSON_IsNumber(e) || e->valuedouble != floor(e->valuedouble) || e->valuedouble < 0 ||
            e->valuedouble >= srv->vocab)
            break;
        ids[k] = (int32_t)e->valuedouble;
    }
    exl_str text = EXL_STR_INIT;
    if (n < 0)
        exl_oai_bad_param(&err, "tokens", "'tokens' must be a list of token ids");
    else if (!ids)
        exl_oai_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
    else if (k < n)
        exl_oai_bad_param(&err, "tokens", "tokens must be integers in 0..%d", (int)srv->vocab - 1);
    else if (decode(srv->tok, ids, n, &text) != EXL_OK)
        exl_oai_fail(&err, 500, "server_error", NULL, NULL, "%s", exl_last_error());
    cJSON_Delete(root);
    exl_free(ids);
    exl_str o = EXL_STR_INIT;
    if (!err.status && (exl_str_puts(&o, "{\"prompt\":") || exl_json_quote(&o, text.data ? text.data : "", text.len) ||
                        exl_str_putc(&o, '}')))
        exl_oai_fail(&err, 500, "server_error", NULL, NULL, "out of memory");
    exl_str_free(&text);
    if (err.status)
        exl_reply_error(reply, &err);
    else
        exl_reply_json(reply, 200, exl_str_steal(&o));
    exl_str_free(&o);
}
