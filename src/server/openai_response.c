/* openai_response.c - JSON for completion / chat completion responses and SSE chunks,
 * shaped as in the OpenAI API reference. */
#include "server/openai_response.h"

#include "base/alloc.h"

#include <math.h>
#include <string.h>

/* ---------------------------------------------------------------- small helpers */

static const char *object_name(const exl_oai_header *h, int chunk) {
    if (h->kind == EXL_OAI_COMPLETION)
        return "text_completion";
    return chunk ? "chat.completion.chunk" : "chat.completion";
}

static cJSON *header_object(const exl_oai_header *h, int chunk) {
    cJSON *o = cJSON_CreateObject();
    if (o && cJSON_AddStringToObject(o, "id", h->id) && cJSON_AddStringToObject(o, "object", object_name(h, chunk)) &&
        cJSON_AddNumberToObject(o, "created", (double)h->created) && cJSON_AddStringToObject(o, "model", h->model))
        return o;
    cJSON_Delete(o);
    return NULL;
}

static cJSON *usage_object(const exl_oai_usage *u) {
    cJSON *o = cJSON_CreateObject();
    if (o && cJSON_AddNumberToObject(o, "prompt_tokens", u->prompt_tokens) &&
        cJSON_AddNumberToObject(o, "completion_tokens", u->completion_tokens) &&
        cJSON_AddNumberToObject(o, "total_tokens", u->prompt_tokens + u->completion_tokens))
        return o;
    cJSON_Delete(o);
    return NULL;
}

/* Serialize, free o, and return an exl_malloc'd copy. */
static char *finish_json(cJSON *o) {
    char *s = o ? cJSON_PrintUnformatted(o) : NULL;
    char *out = s ? exl_strdup(s) : NULL;
    cJSON_free(s);
    cJSON_Delete(o);
    return out;
}

const char *exl_oai_finish_str(exl_finish_reason r) { return r == EXL_FINISH_LENGTH ? "length" : "stop"; }

