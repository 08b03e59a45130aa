/* tools.h - function calling for chat completions: how a model writes tool calls (read from its
 * chat template), the prompt that presents tools to a template that takes none, the grammar that
 * forces a call (tool_choice required or a named function), and tool calls parsed out of a reply.
 *
 * Formats: Hermes / Qwen  <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> (one block
 * per call); Mistral  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]; Llama 3.x  a JSON
 * object {"name": ..., "parameters": {...}} (after <|python_tag|>, when the model writes it). A
 * template that renders no tools gets exl's own system prompt, which asks for the Hermes form. */
#ifndef EXL_SERVER_TOOLS_H
#define EXL_SERVER_TOOLS_H

#include "base/str.h"
#include "exl.h"

#include <cjson/cJSON.h>

typedef enum exl_tool_format {
    EXL_TOOLS_GENERIC, /* the template takes no tools: exl's prompt, Hermes-style calls */
    EXL_TOOLS_HERMES,
    EXL_TOOLS_MISTRAL,
    EXL_TOOLS_LLAMA3,
} exl_tool_format;

/* The model's format, from its chat template rendered with a probe conversation. */
exl_tool_format exl_tools_detect(const exl_tokenizer *tok);

/* The system prompt presenting tools (the request's list) to a model whose template cannot. */
exl_status exl_tools_prompt(const cJSON *tools, exl_str *out);

/* GBNF for a reply that is only tool calls in the format: of the function named `only`, or of any
 * of tools when it is NULL; one call, or one or more when parallel. Arguments follow each
 * function's parameters (strict where the function says so, else lax). */
exl_status exl_tools_grammar(const cJSON *tools, const char *only, int parallel, exl_tool_format fmt, exl_str *out);

typedef struct exl_tool_call {
    char *name;
    char *arguments; /* compact JSON text */
} exl_tool_call;

typedef struct exl_tool_calls {
    exl_tool_call *v;
    int32_t n;
    size_t content_len; /* the reply's text before its first call (its content) */
} exl_tool_calls;

/* The calls in a reply (out->n 0 when there are none, or they do not parse, or name a function
 * not among tools: the reply is then all content). */
exl_status exl_tools_parse(const char *text, size_t len, exl_tool_format fmt, const cJSON *tools, exl_tool_calls *out);
void exl_tool_calls_free(exl_tool_calls *calls);

/* How much of a reply so far is content for sure: no call can start before it. */
size_t exl_tools_content_safe(const char *text, size_t len, exl_tool_format fmt);

#endif
