/* safetensors.c - map a safetensors file and validate its header as hostile input. */
#include "io/safetensors.h"

#include "base/alloc.h"
#include "base/error.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_HEADER_BYTES (256u << 20)

static int cmp_tensor(const void *a, const void *b) {
    return strcmp(((const exl_st_tensor *)a)->name, ((const exl_st_tensor *)b)->name);
}

int64_t exl_st_numel(const exl_st_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->n_dims; i++)
        n *= t->shape[i];
    return n;
}

static void free_tensors(exl_st_file *f) {
    for (int i = 0; i < f->n_tensors; i++)
        exl_free(f->tensors[i].name);
    exl_free(f->tensors);
    f->tensors = NULL;
    f->n_tensors = 0;
}

/* A JSON number that is a non-negative integer representable exactly. */
static int json_uint(const cJSON *j, uint64_t *out) {
    if (!cJSON_IsNumber(j))
        return -1;
    double d = j->valuedouble;
    if (!(d >= 0) || d > 9007199254740992.0 || d != (double)(uint64_t)d)
        return -1;
    *out = (uint64_t)d;
    return 0;
}

static exl_status parse_tensor(const char *path, const cJSON *item, uint64_t data_size, exl_st_tensor *t) {
    const char *name = item->string;
    if (!cJSON_IsObject(item))
        return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s': header entry is not an object", path, name);
    const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(item, "dtype");
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(item, "shape");
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(item, "data_offsets");
    if (!cJSON_IsString(dtype) || exl_dtype_parse(dtype->valuestring, &t->dtype))
        return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s': missing or unknown dtype%s%s", path, name,
                        cJSON_IsString(dtype) ? " " : "", cJSON_IsString(dtype) ? dtype->valuestring : "");
    if (!cJSON_IsArray(shape))
        return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s': missing shape", path, name);
    int nd = cJSON_GetArraySize(shape);
    if (nd > EXL_MAX_DIMS)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: tensor '%s': %d dimensions (at most %d)", path, name, nd,
                        EXL_MAX_DIMS);
    t->n_dims = nd;
    uint64_t numel = 1;
    int overflow = 0;
    for (int i = 0; i < nd; i++) {
        uint64_t d;
        if (json_uint(cJSON_GetArrayItem(shape, i), &d) || d > INT64_MAX)
            return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s': shape[%d] is not a non-negative integer", path, name, i);
        t->shape[i] = (int64_t)d;
        if (d && numel > UINT64_MAX / d)
            overflow = 1;
        numel *= d;
    }
    uint64_t b, e;
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 || json_uint(cJSON_GetArrayItem(offs, 0), &b) ||
        json_uint(cJSON_GetArrayItem(offs, 1), &e) || b > e)
        return exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s': data_offsets must be [begin, end] with begin <= end", path,
                        name);
    if (e > data_size)
        return exl_fail(EXL_ERR_FORMAT,
                        "%s: tensor '%s': data_offsets [%llu, %llu] run past the end of the data (%llu bytes); "
                        "the file may be truncated",
                        path, name, (unsigned long long)b, (unsigned long long)e, (unsigned long long)data_size);
    uint64_t esz = exl_dtype_size(t->dtype);
    if (overflow || numel > UINT64_MAX / esz || numel * esz != e - b)
        return exl_fail(EXL_ERR_FORMAT,
                        "%s: tensor '%s': shape and dtype %s need %llu bytes but data_offsets span %llu", path, name,
                        exl_dtype_name(t->dtype), overflow ? 0ull : (unsigned long long)(numel * esz),
                        (unsigned long long)(e - b));
    t->offset = b;
    t->nbytes = e - b;
    return EXL_OK;
}

