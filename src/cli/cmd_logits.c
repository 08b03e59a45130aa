/* cmd_logits.c - `exl logits`: the logits at every position of a token sequence. */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void help(void) {
    printf("usage: exl logits -m DIR --ids 1,2,3 -o OUT.safetensors [--device cpu|cuda|auto] [-t THREADS]\n\n"
           "Run the token ids through the model in one pass and write one fp32 tensor named\n"
           "\"logits\" of shape [n_ids, vocab]: the logits at every position.\n");
}

static int parse_ids(const char *s, int32_t **ids, int32_t *n) {
    int32_t cap = 16, count = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    while (v && *s) {
        char *end;
        long x = strtol(s, &end, 10);
        if (end == s || x < 0 || x > 0x7fffffff || (*end && *end != ','))
            break;
        if (count == cap) {
            int32_t *nv = realloc(v, (size_t)(cap *= 2) * sizeof *v);
            if (!nv)
                break;
            v = nv;
        }
        v[count++] = (int32_t)x;
        s = *end ? end + 1 : end;
    }
    if (!v || *s || !count) {
        free(v);
        return -1;
    }
    *ids = v;
    *n = count;
    return 0;
}

int cmd_logits(int argc, char **argv) {
    const char *dir = NULL, *out = NULL, *ids_arg = NULL;
    exl_model_params p = exl_model_default_params();
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int opt;
        int has = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            help();
            return 0;
        } else if ((opt = cli_model_option("logits", argc, argv, &i, &dir, &p)) != 0) {
            if (opt < 0)
                return 2;
        } else if (!strcmp(a, "--ids") && has) {
            ids_arg = argv[++i];
        } else if ((!strcmp(a, "-o") || !strcmp(a, "--output")) && has) {
            out = argv[++i];
        } else {
            return cli_usage_error("logits", "unknown option or missing value '%s'", a);
        }
    }
    if (!dir || !out || !ids_arg)
        return cli_usage_error("logits", "need -m DIR, --ids LIST and -o FILE");
    int32_t *ids, n;
    if (parse_ids(ids_arg, &ids, &n))
        return cli_usage_error("logits", "--ids must be a comma-separated list of token ids");
    exl_model *model = NULL;
    exl_session *sess = NULL;
    float *logits = NULL;
    exl_status st = exl_model_load(dir, &p, &model);
    exl_model_desc d;
    if (st == EXL_OK) {
        exl_model_describe(model, &d);
        st = exl_session_init(model, n, &sess);
    }
    if (st == EXL_OK) {
        logits = malloc((size_t)n * d.vocab_size * sizeof *logits);
        st = logits ? exl_session_eval(sess, ids, n, logits, NULL) : EXL_ERR_NOMEM;
    }
    if (st == EXL_OK)
        st = exl_tensor_save(out, "logits", logits, n, d.vocab_size);
    free(logits);
    free(ids);
    exl_session_free(sess);
    exl_model_free(model);
    return st == EXL_OK ? 0 : cli_error(st);
}
