/* tools.c - tool call formats (see tools.h): detection through a probe rendering of the chat
 * template, exl's tool prompt, the forced-call grammar, and parsing calls out of replies. */
#include "server/tools.h"

#include "base/alloc.h"
#include "base/error.h"
#include "constrain/json_schema.h"

#include <stdio.h>
#include <string.h>

#define HERMES_OPEN "<tool_call>"
#define HERMES_CLOSE "</tool_call>"
#define MISTRAL_MARK "[TOOL_CALLS]"
#define PYTHON_TAG "<|python_tag|>"

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "out of memory"); }

/* ---------------------------------------------------------------- detection */

static const char PROBE_TOOLS[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"probe_fn\", \"description\": \"probe\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"probe_arg\": {\"type\": \"integer\"}}}}}]";

exl_tool_format exl_tools_detect(const exl_tokenizer *tok) {
    /* a call and its answer (ids of 9 letters and digits: Mistral's template insists) */
    const exl_chat_message probe[] = {
        {.role = "user", .content = "probe question"},
        {.role = "assistant",
         .content = "",
         .tool_calls = "[{\"id\": \"probeid01\", \"type\": \"function\", \"function\": "
                       "{\"name\": \"probe_fn\", \"arguments\": \"{\\\"probe_arg\\\": 1}\"}}]"},
        {.role = "tool", .content = "probe result", .tool_call_id = "probeid01", .name = "probe_fn"},
    };
    char *with = NULL, *without = NULL;
    exl_tool_format f = EXL_TOOLS_GENERIC;
    if (exl_chat_apply(tok, probe, 3, 1, PROBE_TOOLS, &with) == EXL_OK &&
        (exl_chat_apply(tok, probe, 3, 1, NULL, &without) != EXL_OK || strcmp(with, without))) {
        if (strstr(with, MISTRAL_MARK))
            f = EXL_TOOLS_MISTRAL;
        else if (strstr(with, PYTHON_TAG) || strstr(with, "\"parameters\": {\"probe_arg\""))
            f = EXL_TOOLS_LLAMA3;
        else /* <tool_call>, or a form of its own: Hermes is the common one */
            f = EXL_TOOLS_HERMES;
    }
    exl_string_free(with);
    exl_string_free(without);
    return f;
}

/* ---------------------------------------------------------------- prompt */

exl_status exl_tools_prompt(const cJSON *tools, exl_str *out) {
    /* short: small models have small contexts */
    int fail = exl_str_puts(out, "You can call these functions:\n");
    for (const cJSON *t = tools->child; t && !fail; t = t->next) {
        char *s = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(t, "function"));
        fail = !s || exl_str_puts(out, s) || exl_str_putc(out, '\n');
        cJSON_free(s);
    }
    fail = fail ||
           exl_str_puts(out, "To call one, reply with " HERMES_OPEN "\n{\"name\": <function name>, \"arguments\": "
                             "<arguments object>}\n" HERMES_CLOSE " for each call, and nothing else.");
    return fail ? nomem() : EXL_OK;
}

/* ---------------------------------------------------------------- forced calls */

/* call-<i> ::= {"name": "<name>", "<key>": <its parameters>} */
static exl_status call_rule(const cJSON *fn, int32_t i, const char *key, exl_str *out) {
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
    const cJSON *params = cJSON_GetObjectItemCaseSensitive(fn, "parameters");
    int strict = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(fn, "strict"));
    char prefix[32];
    snprintf(prefix, sizeof prefix, "t%d-", (int)i);
    cJSON *none = NULL;
    if (!params) /* no parameters: an empty argument list */
        params = none = cJSON_Parse("{\"type\": \"object\", \"properties\": {}, \"additionalProperties\": false}");
    exl_status st = params ? exl_json_schema_gbnf_part(params, strict, prefix, out) : nomem();
    cJSON_Delete(none);
    EXL_TRY(st);
    /* names are [A-Za-z0-9_-] (checked with the request): no escaping needed */
    if (exl_str_printf(out,
                       "call-%d ::= \"{\" json-ws \"\\\"name\\\"\" json-ws \":\" json-ws \"\\\"%s\\\"\" json-ws \",\" "
                       "json-ws \"\\\"%s\\\"\" json-ws \":\" json-ws %sroot json-ws \"}\"\n",
                       (int)i, name->valuestring, key, prefix))
        return nomem();
    return EXL_OK;
}

