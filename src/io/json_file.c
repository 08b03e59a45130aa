/* json_file.c - whole-file reads and JSON parsing with located errors. */
#include "io/json_file.h"

#include "base/alloc.h"
#include "base/error.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_TEXT_FILE (1u << 30)

int exl_file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

char *exl_path_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = exl_malloc(a + b + 2);
    if (!p)
        return NULL;
    memcpy(p, dir, a);
    size_t i = a;
    if (a && dir[a - 1] != '/')
        p[i++] = '/';
    memcpy(p + i, name, b + 1);
    return p;
}

exl_status exl_file_read(const char *path, char **data, size_t *len) {
    *data = NULL;
    FILE *fp = fopen(path, "rb");
    if (!fp)
        return exl_fail(EXL_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(fp), &sb) != 0 || !S_ISREG(sb.st_mode) || (unsigned long long)sb.st_size > MAX_TEXT_FILE) {
        fclose(fp);
        return exl_fail(EXL_ERR_IO, "%s: not a regular file of a readable size", path);
    }
    size_t n = (size_t)sb.st_size;
    char *buf = exl_malloc(n + 1);
    if (!buf) {
        fclose(fp);
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t got = fread(buf, 1, n, fp);
    fclose(fp);
    if (got != n) {
        exl_free(buf);
        return exl_fail(EXL_ERR_IO, "%s: short read", path);
    }
    buf[n] = 0;
    *data = buf;
    if (len)
        *len = n;
    return EXL_OK;
}

exl_status exl_json_parse(const char *name, const char *text, size_t len, cJSON **out) {
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!j) {
        size_t at = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        int line = 1, col = 1;
        for (size_t i = 0; i < at; i++) {
            if (text[i] == '\n') {
                line++;
                col = 1;
            } else {
                col++;
            }
        }
        return exl_fail(EXL_ERR_FORMAT, "%s: invalid JSON near line %d, column %d", name, line, col);
    }
    *out = j;
    return EXL_OK;
}

exl_status exl_json_read_file(const char *path, cJSON **out) {
    *out = NULL;
    char *text;
    size_t len;
    EXL_TRY(exl_file_read(path, &text, &len));
    exl_status st = exl_json_parse(path, text, len, out);
    exl_free(text);
    return st;
}
