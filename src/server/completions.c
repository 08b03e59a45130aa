/* completions.c - POST /v1/completions and /v1/chat/completions: the request becomes
 * token prompts (the chat template renders messages), one generator job per choice
 * (prompts x n) is submitted to the engine, and the reply is pending: the engine's events
 * wake the connection, whose pump (on an HTTP worker) takes in what came and answers once
 * all is there (one JSON response) or passes it on chunk by chunk as Server-Sent Events.
 *
 * Context: a prompt of ctx tokens or more is refused (400, context_length_exceeded);
 * max_tokens is cut to what the context leaves. Default max_tokens: 16 for
 * completions (as OpenAI), the rest of the context for chat. A request that may make more
 * than max_response_tokens (choices x max_tokens x (1 + logprob entries per token)) is
 * refused up front (400, response_too_large).
 * A client that leaves has its reply freed by the HTTP layer, which cancels its jobs and
 * so releases their cache pages; a half-closed connection counts as a client that left
 * (nothing tells the two apart).
 *
 * Structured output: response_format json_object / json_schema and tool_choice required / a
 * named function become one constraint per request (all its choices share it). With tools
 * offered (tool_choice not none) each reply is parsed for tool calls in the model's format
 * (tools.h); streamed, content goes out while no call can have started, and the calls go out
 * as delta.tool_calls chunks once the choice is done. */
#include "server/routes.h"

#include "base/alloc.h"
#include "base/error.h"
#include "server/openai_response.h"
#include "server/tools.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

typedef struct oai_run {
    struct oai_run *prev, *next; /* srv->runs, once its jobs are submitted */
    int listed;
    exl_server *srv;
    exl_oai_request req;
    exl_oai_header hdr;
    exl_stream *stream;
    int32_t n_prompts;
    exl_chat_prompt chat; /* chat: the prompt (prompt_ids[0] points at its ids) and its stops */
    int32_t **prompt_ids; /* [n_prompts]; owned for completions */
    int32_t *prompt_len;
    int32_t n_choices;
    exl_oai_choice *choices; /* [n_choices] */
    int32_t n_done;
    double received;    /* when the request arrived, for the time to first token */
    double *last_token; /* [n_choices]: when each choice's latest token came, 0 = none yet */
    int any_token;
    int opened;                 /* streams: the opening chunks are out */
    exl_constraint *constraint; /* response_format or a forced tool call; NULL: free text */
    int tool_mode;              /* tools offered: replies are parsed for calls */
    exl_tool_format tool_fmt;
    exl_chat_message *msgs; /* the conversation as the template gets it, when it differs from the request's */
    exl_str *owned;         /* texts msgs points at */
    int32_t n_owned;
    exl_lora_use lora; /* the adapter "model" names (n_lora 1), held by the jobs once submitted */
    int32_t n_lora;
} oai_run;

/* ---------------------------------------------------------------- life of a run */

static void cancel_unfinished(oai_run *r) {
    for (int32_t i = 0; r->stream && i < r->stream->n_slots; i++)
        if (!r->stream->slots[i].finished)
            exl_engine_cancel(r->srv->engine, r->stream->slots[i].job);
}

static void unlist(oai_run *r) {
    exl_server *srv = r->srv;
    pthread_mutex_lock(&srv->runs_mu);
    if (r->listed) {
        if (r->prev)
            r->prev->next = r->next;
        else
            srv->runs = r->next;
        if (r->next)
            r->next->prev = r->prev;
        r->listed = 0;
    }
    pthread_mutex_unlock(&srv->runs_mu);
}

static void list(oai_run *r) {
    exl_server *srv = r->srv;
    pthread_mutex_lock(&srv->runs_mu);
    r->prev = NULL;
    r->next = srv->runs;
    if (srv->runs)
        srv->runs->prev = r;
    srv->runs = r;
    r->listed = 1;
    pthread_mutex_unlock(&srv->runs_mu);
}

