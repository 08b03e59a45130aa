/* test_chat.c - chat templates against the transformers renderings in
 * ../shared/reference/tokenizers/<name>.json (`chat` entries: text and ids), through
 * exl_chat_apply and exl_chat_encode on the real model directories, plus the fallback
 * template (BOS, its stop marker), tools and template errors. */
#include "test.h"

#include "base/alloc.h"
#include "io/json_file.h"
#include "tokenizer/chat.h"

#include <string.h>
#include <unistd.h>

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
                m[n++] = (exl_chat_message){.role = cJSON_GetObjectItem(e, "role")->valuestring,
                                            .content = cJSON_GetObjectItem(e, "content")->valuestring};
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
        /* the prompt: transformers' apply_chat_template(tokenize=True), and no stop of its own */
        exl_chat_prompt p;
        const cJSON *want_ids = cJSON_GetObjectItem(c, "ids");
        st = exl_chat_encode(tok, m, n, agp, NULL, &p);
        int same = st == EXL_OK && p.n_ids == cJSON_GetArraySize(want_ids) && !p.stop_string && p.stop_id == -1;
        for (int32_t i = 0; same && i < p.n_ids; i++)
            same = p.ids[i] == cJSON_GetArrayItem(want_ids, i)->valueint;
        CHECK_MSG(same, "%s (%d messages): exl_chat_encode differs (%d ids, want %d): %s", name, n, (int)p.n_ids,
                  cJSON_GetArraySize(want_ids), st == EXL_OK ? "" : exl_last_error());
        exl_chat_prompt_free(&p);
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
    exl_chat_message m[] = {{.role = "user", .content = "Weather in Paris?"}};
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
    exl_chat_message m[] = {{.role = "user", .content = "a"}, {.role = "user", .content = "b"}};
    char *out = NULL;
    CHECK(exl_chat_template_render(ct, m, 2, 1, NULL, &out) == EXL_ERR_ARG && !out);
    CHECK(!strcmp(
        exl_last_error(),
        "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."));
    exl_chat_template_free(ct);
}

EXL_TEST(fallback_is_chatml) {
    exl_chat_template *ct;
    REQUIRE_OK(exl_chat_template_init(NULL, NULL, NULL, &ct));
    exl_chat_message m[] = {{.role = "system", .content = "S"}, {.role = "user", .content = "Hi"}};
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
    exl_chat_message m[] = {{.role = "user", .content = NULL}};
    char *out = NULL;
    CHECK(exl_chat_template_render(ct, m, 1, 0, NULL, &out) == EXL_ERR_ARG && !out);
    CHECK(exl_chat_template_render(ct, NULL, -1, 0, NULL, &out) == EXL_ERR_ARG);
    exl_chat_template_free(ct);
}

/* No template: ChatML, the tokenizer's BOS first, and "<|im_end|>" to stop on (as text: the
 * TinyStories vocabulary has no such token). */
EXL_TEST(encode_fallback_adds_bos_and_stop_string) {
    exl_tokenizer *tok;
    REQUIRE_OK(exl_tokenizer_load(exl_test_shared("models/tinystories-656k"), &tok));
    exl_chat_message m[] = {{.role = "user", .content = "Hi"}};
    exl_chat_prompt p;
    REQUIRE_OK(exl_chat_encode(tok, m, 1, 1, NULL, &p));
    int32_t *ids, n;
    const char *text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    REQUIRE_OK(exl_tokenizer_encode(tok, text, strlen(text), 0, &ids, &n));
    CHECK(exl_tokenizer_bos_id(tok) >= 0 && p.n_ids == n + 1 && p.ids[0] == exl_tokenizer_bos_id(tok));
    CHECK(p.n_ids == n + 1 && !memcmp(p.ids + 1, ids, (size_t)n * sizeof *ids));
    CHECK(p.stop_string && !strcmp(p.stop_string, "<|im_end|>") && p.stop_id == -1);
    exl_ids_free(ids);
    exl_chat_prompt_free(&p);
    CHECK(!p.ids && p.stop_id == -1);
    CHECK(exl_chat_encode(tok, NULL, -1, 1, NULL, &p) == EXL_ERR_ARG && !p.ids);
    exl_tokenizer_free(tok);
}

/* No template, but "<|im_end|>" is a special token of the vocabulary (Qwen3's tokenizer without
 * its tokenizer_config.json): it never shows in the text, so its id is the stop. */
EXL_TEST(encode_fallback_stops_on_marker_token) {
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s", exl_test_tmpdir());
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    REQUIRE(symlink(exl_test_shared("tokenizers/qwen3/tokenizer.json"), path) == 0);
    exl_tokenizer *tok;
    REQUIRE_OK(exl_tokenizer_load(dir, &tok));
    exl_chat_message m[] = {{.role = "user", .content = "Hi"}};
    exl_chat_prompt p;
    REQUIRE_OK(exl_chat_encode(tok, m, 1, 1, NULL, &p));
    CHECK(p.stop_id >= 0 && exl_tokenizer_is_special(tok, p.stop_id));
    CHECK(p.stop_id >= 0 && !strcmp(exl_tokenizer_token_text(tok, p.stop_id), "<|im_end|>"));
    CHECK(p.n_ids > 0 && p.ids[0] != p.stop_id);
    exl_chat_prompt_free(&p);
    exl_tokenizer_free(tok);
}
