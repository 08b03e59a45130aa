/* test_quantize_device.c - GPTQ on a backend that is not the CPU, run here on the CPU backend under another op table
 * (so it counts as not the CPU, its memory being the host's), against the host's own path. EXL2 where the backend
 * has the qz_exl2_scales and qz_rows ops (a GPU): gptq.c's device path (W up once, scales and rows there, the
 * updates by the backend's gemm, the results down at the end) with the two ops written out as cuda_gptq.cu's
 * kernels compute them, one column at a time, and gemm the host's update kernel: the same codes, scales and
 * weights. GPTQ's scales with the rows kept there (the rounding the host's): the same codes and weights. test_gpu's
 * quantize group runs the CUDA kernels against the host. */
#include "test.h"

#include "base/half.h"
#include "convert/qz.h"
#include "format/exl2.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static float f16_round(float x) { return exl_f16_to_f32(exl_f32_to_f16(x)); }

static float tried_max(float smax, int t) { return f16_round((smax > 0 ? smax : 1e-6f) * (0.65f + 0.025f * (float)t)); }

/* cuda_gptq.cu's exl2_ideal_kernel, exl2_try_kernel and exl2_pick_kernel, one column at a time */
static exl_status ref_exl2_scales(exl_backend *be, const float *W, int64_t N, int32_t rows, int32_t bits,
                                  uint8_t *scale_codes, uint16_t *scale_max, float *scale, float *zero) {
    (void)be;
    enum { TRIES = EXL_EXL2_SCALE_TRIES, CANDS = EXL_EXL2_SCALE_CANDS, COARSE = EXL_EXL2_SCALE_COARSE };
    float *ideal = malloc(sizeof(float) * (size_t)N), smax = 0, mid = (float)(1 << (bits - 1));
    uint8_t *codes = malloc((size_t)(N * TRIES));
    if (!ideal || !codes) {
        free(ideal), free(codes);
        return EXL_ERR_NOMEM;
    }
    for (int64_t n = 0; n < N; n++) {
        float lo = 0, hi = 0;
        for (int32_t r = 0; r < rows; r++) {
            float w = W[r * N + n];
            lo = w < lo ? w : lo;
            hi = w > hi ? w : hi;
        }
        float s1 = hi / (mid - 1.0f), s2 = -lo / mid;
        ideal[n] = s1 > s2 ? s1 : s2;
        smax = ideal[n] > smax ? ideal[n] : smax;
    }
    double total[TRIES] = {0};
    const float magic = 12582912.0f, z = mid, maxq = (float)((1 << bits) - 1);
    for (int t = 0; t < TRIES; t++) {
        float smf = tried_max(smax, t);
        for (int64_t n = 0; n < N; n++) {
            int c0 = (int)nearbyintf(16.0f * sqrtf(ideal[n] / smf)) - 1;
            float s[CANDS], inv[CANDS], e[CANDS];
            for (int j = 0; j < CANDS; j++) {
                int k = c0 - 2 + j;
                s[j] = exl_exl2_scale(exl_f32_to_f16(smf), (uint32_t)(k < 0 ? 0 : k > 15 ? 15 : k));
                inv[j] = s[j] != 0.0f ? 1.0f / s[j] : 0.0f;
                e[j] = 0;
            }
            for (int32_t r = 0; r < rows; r++) {
                float x = W[r * N + n];
                for (int j = 0; j < CANDS; j++) {
                    float q = (fmaf(x, inv[j], magic) - magic) + z;
                    q = q < 0.0f ? 0.0f : q > maxq ? maxq : q;
                    float d = fmaf(-(q - z), s[j], x);
                    e[j] = fmaf(d, d, e[j]);
                }
            }
            float best = INFINITY;
            int best_c = 15;
            for (int j = 0; j < CANDS; j++) {
                int k = c0 - 2 + j;
                if (k >= 0 && k <= 15 && e[j] < best)
                    best = e[j], best_c = k;
            }
            codes[t * N + n] = (uint8_t)best_c;
            total[t] += best;
        }
    }
    int best = 0, tried[TRIES] = {0};
    double best_err = INFINITY;
    for (int round = 0; round < 2; round++) {
        int list[TRIES], n_try = 0;
        for (int t = 0; t < TRIES; t++)
            if (!tried[t] && (round ? t > best - COARSE && t < best + COARSE : t % COARSE == COARSE / 2))
                list[n_try++] = t, tried[t] = 1;
        for (int i = 0; i < n_try; i++)
            if (total[list[i]] < best_err || (total[list[i]] == best_err && list[i] < best))
                best_err = total[list[i]], best = list[i];
    }
    *scale_max = exl_f32_to_f16(tried_max(smax, best));
    for (int64_t n = 0; n < N; n++) {
        scale_codes[n] = codes[best * N + n];
        scale[n] = exl_exl2_scale(*scale_max, scale_codes[n]);
        zero[n] = mid;
    }
    free(ideal), free(codes);
    return EXL_OK;
}

