/* cpu_lora.c - LoRA updates on the CPU: each row's adapters (graph.h: lora), for each projection x' · A^T (x' the
 * input as given, normed, or through the GLU) into the use's scratch, then that times Bt, weighted, added to the row's output; rows split across the worker threads. */
#include "backend/cpu/cpu.h"

#include <math.h>

typedef struct lora_task {
    const exl_lora_node *n;
} lora_task;

/* element i of row r's input as the node defines it (inv: the row's 1 / rms with a norm) */
static float input_at(const exl_lora_node *n, const float *x, const float *up, int32_t i, float inv) {
    if (n->norm)
        return n->norm->v[i] * (x[i] * inv);
    if (!up)
        return x[i];
    float g = x[i];
    if (n->act == 0) /* silu */
        g = g / (1.0f + expf(-g));
    else if (n->act == 1) /* gelu, tanh approximation */
        g = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    else /* gelu, exact */
        g = 0.5f * g * (1.0f + erff(g * 0.7071067811865476f));
    return g * up[i];
}

/* the updates of use u (row r) added to each output */
static void apply_use(const exl_lora_node *n, int32_t u, int32_t r) {
    const float *x = n->x + (int64_t)r * n->in_features, *up = n->up ? n->up + (int64_t)r * n->in_features : NULL;
    float inv = 1;
    if (n->norm) {
        double ss = 0;
        for (int32_t i = 0; i < n->in_features; i++)
            ss += (double)x[i] * x[i];
        inv = 1.0f / sqrtf((float)(ss / n->in_features) + n->eps);
    }
    for (int32_t o = 0; o < n->n_out; o++) {
        const exl_lora_factors *f = &n->factors[o][n->use_slot[u]];
        const int32_t width = n->out_features[o];
        float *t = n->t + ((int64_t)u * n->n_out + o) * n->max_rank, *out = n->out[o] + (int64_t)r * width;
        for (int32_t j = 0; j < f->rank; j++) {
            const float *a = f->a + (int64_t)j * n->in_features;
            float s = 0;
            for (int32_t i = 0; i < n->in_features; i++)
                s += input_at(n, x, up, i, inv) * a[i];
            t[j] = s * n->use_scale[u];
        }
        for (int32_t j = 0; j < f->rank; j++) {
            const float *bt = f->bt + (int64_t)j * width;
            for (int32_t c = 0; c < width; c++)
                out[c] += t[j] * bt[c];
        }
    }
}

static void lora_rows(void *ctx, int index, int count) {
    const exl_lora_node *n = ((const lora_task *)ctx)->n;
    long begin, end;
    exl_split_range(n->rows, index, count, 1, &begin, &end);
    for (long r = begin; r < end; r++)
        for (int32_t u = n->row_uses[r]; u < n->row_uses[r + 1]; u++)
            apply_use(n, u, (int32_t)r);
}

void exl_cpu_lora(exl_backend *be, const exl_lora_node *n) {
    lora_task task = {n};
    int64_t width = 0;
    for (int32_t o = 0; o < n->n_out; o++)
        width += n->out_features[o];
    int64_t work = (int64_t)n->n_uses * n->max_rank * (n->n_out * (int64_t)n->in_features + width);
    exl_pool_run_work(exl_cpu(be)->pool, lora_rows, &task, work);
}
