/* test_tools.c - the server's tool calling pieces: the format read from real chat templates, tool
 * calls and results in the history rendered by them, the forced-call grammar (a sampled call
 * always parses, with arguments that validate), calls parsed out of replies in each format, and
 * the content that may be streamed before a call starts. */
#include "gen_util.h"
#include "test.h"

#include "constrain/constraint.h"
#include "server/tools.h"

#include <stdlib.h>
#include <string.h>

static const char TOOLS[] =
    "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": \"Weather of a city\","
    " \"parameters\": {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\", \"maxLength\": 16},"
    " \"days\": {\"type\": \"integer\", \"minimum\": 1, \"maximum\": 7}}, \"required\": [\"city\", \"days\"],"
    " \"additionalProperties\": false}, \"strict\": true}},"
    " {\"type\": \"function\", \"function\": {\"name\": \"now\"}}]";

static exl_tokenizer *tokenizer(const char *dir) {
    exl_tokenizer *tok = NULL;
    if (exl_tokenizer_load(exl_test_shared(dir), &tok) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "%s: %s", dir, exl_last_error());
    return tok;
}

EXL_TEST(format_from_template) {
    static const struct {
        const char *dir;
        exl_tool_format want;
    } cases[] = {{"tokenizers/qwen3", EXL_TOOLS_HERMES},
                 {"tokenizers/mistral-7b-instruct-v0.3", EXL_TOOLS_MISTRAL},
                 {"tokenizers/llama3", EXL_TOOLS_GENERIC}, /* its template renders no tools */
                 {"models/tinystories-656k", EXL_TOOLS_GENERIC}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_tokenizer *tok = tokenizer(cases[i].dir);
        REQUIRE(tok);
        CHECK_MSG(exl_tools_detect(tok) == cases[i].want, "%s: %d", cases[i].dir, (int)exl_tools_detect(tok));
        exl_tokenizer_free(tok);
    }
}

