/* calib.c - calibration rows: the user's text files, tokenized with the model's tokenizer
 * (no special tokens), concatenated in the order given, and cut into windows of `length`
 * tokens whose starts are spread evenly over the whole stream (so every file contributes).
 * Windows overlap only when the text is shorter than rows x length.
 *
 * As in ExLlamaV2's standard calibration set, a few rows (one in 16; at least one when
 * there are two or more) hold uniformly random token ids instead: text reaches only the
 * embeddings of its common tokens, and Hessians that never saw the others let GPTQ push the
 * rounding error into exactly the directions those tokens use. The random ids come from a
 * fixed seed, so runs repeat. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "io/json_file.h"

#include <string.h>

#define RANDOM_EVERY 16

/* Every token of the files, in order (*all allocated). */
static exl_status read_tokens(const exl_tokenizer *tok, const char *const *files, int32_t n_files, int32_t **all,
                              int64_t *n_all, int64_t *file_tokens) {
    *all = NULL;
    *n_all = 0;
    exl_status st = EXL_OK;
    for (int32_t f = 0; f < n_files && st == EXL_OK; f++) {
        char *text;
        size_t len;
        st = exl_file_read(files[f], &text, &len);
        if (st != EXL_OK)
            break;
        int32_t *t = NULL, n = 0;
        st = exl_tokenizer_encode(tok, text, len, 0, &t, &n);
        exl_free(text);
        file_tokens[f] = n;
        if (st == EXL_OK && n == 0)
            st = exl_fail(EXL_ERR_ARG, "%s: calibration file holds no text", files[f]);
        int32_t *grown = st == EXL_OK ? exl_realloc(*all, (size_t)(*n_all + n) * sizeof(int32_t)) : NULL;
        if (st == EXL_OK && !grown)
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        if (grown) {
            *all = grown;
            memcpy(*all + *n_all, t, (size_t)n * sizeof(int32_t));
            *n_all += n;
        }
        exl_ids_free(t);
    }
    return st;
}

/* splitmix64 */
static uint64_t next_random(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

exl_status exl_qz_calibration(const char *model_dir, const char *const *files, int32_t n_files, int32_t rows,
                              int32_t length, int32_t vocab, int32_t **ids, int32_t *file_rows, int64_t *file_tokens) {
    *ids = NULL;
    if (n_files < 1)
        return exl_fail(EXL_ERR_ARG, "no calibration text: give one or more UTF-8 files (--calibration FILE...)");
    int64_t *tokens = exl_calloc((size_t)n_files, sizeof *tokens);
    if (!tokens)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_tokenizer *tok;
    exl_status st = exl_tokenizer_load(model_dir, &tok);
    if (st != EXL_OK) {
        exl_free(tokens);
        return st;
    }
    int32_t *all = NULL;
    int64_t n_all = 0;
    st = read_tokens(tok, files, n_files, &all, &n_all, tokens);
    int32_t tok_vocab = exl_tokenizer_vocab_size(tok);
    exl_tokenizer_free(tok);
    vocab = tok_vocab > 0 && tok_vocab < vocab ? tok_vocab : vocab;
    if (st == EXL_OK && n_all < length)
        st = exl_fail(EXL_ERR_ARG, "the calibration text gives %lld tokens, fewer than one row of --length %d",
                      (long long)n_all, length);
    if (st == EXL_OK && !(*ids = exl_malloc((size_t)rows * length * sizeof(int32_t))))
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    int32_t n_random = rows > 1 ? (rows + RANDOM_EVERY - 1) / RANDOM_EVERY : 0, n_text = rows - n_random;
    if (file_rows)
        memset(file_rows, 0, (size_t)(n_files + 1) * sizeof *file_rows);
    for (int32_t r = 0; r < n_text && st == EXL_OK; r++) {
        int64_t start = n_text > 1 ? (n_all - length) * r / (n_text - 1) : 0;
        memcpy(*ids + (int64_t)r * length, all + start, (size_t)length * sizeof(int32_t));
        int32_t f = 0; /* the file the window starts in */
        for (int64_t end = tokens[0]; f + 1 < n_files && start >= end; end += tokens[++f])
            ;
        if (file_rows)
            file_rows[f]++;
    }
    if (file_rows)
        file_rows[n_files] = n_random;
    if (file_tokens)
        memcpy(file_tokens, tokens, (size_t)n_files * sizeof *tokens);
    exl_free(tokens);
    uint64_t seed = 0x5eed;
    for (int64_t i = (int64_t)n_text * length; i < (int64_t)rows * length && st == EXL_OK; i++)
        (*ids)[i] = (int32_t)(next_random(&seed) % (uint64_t)vocab);
    exl_free(all);
    return st;
}
