/* cmd_perplexity.c - `exl perplexity`: perplexity of a model on a text file, sliding windows. */
#include "cli.h"
#include "options.h"
#include "progress.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char NOTES[] =
    "Protocol:\n"
    "  - the whole file is tokenized once with the tokenizer's post-processor, so a BOS\n"
    "    token (if the tokenizer adds one) stands only at the very start;\n"
    "  - windows of N tokens (--ctx) start every S tokens (--stride): window w covers tokens\n"
    "    [w*S, w*S + N); only whole windows are used (a text shorter than N gives one window\n"
    "    of all its tokens);\n"
    "  - inside a window, token i (i >= 1) is predicted from tokens 0..i-1 of that window;\n"
    "  - a window scores only the tokens that no earlier window scored (with S = N that\n"
    "    is N-1 predictions per window);\n"
    "  - --max-windows K stops after K windows;\n"
    "  - each window goes through the model in pieces of C tokens (--chunk): a piece attends to\n"
    "    the earlier pieces' keys and values as the KV cache holds them (--cache-bits), to its\n"
    "    own as computed; C = N (the default) evaluates a window in one pass (in forward steps\n"
    "    of at most 512 tokens).\n"
    "The result is exp(mean negative log-likelihood) over all scored tokens, printed last\n"
    "as 'perplexity: <value>'.";

/* -log softmax(logits)[target], computed in double. */
static double nll(const float *logits, int32_t vocab, int32_t target) {
    float mx = logits[0];
    for (int32_t i = 1; i < vocab; i++)
        if (logits[i] > mx)
            mx = logits[i];
    double sum = 0;
    for (int32_t i = 0; i < vocab; i++)
        sum += exp((double)logits[i] - mx);
    return log(sum) + mx - logits[target];
}

int cmd_perplexity(int argc, char **argv) {
    cli_model_args model;
    cli_cache_args cache;
    const char *file = NULL;
    long ctx = 2048, stride = 0, max_windows = -1, chunk = 0;
    const cli_option options[] = {
        {"-f", "--file", CLI_STRING, &file, "FILE", .help = "the text (UTF-8)", .required = 1},
        {NULL, "--ctx", CLI_LONG, &ctx, "N", .help = "tokens per window", .lo = 2, .hi = 1 << 20},
        {NULL, "--stride", CLI_LONG, &stride, "S", .help = "tokens between window starts", .lo = 1, .hi = 1 << 20,
         .default_text = "N"},
        {NULL, "--max-windows", CLI_LONG, &max_windows, "K", .help = "stop after K windows", .lo = 1, .hi = 1L << 40,
         .default_text = "all"},
        {NULL, "--chunk", CLI_LONG, &chunk, "C", .help = "tokens of a window evaluated at once", .lo = 1, .hi = 1 << 20,
         .default_text = "N"},
    };
    const cli_command cmd = {"perplexity",
                             "-m DIR -f FILE [--ctx N] [--stride S] [--max-windows K] [options]",
                             "The perplexity of the model on a text file, over sliding windows.",
                             NOTES,
                             {CLI_GROUP("options", options), cli_model_group(&model, CLI_MODEL_ALL | CLI_MODEL_LORA),
                              cli_cache_group(&cache, CLI_CACHE_BITS, NULL)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc == CLI_GO_ON)
        rc = cli_cache_get(&cache, "perplexity");
    if (rc != CLI_GO_ON)
        return rc;
    const char *dir = model.dir;
    if (!stride)
        stride = ctx;
    if (stride > ctx)
        return cli_usage_error("perplexity", "--stride (%ld) must not exceed --ctx (%ld)", stride, ctx);
    if (chunk > ctx)
        return cli_usage_error("perplexity", "--chunk (%ld) must not exceed --ctx (%ld)", chunk, ctx);

    FILE *fp = fopen(file, "rb");
    if (!fp) {
        fprintf(stderr, "exl: %s: cannot open\n", file);
        return 1;
    }
    fseek(fp, 0, SEEK_END);
    long len = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (!text || fread(text, 1, (size_t)len, fp) != (size_t)len) {
        fclose(fp);
        free(text);
        fprintf(stderr, "exl: %s: read failed\n", file);
        return 1;
    }
    fclose(fp);

    exl_tokenizer *tok = NULL;
    exl_model *m = NULL;
    exl_session *s = NULL;
    int32_t *ids = NULL, n_ids = 0;
    float *logits = NULL;
    exl_status st = exl_tokenizer_load(dir, &tok);
    if (st == EXL_OK)
        st = exl_tokenizer_encode(tok, text, (size_t)len, 1, &ids, &n_ids);
    free(text);
    cli_exact_cpu_activations();
    if (st == EXL_OK)
        st = cli_model_load(&model, &m);
    exl_model_desc d;
    if (st == EXL_OK) {
        exl_model_describe(m, &d);
        if (ctx > n_ids)
            ctx = n_ids;
        if (!chunk || chunk > ctx)
            chunk = ctx;
        st = exl_session_init_cache(m, (int32_t)ctx, cache.k_bits, cache.v_bits, &s);
    }
    if (st == EXL_OK && !(logits = malloc((size_t)chunk * d.vocab_size * sizeof *logits)))
        st = EXL_ERR_NOMEM;
    if (st != EXL_OK || n_ids < 2) {
        rc = st != EXL_OK ? cli_error(st) : (fprintf(stderr, "exl: %s: fewer than 2 tokens\n", file), 1);
        exl_session_free(s);
        exl_model_free(m);
        exl_tokenizer_free(tok);
        exl_ids_free(ids);
        free(logits);
        return rc;
    }
    long n_windows = (n_ids - ctx) / stride + 1;
    if (max_windows > 0 && n_windows > max_windows)
        n_windows = max_windows;
    double total_nll = 0;
    long scored = 0;
    long next_unscored = 1; /* global index of the first token no window has scored */
    cli_progress bar;
    cli_progress_begin(&bar, "perplexity", n_windows);
    for (long w = 0; w < n_windows && st == EXL_OK; w++) {
        long start = w * stride;
        exl_session_reset(s);
        for (long c = 0; c < ctx && st == EXL_OK; c += chunk) {
            int32_t n = (int32_t)(ctx - c < chunk ? ctx - c : chunk);
            st = exl_session_eval(s, ids + start + c, n, logits, NULL);
            /* row r predicts token start + c + r + 1 */
            for (int32_t r = 0; st == EXL_OK && r < n; r++) {
                long target = start + c + r + 1;
                if (target >= start + ctx || target < next_unscored)
                    continue;
                total_nll += nll(logits + (int64_t)r * d.vocab_size, d.vocab_size, ids[target]);
                scored++;
            }
        }
        next_unscored = start + ctx;
        char extra[64];
        snprintf(extra, sizeof extra, "ppl %.4f", scored ? exp(total_nll / scored) : 0.0);
        cli_progress_update(&bar, w + 1, extra);
    }
    cli_progress_end(&bar);
    rc = 0;
    if (st != EXL_OK) {
        rc = cli_error(st);
    } else {
        printf("tokens: %d, windows: %ld, scored: %ld\n", n_ids, n_windows, scored);
        printf("perplexity: %.6f\n", exp(total_nll / scored));
    }
    exl_session_free(s);
    exl_model_free(m);
    exl_tokenizer_free(tok);
    exl_ids_free(ids);
    free(logits);
    return rc;
}