void exl_completions_cancel_all(exl_server *srv) {
    pthread_mutex_lock(&srv->runs_mu);
    for (oai_run *r = srv->runs; r; r = r->next)
        for (int32_t i = 0; i < r->stream->n_slots; i++)
            exl_engine_cancel(srv->engine, r->stream->slots[i].job); /* a finished job: nothing to do */
    pthread_mutex_unlock(&srv->runs_mu);
}

static void run_free(oai_run *r) {
    if (!r)
        return;
    unlist(r);
    if (r->stream)
        exl_stream_set_waker(r->stream, NULL, NULL);
    cancel_unfinished(r);
    exl_stream_unref(r->stream);
    for (int32_t i = 0; r->prompt_ids && r->hdr.kind == EXL_OAI_COMPLETION && i < r->n_prompts; i++)
        exl_free(r->prompt_ids[i]);
    exl_free(r->prompt_ids);
    exl_chat_prompt_free(&r->chat);
    exl_free(r->prompt_len);
    for (int32_t i = 0; r->choices && i < r->n_choices; i++) {
        exl_str_free(&r->choices[i].text);
        cJSON_Delete(r->choices[i].logprobs);
        exl_tool_calls_free(&r->choices[i].calls);
    }
    exl_constraint_free(r->constraint);
    for (int32_t i = 0; i < r->n_owned; i++)
        exl_str_free(&r->owned[i]);
    exl_free(r->owned);
    exl_free(r->msgs);
    exl_free(r->choices);
    exl_free(r->last_token);
    exl_oai_request_free(&r->req);
    exl_free(r);
}

static int nomem(exl_oai_error *err) { return exl_oai_fail(err, 500, "server_error", NULL, NULL, "out of memory"); }

/* ---------------------------------------------------------------- tools */

/* A new owned text (a slot in r->owned); NULL when out of memory. */
static exl_str *owned_text(oai_run *r) {
    exl_str *o = exl_realloc(r->owned, (size_t)(r->n_owned + 1) * sizeof *o);
    if (!o)
        return NULL;
    r->owned = o;
    o[r->n_owned] = (exl_str)EXL_STR_INIT;
    return &o[r->n_owned++];
}

/* For a template that takes no tools: the calls of an assistant message written into its content
 * the way exl's tool prompt asks for them. */
static int calls_as_text(oai_run *r, exl_chat_message *m) {
    cJSON *calls = cJSON_Parse(m->tool_calls);
    exl_str *t = owned_text(r);
    int fail = !calls || !t || exl_str_puts(t, m->content);
    for (const cJSON *c = calls ? calls->child : NULL; c && !fail; c = c->next) {
        const cJSON *fn = cJSON_GetObjectItemCaseSensitive(c, "function");
        const cJSON *args = cJSON_GetObjectItemCaseSensitive(fn, "arguments");
        fail = exl_str_printf(t, "%s<tool_call>\n{\"name\": \"%s\", \"arguments\": %s}\n</tool_call>",
                              t->len ? "\n" : "", cJSON_GetObjectItemCaseSensitive(fn, "name")->valuestring,
                              cJSON_IsString(args) && *args->valuestring ? args->valuestring : "{}");
    }
    cJSON_Delete(calls);
    if (fail)
        return -1;
    m->content = t->data ? t->data : "";
    m->tool_calls = NULL;
    return 0;
}

/* The conversation for a template that takes no tools: exl's tool prompt in the system message,
 * past calls as text. */
static int generic_messages(oai_run *r, exl_oai_error *err) {
    const exl_oai_request *q = &r->req;
    int add_system = r->tool_mode && strcmp(q->messages[0].role, "system");
    int32_t n = q->n_messages + add_system;
    r->msgs = exl_calloc((size_t)n, sizeof *r->msgs);
    if (!r->msgs)
        return nomem(err);
    memcpy(r->msgs + add_system, q->messages, (size_t)q->n_messages * sizeof *r->msgs);
    if (r->tool_mode) {
        exl_str *p = owned_text(r);
        if (!p || exl_tools_prompt(q->tools, p) != EXL_OK ||
            (!add_system && (exl_str_puts(p, "\n\n") || exl_str_puts(p, q->messages[0].content))))
            return nomem(err);
        r->msgs[0] = (exl_chat_message){.role = "system", .content = p->data};
    }
    for (int32_t i = 0; i < n; i++)
        if (r->msgs[i].tool_calls && calls_as_text(r, &r->msgs[i]))
            return nomem(err);
    return 0;
}

