/* openai_request.h - a /v1/completions or /v1/chat/completions request body, parsed
 * and checked: every field's type and range, with a 400 naming the field otherwise. */
#ifndef EXL_SERVER_OPENAI_REQUEST_H
#define EXL_SERVER_OPENAI_REQUEST_H

#include "exl.h"
#include "server/openai_error.h"

#include <cjson/cJSON.h>

#define EXL_OAI_MAX_CHOICES 128 /* prompts x n */
#define EXL_OAI_MAX_STOP 16
#define EXL_OAI_MAX_BIAS 1024

typedef enum exl_oai_kind { EXL_OAI_COMPLETION, EXL_OAI_CHAT } exl_oai_kind;

/* A completion prompt: text, or token ids given directly. */
typedef struct exl_oai_prompt {
    const char *text; /* points into the parsed JSON, or NULL */
    int32_t *ids;     /* exl_malloc'd when given as ids */
    int32_t n_ids;
} exl_oai_prompt;

/* tool_choice */
typedef enum exl_oai_tool_choice {
    EXL_OAI_TOOLS_NONE,     /* no tools offered, or "none": plain text */
    EXL_OAI_TOOLS_AUTO,     /* the model may call tools: its reply is parsed for calls */
    EXL_OAI_TOOLS_REQUIRED, /* it must call one or more (a grammar enforces it) */
    EXL_OAI_TOOLS_NAMED,    /* it must call tool_name */
} exl_oai_tool_choice;

/* response_format */
typedef enum exl_oai_format {
    EXL_OAI_FORMAT_TEXT,
    EXL_OAI_FORMAT_JSON_OBJECT,
    EXL_OAI_FORMAT_JSON_SCHEMA,
} exl_oai_format;

typedef struct exl_oai_request {
    exl_oai_kind kind;
    cJSON *root;             /* the parsed body; strings below point into it */
    const char *model;       /* NULL when not given */
    exl_oai_prompt *prompts; /* completions: one per prompt */
    int32_t n_prompts;
    exl_chat_message *messages; /* chat */
    char **contents;            /* owned message texts (content parts joined) */
    char **tool_calls;          /* owned: each assistant message's tool_calls as JSON text, or NULL */
    int32_t n_messages;
    const cJSON *tools; /* chat: the tools list, NULL when none */
    exl_oai_tool_choice tool_choice;
    const char *tool_name; /* EXL_OAI_TOOLS_NAMED: the function */
    int parallel_tool_calls;
    exl_oai_format format;
    const cJSON *schema; /* EXL_OAI_FORMAT_JSON_SCHEMA: the schema */
    int schema_strict;
    int32_t max_tokens; /* 0 = not given */
    int32_t n;
    const char *stop[EXL_OAI_MAX_STOP];
    int32_t n_stop;
    int has_seed;
    int stream, include_usage;
    int ignore_eos; /* extension (as vLLM's): go on past end-of-sequence, to max_tokens */
    int logprobs;   /* report log-probabilities */
    int32_t top_logprobs;
    int speculative;       /* "speculative" (an extension): false decodes without the server's drafting; default true */
    exl_sampling sampling; /* seed set when has_seed; logit_bias points at `bias` */
    exl_logit_bias *bias;
} exl_oai_request;

/* The body as a JSON value: valid UTF-8, no U+0000 in it (escaped or not), nothing after the
 * value. NULL with *err (400) otherwise; free with cJSON_Delete. */
cJSON *exl_oai_json_parse(const char *body, size_t len, exl_oai_error *err);
/* Parse body[0..len) (checked as exl_oai_json_parse does). vocab bounds logit_bias and token prompts.
 * On failure *err says what (400) and the request holds nothing to free. */
int exl_oai_request_parse(exl_oai_kind kind, const char *body, size_t len, int32_t vocab, exl_oai_request *req,
                          exl_oai_error *err);
void exl_oai_request_free(exl_oai_request *req);

#endif
