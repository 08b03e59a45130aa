/* gptq.c - GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
 * Pre-trained Transformers", 2022) over W[K, N], with EXL2 or GPTQ scales.
 *
 * Rows (input features) are taken in act-order (diag(H) descending) when asked. With U the
 * upper Cholesky factor of (H + λI)⁻¹, row i is rounded and its error e = (w_i - q_i) / U[i,i]
 * is subtracted from every later row j as U[i,j]·e: immediately inside the current block
 * of 128 rows, and for the rows after it in one pass when the block is done. Group scales
 * are fixed when the quantization reaches the group's first row, from the rows as they are
 * then. Work over rows is split across the pool. */
#include "quant/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"
#include "quant/quant.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 128

void exl_qz_layout_free(exl_qz_layout *l) {
    exl_free(l->bits);
    exl_free(l->rows);
    l->bits = l->rows = NULL;
    l->n_groups = 0;
}

void exl_qz_result_free(exl_qz_result *r) {
    exl_free(r->perm);
    exl_free(r->codes);
    exl_free(r->scale_codes);
    exl_free(r->scale_max);
    exl_free(r->scales);
    exl_free(r->zeros);
    exl_free(r->Wq);
    memset(r, 0, sizeof *r);
}

/* ---- H⁻¹ factor */

/* In-place lower Cholesky factor of A [K, K] (row-major, lower triangle used). */
static int cholesky(double *A, int64_t K) {
    for (int64_t j = 0; j < K; j++) {
        double d = A[j * K + j];
        for (int64_t p = 0; p < j; p++)
            d -= A[j * K + p] * A[j * K + p];
        if (!(d > 0))
            return -1;
        d = sqrt(d);
        A[j * K + j] = d;
        for (int64_t i = j + 1; i < K; i++) {
            double s = A[i * K + j];
            const double *ai = A + i * K, *aj = A + j * K;
            for (int64_t p = 0; p < j; p++)
                s -= ai[p] * aj[p];
            A[i * K + j] = s / d;
        }
    }
    return 0;
}

/* U (upper, float) with Uᵀ U = A⁻¹, A symmetric positive definite; A is destroyed. */
static int inverse_upper_factor(double *A, double *tmp, int64_t K, float *U) {
    if (cholesky(A, K))
        return -1;
    /* tmp = L⁻¹ (lower) */
    memset(tmp, 0, (size_t)(K * K) * sizeof(double));
    for (int64_t j = 0; j < K; j++) {
        tmp[j * K + j] = 1.0 / A[j * K + j];
        for (int64_t i = j + 1; i < K; i++) {
            double s = 0;
            for (int64_t p = j; p < i; p++)
                s += A[i * K + p] * tmp[p * K + j];
            tmp[i * K + j] = -s / A[i * K + i];
        }
    }
    /* A = L⁻ᵀ L⁻¹ = A⁻¹ (lower triangle) */
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j <= i; j++) {
            double s = 0;
            for (int64_t p = i; p < K; p++)
                s += tmp[p * K + i] * tmp[p * K + j];
            A[i * K + j] = s;
        }
    if (cholesky(A, K))
        return -1;
    for (int64_t i = 0; i < K; i++)
        for (int64_t j = 0; j < K; j++)
            U[i * K + j] = j >= i ? (float)A[j * K + i] : 0.0f;
    return 0;
}

/* ---- group scales */

typedef struct qstate {
    exl_qz_scheme scheme;
    int64_t N;
    int bits;
    float *scale;  /* [N] current group's scale per column */
    float *zero;   /* [N] */
} qstate;

static inline float qdq(float w, float s, float z, int maxq, uint8_t *code) {
    float q = s != 0.0f ? nearbyintf(w / s) + z : z;
    q = q < 0 ? 0 : q > (float)maxq ? (float)maxq : q;
    *code = (uint8_t)q;
    return (q - z) * s;
}

