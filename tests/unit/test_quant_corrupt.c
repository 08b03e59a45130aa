/* test_quant_corrupt.c - broken EXL2 / GPTQ tensors give one clear error naming the
 * tensor (wrong shapes and dtypes, group tables that do not add up, permutations that
 * are not permutations, group indices out of range, unsupported widths), never a misread. */
#include "quant_util.h"
#include "test.h"

#include "base/half.h"
#include "format/quant.h"
#include "io/weights.h"

#include <stdio.h>
#include <string.h>

typedef struct {
    const char *name;
    exl_dtype dtype;
    int n_dims;
    int64_t shape[2];
    const void *data;
} tensor;

/* Write the tensors as dir/model.safetensors and load layer "l" from it. */
static exl_status load_layer(const tensor *ts, int n, exl_linear_kind kind, const exl_quant_config *q, int64_t K,
                             int64_t N) {
    const char *dir = exl_test_tmpdir();
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    exl_st_writer *w;
    exl_status st = exl_st_writer_init(&w);
    for (int i = 0; st == EXL_OK && i < n; i++)
        st = exl_st_writer_add(w, ts[i].name, ts[i].dtype, ts[i].n_dims, ts[i].shape, ts[i].data);
    if (st == EXL_OK)
        st = exl_st_writer_write(w, path);
    exl_st_writer_free(w);
    if (st != EXL_OK)
        return st;
    exl_weights *ws;
    if ((st = exl_weights_open(dir, &ws)) != EXL_OK)
        return st;
    exl_linear_src src = {0};
    src.in_features = K;
    src.out_features = N;
    src.name = "l";
    st = kind == EXL_LINEAR_EXL2 ? exl_exl2_load(ws, "l", &src) : exl_gptq_load(ws, q, "l", &src);
    exl_weights_close(ws);
    return st;
}

static void expect_error(exl_status st, exl_status want, const char *needle, const char *what) {
    CHECK_MSG(st == want, "%s: got %s (%s), expected %s", what, exl_status_str(st), exl_last_error(),
              exl_status_str(want));
    CHECK_MSG(st == EXL_OK || strstr(exl_last_error(), needle), "%s: message '%s' does not name '%s'", what,
              exl_last_error(), needle);
}

/* ---- EXL2: K 96 rows in groups 4-bit x 64 + 3-bit x 32, N 40 (padded to 64) */

#define EK 96
#define EN 40
static const int32_t ebits[] = {4, 3}, erows[] = {64, 32};

static void exl2_tensors(const tq_exl2 *t, tensor *ts) {
    ts[0] = (tensor){"l.q_weight", EXL_DTYPE_I32, 2, {t->Q, t->Np}, t->q_weight};
    ts[1] = (tensor){"l.q_invperm", EXL_DTYPE_I32, 1, {t->K}, t->q_invperm};
    ts[2] = (tensor){"l.q_scale", EXL_DTYPE_I32, 2, {t->G, t->Np / 8}, t->q_scale};
    ts[3] = (tensor){"l.q_scale_max", EXL_DTYPE_F16, 1, {t->G}, t->q_scale_max};
    ts[4] = (tensor){"l.q_groups", EXL_DTYPE_I16, 1, {2 * t->G}, t->q_groups};
}

EXL_TEST(exl2_valid_layer_loads) {
    tq_exl2 t;
    REQUIRE(tq_exl2_make(&t, EK, EN, 2, ebits, erows, 0, 1));
    tensor ts[5];
    exl2_tensors(&t, ts);
    REQUIRE_OK(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN));
    tq_exl2_free(&t);
}

EXL_TEST(exl2_wrong_shapes_and_dtypes) {
    tq_exl2 t;
    REQUIRE(tq_exl2_make(&t, EK, EN, 2, ebits, erows, 0, 2));
    tensor ts[5];
    exl2_tensors(&t, ts);
    ts[0].shape[1] = 32; /* not N padded to 32 */
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_weight", "q_weight width");
    exl2_tensors(&t, ts);
    ts[1].shape[0] = EK - 8;
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_invperm", "q_invperm length");
    exl2_tensors(&t, ts);
    ts[2].shape[0] = 1;
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_scale", "q_scale rows");
    exl2_tensors(&t, ts);
    ts[4].shape[0] = 3;
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_groups", "q_groups length");
    exl2_tensors(&t, ts);
    ts[3].dtype = EXL_DTYPE_I16;
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_scale_max",
                 "q_scale_max dtype");
    exl2_tensors(&t, ts);
    expect_error(load_layer(ts, 4, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_groups", "missing q_groups");
    tq_exl2_free(&t);
}

EXL_TEST(exl2_bad_group_tables) {
    tq_exl2 t;
    REQUIRE(tq_exl2_make(&t, EK, EN, 2, ebits, erows, 0, 3));
    tensor ts[5];
    exl2_tensors(&t, ts);
    int16_t saved[4];
    memcpy(saved, t.q_groups, sizeof saved);
    struct {
        int16_t g[4];
        exl_status want;
        const char *what;
    } cases[] = {
        {{4, 0, 3, 6}, EXL_ERR_FORMAT, "rows do not add up to in_features"},
        {{4, 0, 3, 9}, EXL_ERR_FORMAT, "group with a partial code (3-bit in 2 words)"},
        {{4, 2, 3, 8}, EXL_ERR_FORMAT, "first group not at row 0"},
        {{4, 0, 3, 20}, EXL_ERR_FORMAT, "group beyond q_weight"},
        {{4, 8, 3, 0}, EXL_ERR_FORMAT, "groups out of order"},
        {{7, 0, 3, 8}, EXL_ERR_UNSUPPORTED, "7-bit group"},
        {{4, 0, 1, 8}, EXL_ERR_UNSUPPORTED, "1-bit group"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memcpy(t.q_groups, cases[i].g, sizeof saved);
        expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), cases[i].want, "l.q_groups", cases[i].what);
    }
    memcpy(t.q_groups, saved, sizeof saved);
    tq_exl2_free(&t);
}

