/* test_chat.c - chat templates against the transformers renderings in
 * ../shared/reference/tokenizers/<name>.json (`chat` entries), through exl_chat_apply
 * on the real model directories, plus the fallback template, tools and template errors. */
#include "test.h"

#include "base/alloc.h"
#include "io/json_file.h"
#include "tokenizer/chat.h"

#include <string.h>

static const char *const NAMES[] = {"llama3", "mistral-7b-instruct-v0.3", "qwen3"};

/* Render every reference conversation of one tokenizer; returns how many matched. */
static int check_reference(const char *name, int *total) {
    char rel[256];
    snprintf(rel, sizeof rel, "reference/tokenizers/%s.json", name);
    cJSON *ref;
    if (exl_json_read_file(exl_test_shared(rel), &ref) != EXL_OK) {
        CHECK_MSG(0, "%s", exl_last_error());
        return 0;
    }
    snprintf(rel, sizeof rel, "tokenizers/%s", name);
    exl_tokenizer *tok;
    if (exl_tokenizer_load(exl_test_shared(rel), &tok) != EXL_OK) {
        CHECK_MSG(0, "%s: %s", name, exl_last_error());
        cJSON_Delete(ref);
        return 0;
    }
    int ok = 0;
    const cJSON *c;
    cJSON_ArrayForEach(c, cJSON_GetObjectItem(ref, "chat")) {
        const cJSON *msgs = cJSON_GetObjectItem(c, "messages");
        exl_chat_message m[16];
        int n = 0;
        const cJSON *e;
        cJSON_ArrayForEach(e, msgs) {
            if (n < 16)
                m[n++] = (exl_chat_message){cJSON_GetObjectItem(e, "role")->valuestring,
                                            cJSON_GetObjectItem(e, "content")->valuestring};
        }
        int agp = cJSON_IsTrue(cJSON_GetObjectItem(c, "add_generation_prompt"));
        const char *want = cJSON_GetObjectItem(c, "text")->valuestring;
        char *got = NULL;
        exl_status st = exl_chat_apply(tok, m, n, agp, NULL, &got);
        (*total)++;
        if (st == EXL_OK && !strcmp(got, want))
            ok++;
        else
            CHECK_MSG(0, "%s (%d messages, generation prompt %d):\n      got  %s\n      want %s", name, n, agp,
                      got ? got : exl_last_error(), want);
        exl_string_free(got);
    }
    exl_tokenizer_free(tok);
    cJSON_Delete(ref);
    return ok;
}

EXL_TEST(reference_renderings_match) {
    int total = 0, ok = 0;
    for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
        ok += check_reference(NAMES[i], &total);
    CHECK_MSG(total == 18 && ok == total, "%d of %d reference renderings match", ok, total);
}

/* The template of a tokenizer_config.json, for exl_chat_template_init. */
static char *config_template(const char *name) {
    char rel[256];
    snprintf(rel, sizeof rel, "tokenizers/%s/tokenizer_config.json", name);
    cJSON *cfg;
    if (exl_json_read_file(exl_test_shared(rel), &cfg) != EXL_OK)
        return NULL;
    const cJSON *t = cJSON_GetObjectItem(cfg, "chat_template");
    char *s = cJSON_IsString(t) ? exl_strdup(t->valuestring) : NULL;
    cJSON_Delete(cfg);
    return s;
}

EXL_TEST(tools_are_rendered) {
    char *src = config_template("qwen3");
    REQUIRE(src);
    exl_chat_template *ct;
    REQUIRE_OK(exl_chat_template_init(src, NULL, "<|im_end|>", &ct));
    exl_free(src);
    exl_chat_message m[] = {{"user", "Weather in Paris?"}};
    const char *tools = "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                        "\"description\": \"Get the weather \\u2600\", \"parameters\": {\"type\": \"object\"}}}]";
    char *out;
    REQUIRE_OK(exl_chat_template_render(ct, m, 1, 1, tools, &out));
    const char *want = "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user "
                       "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
                       "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"description\": "
                       "\"Get the weather \xe2\x98\x80\", \"parameters\": {\"type\": \"object\"}}}\n</tools>\n\n";
    CHECK_MSG(!strncmp(out, want, strlen(want)), "got %s", out);
    CHECK(strstr(out, "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n") != NULL);
    exl_string_free(out);
    CHECK(exl_chat_template_render(ct, m, 1, 1, "{\"not\": \"a list\"}", &out) == EXL_ERR_ARG);
    CHECK(exl_chat_template_render(ct, m, 1, 1, "[oops", &out) == EXL_ERR_ARG);
    exl_chat_template_free(ct);
}

EXL_TEST(template_exceptions_become_errors) {
    char *src = config_template("mistral-7b-instruct-v0.3");
    REQUIRE(src);
    exl_chat_template *ct;
    REQUIRE_OK(exl_chat_template_init(src, "<s>", "</s>", &ct));
    exl_free(src);
    exl_chat_message m[] = {{"user", "a"}, {"user", "b"}};
    char *out = NULL;
    CHECK(exl_chat_template_render(ct, m, 2, 1, NULL, &out) == EXL_ERR_ARG && !out);
    CHECK(!strcmp(exl_last_error(),
                  "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."));
    exl_chat_template_free(ct);
}

EXL_TEST(fallback_is_chatml) {
    exl_chat_template *ct;
    REQUIRE_OK(exl_chat_template_init(NULL, NULL, NULL, &ct));
    exl_chat_message m[] = {{"system", "S"}, {"user", "Hi"}};
    char *out;
    REQUIRE_OK(exl_chat_template_render(ct, m, 2, 1, NULL, &out));
    CHECK(!strcmp(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    exl_string_free(out);
    REQUIRE_OK(exl_chat_template_render(ct, m, 1, 0, NULL, &out));
    CHECK(!strcmp(out, "<|im_start|>system\nS<|im_end|>\n"));
    exl_string_free(out);
    exl_chat_template_free(ct);
}

EXL_TEST(bad_templates_and_arguments) {
    exl_chat_template *ct = NULL;
    CHECK(exl_chat_template_init("{% for m in messages %}", NULL, NULL, &ct) == EXL_ERR_FORMAT && !ct);
    CHECK(strstr(exl_last_error(), "chat template:1:24: expected 'else' or 'endfor', got end of template") != NULL);
    REQUIRE_OK(exl_chat_template_init(NULL, NULL, NULL, &ct));
    exl_chat_message m[] = {{"user", NULL}};
    char *out = NULL;
    CHECK(exl_chat_template_render(ct, m, 1, 0, NULL, &out) == EXL_ERR_ARG && !out);
    CHECK(exl_chat_template_render(ct, NULL, -1, 0, NULL, &out) == EXL_ERR_ARG);
    exl_chat_template_free(ct);
}
