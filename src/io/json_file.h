/* json_file.h - read a whole JSON file with errors that name the file. */
#ifndef EXL_IO_JSON_FILE_H
#define EXL_IO_JSON_FILE_H

#include "exl.h"

#include <cjson/cJSON.h>

/* Parse path as JSON. A missing file is EXL_ERR_IO; malformed JSON is EXL_ERR_FORMAT
 * with the line and column of the error. */
exl_status exl_json_read_file(const char *path, cJSON **out);
/* Same for text already in memory; name is used in messages. */
exl_status exl_json_parse(const char *name, const char *text, size_t len, cJSON **out);
/* Read a whole file (NUL-terminated); free with exl_free. */
exl_status exl_file_read(const char *path, char **data, size_t *len);
int exl_file_exists(const char *path);
/* "dir/name" into a newly allocated string (NULL on allocation failure). */
char *exl_path_join(const char *dir, const char *name);

#endif