EXL_TEST(exl2_bad_permutations) {
    tq_exl2 t;
    REQUIRE(tq_exl2_make(&t, EK, EN, 2, ebits, erows, 0, 4));
    tensor ts[5];
    exl2_tensors(&t, ts);
    int32_t a = t.q_invperm[5];
    t.q_invperm[5] = t.q_invperm[9];
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_invperm", "repeated entry");
    t.q_invperm[5] = EK;
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_invperm", "entry = K");
    t.q_invperm[5] = -1;
    expect_error(load_layer(ts, 5, EXL_LINEAR_EXL2, NULL, EK, EN), EXL_ERR_FORMAT, "l.q_invperm", "negative entry");
    t.q_invperm[5] = a;
    tq_exl2_free(&t);
}

/* ---- GPTQ: 4-bit, K 128, N 64, groups of 32 */

#define GK 128
#define GN 64

static exl_quant_config gptq_cfg(int bits, int group_size) {
    exl_quant_config q = {0};
    q.present = 1;
    snprintf(q.method, sizeof q.method, "gptq");
    q.bits = bits;
    q.group_size = group_size;
    return q;
}

static int gptq_tensors(const tq_gptq *t, tensor *ts) {
    ts[0] = (tensor){"l.qweight", EXL_DTYPE_I32, 2, {t->K * t->bits / 32, t->N}, t->qweight};
    ts[1] = (tensor){"l.qzeros", EXL_DTYPE_I32, 2, {t->G, t->N * t->bits / 32}, t->qzeros};
    ts[2] = (tensor){"l.scales", EXL_DTYPE_F16, 2, {t->G, t->N}, t->scales};
    ts[3] = (tensor){"l.g_idx", EXL_DTYPE_I32, 1, {t->K}, t->g_idx};
    return t->g_idx ? 4 : 3;
}

EXL_TEST(gptq_valid_layer_loads) {
    tq_gptq t;
    REQUIRE(tq_gptq_make(&t, 4, GK, GN, 32, 2, 0, 0, 5));
    tensor ts[4];
    int n = gptq_tensors(&t, ts);
    exl_quant_config q = gptq_cfg(4, 32);
    REQUIRE_OK(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN));
    tq_gptq_free(&t);
}

EXL_TEST(gptq_config_disagrees_with_tensors) {
    tq_gptq t;
    REQUIRE(tq_gptq_make(&t, 4, GK, GN, 32, 1, 0, 0, 6));
    tensor ts[4];
    int n = gptq_tensors(&t, ts);
    exl_quant_config q = gptq_cfg(8, 32); /* 4-bit tensors read as 8-bit */
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_FORMAT, "l.qweight", "bits 8 vs 4");
    q = gptq_cfg(4, 64); /* groups of 64: scales should have 2 rows */
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_FORMAT, "l.scales", "group size 64 vs 32");
    q = gptq_cfg(5, 32);
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_UNSUPPORTED, "l.qweight", "5-bit GPTQ");
    q = gptq_cfg(3, 32); /* 3-bit needs whole 32-row chunks and 32-column zero rows */
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, 40), EXL_ERR_UNSUPPORTED, "l.qweight", "3-bit, N 40");
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, NULL, GK, GN), EXL_ERR_FORMAT, "l.qweight", "no config");
    tq_gptq_free(&t);
}

EXL_TEST(gptq_wrong_shapes) {
    tq_gptq t;
    REQUIRE(tq_gptq_make(&t, 4, GK, GN, 32, 1, 0, 0, 7));
    tensor ts[4];
    exl_quant_config q = gptq_cfg(4, 32);
    int n = gptq_tensors(&t, ts);
    ts[1].shape[1] = 4;
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_FORMAT, "l.qzeros", "qzeros width");
    gptq_tensors(&t, ts);
    ts[3].shape[0] = GK / 2;
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_FORMAT, "l.g_idx", "g_idx length");
    gptq_tensors(&t, ts);
    ts[2].dtype = EXL_DTYPE_F32;
    ts[2].shape[1] = GN / 2; /* same bytes, wrong dtype */
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_FORMAT, "l.scales", "scales dtype");
    tq_gptq_free(&t);
}

EXL_TEST(gptq_group_index_out_of_range) {
    tq_gptq t;
    REQUIRE(tq_gptq_make(&t, 4, GK, GN, 32, 2, 0, 0, 8));
    tensor ts[4];
    exl_quant_config q = gptq_cfg(4, 32);
    int n = gptq_tensors(&t, ts);
    int32_t a = t.g_idx[17];
    t.g_idx[17] = 4;
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_FORMAT, "l.g_idx", "g_idx = n_groups");
    t.g_idx[17] = -3;
    expect_error(load_layer(ts, n, EXL_LINEAR_GPTQ, &q, GK, GN), EXL_ERR_FORMAT, "l.g_idx", "negative g_idx");
    t.g_idx[17] = a;
    tq_gptq_free(&t);
}