exl_status exl_tools_grammar(const cJSON *tools, const char *only, int parallel, exl_tool_format fmt, exl_str *out) {
    const char *key = fmt == EXL_TOOLS_LLAMA3 ? "parameters" : "arguments";
    int32_t i = 0, n = 0;
    exl_str any = EXL_STR_INIT;
    exl_status st = EXL_OK;
    for (const cJSON *t = tools->child; t && st == EXL_OK; t = t->next, i++) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        if (only && strcmp(name->valuestring, only))
            continue;
        st = call_rule(fn, i, key, out);
        if (st == EXL_OK && exl_str_printf(&any, "%scall-%d", n++ ? " | " : "", (int)i))
            st = nomem();
    }
    if (st == EXL_OK && !n)
        st = exl_fail(EXL_ERR_ARG, "tool_choice: no function named '%s' among the tools", only ? only : "");
    int fail = 0;
    if (st == EXL_OK) {
        fail |= exl_str_printf(out, "call ::= %s\n", any.data);
        if (fmt == EXL_TOOLS_MISTRAL)
            fail |= exl_str_puts(out, parallel ? "root ::= \"[\" call (\",\" json-ws call)* \"]\"\n"
                                               : "root ::= \"[\" call \"]\"\n");
        else if (fmt == EXL_TOOLS_LLAMA3)
            fail |= exl_str_puts(out, "root ::= call\n");
        else
            fail |= exl_str_puts(out, "block ::= \"" HERMES_OPEN "\\n\" call \"\\n" HERMES_CLOSE "\"\n") ||
                    exl_str_puts(out, parallel ? "root ::= block (\"\\n\" block)*\n" : "root ::= block\n");
        if (fail)
            st = nomem();
    }
    if (st == EXL_OK)
        st = exl_json_schema_gbnf_shared(out);
    exl_str_free(&any);
    return st;
}

/* ---------------------------------------------------------------- parsing */

void exl_tool_calls_free(exl_tool_calls *calls) {
    for (int32_t i = 0; i < calls->n; i++) {
        exl_free(calls->v[i].name);
        exl_free(calls->v[i].arguments);
    }
    exl_free(calls->v);
    *calls = (exl_tool_calls){0};
}

static int known(const cJSON *tools, const char *name) {
    for (const cJSON *t = tools ? tools->child : NULL; t; t = t->next) {
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name");
        if (cJSON_IsString(n) && !strcmp(n->valuestring, name))
            return 1;
    }
    return 0;
}

/* Add the call described by object o ({"name", "arguments" or "parameters"}); -1 when it is not one. */
static int add_call(exl_tool_calls *c, const cJSON *o, const cJSON *tools) {
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(o, "name");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(o, "arguments");
    if (!args)
        args = cJSON_GetObjectItemCaseSensitive(o, "parameters");
    if (!cJSON_IsObject(o) || !cJSON_IsString(name) || !known(tools, name->valuestring))
        return -1;
    cJSON *parsed = cJSON_IsString(args) ? cJSON_Parse(args->valuestring) : NULL;
    const cJSON *a = parsed ? parsed : args;
    if (a && !cJSON_IsObject(a)) {
        cJSON_Delete(parsed);
        return -1;
    }
    char *text = a ? cJSON_PrintUnformatted(a) : NULL;
    cJSON_Delete(parsed);
    exl_tool_call *v = exl_realloc(c->v, (size_t)(c->n + 1) * sizeof *v);
    if (v)
        c->v = v;
    char *n = exl_strdup(name->valuestring), *t = exl_strdup(text ? text : "{}");
    cJSON_free(text);
    if (!v || !n || !t) {
        exl_free(n);
        exl_free(t);
        return -1;
    }
    c->v[c->n++] = (exl_tool_call){n, t};
    return 0;
}

/* One JSON value from s[0..n) (leading whitespace skipped); *used: bytes through its end. */
static cJSON *json_at(const char *s, size_t n, size_t *used) {
    const char *end = NULL;
    cJSON *v = cJSON_ParseWithLengthOpts(s, n, &end, 0);
    *used = v && end ? (size_t)(end - s) : 0;
    return v;
}

static int only_space(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strchr(" \t\r\n", s[i]))
            return 0;
    return 1;
}

