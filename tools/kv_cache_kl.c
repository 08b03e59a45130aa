/* kv_cache_kl.c - what quantizing the KV cache costs a model: each window of a text goes through sessions in pieces
 * of C tokens (later pieces read the earlier ones from the cache), once with the 16-bit cache and once per given
 * cache format; per format, the perplexity and the mean KL(P_16 || P_format) of the next-token distributions over
 * the predicted positions, with the top-1 agreement.
 *
 *   kv_cache_kl -m DIR -f FILE [--ctx N] [--windows W] [--chunk C] [-t THREADS] BITS...
 *
 * BITS: K or K,V as exl's --cache-bits takes them (8 6 4 8,4 ...). Runs on the CPU. The first line is the 16-bit
 * cache in one pass (C = N), the reference's own perplexity for comparison. */
#include "exl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t k, v;
    double nll, kl;
    long agree;
} format_row;

static void log_softmax(const float *x, int32_t n, double *out) {
    double mx = x[0], sum = 0;
    for (int32_t i = 1; i < n; i++)
        mx = x[i] > mx ? x[i] : mx;
    for (int32_t i = 0; i < n; i++)
        sum += exp((double)x[i] - mx);
    for (int32_t i = 0; i < n; i++)
        out[i] = (double)x[i] - mx - log(sum);
}

static int32_t argmax(const float *x, int32_t n) {
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        b = x[i] > x[b] ? i : b;
    return b;
}

/* logits [n, vocab] of ids through a cache of k, v bits, in pieces of chunk tokens */
static exl_status window_logits(exl_model *m, const int32_t *ids, int32_t n, int32_t chunk, int32_t k, int32_t v,
                                float *logits, int32_t vocab) {
    exl_session *s;
    exl_status st = exl_session_init_cache(m, n, k, v, &s);
    for (int32_t c = 0; st == EXL_OK && c < n; c += chunk) {
        int32_t len = n - c < chunk ? n - c : chunk;
        st = exl_session_eval(s, ids + c, len, logits + (int64_t)c * vocab, NULL);
    }
    exl_session_free(s);
    return st;
}

static int parse_format(const char *s, format_row *f) {
    char *end;
    f->k = (int32_t)strtol(s, &end, 10);
    f->v = *end == ',' ? (int32_t)strtol(end + 1, &end, 10) : f->k;
    return *end || end == s ? -1 : 0;
}

static char *read_file(const char *path, long *len) {
    FILE *fp = fopen(path, "rb");
    char *text = NULL;
    if (fp && fseek(fp, 0, SEEK_END) == 0 && (*len = ftell(fp)) >= 0 && fseek(fp, 0, SEEK_SET) == 0 &&
        (text = malloc((size_t)*len + 1)) && fread(text, 1, (size_t)*len, fp) != (size_t)*len) {
        free(text);
        text = NULL;
    }
    if (fp)
        fclose(fp);
    return text;
}

