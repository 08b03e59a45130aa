/* openai_request.c - parse and check an OpenAI completions / chat completions body.
 * Field names and ranges follow the OpenAI API reference; top_k, min_p, typical_p and
 * repetition_penalty are extensions (as in vLLM). Unknown fields are ignored; fields
 * that would change the output in ways exl does not implement (echo, suffix, best_of,
 * legacy functions, tools on /v1/completions, store, modalities other than text,
 * stream_options without a stream) are refused rather than silently dropped. U+0000 is
 * refused anywhere in the body: cJSON's strings end at it, so it would cut a prompt short
 * unseen. */
#include "server/openai_request.h"

#include "base/alloc.h"
#include "base/str.h"
#include "base/utf8.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- typed field access */

/* The field, or NULL when absent or null. */
static const cJSON *field(const cJSON *root, const char *name) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(root, name);
    return cJSON_IsNull(f) ? NULL : f;
}

/* 1 when set, 0 when absent, -1 (err filled) when of the wrong type or out of [lo, hi]. */
static int opt_number(const cJSON *root, const char *name, double lo, double hi, double *out, exl_oai_error *err) {
    const cJSON *f = field(root, name);
    if (!f)
        return 0;
    if (!cJSON_IsNumber(f))
        return exl_oai_bad_param(err, name, "'%s' must be a number", name);
    if (!(f->valuedouble >= lo && f->valuedouble <= hi))
        return exl_oai_bad_param(err, name, "'%s' must be between %g and %g, got %g", name, lo, hi, f->valuedouble);
    *out = f->valuedouble;
    return 1;
}

static int opt_int(const cJSON *root, const char *name, double lo, double hi, int64_t *out, exl_oai_error *err) {
    const cJSON *f = field(root, name);
    if (!f)
        return 0;
    if (!cJSON_IsNumber(f) || f->valuedouble != floor(f->valuedouble))
        return exl_oai_bad_param(err, name, "'%s' must be an integer", name);
    if (!(f->valuedouble >= lo && f->valuedouble <= hi))
        return exl_oai_bad_param(err, name, "'%s' must be between %.0f and %.0f, got %.0f", name, lo, hi,
                                 f->valuedouble);
    *out = (int64_t)f->valuedouble;
    return 1;
}

static int opt_bool(const cJSON *root, const char *name, int *out, exl_oai_error *err) {
    const cJSON *f = field(root, name);
    if (!f)
        return 0;
    if (!cJSON_IsBool(f))
        return exl_oai_bad_param(err, name, "'%s' must be a boolean", name);
    *out = cJSON_IsTrue(f);
    return 1;
}

static int opt_string(const cJSON *root, const char *name, const char **out, exl_oai_error *err) {
    const cJSON *f = field(root, name);
    if (!f)
        return 0;
    if (!cJSON_IsString(f))
        return exl_oai_bad_param(err, name, "'%s' must be a string", name);
    *out = f->valuestring;
    return 1;
}

static int nomem(exl_oai_error *err) { return exl_oai_fail(err, 500, "server_error", NULL, NULL, "out of memory"); }

/* ---------------------------------------------------------------- prompts and messages */

static int token_array(const cJSON *a, int32_t vocab, exl_oai_prompt *p, exl_oai_error *err) {
    int n = cJSON_GetArraySize(a);
    if (n == 0)
        return exl_oai_bad_param(err, "prompt", "a token prompt must not be empty");
    p->ids = exl_malloc((size_t)n * sizeof *p->ids);
    if (!p->ids)
        return nomem(err);
    for (const cJSON *t = a->child; t; t = t->next) {
        if (!cJSON_IsNumber(t) || t->valuedouble != floor(t->valuedouble) || t->valuedouble < 0 ||
            t->valuedouble >= vocab)
            return exl_oai_bad_param(err, "prompt", "prompt tokens must be integers in 0..%d", (int)vocab - 1);
        p->ids[p->n_ids++] = (int32_t)t->valuedouble;
    }
    return 0;
}

