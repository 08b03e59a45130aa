/* weights.c - open a model's safetensors (single or sharded) and look tensors up by name. */
#include "io/weights.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/str.h"
#include "io/json_file.h"

#include <dirent.h>
#include <string.h>

static exl_status add_file(exl_weights *w, const char *path) {
    for (int i = 0; i < w->n_files; i++)
        if (!strcmp(w->files[i]->path, path))
            return EXL_OK;
    exl_st_file **files = exl_realloc(w->files, (size_t)(w->n_files + 1) * sizeof *files);
    if (!files)
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    w->files = files;
    EXL_TRY(exl_st_open(path, &w->files[w->n_files]));
    w->total_bytes += w->files[w->n_files]->size;
    w->n_files++;
    return EXL_OK;
}

static exl_status open_index(exl_weights *w, const char *dir, const char *index_path) {
    cJSON *root;
    EXL_TRY(exl_json_read_file(index_path, &root));
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    exl_status st = EXL_OK;
    if (!cJSON_IsObject(map) || !map->child)
        st = exl_fail(EXL_ERR_FORMAT, "%s: missing or empty \"weight_map\"", index_path);
    for (const cJSON *it = map ? map->child : NULL; it && st == EXL_OK; it = it->next) {
        if (!cJSON_IsString(it) || strchr(it->valuestring, '/') || !strcmp(it->valuestring, "..")) {
            st = exl_fail(EXL_ERR_FORMAT, "%s: weight_map entry '%s' is not a file name in the model directory",
                          index_path, it->string);
            break;
        }
        char *path = exl_path_join(dir, it->valuestring);
        if (!path) {
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
            break;
        }
        st = add_file(w, path);
        if (st == EXL_OK && !exl_weights_find(w, it->string))
            st = exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s' is listed for %s but that file does not hold it",
                          index_path, it->string, it->valuestring);
        exl_free(path);
    }
    cJSON_Delete(root);
    return st;
}

/* The one *.safetensors file in dir, if there is exactly one. */
static exl_status find_single(const char *dir, char **out) {
    *out = NULL;
    DIR *d = opendir(dir);
    if (!d)
        return exl_fail(EXL_ERR_IO, "%s: cannot open the model directory", dir);
    int count = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n > 12 && !strcmp(e->d_name + n - 12, ".safetensors")) {
            count++;
            exl_free(*out);
            *out = exl_path_join(dir, e->d_name);
        }
    }
    closedir(d);
    if (count == 1 && *out)
        return EXL_OK;
    exl_free(*out);
    *out = NULL;
    if (count == 0)
        return exl_fail(EXL_ERR_IO, "%s: no model.safetensors, model.safetensors.index.json or other .safetensors file",
                        dir);
    return exl_fail(EXL_ERR_FORMAT, "%s: several .safetensors files but no model.safetensors.index.json", dir);
}

exl_status exl_weights_open(const char *dir, exl_weights **out) {
    *out = NULL;
    exl_weights *w = exl_calloc(1, sizeof *w);
    char *index = exl_path_join(dir, "model.safetensors.index.json");
    char *single = exl_path_join(dir, "model.safetensors");
    exl_status st;
    if (!w || !index || !single) {
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    } else if (exl_file_exists(index)) {
        st = open_index(w, dir, index);
    } else if (exl_file_exists(single)) {
        st = add_file(w, single);
    } else {
        char *path;
        st = find_single(dir, &path);
        if (st == EXL_OK)
            st = add_file(w, path);
        exl_free(path);
    }
    exl_free(index);
    exl_free(single);
    if (st != EXL_OK) {
        exl_weights_close(w);
        return st;
    }
    *out = w;
    return EXL_OK;
}

void exl_weights_close(exl_weights *w) {
    if (!w)
        return;
    for (int i = 0; i < w->n_files; i++)
        exl_st_close(w->files[i]);
    exl_free(w->files);
    exl_free(w);
}

const exl_st_tensor *exl_weights_find(const exl_weights *w, const char *name) {
    for (int i = 0; i < w->n_files; i++) {
        const exl_st_tensor *t = exl_st_find(w->files[i], name);
        if (t)
            return t;
    }
    return NULL;
}

static void shape_str(exl_str *s, int n_dims, const int64_t *shape) {
    exl_str_putc(s, '[');
    for (int i = 0; i < n_dims; i++) {
        if (shape[i] < 0)
            exl_str_printf(s, "%s*", i ? ", " : "");
        else
            exl_str_printf(s, "%s%lld", i ? ", " : "", (long long)shape[i]);
    }
    exl_str_putc(s, ']');
}

exl_status exl_weights_get(const exl_weights *w, const char *name, unsigned allowed_dtypes, int n_dims,
                           const int64_t *shape, const exl_st_tensor **out) {
    const exl_st_tensor *t = exl_weights_find(w, name);
    *out = NULL;
    if (!t)
        return exl_fail(EXL_ERR_FORMAT, "%s: missing tensor '%s'", w->n_files ? w->files[0]->path : "weights",
                        name);
    if (!(allowed_dtypes & (1u << t->dtype)))
        return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s' has dtype %s, which is not valid for it", t->path, name,
                        exl_dtype_name(t->dtype));
    int ok = n_dims < 0 || t->n_dims == n_dims;
    for (int i = 0; ok && n_dims > 0 && i < n_dims; i++)
        ok = shape[i] < 0 || shape[i] == t->shape[i];
    if (!ok) {
        exl_str want = EXL_STR_INIT, got = EXL_STR_INIT;
        shape_str(&want, n_dims, shape);
        shape_str(&got, t->n_dims, t->shape);
        exl_status st = exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s' has shape %s, expected %s", t->path, name,
                                 got.data ? got.data : "?", want.data ? want.data : "?");
        exl_str_free(&want);
        exl_str_free(&got);
        return st;
    }
    *out = t;
    return EXL_OK;
}
