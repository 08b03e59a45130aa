/* weights.c - open a model's safetensors (single or sharded) and look tensors up by name. */
#include "io/weights.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/notice.h"
#include "base/str.h"
#include "io/json_file.h"

#include <dirent.h>
#include <stdlib.h>
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

/* The shard file named by a weight_map entry, checked to be a plain name in the model directory. */
static exl_status shard_name(const char *index_path, const cJSON *it) {
    if (!cJSON_IsString(it) || strchr(it->valuestring, '/') || !strcmp(it->valuestring, "..") || !it->valuestring[0])
        return exl_fail(EXL_ERR_FORMAT, "%s: weight_map entry '%s' is not a file name in the model directory",
                        index_path, it->string);
    return EXL_OK;
}

/* The index's weight_map, and the first shard it names that is not in dir (*missing, NULL if all are there;
 * points into *root). */
static exl_status read_index(const char *dir, const char *index_path, cJSON **root, const cJSON **map,
                             const char **missing) {
    *missing = NULL;
    EXL_TRY(exl_json_read_file(index_path, root));
    *map = cJSON_GetObjectItemCaseSensitive(*root, "weight_map");
    if (!cJSON_IsObject(*map) || !(*map)->child)
        return exl_fail(EXL_ERR_FORMAT, "%s: missing or empty \"weight_map\"", index_path);
    for (const cJSON *it = (*map)->child; it && !*missing; it = it->next) {
        EXL_TRY(shard_name(index_path, it));
        char *path = exl_path_join(dir, it->valuestring);
        if (!path)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        if (!exl_file_exists(path))
            *missing = it->valuestring;
        exl_free(path);
    }
    return EXL_OK;
}

/* Open every shard the index names; each must hold the tensors listed for it. */
static exl_status open_shards(exl_weights *w, const char *dir, const char *index_path, const cJSON *map) {
    for (const cJSON *it = map->child; it; it = it->next) {
        char *path = exl_path_join(dir, it->valuestring);
        if (!path)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        exl_status st = add_file(w, path);
        exl_free(path);
        EXL_TRY(st);
        if (!exl_weights_find(w, it->string))
            return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s' is listed for %s but that file does not hold it",
                            index_path, it->string, it->valuestring);
    }
    return EXL_OK;
}

static int is_safetensors(const char *name) {
    size_t n = strlen(name);
    return n > 12 && !strcmp(name + n - 12, ".safetensors");
}

static int compare_names(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void free_names(char **names, int count) {
    for (int i = 0; i < count; i++)
        exl_free(names[i]);
    exl_free(names);
}

/* The names of dir's *.safetensors files, sorted. */
static exl_status list_safetensors(const char *dir, char ***out, int *count) {
    *out = NULL;
    *count = 0;
    DIR *d = opendir(dir);
    if (!d)
        return exl_fail(EXL_ERR_IO, "%s: cannot open the model directory", dir);
    exl_status st = EXL_OK;
    struct dirent *e;
    while (st == EXL_OK && (e = readdir(d))) {
        if (!is_safetensors(e->d_name))
            continue;
        char **names = exl_realloc(*out, (size_t)(*count + 1) * sizeof *names);
        if (!names || !(names[*count] = exl_strdup(e->d_name))) {
            if (names)
                *out = names;
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
            break;
        }
        *out = names;
        (*count)++;
    }
    closedir(d);
    if (st != EXL_OK) {
        free_names(*out, *count);
        *out = NULL;
        *count = 0;
    } else if (*count > 1) {
        qsort(*out, (size_t)*count, sizeof **out, compare_names);
    }
    return st;
}

/* Without a usable index: the one *.safetensors file in dir (e.g. EXL2's output.safetensors), or with
 * all_files (the index was stale) every one of them. */
static exl_status open_directory(exl_weights *w, const char *dir, int all_files) {
    char **names;
    int count;
    EXL_TRY(list_safetensors(dir, &names, &count));
    exl_status st = EXL_OK;
    if (count == 0)
        st = exl_fail(EXL_ERR_IO, "%s: no model.safetensors, model.safetensors.index.json or other .safetensors file",
                      dir);
    else if (count > 1 && !all_files)
        st = exl_fail(EXL_ERR_FORMAT, "%s: several .safetensors files but no model.safetensors.index.json", dir);
    for (int i = 0; st == EXL_OK && i < count; i++) {
        char *path = exl_path_join(dir, names[i]);
        st = path ? add_file(w, path) : exl_fail(EXL_ERR_NOMEM, "out of memory");
        exl_free(path);
    }
    free_names(names, count);
    return st;
}

/* The index when every shard it names is there; else (ExLlamaV2 copies the source model's index into its output)
 * the directory's own .safetensors files, with a notice. */
static exl_status open_indexed(exl_weights *w, const char *dir, const char *index_path) {
    cJSON *root = NULL;
    const cJSON *map = NULL;
    const char *missing;
    exl_status st = read_index(dir, index_path, &root, &map, &missing);
    if (st == EXL_OK && !missing)
        st = open_shards(w, dir, index_path, map);
    else if (st == EXL_OK) {
        exl_notice("%s names %s, which is not in the directory: ignoring the index, loading the directory's "
                   ".safetensors files",
                   index_path, missing);
        st = open_directory(w, dir, 1);
    }
    cJSON_Delete(root);
    return st;
}

exl_status exl_weights_open(const char *dir, exl_weights **out) {
    *out = NULL;
    exl_weights *w = exl_calloc(1, sizeof *w);
    char *index = exl_path_join(dir, "model.safetensors.index.json");
    char *single = exl_path_join(dir, "model.safetensors");
    exl_status st;
    if (!w || !index || !single)
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    else if (exl_file_exists(index))
        st = open_indexed(w, dir, index);
    else if (exl_file_exists(single))
        st = add_file(w, single);
    else
        st = open_directory(w, dir, 0);
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
        return exl_fail(EXL_ERR_FORMAT, "%s: missing tensor '%s'", w->n_files ? w->files[0]->path : "weights", name);
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
