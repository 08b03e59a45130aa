/* chat.c - chat templates on top of the Jinja interpreter; exl_chat_apply renders a
 * conversation, exl_chat_encode makes it a prompt (BOS and the fallback's stop marker). */
#include "tokenizer/chat.h"

#include "base/alloc.h"
#include "base/error.h"
#include "jinja/jinja.h"
#include "tokenizer/tokenizer.h"

#include <cjson/cJSON.h>
#include <string.h>

/* the end of a turn in ChatML, the fallback template */
#define CHATML_END "<|im_end|>"

const char exl_chat_fallback_template[] =
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '" CHATML_END "\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}";

struct exl_chat_template {
    exl_jinja *jinja;
    char *bos, *eos;
};

exl_status exl_chat_template_init(const char *source, const char *bos_token, const char *eos_token,
                                  exl_chat_template **out) {
    *out = NULL;
    exl_chat_template *ct = exl_calloc(1, sizeof *ct);
    if (!ct || (bos_token && !(ct->bos = exl_strdup(bos_token))) || (eos_token && !(ct->eos = exl_strdup(eos_token)))) {
        exl_chat_template_free(ct);
        return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
    }
    if (!source)
        source = exl_chat_fallback_template;
    exl_status st = exl_jinja_parse("chat template", source, strlen(source), &ct->jinja);
    if (st) {
        exl_chat_template_free(ct);
        return st;
    }
    *out = ct;
    return EXL_OK;
}

void exl_chat_template_free(exl_chat_template *ct) {
    if (!ct)
        return;
    exl_jinja_free(ct->jinja);
    exl_free(ct->bos);
    exl_free(ct->eos);
    exl_free(ct);
}

/* A message's tool calls as templates expect them: each function's arguments string parsed (when
 * it is JSON) into the object templates write with tojson. */
static exl_status add_tool_calls(cJSON *m, const char *json, int32_t i) {
    cJSON *calls = cJSON_Parse(json);
    if (!cJSON_IsArray(calls)) {
        cJSON_Delete(calls);
        return exl_fail(EXL_ERR_ARG, "chat message %d: tool_calls must be a JSON array", (int)i);
    }
    for (cJSON *c = calls->child; c; c = c->next) {
        cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
        cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        cJSON *parsed = cJSON_IsString(args) ? cJSON_Parse(args->valuestring) : NULL;
        if (parsed && !cJSON_ReplaceItemInObjectCaseSensitive(fn, "arguments", parsed))
            cJSON_Delete(parsed);
    }
    if (!cJSON_AddItemToObject(m, "tool_calls", calls)) {
        cJSON_Delete(calls);
        return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
    }
    return EXL_OK;
}

static exl_status build_context(const exl_chat_template *ct, const exl_chat_message *messages, int32_t n_messages,
                                int add_generation_prompt, const char *tools_json, cJSON *ctx) {
    cJSON *msgs = cJSON_AddArrayToObject(ctx, "messages");
    if (!msgs)
        return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
    for (int32_t i = 0; i < n_messages; i++) {
        if (!messages[i].role || !messages[i].content)
            return exl_fail(EXL_ERR_ARG, "chat message %d: role and content must not be NULL", (int)i);
        cJSON *m = cJSON_CreateObject();
        if (!m || !cJSON_AddItemToArray(msgs, m) || !cJSON_AddStringToObject(m, "role", messages[i].role) ||
            !cJSON_AddStringToObject(m, "content", messages[i].content)) {
            if (m && !m->prev)
                cJSON_Delete(m);
            return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
        }
        if (messages[i].tool_calls)
            EXL_TRY(add_tool_calls(m, messages[i].tool_calls, i));
        if ((messages[i].tool_call_id && !cJSON_AddStringToObject(m, "tool_call_id", messages[i].tool_call_id)) ||
            (messages[i].name && !cJSON_AddStringToObject(m, "name", messages[i].name)))
            return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
    }
    cJSON *tools = NULL;
    if (tools_json) {
        tools = cJSON_Parse(tools_json);
        if (!cJSON_IsArray(tools)) {
            cJSON_Delete(tools);
            return exl_fail(EXL_ERR_ARG, "tools: expected a JSON array of tool definitions");
        }
    } else {
        tools = cJSON_CreateNull();
    }
    if (!tools || !cJSON_AddItemToObject(ctx, "tools", tools)) {
        cJSON_Delete(tools);
        return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
    }
    if (!cJSON_AddNullToObject(ctx, "documents") ||
        !cJSON_AddBoolToObject(ctx, "add_generation_prompt", add_generation_prompt != 0) ||
        (ct->bos && !cJSON_AddStringToObject(ctx, "bos_token", ct->bos)) ||
        (ct->eos && !cJSON_AddStringToObject(ctx, "eos_token", ct->eos)))
        return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
    return EXL_OK;
}

