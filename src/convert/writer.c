/* writer.c - the quantizer's output: safetensors parts (one per finished layer, so a
 * killed run keeps its work), their merge into the model's one weights file, config.json
 * with quantization_config, and the model's other files copied as they are. */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "io/json_file.h"
#include "io/weights.h"

#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

exl_status exl_qz_part_init(exl_qz_part *p) {
    memset(p, 0, sizeof *p);
    return exl_st_writer_init(&p->w);
}

void exl_qz_part_free(exl_qz_part *p) {
    if (p->w)
        exl_st_writer_free(p->w);
    for (int32_t i = 0; i < p->n_owned; i++)
        exl_free(p->owned[i]);
    exl_free(p->owned);
    memset(p, 0, sizeof *p);
}

exl_status exl_qz_part_own(exl_qz_part *p, const char *name, int dtype, int n_dims, const int64_t *shape, void *data) {
    if (p->n_owned == p->cap_owned) {
        int32_t cap = p->cap_owned ? 2 * p->cap_owned : 32;
        void **o = exl_realloc(p->owned, (size_t)cap * sizeof *o);
        if (!o) {
            exl_free(data);
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        }
        p->owned = o;
        p->cap_owned = cap;
    }
    p->owned[p->n_owned++] = data;
    return exl_st_writer_add(p->w, name, (exl_dtype)dtype, n_dims, shape, data);
}

exl_status exl_qz_part_copy(exl_qz_part *p, const exl_weights *w, const char *name) {
    const exl_st_tensor *t = exl_weights_find(w, name);
    if (!t)
        return exl_fail(EXL_ERR_FORMAT, "missing tensor '%s'", name);
    return exl_st_writer_add(p->w, name, t->dtype, t->n_dims, t->shape, t->data);
}

exl_status exl_qz_part_write(exl_qz_part *p, const char *path) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    EXL_TRY(exl_st_writer_write(p->w, tmp));
    if (rename(tmp, path))
        return exl_fail(EXL_ERR_IO, "%s: cannot rename into place", path);
    return EXL_OK;
}

/* The tensors go in by element size, widest first (in part order within a size), as the
 * safetensors library lays them out: with the data section starting 8-aligned, every tensor
 * is then aligned to its element size, so readers that map the file can use it in place. */
exl_status exl_qz_merge(char *const *paths, int32_t n, const char *out_path) {
    exl_st_file **f = exl_calloc((size_t)n, sizeof *f);
    exl_st_writer *w = NULL;
    exl_status st = f ? exl_st_writer_init(&w) : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK)
        exl_st_writer_format_pt(w);
    for (int32_t i = 0; i < n && st == EXL_OK; i++)
        st = exl_st_open(paths[i], &f[i]);
    int64_t n_in = 0, n_out = 0;
    for (int32_t i = 0; i < n && st == EXL_OK; i++)
        n_in += f[i]->n_tensors;
    for (size_t size = 8; size >= 1 && st == EXL_OK; size /= 2)
        for (int32_t i = 0; i < n && st == EXL_OK; i++)
            for (int j = 0; st == EXL_OK && j < f[i]->n_tensors; j++) {
                const exl_st_tensor *t = &f[i]->tensors[j];
                if (exl_dtype_size(t->dtype) == size) {
                    st = exl_st_writer_add(w, t->name, t->dtype, t->n_dims, t->shape, t->data);
                    n_out++;
                }
            }
    if (st == EXL_OK && n_out != n_in)
        st = exl_fail(EXL_ERR_UNSUPPORTED, "%s: a tensor of the parts has an element size other than 1, 2, 4 or 8",
                      out_path);
    if (st == EXL_OK)
        st = exl_st_writer_write(w, out_path);
    if (w)
        exl_st_writer_free(w);
    for (int32_t i = 0; f && i < n; i++)
        if (f[i])
            exl_st_close(f[i]);
    exl_free(f);
    return st;
}

static int skipped(const char *name) {
    size_t n = strlen(name);
    static const char *const names[] = {"config.json", "quantize_config.json", "measurement.json",
                                        "model.safetensors.index.json"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(name, names[i]))
            return 1;
    return name[0] == '.' || (n > 12 && !strcmp(name + n - 12, ".safetensors")) ||
           (n > 4 && (!strcmp(name + n - 4, ".bin") || !strcmp(name + n - 4, ".pth")));
}

static exl_status copy_file(const char *src, const char *dst) {
    char *data;
    size_t len;
    EXL_TRY(exl_file_read(src, &data, &len));
    FILE *f = fopen(dst, "wb");
    int ok = f && fwrite(data, 1, len, f) == len;
    ok = f && !fclose(f) && ok;
    exl_free(data);
    return ok ? EXL_OK : exl_fail(EXL_ERR_IO, "%s: cannot write", dst);
}

exl_status exl_qz_copy_files(const char *in_dir, const char *out_dir) {
    DIR *d = opendir(in_dir);
    if (!d)
        return exl_fail(EXL_ERR_IO, "%s: cannot list the directory", in_dir);
    exl_status st = EXL_OK;
    struct dirent *e;
    while (st == EXL_OK && (e = readdir(d))) {
        if (skipped(e->d_name))
            continue;
        char *src = exl_path_join(in_dir, e->d_name), *dst = exl_path_join(out_dir, e->d_name);
        struct stat sb;
        if (!src || !dst)
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        else if (!stat(src, &sb) && S_ISREG(sb.st_mode))
            st = copy_file(src, dst);
        exl_free(src);
        exl_free(dst);
    }
    closedir(d);
    return st;
}

exl_status exl_qz_write_json(const cJSON *j, const char *path) {
    char *text = cJSON_Print(j);
    if (!text)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    int ok = f && fputs(text, f) >= 0;
    ok = f && !fclose(f) && ok;
    cJSON_free(text);
    if (!ok || rename(tmp, path))
        return exl_fail(EXL_ERR_IO, "%s: cannot write", path);
    return EXL_OK;
}

exl_status exl_qz_write_config(const char *in_dir, const char *out_dir, cJSON *q) {
    char *in = exl_path_join(in_dir, "config.json"), *out = exl_path_join(out_dir, "config.json");
    cJSON *root = NULL;
    exl_status st = in && out ? exl_json_read_file(in, &root) : exl_fail(EXL_ERR_NOMEM, "out of memory");
    if (st == EXL_OK) {
        cJSON_DeleteItemFromObjectCaseSensitive(root, "quantization_config");
        cJSON_AddItemToObject(root, "quantization_config", q);
        q = NULL;
        st = exl_qz_write_json(root, out);
    }
    cJSON_Delete(root);
    cJSON_Delete(q);
    exl_free(in);
    exl_free(out);
    return st;
}
