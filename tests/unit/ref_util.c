/* ref_util.c - run a model over reference sequences and measure the error of its logits. */
#include "ref_util.h"

#include "model/model.h"
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

double ref_decode_rows(exl_model *m, const int32_t *ks, int n_ks, int *argmax_mismatch, int *rows) {
    enum { PROMPT = 20, PAGE = 16, PAGES = 2 }; /* a sequence's prompt and next token in its two pages */
    *argmax_mismatch = 0;
    *rows = 0;
    exl_model_desc d;
    exl_model_describe(m, &d);
    exl_kv_cache *cache;
    if (exl_kv_cache_init(m, REF_DECODE_SEQS * PAGES, PAGE, 16, 16, &cache) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "kv cache: %s", exl_last_error());
        return -1;
    }
    int32_t ids[REF_DECODE_SEQS][PROMPT + 1], pages[REF_DECODE_SEQS][PAGES];
    float *alone = malloc((size_t)REF_DECODE_SEQS * d.vocab_size * sizeof *alone);
    float *together = malloc((size_t)REF_DECODE_SEQS * d.vocab_size * sizeof *together);
    double worst = 0;
    for (int s = 0; s < REF_DECODE_SEQS; s++) {
        for (int i = 0; i <= PROMPT; i++)
            ids[s][i] = (int32_t)((7919u * (unsigned)(s * 31 + i) + 13u) % (unsigned)d.vocab_size);
        pages[s][0] = 2 * s, pages[s][1] = 2 * s + 1;
    }
    exl_status st = EXL_OK;
    for (int s = 0; s < REF_DECODE_SEQS && st == EXL_OK; s++) {
        exl_seq_step prompt = {ids[s], PROMPT, 0, pages[s], PAGES, 0};
        exl_seq_step next = {ids[s] + PROMPT, 1, PROMPT, pages[s], PAGES, 1};
        st = exl_model_forward(m, cache, &prompt, 1, NULL);
        if (st == EXL_OK)
            st = exl_model_forward(m, cache, &next, 1, alone + (int64_t)s * d.vocab_size);
    }
    for (int ki = 0; ki < n_ks && st == EXL_OK; ki++) {
        const int k = ks[ki] < REF_DECODE_SEQS ? ks[ki] : REF_DECODE_SEQS;
        exl_seq_step steps[REF_DECODE_SEQS];
        for (int s = 0; s < k; s++)
            steps[s] = (exl_seq_step){ids[s] + PROMPT, 1, PROMPT, pages[s], PAGES, 1};
        st = exl_model_forward(m, cache, steps, k, together);
        for (int s = 0; s < k && st == EXL_OK; s++) {
            const float *a = alone + (int64_t)s * d.vocab_size, *t = together + (int64_t)s * d.vocab_size;
            const double e = ref_rel_err(t, a, d.vocab_size);
            worst = e > worst ? e : worst;
            *argmax_mismatch += ref_argmax(t, d.vocab_size) != ref_argmax(a, d.vocab_size);
            (*rows)++;
        }
    }
    if (st != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "decode rows: %s", exl_last_error());
        worst = -1;
    }
    exl_kv_cache_free(m, cache);
    free(alone);
    free(together);
    return worst;
}
