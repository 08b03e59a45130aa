/* fuzz_quant.c - libFuzzer target for the EXL2 / GPTQ loaders and the fused CPU kernels.
 *
 * The first bytes choose the format, sizes, code width, group size and which tensors are
 * built consistently (a valid permutation, a group table that adds up, in-range group
 * indices, right shapes) or straight from the input; the rest of the input fills the
 * tensors. The tensors go into an in-memory weight set as layer "l". Loading must fail
 * cleanly or accept a layer that then dequantizes and runs through the CPU kernels of
 * every ISA without touching memory outside its tensors (ASan). */
#include "fuzz.h"
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "format/quant.h"
#include "io/weights.h"

/* the tensors' bytes, owned here (exl_st_tensor's data is const: it points into mappings) */
static uint8_t *owned[16];

typedef struct {
    const uint8_t *p;
    size_t n, i;
} src_bytes;

static uint8_t next(src_bytes *s) { return s->n ? s->p[s->i++ % s->n] : 0; }

static exl_st_tensor *add(exl_st_tensor *ts, int *n, char *name, exl_dtype dt, int nd, int64_t d0, int64_t d1,
                          src_bytes *in) {
    exl_st_tensor *t = &ts[(*n)++];
    memset(t, 0, sizeof *t);
    t->name = name;
    t->dtype = dt;
    t->n_dims = nd;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->nbytes = (uint64_t)(d0 * (nd > 1 ? d1 : 1)) * exl_dtype_size(dt);
    uint8_t *d = owned[*n - 1] = malloc(t->nbytes ? t->nbytes : 1);
    for (uint64_t i = 0; i < t->nbytes; i++)
        d[i] = next(in);
    t->data = d;
    t->path = "fuzz.safetensors";
    return t;
}

static void run_layer(const exl_linear_src *src) {
    int64_t K = src->in_features, N = src->out_features;
    float *w = malloc((size_t)(K * N) * sizeof *w), *x = malloc((size_t)(5 * K) * sizeof *x);
    float *y = malloc((size_t)(5 * N) * sizeof *y);
    for (int64_t i = 0; i < 5 * K; i++)
        x[i] = (float)(i % 7) - 3.0f;
    exl_linear_dequant(src, w);
    const char *isas[] = {"scalar", "avx2", "avx512"};
    for (int i = 0; i < 3; i++) {
        setenv("EXL_CPU_ISA", isas[i], 1);
        exl_backend *be;
        exl_linear *lin;
        if (exl_backend_cpu_init(1, &be) != EXL_OK)
            continue;
        if (be->ops->linear_init(be, src, &lin) == EXL_OK) {
            be->ops->matmul(be, y, x, lin, 1);
            be->ops->matmul(be, y, x, lin, 5);
            be->ops->linear_free(be, lin);
        }
        be->ops->destroy(be);
    }
    free(w);
    free(x);
    free(y);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 8)
        return 0;
    src_bytes in = {data + 8, size - 8, 0};
    int exl2 = data[0] & 1, consistent = data[0] >> 1;
    int64_t K = 32 * (1 + data[1] % 6), N = 8 * (1 + data[2] % 10);
    static const int widths[] = {2, 3, 4, 5, 6, 8, 1, 7};
    exl_st_tensor ts[8];
    int n = 0;
    exl_linear_src src = {0};
    src.in_features = K;
    src.out_features = N;
    src.name = "l";
    exl_status st;
    exl_weights ws = {0};
    exl_st_file file = {0};
    exl_st_file *files[1] = {&file};
    file.path = "fuzz.safetensors";
    ws.files = files;
    ws.n_files = 1;
    if (exl2) {
        int64_t Np = (N + 31) / 32 * 32, G = 1 + data[3] % 6;
        int64_t Q = 0;
        int16_t groups[12];
        for (int64_t g = 0, rows_left = K; g < G; g++) { /* a table that adds up when rows allow */
            int b = widths[data[4 + g % 4] % (consistent & 1 ? 6 : 8)];
            int64_t rows = g + 1 < G ? 32 * (1 + data[5] % 2) : rows_left;
            rows = rows > rows_left ? rows_left : rows;
            groups[2 * g] = (int16_t)b;
            groups[2 * g + 1] = (int16_t)Q;
            Q += (rows * b + 31) / 32;
            rows_left -= rows;
        }
        add(ts, &n, "l.q_groups", EXL_DTYPE_I16, 1, 2 * G + (consistent & 8 ? 0 : data[6] % 2), 0, &in);
        if (consistent & 2)
            memcpy(owned[0], groups, (size_t)(2 * G) * 2);
        exl_st_tensor *inv = add(ts, &n, "l.q_invperm", EXL_DTYPE_I32, 1, K, 0, &in);
        if (consistent & 4) {
            int32_t *p = (int32_t *)(void *)owned[inv - ts];
            for (int64_t k = 0; k < K; k++)
                p[k] = (int32_t)k;
            for (int64_t k = K - 1; k > 0; k--) {
                int64_t j = next(&in) % (k + 1);
                int32_t t = p[k];
                p[k] = p[j];
                p[j] = t;
            }
        }
        add(ts, &n, "l.q_scale", EXL_DTYPE_I32, 2, G, Np / 8, &in);
        add(ts, &n, "l.q_scale_max", EXL_DTYPE_F16, 1, G, 0, &in);
        add(ts, &n, "l.q_weight", EXL_DTYPE_I32, 2, Q > 0 ? Q : 1, Np, &in);
        file.tensors = ts;
        file.n_tensors = n;
        st = exl_exl2_load(&ws, "l", &src);
    } else {
        exl_quant_config q = {0};
        q.present = 1;
        memcpy(q.method, "gptq", 5);
        q.bits = widths[data[3] % 8];
        q.group_size = data[4] % 3 == 0 ? -1 : 8 * (1 + data[4] % 20);
        q.gptq_v2 = data[5] & 1;
        int bits = q.bits;
        int64_t gs = q.group_size < 0 ? K : q.group_size, G = (K + gs - 1) / gs;
        if (data[6] & 1) {
            exl_st_tensor *gi = add(ts, &n, "l.g_idx", EXL_DTYPE_I32, 1, K, 0, &in);
            if (consistent & 4)
                for (int64_t k = 0; k < K; k++)
                    ((int32_t *)(void *)owned[gi - ts])[k] =
                        (int32_t)((uint32_t)((int32_t *)(void *)owned[gi - ts])[k] % (uint32_t)G);
        }
        int64_t wrows = K * bits / 32 + (consistent & 8 ? 0 : data[7] % 2);
        add(ts, &n, "l.qweight", EXL_DTYPE_I32, 2, wrows > 0 ? wrows : 1, N, &in);
        add(ts, &n, "l.qzeros", EXL_DTYPE_I32, 2, G, N * bits / 32 > 0 ? N * bits / 32 : 1, &in);
        add(ts, &n, "l.scales", EXL_DTYPE_F16, 2, G, N, &in);
        file.tensors = ts;
        file.n_tensors = n;
        st = exl_gptq_load(&ws, &q, "l", &src);
    }
    if (st == EXL_OK)
        run_layer(&src);
    for (int i = 0; i < n; i++)
        free(owned[i]);
    return 0;
}
