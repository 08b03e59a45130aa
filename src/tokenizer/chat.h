/* chat.h - chat templates: a parsed Jinja template plus the special-token texts it is
 * rendered with, as transformers' apply_chat_template(tokenize=False) renders it. */
#ifndef EXL_TOKENIZER_CHAT_H
#define EXL_TOKENIZER_CHAT_H

#include "exl.h"

typedef struct exl_chat_template exl_chat_template;

/* The template used when a model has none: ChatML,
 *   <|im_start|>{role}\n{content}<|im_end|>\n ... [<|im_start|>assistant\n] */
extern const char exl_chat_fallback_template[];

/* Parse source (NULL: the fallback) with the BOS/EOS texts (NULL when the model has
 * none: the variables are then undefined, as in transformers). */
exl_status exl_chat_template_init(const char *source, const char *bos_token, const char *eos_token,
                                  exl_chat_template **out);
void exl_chat_template_free(exl_chat_template *ct);

/* Render the conversation. The template sees `messages` (list of {role, content}),
 * `add_generation_prompt`, `bos_token`, `eos_token`, `tools` (the parsed tools_json
 * array, or none when tools_json is NULL: transformers passes tools=None) and
 * `documents` (none). *text is freed with exl_string_free. A template's
 * raise_exception(msg) fails with EXL_ERR_ARG and msg as the message. */
exl_status exl_chat_template_render(const exl_chat_template *ct, const exl_chat_message *messages, int32_t n_messages,
                                    int add_generation_prompt, const char *tools_json, char **text);

#endif