/* The constraint of the request, compiled once for all its choices. */
static int make_constraint(oai_run *r, exl_oai_error *err) {
    const exl_oai_request *q = &r->req;
    exl_str text = EXL_STR_INIT;
    exl_constraint_kind kind = EXL_CONSTRAINT_GBNF;
    const char *param = "response_format";
    exl_status st = EXL_OK;
    if (q->tool_choice == EXL_OAI_TOOLS_REQUIRED || q->tool_choice == EXL_OAI_TOOLS_NAMED) {
        param = "tools";
        st = exl_tools_grammar(q->tools, q->tool_choice == EXL_OAI_TOOLS_NAMED ? q->tool_name : NULL,
                               q->parallel_tool_calls, r->tool_fmt, &text);
    } else if (q->format == EXL_OAI_FORMAT_JSON_OBJECT) {
        kind = EXL_CONSTRAINT_JSON_SCHEMA_LAX;
        st = exl_str_puts(&text, "{\"type\": \"object\"}") ? exl_fail(EXL_ERR_NOMEM, "out of memory") : EXL_OK;
    } else if (q->format == EXL_OAI_FORMAT_JSON_SCHEMA) {
        kind = q->schema_strict ? EXL_CONSTRAINT_JSON_SCHEMA : EXL_CONSTRAINT_JSON_SCHEMA_LAX;
        char *s = cJSON_PrintUnformatted(q->schema);
        st = !s || exl_str_puts(&text, s) ? exl_fail(EXL_ERR_NOMEM, "out of memory") : EXL_OK;
        cJSON_free(s);
    } else {
        return 0;
    }
    if (st == EXL_OK)
        st = exl_constraint_compile(kind, text.data, text.len, &r->constraint);
    exl_str_free(&text);
    if (st == EXL_ERR_NOMEM)
        return nomem(err);
    return st == EXL_OK ? 0 : exl_oai_bad_param(err, param, "%s", exl_last_error());
}

/* ---------------------------------------------------------------- prompts */

/* Chat: the conversation as exl_chat_encode makes it a prompt, with the tools offered. */
static int chat_prompt(oai_run *r, exl_oai_error *err) {
    const exl_oai_request *q = &r->req;
    int history_calls = 0;
    for (int32_t i = 0; i < q->n_messages; i++)
        history_calls |= q->messages[i].tool_calls != NULL;
    r->tool_mode = q->tools && q->tool_choice != EXL_OAI_TOOLS_NONE;
    r->tool_fmt = r->tool_mode || history_calls ? exl_tools_detect(r->srv->tok) : EXL_TOOLS_GENERIC;
    char *tools_json = NULL;
    if (r->tool_fmt == EXL_TOOLS_GENERIC && (r->tool_mode || history_calls)) {
        if (generic_messages(r, err))
            return -1;
    } else if (r->tool_mode && !(tools_json = cJSON_PrintUnformatted(q->tools))) {
        return nomem(err);
    }
    int32_t n = r->msgs ? q->n_messages + (r->tool_mode && strcmp(q->messages[0].role, "system")) : q->n_messages;
    exl_status st = exl_chat_encode(r->srv->tok, r->msgs ? r->msgs : q->messages, n, 1, tools_json, &r->chat);
    cJSON_free(tools_json);
    if (st != EXL_OK)
        return st == EXL_ERR_NOMEM ? nomem(err) : exl_oai_bad_param(err, "messages", "%s", exl_last_error());
    r->prompt_ids[0] = r->chat.ids;
    r->prompt_len[0] = r->chat.n_ids;
    return 0;
}