/* prompt: a string, a list of strings, a list of token ids, or a list of such lists. */
static int parse_prompts(exl_oai_request *r, int32_t vocab, exl_oai_error *err) {
    const cJSON *p = field(r->root, "prompt");
    if (!p)
        return exl_oai_bad_param(err, "prompt", "'prompt' is required");
    if (cJSON_IsString(p)) {
        r->prompts = exl_calloc(1, sizeof *r->prompts);
        if (!r->prompts)
            return nomem(err);
        r->prompts[0].text = p->valuestring;
        r->n_prompts = 1;
        return 0;
    }
    int n = cJSON_IsArray(p) ? cJSON_GetArraySize(p) : 0;
    if (n == 0)
        return exl_oai_bad_param(err, "prompt", "'prompt' must be a string or a non-empty list");
    if (cJSON_IsNumber(p->child))
        n = 1; /* one prompt given as token ids */
    if (n > EXL_OAI_MAX_CHOICES)
        return exl_oai_bad_param(err, "prompt", "at most %d prompts per request", EXL_OAI_MAX_CHOICES);
    r->prompts = exl_calloc((size_t)n, sizeof *r->prompts);
    if (!r->prompts)
        return nomem(err);
    r->n_prompts = n;
    if (cJSON_IsNumber(p->child))
        return token_array(p, vocab, &r->prompts[0], err);
    int i = 0;
    for (const cJSON *e = p->child; e; e = e->next, i++) {
        if (cJSON_IsString(e))
            r->prompts[i].text = e->valuestring;
        else if (cJSON_IsArray(e)) {
            if (token_array(e, vocab, &r->prompts[i], err))
                return -1;
        } else
            return exl_oai_bad_param(err, "prompt", "'prompt' list items must be strings or token id lists");
    }
    return 0;
}

/* content: a string, null, or a list of {"type": "text", "text": ...} parts (joined). */
static int message_content(const cJSON *c, int i, char **out, exl_oai_error *err) {
    if (!c || cJSON_IsString(c)) {
        *out = exl_strdup(c ? c->valuestring : "");
        return *out ? 0 : nomem(err);
    }
    if (!cJSON_IsArray(c))
        return exl_oai_bad_param(err, "messages", "messages[%d].content must be a string or a list of parts", i);
    exl_str s = EXL_STR_INIT;
    for (const cJSON *part = c->child; part; part = part->next) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(part, "type");
        const cJSON *text = cJSON_GetObjectItemCaseSensitive(part, "text");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "text") || !cJSON_IsString(text)) {
            exl_str_free(&s);
            return exl_oai_bad_param(err, "messages", "messages[%d].content: only text parts are supported", i);
        }
        if (exl_str_puts(&s, text->valuestring)) {
            exl_str_free(&s);
            return nomem(err);
        }
    }
    *out = exl_str_steal(&s);
    return *out ? 0 : nomem(err);
}

/* An assistant message's tool_calls (kept as JSON text), a tool message's tool_call_id and name. */
static int message_tools(const cJSON *e, int i, exl_chat_message *m, char **calls_json, exl_oai_error *err) {
    const cJSON *calls = field(e, "tool_calls"), *id = field(e, "tool_call_id"), *name = field(e, "name");
    if ((id && !cJSON_IsString(id)) || (name && !cJSON_IsString(name)))
        return exl_oai_bad_param(err, "messages", "messages[%d]: tool_call_id and name must be strings", i);
    m->tool_call_id = id ? id->valuestring : NULL;
    m->name = name && !strcmp(m->role, "tool") ? name->valuestring : NULL;
    if (!calls)
        return 0;
    if (strcmp(m->role, "assistant") || !cJSON_IsArray(calls))
        return exl_oai_bad_param(err, "messages", "messages[%d].tool_calls must be a list, on an assistant message", i);
    for (const cJSON *c = calls->child; c; c = c->next) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
        const cJSON *fname = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        if (!cJSON_IsString(fname) || (args && !cJSON_IsString(args)))
            return exl_oai_bad_param(err, "messages",
                                     "messages[%d].tool_calls: each needs function.name and function.arguments "
                                     "(a string)",
                                     i);
    }
    char *s = cJSON_PrintUnformatted(calls);
    *calls_json = s ? exl_strdup(s) : NULL;
    cJSON_free(s);
    m->tool_calls = *calls_json;
    return *calls_json ? 0 : nomem(err);
}

