/* jinja.h - a Jinja-subset template interpreter for chat templates.
 *
 * The subset is what Hugging Face chat templates use, rendered the way transformers
 * does (trim_blocks and lstrip_blocks on, keep_trailing_newline off, loop controls,
 * `tojson` as Python json.dumps(ensure_ascii=False), `raise_exception`, `strftime_now`):
 *   statements  for (loop.*, else, tuple targets, `if` filter), if/elif/else, set (also
 *               `ns.attr` and block set), macro, break, continue, generation, raw
 *   expressions literals, list/dict/tuple displays, and/or/not, in/not in, is/is not
 *               tests, comparisons (chained), + - * / // % ** ~, ternary, attributes,
 *               subscripts, slices, calls with keyword arguments, filters
 * Values are none/undefined, bool, int, float, str, list, dict (string keys, insertion
 * ordered), namespace, macro and loop. Lists and dicts are immutable once built.
 *
 * Templates are hostile input: syntax errors say line:column and what was expected,
 * nesting is bounded at parse time, and rendering runs under step and size limits so
 * that no template can hang, exhaust memory or crash the caller. A parsed template is
 * read-only while rendering and may be rendered from several threads at once. */
#ifndef EXL_TOKENIZER_JINJA_H
#define EXL_TOKENIZER_JINJA_H

#include "exl.h"

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

typedef struct exl_jinja exl_jinja;

/* Bounds on one render; zero fields take the defaults below. */
typedef struct exl_jinja_limits {
    uint64_t max_steps; /* evaluated nodes + loop iterations + copied elements */
    size_t max_bytes;   /* the output, and any one string or list built on the way */
    int32_t max_calls;  /* nesting of macro calls */
} exl_jinja_limits;

#define EXL_JINJA_DEFAULT_STEPS 20000000u
#define EXL_JINJA_DEFAULT_BYTES ((size_t)64 << 20)
#define EXL_JINJA_DEFAULT_CALLS 64

/* Parse src[0..len). name is used in messages ("chat template" if NULL). Errors are
 * EXL_ERR_FORMAT with "name:line:col: ..." (or EXL_ERR_UNSUPPORTED for constructs
 * outside the subset, such as include and extends). */
exl_status exl_jinja_parse(const char *name, const char *src, size_t len, exl_jinja **out);
void exl_jinja_free(exl_jinja *t);

/* Render with the variables of context (a JSON object, or NULL). JSON numbers that are
 * integral and within +-2^53 become ints, others floats. *out is a NUL-terminated string
 * to free with exl_free. raise_exception(msg) fails with EXL_ERR_ARG and exactly msg as
 * the message; other errors carry "name:line:col: ". limits may be NULL. */
exl_status exl_jinja_render(const exl_jinja *t, const cJSON *context, const exl_jinja_limits *limits, char **out);

#endif
