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
 * columns is split across the pool; the update of the rows after a block, a product
 * W[rest] -= U[block, rest]ᵀ·E, is the backend's host_gemm (see qz.h), or on a GPU with the rows kept in its
 * memory (its gemm, see "the updates on a backend that is not the CPU"); there EXL2's scale search and row loop
 * are the backend's too ("GPTQ with EXL2 scales wholly on a backend"). */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"
#include "format/exl2.h"
#include "format/quant.h"

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
    exl_qz_hinv_dev *hd = h->dev;
    void *on_dev[3 + EXL_QZ_DEV_SOURCES] = {hd ? hd->U : NULL, hd ? hd->work : NULL, hd ? hd->perm : NULL};
    for (int i = 0; hd && i < EXL_QZ_DEV_SOURCES; i++)
        on_dev[3 + i] = hd->src[i].dev;
    for (int i = 0; i < 3 + EXL_QZ_DEV_SOURCES; i++)
        if (on_dev[i])
            hd->be->ops->free(hd->be, on_dev[i]);
    exl_free(h->dev);
    exl_free(h->perm);
    exl_free(h->U);
    h->perm = NULL;
    h->U = NULL;
    h->dev = NULL;
}

/* ---- the inverse-Hessian factor
 *
 * With J the order reversal and J·A·J = M·Mᵀ (M lower), A⁻¹ = J·M⁻ᵀ·M⁻¹·J, so U = J·M⁻¹·J is
 * upper with UᵀU = A⁻¹: one Cholesky factorization and one triangular inverse, both in place
 * in double. Both go by blocks of NB columns, so that all but O(K²·NB) of their O(K³) work is
 * products by gemm, split across the pool by rows. A is padded with the identity to Kp, a
 * multiple of 8 (gemm's tile).
 *
 * The products stay in double on the CPU, not on the backend's fp32 host_gemm: simulated
 * in fp32 they moved U by about 1e-7 (relative, twice its own float rounding) and left the
 * codes unchanged, but every step would send the trailing matrix over the bus and back, and
 * the O(K²·NB) panel work stays on the CPU anyway, so little time would be saved. A backend with the op qz_factor
 * (a GPU: cuBLAS in double) factors there instead, U staying there too (factor_on_device). */

#define NB 128   /* columns per block */
#define PANEL 64 /* rows per gemm call */

/* x86-64-v3 clones of the hot loops. GEMM_CLONES: the factor's products, vectorized as they are (their inner loops
 * have fixed counts). GCC's -O2 vectorizes only such loops (its very cheap cost model): SIMD_CLONES vectorizes the
 * others as -O3 would, each element's operations as in the scalar loop (FMA where v3 contracts them); EXACT_CLONES
 * also keeps every product and sum rounded on its own (no FMA), as the default build computes them (and
 * cuda_gptq.cu's row loop). Clang vectorizes at -O2 and has no optimize attribute. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define GEMM_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define GEMM_CLONES
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SIMD_CLONES \
    __attribute__((target_clones("arch=x86-64-v3", "default"), optimize("tree-vectorize", "vect-cost-model=dynamic")))
#define EXACT_CLONES                                           \
    __attribute__((target_clones("arch=x86-64-v3", "default"), \
                   optimize("tree-vectorize", "vect-cost-model=dynamic", "fp-contract=off")))
#else
#define SIMD_CLONES GEMM_CLONES
#define EXACT_CLONES
#endif

/* C [m, n] = (beta ? C : 0) + alpha·A [m, k]·B [k, n], row-major with leading dimensions lda,
 * ldb, ldc; m % 4 == 0, n % 8 == 0, k > 0. Over slices of 256 of k and 64 rows of A, an 8-column
 * strip of B is copied to a contiguous buffer and 4 x 8 tiles of C accumulate in registers. */
GEMM_CLONES static void gemm(int64_t m, int64_t n, int64_t k, double alpha, const double *A, int64_t lda,
                             const double *B, int64_t ldb, int beta, double *C, int64_t ldc) {
    double bp[256][8];
    for (int64_t p0 = 0; p0 < k; p0 += 256) {
        int64_t kc = k - p0 < 256 ? k - p0 : 256;
        int add = beta || p0 > 0;
        for (int64_t i0 = 0; i0 < m; i0 += 64)
            for (int64_t j = 0; j < n; j += 8) {
                for (int64_t p = 0; p < kc; p++)
                    memcpy(bp[p], B + (p0 + p) * ldb + j, sizeof bp[p]);
                for (int64_t i = i0; i < m && i < i0 + 64; i += 4) {
                    const double *a = A + i * lda + p0;
                    double acc[4][8] = {{0}};
                    for (int64_t p = 0; p < kc; p++)
#pragma GCC unroll 4
                        for (int r = 0; r < 4; r++)
#pragma GCC unroll 8
                            for (int q = 0; q < 8; q++)
                                acc[r][q] += a[r * lda + p] * bp[p][q];
                    for (int r = 0; r < 4; r++)
                        for (int q = 0; q < 8; q++) {
                            double *o = C + (i + r) * ldc + j + q;
                            *o = (add ? *o : 0.0) + alpha * acc[r][q];
                        }
                }
            }
    }
}

/* Rows [r0, r1) of thread i of n over [0, len) when row r costs r + 1: equal shares of the
 * triangle, in multiples of 4 (as len is). */
static void split_tri(int64_t len, int i, int n, int64_t *r0, int64_t *r1) {
    *r0 = (int64_t)((double)len * sqrt((double)i / n)) & ~(int64_t)3;
    *r1 = i + 1 == n ? len : (int64_t)((double)len * sqrt((double)(i + 1) / n)) & ~(int64_t)3;
}

typedef struct fac_ctx {
    double *A;          /* [Kp, Kp] */
    double *W;          /* [Kp, NB] the panel transposed, or a product */
    double *D;          /* [NB, NB] the diagonal block transposed, or its inverse */
    int64_t Kp, b0, b1; /* the block: columns b0 .. b1 */
} fac_ctx;