void exl_oai_call_id(const exl_oai_header *h, int32_t index, int32_t k, char out[32]) {
    static const char digits[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t x = 1469598103934665603ull;
    for (const char *p = h->id; *p; p++)
        x = (x ^ (unsigned char)*p) * 1099511628211ull;
    x ^= ((uint64_t)index << 32) ^ (uint64_t)k;
    memcpy(out, "call_", 5);
    for (int i = 0; i < 24; i++) { /* splitmix64 steps */
        uint64_t z = (x += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        out[5 + i] = digits[(z ^ (z >> 31)) % 62];
    }
    out[29] = 0;
}

/* {"id", "type": "function", "function": {"name", "arguments"}} (id, name NULL: left out) */
static cJSON *call_object(const char *id, const char *name, const char *args, int32_t stream_index) {
    cJSON *o = cJSON_CreateObject();
    cJSON *fn = NULL;
    int ok = o && (stream_index < 0 || cJSON_AddNumberToObject(o, "index", stream_index)) &&
             (!id || (cJSON_AddStringToObject(o, "id", id) && cJSON_AddStringToObject(o, "type", "function"))) &&
             (fn = cJSON_AddObjectToObject(o, "function")) && (!name || cJSON_AddStringToObject(fn, "name", name)) &&
             cJSON_AddStringToObject(fn, "arguments", args);
    if (ok)
        return o;
    cJSON_Delete(o);
    return NULL;
}

static cJSON *tool_calls_array(const exl_oai_header *h, int32_t index, const exl_tool_calls *calls) {
    cJSON *a = cJSON_CreateArray();
    for (int32_t k = 0; a && k < calls->n; k++) {
        char id[32];
        exl_oai_call_id(h, index, k, id);
        cJSON *c = call_object(id, calls->v[k].name, calls->v[k].arguments, -1);
        if (!c || !cJSON_AddItemToArray(a, c)) {
            cJSON_Delete(c);
            cJSON_Delete(a);
            return NULL;
        }
    }
    return a;
}

/* ---------------------------------------------------------------- log-probabilities */

cJSON *exl_oai_logprobs_new(exl_oai_kind kind) {
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    int ok = kind == EXL_OAI_CHAT ? cJSON_AddArrayToObject(o, "content") != NULL
                                  : cJSON_AddArrayToObject(o, "tokens") && cJSON_AddArrayToObject(o, "token_logprobs") &&
                                        cJSON_AddArrayToObject(o, "top_logprobs") &&
                                        cJSON_AddArrayToObject(o, "text_offset");
    if (ok)
        return o;
    cJSON_Delete(o);
    return NULL;
}

static double finite_lp(float lp) { return isfinite(lp) ? lp : -9999.0; }

static cJSON *bytes_array(const char *s) {
    cJSON *a = cJSON_CreateArray();
    for (const unsigned char *p = (const unsigned char *)s; a && *p; p++)
        if (!cJSON_AddItemToArray(a, cJSON_CreateNumber(*p))) {
            cJSON_Delete(a);
            return NULL;
        }
    return a;
}

/* {"token", "logprob", "bytes"} (chat) */
static cJSON *chat_token(const char *text, float lp) {
    cJSON *o = cJSON_CreateObject();
    if (o && cJSON_AddStringToObject(o, "token", text) && cJSON_AddNumberToObject(o, "logprob", finite_lp(lp)) &&
        cJSON_AddItemToObject(o, "bytes", bytes_array(text)))
        return o;
    cJSON_Delete(o);
    return NULL;
}

static char *token_text(const exl_tokenizer *tok, int32_t id) {
    char *s = NULL;
    if (exl_tokenizer_decode(tok, &id, 1, 0, &s) != EXL_OK)
        return NULL;
    return s;
}

static int add_chat_token(cJSON *content, const exl_tokenizer *tok, const exl_stream_event *e, int32_t i) {
    char *text = token_text(tok, e->ids[i]);
    cJSON *o = text ? chat_token(text, e->logprobs ? e->logprobs[i] : NAN) : NULL;
    exl_string_free(text);
    cJSON *tops = o ? cJSON_AddArrayToObject(o, "top_logprobs") : NULL;
    if (!tops || !cJSON_AddItemToArray(content, o)) {
        cJSON_Delete(o);
        return -1;
    }
    for (int32_t k = 0; k < e->n_top; k++) {
        const exl_token_logprob *t = &e->top_logprobs[(size_t)i * (size_t)e->n_top + (size_t)k];
        char *tt = token_text(tok, t->id);
        cJSON *x = tt ? chat_token(tt, t->logprob) : NULL;
        exl_string_free(tt);
        if (!x || !cJSON_AddItemToArray(tops, x)) {
            cJSON_Delete(x);
            return -1;
        }
    }
    return 0;
}

static int add_completion_token(cJSON *lp, const exl_tokenizer *tok, const exl_stream_event *e, int32_t i,
                                size_t *offset) {
    char *text = token_text(tok, e->ids[i]);
    if (!text)
        return -1;
    cJSON *tops = e->n_top ? cJSON_CreateObject() : cJSON_CreateNull();
    int ok = tops && cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "tokens"), cJSON_CreateString(text)) &&
             cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "token_logprobs"),
                                  cJSON_CreateNumber(finite_lp(e->logprobs ? e->logprobs[i] : NAN))) &&
             cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "text_offset"),
                                  cJSON_CreateNumber((double)*offset));
    *offset += strlen(text);
    exl_string_free(text);
    for (int32_t k = 0; ok && k < e->n_top; k++) {
        const exl_token_logprob *t = &e->top_logprobs[(size_t)i * (size_t)e->n_top + (size_t)k];
        char *tt = token_text(tok, t->id);
        ok = tt && (cJSON_GetObjectItemCaseSensitive(tops, tt) ||
                    cJSON_AddNumberToObject(tops, tt, finite_lp(t->logprob)));
        exl_string_free(tt);
    }
    if (!ok || !cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "top_logprobs"), tops)) {
        cJSON_Delete(tops);
        return -1;
    }
    return 0;
}

