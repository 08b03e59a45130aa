/* test_cli.c - the exl binary end to end: logits output, info, usage and error exits. */
#include "io/safetensors.h"
#include "ref_util.h"
#include "test.h"

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

EXL_TEST(errors_exit_nonzero_with_one_line) {
    char cmd[4096], text[8192];
    struct {
        const char *args;
        int code;
        const char *needle;
    } cases[] = {
        {"info -m /nonexistent/model", 1, "/nonexistent/model/config.json: cannot open"},
        {"info", 2, "missing -m DIR"},
        {"frobnicate", 2, "unknown command"},
        {"logits -m /nonexistent --ids 1,x -o /tmp/x", 2, "comma-separated"},
        {"bench --bogus", 2, "unknown option"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(cmd, sizeof cmd, "%s %s 2>&1", EXL_CLI_PATH, cases[i].args);
        int rc = run(cmd, text, sizeof text);
        CHECK_MSG(rc == cases[i].code, "'%s' exited %d, wanted %d: %s", cases[i].args, rc, cases[i].code, text);
        CHECK_MSG(strstr(text, cases[i].needle) != NULL, "'%s' said: %s", cases[i].args, text);
    }
}

EXL_TEST(every_command_has_help) {
    const char *cmds[] = {"info", "logits", "bench", "perplexity", "tokenize"};
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