static int parse_messages(exl_oai_request *r, exl_oai_error *err) {
    static const char *const roles[] = {"system", "user", "assistant", "tool", "developer"};
    const cJSON *m = field(r->root, "messages");
    int n = cJSON_IsArray(m) ? cJSON_GetArraySize(m) : 0;
    if (n == 0)
        return exl_oai_bad_param(err, "messages", "'messages' must be a non-empty list");
    r->messages = exl_calloc((size_t)n, sizeof *r->messages);
    r->contents = exl_calloc((size_t)n, sizeof *r->contents);
    r->tool_calls = exl_calloc((size_t)n, sizeof *r->tool_calls);
    if (!r->messages || !r->contents || !r->tool_calls)
        return nomem(err);
    int i = 0;
    for (const cJSON *e = m->child; e; e = e->next, i++) {
        const cJSON *role = cJSON_IsObject(e) ? cJSON_GetObjectItemCaseSensitive(e, "role") : NULL;
        size_t k = 0;
        while (cJSON_IsString(role) && k < sizeof roles / sizeof roles[0] && strcmp(role->valuestring, roles[k]))
            k++;
        if (!cJSON_IsString(role) || k == sizeof roles / sizeof roles[0])
            return exl_oai_bad_param(err, "messages",
                                     "messages[%d].role must be one of system, user, assistant, tool, developer", i);
        if (message_content(field(e, "content"), i, &r->contents[i], err))
            return -1;
        r->n_messages = i + 1;
        /* "developer" is the newer name of "system"; templates know only the latter */
        r->messages[i].role = k == 4 ? "system" : roles[k];
        r->messages[i].content = r->contents[i];
        if (message_tools(e, i, &r->messages[i], &r->tool_calls[i], err))
            return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- sampling and the rest */

static int parse_stop(exl_oai_request *r, exl_oai_error *err) {
    const cJSON *s = field(r->root, "stop");
    if (!s)
        return 0;
    if (cJSON_IsString(s)) {
        if (*s->valuestring)
            r->stop[r->n_stop++] = s->valuestring;
        return 0;
    }
    if (!cJSON_IsArray(s))
        return exl_oai_bad_param(err, "stop", "'stop' must be a string or a list of strings");
    for (const cJSON *e = s->child; e; e = e->next) {
        if (!cJSON_IsString(e))
            return exl_oai_bad_param(err, "stop", "'stop' must be a string or a list of strings");
        if (r->n_stop == EXL_OAI_MAX_STOP)
            return exl_oai_bad_param(err, "stop", "at most %d stop strings", EXL_OAI_MAX_STOP);
        if (*e->valuestring)
            r->stop[r->n_stop++] = e->valuestring;
    }
    return 0;
}

/* logit_bias: {"token id": bias in [-100, 100]}; -100 bans the token. */
static int parse_logit_bias(exl_oai_request *r, int32_t vocab, exl_oai_error *err) {
    const cJSON *b = field(r->root, "logit_bias");
    if (!b)
        return 0;
    if (!cJSON_IsObject(b))
        return exl_oai_bad_param(err, "logit_bias", "'logit_bias' must be an object of token id -> bias");
    int n = cJSON_GetArraySize(b);
    if (n > EXL_OAI_MAX_BIAS)
        return exl_oai_bad_param(err, "logit_bias", "at most %d logit_bias entries", EXL_OAI_MAX_BIAS);
    r->bias = exl_calloc(n ? (size_t)n : 1, sizeof *r->bias);
    if (!r->bias)
        return nomem(err);
    for (const cJSON *e = b->child; e; e = e->next) {
        char *end;
        long id = strtol(e->string, &end, 10);
        if (!*e->string || *end || id < 0 || id >= vocab)
            return exl_oai_bad_param(err, "logit_bias", "logit_bias key '%.64s' is not a token id in 0..%d", e->string,
                                     (int)vocab - 1);
        if (!cJSON_IsNumber(e) || !(e->valuedouble >= -100 && e->valuedouble <= 100))
            return exl_oai_bad_param(err, "logit_bias", "logit_bias values must be numbers in [-100, 100]");
        exl_logit_bias *lb = &r->bias[r->sampling.n_logit_bias++];
        lb->id = (int32_t)id;
        lb->bias = e->valuedouble <= -100 ? -INFINITY : (float)e->valuedouble;
    }
    r->sampling.logit_bias = r->bias;
    return 0;
}

static int parse_sampling(exl_oai_request *r, exl_oai_error *err) {
    const cJSON *root = r->root;
    exl_sampling *s = &r->sampling;
    double v;
    int64_t i;
    int rc;
    if ((rc = opt_number(root, "temperature", 0, 2, &v, err)) < 0)
        return -1;
    if (rc)
        s->temperature = (float)v;
    if ((rc = opt_number(root, "top_p", 0, 1, &v, err)) < 0)
        return -1;
    if (rc && v == 0)
        s->top_k = 1; /* nothing but the most likely token */
    else if (rc)
        s->top_p = (float)v;
    if ((rc = opt_int(root, "top_k", -1, 1 << 30, &i, err)) < 0)
        return -1;
    if (rc && i > 0)
        s->top_k = (int32_t)i; /* -1 and 0: off */
    if ((rc = opt_number(root, "min_p", 0, 1, &v, err)) < 0)
        return -1;
    if (rc)
        s->min_p = (float)v;
    if ((rc = opt_number(root, "typical_p", 0, 1, &v, err)) < 0)
        return -1;
    if (rc && v == 0)
        return exl_oai_bad_param(err, "typical_p", "'typical_p' must be in (0, 1]");
    if (rc)
        s->typical_p = (float)v;
    if ((rc = opt_number(root, "repetition_penalty", 0, 100, &v, err)) < 0)
        return -1;
    if (rc && v == 0)
        return exl_oai_bad_param(err, "repetition_penalty", "'repetition_penalty' must be > 0");
    if (rc)
        s->repetition_penalty = (float)v;
    if ((rc = opt_number(root, "presence_penalty", -2, 2, &v, err)) < 0)
        return -1;
    if (rc)
        s->presence_penalty = (float)v;
    if ((rc = opt_number(root, "frequency_penalty", -2, 2, &v, err)) < 0)
        return -1;
    if (rc)
        s->frequency_penalty = (float)v;
    if ((rc = opt_int(root, "seed", -9.2e18, 9.2e18, &i, err)) < 0)
        return -1;
    if (rc) {
        r->has_seed = 1;
        s->seed = (uint64_t)i;
    }
    r->speculative = 1;
    return opt_bool(root, "speculative", &r->speculative, err) < 0 ? -1 : 0;
}

static int parse_logprobs(exl_oai_request *r, exl_oai_error *err) {
    int64_t i;
    int rc;
    if (r->kind == EXL_OAI_COMPLETION) { /* logprobs: how many alternatives (0 = the token's own) */
        if ((rc = opt_int(r->root, "logprobs", 0, 20, &i, err)) < 0)
            return -1;
        r->logprobs = rc;
        r->top_logprobs = rc ? (int32_t)i : 0;
        return 0;
    }
    if (opt_bool(r->root, "logprobs", &r->logprobs, err) < 0 ||
        (rc = opt_int(r->root, "top_logprobs", 0, 20, &i, err)) < 0)
        return -1;
    if (rc && !r->logprobs)
        return exl_oai_bad_param(err, "top_logprobs", "'top_logprobs' needs 'logprobs' set to true");
    r->top_logprobs = rc ? (int32_t)i : 0;
    return 0;
}

/* ---------------------------------------------------------------- tools and response_format */

static int valid_name(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64)
        return 0;
    for (; *s; s++)
        if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') || *s == '_' ||
              *s == '-'))
            return 0;
    return 1;
}

