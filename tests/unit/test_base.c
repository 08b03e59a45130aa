/* test_base.c - base utilities: errors, strings, fp16/bf16 conversion, thread pool, alloc failures. */
#include "backend/cpu/kernels.h"
#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"
#include "base/str.h"
#include "base/threads.h"
#include "test.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

EXL_TEST(error_messages) {
    CHECK(exl_fail(EXL_ERR_FORMAT, "%s: bad %d", "file", 3) == EXL_ERR_FORMAT);
    CHECK(!strcmp(exl_last_error(), "file: bad 3"));
    CHECK(exl_fail_prefix(EXL_ERR_IO, "loading %s", "x") == EXL_ERR_IO);
    CHECK(!strcmp(exl_last_error(), "loading x: file: bad 3"));
    char long_msg[3000];
    memset(long_msg, 'a', sizeof long_msg - 1);
    long_msg[sizeof long_msg - 1] = 0;
    exl_fail(EXL_ERR_ARG, "%s", long_msg);
    exl_fail_prefix(EXL_ERR_ARG, "p");
    CHECK(strlen(exl_last_error()) < 1024 && !strncmp(exl_last_error(), "p: aaa", 6));
    CHECK(!strcmp(exl_status_str(EXL_ERR_NOMEM), "out of memory"));
}

EXL_TEST(strings) {
    exl_str s = EXL_STR_INIT;
    CHECK(exl_str_puts(&s, "ab") == 0 && exl_str_printf(&s, "%d-%s", 42, "x") == 0 && exl_str_putc(&s, '!') == 0);
    CHECK(!strcmp(s.data, "ab42-x!") && s.len == 7);
    for (int i = 0; i < 1000; i++)
        exl_str_putc(&s, 'z');
    CHECK(s.len == 1007 && s.data[1007] == 0);
    char *d = exl_str_steal(&s);
    CHECK(d && s.data == NULL && strlen(d) == 1007);
    exl_free(d);
    exl_alloc_fail_after(0);
    CHECK(exl_str_puts(&s, "x") == -1 && s.len == 0);
    exl_alloc_fail_after(-1);
}

EXL_TEST(half_conversions_exact) {
    /* every fp16 value widens exactly and narrows back to itself */
    int bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = exl_f16_to_f32((uint16_t)h);
        if (isnan(f))
            continue;
        if (exl_f32_to_f16(f) != h)
            bad++;
    }
    CHECK_MSG(bad == 0, "%d fp16 values do not round-trip", bad);
    CHECK(exl_f16_to_f32(0x3c00) == 1.0f && exl_f16_to_f32(0xc000) == -2.0f && exl_f16_to_f32(0x0001) == 0x1p-24f);
    CHECK(exl_f32_to_f16(65520.0f) == 0x7c00 && exl_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00); /* ties to even */
    CHECK(exl_f32_to_f16(1.0f + 0x1p-11f + 0x1p-20f) == 0x3c01);
    CHECK(exl_bf16_to_f32(0x3f80) == 1.0f && exl_f32_to_bf16(1.0f) == 0x3f80);
    CHECK(exl_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80 && exl_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-16f) == 0x3f81);
}

static atomic_int hits[8];

static void count_task(void *ctx, int i, int n) {
    (void)ctx;
    atomic_fetch_add(&hits[i], n);
}

EXL_TEST(thread_pool_runs_every_index) {
    exl_pool *pool;
    REQUIRE_OK(exl_pool_init(4, &pool));
    for (int rep = 0; rep < 1000; rep++)
        exl_pool_run(pool, count_task, NULL);
    for (int i = 0; i < 4; i++)
        CHECK_MSG(atomic_load(&hits[i]) == 4000, "thread %d ran %d", i, atomic_load(&hits[i]) / 4);
    exl_pool_free(pool);
    long b, e, total = 0;
    for (int i = 0; i < 3; i++) {
        exl_split_range(100, i, 3, 8, &b, &e);
        CHECK(b % 8 == 0 && e >= b);
        total += e - b;
    }
    CHECK(total == 100);
}