/* cuda_gptq.cu's gptq_rows_kernel: a column's rows take the earlier rows' errors in order */
static exl_status ref_rows(exl_backend *be, float *W, const float *U, int64_t ldu, int64_t N, int32_t rows,
                           const float *scale, const float *zero, int32_t bits, uint8_t *codes, float *E) {
    (void)be;
    float maxq = (float)((1 << bits) - 1);
    for (int64_t n = 0; n < N; n++)
        for (int32_t i = 0; i < rows; i++) {
            float w = W[i * N + n], s = scale[n], z = zero[n];
            for (int32_t p = 0; p < i; p++)
                w -= U[p * ldu + i] * E[p * N + n];
            float q = s != 0.0f ? nearbyintf(w / s) + z : z;
            q = q < 0.0f ? 0.0f : q > maxq ? maxq : q;
            float dq = (q - z) * s;
            codes[i * N + n] = (uint8_t)q;
            W[i * N + n] = dq;
            E[i * N + n] = (w - dq) / U[i * ldu + i];
        }
    return EXL_OK;
}

/* The updates of the device path through the host path's own kernel (exl_qz_atb), so both products are the same */
static exl_pool *atb_pool;

static exl_status atb_gemm(exl_backend *be, int trans_a, int trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                           const float *A, int64_t lda, const float *B, int64_t ldb, float beta, float *C,
                           int64_t ldc) {
    (void)be;
    if (!trans_a || trans_b || beta != 1.0f)
        return EXL_ERR_ARG;
    exl_qz_atb(atb_pool, M, N, K, alpha, A, lda, B, ldb, C, ldc, 0);
    return EXL_OK;
}

static void fill(float *v, int64_t n, uint32_t *seed, float scale, int spread) {
    for (int64_t i = 0; i < n; i++) {
        *seed = *seed * 1664525u + 1013904223u;
        v[i] = ((float)(*seed >> 8) / (float)(1u << 24) - 0.5f) * scale * (float)(1 + (spread ? i % spread : 0));
    }
}

/* A GPTQ problem of K inputs and N columns on the CPU backend: the Hessian of ROWS random calibration rows, its
 * inverse's factor, random weights W; ready says the setup went through. */
typedef struct gptq_case {
    exl_pool *pool;
    exl_backend *be;
    exl_hessian h;
    exl_qz_hinv hi;
    float *W;
    int ready;
} gptq_case;

static void gptq_case_init(gptq_case *c, int32_t K, int32_t N, int32_t ROWS, uint32_t seed, int spread) {
    memset(c, 0, sizeof *c);
    float *x = malloc(sizeof(float) * ROWS * K);
    c->W = malloc(sizeof(float) * K * N);
    REQUIRE(x && c->W);
    fill(x, (int64_t)ROWS * K, &seed, 1.0f, spread);
    fill(c->W, (int64_t)K * N, &seed, 0.05f, 0);
    REQUIRE_OK(exl_pool_init(2, &c->pool));
    REQUIRE_OK(exl_backend_cpu_init(2, &c->be));
    REQUIRE_OK(exl_hessian_init(&c->h, K));
    REQUIRE_OK(exl_hessian_add(&c->h, x, ROWS, c->be));
    exl_hessian_finish(&c->h);
    free(x);
    REQUIRE_OK(exl_gptq_prepare(&c->h, 1, c->pool, NULL, &c->hi));
    c->ready = 1;
}

static void gptq_case_free(gptq_case *c) {
    exl_hessian_free(&c->h);
    if (c->pool)
        exl_pool_free(c->pool);
    if (c->be)
        c->be->ops->destroy(c->be);
    free(c->W);
}

/* Groups of 6, 4 and 3 bits (32, 64 and 128 rows, the last of 96: blocks and groups both end mid-way); codes,
 * scales and weights equal (the updates are the same products, exl_qz_atb's). */