static int parse_tool_list(exl_oai_request *r, exl_oai_error *err) {
    const cJSON *tools = field(r->root, "tools");
    if (!tools)
        return 0;
    if (r->kind != EXL_OAI_CHAT)
        return exl_oai_bad_param(err, "tools", "'tools' are supported on /v1/chat/completions only");
    if (!cJSON_IsArray(tools))
        return exl_oai_bad_param(err, "tools", "'tools' must be a list of function tools");
    int i = 0;
    for (const cJSON *t = tools->child; t; t = t->next, i++) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(t, "type");
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(t, "function");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(fn, "name");
        const cJSON *params = field(fn, "parameters"), *desc = field(fn, "description"), *strict = field(fn, "strict");
        if (!cJSON_IsString(type) || strcmp(type->valuestring, "function") || !cJSON_IsObject(fn))
            return exl_oai_bad_param(err, "tools", "tools[%d] must be {\"type\": \"function\", \"function\": {...}}",
                                     i);
        if (!cJSON_IsString(name) || !valid_name(name->valuestring))
            return exl_oai_bad_param(err, "tools", "tools[%d].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -",
                                     i);
        if ((params && !cJSON_IsObject(params)) || (desc && !cJSON_IsString(desc)) || (strict && !cJSON_IsBool(strict)))
            return exl_oai_bad_param(err, "tools",
                                     "tools[%d].function: parameters must be an object, description a string, "
                                     "strict a boolean",
                                     i);
        for (const cJSON *u = tools->child; u != t; u = u->next)
            if (!strcmp(cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(u, "function"), "name")
                            ->valuestring,
                        name->valuestring))
                return exl_oai_bad_param(err, "tools", "two tools are named '%s'", name->valuestring);
    }
    r->tools = i ? tools : NULL;
    return 0;
}