/* Unblocked in-place lower Cholesky factor of the n x n block at A (leading dimension ld); -1
 * when it is not positive definite. */
static int chol_block(double *A, int64_t ld, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const double *aj = A + j * ld;
        double d = aj[j];
        for (int64_t p = 0; p < j; p++)
            d -= aj[p] * aj[p];
        if (!(d > 0))
            return -1;
        d = sqrt(d);
        A[j * ld + j] = d;
        for (int64_t i = j + 1; i < n; i++) {
            double *ai = A + i * ld, s = ai[j];
            for (int64_t p = 0; p < j; p++)
                s -= ai[p] * aj[p];
            ai[j] = s / d;
        }
    }
    return 0;
}

/* Rows b1 .. Kp of the block's columns, 8 at a time: L21 = A21·L11⁻ᵀ by substitution (D holds
 * L11ᵀ), also stored transposed in W [nb, Kp - b1]. */
static void chol_panel_task(void *ctx, int index, int count) {
    const fac_ctx *c = ctx;
    int64_t Kp = c->Kp, nb = c->b1 - c->b0, rows = Kp - c->b1;
    long i0, i1;
    exl_split_range((long)rows, index, count, 8, &i0, &i1);
    double x[NB][8];
    for (int64_t i = i0; i < i1; i += 8) {
        double *a = c->A + (c->b1 + i) * Kp + c->b0;
        for (int64_t j = 0; j < nb; j++)
            for (int r = 0; r < 8; r++)
                x[j][r] = a[r * Kp + j];
        for (int64_t j = 0; j < nb; j++) {
            const double *d = c->D + j * nb;
            for (int r = 0; r < 8; r++)
                x[j][r] /= d[j];
            for (int64_t q = j + 1; q < nb; q++)
                for (int r = 0; r < 8; r++)
                    x[q][r] -= d[q] * x[j][r];
            memcpy(c->W + j * rows + i, x[j], sizeof x[j]);
        }
        for (int64_t j = 0; j < nb; j++)
            for (int r = 0; r < 8; r++)
                a[r * Kp + j] = x[j][r];
    }
}

/* A22 -= L21·L21ᵀ on this thread's rows (to the diagonal, by tiles: also a little above it). */
static void chol_update_task(void *ctx, int index, int count) {
    const fac_ctx *c = ctx;
    int64_t Kp = c->Kp, nb = c->b1 - c->b0, rows = Kp - c->b1, r0, r1;
    split_tri(rows, index, count, &r0, &r1);
    for (int64_t a = r0; a < r1; a += PANEL) {
        int64_t b = a + PANEL < r1 ? a + PANEL : r1;
        double *ai = c->A + (c->b1 + a) * Kp;
        gemm(b - a, (b + 7) & ~(int64_t)7, nb, -1.0, ai + c->b0, Kp, c->W, rows, 1, ai + c->b1, Kp);
    }
}

/* Right-looking blocked Cholesky of c->A in place (lower); -1 when it is not positive definite. */
static int cholesky(fac_ctx *c, exl_pool *pool) {
    int64_t Kp = c->Kp;
    for (c->b0 = 0; c->b0 < Kp; c->b0 = c->b1) {
        c->b1 = c->b0 + NB < Kp ? c->b0 + NB : Kp;
        int64_t nb = c->b1 - c->b0, rows = Kp - c->b1;
        double *d = c->A + c->b0 * Kp + c->b0;
        if (chol_block(d, Kp, nb))
            return -1;
        for (int64_t j = 0; j < nb; j++)
            for (int64_t q = j; q < nb; q++)
                c->D[j * nb + q] = d[q * Kp + j];
        exl_pool_run_work(pool, chol_panel_task, c, rows * nb * nb / 2);
        exl_pool_run_work(pool, chol_update_task, c, rows * rows * nb / 2);
    }
    return 0;
}

/* D [n, n] = the inverse of the lower n x n block at M (leading dimension ld), row by row. */
static void tri_inv_block(const double *M, int64_t ld, int64_t n, double *D) {
    memset(D, 0, (size_t)(n * n) * sizeof(double));
    for (int64_t r = 0; r < n; r++) {
        double *x = D + r * n;
        const double *m = M + r * ld;
        x[r] = 1.0;
        for (int64_t p = 0; p < r; p++)
            for (int64_t q = 0; q <= p; q++)
                x[q] -= m[p] * D[p * n + q];
        for (int64_t q = 0; q <= r; q++)
            x[q] /= m[r];
    }
}

/* W [Kp - b1, nb] = X·M[b1 .., block] on this thread's rows, X = A[b1 .., b1 ..] (lower). */
static void inv_product_task(void *ctx, int index, int count) {
    const fac_ctx *c = ctx;
    int64_t Kp = c->Kp, nb = c->b1 - c->b0, rows = Kp - c->b1, r0, r1;
    split_tri(rows, index, count, &r0, &r1);
    const double *X = c->A + c->b1 * Kp + c->b1;
    for (int64_t a = r0; a < r1; a += PANEL) {
        int64_t b = a + PANEL < r1 ? a + PANEL : r1;
        gemm(b - a, nb, b, 1.0, X + a * Kp, Kp, c->A + c->b1 * Kp + c->b0, Kp, 0, c->W + a * nb, nb);
    }
}

/* A[b1 .., block] = -W·D on this thread's rows. */
static void inv_scale_task(void *ctx, int index, int count) {
    const fac_ctx *c = ctx;
    int64_t Kp = c->Kp, nb = c->b1 - c->b0;
    long i0, i1;
    exl_split_range((long)(Kp - c->b1), index, count, 4, &i0, &i1);
    gemm(i1 - i0, nb, nb, -1.0, c->W + i0 * nb, nb, c->D, nb, 0, c->A + (c->b1 + i0) * Kp + c->b0, Kp);
}

/* In-place inverse of the lower c->A (zero above the diagonal), by block columns from the
 * right: with X the inverse of the part after a block, A[b1 .., block] = -X·A[b1 .., block]·D
 * where D is the inverse of the block's diagonal part. */