/* <tool_call> blocks */
static int parse_hermes(const char *s, size_t n, const cJSON *tools, exl_tool_calls *c) {
    const char *open = memmem(s, n, HERMES_OPEN, strlen(HERMES_OPEN));
    if (!open)
        return -1;
    c->content_len = (size_t)(open - s);
    while (open) {
        const char *body = open + strlen(HERMES_OPEN);
        size_t left = n - (size_t)(body - s), used;
        const char *close = memmem(body, left, HERMES_CLOSE, strlen(HERMES_CLOSE));
        cJSON *o = json_at(body, close ? (size_t)(close - body) : left, &used);
        int bad = !o || !only_space(body + used, (close ? (size_t)(close - body) : left) - used) ||
                  add_call(c, o, tools);
        cJSON_Delete(o);
        if (bad)
            return -1;
        if (!close)
            break;
        const char *next = close + strlen(HERMES_CLOSE);
        open = memmem(next, n - (size_t)(next - s), HERMES_OPEN, strlen(HERMES_OPEN));
        if (!open && !only_space(next, n - (size_t)(next - s)))
            return -1; /* text after the calls: not a tool reply */
    }
    return 0;
}

/* [TOOL_CALLS] [..], or a bare array of calls */
static int parse_array(const char *s, size_t n, const cJSON *tools, exl_tool_calls *c) {
    const char *mark = memmem(s, n, MISTRAL_MARK, strlen(MISTRAL_MARK));
    const char *body = mark ? mark + strlen(MISTRAL_MARK) : s;
    if (!mark && !(n && s[strspn(s, " \t\r\n")] == '['))
        return -1;
    c->content_len = mark ? (size_t)(mark - s) : 0;
    size_t left = n - (size_t)(body - s), used;
    cJSON *a = json_at(body, left, &used);
    int bad = !cJSON_IsArray(a) || !a->child || !only_space(body + used, left - used);
    for (const cJSON *o = a && !bad ? a->child : NULL; o && !bad; o = o->next)
        bad = add_call(c, o, tools) != 0;
    cJSON_Delete(a);
    return bad ? -1 : 0;
}

/* a JSON object, after <|python_tag|> or not */
static int parse_object(const char *s, size_t n, const cJSON *tools, exl_tool_calls *c) {
    size_t skip = strspn(s, " \t\r\n");
    if (skip < n && n - skip >= strlen(PYTHON_TAG) && !memcmp(s + skip, PYTHON_TAG, strlen(PYTHON_TAG)))
        skip += strlen(PYTHON_TAG);
    size_t used;
    cJSON *o = json_at(s + skip, n - skip, &used);
    int bad = !cJSON_IsObject(o) || !only_space(s + skip + used, n - skip - used) || add_call(c, o, tools);
    cJSON_Delete(o);
    c->content_len = 0;
    return bad ? -1 : 0;
}

exl_status exl_tools_parse(const char *text, size_t len, exl_tool_format fmt, const cJSON *tools, exl_tool_calls *out) {
    *out = (exl_tool_calls){.content_len = len};
    typedef int (*parser)(const char *, size_t, const cJSON *, exl_tool_calls *);
    parser order[3] = {parse_hermes, parse_array, parse_object}; /* the model's own format first */
    if (fmt == EXL_TOOLS_MISTRAL)
        order[0] = parse_array, order[1] = parse_hermes;
    else if (fmt == EXL_TOOLS_LLAMA3)
        order[0] = parse_object, order[2] = parse_hermes;
    for (int i = 0; i < 3; i++) {
        if (order[i](text, len, tools, out) == 0)
            return EXL_OK;
        exl_tool_calls_free(out);
        *out = (exl_tool_calls){.content_len = len};
    }
    return EXL_OK;
}

size_t exl_tools_content_safe(const char *text, size_t len, exl_tool_format fmt) {
    size_t skip = strspn(text, " \t\r\n");
    if (skip == len) /* nothing but blanks yet: a call may still come */
        return 0;
    if ((fmt == EXL_TOOLS_LLAMA3 && (text[skip] == '{' || text[skip] == '<')) ||
        (fmt == EXL_TOOLS_MISTRAL && text[skip] == '['))
        return 0; /* the reply may be one call */
    static const char *const marks[] = {HERMES_OPEN, MISTRAL_MARK};
    size_t safe = len;
    for (int m = 0; m < 2; m++) {
        size_t ml = strlen(marks[m]);
        const char *hit = memmem(text, len, marks[m], ml);
        if (hit && (size_t)(hit - text) < safe)
            safe = (size_t)(hit - text);
        for (size_t k = ml - 1; !hit && k > 0; k--) /* a marker's start at the very end */
            if (k <= len && !memcmp(text + len - k, marks[m], k) && len - k < safe) {
                safe = len - k;
                break;
            }
    }
    return safe;
}