static int parse_tool_choice(exl_oai_request *r, exl_oai_error *err) {
    const cJSON *c = field(r->root, "tool_choice");
    r->tool_choice = r->tools ? EXL_OAI_TOOLS_AUTO : EXL_OAI_TOOLS_NONE;
    r->parallel_tool_calls = 1;
    if (opt_bool(r->root, "parallel_tool_calls", &r->parallel_tool_calls, err) < 0)
        return -1;
    if (!c)
        return 0;
    if (cJSON_IsString(c)) {
        static const char *const names[] = {"none", "auto", "required"};
        int k = 0;
        while (k < 3 && strcmp(c->valuestring, names[k]))
            k++;
        if (k == 3)
            return exl_oai_bad_param(err, "tool_choice", "'tool_choice' must be none, auto, required or a function");
        r->tool_choice = (exl_oai_tool_choice)k;
    } else {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(c, "type");
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "function"), "name");
        if (!cJSON_IsObject(c) || !cJSON_IsString(type) || strcmp(type->valuestring, "function") ||
            !cJSON_IsString(name))
            return exl_oai_bad_param(err, "tool_choice",
                                     "'tool_choice' must be none, auto, required or {\"type\": \"function\", "
                                     "\"function\": {\"name\": ...}}");
        r->tool_choice = EXL_OAI_TOOLS_NAMED;
        r->tool_name = name->valuestring;
    }
    if (r->tool_choice != EXL_OAI_TOOLS_NONE && !r->tools)
        return exl_oai_bad_param(err, "tool_choice", "'tool_choice' other than none needs 'tools'");
    int found = r->tool_choice != EXL_OAI_TOOLS_NAMED;
    for (const cJSON *t = r->tools ? r->tools->child : NULL; t && !found; t = t->next)
        found = !strcmp(
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(t, "function"), "name")->valuestring,
            r->tool_name);
    if (!found)
        return exl_oai_bad_param(err, "tool_choice", "no tool is named '%.64s'", r->tool_name);
    return 0;
}