int exl_oai_logprobs_add(cJSON *lp, exl_oai_kind kind, const exl_tokenizer *tok, const exl_stream_event *e,
                         size_t text_offset) {
    int32_t n = e->n_ids;
    if (e->finish == EXL_FINISH_STOP && n > 0 && e->stop_token >= 0 && e->ids[n - 1] == e->stop_token)
        n--; /* the end-of-sequence token is not part of the text */
    cJSON *content = cJSON_GetObjectItemCaseSensitive(lp, "content");
    for (int32_t i = 0; i < n; i++)
        if (kind == EXL_OAI_CHAT ? add_chat_token(content, tok, e, i) : add_completion_token(lp, tok, e, i, &text_offset))
            return -1;
    return 0;
}

/* ---------------------------------------------------------------- whole responses */

static cJSON *choice_object(const exl_oai_header *h, int32_t index, const exl_oai_choice *c) {
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddNumberToObject(o, "index", index))
        goto fail;
    const char *text = c->text.data ? c->text.data : "";
    if (h->kind == EXL_OAI_CHAT && c->calls.n) { /* the text before the calls is the content, if any */
        cJSON *m = cJSON_AddObjectToObject(o, "message");
        char *content = exl_strndup(text, c->calls.content_len);
        size_t end = c->calls.content_len;
        while (end && strchr(" \t\r\n", text[end - 1]))
            end--;
        if (content)
            content[end] = 0;
        cJSON *calls = tool_calls_array(h, index, &c->calls);
        int ok = m && content && cJSON_AddStringToObject(m, "role", "assistant") &&
                 (end ? cJSON_AddStringToObject(m, "content", content) : cJSON_AddNullToObject(m, "content")) && calls &&
                 cJSON_AddItemToObject(m, "tool_calls", calls);
        exl_free(content);
        if (!ok) {
            if (calls && !calls->prev)
                cJSON_Delete(calls);
            goto fail;
        }
    } else if (h->kind == EXL_OAI_CHAT) {
        cJSON *m = cJSON_AddObjectToObject(o, "message");
        if (!m || !cJSON_AddStringToObject(m, "role", "assistant") || !cJSON_AddStringToObject(m, "content", text))
            goto fail;
    } else if (!cJSON_AddStringToObject(o, "text", text)) {
        goto fail;
    }
    cJSON *lp = c->logprobs ? cJSON_Duplicate(c->logprobs, 1) : cJSON_CreateNull();
    if (!cJSON_AddItemToObject(o, "logprobs", lp)) {
        cJSON_Delete(lp);
        goto fail;
    }
    if (cJSON_AddStringToObject(o, "finish_reason", c->calls.n ? "tool_calls" : exl_oai_finish_str(c->finish)))
        return o;
fail:
    cJSON_Delete(o);
    return NULL;
}

char *exl_oai_response_json(const exl_oai_header *h, const exl_oai_choice *choices, int32_t n,
                            const exl_oai_usage *usage) {
    cJSON *o = header_object(h, 0);
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "choices") : NULL;
    if (!arr) {
        cJSON_Delete(o);
        return NULL;
    }
    for (int32_t i = 0; i < n; i++) {
        cJSON *c = choice_object(h, i, &choices[i]);
        if (!c || !cJSON_AddItemToArray(arr, c)) {
            cJSON_Delete(o);
            return NULL;
        }
    }
    cJSON *u = usage_object(usage);
    if (!u || !cJSON_AddItemToObject(o, "usage", u)) {
        cJSON_Delete(u);
        cJSON_Delete(o);
        return NULL;
    }
    return finish_json(o);
}

/* ---------------------------------------------------------------- streamed chunks */

static int append_event(exl_str *out, cJSON *o) {
    char *s = finish_json(o);
    int rc = !s || exl_str_puts(out, "data: ") || exl_str_puts(out, s) || exl_str_puts(out, "\n\n") ? -1 : 0;
    exl_free(s);
    return rc;
}

