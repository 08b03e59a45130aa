/* fuzz_tokenizer.c - libFuzzer target: the input (up to its first NUL byte) is written
 * as tokenizer.json, loaded, and the rest of the input (or a fixed sample) is encoded,
 * decoded and stream-decoded. Loading must fail cleanly or give a working tokenizer. */
#include "fuzz.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "exl.h"

static char dir[64];
static char path[128];

static const char sample[] = "Hello world! <s> 123 4567  \n\t caf\xc3\xa9 \xf0\x9f\xa6\x99 <|im_start|>";

static void exercise(const exl_tokenizer *tok, const char *text, size_t len) {
    int32_t *ids, n;
    if (exl_tokenizer_encode(tok, text, len, 1, &ids, &n) != EXL_OK)
        return;
    char *out;
    for (int skip = 0; skip < 2; skip++) {
        if (exl_tokenizer_decode(tok, ids, n, skip, &out) == EXL_OK)
            exl_string_free(out);
        exl_detokenizer *d;
        if (exl_detokenizer_init(tok, skip, &d) != EXL_OK)
            continue;
        const char *t;
        size_t tl;
        for (int32_t i = 0; i < n; i++)
            exl_detokenizer_push(d, ids[i], &t, &tl);
        exl_detokenizer_flush(d, &t, &tl);
        exl_detokenizer_free(d);
    }
    exl_ids_free(ids);
    for (int32_t id = -1; id <= exl_tokenizer_vocab_size(tok) && id < 64; id++)
        exl_tokenizer_token_text(tok, id);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (!dir[0]) {
        snprintf(dir, sizeof dir, "/tmp/exl-fuzz-tok-XXXXXX");
        if (!mkdtemp(dir))
            abort();
        snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    }
    const uint8_t *nul = memchr(data, 0, size);
    size_t json_len = nul ? (size_t)(nul - data) : size;
    FILE *f = fopen(path, "wb");
    if (!f)
        abort();
    fwrite(data, 1, json_len, f);
    fclose(f);
    exl_tokenizer *tok;
    if (exl_tokenizer_load(dir, &tok) != EXL_OK)
        return 0;
    if (nul)
        exercise(tok, (const char *)nul + 1, size - json_len - 1);
    exercise(tok, sample, sizeof sample - 1);
    exl_tokenizer_free(tok);
    return 0;
}
