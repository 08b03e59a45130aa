/* gptq.c - GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
 * Pre-trained Transformers", 2022) over W[K, N], with EXL2 or GPTQ scales.
 *
 * exl_gptq_prepare orders the rows (act-order: diag(H) descending) and factors the damped
 * Hessian once: U, the upper Cholesky factor of (H + λI)⁻¹, serves every quantization of the
 * linears that share H. exl_gptq_quantize takes the rows group by group, in blocks of at
 * most 128 rows that never cross a group: row i is rounded and its error e = (w_i - q_i) /
 * U[i,i] is subtracted from every later row j as U[i,j]·e, immediately inside the block and
 * for the rows after it in one pass when the block is done. So a group's scales are fixed
 * from its rows with every earlier error already spread into them. Work over rows and
 * columns is split across the pool. */
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

void exl_qz_hinv_free(exl_qz_hinv *h) {
    exl_free(h->perm);
    exl_free(h->U);
    h->perm = NULL;
    h->U = NULL;
}

/* ---- the inverse-Hessian factor
 *
 * With J the order reversal and J·A·J = M·Mᵀ (M lower), A⁻¹ = J·M⁻ᵀ·M⁻¹·J, so U = J·M⁻¹·J is
 * upper with UᵀU = A⁻¹: one Cholesky factorization and one triangular inverse. */

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

typedef struct inv_ctx {
    const double *M; /* lower Cholesky factor of the reversed A */
    float *U;
    int64_t K;
} inv_ctx;

/* Column j of M⁻¹ by forward substitution, stored as U[K-1-i, K-1-j]; columns split by thread. */
static void inv_task(void *ctx, int index, int count) {
    const inv_ctx *c = ctx;
    int64_t K = c->K;
    double *x = exl_malloc((size_t)K * sizeof(double));
    if (!x)
        return; /* caught by the caller's check of U's diagonal */
    for (int64_t j = index; j < K; j += count) {
        for (int64_t i = j; i < K; i++) {
            double s = i == j ? 1.0 : 0.0;
            const double *mi = c->M + i * K;
            for (int64_t p = j; p < i; p++)
                s -= mi[p] * x[p];
            x[i] = s / mi[i];
            c->U[(K - 1 - i) * K + (K - 1 - j)] = (float)x[i];
        }
    }
    exl_free(x);
}

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

/* U of the permuted Hessian plus (EXL_QZ_DAMP + EXL_QZ_DAMP_PER_DIM·K/n) x its mean
 * diagonal, n the rows it was accumulated from; the damping grows 4x (up to 8 times) while
 * the factorization fails. */
static exl_status factor(const exl_hessian *H, const int32_t *perm, exl_pool *pool, float *U) {
    int64_t K = H->K;
    double *A = exl_malloc((size_t)(K * K) * sizeof(double));
    if (!A)
        return exl_fail(EXL_ERR_NOMEM, "out of memory for the inverse Hessian (K = %lld)", (long long)K);
    double mean = 0;
    for (int64_t i = 0; i < K; i++)
        mean += H->H[i * K + i];
    mean = mean > 0 ? mean / (double)K : 1.0;
    double damp = EXL_QZ_DAMP + EXL_QZ_DAMP_PER_DIM * (double)K / (double)(H->n > 0 ? H->n : 1);
    int tries = 0;
    for (; tries < 8; tries++, damp *= 4) {
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j <= i; j++)
                A[i * K + j] = H->H[(int64_t)perm[K - 1 - i] * K + perm[K - 1 - j]];
        for (int64_t i = 0; i < K; i++)
            A[i * K + i] += damp * mean;
        if (!cholesky(A, K))
            break;
    }
    exl_status st =
        tries < 8 ? EXL_OK : exl_fail(EXL_ERR_ARG, "the calibration Hessian is not positive definite even with damping");
    if (st == EXL_OK) {
        inv_ctx c = {A, U, K};
        exl_pool_run_work(pool, inv_task, &c, K * K * K / 6);
        for (int64_t i = 0; i < K && st == EXL_OK; i++)
            if (!(U[i * K + i] > 0))
                st = exl_fail(EXL_ERR_NOMEM, "out of memory inverting the Hessian");
    }
    exl_free(A);
    return st;
}

exl_status exl_gptq_prepare(const exl_hessian *H, int act_order, exl_pool *pool, exl_qz_hinv *out) {
    int64_t K = H->K;
    out->K = K;
    out->perm = exl_malloc((size_t)K * sizeof(int32_t));
    out->U = exl_calloc((size_t)(K * K), sizeof(float));
    exl_status st = out->perm && out->U ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory (K = %lld)", (long long)K);
    if (st == EXL_OK)
        st = make_perm(H, act_order, out->perm);
    if (st == EXL_OK)
        st = factor(H, out->perm, pool, out->U);
    if (st != EXL_OK)
        exl_qz_hinv_free(out);
    return st;
}

/* ---- group scales */

