/* cmd_logits.c - `exl logits`: the logits at every position of a token sequence. */
#include "cli.h"
#include "options.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
    cli_model_args model;
    const char *out = NULL, *ids_arg = NULL;
    const cli_option options[] = {
        {NULL, "--ids", CLI_STRING, &ids_arg, "LIST", .help = "the token ids, comma-separated (1,2,3)", .required = 1},
        {"-o", "--output", CLI_STRING, &out, "FILE", .help = "the safetensors file to write", .required = 1},
    };
    const cli_command cmd = {"logits",
                             "-m DIR --ids 1,2,3 -o OUT.safetensors [options]",
                             "Run the token ids through the model in one pass and write one fp32 tensor named\n"
                             "\"logits\" of shape [n_ids, vocab]: the logits at every position.",
                             NULL,
                             {CLI_GROUP("options", options), cli_model_group(&model, CLI_MODEL_ALL | CLI_MODEL_LORA)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc != CLI_GO_ON)
        return rc;
    int32_t *ids, n;
    if (parse_ids(ids_arg, &ids, &n))
        return cli_usage_error("logits", "--ids must be a comma-separated list of token ids");
    exl_model *m = NULL;
    exl_session *sess = NULL;
    float *logits = NULL;
    cli_exact_cpu_activations();
    exl_status st = cli_model_load(&model, &m);
    exl_model_desc d;
    if (st == EXL_OK) {
        exl_model_describe(m, &d);
        st = exl_session_init(m, n, &sess);
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
    exl_model_free(m);
    return st == EXL_OK ? 0 : cli_error(st);
}