/* Fix the scales of group g, whose rows are W[r0 .. r1), in qs and out. */
static void group_params(qstate *qs, const float *W, int64_t r0, int64_t r1, int64_t g, exl_qz_result *out) {
    int64_t N = qs->N;
    int b = qs->bits, maxq = (1 << b) - 1, mid = 1 << (b - 1);
    float smax = 0;
    for (int64_t n = 0; n < N; n++) {
        float lo = 0, hi = 0;
        for (int64_t r = r0; r < r1; r++) {
            float w = W[r * N + n];
            lo = w < lo ? w : lo;
            hi = w > hi ? w : hi;
        }
        float s, z = (float)mid;
        if (qs->scheme == EXL_QZ_EXL2) {
            /* the smallest scale that codes both ends without clipping */
            float s1 = hi / (float)(mid - 1), s2 = -lo / (float)mid;
            s = s1 > s2 ? s1 : s2;
            smax = s > smax ? s : smax;
        } else if (qs->scheme == EXL_QZ_GPTQ_SYM) {
            float m = -lo > hi ? -lo : hi;
            s = m > 0 ? 2.0f * m / (float)maxq : 2.0f / (float)maxq;
            s = exl_f16_to_f32(exl_f32_to_f16(s));
            out->zeros[g * N + n] = (uint8_t)mid;
        } else {
            if (lo == 0 && hi == 0)
                lo = -1, hi = 1;
            s = (hi - lo) / (float)maxq;
            z = nearbyintf(-lo / s);
            if (z < 1) { /* v1 checkpoints store zero - 1: keep it >= 0 */
                z = 1;
                s = hi / (float)(maxq - 1);
            }
            z = z > (float)maxq ? (float)maxq : z;
            s = exl_f16_to_f32(exl_f32_to_f16(s));
            out->zeros[g * N + n] = (uint8_t)z;
        }
        qs->scale[n] = s;
        qs->zero[n] = z;
        if (qs->scheme != EXL_QZ_EXL2)
            out->scales[g * N + n] = exl_f32_to_f16(s);
    }
    if (qs->scheme != EXL_QZ_EXL2)
        return;
    /* EXL2: one fp16 maximum per group, a 4-bit code per column on a quadratic grid; the
     * code is the one of the few near the ideal that rounds the group's column best. */
    uint16_t sm = exl_f32_to_f16(smax > 0 ? smax : 1e-6f);
    out->scale_max[g] = sm;
    float smf = exl_f16_to_f32(sm);
    for (int64_t n = 0; n < N; n++) {
        int c0 = (int)nearbyintf(16.0f * sqrtf(qs->scale[n] / smf)) - 1;
        float best_err = INFINITY, best_s = 0;
        int best_c = 15;
        for (int c = c0 - 2; c <= c0 + 1; c++) {
            if (c < 0 || c > 15)
                continue;
            float sc = exl_exl2_scale(sm, (uint32_t)c), err = 0;
            uint8_t code;
            for (int64_t r = r0; r < r1; r++) {
                float w = W[r * N + n], d = w - qdq(w, sc, (float)mid, maxq, &code);
                err += d * d;
            }
            if (err < best_err)
                best_err = err, best_c = c, best_s = sc;
        }
        out->scale_codes[g * N + n] = (uint8_t)best_c;
        qs->scale[n] = best_s;
    }
}

/* ---- the lazy update of the rows after a block */

typedef struct upd_ctx {
    float *W;
    const float *U, *E;
    int64_t K, N, i1, i2;
} upd_ctx;

static void upd_task(void *ctx, int index, int count) {
    const upd_ctx *c = ctx;
    long j0, j1;
    exl_split_range((long)(c->K - c->i2), index, count, 1, &j0, &j1);
    for (int64_t j = c->i2 + j0; j < c->i2 + j1; j++) {
        float *wj = c->W + j * c->N;
        for (int64_t i = c->i1; i < c->i2; i++) {
            float u = c->U[i * c->K + j];
            const float *e = c->E + (i - c->i1) * c->N;
            for (int64_t n = 0; n < c->N; n++)
                wj[n] -= u * e[n];
        }
    }
}

/* ---- driver */

typedef struct diag_key {
    float d;
    int32_t i;
} diag_key;

static int cmp_diag_desc(const void *a, const void *b) {
    const diag_key *x = a, *y = b;
    return x->d > y->d ? -1 : x->d < y->d ? 1 : (x->i > y->i) - (x->i < y->i);
}

static exl_status make_perm(const exl_hessian *H, int act_order, int32_t *perm) {
    int64_t K = H->K;
    diag_key *k = exl_malloc((size_t)K * sizeof *k);
    if (!k)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < K; i++)
        k[i] = (diag_key){act_order ? H->H[i * K + i] : 0.0f, (int32_t)i};
    qsort(k, (size_t)K, sizeof *k, cmp_diag_desc);
    for (int64_t i = 0; i < K; i++)
        perm[i] = k[i].i;
    exl_free(k);
    return EXL_OK;
}

