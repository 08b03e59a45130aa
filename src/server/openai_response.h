/* openai_response.h - the JSON the OpenAI API answers with: completion and chat
 * completion objects, their streamed chunks, usage and log-probabilities. */
#ifndef EXL_SERVER_OPENAI_RESPONSE_H
#define EXL_SERVER_OPENAI_RESPONSE_H

#include "base/str.h"
#include "exl.h"
#include "server/openai_request.h"
#include "server/stream.h"
#include "server/tools.h"

#include <cjson/cJSON.h>

/* What identifies one response across its chunks. */
typedef struct exl_oai_header {
    exl_oai_kind kind;
    char id[48];       /* "cmpl-..." or "chatcmpl-..." */
    long long created; /* unix seconds */
    const char *model;
} exl_oai_header;

/* One choice as it accumulates (non-streaming responses). */
typedef struct exl_oai_choice {
    exl_str text;
    cJSON *logprobs; /* NULL unless requested */
    exl_finish_reason finish;
    int32_t n_generated;
    exl_tool_calls calls; /* parsed from the text when tools were offered; then finish_reason "tool_calls" */
    size_t streamed;      /* tools offered: bytes of text already sent as content */
} exl_oai_choice;

typedef struct exl_oai_usage {
    int32_t prompt_tokens, completion_tokens;
} exl_oai_usage;

/* The log-probability object of one choice, still empty; NULL when out of memory. */
cJSON *exl_oai_logprobs_new(exl_oai_kind kind);
/* Append an event's tokens (not the stop token that ended it); text_offset is the
 * completion text's length before this event. 0 on success. */
int exl_oai_logprobs_add(cJSON *lp, exl_oai_kind kind, const exl_tokenizer *tok, const exl_stream_event *e,
                         size_t text_offset);

/* s[0..n) as a JSON string literal appended to out (U+0000 and other controls escaped). */
int exl_json_quote(exl_str *out, const char *s, size_t n);
/* s[0..n) as a cJSON item (raw JSON text) that prints as that string literal; NULL: no memory. */
cJSON *exl_json_string(const char *s, size_t n);

/* "stop" or "length" (cancelled and failed jobs never reach a response). */
const char *exl_oai_finish_str(exl_finish_reason r);

/* The whole response object; NULL when out of memory. */
char *exl_oai_response_json(const exl_oai_header *h, const exl_oai_choice *choices, int32_t n,
                            const exl_oai_usage *usage);
/* One SSE event "data: {chunk}\n\n" appended to out. text may be NULL (no text in the
 * delta), lp NULL (no logprobs), finish NULL (not finished); role: the chat chunk that
 * opens a choice. with_usage adds "usage": null (stream_options.include_usage). */
int exl_oai_chunk_append(exl_str *out, const exl_oai_header *h, int32_t index, int role, const char *text,
                         size_t text_len, const cJSON *lp, const char *finish, int with_usage);
/* The id of tool call k of choice `index` ("call_" and 24 letters and digits, from the response id). */
void exl_oai_call_id(const exl_oai_header *h, int32_t index, int32_t k, char out[32]);
/* The chunks of one tool call: its id, type and name with empty arguments, then the arguments in
 * pieces (as a client reassembles them). */
int exl_oai_tool_chunks_append(exl_str *out, const exl_oai_header *h, int32_t index, int32_t k,
                               const exl_tool_call *call, int with_usage);
/* The closing usage chunk (no choices). */
int exl_oai_usage_chunk_append(exl_str *out, const exl_oai_header *h, const exl_oai_usage *usage);

#endif