int main(int argc, char **argv) {
    const char *dir = NULL, *file = NULL;
    int32_t ctx = 256, windows = 16, chunk = 32, threads = 0, n_formats = 0;
    format_row *formats = calloc((size_t)argc, sizeof *formats);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : "";
        if (!strcmp(a, "-m"))
            dir = v, i++;
        else if (!strcmp(a, "-f"))
            file = v, i++;
        else if (!strcmp(a, "--ctx"))
            ctx = atoi(v), i++;
        else if (!strcmp(a, "--windows"))
            windows = atoi(v), i++;
        else if (!strcmp(a, "--chunk"))
            chunk = atoi(v), i++;
        else if (!strcmp(a, "-t"))
            threads = atoi(v), i++;
        else if (parse_format(a, &formats[n_formats++])) {
            fprintf(stderr, "kv_cache_kl: '%s' is no option or cache format\n", a);
            return 2;
        }
    }
    if (!dir || !file || ctx < 2 || windows < 1 || chunk < 1 || chunk > ctx || !n_formats) {
        fprintf(stderr, "usage: kv_cache_kl -m DIR -f FILE [--ctx N] [--windows W] [--chunk C] [-t THREADS] BITS...\n");
        return 2;
    }
    long len = 0;
    char *text = read_file(file, &len);
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    mp.n_threads = threads;
    exl_tokenizer *tok = NULL;
    exl_model *m = NULL;
    int32_t *ids = NULL, n_ids = 0;
    exl_status st = !text ? EXL_ERR_IO : exl_tokenizer_load(dir, &tok);
    if (st == EXL_OK)
        st = exl_tokenizer_encode(tok, text, (size_t)len, 1, &ids, &n_ids);
    if (st == EXL_OK)
        st = exl_model_load(dir, &mp, &m);
    if (st != EXL_OK) {
        fprintf(stderr, "kv_cache_kl: %s\n", text ? exl_last_error() : "cannot read the text");
        return 1;
    }
    exl_model_desc d;
    exl_model_describe(m, &d);
    const int32_t vocab = d.vocab_size;
    if ((int64_t)windows * ctx > n_ids)
        windows = n_ids / ctx;
    if (windows < 1) {
        fprintf(stderr, "kv_cache_kl: %s has fewer than %d tokens\n", file, ctx);
        return 1;
    }
    float *ref = malloc((size_t)ctx * vocab * sizeof *ref), *got = malloc((size_t)ctx * vocab * sizeof *got);
    double *lp = malloc((size_t)vocab * sizeof *lp), *lq = malloc((size_t)vocab * sizeof *lq);
    double one_pass = 0, ref_nll = 0;
    long scored = 0;
    for (int32_t w = 0; st == EXL_OK && w < windows; w++) {
        const int32_t *x = ids + (int64_t)w * ctx;
        st = window_logits(m, x, ctx, ctx, 16, 16, got, vocab);
        for (int32_t r = 0; st == EXL_OK && r + 1 < ctx; r++) {
            log_softmax(got + (int64_t)r * vocab, vocab, lp);
            one_pass -= lp[x[r + 1]];
        }
        if (st == EXL_OK)
            st = window_logits(m, x, ctx, chunk, 16, 16, ref, vocab);
        for (int32_t f = 0; st == EXL_OK && f < n_formats; f++) {
            format_row *fr = &formats[f];
            st = window_logits(m, x, ctx, chunk, fr->k, fr->v, got, vocab);
            for (int32_t r = 0; st == EXL_OK && r + 1 < ctx; r++) {
                const float *p = ref + (int64_t)r * vocab, *q = got + (int64_t)r * vocab;
                log_softmax(p, vocab, lp);
                log_softmax(q, vocab, lq);
                double kl = 0;
                for (int32_t i = 0; i < vocab; i++)
                    kl += exp(lp[i]) * (lp[i] - lq[i]);
                fr->kl += kl;
                fr->nll -= lq[x[r + 1]];
                fr->agree += argmax(p, vocab) == argmax(q, vocab);
                if (f == 0)
                    ref_nll -= lp[x[r + 1]];
            }
        }
        scored += ctx - 1;
    }
    if (st != EXL_OK) {
        fprintf(stderr, "kv_cache_kl: %s\n", exl_last_error());
        return 1;
    }
    printf("%s: %d windows of %d tokens, pieces of %d, %ld predictions\n", dir, windows, ctx, chunk, scored);
    printf("cache     perplexity  vs 16-bit  mean KL      top-1\n");
    printf("16 1-pass %10.4f\n", exp(one_pass / (double)scored));
    printf("16        %10.4f\n", exp(ref_nll / (double)scored));
    for (int32_t f = 0; f < n_formats; f++) {
        const format_row *fr = &formats[f];
        char name[16];
        snprintf(name, sizeof name, fr->k == fr->v ? "%d" : "%d,%d", fr->k, fr->v);
        double ppl = exp(fr->nll / (double)scored);
        printf("%-9s %10.4f  %+8.3f%%  %.3e  %6.2f%%\n", name, ppl, 100.0 * (ppl / exp(ref_nll / (double)scored) - 1),
               fr->kl / (double)scored, 100.0 * (double)fr->agree / (double)scored);
    }
    free(ref);
    free(got);
    free(lp);
    free(lq);
    free(formats);
    free(text);
    exl_ids_free(ids);
    exl_model_free(m);
    exl_tokenizer_free(tok);
    return 0;
}
