/* cpu_ops.c - the CPU's element-wise and row ops: embed, rmsnorm, rope, glu, add, gather, column copies,
 * soft-capping, sigmoid row gates. */
#include "backend/cpu/cpu.h"

#include "base/half.h"

#include <math.h>
#include <string.h>

/* ---- embed */

void exl_cpu_embed(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows,
                   float scale) {
    const exl_linear_src *s = &table->src;
    int64_t width = s->in_features;
    for (int32_t r = 0; r < rows; r++) {
        int64_t base = (int64_t)ids[r] * width;
        float *o = out + (int64_t)r * width;
        for (int64_t i = 0; i < width; i++) {
            float v;
            switch (s->dense.dtype) {
            case EXL_DTYPE_F16: v = exl_f16_to_f32(((const uint16_t *)s->dense.data)[base + i]); break;
            case EXL_DTYPE_BF16: v = exl_bf16_to_f32(((const uint16_t *)s->dense.data)[base + i]); break;
            default: v = ((const float *)s->dense.data)[base + i]; break;
            }
            o[i] = v * scale;
        }
    }
}

/* ---- rmsnorm: x * w / sqrt(mean(x^2) + eps) */

typedef struct {
    float *out;
    const float *x;
    const float *w;
    int32_t rows, width;
    float eps;
} rmsnorm_job;

static void rmsnorm_task(void *p, int ti, int tn) {
    const rmsnorm_job *j = p;
    long r0, r1;
    exl_split_range(j->rows, ti, tn, 1, &r0, &r1);
    for (long r = r0; r < r1; r++) {
        const float *x = j->x + r * j->width;
        float *o = j->out + r * j->width;
        double ss = 0;
        for (int32_t i = 0; i < j->width; i++)
            ss += (double)x[i] * x[i];
        float inv = 1.0f / sqrtf((float)(ss / j->width) + j->eps);
        for (int32_t i = 0; i < j->width; i++)
            o[i] = j->w[i] * (x[i] * inv);
    }
}

void exl_cpu_rmsnorm(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                     float eps) {
    rmsnorm_job j = {out, x, w->v, rows, width, eps};
    exl_pool_run_work(exl_cpu(be)->pool, rmsnorm_task, &j, (int64_t)rows * width * 4);
}

/* ---- rope (NeoX layout: pairs (i, i + rot_dim/2)) */

void exl_cpu_rope(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                  int32_t rot_dim, const float *inv_freq, float attn_factor) {
    int32_t half = rot_dim / 2;
    float cs[512], sn[512];
    for (int32_t r = 0; r < rows; r++) {
        for (int32_t i = 0; i < half && i < 512; i++) {
            float t = (float)pos[r] * inv_freq[i];
            cs[i] = cosf(t) * attn_factor;
            sn[i] = sinf(t) * attn_factor;
        }
        for (int32_t h = 0; h < n_heads; h++) {
            float *v = x + ((int64_t)r * n_heads + h) * head_dim;
            for (int32_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * cs[i] - b * sn[i];
                v[i + half] = b * cs[i] + a * sn[i];
            }
        }
    }
}

/* ---- glu: gate = act(gate) * up */

typedef struct {
    float *gate;
    const float *up;
    int64_t n;
    int act;
} glu_job;

static void glu_task(void *p, int ti, int tn) {
    const glu_job *j = p;
    long i0, i1;
    exl_split_range(j->n, ti, tn, 16, &i0, &i1);
    for (long i = i0; i < i1; i++) {
        float g = j->gate[i], a;
        if (j->act == 0) /* silu */
            a = g / (1.0f + expf(-g));
        else if (j->act == 1) /* gelu, tanh approximation */
            a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
        else /* gelu, exact */
            a = 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
        j->gate[i] = a * j->up[i];
    }
}

void exl_cpu_glu(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act) {
    glu_job j = {gate, up, (int64_t)rows * width, act};
    exl_pool_run_work(exl_cpu(be)->pool, glu_task, &j, j.n * 16);
}

/* ---- add, gather, copy_cols */

void exl_cpu_add(exl_backend *be, float *x, const float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] += y[i];
}

void exl_cpu_gather_rows(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n, int32_t width) {
    for (int32_t i = 0; i < n; i++)
        memcpy(out + (int64_t)i * width, x + (int64_t)idx[i] * width, (size_t)width * sizeof(float));
}

void exl_cpu_copy_cols(exl_backend *be, float *out, const float *x, int32_t rows, int32_t width, int32_t x_width,
                       int32_t col) {
    for (int32_t r = 0; r < rows; r++)
        memcpy(out + (int64_t)r * width, x + (int64_t)r * x_width + col, (size_t)width * sizeof(float));
}

/* ---- softcap, row_gate */

void exl_cpu_softcap(exl_backend *be, float *x, int64_t n, float cap) {
    for (int64_t i = 0; i < n; i++)
        x[i] = cap * tanhf(x[i] / cap);
}

void exl_cpu_row_gate(exl_backend *be, float *x, const float *g, int32_t rows, int32_t width) {
    for (int32_t r = 0; r < rows; r++) {
        float s = 1.0f / (1.0f + expf(-g[r]));
        for (int32_t i = 0; i < width; i++)
            x[(int64_t)r * width + i] *= s;
    }
}
