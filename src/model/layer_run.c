/* layer_run.c - host fp32 pieces of one decoder layer for the quantizer (see layer_run.h). */
#include "model/layer_run.h"

#include "backend/cpu/kernels.h"
#include "base/alloc.h"
#include "base/error.h"
#include "base/half.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---- setup */

void exl_lrun_gap(const exl_hf_config *c, char *gap, size_t size) {
    static const exl_arch runs[] = {EXL_ARCH_LLAMA, EXL_ARCH_MISTRAL, EXL_ARCH_QWEN2, EXL_ARCH_GEMMA};
    int known = 0;
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++)
        known |= c->arch == runs[i];
    gap[0] = 0;
    if (!known)
        snprintf(gap, size, "%s models", exl_arch_name(c->arch));
    else if (c->rope.type == EXL_ROPE_LONGROPE)
        snprintf(gap, size, "longrope rotary embeddings");
    for (int32_t i = 1; !gap[0] && i < c->n_layers; i++)
        if (c->layers[i].sliding_window != c->layers[0].sliding_window)
            snprintf(gap, size, "attention windows that differ between layers");
}

/* Floats of attention scratch per thread: one sequence's values transposed [head_dim,
 * seq_len] and the probabilities of a block of queries [EXL_CPU_MAX_NR, seq_len]. */
static size_t attn_scratch(const exl_lrun *r) {
    return (size_t)r->seq_len * (size_t)(r->cfg->head_dim + EXL_CPU_MAX_NR);
}

