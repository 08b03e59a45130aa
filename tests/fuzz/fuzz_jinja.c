/* fuzz_jinja.c - libFuzzer target for the Jinja-subset interpreter: parse the input as a
 * template and render it with a small fixed chat context under tight limits, so every
 * input finishes quickly; any crash, leak or sanitizer report is a bug. */
#include "fuzz.h"
#include "jinja/jinja.h"

#include "base/alloc.h"

#include <stddef.h>
#include <stdint.h>

static const char CONTEXT[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": \"Hi \\u00e9\\n\"},"
    " {\"role\": \"assistant\", \"content\": \"<think>x</think>yo\","
    "  \"tool_calls\": [{\"id\": \"abcdefghi\", \"function\": {\"name\": \"f\", \"arguments\": {\"a\": 1.5}}}]},"
    " {\"role\": \"tool\", \"content\": \"42\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}}}],"
    " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"n\": 3}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static cJSON *ctx;
    if (!ctx)
        ctx = cJSON_Parse(CONTEXT);
    exl_jinja *t;
    if (exl_jinja_parse("fuzz", (const char *)data, size, &t) != EXL_OK)
        return 0;
    exl_jinja_limits lim = {.max_steps = 200000, .max_bytes = 1 << 20, .max_calls = 16};
    char *out = NULL;
    if (exl_jinja_render(t, ctx, &lim, &out) == EXL_OK)
        exl_free(out);
    exl_jinja_free(t);
    return 0;
}