static void tri_inverse(fac_ctx *c, exl_pool *pool) {
    int64_t Kp = c->Kp;
    for (c->b0 = (Kp - 1) / NB * NB; c->b0 >= 0; c->b0 -= NB) {
        c->b1 = c->b0 + NB < Kp ? c->b0 + NB : Kp;
        int64_t nb = c->b1 - c->b0, rows = Kp - c->b1;
        double *d = c->A + c->b0 * Kp + c->b0;
        tri_inv_block(d, Kp, nb, c->D);
        exl_pool_run_work(pool, inv_product_task, c, rows * rows * nb / 2);
        exl_pool_run_work(pool, inv_scale_task, c, rows * nb * nb);
        for (int64_t r = 0; r < nb; r++)
            memcpy(d + r * Kp, c->D + r * nb, (size_t)nb * sizeof(double));
    }
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

/* The damping's scale, the mean of H's diagonal (1 for an empty one), and its first factor (*damp); each failed
 * factorization multiplies the factor by 4. */
static double first_damping(const exl_hessian *H, double *damp) {
    int64_t K = H->K;
    double mean = 0;
    for (int64_t i = 0; i < K; i++)
        mean += H->H[i * K + i];
    *damp = EXL_QZ_DAMP + EXL_QZ_DAMP_PER_DIM * (double)K / (double)(H->n > 0 ? H->n : 1);
    return mean > 0 ? mean / (double)K : 1.0;
}

/* U of the permuted Hessian plus (EXL_QZ_DAMP + EXL_QZ_DAMP_PER_DIM·K/n) x its mean
 * diagonal, n the rows it was accumulated from; the damping grows 4x (up to 8 times) while
 * the factorization fails. */
static exl_status factor(const exl_hessian *H, const int32_t *perm, exl_pool *pool, float *U) {
    int64_t K = H->K, Kp = (K + 7) & ~(int64_t)7;
    fac_ctx c = {exl_malloc((size_t)(Kp * Kp) * sizeof(double)),
                 exl_malloc((size_t)(Kp * NB) * sizeof(double)),
                 exl_malloc((size_t)(NB * NB) * sizeof(double)),
                 Kp,
                 0,
                 0};
    exl_status st = c.A && c.W && c.D
                        ? EXL_OK
                        : exl_fail(EXL_ERR_NOMEM, "out of memory for the inverse Hessian (K = %lld)", (long long)K);
    double damp, mean = first_damping(H, &damp);
    int tries = 0;
    for (; st == EXL_OK && tries < 8; tries++, damp *= 4) {
        for (int64_t i = 0; i < Kp; i++) {
            double *a = c.A + i * Kp;
            memset(a, 0, (size_t)Kp * sizeof(double));
            for (int64_t j = 0; i < K && j <= i; j++)
                a[j] = H->H[(int64_t)perm[K - 1 - i] * K + perm[K - 1 - j]];
            a[i] += i < K ? damp * mean : 1.0;
        }
        if (!cholesky(&c, pool))
            break;
    }
    if (st == EXL_OK && tries == 8)
        st = exl_fail(EXL_ERR_ARG, "the calibration Hessian is not positive definite even with damping");
    if (st == EXL_OK) {
        for (int64_t i = 0; i < Kp; i++) /* the updates by tiles wrote a little above the diagonal */
            memset(c.A + i * Kp + i + 1, 0, (size_t)(Kp - i - 1) * sizeof(double));
        tri_inverse(&c, pool);
        for (int64_t i = 0; i < K; i++)
            for (int64_t j = 0; j <= i; j++)
                U[(K - 1 - i) * K + (K - 1 - j)] = (float)c.A[i * Kp + j];
    }
    exl_free(c.A);
    exl_free(c.W);
    exl_free(c.D);
    return st;
}

/* The same on a backend with the op (qz_factor): U made there and kept there (out->dev), and brought to the host. */
static exl_status factor_on_device(const exl_hessian *H, exl_backend *be, exl_qz_hinv *out) {
    int64_t K = H->K;
    exl_qz_hinv_dev *hd = out->dev;
    if (!(hd->U = be->ops->alloc(be, (size_t)(K * K) * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of %s memory for a %lld x %lld factor", be->name, (long long)K,
                        (long long)K);
    hd->be = be;
    double damp, mean = first_damping(H, &damp);
    int ok = 0;
    for (int tries = 0; !ok && tries < 8; tries++, damp *= 4)
        EXL_TRY(be->ops->qz_factor(be, hd->U, H->H, out->perm, K, damp * mean, &ok));
    if (!ok)
        return exl_fail(EXL_ERR_ARG, "the calibration Hessian is not positive definite even with damping");
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    exl_status st = be->ops->download(be, out->U, hd->U, (size_t)(K * K) * sizeof(float));
    exl_qz_prof_leave();
    return st;
}

/* EXL_QUANT_DEVICE_FACTOR=0: the host factors on every backend (for comparisons) */
static int factor_on(exl_backend *be) {
    const char *env = getenv("EXL_QUANT_DEVICE_FACTOR");
    return be && !exl_backend_cpu_pool(be) && be->ops->qz_factor && !(env && !strcmp(env, "0"));
}

exl_status exl_gptq_prepare(const exl_hessian *H, int act_order, exl_pool *pool, exl_backend *be, exl_qz_hinv *out) {
    int64_t K = H->K;
    out->K = K;
    out->perm = exl_malloc((size_t)K * sizeof(int32_t));
    out->U = exl_calloc((size_t)(K * K), sizeof(float));
    out->dev = exl_calloc(1, sizeof *out->dev);
    exl_status st = out->perm && out->U && out->dev ? EXL_OK
                                                    : exl_fail(EXL_ERR_NOMEM, "out of memory (K = %lld)", (long long)K);
    if (st == EXL_OK)
        st = make_perm(H, act_order, out->perm);
    if (st == EXL_OK)
        st = factor_on(be) ? factor_on_device(H, be, out) : factor(H, out->perm, pool, out->U);
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

/* EXL2 scales of one group: one fp16 maximum and per column a 4-bit code c giving fp16(max/256)·(c+1)², searched as
 * format/exl2.h describes (EXL_EXL2_SCALE_*; the total error is smooth in the maximum). */
#define EXL2_TRIES EXL_EXL2_SCALE_TRIES
#define COARSE EXL_EXL2_SCALE_COARSE
typedef struct scale_ctx {
    const float *W;
    const float *ideal; /* [N] no-clipping scale per column */
    int64_t N, r0, r1;
    int bits;
    uint16_t sm[EXL2_TRIES];
    int n_try, tries[EXL2_TRIES]; /* the maxima this round tries */
    double *err;                  /* [threads, EXL2_TRIES] */
    uint8_t *codes;               /* [EXL2_TRIES, N] best code per column */
} scale_ctx;

/* The squared rounding errors of columns [0, w) of the group's rows (row r at W + r·N) at NCAND scales each
 * (scale s[j·w + i] of column i, its reciprocal inv, 0 for a zero scale), added to e[j·w + i]. Rounding to nearest
 * even by adding and taking away 1.5·2^23 (exact below 2^22, and beyond it the clamp decides); rows outer and
 * columns inner, so it vectorizes. */
#define NCAND EXL_EXL2_SCALE_CANDS
SIMD_CLONES static void column_errs(const float *W, int64_t N, int64_t rows, int64_t w, const float *s,
                                    const float *inv, float z, float maxq, float *e) {
    const float magic = 12582912.0f;
    for (int64_t r = 0; r < rows; r++) {
        const float *row = W + r * N;
        for (int j = 0; j < NCAND; j++) {
            const float *sj = s + j * w, *ij = inv + j * w;
            float *ej = e + j * w;
            for (int64_t i = 0; i < w; i++) {
                float x = row[i], q = (x * ij[i] + magic) - magic + z;
                q = q < 0.0f ? 0.0f : q > maxq ? maxq : q;
                float d = x - (q - z) * sj[i];
                ej[i] += d * d;
            }
        }
    }
}

/* Each column's least and largest value of the rows (row r at W + r·N), and 0, rows outer (vectorized). */
SIMD_CLONES static void column_range(const float *W, int64_t N, int64_t rows, float *lo, float *hi) {
    for (int64_t n = 0; n < N; n++)
        lo[n] = hi[n] = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t n = 0; n < N; n++) {
            float w = W[r * N + n];
            lo[n] = w < lo[n] ? w : lo[n];
            hi[n] = w > hi[n] ? w : hi[n];
        }
}

static void scale_task(void *ctx, int index, int count) {
    const scale_ctx *c = ctx;
    long n0, n1;
    exl_split_range((long)c->N, index, count, 8, &n0, &n1);
    int64_t w = n1 - n0;
    if (w <= 0)
        return;
    double *err = c->err + (size_t)index * EXL2_TRIES;
    float *buf = exl_malloc((size_t)w * NCAND * 3 * sizeof(float));
    int *c0 = exl_malloc((size_t)w * sizeof(int));
    if (!buf || !c0) { /* no room to search: the largest codes (no clipping) */
        for (int t = 0; t < EXL2_TRIES; t++)
            for (int64_t n = n0; n < n1; n++)
                c->codes[(size_t)t * c->N + n] = 15;
        exl_free(buf);
        exl_free(c0);
        return;
    }
    float *s = buf, *inv = buf + w * NCAND, *e = buf + 2 * w * NCAND;
    float z = (float)(1 << (c->bits - 1)), maxq = (float)((1 << c->bits) - 1);
    for (int ti = 0; ti < c->n_try; ti++) {
        int t = c->tries[ti];
        float smf = exl_f16_to_f32(c->sm[t]), sc[16], isc[16]; /* the scale of each code, its reciprocal */
        for (int k = 0; k < 16; k++) {
            sc[k] = exl_exl2_scale(c->sm[t], (uint32_t)k);
            isc[k] = sc[k] != 0.0f ? 1.0f / sc[k] : 0.0f;
        }
        for (int64_t i = 0; i < w; i++) {
            c0[i] = (int)nearbyintf(16.0f * sqrtf(c->ideal[n0 + i] / smf)) - 1;
            for (int j = 0; j < NCAND; j++) {
                int k = c0[i] - 2 + j;
                k = k < 0 ? 0 : k > 15 ? 15 : k;
                s[j * w + i] = sc[k];
                inv[j * w + i] = isc[k];
                e[j * w + i] = 0;
            }
        }
        column_errs(c->W + c->r0 * c->N + n0, c->N, c->r1 - c->r0, w, s, inv, z, maxq, e);
        for (int64_t i = 0; i < w; i++) {
            float best = INFINITY;
            int best_c = 15;
            for (int j = 0; j < NCAND; j++) {
                int k = c0[i] - 2 + j;
                if (k >= 0 && k <= 15 && e[j * w + i] < best)
                    best = e[j * w + i], best_c = k;
            }
            c->codes[(size_t)t * c->N + n0 + i] = (uint8_t)best_c;
            err[t] += best;
        }
    }
    exl_free(buf);
    exl_free(c0);
}

static exl_status exl2_group_params(qstate *qs, const float *W, int64_t r0, int64_t r1, int64_t g, exl_pool *pool,
                                    exl_qz_result *out) {
    int64_t N = qs->N;
    int mid = 1 << (qs->bits - 1), threads = exl_pool_size(pool);
    float smax = 0, *lo = qs->zero, *hi = qs->scale; /* zero is set below, scale from hi */
    column_range(W + r0 * N, N, r1 - r0, lo, hi);
    for (int64_t n = 0; n < N; n++) {
        float s1 = hi[n] / (float)(mid - 1), s2 = -lo[n] / (float)mid;
        qs->scale[n] = s1 > s2 ? s1 : s2;
        smax = qs->scale[n] > smax ? qs->scale[n] : smax;
    }
    scale_ctx c = {W, qs->scale, N, r0, r1, qs->bits, {0}, 0, {0}, NULL, NULL};
    c.err = exl_calloc((size_t)threads * EXL2_TRIES, sizeof(double));
    c.codes = exl_malloc((size_t)EXL2_TRIES * N);
    if (!c.err || !c.codes) {
        exl_free(c.err);
        exl_free(c.codes);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    for (int t = 0; t < EXL2_TRIES; t++)
        c.sm[t] = exl_f32_to_f16((smax > 0 ? smax : 1e-6f) * (0.65f + 0.025f * (float)t));
    /* coarse to fine: every COARSE-th maximum, then the ones around the best of those */
    int best = 0, tried[EXL2_TRIES] = {0};
    double best_err = INFINITY;
    for (int round = 0; round < 2; round++) {
        c.n_try = 0;
        for (int t = 0; t < EXL2_TRIES; t++)
            if (!tried[t] && (round ? t > best - COARSE && t < best + COARSE : t % COARSE == COARSE / 2))
                c.tries[c.n_try++] = t, tried[t] = 1;
        exl_pool_run_work(pool, scale_task, &c, c.n_try * NCAND * (r1 - r0) * N);
        for (int i = 0; i < c.n_try; i++) {
            int t = c.tries[i];
            double e = 0;
            for (int k = 0; k < threads; k++)
                e += c.err[(size_t)k * EXL2_TRIES + t];
            if (e < best_err || (e == best_err && t < best))
                best_err = e, best = t;
        }
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

/* The rows [i1, i2) of a block, columns [n0, n1): each row rounded, its error (scaled by 1/U[i,i]) kept in E and
 * spread into the block's later rows. Columns are independent of each other here. */
EXACT_CLONES static void quant_block_cols(const qstate *qs, float *Wp, const float *U, float *E, int64_t K, int64_t i1,
                                          int64_t i2, int64_t n0, int64_t n1, uint8_t *codes) {
    int64_t N = qs->N;
    int maxq = (1 << qs->bits) - 1;
    for (int64_t i = i1; i < i2; i++) {
        float *w = Wp + i * N, *e = E + (i - i1) * N, d = U[i * K + i];
        uint8_t *code = codes + i * N;
        for (int64_t n = n0; n < n1; n++) {
            float q = qdq(w[n], qs->scale[n], qs->zero[n], maxq, &code[n]);
            e[n] = (w[n] - q) / d;
            w[n] = q;
        }
        for (int64_t j = i + 1; j < i2; j++) {
            float u = U[i * K + j], *wj = Wp + j * N;
            for (int64_t n = n0; n < n1; n++)
                wj[n] -= u * e[n];
        }
    }
}

/* The work of a block (quant_block_cols), split across the pool by columns. */
typedef struct block_ctx {
    const qstate *qs;
    float *Wp;
    const float *U;
    float *E;
    int64_t K, i1, i2;
    uint8_t *codes;
} block_ctx;

static void quant_block_task(void *ctx, int index, int count) {
    const block_ctx *c = ctx;
    long n0, n1;
    exl_split_range((long)c->qs->N, index, count, 16, &n0, &n1);
    if (n1 > n0)
        quant_block_cols(c->qs, c->Wp, c->U, c->E, c->K, c->i1, c->i2, n0, n1, c->codes);
}

static void quant_block(const qstate *qs, float *Wp, const float *U, float *E, int64_t K, int64_t i1, int64_t i2,
                        uint8_t *codes, exl_pool *pool) {
    block_ctx c = {qs, Wp, U, E, K, i1, i2, codes};
    exl_pool_run_work(pool, quant_block_task, &c, (i2 - i1) * (i2 - i1) * qs->N / 2);
}

/* A product this small goes faster on the host's threads than through a backend that is not the CPU's: its
 * host_gemm (a GPU's) would move the rows after the block over the bus and back, for every block. */
#define HOST_UPDATE_WORK ((int64_t)1 << 28)

/* W[i2 .. K) -= U[i1 .. i2, i2 .. K)ᵀ · E: on the host's threads (exl_qz_atb) on the CPU, or where small enough,
 * else by the backend's host_gemm */
static exl_status update_rest(const qstate *qs, float *W, const float *U, float *E, int64_t K, int64_t i1, int64_t i2,
                              exl_pool *pool, exl_backend *be) {
    int64_t N = qs->N, work = (K - i2) * N * (i2 - i1);
    if (exl_backend_cpu_pool(be) || work < HOST_UPDATE_WORK) {
        exl_qz_atb(pool, K - i2, N, i2 - i1, -1.0f, U + i1 * K + i2, K, E, N, W + i2 * N, N, 0);
        return EXL_OK;
    }
    return be->ops->host_gemm(be, 1, 0, K - i2, N, i2 - i1, -1.0f, U + i1 * K + i2, K, E, N, 1.0f, W + i2 * N, N);
}

/* ---- the updates on a backend that is not the CPU (a GPU)
 *
 * A quantization with at least DEVICE_WORK multiply-adds of updates keeps the rows still to quantize in the backend's
 * memory: W goes up once, then each block's scaled errors go up and the rows of the next block (or group, whose
 * scales need all its rows) come down, 2 x 128 rows a block instead of every row after it both ways as host_gemm
 * would move them; U goes up once per Hessian (exl_qz_hinv_dev). Rounding, scales and the spreading within a block
 * stay on the host's threads (GPTQ's scales; EXL2's go below where the backend has the ops). */
#define DEVICE_WORK ((int64_t)1 << 26)

typedef struct dev_rows {
    exl_backend *be;
    const float *U;
    float *W, *E; /* [K, N] the rows, [BLOCK, N] a block's errors (NULL: the updates are the host's) */
} dev_rows;

static void dev_end(dev_rows *d) {
    if (d->W)
        d->be->ops->free(d->be, d->W);
    if (d->E)
        d->be->ops->free(d->be, d->E);
    d->W = d->E = NULL;
}

/* U on the backend (once per Hessian) */
static exl_status dev_factor(exl_backend *be, const exl_qz_hinv *h) {
    exl_qz_hinv_dev *hd = h->dev;
    int64_t K = h->K;
    if (hd->U)
        return EXL_OK;
    if (!(hd->U = be->ops->alloc(be, (size_t)(K * K) * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of %s memory for a %lld x %lld factor", be->name, (long long)K,
                        (long long)K);
    hd->be = be;
    return be->ops->upload(be, hd->U, h->U, (size_t)(K * K) * sizeof(float));
}

static exl_status dev_begin(dev_rows *d, exl_backend *be, const exl_qz_hinv *h, const float *Wp, int64_t N) {
    int64_t K = h->K;
    d->be = be;
    EXL_TRY(dev_factor(be, h));
    d->U = h->dev->U;
    d->W = be->ops->alloc(be, (size_t)(K * N) * sizeof(float));
    d->E = be->ops->alloc(be, (size_t)(BLOCK * N) * sizeof(float));
    if (!d->W || !d->E) {
        dev_end(d);
        return exl_fail(EXL_ERR_NOMEM, "out of %s memory for a %lld x %lld matrix", be->name, (long long)K,
                        (long long)N);
    }
    return be->ops->upload(be, d->W, Wp, (size_t)(K * N) * sizeof(float));
}

/* Rows [r0, r1) of the backend's W to Wp. */
static exl_status dev_get(const dev_rows *d, float *Wp, int64_t N, int64_t r0, int64_t r1) {
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    exl_status st = d->be->ops->download(d->be, Wp + r0 * N, d->W + r0 * N, (size_t)((r1 - r0) * N) * sizeof(float));
    exl_qz_prof_leave();
    return st;
}

/* The backend's W[i2 .. K) -= U[i1 .. i2, i2 .. K)ᵀ · E */
static exl_status dev_update(const dev_rows *d, const float *E, int64_t K, int64_t N, int64_t i1, int64_t i2) {
    if (i2 >= K)
        return EXL_OK;
    EXL_TRY(d->be->ops->upload(d->be, d->E, E, (size_t)((i2 - i1) * N) * sizeof(float)));
    return d->be->ops->gemm(d->be, 1, 0, K - i2, N, i2 - i1, -1.0f, d->U + i1 * K + i2, K, d->E, N, 1.0f, d->W + i2 * N,
                            N);
}

/* ---- GPTQ with EXL2 scales wholly on a backend that has the ops (a GPU)
 *
 * W goes up once while its Hessian lives and is gathered into act-order there, the scale search (qz_exl2_scales) and
 * each block's rows (qz_rows) run there, the rows after a block are updated there (gemm), and the codes, scales and
 * quantized rows (gathered back into input order) come down once at the end: one wait a quantization. The rows, the
 * errors of a block, the scales and the codes live in the Hessian's room on the backend (exl_qz_hinv_dev.work), which
 * the quantizations of its linears reuse. */

/* EXL_QUANT_DEVICE_GPTQ=0: the host's rounding on every backend (for comparisons) */
static int exl2_on_device(const exl_backend *be, exl_qz_scheme scheme) {
    const char *env = getenv("EXL_QUANT_DEVICE_GPTQ");
    return scheme == EXL_QZ_EXL2 && be->ops->qz_exl2_scales && be->ops->qz_rows && be->ops->gemm &&
           !(env && !strcmp(env, "0"));
}

/* the Hessian's room on the backend, at least bytes (U there too) */
static exl_status dev_room(exl_backend *be, const exl_qz_hinv *h, size_t bytes) {
    exl_qz_hinv_dev *hd = h->dev;
    EXL_TRY(dev_factor(be, h));
    if (hd->work_bytes >= bytes)
        return EXL_OK;
    if (hd->work)
        be->ops->free(be, hd->work);
    hd->work_bytes = 0;
    if (!(hd->work = be->ops->alloc(be, bytes)))
        return exl_fail(EXL_ERR_NOMEM, "out of %s memory quantizing a %lld-row matrix", be->name, (long long)h->K);
    hd->work_bytes = bytes;
    return EXL_OK;
}

/* The rows of the Hessian's room on the backend, its scales and codes, and (out_rows) the quantized rows back in input
 * order: the layout gptq_exl2_dev works in. */
typedef struct dev_exl2 {
    float *W, *E, *scale, *zero, *Wo; /* [K, N], [BLOCK, N], [N], [N], [K, N] or NULL */
    uint16_t *smax;                   /* [G] */
    uint8_t *codes, *scale_codes;     /* [K, N], [G, N] */
} dev_exl2;

static exl_status dev_exl2_room(exl_backend *be, const exl_qz_hinv *h, int64_t N, int64_t G, int out_rows,
                                dev_exl2 *d) {
    int64_t K = h->K;
    size_t floats = (size_t)((K + BLOCK + 2 + (out_rows ? K : 0)) * N),
           bytes = floats * sizeof(float) + (size_t)((K + G) * N + 2 * G);
    EXL_TRY(dev_room(be, h, bytes));
    d->W = h->dev->work;
    d->E = d->W + K * N;
    d->scale = d->E + BLOCK * N;
    d->zero = d->scale + N;
    d->Wo = out_rows ? d->zero + N : NULL;
    d->smax = (uint16_t *)(d->zero + N + (out_rows ? K * N : 0));
    d->codes = (uint8_t *)(d->smax + G);
    d->scale_codes = d->codes + K * N;
    return EXL_OK;
}

/* GPTQ over the permuted rows d->W, group by group: the scale search, each block's rows, the update of the rows after
 * it, all queued on the backend. */
static exl_status gptq_exl2_dev(exl_backend *be, const exl_qz_hinv *h, int64_t N, const exl_qz_layout *layout,
                                const dev_exl2 *d) {
    int64_t K = h->K, r0 = 0;
    const float *U = h->dev->U;
    exl_status st = EXL_OK;
    for (int32_t g = 0; st == EXL_OK && g < layout->n_groups; g++) {
        int64_t r1 = r0 + layout->rows[g];
        int32_t bits = layout->bits[g];
        exl_qz_prof_enter(EXL_QZ_PROF_SCALES);
        st = be->ops->qz_exl2_scales(be, d->W + r0 * N, N, (int32_t)(r1 - r0), bits, d->scale_codes + g * N,
                                     d->smax + g, d->scale, d->zero);
        exl_qz_prof_leave();
        for (int64_t i1 = r0; st == EXL_OK && i1 < r1; i1 += BLOCK) {
            int64_t i2 = i1 + BLOCK < r1 ? i1 + BLOCK : r1;
            exl_qz_prof_enter(EXL_QZ_PROF_ROWS);
            st = be->ops->qz_rows(be, d->W + i1 * N, U + i1 * K + i1, K, N, (int32_t)(i2 - i1), d->scale, d->zero, bits,
                                  d->codes + i1 * N, d->E);
            exl_qz_prof_leave();
            exl_qz_prof_enter(EXL_QZ_PROF_UPDATE);
            if (st == EXL_OK && i2 < K)
                st = be->ops->gemm(be, 1, 0, K - i2, N, i2 - i1, -1.0f, U + i1 * K + i2, K, d->E, N, 1.0f,
                                   d->W + i2 * N, N);
            exl_qz_prof_leave();
        }
        r0 = r1;
    }
    return st;
}

/* ---- a candidate's trial weights wholly on the backend
 *
 * The measuring pass quantizes each linear with many recipes and needs only the dequantized weights, as a trial
 * linear on the backend. The linear's weights go up once while its Hessian lives (the room's sources, the least
 * recently used replaced), and the order of rows once; each recipe then gathers the rows into act-order there,
 * quantizes them (gptq_exl2_dev) and writes them into the trial linear (qz_set_trial): no host copy, no transfer. */

int exl_gptq_trial_on_device(const exl_backend *be) {
    return exl2_on_device(be, EXL_QZ_EXL2) && be->ops->qz_set_trial && be->ops->gather_rows;
}

/* W's copy on the backend (uploaded unless one of the sources is it) */
static exl_status dev_source(exl_backend *be, const exl_qz_hinv *h, const float *W, int64_t N, float **out) {
    exl_qz_hinv_dev *hd = h->dev;
    int64_t K = h->K;
    exl_qz_dev_source *slot = &hd->src[0];
    hd->uses++;
    for (int i = 0; i < EXL_QZ_DEV_SOURCES; i++) {
        exl_qz_dev_source *x = &hd->src[i];
        if (x->W == W && x->N == N) {
            x->used = hd->uses;
            *out = x->dev;
            return EXL_OK;
        }
        if (x->used < slot->used)
            slot = x;
    }
    if (slot->dev && slot->N != N) {
        be->ops->free(be, slot->dev);
        slot->dev = NULL;
    }
    slot->W = NULL;
    hd->be = be;
    if (!slot->dev && !(slot->dev = be->ops->alloc(be, (size_t)(K * N) * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of %s memory for a %lld x %lld linear", be->name, (long long)K,
                        (long long)N);
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    exl_status st = be->ops->upload(be, slot->dev, W, (size_t)(K * N) * sizeof(float));
    if (st == EXL_OK && !hd->perm) { /* the order of rows, then its inverse */
        int32_t *both = exl_malloc((size_t)K * 2 * sizeof(int32_t));
        if (both) {
            memcpy(both, h->perm, (size_t)K * sizeof(int32_t));
            for (int64_t r = 0; r < K; r++)
                both[K + h->perm[r]] = (int32_t)r;
        }
        if (!both || !(hd->perm = be->ops->alloc(be, (size_t)K * 2 * sizeof(int32_t))))
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        else
            st = be->ops->upload(be, hd->perm, both, (size_t)K * 2 * sizeof(int32_t));
        exl_free(both);
    }
    exl_qz_prof_leave();
    if (st == EXL_OK) {
        slot->W = W;
        slot->N = N;
        slot->used = hd->uses;
        *out = slot->dev;
    }
    return st;
}

exl_status exl_gptq_quantize_trial(const float *W, const exl_qz_hinv *h, int64_t N, const exl_qz_layout *layout,
                                   exl_backend *be, exl_linear *w) {
    int64_t K = h->K, rows = 0;
    for (int32_t g = 0; g < layout->n_groups; g++)
        rows += layout->rows[g];
    if (rows != K || N > INT32_MAX || K > INT32_MAX)
        return exl_fail(EXL_ERR_ARG, "quantization groups cover %lld of %lld rows", (long long)rows, (long long)K);
    exl_qz_prof_enter(EXL_QZ_PROF_GPTQ);
    dev_exl2 d;
    float *src = NULL;
    exl_status st = dev_exl2_room(be, h, N, layout->n_groups, 0, &d);
    if (st == EXL_OK)
        st = dev_source(be, h, W, N, &src);
    if (st == EXL_OK) {
        exl_qz_prof_enter(EXL_QZ_PROF_PERMUTE);
        be->ops->gather_rows(be, d.W, src, h->dev->perm, (int32_t)K, (int32_t)N);
        exl_qz_prof_leave();
        st = gptq_exl2_dev(be, h, N, layout, &d);
    }
    if (st == EXL_OK) {
        exl_qz_prof_enter(EXL_QZ_PROF_TRIAL);
        st = be->ops->qz_set_trial(be, w, d.W, h->dev->perm);
        exl_qz_prof_leave();
    }
    exl_qz_prof_leave();
    return st;
}

/* The same with the whole result brought back (the quantizing pass): the codes, the scales, and the quantized rows
 * gathered back into input order there, so that they come down as Wq. */
static exl_status gptq_exl2_dev_result(const float *W, const exl_qz_hinv *h, int64_t N, const exl_qz_layout *layout,
                                       exl_backend *be, exl_qz_result *out) {
    int64_t K = h->K, G = layout->n_groups;
    dev_exl2 d;
    float *src = NULL;
    EXL_TRY(dev_exl2_room(be, h, N, G, 1, &d));
    EXL_TRY(dev_source(be, h, W, N, &src));
    exl_qz_prof_enter(EXL_QZ_PROF_PERMUTE);
    be->ops->gather_rows(be, d.W, src, h->dev->perm, (int32_t)K, (int32_t)N);
    exl_qz_prof_leave();
    exl_status st = gptq_exl2_dev(be, h, N, layout, &d);
    if (st == EXL_OK) {
        exl_qz_prof_enter(EXL_QZ_PROF_PERMUTE);
        be->ops->gather_rows(be, d.Wo, d.W, h->dev->perm + K, (int32_t)K, (int32_t)N);
        exl_qz_prof_leave();
    }
    exl_qz_prof_enter(EXL_QZ_PROF_TRANSFER);
    if (st == EXL_OK)
        st = be->ops->download(be, out->codes, d.codes, (size_t)(K * N));
    if (st == EXL_OK)
        st = be->ops->download(be, out->scale_codes, d.scale_codes, (size_t)(G * N));
    if (st == EXL_OK)
        st = be->ops->download(be, out->scale_max, d.smax, (size_t)G * sizeof(uint16_t));
    if (st == EXL_OK)
        st = be->ops->download(be, out->Wq, d.Wo, (size_t)(K * N) * sizeof(float));
    exl_qz_prof_leave();
    return st;
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
                            exl_backend *be, exl_qz_result *out) {
    int64_t K = h->K, N = qs->N, r0 = 0;
    float *E = exl_malloc((size_t)(BLOCK * N) * sizeof(float));
    exl_status st = E ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    dev_rows d = {0};
    if (st == EXL_OK && !exl_backend_cpu_pool(be) && be->ops->gemm && K * K / 2 * N >= DEVICE_WORK)
        st = dev_begin(&d, be, h, Wp, N);
    for (int32_t g = 0; st == EXL_OK && g < layout->n_groups; g++) {
        int64_t r1 = r0 + layout->rows[g];
        qs->bits = layout->bits[g];
        if (d.W) /* the group's rows with every earlier block's update */
            st = dev_get(&d, Wp, N, r0, r1);
        if (st != EXL_OK)
            break;
        exl_qz_prof_enter(EXL_QZ_PROF_SCALES);
        if (qs->scheme == EXL_QZ_EXL2)
            st = exl2_group_params(qs, Wp, r0, r1, g, pool, out);
        else
            gptq_group_params(qs, Wp, r0, r1, g, out);
        exl_qz_prof_leave();
        for (int64_t i1 = r0; st == EXL_OK && i1 < r1; i1 += BLOCK) {
            int64_t i2 = i1 + BLOCK < r1 ? i1 + BLOCK : r1;
            if (d.W && i1 > r0) /* the group's later blocks: with the updates of its earlier ones */
                st = dev_get(&d, Wp, N, i1, i2);
            if (st != EXL_OK)
                break;
            exl_qz_prof_enter(EXL_QZ_PROF_ROWS);
            quant_block(qs, Wp, h->U, E, K, i1, i2, out->codes, pool);
            exl_qz_prof_leave();
            exl_qz_prof_enter(EXL_QZ_PROF_UPDATE);
            st = d.W ? dev_update(&d, E, K, N, i1, i2) : update_rest(qs, Wp, h->U, E, K, i1, i2, pool, be);
            exl_qz_prof_leave();
        }
        r0 = r1;
    }
    dev_end(&d);
    exl_free(E);
    return st;
}

exl_status exl_gptq_quantize(const float *W, const exl_qz_hinv *h, int64_t N, exl_qz_scheme scheme,
                             const exl_qz_layout *layout, exl_pool *pool, exl_backend *be, exl_qz_result *out) {
    int64_t K = h->K, rows = 0;
    for (int32_t g = 0; g < layout->n_groups; g++)
        rows += layout->rows[g];
    if (rows != K)
        return exl_fail(EXL_ERR_ARG, "quantization groups cover %lld of %lld rows", (long long)rows, (long long)K);
    exl_qz_prof_enter(EXL_QZ_PROF_GPTQ);
    exl_status st = alloc_result(out, K, N, layout->n_groups, scheme);
    if (st != EXL_OK) {
        exl_qz_prof_leave();
        return st;
    }
    memcpy(out->perm, h->perm, (size_t)K * sizeof(int32_t));
    if (!exl_backend_cpu_pool(be) && exl2_on_device(be, scheme) && K <= INT32_MAX && N <= INT32_MAX) {
        st = gptq_exl2_dev_result(W, h, N, layout, be, out);
        if (st != EXL_OK)
            exl_qz_result_free(out);
        exl_qz_prof_leave();
        return st;
    }
    float *Wp = exl_malloc((size_t)(K * N) * sizeof(float)), *sc = exl_malloc((size_t)N * 2 * sizeof(float));
    st = Wp && sc ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK) {
        exl_qz_prof_enter(EXL_QZ_PROF_PERMUTE);
        for (int64_t r = 0; r < K; r++)
            memcpy(Wp + r * N, W + (int64_t)h->perm[r] * N, (size_t)N * sizeof(float));
        exl_qz_prof_leave();
        qstate qs = {scheme, N, 0, sc, sc + N};
        st = gptq_rows(Wp, h, &qs, layout, pool, be, out);
    }
    exl_qz_prof_enter(EXL_QZ_PROF_PERMUTE);
    for (int64_t r = 0; st == EXL_OK && r < K; r++)
        memcpy(out->Wq + (int64_t)h->perm[r] * N, Wp + r * N, (size_t)N * sizeof(float));
    exl_qz_prof_leave();
    exl_free(Wp);
    exl_free(sc);
    if (st != EXL_OK)
        exl_qz_result_free(out);
    exl_qz_prof_leave();
    return st;
}