exl_status exl_lrun_init(exl_lrun *r, const exl_hf_config *cfg, exl_pool *pool, int32_t n_seqs, int32_t seq_len) {
    memset(r, 0, sizeof *r);
    r->cfg = cfg;
    r->pool = pool;
    r->n_seqs = n_seqs;
    r->seq_len = seq_len;
    r->rot_dim = (int32_t)(cfg->head_dim * cfg->rope.partial_rotary_factor) & ~1;
    if (r->rot_dim < 2 || r->rot_dim > cfg->head_dim || r->rot_dim > 1024)
        return exl_fail(EXL_ERR_UNSUPPORTED, "rotary dimension %d is not supported", r->rot_dim);
    int32_t half = r->rot_dim / 2;
    r->cos = exl_malloc((size_t)seq_len * half * sizeof(float));
    r->sin = exl_malloc((size_t)seq_len * half * sizeof(float));
    r->scores = exl_malloc((size_t)exl_pool_size(pool) * attn_scratch(r) * sizeof(float));
    if (!r->cos || !r->sin || !r->scores) {
        exl_lrun_free(r);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    float inv_freq[512], factor = 1.0f;
    exl_rope_frequencies(cfg, &cfg->rope, r->rot_dim, seq_len > cfg->max_pos ? seq_len : cfg->max_pos, inv_freq,
                         &factor);
    for (int32_t p = 0; p < seq_len; p++)
        for (int32_t i = 0; i < half; i++) {
            float a = (float)p * inv_freq[i];
            r->cos[(size_t)p * half + i] = cosf(a) * factor;
            r->sin[(size_t)p * half + i] = sinf(a) * factor;
        }
    return EXL_OK;
}

void exl_lrun_free(exl_lrun *r) {
    exl_free(r->cos);
    exl_free(r->sin);
    exl_free(r->scores);
    r->cos = r->sin = r->scores = NULL;
}

/* ---- rmsnorm */

void exl_lrun_rmsnorm(const exl_lrun *r, float *out, const float *x, const float *w, int64_t rows) {
    int64_t H = r->cfg->hidden_size;
    for (int64_t t = 0; t < rows; t++) {
        const float *xi = x + t * H;
        double ss = 0;
        for (int64_t i = 0; i < H; i++)
            ss += (double)xi[i] * xi[i];
        float inv = (float)(1.0 / sqrt(ss / (double)H + r->cfg->rms_eps));
        for (int64_t i = 0; i < H; i++)
            out[t * H + i] = xi[i] * inv * w[i];
    }
}

/* ---- matmul (big ones on the accelerator when there is one, see layer_run.h): the CPU's
 * dot kernels (the backend's, SIMD where the CPU has it) over tiles of rows split across
 * the pool; the columns pass one block at a time, gathered from W in chunks of input
 * features, while the tile's rows stay in cache. */

#define MM_TILE 32 /* rows per tile */
#define MM_KC 512  /* input features gathered per column at a time */

typedef struct mm_ctx {
    float *out;
    const float *x, *W, *bias;
    int64_t rows, K, N;
    const exl_cpu_kernels *k;
} mm_ctx;

/* acc[i * EXL_CPU_NC + j] = x[i, 0 .. kc) · w[j] for i < nr. */
static void mm_kernel(const exl_cpu_kernels *k, const float *x, int64_t ldx, int nr, const float *const *w, int64_t kc,
                      float *acc) {
    if (k->block_f32) {
        k->block_f32(x, ldx, nr, w, kc, acc);
        return;
    }
    float col[EXL_CPU_MAX_NR];
    for (int j = 0; j < EXL_CPU_NC; j++) {
        k->dot_f32(x, ldx, nr, w[j], kc, col);
        for (int i = 0; i < nr; i++)
            acc[i * EXL_CPU_NC + j] = col[i];
    }
}

/* Columns n .. n + EXL_CPU_NC (fewer at the end) of rows r0 .. r1 (at most MM_TILE). */
static void mm_cols(const mm_ctx *c, int64_t r0, int64_t r1, int64_t n) {
    int64_t K = c->K, N = c->N;
    int nc = N - n < EXL_CPU_NC ? (int)(N - n) : EXL_CPU_NC;
    float wbuf[EXL_CPU_NC][MM_KC], sum[MM_TILE * EXL_CPU_NC] = {0}, acc[EXL_CPU_MAX_NR * EXL_CPU_NC];
    const float *w[EXL_CPU_NC];
    for (int j = 0; j < EXL_CPU_NC; j++)
        w[j] = wbuf[j];
    for (int64_t k0 = 0; k0 < K; k0 += MM_KC) {
        int64_t kc = K - k0 < MM_KC ? K - k0 : MM_KC;
        for (int64_t k = 0; k < kc; k++)
            for (int j = 0; j < EXL_CPU_NC; j++) /* a last partial block repeats its last column */
                wbuf[j][k] = c->W[(k0 + k) * N + n + (j < nc ? j : nc - 1)];
        for (int64_t r = r0; r < r1; r += EXL_CPU_MAX_NR) {
            int nr = r1 - r < EXL_CPU_MAX_NR ? (int)(r1 - r) : EXL_CPU_MAX_NR;
            mm_kernel(c->k, c->x + r * K + k0, K, nr, w, kc, acc);
            for (int i = 0; i < nr * EXL_CPU_NC; i++)
                sum[(r - r0) * EXL_CPU_NC + i] += acc[i];
        }
    }
    for (int64_t r = r0; r < r1; r++)
        for (int j = 0; j < nc; j++)
            c->out[r * N + n + j] = sum[(r - r0) * EXL_CPU_NC + j] + (c->bias ? c->bias[n + j] : 0.0f);
}

static void mm_task(void *ctx, int index, int count) {
    const mm_ctx *c = ctx;
    long t0, t1;
    exl_split_range((long)c->rows, index, count, MM_TILE, &t0, &t1);
    for (int64_t tile = t0; tile < t1; tile += MM_TILE)
        for (int64_t n = 0; n < c->N; n += EXL_CPU_NC)
            mm_cols(c, tile, tile + MM_TILE < t1 ? tile + MM_TILE : t1, n);
}

static exl_status matmul_accel(const exl_lrun *r, float *out, const float *x, const float *W, const float *bias,
                               int64_t rows, int64_t K, int64_t N) {
    EXL_TRY(r->accel->ops->host_gemm(r->accel, 0, 0, rows, N, K, 1.0f, x, K, W, N, 0.0f, out, N));
    for (int64_t t = 0; bias && t < rows; t++)
        for (int64_t n = 0; n < N; n++)
            out[t * N + n] += bias[n];
    return EXL_OK;
}

exl_status exl_lrun_matmul(const exl_lrun *r, float *out, const float *x, const float *W, const float *bias,
                           int64_t rows, int64_t K, int64_t N) {
    if (r->accel && rows * K * N >= EXL_HOST_GEMM_MIN_WORK)
        return matmul_accel(r, out, x, W, bias, rows, K, N);
    mm_ctx c = {out, x, W, bias, rows, K, N, exl_cpu_kernels_best()};
    exl_pool_run_work(r->pool, mm_task, &c, rows * K * N);
    return EXL_OK;
}

/* ---- rope + attention, split by (sequence, head) */

typedef struct attn_ctx {
    const exl_lrun *r;
    float *out, *q, *k;
    const float *v;
    const exl_cpu_kernels *kern;
} attn_ctx;

static void rope_rows(const exl_lrun *r, float *x, int32_t heads) {
    int32_t hd = r->cfg->head_dim, half = r->rot_dim / 2;
    int64_t T = exl_lrun_rows(r);
    for (int64_t t = 0; t < T; t++) {
        int32_t p = (int32_t)(t % r->seq_len);
        const float *cs = r->cos + (size_t)p * half, *sn = r->sin + (size_t)p * half;
        for (int32_t h = 0; h < heads; h++) {
            float *v = x + (t * heads + h) * hd;
            for (int32_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = b * cs[i] + a * sn[i];
            }
        }
    }
}

/* Probabilities of query i over keys first .. i into p (zero elsewhere in [lo, hi]). */
static void attn_probs(const attn_ctx *c, const float *qi, const float *k, int64_t ldk, int32_t first, int32_t i,
                       int32_t lo, int32_t hi, float *p) {
    const exl_lrun *r = c->r;
    int32_t hd = r->cfg->head_dim;
    float scale = 1.0f / sqrtf((float)hd), mx = -INFINITY, sum = 0;
    for (int32_t j = lo; j < first; j++)
        p[j] = 0;
    for (int32_t j = first; j <= i; j += EXL_CPU_MAX_NR) {
        int nr = i + 1 - j < EXL_CPU_MAX_NR ? i + 1 - j : EXL_CPU_MAX_NR;
        c->kern->dot_f32(k + j * ldk, ldk, nr, qi, hd, p + j);
    }
    for (int32_t j = first; j <= i; j++) {
        p[j] *= scale;
        mx = p[j] > mx ? p[j] : mx;
    }
    for (int32_t j = first; j <= i; j++)
        sum += p[j] = expf(p[j] - mx);
    for (int32_t j = first; j <= i; j++)
        p[j] /= sum;
    for (int32_t j = i + 1; j <= hi; j++)
        p[j] = 0;
}

/* One (sequence, head): blocks of EXL_CPU_MAX_NR queries share each pass over the values. */
static void attn_head(const attn_ctx *c, int32_t s, int32_t h, float *scratch) {
    const exl_lrun *r = c->r;
    const exl_hf_config *cf = r->cfg;
    int32_t H = cf->n_heads, KV = cf->n_kv_heads, hd = cf->head_dim, L = r->seq_len, win = cf->sliding_window;
    int32_t kh = h / (H / KV);
    float *vt = scratch, *p = scratch + (size_t)hd * L;
    int64_t ldk = (int64_t)KV * hd, ldq = (int64_t)H * hd;
    const float *k = c->k + (int64_t)s * L * ldk + (int64_t)kh * hd, *v = c->v + (int64_t)s * L * ldk + (int64_t)kh * hd;
    for (int32_t j = 0; j < L; j++)
        for (int32_t e = 0; e < hd; e++)
            vt[(size_t)e * L + j] = v[j * ldk + e];
    for (int32_t i0 = 0; i0 < L; i0 += EXL_CPU_MAX_NR) {
        int nq = L - i0 < EXL_CPU_MAX_NR ? L - i0 : EXL_CPU_MAX_NR;
        int32_t hi = i0 + nq - 1, lo = win > 0 && i0 - win + 1 > 0 ? i0 - win + 1 : 0;
        for (int qi = 0; qi < nq; qi++) {
            int32_t i = i0 + qi, first = win > 0 && i - win + 1 > 0 ? i - win + 1 : 0;
            attn_probs(c, c->q + ((int64_t)s * L + i) * ldq + (int64_t)h * hd, k, ldk, first, i, lo, hi,
                       p + (size_t)qi * L);
        }
        float o[EXL_CPU_MAX_NR];
        for (int32_t e = 0; e < hd; e++) {
            c->kern->dot_f32(p + lo, L, nq, vt + (size_t)e * L + lo, hi + 1 - lo, o);
            for (int qi = 0; qi < nq; qi++)
                c->out[((int64_t)s * L + i0 + qi) * ldq + (int64_t)h * hd + e] = o[qi];
        }
    }
}

static void attn_task(void *ctx, int index, int count) {
    const attn_ctx *c = ctx;
    int32_t H = c->r->cfg->n_heads;
    long j0, j1;
    exl_split_range((long)c->r->n_seqs * H, index, count, 1, &j0, &j1);
    for (long job = j0; job < j1; job++)
        attn_head(c, (int32_t)(job / H), (int32_t)(job % H), c->r->scores + (size_t)index * attn_scratch(c->r));
}

void exl_lrun_attention(const exl_lrun *r, float *out, float *q, float *k, const float *v) {
    rope_rows(r, q, r->cfg->n_heads);
    rope_rows(r, k, r->cfg->n_kv_heads);
    attn_ctx c = {r, out, q, k, v, exl_cpu_kernels_best()};
    exl_pool_run(r->pool, attn_task, &c);
}

/* ---- activation */

void exl_lrun_glu(const exl_lrun *r, float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i], a;
        if (r->cfg->act == EXL_ACT_SILU)
            a = g / (1.0f + expf(-g));
        else if (r->cfg->act == EXL_ACT_GELU_TANH)
            a = 0.5f * g * (1.0f + tanhf(0.7978845608f * (g + 0.044715f * g * g * g)));
        else
            a = 0.5f * g * (1.0f + erff(g * 0.70710678f));
        gate[i] = a * up[i];
    }
}