static int completion_prompt(oai_run *r, int32_t i, exl_oai_error *err) {
    const exl_oai_prompt *p = &r->req.prompts[i];
    int32_t *ids = NULL, n = p->n_ids;
    if (p->text) {
        if (exl_tokenizer_encode(r->srv->tok, p->text, strlen(p->text), 1, &ids, &n) != EXL_OK)
            return exl_oai_bad_param(err, "prompt", "%s", exl_last_error());
    }
    r->prompt_ids[i] = exl_malloc((size_t)n * sizeof(int32_t) + 1);
    if (r->prompt_ids[i] && n)
        memcpy(r->prompt_ids[i], p->text ? ids : p->ids, (size_t)n * sizeof(int32_t));
    r->prompt_len[i] = n;
    exl_ids_free(ids);
    return r->prompt_ids[i] ? 0 : nomem(err);
}

static int make_prompts(oai_run *r, exl_oai_error *err) {
    r->n_prompts = r->req.kind == EXL_OAI_CHAT ? 1 : r->req.n_prompts;
    r->prompt_ids = exl_calloc((size_t)r->n_prompts, sizeof *r->prompt_ids);
    r->prompt_len = exl_calloc((size_t)r->n_prompts, sizeof *r->prompt_len);
    if (!r->prompt_ids || !r->prompt_len)
        return nomem(err);
    const char *param = r->req.kind == EXL_OAI_CHAT ? "messages" : "prompt";
    for (int32_t i = 0; i < r->n_prompts; i++) {
        if (r->req.kind == EXL_OAI_CHAT ? chat_prompt(r, err) : completion_prompt(r, i, err))
            return -1;
        if (r->prompt_len[i] == 0)
            return exl_oai_bad_param(err, param, "the prompt is empty");
        if (r->prompt_len[i] >= r->srv->ctx)
            return exl_oai_fail(err, 400, "invalid_request_error", param, "context_length_exceeded",
                                "This model's maximum context length is %d tokens, but the prompt has %d tokens",
                                (int)r->srv->ctx, (int)r->prompt_len[i]);
    }
    return 0;
}

/* ---------------------------------------------------------------- jobs */

static exl_oai_usage usage_of(const oai_run *r) {
    exl_oai_usage u = {0};
    for (int32_t i = 0; i < r->n_prompts; i++)
        u.prompt_tokens += r->prompt_len[i];
    for (int32_t i = 0; i < r->n_choices; i++)
        u.completion_tokens += r->choices[i].n_generated;
    return u;
}

static int32_t max_new_tokens(const oai_run *r, int32_t choice) {
    const exl_oai_request *q = &r->req;
    int32_t room = r->srv->ctx - r->prompt_len[choice / q->n];
    int32_t n = q->max_tokens ? q->max_tokens : q->kind == EXL_OAI_CHAT ? room : 16;
    return n < room ? n : room;
}

/* Refuse what could make a response larger than the server allows, before any work. */
static int check_response_size(const oai_run *r, exl_oai_error *err) {
    const exl_oai_request *q = &r->req;
    int64_t per_token = 1 + (q->logprobs ? 1 + q->top_logprobs : 0), total = 0;
    for (int32_t i = 0; i < r->n_choices; i++)
        total += (int64_t)max_new_tokens(r, i) * per_token;
    int64_t cap = r->srv->params.max_response_tokens;
    if (total <= cap)
        return 0;
    return exl_oai_fail(err, 400, "invalid_request_error", q->n > 1 ? "n" : "max_tokens", "response_too_large",
                        "This request may produce %lld response entries (choices x max_tokens x (1 + logprob "
                        "entries per token) = %d x up to %d x %lld), more than this server's limit of %lld; "
                        "lower n, max_tokens or logprobs",
                        (long long)total, (int)r->n_choices, (int)max_new_tokens(r, 0), (long long)per_token,
                        (long long)cap);
}