exl_status exl_st_parse(const char *path, const uint8_t *buf, size_t size, exl_st_file **out) {
    *out = NULL;
    if (size < 8)
        return exl_fail(EXL_ERR_FORMAT, "%s: file is %zu bytes, too short for a safetensors header", path, size);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--)
        hlen = hlen << 8 | buf[i];
    if (hlen > size - 8)
        return exl_fail(EXL_ERR_FORMAT, "%s: header length %llu runs past the end of the file (%zu bytes)", path,
                        (unsigned long long)hlen, size);
    if (hlen > MAX_HEADER_BYTES)
        return exl_fail(EXL_ERR_FORMAT, "%s: header length %llu is implausibly large", path, (unsigned long long)hlen);
    cJSON *root = cJSON_ParseWithLength((const char *)buf + 8, (size_t)hlen);
    if (!root || !cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return exl_fail(EXL_ERR_FORMAT, "%s: header is not a valid JSON object", path);
    }
    exl_st_file *f = exl_calloc(1, sizeof *f);
    int n = cJSON_GetArraySize(root);
    if (!f || !(f->path = exl_strdup(path)) || !(f->tensors = exl_calloc((size_t)n + 1, sizeof *f->tensors))) {
        cJSON_Delete(root);
        if (f)
            exl_free(f->path);
        exl_free(f);
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory reading the header", path);
    }
    uint64_t data_size = size - 8 - hlen;
    const uint8_t *data = buf + 8 + hlen;
    exl_status st = EXL_OK;
    for (const cJSON *it = root->child; it && st == EXL_OK; it = it->next) {
        if (!strcmp(it->string, "__metadata__")) {
            if (!cJSON_IsObject(it))
                st = exl_fail(EXL_ERR_FORMAT, "%s: __metadata__ is not an object", path);
            continue;
        }
        exl_st_tensor *t = &f->tensors[f->n_tensors];
        st = parse_tensor(path, it, data_size, t);
        if (st != EXL_OK)
            break;
        if (!(t->name = exl_strdup(it->string))) {
            st = exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
            break;
        }
        t->data = data + t->offset;
        t->path = f->path;
        f->n_tensors++;
    }
    cJSON_Delete(root);
    if (st == EXL_OK) {
        qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_tensor);
        for (int i = 1; i < f->n_tensors; i++)
            if (!strcmp(f->tensors[i - 1].name, f->tensors[i].name)) {
                st = exl_fail(EXL_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", path, f->tensors[i].name);
                break;
            }
    }
    if (st != EXL_OK) {
        free_tensors(f);
        exl_free(f->path);
        exl_free(f);
        return st;
    }
    *out = f;
    return EXL_OK;
}

/* Copy the tensors to one aligned block if any of them is misaligned for its type. */
static exl_status align_tensors(exl_st_file *f) {
    size_t total = 0;
    int misaligned = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        const exl_st_tensor *t = &f->tensors[i];
        misaligned |= (uintptr_t)t->data % exl_dtype_size(t->dtype) != 0;
        total += (t->nbytes + 63) / 64 * 64;
    }
    if (!misaligned)
        return EXL_OK;
    uint8_t *block = exl_malloc_aligned(total);
    if (!block)
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory copying misaligned tensors (%zu bytes)", f->path, total);
    size_t at = 0;
    for (int i = 0; i < f->n_tensors; i++) {
        exl_st_tensor *t = &f->tensors[i];
        memcpy(block + at, t->data, t->nbytes);
        t->data = block + at;
        at += (t->nbytes + 63) / 64 * 64;
    }
    f->aligned = block;
    return EXL_OK;
}

exl_status exl_st_open(const char *path, exl_st_file **out) {
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return exl_fail(EXL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return exl_fail(EXL_ERR_IO, "%s: not a regular file", path);
    }
    size_t size = (size_t)sb.st_size;
    if (size < 8) {
        close(fd);
        return exl_fail(EXL_ERR_FORMAT, "%s: file is %zu bytes, too short for a safetensors header", path, size);
    }
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return exl_fail(EXL_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
    exl_st_file *f;
    exl_status st = exl_st_parse(path, map, size, &f);
    if (st != EXL_OK) {
        munmap(map, size);
        return st;
    }
    f->map = map;
    f->size = size;
    if ((st = align_tensors(f)) != EXL_OK) {
        exl_st_close(f);
        return st;
    }
    *out = f;
    return EXL_OK;
}

void exl_st_close(exl_st_file *f) {
    if (!f)
        return;
    if (f->map)
        munmap(f->map, f->size);
    exl_free_aligned(f->aligned);
    free_tensors(f);
    exl_free(f->path);
    exl_free(f);
}

const exl_st_tensor *exl_st_find(const exl_st_file *f, const char *name) {
    int lo = 0, hi = f->n_tensors - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(f->tensors[mid].name, name);
        if (!c)
            return &f->tensors[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}