EXL_TEST(exl2_gptq_on_a_device_backend_matches_the_host) {
    enum { K = 640, N = 200, ROWS = 1300 };
    gptq_case c;
    gptq_case_init(&c, K, N, ROWS, 5, 7);
    if (!c.ready) {
        gptq_case_free(&c);
        return;
    }
    exl_pool *pool = c.pool;
    exl_backend *be = c.be;
    const float *W = c.W;
    int32_t bits[] = {6, 6, 4, 4, 3, 3, 3, 3}, rows[] = {32, 32, 64, 64, 128, 128, 96, 96};
    exl_qz_layout l = {8, bits, rows};
    exl_qz_result host, dev;
    REQUIRE_OK(exl_gptq_quantize(W, &c.hi, N, EXL_QZ_EXL2, &l, pool, be, &host));
    const exl_backend_ops *cpu_ops = be->ops;
    exl_backend_ops other = *cpu_ops;
    other.qz_exl2_scales = ref_exl2_scales;
    other.qz_rows = ref_rows;
    other.gemm = atb_gemm;
    atb_pool = pool;
    be->ops = &other;
    exl_status st = exl_gptq_quantize(W, &c.hi, N, EXL_QZ_EXL2, &l, pool, be, &dev);
    exl_qz_hinv_free(&c.hi); /* the backend's copies, freed through the op table that made them */
    be->ops = cpu_ops;
    REQUIRE_OK(st);
    CHECK(!memcmp(host.scale_max, dev.scale_max, sizeof(uint16_t) * 8));
    CHECK(!memcmp(host.scale_codes, dev.scale_codes, (size_t)8 * N));
    int64_t same = 0;
    for (int64_t i = 0; i < (int64_t)K * N; i++)
        same += host.codes[i] == dev.codes[i];
    CHECK_MSG(same == (int64_t)K * N, "%lld of %d codes differ", (long long)((int64_t)K * N - same), K * N);
    CHECK(!memcmp(host.Wq, dev.Wq, sizeof(float) * K * N));
    exl_qz_result_free(&host);
    exl_qz_result_free(&dev);
    gptq_case_free(&c);
}

/* GPTQ's scales (4-bit g128, symmetric) with the rows kept on the backend (gptq.c: they stay there, blocks come
 * down, the updates are the backend's gemm): the same codes and weights as the host's path, bit for bit. */
EXL_TEST(gptq_updates_on_a_device_backend_match_the_host) {
    enum { K = 640, N = 384, ROWS = 1300, GS = 128 };
    gptq_case c;
    gptq_case_init(&c, K, N, ROWS, 11, 5);
    if (!c.ready) {
        gptq_case_free(&c);
        return;
    }
    exl_pool *pool = c.pool;
    exl_backend *be = c.be;
    const float *W = c.W;
    int32_t bits[K / GS], rows[K / GS];
    for (int g = 0; g < K / GS; g++)
        bits[g] = 4, rows[g] = GS;
    exl_qz_layout l = {K / GS, bits, rows};
    exl_qz_result host, dev;
    REQUIRE_OK(exl_gptq_quantize(W, &c.hi, N, EXL_QZ_GPTQ_SYM, &l, pool, be, &host));
    const exl_backend_ops *cpu_ops = be->ops;
    exl_backend_ops other = *cpu_ops;
    other.gemm = atb_gemm;
    atb_pool = pool;
    be->ops = &other;
    exl_status st = exl_gptq_quantize(W, &c.hi, N, EXL_QZ_GPTQ_SYM, &l, pool, be, &dev);
    exl_qz_hinv_free(&c.hi); /* U's backend copy, freed through the op table that made it */
    be->ops = cpu_ops;
    REQUIRE_OK(st);
    CHECK(!memcmp(host.codes, dev.codes, (size_t)K * N));
    CHECK(!memcmp(host.Wq, dev.Wq, sizeof(float) * K * N));
    exl_qz_result_free(&host);
    exl_qz_result_free(&dev);
    gptq_case_free(&c);
}

/* qz_factor as the op defines it, unblocked in double (cuda_gptq_factor.cu blocks it through cuBLAS); the first
 * fail_first calls report "not positive definite", and every damping asked for is recorded. */
static int factor_fail_first, factor_calls;
static double factor_damps[8];