/* ---- weights */

float exl_lrun_elem(const exl_st_tensor *t, int64_t i) {
    switch (t->dtype) {
    case EXL_DTYPE_F16:
        return exl_f16_to_f32(((const uint16_t *)t->data)[i]);
    case EXL_DTYPE_BF16:
        return exl_bf16_to_f32(((const uint16_t *)t->data)[i]);
    default:
        return ((const float *)t->data)[i];
    }
}

exl_status exl_lrun_embed(const exl_lrun *r, const exl_weights *w, const int32_t *ids, float *out) {
    int64_t H = r->cfg->hidden_size, T = exl_lrun_rows(r);
    const exl_st_tensor *t;
    int64_t shape[2] = {r->cfg->vocab_size, H};
    EXL_TRY(exl_weights_get(w, "model.embed_tokens.weight", EXL_DTYPES_FLOAT, 2, shape, &t));
    float scale = r->cfg->arch == EXL_ARCH_GEMMA ? sqrtf((float)H) : 1.0f;
    for (int64_t i = 0; i < T; i++)
        for (int64_t j = 0; j < H; j++)
            out[i * H + j] = exl_lrun_elem(t, (int64_t)ids[i] * H + j) * scale;
    return EXL_OK;
}

exl_status exl_lrun_load_linear(const exl_weights *w, const char *name, int64_t K, int64_t N, float **W) {
    const exl_st_tensor *t;
    int64_t shape[2] = {N, K};
    EXL_TRY(exl_weights_get(w, name, EXL_DTYPES_FLOAT, 2, shape, &t));
    if (!(*W = exl_malloc((size_t)K * N * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory reading %s", name);
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++)
            (*W)[k * N + n] = exl_lrun_elem(t, n * K + k);
    return EXL_OK;
}

exl_status exl_lrun_load_vector(const exl_weights *w, const char *name, int64_t n, float add, float **v) {
    const exl_st_tensor *t;
    int64_t shape[1] = {n};
    EXL_TRY(exl_weights_get(w, name, EXL_DTYPES_FLOAT, 1, shape, &t));
    if (!(*v = exl_malloc((size_t)n * sizeof(float))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory reading %s", name);
    for (int64_t i = 0; i < n; i++)
        (*v)[i] = exl_lrun_elem(t, i) + add;
    return EXL_OK;
}

exl_status exl_lrun_load_norm(const exl_lrun *r, const exl_weights *w, const char *name, float **v) {
    return exl_lrun_load_vector(w, name, r->cfg->hidden_size, r->cfg->arch == EXL_ARCH_GEMMA ? 1.0f : 0.0f, v);
}
