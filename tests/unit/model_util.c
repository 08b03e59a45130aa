/* model_util.c - write converted, sharded or broken copies of model directories for tests. */
#include "model_util.h"
#include "test.h"

#include "base/half.h"
#include "io/safetensors.h"
#include "io/weights.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

char *mu_read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)len + 1);
    if (buf && fread(buf, 1, (size_t)len, f) != (size_t)len) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) {
        buf[len] = 0;
        if (n)
            *n = (size_t)len;
    }
    return buf;
}

int mu_write_file(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    int ok = fwrite(data, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

int mu_copy_file(const char *src, const char *dst) {
    size_t n;
    char *buf = mu_read_file(src, &n);
    if (!buf)
        return -1;
    int r = mu_write_file(dst, buf, n);
    free(buf);
    return r;
}

static void *convert(const exl_st_tensor *t, exl_dtype to) {
    int64_t n = exl_st_numel(t);
    void *out = malloc((size_t)(n ? n : 1) * exl_dtype_size(to));
    for (int64_t i = 0; out && i < n; i++) {
        float v = t->dtype == EXL_DTYPE_F32   ? ((const float *)t->data)[i]
                  : t->dtype == EXL_DTYPE_F16 ? exl_f16_to_f32(((const uint16_t *)t->data)[i])
                                              : exl_bf16_to_f32(((const uint16_t *)t->data)[i]);
        if (to == EXL_DTYPE_F32)
            ((float *)out)[i] = v;
        else if (to == EXL_DTYPE_F16)
            ((uint16_t *)out)[i] = exl_f32_to_f16(v);
        else
            ((uint16_t *)out)[i] = exl_f32_to_bf16(v);
    }
    return out;
}

exl_status mu_convert_model(const char *src_dir, const char *dst_dir, exl_dtype dtype, int n_shards) {
    char a[4096], b[4096];
    snprintf(a, sizeof a, "%s/config.json", src_dir);
    snprintf(b, sizeof b, "%s/config.json", dst_dir);
    if (mu_copy_file(a, b))
        return EXL_ERR_IO;
    exl_weights *w;
    exl_status st = exl_weights_open(src_dir, &w);
    if (st != EXL_OK)
        return st;
    const exl_st_file *f = w->files[0];
    void **bufs = calloc((size_t)f->n_tensors, sizeof *bufs);
    FILE *index = NULL;
    if (n_shards > 1) {
        snprintf(b, sizeof b, "%s/model.safetensors.index.json", dst_dir);
        index = fopen(b, "w");
        fprintf(index, "{\"metadata\": {}, \"weight_map\": {");
    }
    for (int s = 0; s < n_shards && st == EXL_OK; s++) {
        exl_st_writer *wr;
        exl_st_writer_init(&wr);
        char shard[256];
        if (n_shards > 1)
            snprintf(shard, sizeof shard, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        else
            snprintf(shard, sizeof shard, "model.safetensors");
        for (int i = s; i < f->n_tensors; i += n_shards) {
            const exl_st_tensor *t = &f->tensors[i];
            int is_float = t->dtype == EXL_DTYPE_F32 || t->dtype == EXL_DTYPE_F16 || t->dtype == EXL_DTYPE_BF16;
            const void *data = t->data;
            if (is_float)
                data = bufs[i] = convert(t, dtype);
            exl_st_writer_add(wr, t->name, is_float ? dtype : t->dtype, t->n_dims, t->shape, data);
            if (index)
                fprintf(index, "%s\"%s\": \"%s\"", i ? ", " : "", t->name, shard);
        }
        snprintf(b, sizeof b, "%s/%s", dst_dir, shard);
        st = exl_st_writer_write(wr, b);
        exl_st_writer_free(wr);
    }
    if (index) {
        fprintf(index, "}}\n");
        fclose(index);
    }
    for (int i = 0; i < f->n_tensors; i++)
        free(bufs[i]);
    free(bufs);
    exl_weights_close(w);
    return st;
}

exl_quantize_params mu_quantize_params_dir(const char *in, const char *out, int32_t rows, int32_t length) {
    static char cal[1024];
    static const char *cal_list[1];
    snprintf(cal, sizeof cal, "%s", exl_test_shared("data/calibration/tiny.utf8"));
    cal_list[0] = cal;
    exl_quantize_params p = exl_quantize_default_params();
    p.in_dir = in;
    p.out_dir = out;
    p.calibration = cal_list;
    p.n_calibration = 1;
    p.rows = rows;
    p.length = length;
    p.n_threads = 2;
    p.device = EXL_DEVICE_CPU;
    return p;
}

exl_quantize_params mu_quantize_params(const char *model, const char *out, int32_t rows, int32_t length) {
    static char in[1024];
    snprintf(in, sizeof in, "%s/%s", exl_test_shared("models"), model);
    return mu_quantize_params_dir(in, out, rows, length);
}