static int parse_response_format(exl_oai_request *r, exl_oai_error *err) {
    const cJSON *f = field(r->root, "response_format");
    r->format = EXL_OAI_FORMAT_TEXT;
    if (!f)
        return 0;
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(f, "type");
    if (!cJSON_IsObject(f) || !cJSON_IsString(type))
        return exl_oai_bad_param(err, "response_format", "'response_format' must be an object with a 'type'");
    if (!strcmp(type->valuestring, "text"))
        return 0;
    if (!strcmp(type->valuestring, "json_object")) {
        r->format = EXL_OAI_FORMAT_JSON_OBJECT;
        return 0;
    }
    if (strcmp(type->valuestring, "json_schema"))
        return exl_oai_bad_param(err, "response_format",
                                 "response_format.type must be text, json_object or json_schema");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(f, "json_schema");
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(js, "schema"), *strict = field(js, "strict");
    if (!cJSON_IsObject(js) || !(cJSON_IsObject(schema) || cJSON_IsBool(schema)) || (strict && !cJSON_IsBool(strict)))
        return exl_oai_bad_param(err, "response_format",
                                 "response_format.json_schema must be {\"name\": ..., \"schema\": {...}, "
                                 "\"strict\": true or false}");
    r->format = EXL_OAI_FORMAT_JSON_SCHEMA;
    r->schema = schema;
    r->schema_strict = cJSON_IsTrue(strict);
    return 0;
}

static int refuse_unsupported(const cJSON *root, exl_oai_error *err) {
    const cJSON *f;
    if (cJSON_IsTrue(field(root, "echo")))
        return exl_oai_bad_param(err, "echo", "'echo' is not supported");
    if ((f = field(root, "suffix")) && !(cJSON_IsString(f) && !*f->valuestring))
        return exl_oai_bad_param(err, "suffix", "'suffix' is not supported");
    if ((f = field(root, "best_of")) && !(cJSON_IsNumber(f) && f->valuedouble == 1))
        return exl_oai_bad_param(err, "best_of", "'best_of' other than 1 is not supported");
    if ((f = field(root, "functions")) && cJSON_GetArraySize(f) > 0)
        return exl_oai_bad_param(err, "functions", "the legacy 'functions' are not supported: use 'tools'");
    return 0;
}

/* Fields that would otherwise be accepted and do nothing. */
static int refuse_ignored(const exl_oai_request *r, exl_oai_error *err) {
    const cJSON *f;
    if (field(r->root, "stream_options") && !r->stream)
        return exl_oai_bad_param(err, "stream_options", "'stream_options' is only allowed when 'stream' is true");
    if ((f = field(r->root, "store")) && !cJSON_IsBool(f))
        return exl_oai_bad_param(err, "store", "'store' must be a boolean");
    if (cJSON_IsTrue(f))
        return exl_oai_bad_param(err, "store", "'store' is not supported: this server keeps no completions");
    if (!(f = field(r->root, "modalities")))
        return 0;
    if (!cJSON_IsArray(f))
        return exl_oai_bad_param(err, "modalities", "'modalities' must be a list of strings");
    for (const cJSON *m = f->child; m; m = m->next)
        if (!cJSON_IsString(m) || strcmp(m->valuestring, "text"))
            return exl_oai_bad_param(err, "modalities", "only the \"text\" modality is supported");
    return 0;
}