EXL_TEST(simd_kernels_agree_with_scalar) {
    const char *isas[] = {"avx2", "avx512"};
    float x[4 * 203], w32[203], out_s[4], out_v[4];
    uint16_t w16[203], wbf[203];
    for (int i = 0; i < 4 * 203; i++)
        x[i] = sinf((float)i) * 0.5f;
    for (int i = 0; i < 203; i++) {
        w32[i] = cosf((float)i * 0.3f);
        w16[i] = exl_f32_to_f16(w32[i]);
        wbf[i] = exl_f32_to_bf16(w32[i]);
    }
    const exl_cpu_kernels *s = exl_cpu_kernels_named("scalar");
    for (int k = 0; k < 2; k++) {
        const exl_cpu_kernels *v = exl_cpu_kernels_named(isas[k]);
        if (!v) {
            printf("    %s not supported on this CPU: not compared\n", isas[k]);
            continue;
        }
        for (int nr = 1; nr <= 4; nr++)
            for (int len = 1; len <= 203; len += 13) {
                s->dot_f32(x, 203, nr, w32, len, out_s);
                v->dot_f32(x, 203, nr, w32, len, out_v);
                for (int r = 0; r < nr; r++)
                    CHECK(fabsf(out_s[r] - out_v[r]) <= 1e-5f * (1 + fabsf(out_s[r])));
                s->dot_f16(x, 203, nr, w16, len, out_s);
                v->dot_f16(x, 203, nr, w16, len, out_v);
                for (int r = 0; r < nr; r++)
                    CHECK(fabsf(out_s[r] - out_v[r]) <= 1e-5f * (1 + fabsf(out_s[r])));
                s->dot_bf16(x, 203, nr, wbf, len, out_s);
                v->dot_bf16(x, 203, nr, wbf, len, out_v);
                for (int r = 0; r < nr; r++)
                    CHECK(fabsf(out_s[r] - out_v[r]) <= 1e-5f * (1 + fabsf(out_s[r])));
            }
    }
}

/* The fp16 attention kernels (cpu_attention_f16.c) of every table against plain double arithmetic: scores of a
 * block of keys for 1..8 heads, the exponentials and their sum, the weighted value sums, head_dim with and without a
 * tail, partial blocks. */
EXL_TEST(fp16_attention_kernels_agree_with_double) {
    enum { HD = 80, KEYS = EXL_CPU_KEYS, HEADS = EXL_CPU_HEADS };
    static float q[HEADS * HD], acc[HEADS * HD], acc0[HEADS * HD], s[HEADS * KEYS], p[HEADS * KEYS], x[37];
    static uint16_t kv[KEYS][HD];
    const uint16_t *rows[KEYS];
    float corr[HEADS];
    for (int i = 0; i < HEADS * HD; i++)
        q[i] = sinf((float)i * 0.7f), acc0[i] = cosf((float)i * 0.11f);
    for (int i = 0; i < KEYS; i++) {
        rows[i] = kv[i];
        for (int d = 0; d < HD; d++)
            kv[i][d] = exl_f32_to_f16(cosf((float)(i * HD + d) * 0.37f));
    }
    for (int h = 0; h < HEADS; h++)
        corr[h] = 0.5f + 0.1f * (float)h;
    for (int i = 0; i < HEADS * KEYS; i++)
        p[i] = 0.01f * (float)(i % 29);
    const char *isas[] = {"scalar", "avx2", "avx512"};
    for (int t = 0; t < 3; t++) {
        const exl_cpu_kernels *v = exl_cpu_kernels_named(isas[t]);
        if (!v)
            continue;
        for (int hd = 16; hd <= HD; hd += 64 - 16) /* 16 and 64 + 16 */
            for (int nh = 1; nh <= HEADS; nh++)
                for (int n = 1; n <= KEYS; n += 5) {
                    double worst_s = 0, worst_v = 0;
                    v->scores_f16(q, nh, rows, n, hd, s);
                    memcpy(acc, acc0, sizeof acc);
                    v->values_f16(acc, nh, corr, p, rows, n, hd);
                    for (int h = 0; h < nh; h++) {
                        for (int i = 0; i < n; i++) {
                            double want = 0;
                            for (int d = 0; d < hd; d++)
                                want += (double)q[h * hd + d] * exl_f16_to_f32(kv[i][d]);
                            worst_s = fmax(worst_s, fabs(s[h * KEYS + i] - want));
                        }
                        for (int d = 0; d < hd; d++) {
                            double want = (double)acc0[h * hd + d] * corr[h];
                            for (int i = 0; i < n; i++)
                                want += (double)p[h * KEYS + i] * exl_f16_to_f32(kv[i][d]);
                            worst_v = fmax(worst_v, fabs(acc[h * hd + d] - want));
                        }
                    }
                    CHECK_MSG(worst_s < 1e-4 && worst_v < 1e-5,
                              "%s hd %d, %d heads, %d keys: scores off by %g, values %g", isas[t], hd, nh, n, worst_s,
                              worst_v);
                }
        for (int n = 1; n <= 37; n += 4) {
            for (int i = 0; i < 37; i++)
                x[i] = -20.0f + 0.6f * (float)i;
            double want_sum = 0, worst = 0;
            float arg[37]; /* x - m as the kernel computes it, in fp32 */
            for (int i = 0; i < 37; i++)
                arg[i] = x[i] - 1.5f;
            float sum = v->exp_sum(x, 1.5f, n);
            for (int i = 0; i < n; i++) {
                double e = exp((double)arg[i]);
                want_sum += e;
                worst = fmax(worst, fabs(x[i] - e) / e);
            }
            CHECK_MSG(worst < 1e-6 && fabs(sum - want_sum) < 1e-6 * want_sum, "%s exp_sum of %d: off by %g", isas[t], n,
                      worst);
        }
    }
}

