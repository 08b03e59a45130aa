/* test_json_schema.c - the JSON Schema to grammar compiler: documents the schema accepts match and
 * others do not (escapes, unicode, numbers, nested arrays, empty objects, optional properties,
 * references), and keywords outside the strict subset are errors that name them. */
#include "test.h"

#include "constrain/constraint.h"
#include "constrain/json_schema.h"

#include <string.h>

static exl_constraint *schema(const char *src, int strict) {
    exl_constraint *c = NULL;
    exl_status st = exl_constraint_compile(strict ? EXL_CONSTRAINT_JSON_SCHEMA : EXL_CONSTRAINT_JSON_SCHEMA_LAX, src,
                                           strlen(src), &c);
    if (st != EXL_OK)
        fprintf(stderr, "    schema %s: %s\n", src, exl_last_error());
    return c;
}

static int matches(exl_constraint *c, const char *doc) {
    int32_t st;
    if (exl_matcher_walk(&c->matcher, c->matcher.start, doc, strlen(doc), &st) != EXL_OK)
        return 0;
    return st >= 0 && exl_matcher_accepting(&c->matcher, st);
}

typedef struct doc_case {
    const char *schema;
    const char *yes[8], *no[8];
} doc_case;

static void run_cases(const doc_case *cases, size_t n, int strict) {
    for (size_t i = 0; i < n; i++) {
        exl_constraint *c = schema(cases[i].schema, strict);
        CHECK_MSG(c, "case %zu", i);
        if (!c)
            continue;
        for (int k = 0; k < 8 && cases[i].yes[k]; k++)
            CHECK_MSG(matches(c, cases[i].yes[k]), "case %zu: %s should accept %s", i, cases[i].schema,
                      cases[i].yes[k]);
        for (int k = 0; k < 8 && cases[i].no[k]; k++)
            CHECK_MSG(!matches(c, cases[i].no[k]), "case %zu: %s should refuse %s", i, cases[i].schema, cases[i].no[k]);
        exl_constraint_free(c);
    }
}

EXL_TEST(scalars_strings_and_numbers) {
    static const doc_case cases[] = {
        {"{\"type\": \"string\"}",
         {"\"\"", "\"plain\"", "\"q\\\"uote\\\\ \\/ \\b\\f\\n\\r\\t\"", "\"\\u00e9\\uD83D\\uDE00\"",
          "\"caf\xc3\xa9 \xf0\x9f\x98\x80\""},
         {"plain", "\"a\nb\"", "\"\\x41\"", "\"\\u12\"", "\"open", "\"\xc3\"", "\"a\"b\""}},
        {"{\"type\": \"string\", \"minLength\": 2, \"maxLength\": 3}",
         {"\"ab\"", "\"\\n\\t\\\"\"", "\"\xe2\x82\xac\xe2\x82\xac\""},
         {"\"a\"", "\"abcd\"", "\"\""}},
        {"{\"type\": \"number\"}",
         {"0", "-0", "12.5", "-3.25e10", "1E-7", "9999999999999999", "0.0001"},
         {"01", "1.", ".5", "+1", "1e", "--1", "12345678901234567"}},
        {"{\"type\": \"integer\"}", {"0", "-17", "1234567890123456"}, {"1.0", "-", "00", "1e3"}},
        {"{\"type\": \"integer\", \"minimum\": -5, \"maximum\": 120}",
         {"-5", "0", "7", "99", "120"},
         {"-6", "121", "1000", "-0"}},
        {"{\"type\": \"integer\", \"exclusiveMinimum\": 0, \"exclusiveMaximum\": 10}", {"1", "9"}, {"0", "10"}},
        {"{\"type\": \"boolean\"}", {"true", "false"}, {"True", "1", "null"}},
        {"{\"type\": [\"string\", \"null\"]}", {"\"x\"", "null"}, {"1"}},
        {"{\"enum\": [\"red\", 7, null, {\"a\": [1]}, \"\\u00e9\\\"\"]}",
         {"\"red\"", "7", "null", "{\"a\":[1]}", "\"\xc3\xa9\\\"\""},
         {"\"blue\"", "\"Red\"", "{\"a\": [1]}"}},
        {"{\"const\": \"fixed\"}", {"\"fixed\""}, {"\"fixe\"", "fixed"}},
        {"{}", {"1", "\"s\"", "[1, {\"a\": null}]", "{}", "true"}, {"", "[1,]", "{\"a\"}"}},
    };
    run_cases(cases, sizeof cases / sizeof cases[0], 1);
}

