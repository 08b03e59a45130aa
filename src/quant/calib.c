/* calib.c - calibration rows: the user's text files, tokenized with the model's tokenizer
 * (no special tokens), concatenated in the order given, and cut into `rows` windows of
 * `length` tokens whose starts are spread evenly over the whole stream (so every file
 * contributes). Windows overlap only when the text is shorter than rows x length. */
#include "quant/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "io/json_file.h"

#include <string.h>

exl_status exl_qz_calibration(const char *model_dir, const char *const *files, int32_t n_files, int32_t rows,
                              int32_t length, int32_t **ids) {
    *ids = NULL;
    if (n_files < 1)
        return exl_fail(EXL_ERR_ARG, "no calibration text: give one or more UTF-8 files (--calibration FILE...)");
    exl_tokenizer *tok;
    EXL_TRY(exl_tokenizer_load(model_dir, &tok));
    int32_t *all = NULL;
    int64_t n_all = 0;
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
        if (st == EXL_OK && n == 0)
            st = exl_fail(EXL_ERR_ARG, "%s: calibration file holds no text", files[f]);
        int32_t *grown = st == EXL_OK ? exl_realloc(all, (size_t)(n_all + n) * sizeof(int32_t)) : NULL;
        if (st == EXL_OK && !grown)
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        if (grown) {
            all = grown;
            memcpy(all + n_all, t, (size_t)n * sizeof(int32_t));
            n_all += n;
        }
        exl_ids_free(t);
    }
    exl_tokenizer_free(tok);
    if (st == EXL_OK && n_all < length)
        st = exl_fail(EXL_ERR_ARG, "the calibration text gives %lld tokens, fewer than one row of --length %d",
                      (long long)n_all, length);
    if (st == EXL_OK && !(*ids = exl_malloc((size_t)rows * length * sizeof(int32_t))))
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t r = 0; r < rows && st == EXL_OK; r++) {
        int64_t start = rows > 1 ? (n_all - length) * r / (rows - 1) : 0;
        memcpy(*ids + (int64_t)r * length, all + start, (size_t)length * sizeof(int32_t));
    }
    exl_free(all);
    return st;
}
