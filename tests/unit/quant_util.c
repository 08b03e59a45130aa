/* quant_util.c - random quantized layers for the round-trip and corruption tests. */
#include "quant_util.h"

#include "test.h"

#include "base/half.h"
#include "format/quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint32_t rnd(uint32_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

static float rndf(uint32_t *s) { return (float)(rnd(s) >> 8) / 16777216.0f; }

static void shuffle(int32_t *v, int64_t n, uint32_t *s) {
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = rnd(s) % (uint32_t)(i + 1);
        int32_t t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

/* ---- EXL2 */

int tq_exl2_make(tq_exl2 *t, int64_t K, int64_t N, int32_t G, const int32_t *bits, const int32_t *rows, int with_bias,
                 uint32_t seed) {
    uint32_t s = seed | 1;
    memset(t, 0, sizeof *t);
    t->K = K;
    t->N = N;
    t->Np = (N + 31) / 32 * 32;
    t->G = G;
    t->Q = exl_exl2_q_rows(bits, rows, G);
    uint8_t *codes = malloc((size_t)(K * N)), *sc = malloc((size_t)G * N);
    t->q_weight = malloc((size_t)t->Q * t->Np * 4);
    t->q_invperm = malloc((size_t)K * 4);
    t->q_scale = malloc((size_t)G * (t->Np / 8) * 4);
    t->q_scale_max = malloc((size_t)G * 2);
    t->q_groups = malloc((size_t)G * 4);
    t->W = malloc((size_t)(K * N) * sizeof(float));
    t->bias = with_bias ? malloc((size_t)N * 2) : NULL;
    if (!codes || !sc || !t->q_weight || !t->q_invperm || !t->q_scale || !t->q_scale_max || !t->q_groups || !t->W) {
        free(codes);
        free(sc);
        return 0;
    }
    int64_t r = 0;
    for (int32_t g = 0; g < G; g++) {
        for (int64_t j = 0; j < rows[g]; j++, r++)
            for (int64_t n = 0; n < N; n++)
                codes[r * N + n] = (uint8_t)(rnd(&s) & ((1u << bits[g]) - 1));
        for (int64_t n = 0; n < N; n++)
            sc[g * N + n] = (uint8_t)(rnd(&s) & 15);
        t->q_scale_max[g] = exl_f32_to_f16(0.002f + 0.05f * rndf(&s));
    }
    for (int64_t k = 0; k < K; k++)
        t->q_invperm[k] = (int32_t)k;
    shuffle(t->q_invperm, K, &s);
    exl_exl2_pack(K, N, G, bits, rows, codes, sc, t->q_weight, t->q_scale, t->q_groups);
    /* the expected matrix, straight from the codes */
    for (int64_t k = 0; k < K; k++) {
        int64_t rr = t->q_invperm[k], first = 0;
        int32_t g = 0;
        while (rr >= first + rows[g])
            first += rows[g++];
        for (int64_t n = 0; n < N; n++)
            t->W[k * N + n] = (float)((int)codes[rr * N + n] - (1 << (bits[g] - 1))) *
                              exl_exl2_scale(t->q_scale_max[g], sc[g * N + n]);
    }
    for (int64_t n = 0; t->bias && n < N; n++)
        t->bias[n] = exl_f32_to_f16(rndf(&s) - 0.5f);
    free(codes);
    free(sc);
    return 1;
}

void tq_exl2_src(const tq_exl2 *t, exl_linear_src *src) {
    memset(src, 0, sizeof *src);
    src->kind = EXL_LINEAR_EXL2;
    src->in_features = t->K;
    src->out_features = t->N;
    src->name = "test.exl2";
    src->exl2 = (exl_exl2_src){t->q_weight, t->q_invperm, t->q_scale,     t->q_scale_max,
                               t->q_groups, t->Q,         (int32_t)t->Np, t->G};
    src->bias = t->bias;
    src->bias_dtype = EXL_DTYPE_F16;
}

void tq_exl2_free(tq_exl2 *t) {
    free(t->q_weight);
    free(t->q_invperm);
    free(t->q_scale);
    free(t->q_scale_max);
    free(t->q_groups);
    free(t->bias);
    free(t->W);
}

/* ---- GPTQ */

int tq_gptq_make(tq_gptq *t, int bits, int64_t K, int64_t N, int32_t group_size, int g_idx_mode, int sym, int v2,
                 uint32_t seed) {
    uint32_t s = seed | 1;
    memset(t, 0, sizeof *t);
    int32_t gs = group_size < 0 ? (int32_t)K : group_size;
    t->bits = bits;
    t->v2 = v2;
    t->K = K;
    t->N = N;
    t->group_size = gs;
    t->G = (int32_t)((K + gs - 1) / gs);
    uint8_t *codes = malloc((size_t)(K * N)), *zeros = malloc((size_t)t->G * N);
    t->qweight = malloc((size_t)(K * bits / 32) * N * 4);
    t->qzeros = malloc((size_t)t->G * (N * bits / 32) * 4);
    t->scales = malloc((size_t)t->G * N * 2);
    t->g_idx = g_idx_mode ? malloc((size_t)K * 4) : NULL;
    t->W = malloc((size_t)(K * N) * sizeof(float));
    if (!codes || !zeros || !t->qweight || !t->qzeros || !t->scales || !t->W || (g_idx_mode && !t->g_idx)) {
        free(codes);
        free(zeros);
        return 0;
    }
    uint32_t max = (1u << bits) - 1;
    for (int64_t i = 0; i < K * N; i++)
        codes[i] = (uint8_t)(rnd(&s) & max);
    for (int64_t i = 0; i < (int64_t)t->G * N; i++) {
        /* stored zero: v1 checkpoints store zero - 1 (never the top code), v2 the zero itself */
        uint32_t z = sym ? 1u << (bits - 1) : (rnd(&s) % max) + 1;
        zeros[i] = (uint8_t)(v2 ? z : z - 1);
        t->scales[i] = exl_f32_to_f16(0.001f + 0.02f * rndf(&s));
    }
    if (g_idx_mode == 1 || g_idx_mode == 2)
        for (int64_t k = 0; k < K; k++)
            t->g_idx[k] = (int32_t)(k / gs);
    if (g_idx_mode == 2)
        shuffle(t->g_idx, K, &s);
    if (g_idx_mode == 3)
        for (int64_t k = 0; k < K; k++)
            t->g_idx[k] = (int32_t)(rnd(&s) % (uint32_t)t->G);
    exl_gptq_pack(bits, K, N, t->G, codes, zeros, t->qweight, t->qzeros);
    for (int64_t k = 0; k < K; k++) {
        int64_t g = t->g_idx ? t->g_idx[k] : k / gs;
        for (int64_t n = 0; n < N; n++) {
            int z = zeros[g * N + n] + (v2 ? 0 : 1);
            t->W[k * N + n] = (float)((int)codes[k * N + n] - z) * exl_f16_to_f32(t->scales[g * N + n]);
        }
    }
    free(codes);
    free(zeros);
    return 1;
}

void tq_gptq_src(const tq_gptq *t, exl_linear_src *src) {
    memset(src, 0, sizeof *src);
    src->kind = EXL_LINEAR_GPTQ;
    src->in_features = t->K;
    src->out_features = t->N;
    src->name = "test.gptq";
    src->gptq = (exl_gptq_src){t->qweight, t->qzeros, t->scales, t->g_idx, t->bits, t->group_size, t->G, t->v2 ? 0 : 1};
}

void tq_gptq_free(tq_gptq *t) {
    free(t->qweight);
    free(t->qzeros);
    free(t->scales);
    free(t->g_idx);
    free(t->W);
}

/* ---- kernel against the expected matrix */

double tq_kernel_err(const exl_linear_src *src, const float *W, const float *bias, int rows, uint32_t seed) {
    int64_t K = src->in_features, N = src->out_features;
    uint32_t s = seed | 1;
    float *x = malloc((size_t)(rows * K) * sizeof *x), *y = malloc((size_t)(rows * N) * sizeof *y);
    double *want = malloc((size_t)(rows * N) * sizeof *want);
    double worst = 0;
    for (int64_t i = 0; x && i < rows * K; i++)
        x[i] = rndf(&s) * 2 - 1;
    for (int64_t r = 0; want && x && r < rows; r++)
        for (int64_t n = 0; n < N; n++) {
            double acc = bias ? bias[n] : 0;
            for (int64_t k = 0; k < K; k++)
                acc += (double)x[r * K + k] * W[k * N + n];
            want[r * N + n] = acc;
        }
    const char *isas[] = {"scalar", "avx2", "avx512"};
    const char *saved = getenv("EXL_CPU_ISA");
    for (int i = 0; i < 3 && x && y && want && worst >= 0; i++) {
        setenv("EXL_CPU_ISA", isas[i], 1);
        exl_backend *be;
        exl_linear *w;
        if (exl_backend_cpu_init(2, &be) != EXL_OK)
            break;
        if (be->ops->linear_init(be, src, &w) != EXL_OK) {
            exl_test_failed(__FILE__, __LINE__, "linear_init: %s", exl_last_error());
            be->ops->destroy(be);
            worst = -1;
            break;
        }
        be->ops->matmul(be, y, x, w, rows);
        for (int64_t r = 0; r < rows; r++) {
            double num = 0, den = 0;
            for (int64_t n = 0; n < N; n++) {
                double d = y[r * N + n] - want[r * N + n];
                num += d * d;
                den += want[r * N + n] * want[r * N + n];
            }
            double e = sqrt(num / (den > 0 ? den : 1));
            worst = e > worst ? e : worst;
        }
        be->ops->linear_free(be, w);
        be->ops->destroy(be);
    }
    if (saved)
        setenv("EXL_CPU_ISA", saved, 1);
    else
        unsetenv("EXL_CPU_ISA");
    free(x);
    free(y);
    free(want);
    return worst;
}