static int submit_jobs(oai_run *r, exl_http_conn *conn, exl_oai_error *err) {
    exl_server *srv = r->srv;
    const exl_oai_request *q = &r->req;
    r->n_choices = r->n_prompts * q->n;
    if (check_response_size(r, err))
        return -1;
    r->stream = exl_stream_new(r->n_choices);
    r->choices = exl_calloc((size_t)r->n_choices, sizeof *r->choices);
    r->last_token = exl_calloc((size_t)r->n_choices, sizeof *r->last_token);
    if (!r->stream || !r->choices || !r->last_token)
        return nomem(err);
    exl_stream_set_waker(r->stream, exl_http_wake, conn);
    const char *stop[EXL_OAI_MAX_STOP + 1];
    int32_t n_stop = q->n_stop;
    memcpy(stop, q->stop, (size_t)n_stop * sizeof *stop);
    if (r->chat.stop_string)
        stop[n_stop++] = r->chat.stop_string;
    for (int32_t i = 0; i < r->n_choices; i++) {
        int32_t p = i / q->n, k = i % q->n;
        if (q->logprobs && !(r->choices[i].logprobs = exl_oai_logprobs_new(q->kind)))
            return nomem(err);
        exl_job_params jp = exl_job_default_params();
        jp.ids = r->prompt_ids[p];
        jp.n_ids = r->prompt_len[p];
        jp.max_new_tokens = max_new_tokens(r, i);
        jp.stop_strings = stop;
        jp.n_stop_strings = n_stop;
        jp.stop_ids = &r->chat.stop_id;
        jp.n_stop_ids = r->chat.stop_id >= 0;
        jp.logprobs = q->logprobs;
        jp.top_logprobs = q->top_logprobs;
        jp.ignore_eos = q->ignore_eos;
        jp.sampling = q->sampling;
        jp.no_draft = !q->speculative;
        jp.constraint = r->constraint;
        jp.lora = &r->lora;
        jp.n_lora = r->n_lora;
        /* the n choices of one seed differ from each other, and repeat across requests */
        jp.sampling.seed = q->has_seed
                               ? q->sampling.seed + (uint64_t)k
                               : (uint64_t)time(NULL) * 0x9E3779B97F4A7C15ull + atomic_fetch_add(&srv->next_id, 1);
        if (exl_engine_submit(srv->engine, &jp, &r->stream->slots[i]) != EXL_OK)
            return exl_oai_bad_param(err, NULL, "%s", exl_last_error());
    }
    exl_oai_usage u = usage_of(r);
    atomic_fetch_add(&srv->metrics.prompt_tokens, (unsigned long long)u.prompt_tokens);
    return 0;
}

/* Streamed with tools offered: the content that no call can follow any more. */
static int stream_tool_content(oai_run *r, int32_t index, size_t upto, const cJSON *lp, exl_str *out) {
    exl_oai_choice *c = &r->choices[index];
    if (upto <= c->streamed)
        return 0;
    int rc = exl_oai_chunk_append(out, &r->hdr, index, 0, c->text.data + c->streamed, upto - c->streamed, lp, NULL,
                                  r->req.include_usage);
    c->streamed = upto;
    return rc;
}

/* A choice with tools offered is done: its calls (and the content before them, when streamed). */
static int finish_tools(oai_run *r, int32_t index, exl_str *out) {
    exl_oai_choice *c = &r->choices[index];
    const char *text = c->text.data ? c->text.data : "";
    if (exl_tools_parse(text, c->text.len, r->tool_fmt, r->req.tools, &c->calls) != EXL_OK)
        return -1;
    if (!r->req.stream)
        return 0;
    size_t content = c->calls.n ? c->calls.content_len : c->text.len;
    while (c->calls.n && content > c->streamed && strchr(" \t\r\n", text[content - 1]))
        content--;
    if (stream_tool_content(r, index, content, NULL, out))
        return -1;
    for (int32_t k = 0; k < c->calls.n; k++)
        if (exl_oai_tool_chunks_append(out, &r->hdr, index, k, &c->calls.v[k], r->req.include_usage))
            return -1;
    return 0;
}