/* A block kernel's every (row, column) must equal dot_* on that column bit for bit: the
 * matmul picks between them by batch size, and rows must not depend on their batch. */
EXL_TEST(block_kernels_match_dot_bitwise) {
    enum { K = 203, NC = EXL_CPU_NC };
    float x[4 * K], w32[NC * K], out_d[4], out_b[4 * NC];
    uint16_t w16[NC * K], wbf[NC * K];
    for (int i = 0; i < 4 * K; i++)
        x[i] = sinf((float)i) * 0.5f;
    for (int i = 0; i < NC * K; i++) {
        w32[i] = cosf((float)i * 0.3f);
        w16[i] = exl_f32_to_f16(w32[i]);
        wbf[i] = exl_f32_to_bf16(w32[i]);
    }
    const char *isas[] = {"scalar", "avx2", "avx512"};
    for (int t = 0; t < 3; t++) {
        const exl_cpu_kernels *v = exl_cpu_kernels_named(isas[t]);
        if (!v || !v->block_f16)
            continue;
        for (int nr = 1; nr <= 4; nr++)
            for (int len = 1; len <= K; len += 13) {
                const float *p32[NC];
                const uint16_t *p16[NC], *pbf[NC];
                for (int c = 0; c < NC; c++) {
                    p32[c] = w32 + c * K;
                    p16[c] = w16 + c * K;
                    pbf[c] = wbf + c * K;
                }
                for (int c = 0; c < NC; c++) {
                    v->block_f32(x, K, nr, p32, len, out_b);
                    v->dot_f32(x, K, nr, p32[c], len, out_d);
                    for (int r = 0; r < nr; r++)
                        CHECK(out_b[r * NC + c] == out_d[r]);
                    v->block_f16(x, K, nr, p16, len, out_b);
                    v->dot_f16(x, K, nr, p16[c], len, out_d);
                    for (int r = 0; r < nr; r++)
                        CHECK(out_b[r * NC + c] == out_d[r]);
                    v->block_bf16(x, K, nr, pbf, len, out_b);
                    v->dot_bf16(x, K, nr, pbf[c], len, out_d);
                    for (int r = 0; r < nr; r++)
                        CHECK(out_b[r * NC + c] == out_d[r]);
                }
            }
    }
}
