/* test_quantize_shared.c - the measuring pass's candidates scored together (each skipping the graph nodes whose
 * outputs the one before left) measure exactly what candidates scored one by one do (EXL_QUANT_SHARED_FORWARDS=0):
 * the same measurement.json and output.safetensors, byte for byte, on rand-qwen3 (norms of the q and k heads),
 * rand-gemma3 (post-norms, sliding layers) and rand-phi3 (fused linears split), EXL2 4.0 bpw, head 6, with 6 rows x
 * 64 tokens of tiny.utf8; and the profile shows that shared forwards ran. A suite of its own, and under ASan one
 * model: its six quantizations took most of CTest's 900 s there. */
#include "exl.h"
#include "model_util.h"
#include "test.h"

#include "base/notice.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void count_shared(void *user, const char *text) { *(int *)user += strstr(text, "cand_shared") != NULL; }

static int same_bytes(const char *dir_a, const char *dir_b, const char *name) {
    char a[1300], b[1300];
    snprintf(a, sizeof a, "%s/%s", dir_a, name);
    snprintf(b, sizeof b, "%s/%s", dir_b, name);
    size_t na = 0, nb = 0;
    char *x = mu_read_file(a, &na), *y = mu_read_file(b, &nb);
    int same = x && y && na == nb && !memcmp(x, y, na);
    free(x);
    free(y);
    return same;
}

/* Quantize `model` (EXL2 4.0 bpw, head 6; rows x length calibration tokens) with candidates scored one by one and
 * together: the same bytes, and the profile shows shared forwards. */
static void check_shared(const char *model, int32_t rows, int32_t length) {
    char out[2][1200];
    int shared_lines = 0;
    for (int shared = 0; shared < 2; shared++) {
        snprintf(out[shared], sizeof out[shared], "%s/%s-%d-%s", exl_test_tmpdir(), model, length,
                 shared ? "shared" : "single");
        exl_quantize_params p = mu_quantize_params(model, out[shared], rows, length);
        setenv("EXL_QUANT_SHARED_FORWARDS", shared ? "1" : "0", 1);
        setenv("EXL_QUANT_PROFILE", "1", 1);
        exl_notice_set_handler(count_shared, &shared_lines);
        exl_status st = exl_quantize(&p, NULL);
        exl_notice_set_handler(NULL, NULL);
        unsetenv("EXL_QUANT_SHARED_FORWARDS");
        unsetenv("EXL_QUANT_PROFILE");
        CHECK_MSG(st == EXL_OK, "%s: exl_quantize: %s", model, exl_last_error());
        if (st != EXL_OK)
            return;
        CHECK_MSG(shared || !shared_lines, "%s: EXL_QUANT_SHARED_FORWARDS=0 still shared forwards", model);
    }
    CHECK_MSG(shared_lines > 0, "%s: no profile line shows shared forwards", model);
    CHECK_MSG(same_bytes(out[0], out[1], "measurement.json"),
              "%s: shared candidate forwards measured other accuracies (%s vs %s)", model, out[1], out[0]);
    CHECK_MSG(same_bytes(out[0], out[1], "output.safetensors"), "%s: shared candidate forwards gave another output",
              model);
}

/* Under ASan+UBSan (a debug build ~40x slower here) rand-qwen3 alone: the sanitizers check the shared path's memory on
 * one model, the release run checks all three. */
#if defined(__SANITIZE_ADDRESS__)
#define SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SANITIZED 1
#endif
#endif
#ifndef SANITIZED
#define SANITIZED 0
#endif

/* Qwen3 (a Llama with norms of q and k heads), Gemma 3 (post-norms, sliding layers), Phi-3 (fused linears split). */
EXL_TEST(shared_candidate_forwards_measure_what_single_ones_do) {
    static const char *const models[] = {"rand-qwen3", "rand-gemma3", "rand-phi3"};
    for (size_t i = 0; i < (SANITIZED ? 1 : sizeof models / sizeof models[0]); i++)
        check_shared(models[i], 6, 64);
}
