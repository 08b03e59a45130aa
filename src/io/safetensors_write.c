/* safetensors_write.c - write tensors to a safetensors file (logits dumps, test models). */
#include "io/safetensors.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/str.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

typedef struct {
    char *name;
    exl_dtype dtype;
    int n_dims;
    int64_t shape[EXL_MAX_DIMS];
    const void *data;
    uint64_t nbytes;
} pending_tensor;

struct exl_st_writer {
    pending_tensor *t;
    int n, cap;
    int format_pt;
};

void exl_st_writer_format_pt(exl_st_writer *w) { w->format_pt = 1; }

exl_status exl_st_writer_init(exl_st_writer **out) {
    *out = exl_calloc(1, sizeof **out);
    return *out ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "safetensors writer: out of memory");
}

exl_status exl_st_writer_add(exl_st_writer *w, const char *name, exl_dtype dtype, int n_dims, const int64_t *shape,
                             const void *data) {
    if (n_dims < 0 || n_dims > EXL_MAX_DIMS)
        return exl_fail(EXL_ERR_ARG, "safetensors writer: %s: bad rank %d", name, n_dims);
    if (w->n == w->cap) {
        int cap = w->cap ? 2 * w->cap : 16;
        pending_tensor *t = exl_realloc(w->t, (size_t)cap * sizeof *t);
        if (!t)
            return exl_fail(EXL_ERR_NOMEM, "safetensors writer: out of memory");
        w->t = t;
        w->cap = cap;
    }
    pending_tensor *t = &w->t[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = exl_strdup(name)))
        return exl_fail(EXL_ERR_NOMEM, "safetensors writer: out of memory");
    t->dtype = dtype;
    t->n_dims = n_dims;
    uint64_t numel = 1;
    for (int i = 0; i < n_dims; i++) {
        t->shape[i] = shape[i];
        numel *= (uint64_t)shape[i];
    }
    t->data = data;
    t->nbytes = numel * exl_dtype_size(dtype);
    w->n++;
    return EXL_OK;
}

exl_status exl_st_writer_write(exl_st_writer *w, const char *path) {
    exl_str h = EXL_STR_INIT;
    uint64_t off = 0;
    int bad = exl_str_putc(&h, '{');
    if (w->format_pt)
        bad |= exl_str_printf(&h, "\"__metadata__\":{\"format\":\"pt\"}%s", w->n ? "," : "");
    for (int i = 0; i < w->n; i++) {
        pending_tensor *t = &w->t[i];
        bad |= exl_str_printf(&h, "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[", i ? "," : "", t->name,
                              exl_dtype_name(t->dtype));
        for (int d = 0; d < t->n_dims; d++)
            bad |= exl_str_printf(&h, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        bad |= exl_str_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)off,
                              (unsigned long long)(off + t->nbytes));
        off += t->nbytes;
    }
    bad |= exl_str_putc(&h, '}');
    while (!bad && h.len % 8)
        bad |= exl_str_putc(&h, ' ');
    if (bad) {
        exl_str_free(&h);
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory building the header", path);
    }
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        exl_str_free(&h);
        return exl_fail(EXL_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    }
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)((uint64_t)h.len >> (8 * i));
    int ok = fwrite(len, 1, 8, fp) == 8 && fwrite(h.data, 1, h.len, fp) == h.len;
    for (int i = 0; ok && i < w->n; i++)
        ok = fwrite(w->t[i].data, 1, w->t[i].nbytes, fp) == w->t[i].nbytes;
    ok = (fclose(fp) == 0) && ok;
    exl_str_free(&h);
    return ok ? EXL_OK : exl_fail(EXL_ERR_IO, "%s: write failed: %s", path, strerror(errno));
}

void exl_st_writer_free(exl_st_writer *w) {
    if (!w)
        return;
    for (int i = 0; i < w->n; i++)
        exl_free(w->t[i].name);
    exl_free(w->t);
    exl_free(w);
}

exl_status exl_tensor_save(const char *path, const char *name, const float *data, int32_t rows, int32_t cols) {
    exl_st_writer *w;
    int64_t shape[2] = {rows, cols};
    EXL_TRY(exl_st_writer_init(&w));
    exl_status st = exl_st_writer_add(w, name, EXL_DTYPE_F32, 2, shape, data);
    if (st == EXL_OK)
        st = exl_st_writer_write(w, path);
    exl_st_writer_free(w);
    return st;
}