typedef struct qstate {
    exl_qz_scheme scheme;
    int64_t N;
    int bits;
    float *scale; /* [N] current group's scale per column */
    float *zero;  /* [N] */
} qstate;

static inline float qdq(float w, float s, float z, int maxq, uint8_t *code) {
    float q = s != 0.0f ? nearbyintf(w / s) + z : z;
    q = q < 0 ? 0 : q > (float)maxq ? (float)maxq : q;
    *code = (uint8_t)q;
    return (q - z) * s;
}

/* GPTQ: min/max scale (and zero point) per column of the rows W[r0 .. r1). */
static void gptq_group_params(qstate *qs, const float *W, int64_t r0, int64_t r1, int64_t g, exl_qz_result *out) {
    int64_t N = qs->N;
    int maxq = (1 << qs->bits) - 1, mid = 1 << (qs->bits - 1);
    for (int64_t n = 0; n < N; n++) {
        float lo = 0, hi = 0, s, z = (float)mid;
        for (int64_t r = r0; r < r1; r++) {
            float w = W[r * N + n];
            lo = w < lo ? w : lo;
            hi = w > hi ? w : hi;
        }
        if (qs->scheme == EXL_QZ_GPTQ_SYM) {
            float m = -lo > hi ? -lo : hi;
            s = m > 0 ? 2.0f * m / (float)maxq : 2.0f / (float)maxq;
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
        }
        s = exl_f16_to_f32(exl_f32_to_f16(s));
        out->zeros[g * N + n] = (uint8_t)z;
        out->scales[g * N + n] = exl_f32_to_f16(s);
        qs->scale[n] = s;
        qs->zero[n] = z;
    }
}

/* EXL2 scales of one group: one fp16 maximum and per column a 4-bit code c giving
 * fp16(max/256)·(c+1)². The maximum is tried at EXL2_TRIES points around the smallest one
 * that codes every column without clipping; for each, every column takes the code (of the
 * few around its own no-clipping scale) with the least squared rounding error, and the
 * maximum with the least total wins. */
#define EXL2_TRIES 20
typedef struct scale_ctx {
    const float *W;
    const float *ideal; /* [N] no-clipping scale per column */
    int64_t N, r0, r1;
    int bits;
    uint16_t sm[EXL2_TRIES];
    double *err;        /* [threads, EXL2_TRIES] */
    uint8_t *codes;     /* [EXL2_TRIES, N] best code per column */
} scale_ctx;

static float column_err(const scale_ctx *c, int64_t n, float s) {
    int maxq = (1 << c->bits) - 1;
    float z = (float)(1 << (c->bits - 1)), err = 0;
    uint8_t code;
    for (int64_t r = c->r0; r < c->r1; r++) {
        float w = c->W[r * c->N + n], d = w - qdq(w, s, z, maxq, &code);
        err += d * d;
    }
    return err;
}

static void scale_task(void *ctx, int index, int count) {
    const scale_ctx *c = ctx;
    long n0, n1;
    exl_split_range((long)c->N, index, count, 8, &n0, &n1);
    double *err = c->err + (size_t)index * EXL2_TRIES;
    for (int t = 0; t < EXL2_TRIES; t++) {
        float smf = exl_f16_to_f32(c->sm[t]);
        for (int64_t n = n0; n < n1; n++) {
            int c0 = (int)nearbyintf(16.0f * sqrtf(c->ideal[n] / smf)) - 1;
            float best = INFINITY;
            int best_c = 15;
            for (int k = c0 - 2; k <= c0 + 1; k++) {
                if (k < 0 || k > 15)
                    continue;
                float e = column_err(c, n, exl_exl2_scale(c->sm[t], (uint32_t)k));
                if (e < best)
                    best = e, best_c = k;
            }
            c->codes[(size_t)t * c->N + n] = (uint8_t)best_c;
            err[t] += best;
        }
    }
}