EXL_TEST(history_round_trips_through_templates) {
    const exl_chat_message m[] = {
        {.role = "user", .content = "Weather in Oslo?"},
        {.role = "assistant",
         .content = "",
         .tool_calls = "[{\"id\": \"abc123xyz\", \"type\": \"function\", \"function\":"
                       " {\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": "
                       "\\\"Oslo\\\", \\\"days\\\": 2}\"}}]"},
        {.role = "tool", .content = "rain, 4 C", .tool_call_id = "abc123xyz", .name = "get_weather"},
    };
    static const struct {
        const char *dir, *call, *result;
    } cases[] = {
        {"tokenizers/qwen3",
         "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n</tool_call>",
         "<tool_response>\nrain, 4 C\n</tool_response>"},
        {"tokenizers/mistral-7b-instruct-v0.3",
         "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}, "
         "\"id\": \"abc123xyz\"}]",
         /* the template writes a result's content as it is (a JSON text in practice) */
         "[TOOL_RESULTS] {\"content\": rain, 4 C, \"call_id\": \"abc123xyz\"}[/TOOL_RESULTS]"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_tokenizer *tok = tokenizer(cases[i].dir);
        REQUIRE(tok);
        char *text = NULL;
        REQUIRE_OK(exl_chat_apply(tok, m, 3, 1, TOOLS, &text));
        CHECK_MSG(strstr(text, cases[i].call) && strstr(text, cases[i].result) && strstr(text, "get_weather"),
                  "%s rendered:\n%s", cases[i].dir, text);
        exl_string_free(text);
        exl_tokenizer_free(tok);
    }
}

EXL_TEST(parse_each_format) {
    cJSON *tools = cJSON_Parse(TOOLS);
    REQUIRE(tools);
    static const struct {
        const char *text;
        exl_tool_format fmt;
        int n;
        const char *args0;
        size_t content;
    } cases[] = {
        {"Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 2}}\n"
         "</tool_call>\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
         EXL_TOOLS_HERMES, 2, "{\"city\":\"Oslo\",\"days\":2}", 13},
        {"[TOOL_CALLS] [{\"name\": \"now\", \"arguments\": \"{}\"}, {\"name\": \"get_weather\", \"arguments\": "
         "{\"city\": \"\\u00c5s\", \"days\": 1}}]",
         EXL_TOOLS_MISTRAL, 2, "{}", 0},
        {"[{\"name\": \"now\", \"arguments\": {}}]", EXL_TOOLS_MISTRAL, 1, "{}", 0},
        {"<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\", \"days\": 3}}",
         EXL_TOOLS_LLAMA3, 1, "{\"city\":\"Rome\",\"days\":3}", 0},
        {"  {\"name\": \"now\", \"parameters\": {}}  ", EXL_TOOLS_LLAMA3, 1, "{}", 0},
        /* not calls: plain text, an unknown function, a cut-off block, text after the calls */
        {"It is sunny.", EXL_TOOLS_HERMES, 0, NULL, 12},
        {"<tool_call>\n{\"name\": \"launch\", \"arguments\": {}}\n</tool_call>", EXL_TOOLS_HERMES, 0, NULL, 0},
        {"<tool_call>\n{\"name\": \"now\", \"argu", EXL_TOOLS_HERMES, 0, NULL, 0},
        {"<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call> and more", EXL_TOOLS_GENERIC, 0, NULL, 0},
        {"{\"name\": \"now\", \"parameters\": [1]}", EXL_TOOLS_LLAMA3, 0, NULL, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_tool_calls c;
        REQUIRE_OK(exl_tools_parse(cases[i].text, strlen(cases[i].text), cases[i].fmt, tools, &c));
        CHECK_MSG(c.n == cases[i].n && (!c.n || !strcmp(c.v[0].arguments, cases[i].args0)) &&
                      (!c.n || c.content_len == cases[i].content),
                  "case %zu: %d calls, args %s, content %zu", i, (int)c.n, c.n ? c.v[0].arguments : "-", c.content_len);
        exl_tool_calls_free(&c);
    }
    cJSON_Delete(tools);
}

EXL_TEST(content_safe_holds_back_call_starts) {
    static const struct {
        const char *text;
        exl_tool_format fmt;
        size_t want;
    } cases[] = {
        {"Hello there", EXL_TOOLS_HERMES, 11},
        {"Hello <tool", EXL_TOOLS_HERMES, 6},
        {"Hi <tool_call>{", EXL_TOOLS_HERMES, 3},
        {"  ", EXL_TOOLS_HERMES, 0},
        {"{\"name\"", EXL_TOOLS_LLAMA3, 0},
        {"Sure, [TOOL_C", EXL_TOOLS_MISTRAL, 6},
        {"[{", EXL_TOOLS_MISTRAL, 0},
        {"a < b", EXL_TOOLS_GENERIC, 5},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t got = exl_tools_content_safe(cases[i].text, strlen(cases[i].text), cases[i].fmt);
        CHECK_MSG(got == cases[i].want, "'%s': %zu, want %zu", cases[i].text, got, cases[i].want);
    }
}

/* A sampled forced call always parses, names a function offered and has arguments that validate. */
EXL_TEST(forced_calls_parse_and_validate) {
    cJSON *tools = cJSON_Parse(TOOLS);
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(tools && m);
    exl_generator *g = gu_generator(m, tok, 0, 0, 0);
    gu_result *r = calloc(4, sizeof *r);
    REQUIRE(g && r);
    static const exl_tool_format fmts[] = {EXL_TOOLS_HERMES, EXL_TOOLS_MISTRAL, EXL_TOOLS_LLAMA3};
    for (int f = 0; f < 3; f++)
        for (int named = 0; named < 2; named++) {
            exl_str gbnf = EXL_STR_INIT;
            REQUIRE_OK(exl_tools_grammar(tools, named ? "get_weather" : NULL, 0, fmts[f], &gbnf));
            exl_constraint *c;
            REQUIRE_OK(exl_constraint_compile(EXL_CONSTRAINT_GBNF, gbnf.data, gbnf.len, &c));
            exl_str_free(&gbnf);
            exl_job_params p[4];
            for (int i = 0; i < 4; i++) {
                p[i] = exl_job_default_params();
                p[i].text = "Once upon a time";
                p[i].constraint = c;
                p[i].max_new_tokens = 300;
                p[i].sampling.seed = (uint64_t)(10 * f + 2 * i + named);
            }
            memset(r, 0, 4 * sizeof *r);
            REQUIRE_OK(gu_run(g, p, 4, r));
            exl_constraint_free(c);
            for (int i = 0; i < 4; i++) {
                exl_tool_calls calls;
                REQUIRE_OK(exl_tools_parse(r[i].text, r[i].text_len, fmts[f], tools, &calls));
                cJSON *args = calls.n == 1 ? cJSON_Parse(calls.v[0].arguments) : NULL;
                int ok = calls.n == 1 && args && r[i].finish == EXL_FINISH_STOP;
                if (ok && !strcmp(calls.v[0].name, "get_weather")) {
                    const cJSON *city = cJSON_GetObjectItemCaseSensitive(args, "city");
                    const cJSON *days = cJSON_GetObjectItemCaseSensitive(args, "days");
                    ok = cJSON_GetArraySize(args) == 2 && cJSON_IsString(city) && cJSON_IsNumber(days) &&
                         days->valuedouble >= 1 && days->valuedouble <= 7;
                } else if (ok) {
                    ok = !named && cJSON_GetArraySize(args) == 0;
                }
                r[i].text[r[i].text_len] = 0;
                CHECK_MSG(ok, "format %d named %d job %d: %s", f, named, i, r[i].text);
                cJSON_Delete(args);
                exl_tool_calls_free(&calls);
            }
        }
    free(r);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
    cJSON_Delete(tools);
}