static exl_status ref_factor(exl_backend *be, float *U, const float *H, const int32_t *perm, int64_t K, double damp,
                             int *ok) {
    (void)be;
    if (factor_calls < 8)
        factor_damps[factor_calls] = damp;
    *ok = 0;
    if (factor_calls++ < factor_fail_first)
        return EXL_OK;
    double *L = calloc((size_t)(K * K), sizeof(double)), *X = calloc((size_t)(K * K), sizeof(double));
    if (!L || !X) {
        free(L), free(X);
        return EXL_ERR_NOMEM;
    }
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j <= i; j++)
            L[i * K + j] = (double)H[(int64_t)perm[K - 1 - i] * K + perm[K - 1 - j]] + (i == j ? damp : 0.0);
    int pd = 1;
    for (int64_t j = 0; j < K && pd; j++) {
        double d = L[j * K + j];
        for (int64_t p = 0; p < j; p++)
            d -= L[j * K + p] * L[j * K + p];
        pd = d > 0;
        d = sqrt(d);
        L[j * K + j] = d;
        for (int64_t i = j + 1; i < K; i++) {
            double s = L[i * K + j];
            for (int64_t p = 0; p < j; p++)
                s -= L[i * K + p] * L[j * K + p];
            L[i * K + j] = s / d;
        }
    }
    for (int64_t c = 0; c < K && pd; c++) /* column c of L⁻¹ by forward substitution */
        for (int64_t i = c; i < K; i++) {
            double s = i == c ? 1.0 : 0.0;
            for (int64_t p = c; p < i; p++)
                s -= L[i * K + p] * X[p * K + c];
            X[i * K + c] = s / L[i * K + i];
        }
    for (int64_t i = 0; i < K && pd; i++)
        for (int64_t j = 0; j < K; j++)
            U[(K - 1 - i) * K + (K - 1 - j)] = j <= i ? (float)X[i * K + j] : 0.0f;
    *ok = pd;
    free(L), free(X);
    return EXL_OK;
}

/* gptq.c's factor on a backend with qz_factor (the op above) against the host's blocked factor: the same U up to the
 * order of the double sums (1e-6 of its largest value), the same order of rows; a backend that reports "not positive
 * definite" twice is asked again with 4x, then 16x the damping, as the host's loop damps. */
EXL_TEST(gptq_factor_on_a_device_backend_matches_the_host) {
    enum { K = 200, N = 40, ROWS = 300 };
    gptq_case c;
    gptq_case_init(&c, K, N, ROWS, 7, 5);
    if (!c.ready) {
        gptq_case_free(&c);
        return;
    }
    const exl_backend_ops *cpu_ops = c.be->ops;
    exl_backend_ops other = *cpu_ops;
    other.qz_factor = ref_factor;
    exl_qz_hinv dev;
    for (int fail = 0; fail <= 2; fail += 2) {
        factor_fail_first = fail;
        factor_calls = 0;
        c.be->ops = &other;
        exl_status st = exl_gptq_prepare(&c.h, 1, c.pool, c.be, &dev);
        REQUIRE_OK(st);
        CHECK(!memcmp(dev.perm, c.hi.perm, sizeof(int32_t) * K));
        double d = 0, m = 0;
        for (int64_t i = 0; i < (int64_t)K * K; i++) {
            d = fmax(d, fabs((double)dev.U[i] - c.hi.U[i]));
            m = fmax(m, fabs((double)c.hi.U[i]));
        }
        if (!fail)
            CHECK_MSG(d <= 1e-6 * m, "U differs by %g of %g", d, m);
        CHECK(factor_calls == fail + 1);
        for (int i = 1; i < factor_calls; i++)
            CHECK(fabs(factor_damps[i] - 4 * factor_damps[i - 1]) <= 1e-12 * factor_damps[i]);
        exl_qz_hinv_free(&dev);
        c.be->ops = cpu_ops;
    }
    exl_qz_hinv_free(&c.hi);
    gptq_case_free(&c);
}

/* qz_set_trial as the op defines it, into the CPU's fp32 trial weights [N, K] (the trial's own buffer, trial_wt) */
static float *trial_wt;
static int64_t trial_K, trial_N;

static exl_status ref_set_trial(exl_backend *be, exl_linear *w, const float *W, const int32_t *perm) {
    (void)be, (void)w;
    for (int64_t r = 0; r < trial_K; r++)
        for (int64_t n = 0; n < trial_N; n++)
            trial_wt[n * trial_K + perm[r]] = W[r * trial_N + n];
    return EXL_OK;
}

/* exl_gptq_quantize_trial (W kept on the backend, gathered into act-order there, the weights written into the trial
 * linear there) on the CPU backend under the ops written out as the kernels compute them: the host's Wq, bit for bit,
 * for two recipes in a row from the kept copy of W. */
