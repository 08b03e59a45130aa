/* ref_util.c - run a model over reference sequences and measure the error of its logits. */
#include "ref_util.h"

#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

double ref_rel_err(const float *a, const float *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        double d = (double)a[i] - b[i];
        num += d * d;
        den += (double)b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

int64_t ref_argmax(const float *v, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (v[i] > v[best])
            best = i;
    return best;
}

double ref_compare_model(const char *model_dir, const char *ref_file, const char *key_prefix,
                         const exl_model_params *params, int *argmax_mismatch, int *positions) {
    exl_st_file *ref;
    *argmax_mismatch = 0;
    *positions = 0;
    if (exl_st_open(ref_file, &ref) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "%s", exl_last_error());
        return -1;
    }
    exl_model *model;
    if (exl_model_load(model_dir, params, &model) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "%s", exl_last_error());
        exl_st_close(ref);
        return -1;
    }
    exl_model_desc d;
    exl_model_describe(model, &d);
    double worst = 0;
    const char *seqs[] = {"a", "b", "c", "0", "1", "2"}; /* tinystories names them 0, 1, 2 */
    for (int si = 0; si < 6 && worst >= 0; si++) {
        char name[64];
        snprintf(name, sizeof name, "ids_%s", seqs[si]);
        const exl_st_tensor *ids = exl_st_find(ref, name);
        snprintf(name, sizeof name, "%s_%s", key_prefix, seqs[si]);
        const exl_st_tensor *lg = exl_st_find(ref, name);
        snprintf(name, sizeof name, "pos_%s", seqs[si]);
        const exl_st_tensor *pos = exl_st_find(ref, name);
        if (!ids || !lg)
            continue;
        int32_t n = (int32_t)ids->shape[0];
        int32_t rows = (int32_t)lg->shape[0];
        if (lg->shape[1] != d.vocab_size || (!pos && rows != n)) {
            exl_test_failed(__FILE__, __LINE__, "%s: reference shape mismatch", ref_file);
            worst = -1;
            break;
        }
        exl_session *s;
        float *out = malloc((size_t)n * d.vocab_size * sizeof *out);
        if (!out || exl_session_init(model, n, &s) != EXL_OK) {
            exl_test_failed(__FILE__, __LINE__, "session: %s", exl_last_error());
            free(out);
            worst = -1;
            break;
        }
        if (exl_session_eval(s, (const int32_t *)ids->data, n, out, NULL) != EXL_OK) {
            exl_test_failed(__FILE__, __LINE__, "eval: %s", exl_last_error());
            worst = -1;
        }
        for (int32_t r = 0; worst >= 0 && r < rows; r++) {
            int32_t p = pos ? ((const int32_t *)pos->data)[r] : r;
            const float *want = (const float *)lg->data + (int64_t)r * d.vocab_size;
            const float *got = out + (int64_t)p * d.vocab_size;
            double e = ref_rel_err(got, want, d.vocab_size);
            if (e > worst)
                worst = e;
            if (ref_argmax(got, d.vocab_size) != ref_argmax(want, d.vocab_size))
                (*argmax_mismatch)++;
            (*positions)++;
        }
        exl_session_free(s);
        free(out);
    }
    exl_model_free(model);
    exl_st_close(ref);
    return worst;
}