static cJSON *chunk_choice(const exl_oai_header *h, int32_t index, int role, const char *text, size_t text_len,
                           const cJSON *lp, const char *finish) {
    cJSON *c = cJSON_CreateObject();
    if (!c || !cJSON_AddNumberToObject(c, "index", index))
        goto fail;
    char *t = exl_strndup(text ? text : "", text ? text_len : 0);
    if (!t)
        goto fail;
    cJSON *ok;
    if (h->kind == EXL_OAI_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        ok = d && (!role || cJSON_AddStringToObject(d, "role", "assistant")) &&
                     (!text || cJSON_AddStringToObject(d, "content", t))
                 ? d
                 : NULL;
    } else {
        ok = cJSON_AddStringToObject(c, "text", t);
    }
    exl_free(t);
    cJSON *l = lp ? cJSON_Duplicate(lp, 1) : cJSON_CreateNull();
    if (!ok || !cJSON_AddItemToObject(c, "logprobs", l)) {
        cJSON_Delete(l);
        goto fail;
    }
    if (finish ? cJSON_AddStringToObject(c, "finish_reason", finish) : cJSON_AddNullToObject(c, "finish_reason"))
        return c;
fail:
    cJSON_Delete(c);
    return NULL;
}

int exl_oai_chunk_append(exl_str *out, const exl_oai_header *h, int32_t index, int role, const char *text,
                         size_t text_len, const cJSON *lp, const char *finish, int with_usage) {
    cJSON *o = header_object(h, 1);
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "choices") : NULL;
    cJSON *c = arr ? chunk_choice(h, index, role, text, text_len, lp, finish) : NULL;
    if (!c) {
        cJSON_Delete(o);
        return -1;
    }
    cJSON_AddItemToArray(arr, c); /* cannot fail: both exist */
    if (with_usage && !cJSON_AddNullToObject(o, "usage")) {
        cJSON_Delete(o);
        return -1;
    }
    return append_event(out, o);
}

/* One chunk whose delta holds one tool call entry. */
static int tool_chunk(exl_str *out, const exl_oai_header *h, int32_t index, cJSON *entry, int with_usage) {
    cJSON *o = header_object(h, 1);
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "choices") : NULL;
    cJSON *c = arr ? cJSON_CreateObject() : NULL;
    cJSON *d = c && cJSON_AddItemToArray(arr, c) && cJSON_AddNumberToObject(c, "index", index)
                   ? cJSON_AddObjectToObject(c, "delta")
                   : NULL;
    cJSON *calls = d ? cJSON_AddArrayToObject(d, "tool_calls") : NULL;
    if (!calls || !cJSON_AddItemToArray(calls, entry) || !cJSON_AddNullToObject(c, "logprobs") ||
        !cJSON_AddNullToObject(c, "finish_reason") || (with_usage && !cJSON_AddNullToObject(o, "usage"))) {
        if (!calls)
            cJSON_Delete(entry);
        cJSON_Delete(o);
        return -1;
    }
    return append_event(out, o);
}

int exl_oai_tool_chunks_append(exl_str *out, const exl_oai_header *h, int32_t index, int32_t k,
                               const exl_tool_call *call, int with_usage) {
    char id[32];
    exl_oai_call_id(h, index, k, id);
    cJSON *head = call_object(id, call->name, "", k);
    if (!head || tool_chunk(out, h, index, head, with_usage))
        return -1;
    size_t n = strlen(call->arguments), piece = 24, len;
    for (size_t at = 0; at < n; at += len) { /* pieces on character boundaries */
        len = n - at < piece ? n - at : piece;
        while (at + len < n && ((unsigned char)call->arguments[at + len] & 0xc0) == 0x80)
            len++;
        char *part = exl_strndup(call->arguments + at, len);
        cJSON *entry = part ? call_object(NULL, NULL, part, k) : NULL;
        exl_free(part);
        if (!entry || tool_chunk(out, h, index, entry, with_usage))
            return -1;
    }
    return 0;
}

int exl_oai_usage_chunk_append(exl_str *out, const exl_oai_header *h, const exl_oai_usage *usage) {
    cJSON *o = header_object(h, 1);
    cJSON *u = usage_object(usage);
    if (!o || !u || !cJSON_AddArrayToObject(o, "choices") || !cJSON_AddItemToObject(o, "usage", u)) {
        cJSON_Delete(u);
        cJSON_Delete(o);
        return -1;
    }
    return append_event(out, o);
}