EXL_TEST(exl2_trial_weights_on_a_device_backend_match_the_host) {
    enum { K = 384, N = 96, ROWS = 800 };
    gptq_case c;
    gptq_case_init(&c, K, N, ROWS, 13, 3);
    if (!c.ready) {
        gptq_case_free(&c);
        return;
    }
    const exl_backend_ops *cpu_ops = c.be->ops;
    exl_backend_ops other = *cpu_ops;
    other.qz_exl2_scales = ref_exl2_scales;
    other.qz_rows = ref_rows;
    other.gemm = atb_gemm;
    other.qz_set_trial = ref_set_trial;
    atb_pool = c.pool;
    exl_linear_src like = {0};
    like.kind = EXL_LINEAR_DENSE;
    like.in_features = K;
    like.out_features = N;
    exl_qz_trial t = {0};
    REQUIRE_OK(exl_qz_trial_init(c.be, c.pool, c.W, &like, &t));
    trial_wt = t.wt;
    trial_K = K;
    trial_N = N;
    for (int recipe = 0; recipe < 2; recipe++) {
        int32_t bits[] = {6, 4, 4, 3, 3}, rows[] = {32, 64, 96, 128, 64}, bits1[] = {4, 4, 4},
                rows1[] = {128, 128, 128};
        exl_qz_layout l = recipe ? (exl_qz_layout){3, bits1, rows1} : (exl_qz_layout){5, bits, rows};
        exl_qz_result host;
        REQUIRE_OK(exl_gptq_quantize(c.W, &c.hi, N, EXL_QZ_EXL2, &l, c.pool, c.be, &host));
        c.be->ops = &other;
        CHECK(exl_gptq_trial_on_device(c.be));
        exl_status st = exl_gptq_quantize_trial(c.W, &c.hi, N, &l, c.be, t.w);
        c.be->ops = cpu_ops;
        REQUIRE_OK(st);
        int64_t diff = 0;
        for (int64_t k = 0; k < K; k++)
            for (int64_t n = 0; n < N; n++)
                diff += memcmp(&trial_wt[n * K + k], &host.Wq[k * N + n], sizeof(float)) != 0;
        CHECK_MSG(diff == 0, "recipe %d: %lld of %d weights differ", recipe, (long long)diff, K * N);
        exl_qz_result_free(&host);
    }
    c.be->ops = &other;
    exl_qz_hinv_free(&c.hi); /* the backend's copies, freed through the op table that made them */
    c.be->ops = cpu_ops;
    exl_qz_trial_free(c.be, &t);
    gptq_case_free(&c);
}

/* exl_hessian_add_on (the rows summed where they are, by the backend's gemm) against exl_hessian_add (the host's own
 * kernel), the sum brought back by exl_hessian_finish: the same H up to the order of fp32 sums (1e-5 of its largest
 * value), over three steps of rows. */
EXL_TEST(hessian_on_a_device_backend_matches_the_host) {
    enum { K = 96, ROWS = 200 };
    exl_backend *be;
    REQUIRE_OK(exl_backend_cpu_init(2, &be));
    uint32_t seed = 3;
    float *x = malloc(sizeof(float) * ROWS * K);
    REQUIRE(x);
    fill(x, (int64_t)ROWS * K, &seed, 1.0f, 5);
    exl_hessian host, dev;
    REQUIRE_OK(exl_hessian_init(&host, K));
    REQUIRE_OK(exl_hessian_init(&dev, K));
    const exl_backend_ops *cpu_ops = be->ops;
    exl_backend_ops other = *cpu_ops;
    for (int step = 0; step < 3; step++) {
        int64_t r0 = step * ROWS / 3, r1 = (step + 1) * ROWS / 3;
        REQUIRE_OK(exl_hessian_add(&host, x + r0 * K, r1 - r0, be));
        be->ops = &other;
        exl_status st = exl_hessian_add_on(&dev, x + r0 * K, r1 - r0, be);
        be->ops = cpu_ops;
        REQUIRE_OK(st);
    }
    CHECK(dev.n == host.n && dev.dev != NULL);
    REQUIRE_OK(exl_hessian_finish(&host));
    be->ops = &other;
    exl_status st = exl_hessian_finish(&dev);
    be->ops = cpu_ops;
    REQUIRE_OK(st);
    CHECK(dev.dev == NULL);
    double d = 0, m = 0;
    for (int64_t i = 0; i < (int64_t)K * K; i++) {
        d = fmax(d, fabs((double)dev.H[i] - host.H[i]));
        m = fmax(m, fabs((double)host.H[i]));
    }
    CHECK_MSG(d <= 1e-5 * m, "H differs by %g of %g", d, m);
    exl_hessian_free(&host);
    exl_hessian_free(&dev);
    free(x);
    be->ops->destroy(be);
}