EXL_TEST(objects_and_arrays) {
    static const doc_case cases[] = {
        {"{\"type\": \"object\", \"properties\": {}, \"additionalProperties\": false}",
         {"{}", "{ }", "{\n}"},
         {"{\"a\": 1}", "[]"}},
        {"{\"type\": \"object\"}", {"{}", "{\"any\": [1, 2], \"b\": {\"c\": \"d\"}}"}, {"{\"a\"}", "{1: 2}"}},
        {"{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}, \"b\": {\"type\": \"string\"}},"
         " \"required\": [\"a\", \"b\"], \"additionalProperties\": false}",
         {"{\"a\": 1, \"b\": \"x\"}", "{\"a\":1,\"b\":\"x\"}", "{\n  \"a\": 1,\n  \"b\": \"x\"\n}"},
         {"{\"b\": \"x\", \"a\": 1}", "{\"a\": 1}", "{\"a\": 1, \"b\": \"x\", \"c\": 2}", "{\"a\": 1, \"b\": 2}",
          "{\"a\": 1 \"b\": \"x\"}", "{\"a\": 1, \"b\": \"x\",}"}},
        /* optional properties: any subset, in order */
        {"{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}, \"b\": {\"type\": \"integer\"},"
         " \"c\": {\"type\": \"integer\"}}, \"additionalProperties\": false}",
         {"{}", "{\"a\": 1}", "{\"b\": 2}", "{\"c\": 3}", "{\"a\": 1, \"c\": 3}", "{\"b\": 2, \"c\": 3}",
          "{\"a\": 1, \"b\": 2, \"c\": 3}"},
         {"{\"c\": 3, \"a\": 1}", "{\"a\": 1,}", "{, \"a\": 1}", "{\"a\": 1, \"a\": 1}"}},
        {"{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}, \"b\": {\"type\": \"integer\"}},"
         " \"required\": [\"b\"], \"additionalProperties\": false}",
         {"{\"b\": 2}", "{\"a\": 1, \"b\": 2}"},
         {"{}", "{\"a\": 1}"}},
        {"{\"type\": \"array\", \"items\": {\"type\": \"array\", \"items\": {\"type\": \"integer\"}}, \"maxItems\": 2}",
         {"[]", "[[]]", "[[1, 2], [3]]", "[ [ ] , [1] ]"},
         {"[[1], [2], [3]]", "[1]", "[[1,]]", "[,]"}},
        {"{\"type\": \"array\", \"items\": {\"enum\": [\"x\", \"y\"]}, \"minItems\": 1, \"maxItems\": 3}",
         {"[\"x\"]", "[\"y\", \"x\", \"x\"]"},
         {"[]", "[\"x\", \"x\", \"x\", \"x\"]", "[\"z\"]"}},
        {"{\"type\": \"array\", \"maxItems\": 0}", {"[]"}, {"[1]"}},
        {"{\"type\": \"object\", \"additionalProperties\": {\"type\": \"integer\"}}",
         {"{}", "{\"x\": 1, \"y\": 2}"},
         {"{\"x\": \"1\"}"}},
        {"{\"anyOf\": [{\"type\": \"integer\"}, {\"type\": \"object\", \"properties\": {\"k\": {\"const\": true}},"
         " \"required\": [\"k\"], \"additionalProperties\": false}]}",
         {"5", "{\"k\": true}"},
         {"{\"k\": false}", "\"5\""}},
    };
    run_cases(cases, sizeof cases / sizeof cases[0], 1);
}

EXL_TEST(references_and_recursion) {
    static const doc_case cases[] = {
        {"{\"$defs\": {\"node\": {\"type\": \"object\", \"properties\": {\"v\": {\"type\": \"integer\"},"
         " \"kids\": {\"type\": \"array\", \"items\": {\"$ref\": \"#/$defs/node\"}}},"
         " \"required\": [\"v\", \"kids\"], \"additionalProperties\": false}}, \"$ref\": \"#/$defs/node\"}",
         {"{\"v\": 1, \"kids\": []}", "{\"v\": 1, \"kids\": [{\"v\": 2, \"kids\": [{\"v\": 3, \"kids\": []}]}]}"},
         {"{\"v\": 1}", "{\"v\": 1, \"kids\": [{}]}"}},
        {"{\"definitions\": {\"a/b\": {\"type\": \"boolean\"}}, \"type\": \"array\","
         " \"items\": {\"$ref\": \"#/definitions/a~1b\"}}",
         {"[true, false]"},
         {"[1]"}},
        {"{\"type\": \"object\", \"properties\": {\"next\": {\"anyOf\": [{\"$ref\": \"#\"}, {\"type\": \"null\"}]}},"
         " \"required\": [\"next\"], \"additionalProperties\": false}",
         {"{\"next\": null}", "{\"next\": {\"next\": {\"next\": null}}}"},
         {"{\"next\": {}}"}},
    };
    run_cases(cases, sizeof cases / sizeof cases[0], 1);
}