static exl_status exl2_group_params(qstate *qs, const float *W, int64_t r0, int64_t r1, int64_t g, exl_pool *pool,
                                    exl_qz_result *out) {
    int64_t N = qs->N;
    int mid = 1 << (qs->bits - 1), threads = exl_pool_size(pool);
    float smax = 0;
    for (int64_t n = 0; n < N; n++) {
        float lo = 0, hi = 0;
        for (int64_t r = r0; r < r1; r++) {
            float w = W[r * N + n];
            lo = w < lo ? w : lo;
            hi = w > hi ? w : hi;
        }
        float s1 = hi / (float)(mid - 1), s2 = -lo / (float)mid;
        qs->scale[n] = s1 > s2 ? s1 : s2;
        smax = qs->scale[n] > smax ? qs->scale[n] : smax;
    }
    scale_ctx c = {W, qs->scale, N, r0, r1, qs->bits, {0}, NULL, NULL};
    c.err = exl_calloc((size_t)threads * EXL2_TRIES, sizeof(double));
    c.codes = exl_malloc((size_t)EXL2_TRIES * N);
    if (!c.err || !c.codes) {
        exl_free(c.err);
        exl_free(c.codes);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    for (int t = 0; t < EXL2_TRIES; t++)
        c.sm[t] = exl_f32_to_f16((smax > 0 ? smax : 1e-6f) * (0.65f + 0.025f * (float)t));
    exl_pool_run_work(pool, scale_task, &c, EXL2_TRIES * 4 * (r1 - r0) * N);
    int best = 0;
    double best_err = INFINITY;
    for (int t = 0; t < EXL2_TRIES; t++) {
        double e = 0;
        for (int i = 0; i < threads; i++)
            e += c.err[(size_t)i * EXL2_TRIES + t];
        if (e < best_err)
            best_err = e, best = t;
    }
    out->scale_max[g] = c.sm[best];
    for (int64_t n = 0; n < N; n++) {
        uint8_t k = c.codes[(size_t)best * N + n];
        out->scale_codes[g * N + n] = k;
        qs->scale[n] = exl_exl2_scale(c.sm[best], k);
        qs->zero[n] = (float)mid;
    }
    exl_free(c.err);
    exl_free(c.codes);
    return EXL_OK;
}

/* ---- quantizing the rows of a block, and the lazy update of the rows after it */

static void quant_block(const qstate *qs, float *Wp, const float *U, float *E, int64_t K, int64_t i1, int64_t i2,
                        uint8_t *codes) {
    int64_t N = qs->N;
    int maxq = (1 << qs->bits) - 1;
    for (int64_t i = i1; i < i2; i++) {
        float *w = Wp + i * N, *e = E + (i - i1) * N, d = U[i * K + i];
        uint8_t *code = codes + i * N;
        for (int64_t n = 0; n < N; n++) {
            float q = qdq(w[n], qs->scale[n], qs->zero[n], maxq, &code[n]);
            e[n] = (w[n] - q) / d;
            w[n] = q;
        }
        for (int64_t j = i + 1; j < i2; j++) {
            float u = U[i * K + j], *wj = Wp + j * N;
            for (int64_t n = 0; n < N; n++)
                wj[n] -= u * e[n];
        }
    }
}

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

/* Quantize the permuted rows Wp group by group (see the top of the file). */
static exl_status gptq_rows(float *Wp, const exl_qz_hinv *h, qstate *qs, const exl_qz_layout *layout, exl_pool *pool,
                            exl_qz_result *out) {
    int64_t K = h->K, N = qs->N, r0 = 0;
    float *E = exl_malloc((size_t)(BLOCK * N) * sizeof(float));
    exl_status st = E ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t g = 0; st == EXL_OK && g < layout->n_groups; g++) {
        int64_t r1 = r0 + layout->rows[g];
        qs->bits = layout->bits[g];
        if (qs->scheme == EXL_QZ_EXL2)
            st = exl2_group_params(qs, Wp, r0, r1, g, pool, out);
        else
            gptq_group_params(qs, Wp, r0, r1, g, out);
        for (int64_t i1 = r0; st == EXL_OK && i1 < r1; i1 += BLOCK) {
            int64_t i2 = i1 + BLOCK < r1 ? i1 + BLOCK : r1;
            quant_block(qs, Wp, h->U, E, K, i1, i2, out->codes);
            upd_ctx c = {Wp, h->U, E, K, N, i1, i2};
            exl_pool_run_work(pool, upd_task, &c, (K - i2) * (i2 - i1) * N);
        }
        r0 = r1;
    }
    exl_free(E);
    return st;
}

exl_status exl_gptq_quantize(const float *W, const exl_qz_hinv *h, int64_t N, exl_qz_scheme scheme,
                             const exl_qz_layout *layout, exl_pool *pool, exl_qz_result *out) {
    int64_t K = h->K, rows = 0;
    for (int32_t g = 0; g < layout->n_groups; g++)
        rows += layout->rows[g];
    if (rows != K)
        return exl_fail(EXL_ERR_ARG, "quantization groups cover %lld of %lld rows", (long long)rows, (long long)K);
    EXL_TRY(alloc_result(out, K, N, layout->n_groups, scheme));
    memcpy(out->perm, h->perm, (size_t)K * sizeof(int32_t));
    float *Wp = exl_malloc((size_t)(K * N) * sizeof(float)), *sc = exl_malloc((size_t)N * 2 * sizeof(float));
    exl_status st = Wp && sc ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK) {
        for (int64_t r = 0; r < K; r++)
            memcpy(Wp + r * N, W + (int64_t)h->perm[r] * N, (size_t)N * sizeof(float));
        qstate qs = {scheme, N, 0, sc, sc + N};
        st = gptq_rows(Wp, h, &qs, layout, pool, out);
    }
    for (int64_t r = 0; st == EXL_OK && r < K; r++)
        memcpy(out->Wq + (int64_t)h->perm[r] * N, Wp + r * N, (size_t)N * sizeof(float));
    exl_free(Wp);
    exl_free(sc);
    if (st != EXL_OK)
        exl_qz_result_free(out);
    return st;
}