/* U from the permuted, damped Hessian; Wp rows of dead inputs (zero diagonal) are zeroed. */
static exl_status hinv_factor(const exl_hessian *H, const int32_t *perm, float *Wp, int64_t N, float *U) {
    int64_t K = H->K;
    double *A = exl_malloc((size_t)(K * K) * sizeof(double)), *tmp = exl_malloc((size_t)(K * K) * sizeof(double));
    exl_status st = EXL_OK;
    if (!A || !tmp)
        st = exl_fail(EXL_ERR_NOMEM, "out of memory for the inverse Hessian (K = %lld)", (long long)K);
    double mean = 0;
    for (int64_t i = 0; i < K && st == EXL_OK; i++)
        mean += H->H[i * K + i];
    mean = mean > 0 ? mean / (double)K : 1.0;
    for (double damp = 0.01; st == EXL_OK; damp *= 10) {
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j <= i; j++)
                A[i * K + j] = H->H[(int64_t)perm[i] * K + perm[j]];
        for (int64_t i = 0; i < K; i++) {
            if (A[i * K + i] <= 0) {
                A[i * K + i] = 1;
                memset(Wp + i * N, 0, (size_t)N * sizeof(float));
            }
            A[i * K + i] += damp * mean;
        }
        if (!inverse_upper_factor(A, tmp, K, U))
            break;
        if (damp > 1e3)
            st = exl_fail(EXL_ERR_ARG, "the calibration Hessian is not positive definite even with damping");
    }
    exl_free(A);
    exl_free(tmp);
    return st;
}

static exl_status alloc_result(exl_qz_result *r, int64_t K, int64_t N, int32_t G, exl_qz_scheme scheme) {
    memset(r, 0, sizeof *r);
    r->K = K;
    r->N = N;
    r->perm = exl_malloc((size_t)K * sizeof(int32_t));
    r->codes = exl_malloc((size_t)(K * N));
    r->Wq = exl_malloc((size_t)(K * N) * sizeof(float));
    int ok = r->perm && r->codes && r->Wq;
    if (scheme == EXL_QZ_EXL2) {
        r->scale_codes = exl_malloc((size_t)(G * N));
        r->scale_max = exl_malloc((size_t)G * sizeof(uint16_t));
        ok = ok && r->scale_codes && r->scale_max;
    } else {
        r->scales = exl_malloc((size_t)(G * N) * sizeof(uint16_t));
        r->zeros = exl_malloc((size_t)(G * N));
        ok = ok && r->scales && r->zeros;
    }
    if (!ok) {
        exl_qz_result_free(r);
        return exl_fail(EXL_ERR_NOMEM, "out of memory quantizing a %lld x %lld matrix", (long long)K, (long long)N);
    }
    return EXL_OK;
}

exl_status exl_gptq_quantize(const float *W, const exl_hessian *H, int64_t N, exl_qz_scheme scheme, int act_order,
                             const exl_qz_layout *layout, exl_pool *pool, exl_qz_result *out) {
    int64_t K = H->K;
    EXL_TRY(alloc_result(out, K, N, layout->n_groups, scheme));
    float *Wp = exl_malloc((size_t)(K * N) * sizeof(float)), *U = exl_malloc((size_t)(K * K) * sizeof(float));
    float *E = exl_malloc((size_t)(BLOCK * N) * sizeof(float)), *sc = exl_malloc((size_t)N * 2 * sizeof(float));
    exl_status st = Wp && U && E && sc ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK)
        st = make_perm(H, act_order, out->perm);
    if (st == EXL_OK) {
        for (int64_t r = 0; r < K; r++)
            memcpy(Wp + r * N, W + (int64_t)out->perm[r] * N, (size_t)N * sizeof(float));
        st = hinv_factor(H, out->perm, Wp, N, U);
    }
    if (st == EXL_OK) {
        qstate qs = {scheme, N, 0, sc, sc + N};
        int64_t g = -1, g_end = 0;
        for (int64_t i1 = 0; i1 < K; i1 += BLOCK) {
            int64_t i2 = i1 + BLOCK < K ? i1 + BLOCK : K;
            for (int64_t i = i1; i < i2; i++) {
                if (i == g_end) {
                    g++;
                    qs.bits = layout->bits[g];
                    g_end = i + layout->rows[g];
                    group_params(&qs, Wp, i, g_end < K ? g_end : K, g, out);
                }
                int maxq = (1 << qs.bits) - 1;
                float *w = Wp + i * N, *e = E + (i - i1) * N, d = U[i * K + i];
                uint8_t *code = out->codes + i * N;
                for (int64_t n = 0; n < N; n++) {
                    float q = qdq(w[n], qs.scale[n], qs.zero[n], maxq, &code[n]);
                    e[n] = (w[n] - q) / d;
                    w[n] = q;
                }
                for (int64_t j = i + 1; j < i2; j++) {
                    float u = U[i * K + j], *wj = Wp + j * N;
                    for (int64_t n = 0; n < N; n++)
                        wj[n] -= u * e[n];
                }
            }
            upd_ctx c = {Wp, U, E, K, N, i1, i2};
            exl_pool_run_work(pool, upd_task, &c, (K - i2) * (i2 - i1) * N);
        }
        for (int64_t r = 0; r < K; r++)
            memcpy(out->Wq + (int64_t)out->perm[r] * N, Wp + r * N, (size_t)N * sizeof(float));
    }
    exl_free(Wp);
    exl_free(U);
    exl_free(E);
    exl_free(sc);
    if (st != EXL_OK)
        exl_qz_result_free(out);
    return st;
}