/* Take in one event: count it, and for streams format it into out. */
static int absorb(oai_run *r, exl_stream_event *e, exl_str *out, exl_oai_error *err) {
    exl_oai_choice *c = &r->choices[e->index];
    size_t offset = c->text.len;
    if (exl_str_append(&c->text, e->text, e->text_len))
        return nomem(err);
    c->n_generated = e->n_generated;
    cJSON *delta_lp = NULL;
    if (c->logprobs) {
        delta_lp = r->req.stream ? exl_oai_logprobs_new(r->req.kind) : c->logprobs;
        if (!delta_lp || exl_oai_logprobs_add(delta_lp, r->req.kind, r->srv->tok, e, offset)) {
            if (delta_lp != c->logprobs)
                cJSON_Delete(delta_lp);
            return nomem(err);
        }
    }
    int rc = 0;
    if (r->req.stream && r->tool_mode)
        rc = stream_tool_content(r, e->index, exl_tools_content_safe(c->text.data, c->text.len, r->tool_fmt), delta_lp,
                                 out);
    else if (r->req.stream && (e->text_len || (delta_lp && e->n_ids > (e->finish == EXL_FINISH_STOP))))
        rc = exl_oai_chunk_append(out, &r->hdr, e->index, 0, e->text, e->text_len, delta_lp, NULL,
                                  r->req.include_usage);
    if (delta_lp != c->logprobs)
        cJSON_Delete(delta_lp);
    if (rc)
        return nomem(err);
    if (e->finish == EXL_FINISH_NONE)
        return 0;
    r->stream->slots[e->index].finished = 1;
    r->n_done++;
    c->finish = e->finish;
    if (e->finish == EXL_FINISH_ERROR)
        return exl_oai_fail(err, 500, "server_error", NULL, NULL, "generation failed: %s",
                            e->error ? e->error : "unknown error");
    if (e->finish == EXL_FINISH_CANCELLED)
        return exl_oai_fail(err, 503, "server_error", NULL, NULL, "the server is shutting down");
    if (r->tool_mode && finish_tools(r, e->index, out))
        return nomem(err);
    const char *finish = c->calls.n ? "tool_calls" : exl_oai_finish_str(e->finish);
    if (r->req.stream && exl_oai_chunk_append(out, &r->hdr, e->index, 0, r->req.kind == EXL_OAI_CHAT ? NULL : "", 0,
                                              NULL, finish, r->req.include_usage))
        return nomem(err);
    return 0;
}

/* Time to first token and between tokens, by the engine's clock. */
static void observe(oai_run *r, const exl_stream_event *e) {
    exl_metrics *m = &r->srv->metrics;
    if (e->n_ids <= 0)
        return;
    if (!r->any_token)
        exl_histogram_observe(&m->ttft, e->time - r->received);
    r->any_token = 1;
    double *last = &r->last_token[e->index];
    for (int32_t k = 0; *last > 0 && k < e->n_ids; k++)
        exl_histogram_observe(&m->itl, (e->time - *last) / e->n_ids);
    *last = e->time;
}

/* Take in every event that is there: 0, or -1 with err filled. */
static int take_events(oai_run *r, exl_str *out, exl_oai_error *err) {
    for (;;) {
        int lost = 0;
        exl_stream_event *e = exl_stream_pop(r->stream, &lost);
        if (!e)
            return lost ? nomem(err) : 0;
        observe(r, e);
        int rc = absorb(r, e, out, err);
        exl_stream_event_free(e);
        if (rc)
            return -1;
    }
}

/* ---------------------------------------------------------------- the pending reply */

static void sse_error(exl_str *out, const exl_oai_error *err) {
    char *json = exl_oai_error_json(err);
    if (json) {
        exl_str_printf(out, "data: %s\n\n", json);
        exl_free(json);
    }
}