exl_status exl_chat_template_render(const exl_chat_template *ct, const exl_chat_message *messages, int32_t n_messages,
                                    int add_generation_prompt, const char *tools_json, char **text) {
    *text = NULL;
    if (n_messages < 0 || (n_messages > 0 && !messages))
        return exl_fail(EXL_ERR_ARG, "chat template: invalid message list");
    cJSON *ctx = cJSON_CreateObject();
    if (!ctx)
        return exl_fail(EXL_ERR_NOMEM, "chat template: out of memory");
    exl_status st = build_context(ct, messages, n_messages, add_generation_prompt, tools_json, ctx);
    if (st == EXL_OK)
        st = exl_jinja_render(ct->jinja, ctx, NULL, text);
    cJSON_Delete(ctx);
    return st;
}

exl_status exl_chat_apply(const exl_tokenizer *tok, const exl_chat_message *messages, int32_t n_messages,
                          int add_generation_prompt, const char *tools_json, char **text) {
    if (!tok || !text)
        return exl_fail(EXL_ERR_ARG, "exl_chat_apply: tokenizer and text must not be NULL");
    exl_chat_template *ct;
    EXL_TRY(exl_chat_template_init(exl_tokenizer_chat_template(tok), exl_tokenizer_bos_text(tok),
                                   exl_tokenizer_eos_text(tok), &ct));
    exl_status st = exl_chat_template_render(ct, messages, n_messages, add_generation_prompt, tools_json, text);
    exl_chat_template_free(ct);
    return st;
}

/* The fallback's end marker as a token id, when the vocabulary has it as one token. */
static exl_status chatml_end_id(const exl_tokenizer *tok, int32_t *id) {
    int32_t *ids, n;
    *id = -1;
    EXL_TRY(exl_tokenizer_encode(tok, CHATML_END, strlen(CHATML_END), 0, &ids, &n));
    if (n == 1)
        *id = ids[0];
    exl_ids_free(ids);
    return EXL_OK;
}

exl_status exl_chat_encode(const exl_tokenizer *tok, const exl_chat_message *messages, int32_t n_messages,
                           int add_generation_prompt, const char *tools_json, exl_chat_prompt *out) {
    if (!out)
        return exl_fail(EXL_ERR_ARG, "exl_chat_encode: out must not be NULL");
    *out = (exl_chat_prompt){.stop_id = -1};
    char *text;
    EXL_TRY(exl_chat_apply(tok, messages, n_messages, add_generation_prompt, tools_json, &text));
    int32_t *ids, n;
    exl_status st = exl_tokenizer_encode(tok, text, strlen(text), 0, &ids, &n);
    exl_string_free(text);
    if (st != EXL_OK)
        return st;
    int32_t bos = exl_tokenizer_bos_id(tok);
    int add_bos = bos >= 0 && (n == 0 || ids[0] != bos);
    out->ids = exl_malloc((size_t)(n + add_bos + 1) * sizeof *out->ids);
    if (!out->ids) {
        exl_ids_free(ids);
        return exl_fail(EXL_ERR_NOMEM, "chat prompt: out of memory");
    }
    if (add_bos)
        out->ids[0] = bos;
    if (n)
        memcpy(out->ids + add_bos, ids, (size_t)n * sizeof *ids);
    out->n_ids = n + add_bos;
    exl_ids_free(ids);
    if (!exl_tokenizer_chat_template(tok)) {
        out->stop_string = CHATML_END;
        st = chatml_end_id(tok, &out->stop_id);
    }
    if (st != EXL_OK)
        exl_chat_prompt_free(out);
    return st;
}

void exl_chat_prompt_free(exl_chat_prompt *prompt) {
    if (!prompt)
        return;
    exl_free(prompt->ids);
    *prompt = (exl_chat_prompt){.stop_id = -1};
}