EXL_TEST(strict_errors_name_keyword_and_place) {
    static const struct {
        const char *schema, *want;
    } cases[] = {
        {"{\"type\": \"string\", \"pattern\": \"^a\"}", "'pattern' is not supported"},
        {"{\"type\": \"object\", \"properties\": {\"d\": {\"type\": \"string\", \"format\": \"date\"}}}",
         "#/properties/d: the keyword 'format'"},
        {"{\"oneOf\": [{\"type\": \"string\"}]}", "'oneOf'"},
        {"{\"type\": \"number\", \"minimum\": 1.5}", "'minimum' on a number"},
        {"{\"type\": \"array\", \"items\": [{\"type\": \"string\"}]}", "tuple validation"},
        {"{\"$ref\": \"http://x/y.json\"}", "the reference 'http://x/y.json' is not supported"},
        {"{\"$ref\": \"#/$defs/missing\"}", "names no definition"},
        {"{\"type\": \"strung\"}", "'strung' is not a JSON Schema type"},
        {"{\"type\": \"integer\", \"minimum\": 5, \"maximum\": 4}", "range is empty"},
        {"{\"type\": \"object\", \"properties\": {\"a\": {}}, \"additionalProperties\": true}",
         "additionalProperties must be false"},
        {"{\"type\": \"object\", \"properties\": {\"a\": {}}, \"required\": [\"b\"]}", "'required' names 'b'"},
        {"false", "matches nothing"},
        {"{\"type\": \"string\", \"maxLength\": 100000}", "'maxLength' above 10000"},
        {"{\"type\": ", "not valid JSON"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_constraint *c = NULL;
        exl_status st = exl_constraint_compile(EXL_CONSTRAINT_JSON_SCHEMA, cases[i].schema, strlen(cases[i].schema),
                                               &c);
        CHECK_MSG(st != EXL_OK && strstr(exl_last_error(), cases[i].want), "%s -> %s", cases[i].schema,
                  exl_last_error());
        exl_constraint_free(c);
    }
}

EXL_TEST(lax_mode_ignores_what_it_cannot_enforce) {
    static const doc_case cases[] = {
        {"{\"type\": \"string\", \"format\": \"date\", \"pattern\": \"x\"}", {"\"anything\""}, {"1"}},
        {"{\"oneOf\": [{\"type\": \"integer\"}, {\"type\": \"boolean\"}]}", {"1", "true"}, {"\"1\""}},
        {"{\"type\": \"object\", \"properties\": {\"a\": {\"type\": \"integer\"}}, \"required\": [\"a\", \"zz\"]}",
         {"{\"a\": 1}"},
         {"{\"a\": 1, \"b\": 2}", "{}"}},
    };
    run_cases(cases, sizeof cases / sizeof cases[0], 0);
}

EXL_TEST(grammar_text_is_readable) {
    /* the compiler's output is GBNF a person can read and reuse (exl run --grammar) */
    exl_str g = EXL_STR_INIT;
    REQUIRE_OK(
        exl_json_schema_to_gbnf("{\"type\": \"object\", \"properties\": {\"ok\": {\"type\": \"boolean\"}},"
                                " \"required\": [\"ok\"], \"additionalProperties\": false}",
                                strlen("{\"type\": \"object\", \"properties\": {\"ok\": {\"type\": \"boolean\"}},"
                                       " \"required\": [\"ok\"], \"additionalProperties\": false}"),
                                1, &g));
    CHECK(strstr(g.data, "root ::= s0-root\n") != NULL);
    CHECK(strstr(g.data,
                 "s0-root ::= \"{\" json-ws \"\\\"ok\\\"\" json-ws \":\" json-ws (\"true\" | \"false\") json-ws "
                 "\"}\"\n") != NULL);
    CHECK(strstr(g.data, "json-ws ::=") != NULL && !strstr(g.data, "json-value"));
    exl_str_free(&g);
}