/* exl_http_reply.pump of a stream: the chunks of what came, then the end. */
static int sse_pump(void *ctx, exl_http_reply *reply, exl_str *out) {
    oai_run *r = ctx;
    exl_oai_error err = {0};
    if (!r->opened && r->req.kind == EXL_OAI_CHAT) /* the opening chunk of each choice */
        for (int32_t i = 0; i < r->n_choices; i++)
            if (exl_oai_chunk_append(out, &r->hdr, i, 1, "", 0, NULL, NULL, r->req.include_usage))
                return EXL_HTTP_DROP;
    r->opened = 1;
    if (take_events(r, out, &err)) {
        cancel_unfinished(r);
        r->n_done = r->n_choices;
        sse_error(out, &err);
    }
    if (r->n_done < r->n_choices)
        return EXL_HTTP_MORE;
    exl_oai_usage u = usage_of(r);
    if (!err.status && r->req.include_usage && exl_oai_usage_chunk_append(out, &r->hdr, &u))
        return EXL_HTTP_DROP;
    return exl_str_puts(out, "data: [DONE]\n\n") ? EXL_HTTP_DROP : EXL_HTTP_DONE;
}

/* exl_http_reply.pump of a whole response: nothing until every choice is done. */
static int whole_pump(void *ctx, exl_http_reply *reply, exl_str *out) {
    oai_run *r = ctx;
    exl_oai_error err = {0};
    if (take_events(r, NULL, &err)) {
        cancel_unfinished(r);
        exl_reply_error(reply, &err);
        return EXL_HTTP_DONE;
    }
    if (r->n_done < r->n_choices)
        return EXL_HTTP_MORE;
    exl_oai_usage u = usage_of(r);
    exl_reply_json(reply, 200, exl_oai_response_json(&r->hdr, r->choices, r->n_choices, &u));
    return EXL_HTTP_DONE;
}

static void run_free_cb(void *ctx) { run_free(ctx); }

/* ---------------------------------------------------------------- entry */

/* "model": the base (or none), or a LoRA adapter's name (under the adapters' lock) */
static int select_model(oai_run *r, exl_oai_error *err) {
    exl_server *srv = r->srv;
    if (!r->req.model || !strcmp(r->req.model, srv->model_name))
        return 0;
    const exl_srv_adapter *a = exl_adapters_find(&srv->adapters, r->req.model);
    if (!a)
        return exl_oai_fail(err, 404, "invalid_request_error", "model", "model_not_found",
                            "The model '%.200s' does not exist (this server has '%s' and its LoRA adapters, "
                            "GET /v1/models)",
                            r->req.model, srv->model_name);
    r->lora = a->use;
    r->n_lora = 1;
    r->hdr.model = r->req.model;
    return 0;
}

static int start(oai_run *r, const exl_http_request *req, exl_oai_error *err) {
    exl_server *srv = r->srv;
    if (exl_oai_request_parse(r->hdr.kind, req->body, req->body_len, srv->vocab, &r->req, err))
        return -1;
    if (make_prompts(r, err) || make_constraint(r, err))
        return -1;
    /* an adapter found stays loaded while the jobs are submitted, which then hold it */
    exl_adapters_lock(&srv->adapters);
    int rc = select_model(r, err) || submit_jobs(r, req->conn, err) ? -1 : 0;
    exl_adapters_unlock(&srv->adapters);
    return rc;
}

void exl_completions(exl_server *srv, exl_oai_kind kind, const exl_http_request *req, exl_http_reply *reply) {
    exl_oai_error err = {0};
    oai_run *r = exl_calloc(1, sizeof *r);
    if (!r) {
        nomem(&err);
        exl_reply_error(reply, &err);
        return;
    }
    r->srv = srv;
    r->received = req->received;
    r->hdr.kind = kind;
    r->hdr.created = (long long)time(NULL);
    r->hdr.model = srv->model_name;
    snprintf(r->hdr.id, sizeof r->hdr.id, "%s-%016llx", kind == EXL_OAI_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)(atomic_fetch_add(&srv->next_id, 1) * 0x9E3779B97F4A7C15ull));
    if (start(r, req, &err)) {
        exl_reply_error(reply, &err);
        run_free(r);
        return;
    }
    list(r);
    *reply = (exl_http_reply){.pump = r->req.stream ? sse_pump : whole_pump, .free = run_free_cb, .ctx = r};
    if (r->req.stream) {
        reply->status = 200;
        reply->content_type = "text/event-stream";
    }
}
