/* cmd_tokenize.c - `exl tokenize`: text on stdin to token ids on stdout. */
#include "cli.h"
#include "options.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Read all of stdin; NULL on allocation failure. */
static char *read_all(FILE *f, size_t *len) {
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        char *nb = realloc(buf, cap *= 2);
        if (!nb) {
            free(buf);
            return NULL;
        }
        buf = nb;
    }
    *len = n;
    return buf;
}

static int print_ids(const exl_tokenizer *tok, const char *text, size_t len, int special, int json) {
    int32_t *ids, n;
    exl_status st = exl_tokenizer_encode(tok, text, len, special, &ids, &n);
    if (st != EXL_OK)
        return cli_error(st);
    if (json)
        putchar('[');
    for (int32_t i = 0; i < n; i++)
        printf(i ? (json ? ", %d" : " %d") : "%d", ids[i]);
    printf(json ? "]\n" : "\n");
    exl_ids_free(ids);
    return 0;
}

static int run_jsonl(const exl_tokenizer *tok, int special) {
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    long lineno = 0;
    int rc = 0;
    while (rc == 0 && (n = getline(&line, &cap, stdin)) >= 0) {
        lineno++;
        cJSON *v = cJSON_ParseWithLength(line, (size_t)n);
        if (!cJSON_IsString(v)) {
            fprintf(stderr, "exl tokenize: stdin line %ld: expected one JSON string\n", lineno);
            rc = 1;
        } else {
            rc = print_ids(tok, v->valuestring, strlen(v->valuestring), special, 1);
        }
        cJSON_Delete(v);
    }
    free(line);
    return rc;
}

int cmd_tokenize(int argc, char **argv) {
    cli_model_args model;
    int special = 0, jsonl = 0;
    const cli_option options[] = {
        {NULL, "--special", CLI_FLAG, &special, NULL,
         .help = "add the post-processor's special tokens (BOS/EOS), as\n"
                 "tokenizer(text, add_special_tokens=True) does"},
        {NULL, "--jsonl", CLI_FLAG, &jsonl, NULL,
         .help = "every input line is one JSON string; print one JSON array of ids per line"},
    };
    const cli_command cmd = {"tokenize",
                             "-m DIR [--special] [--jsonl]",
                             "Read UTF-8 text on stdin and print its token ids, separated by spaces, on one line.\n"
                             "DIR holds tokenizer.json (or tokenizer.model) and tokenizer_config.json.",
                             NULL,
                             {CLI_GROUP("options", options), cli_model_group(&model, CLI_MODEL_DIR)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc != CLI_GO_ON)
        return rc;
    const char *dir = model.dir;
    exl_tokenizer *tok;
    exl_status st = exl_tokenizer_load(dir, &tok);
    if (st != EXL_OK)
        return cli_error(st);
    if (jsonl) {
        rc = run_jsonl(tok, special);
    } else {
        size_t len;
        char *text = read_all(stdin, &len);
        if (!text) {
            fprintf(stderr, "exl tokenize: out of memory reading stdin\n");
            rc = 1;
        } else {
            rc = print_ids(tok, text, len, special, 0);
        }
        free(text);
    }
    exl_tokenizer_free(tok);
    return rc;
}