static int parse_fields(exl_oai_request *r, int32_t vocab, exl_oai_error *err) {
    const char *user;
    int64_t i;
    int rc;
    if (!cJSON_IsObject(r->root))
        return exl_oai_bad_param(err, NULL, "the request body must be a JSON object");
    if (opt_string(r->root, "model", &r->model, err) < 0 || opt_string(r->root, "user", &user, err) < 0 ||
        refuse_unsupported(r->root, err))
        return -1;
    if (r->kind == EXL_OAI_COMPLETION ? parse_prompts(r, vocab, err) : parse_messages(r, err))
        return -1;
    if ((rc = opt_int(r->root, "max_tokens", 1, 1 << 24, &i, err)) < 0)
        return -1;
    r->max_tokens = rc ? (int32_t)i : 0;
    if ((rc = opt_int(r->root, "max_completion_tokens", 1, 1 << 24, &i, err)) < 0)
        return -1;
    if (rc)
        r->max_tokens = (int32_t)i;
    if ((rc = opt_int(r->root, "n", 1, EXL_OAI_MAX_CHOICES, &i, err)) < 0)
        return -1;
    r->n = rc ? (int32_t)i : 1;
    int32_t n_prompts = r->kind == EXL_OAI_COMPLETION ? r->n_prompts : 1;
    if (r->n * n_prompts > EXL_OAI_MAX_CHOICES)
        return exl_oai_bad_param(err, "n", "at most %d choices (prompts x n) per request", EXL_OAI_MAX_CHOICES);
    if (opt_bool(r->root, "stream", &r->stream, err) < 0 || opt_bool(r->root, "ignore_eos", &r->ignore_eos, err) < 0)
        return -1;
    const cJSON *so = field(r->root, "stream_options");
    if (so && !cJSON_IsObject(so))
        return exl_oai_bad_param(err, "stream_options", "'stream_options' must be an object");
    if (so && opt_bool(so, "include_usage", &r->include_usage, err) < 0)
        return -1;
    if (refuse_ignored(r, err))
        return -1;
    if (parse_stop(r, err) || parse_sampling(r, err) || parse_logit_bias(r, vocab, err) || parse_logprobs(r, err))
        return -1;
    if (parse_tool_list(r, err) || parse_tool_choice(r, err) || parse_response_format(r, err))
        return -1;
    return 0;
}

/* ---------------------------------------------------------------- entry */

/* Does the JSON text hold U+0000, escaped or raw? (An escape's backslash is never itself escaped
 * at the point the scan sees it: each backslash skips the character after it.) */
static int has_nul(const char *body, size_t len) {
    if (memchr(body, 0, len))
        return 1;
    for (const char *p = memchr(body, '\\', len), *end = body + len; p; p = memchr(p, '\\', (size_t)(end - p))) {
        if (end - p >= 6 && p[1] == 'u' && !memcmp(p + 2, "0000", 4))
            return 1;
        p += 2;
        if (p >= end)
            break;
    }
    return 0;
}

cJSON *exl_oai_json_parse(const char *body, size_t len, exl_oai_error *err) {
    if (!exl_utf8_valid(body, len)) {
        exl_oai_fail(err, 400, "invalid_request_error", NULL, "invalid_utf8", "the request body is not valid UTF-8");
        return NULL;
    }
    if (has_nul(body, len)) {
        exl_oai_fail(err, 400, "invalid_request_error", NULL, "unsupported_character",
                     "the request holds U+0000 (NUL), which this server does not accept in any string");
        return NULL;
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(body, len, &end, 0);
    while (root && end < body + len && strchr(" \t\r\n", *end) && *end)
        end++;
    if (!root || end != body + len) {
        cJSON_Delete(root);
        exl_oai_fail(err, 400, "invalid_request_error", NULL, "invalid_json", "the request body is not valid JSON");
        return NULL;
    }
    return root;
}

int exl_oai_request_parse(exl_oai_kind kind, const char *body, size_t len, int32_t vocab, exl_oai_request *r,
                          exl_oai_error *err) {
    *r = (exl_oai_request){.kind = kind, .sampling = exl_sampling_default()};
    if (!(r->root = exl_oai_json_parse(body, len, err)))
        return -1;
    if (parse_fields(r, vocab, err)) {
        exl_oai_request_free(r);
        return -1;
    }
    return 0;
}

void exl_oai_request_free(exl_oai_request *r) {
    for (int32_t i = 0; r->prompts && i < r->n_prompts; i++)
        exl_free(r->prompts[i].ids);
    exl_free(r->prompts);
    for (int32_t i = 0; r->contents && i < r->n_messages; i++)
        exl_free(r->contents[i]);
    for (int32_t i = 0; r->tool_calls && i < r->n_messages; i++)
        exl_free(r->tool_calls[i]);
    exl_free(r->contents);
    exl_free(r->tool_calls);
    exl_free(r->messages);
    exl_free(r->bias);
    cJSON_Delete(r->root);
    *r = (exl_oai_request){0};
}
