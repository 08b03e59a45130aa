/* test_cli.c - the exl binary end to end: logits output, info, usage and error exits, the
 * option tables (errors, generated --help, shared defaults), --version, run's token counts. */
#include "io/safetensors.h"
#include "ref_util.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Run a shell command; returns its exit code and captures stdout+stderr (static buffer). */
static int run(const char *cmd, char *out, size_t cap) {
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = fread(out, 1, cap - 1, p);
    out[n] = 0;
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

EXL_TEST(logits_command_matches_reference) {
    char dir[1024], out[1024], cmd[4096], text[8192];
    snprintf(dir, sizeof dir, "%s", exl_test_shared("models/rand-llama"));
    snprintf(out, sizeof out, "%s/logits.safetensors", exl_test_tmpdir());
    exl_st_file *ref;
    REQUIRE_OK(exl_st_open(exl_test_shared("reference/rand-llama.logits.safetensors"), &ref));
    const exl_st_tensor *ids = exl_st_find(ref, "ids_a"), *want = exl_st_find(ref, "logits_a");
    REQUIRE(ids && want);
    int len = snprintf(cmd, sizeof cmd, "%s logits -m %s -o %s --device cpu --ids ", EXL_CLI_PATH, dir, out);
    for (int i = 0; i < ids->shape[0]; i++)
        len += snprintf(cmd + len, sizeof cmd - (size_t)len, "%s%d", i ? "," : "", ((const int32_t *)ids->data)[i]);
    snprintf(cmd + len, sizeof cmd - (size_t)len, " 2>&1");
    CHECK_MSG(run(cmd, text, sizeof text) == 0, "exl logits failed: %s", text);
    exl_st_file *got;
    REQUIRE_OK(exl_st_open(out, &got));
    const exl_st_tensor *lg = exl_st_find(got, "logits");
    REQUIRE(lg && lg->dtype == EXL_DTYPE_F32 && lg->n_dims == 2);
    CHECK(lg->shape[0] == ids->shape[0] && lg->shape[1] == 2048);
    double e = ref_rel_err(lg->data, want->data, exl_st_numel(want));
    CHECK_MSG(e <= 1e-4, "logits command: rel err %.3e", e);
    exl_st_close(got);
    exl_st_close(ref);
}

EXL_TEST(info_describes_model) {
    char cmd[4096], text[8192];
    snprintf(cmd, sizeof cmd, "%s info -m %s 2>&1", EXL_CLI_PATH, exl_test_shared("models/rand-qwen2"));
    CHECK(run(cmd, text, sizeof text) == 0);
    CHECK_MSG(strstr(text, "architecture: qwen2") && strstr(text, "q/k/v bias") && strstr(text, "tied"),
              "info output: %s", text);
    CHECK_MSG(strstr(text, "parameters:") && strstr(text, "memory:"), "info output: %s", text);
}

/* The line of text that starts with "  <key> ", its runs of spaces made one ("" if none). */
static const char *line_of(const char *text, const char *key, char *out, size_t cap) {
    char start[128];
    snprintf(start, sizeof start, "\n  %s ", key);
    const char *p = strstr(text, start);
    size_t n = 0;
    for (p = p ? p + 3 : ""; *p && *p != '\n' && n + 1 < cap; p++)
        if (*p != ' ' || (n && out[n - 1] != ' '))
            out[n++] = *p;
    out[n] = 0;
    return out;
}

/* `exl info` groups the linear layers by kind; --verbose lists each (exl_model_report's form). */
EXL_TEST(info_groups_linear_layers) {
    char cmd[4096], grouped[16384], verbose[16384], line[256];
    const char *model = exl_test_shared("models/rand-llama-exl2-3.0bpw-h6");
    snprintf(cmd, sizeof cmd, "%s info -m %s 2>&1", EXL_CLI_PATH, model);
    REQUIRE(run(cmd, grouped, sizeof grouped) == 0);
    snprintf(cmd, sizeof cmd, "%s info -m %s --verbose 2>&1", EXL_CLI_PATH, model);
    REQUIRE(run(cmd, verbose, sizeof verbose) == 0);
    /* kind, count, format, shape, bits per weight (the two layers' q_proj: 4.440 and 2.440), code widths, size */
    const char *want[] = {"self_attn.q_proj 2 EXL2 256 x 256 2.44-4.44 2-5 55.0 KiB",
                          "mlp.down_proj 2 EXL2 768 x 256 3.423 3-5 164.3 KiB",
                          "lm_head 1 EXL2 256 x 2048 7.047 6-8 451.0 KiB"};
    for (int i = 0; i < 3; i++) {
        char key[64];
        snprintf(key, sizeof key, "%.*s", (int)strcspn(want[i], " "), want[i]);
        CHECK_MSG(!strcmp(line_of(grouped, key, line, sizeof line), want[i]), "want '%s', got '%s' in:\n%s", want[i],
                  line, grouped);
    }
    CHECK_MSG(!strstr(grouped, "model.layers.") && strstr(verbose, "model.layers.1.mlp.down_proj "), "%s", grouped);
    const char *summary = "bits/weight:  2.991 decoder layers, 7.047 head, 4.005 all linear layers\n";
    CHECK(strstr(grouped, summary) && strstr(verbose, summary));
    CHECK(strstr(grouped, "memory:") && strstr(verbose, "memory:"));
}

EXL_TEST(errors_exit_nonzero_with_one_line) {
    char cmd[4096], text[8192];
    struct {
        const char *args;
        int code;
        const char *needle;
    } cases[] = {
        {"info -m /nonexistent/model", 1, "/nonexistent/model/config.json: cannot open"},
        {"info -m", 2, "-m needs a value (DIR)"},
        {"frobnicate", 2, "unknown command"},
        {"logits -m /nonexistent --ids 1,x -o /tmp/x", 2, "comma-separated"},
        {"bench --bogus", 2, "unknown option"},
        {"run -m /x -p", 2, "-p needs a value (TEXT)"},
        {"run -m /x", 2, "missing -p TEXT"},
        {"run -m /x -p hi -n 0", 2, "-n needs an integer in 1..16777216, not '0'"},
        {"run -m /x -p hi --top-p=2", 2, "--top-p needs a number in 0..1, not '2'"},
        {"chat -m /x --greedy=1", 2, "--greedy takes no value"},
        {"serve -m /x --device tpu", 2, "unknown device 'tpu'"},
        {"quantize -i /a -o /b --format exl3", 2, "--format needs one of exl2|gptq, not 'exl3'"},
        {"tokenize -m /x stray", 2, "unexpected argument 'stray'"},
        {"version --bogus", 2, "unknown option '--bogus'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s %s 2>&1", EXL_CLI_PATH, cases[i].args);
        int rc = run(cmd, text, sizeof text);
        CHECK_MSG(rc == cases[i].code, "'%s' exited %d, wanted %d: %s", cases[i].args, rc, cases[i].code, text);
        CHECK_MSG(strstr(text, cases[i].needle) != NULL, "'%s' said: %s", cases[i].args, text);
    }
}

EXL_TEST(every_command_has_help) {
    const char *cmds[] = {"info", "logits", "bench", "perplexity", "tokenize",
                          "run",  "chat",   "serve", "quantize",   "version"};
    char cmd[4096], text[8192];
    for (size_t i = 0; i < sizeof cmds / sizeof cmds[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s %s --help 2>&1", EXL_CLI_PATH, cmds[i]);
        CHECK_MSG(run(cmd, text, sizeof text) == 0 && strstr(text, "usage: exl"), "%s --help: %s", cmds[i], text);
    }
}

EXL_TEST(perplexity_protocol_counts) {
    char cmd[4096], text[8192], model[1024];
    snprintf(model, sizeof model, "%s", exl_test_shared("models/tinystories-656k"));
    snprintf(cmd, sizeof cmd, "%s perplexity -m %s -f %s --ctx 64 --stride 32 --max-windows 5 --device cpu 2>&1",
             EXL_CLI_PATH, model, exl_test_shared("data/tinystories_val.txt"));
    REQUIRE(run(cmd, text, sizeof text) == 0);
    /* first window 63 predictions, then 32 new tokens for each of 4 more windows */
    CHECK_MSG(strstr(text, "windows: 5, scored: 191"), "perplexity output: %s", text);
    const char *p = strstr(text, "perplexity: ");
    REQUIRE(p);
    double v = atof(p + 12);
    CHECK_MSG(v > 1 && v < 200, "implausible perplexity %f", v);
}

/* The lines of one --help from `from` to the next blank line or the end. */
static const char *help_group(char *text, const char *from) {
    char *a = strstr(text, from);
    if (!a)
        return "";
    char *b = strstr(a, "\n\n");
    if (b)
        b[1] = 0;
    return a;
}

/* --help comes from the option tables: run and chat show the same sampling group, whose defaults
 * are the library's (exl_sampling_default, the server's too), and -h anywhere asks for it. */
EXL_TEST(help_is_generated_from_the_tables) {
    char cmd[4096], run_help[8192], chat_help[8192], want[256];
    snprintf(cmd, sizeof cmd, "%s run --help 2>&1", EXL_CLI_PATH);
    REQUIRE(run(cmd, run_help, sizeof run_help) == 0);
    snprintf(cmd, sizeof cmd, "%s chat -m /nonexistent -n 5 -h 2>&1", EXL_CLI_PATH);
    REQUIRE(run(cmd, chat_help, sizeof chat_help) == 0);
    CHECK_MSG(strstr(run_help, "usage: exl run -m DIR -p TEXT") && strstr(run_help, "  -p, --prompt TEXT") &&
                  strstr(run_help, "  -m, --model DIR") && strstr(run_help, "(default 128)"),
              "%s", run_help);
    exl_sampling d = exl_sampling_default();
    snprintf(want, sizeof want, "  --temperature T         0 = greedy (default %g)\n", (double)d.temperature);
    CHECK_MSG(strstr(run_help, want), "want '%s' in:\n%s", want, run_help);
    snprintf(want, sizeof want, "1 = off (default %g)\n", (double)d.top_p);
    CHECK_MSG(strstr(run_help, want), "want '%s' in:\n%s", want, run_help);
    CHECK_MSG(strstr(run_help, "stop token") && strstr(run_help, "--stats counts"), "%s", run_help);
    const char *a = help_group(run_help, "sampling options"), *b = help_group(chat_help, "sampling options");
    CHECK_MSG(*a && !strcmp(a, b), "run and chat differ:\n%s\n---\n%s", a, b);
}

EXL_TEST(version_from_exl_h) {
    char cmd[4096], text[256], want[64];
    snprintf(want, sizeof want, "exl %s\n", EXL_VERSION_STRING);
    const char *forms[] = {"--version", "version"};
    for (int i = 0; i < 2; i++) {
        snprintf(cmd, sizeof cmd, "%s %s 2>&1", EXL_CLI_PATH, forms[i]);
        CHECK(run(cmd, text, sizeof text) == 0);
        CHECK_MSG(!strcmp(text, want), "exl %s: '%s'", forms[i], text);
    }
    snprintf(want, sizeof want, "%d.%d.%d", EXL_VERSION_MAJOR, EXL_VERSION_MINOR, EXL_VERSION_PATCH);
    CHECK(!strcmp(want, EXL_VERSION_STRING));
}

/* The rule `exl run --help` states: the stop token that ends a completion is generated: the
 * last of --json's tokens and counted by --stats (the server's usage agrees: test_openai.py). */
EXL_TEST(run_counts_the_stop_token) {
    char cmd[4096], text[16384], err[4096], errfile[1024];
    const char *model = exl_test_shared("models/tinystories-656k");
    snprintf(errfile, sizeof errfile, "%s/stderr", exl_test_tmpdir());
    snprintf(cmd, sizeof cmd, "%s run -m %s -p 'Once upon a time' --greedy -n 300 --json --stats -t 1 2>%s",
             EXL_CLI_PATH, model, errfile);
    REQUIRE(run(cmd, text, sizeof text) == 0);
    cJSON *o = cJSON_Parse(text);
    REQUIRE(o);
    const cJSON *tokens = cJSON_GetObjectItem(o, "tokens");
    int n = cJSON_GetArraySize(tokens);
    exl_tokenizer *tok;
    REQUIRE_OK(exl_tokenizer_load(model, &tok));
    CHECK_MSG(!strcmp(cJSON_GetObjectItem(o, "finish_reason")->valuestring, "stop") && n > 0 && n < 300 &&
                  cJSON_GetArrayItem(tokens, n - 1)->valueint == exl_tokenizer_eos_id(tok),
              "%s", text);
    exl_tokenizer_free(tok);
    cJSON_Delete(o);
    FILE *f = fopen(errfile, "r");
    REQUIRE(f);
    size_t got = fread(err, 1, sizeof err - 1, f);
    err[got] = 0;
    fclose(f);
    char want[64];
    snprintf(want, sizeof want, "exl run: %d tokens generated", n);
    CHECK_MSG(strstr(err, want) != NULL, "want '%s': %s", want, err);
}
