/* fuzz_openai.c - libFuzzer target: OpenAI request bodies (completions and chat) on
 * arbitrary bytes, through UTF-8 checking, JSON parsing and every field check, and the
 * error object built for whatever is refused. */
#include "base/alloc.h"
#include "fuzz.h"
#include "server/openai_request.h"

#include <stddef.h>
#include <stdint.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    for (int kind = 0; kind < 2; kind++) {
        exl_oai_request req;
        exl_oai_error err;
        if (exl_oai_request_parse(kind ? EXL_OAI_CHAT : EXL_OAI_COMPLETION, (const char *)data, size, 2048, &req,
                                  &err) == 0)
            exl_oai_request_free(&req);
        else
            exl_free(exl_oai_error_json(&err));
    }
    return 0;
}
