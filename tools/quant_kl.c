/* quant_kl.c - how far a quantized model's next-token distributions are from the
 * unquantized model's: the mean KL(P_ref || P_quant) over the stored positions of the
 * reference sequences.
 *
 *   quant_kl REF.logits.safetensors QUANT_DIR...
 *
 * REF holds ids_<s> and logits_<s> (fp32, the unquantized model) for sequences a and b,
 * and pos_<s> where only some positions are stored (docs/formats.md, last section). Each
 * QUANT_DIR is run on the CPU over the same ids; one line per directory: the mean KL over
 * all stored positions, the mean per sequence and the top-1 agreement. */
#include "exl.h"
#include "io/safetensors.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static const char *const seqs[] = {"a", "b"};
#define N_SEQS 2

/* log softmax of v[n] into out (double). */
static void log_softmax(const float *v, int64_t n, double *out) {
    double mx = v[0], sum = 0;
    for (int64_t i = 1; i < n; i++)
        mx = v[i] > mx ? v[i] : mx;
    for (int64_t i = 0; i < n; i++)
        sum += exp((double)v[i] - mx);
    double lse = mx + log(sum);
    for (int64_t i = 0; i < n; i++)
        out[i] = (double)v[i] - lse;
}

static int64_t argmax(const float *v, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        best = v[i] > v[best] ? i : best;
    return best;
}

/* KL(softmax(p) || softmax(q)) of two logit rows; lp, lq scratch of n doubles. */
static double kl_row(const float *p, const float *q, int64_t n, double *lp, double *lq) {
    log_softmax(p, n, lp);
    log_softmax(q, n, lq);
    double kl = 0;
    for (int64_t i = 0; i < n; i++)
        kl += exp(lp[i]) * (lp[i] - lq[i]);
    return kl;
}

typedef struct kl_sum {
    double kl[N_SEQS];
    int32_t rows[N_SEQS], top1;
} kl_sum;

/* Run sequence s of the reference through the model and add up its KL per stored row. */
static exl_status eval_seq(exl_model *model, const exl_st_file *ref, int s, int64_t vocab, kl_sum *sum) {
    char name[32];
    snprintf(name, sizeof name, "ids_%s", seqs[s]);
    const exl_st_tensor *ids = exl_st_find(ref, name);
    snprintf(name, sizeof name, "logits_%s", seqs[s]);
    const exl_st_tensor *lg = exl_st_find(ref, name);
    snprintf(name, sizeof name, "pos_%s", seqs[s]);
    const exl_st_tensor *pos = exl_st_find(ref, name);
    if (!ids || !lg || lg->shape[1] != vocab) {
        fprintf(stderr, "quant_kl: %s: no ids_%s / logits_%s of vocab %lld\n", ref->path, seqs[s], seqs[s],
                (long long)vocab);
        return EXL_ERR_FORMAT;
    }
    int32_t n = (int32_t)ids->shape[0], rows = (int32_t)lg->shape[0];
    float *out = malloc((size_t)n * vocab * sizeof *out);
    double *lp = malloc((size_t)vocab * 2 * sizeof *lp);
    exl_session *sess = NULL;
    exl_status st = out && lp ? exl_session_init(model, n, &sess) : EXL_ERR_NOMEM;
    if (st == EXL_OK)
        st = exl_session_eval(sess, (const int32_t *)ids->data, n, out, NULL);
    for (int32_t r = 0; st == EXL_OK && r < rows; r++) {
        int32_t p = pos ? ((const int32_t *)pos->data)[r] : r;
        const float *want = (const float *)lg->data + (int64_t)r * vocab, *got = out + (int64_t)p * vocab;
        sum->kl[s] += kl_row(want, got, vocab, lp, lp + vocab);
        sum->rows[s]++;
        sum->top1 += argmax(want, vocab) == argmax(got, vocab);
    }
    exl_session_free(sess);
    free(out);
    free(lp);
    return st;
}

static exl_status eval_model(const char *dir, const exl_st_file *ref) {
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *model;
    exl_status st = exl_model_load(dir, &p, &model);
    if (st != EXL_OK)
        return st;
    exl_model_desc d;
    exl_model_describe(model, &d);
    kl_sum sum = {{0}, {0}, 0};
    for (int s = 0; s < N_SEQS && st == EXL_OK; s++)
        st = eval_seq(model, ref, s, d.vocab_size, &sum);
    exl_model_free(model);
    if (st != EXL_OK)
        return st;
    int32_t rows = sum.rows[0] + sum.rows[1];
    printf("%s: mean KL %.5f over %d positions (a %.5f, b %.5f), top-1 agreement %.3f\n", dir,
           (sum.kl[0] + sum.kl[1]) / rows, rows, sum.kl[0] / sum.rows[0], sum.kl[1] / sum.rows[1],
           (double)sum.top1 / rows);
    return EXL_OK;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: quant_kl REF.logits.safetensors QUANT_DIR...\n");
        return 2;
    }
    exl_st_file *ref;
    if (exl_st_open(argv[1], &ref) != EXL_OK) {
        fprintf(stderr, "quant_kl: %s\n", exl_last_error());
        return 1;
    }
    int rc = 0;
    for (int i = 2; i < argc; i++)
        if (eval_model(argv[i], ref) != EXL_OK) {
            fprintf(stderr, "quant_kl: %s: %s\n", argv[i], exl_last_error());
            rc = 1;
        }
    exl_st_close(ref);
    return rc;
}
