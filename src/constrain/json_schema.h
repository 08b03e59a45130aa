/* json_schema.h - a JSON Schema as GBNF text whose root matches the JSON documents the schema
 * accepts (compact or indented, a little whitespace between tokens).
 *
 * The subset is the one OpenAI's strict structured outputs take: objects (properties, required,
 * additionalProperties false; properties come in their declared order), arrays (items, minItems,
 * maxItems), enum, const, type (one or a list) string / number / integer / boolean / null /
 * object / array, anyOf, $defs / definitions with $ref ("#", "#/$defs/x", "#/definitions/x",
 * recursion allowed), string minLength / maxLength, integer minimum / maximum (and the exclusive
 * forms); annotations (title, description, default, examples, $schema, $id, $comment) are
 * ignored. Strict: any other keyword is an error naming it and where it is. Lax: other keywords
 * are ignored (the output is then held to the part of the schema understood), oneOf is read as
 * anyOf, additionalProperties other than false with properties is read as false.
 * Integers have at most 16 digits and fractions at most 16, so unbounded numbers stay finite. */
#ifndef EXL_CONSTRAIN_JSON_SCHEMA_H
#define EXL_CONSTRAIN_JSON_SCHEMA_H

#include "base/str.h"
#include "exl.h"

#include <cjson/cJSON.h>
#include <stddef.h>

/* Append the grammar of the schema in src[0..len) (JSON text) to out. */
exl_status exl_json_schema_to_gbnf(const char *src, size_t len, int strict, exl_str *out);
/* The same from a parsed schema. */
exl_status exl_json_schema_gbnf(const cJSON *schema, int strict, exl_str *out);
/* For grammars that embed several schemas: the schema's rules only, every name prefixed (its start
 * rule is <prefix>root), without the shared json-* rules, which exl_json_schema_gbnf_shared writes
 * once (all of them: json-ws, json-char, json-string, json-integer, json-number, json-value,
 * json-object, json-array). */
exl_status exl_json_schema_gbnf_part(const cJSON *schema, int strict, const char *prefix, exl_str *out);
exl_status exl_json_schema_gbnf_shared(exl_str *out);

#endif
