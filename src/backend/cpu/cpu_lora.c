/* cpu_lora.c - LoRA updates on the CPU: each row's adapters (graph.h: lora), for each projection x · A^T into the
 * use's scratch, then that times Bt, weighted, added to the row's output; rows split across the worker threads. */
#include "backend/cpu/cpu.h"

typedef struct lora_task {
    const exl_lora_node *n;
} lora_task;

/* the updates of use u (row r) added to each output */
static void apply_use(const exl_lora_node *n, int32_t u, int32_t r) {
    const float *x = n->x + (int64_t)r * n->in_features;
    for (int32_t o = 0; o < n->n_out; o++) {
        const exl_lora_factors *f = &n->factors[o][n->use_slot[u]];
        const int32_t width = n->out_features[o];
        float *t = n->t + ((int64_t)u * n->n_out + o) * n->max_rank, *out = n->out[o] + (int64_t)r * width;
        for (int32_t j = 0; j < f->rank; j++) {
            const float *a = f->a + (int64_t)j * n->in_features;
            float s = 0;
            for (int32_t i = 0; i < n->in_features; i++)
                s += x[i] * a[i];
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
