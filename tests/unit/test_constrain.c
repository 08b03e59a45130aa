/* test_constrain.c - the constraint engine: GBNF parsing and its errors, the byte matcher on
 * tricky input (escapes, UTF-8, nesting), regular expressions, integer ranges, and the token
 * trie and masks against a brute-force check over real vocabularies. */
#include "test.h"

#include "base/alloc.h"
#include "constrain/constraint.h"
#include "constrain/gbnf.h"
#include "constrain/int_range.h"
#include "constrain/mask.h"
#include "constrain/regex.h"
#include "constrain/token_trie.h"
#include "exl.h"

#include <stdlib.h>
#include <string.h>

/* The state after s from the start (EXL_MATCH_DEAD when s leaves the grammar). */
static int32_t walk(exl_constraint *c, const char *s, size_t n) {
    int32_t st;
    if (exl_matcher_walk(&c->matcher, c->matcher.start, s, n, &st) != EXL_OK)
        return EXL_MATCH_DEAD;
    return st;
}

static int matches(exl_constraint *c, const char *s) {
    int32_t st = walk(c, s, strlen(s));
    return st >= 0 && exl_matcher_accepting(&c->matcher, st);
}

static int viable(exl_constraint *c, const char *s) { return walk(c, s, strlen(s)) >= 0; }

static exl_constraint *compile(exl_constraint_kind kind, const char *src) {
    exl_constraint *c = NULL;
    if (exl_constraint_compile(kind, src, strlen(src), &c) != EXL_OK)
        fprintf(stderr, "    compile failed: %s\n", exl_last_error());
    return c;
}

/* ---------------------------------------------------------------- GBNF */

EXL_TEST(gbnf_alternatives_and_sequences) {
    exl_constraint *c = compile(EXL_CONSTRAINT_GBNF,
                                "root ::= answer \" \" answer\nanswer ::= \"yes\" | \"no\" | \"maybe\"\n");
    REQUIRE(c);
    CHECK(matches(c, "yes no"));
    CHECK(matches(c, "maybe maybe"));
    CHECK(!matches(c, "yes"));
    CHECK(viable(c, "yes"));
    CHECK(viable(c, "ma"));
    CHECK(!viable(c, "yess"));
    CHECK(!viable(c, "yes  no"));
    int32_t st = walk(c, "no yes", 6);
    CHECK(st >= 0 && exl_matcher_complete(&c->matcher, st));
    st = walk(c, "no", 2);
    CHECK(st >= 0 && !exl_matcher_accepting(&c->matcher, st));
    exl_constraint_free(c);
}

EXL_TEST(gbnf_repetition_and_groups) {
    exl_constraint *c = compile(EXL_CONSTRAINT_GBNF,
                                "# a comment\n"
                                "root ::= (\"ab\" | [0-9])+ x? y{2} z{1,3} w{2,}   # trailing comment\n"
                                "x ::= \"!\"\ny ::= \"-\"\nz ::= \"z\"\nw ::= \"w\"\n");
    REQUIRE(c);
    CHECK(matches(c, "ab--zww"));
    CHECK(matches(c, "1ab9!--zzzwwww"));
    CHECK(!matches(c, "--zww"));      /* + needs one */
    CHECK(!matches(c, "ab-zww"));     /* {2} */
    CHECK(!matches(c, "ab--zzzzww")); /* {1,3} */
    CHECK(!matches(c, "ab--zw"));     /* {2,} */
    exl_constraint_free(c);
    /* a newline inside a group and after | continues the rule */
    c = compile(EXL_CONSTRAINT_GBNF, "root ::= (\n  \"a\"\n  | \"b\"\n) |\n  \"c\"\n");
    REQUIRE(c);
    CHECK(matches(c, "a") && matches(c, "b") && matches(c, "c") && !matches(c, "ab"));
    exl_constraint_free(c);
}

EXL_TEST(gbnf_escapes_and_unicode) {
    exl_constraint *c = compile(EXL_CONSTRAINT_GBNF,
                                "root ::= \"\\\"\\\\\\n\\t\\x41\\u00e9\\U0001F600\" [\\]\\-\\[]\n");
    REQUIRE(c);
    CHECK(matches(c, "\"\\\n\tA\xc3\xa9\xf0\x9f\x98\x80]"));
    CHECK(matches(c, "\"\\\n\tA\xc3\xa9\xf0\x9f\x98\x80-"));
    CHECK(matches(c, "\"\\\n\tA\xc3\xa9\xf0\x9f\x98\x80["));
    exl_constraint_free(c);
    /* a negated class: any code point but a quote, as UTF-8; never a surrogate or an overlong form */
    c = compile(EXL_CONSTRAINT_GBNF, "root ::= [^\"]*\n");
    REQUIRE(c);
    CHECK(matches(c, "plain"));
    CHECK(matches(c, "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf"));
    CHECK(!viable(c, "a\"b"));
    CHECK(!viable(c, "\xc0\x80"));         /* overlong NUL */
    CHECK(!viable(c, "\xed\xa0\x80"));     /* a surrogate */
    CHECK(!viable(c, "\xf4\x90\x80\x80")); /* beyond U+10FFFF */
    CHECK(!viable(c, "\x80"));             /* a stray continuation byte */
    CHECK(viable(c, "\xe2\x82"));          /* an incomplete character may continue */
    CHECK(!matches(c, "\xe2\x82"));        /* but does not end the input */
    exl_constraint_free(c);
    c = compile(EXL_CONSTRAINT_GBNF, "root ::= [a-c\\u0400-\\u04FF_] .\n");
    REQUIRE(c);
    CHECK(matches(c, "b\n") && matches(c, "\xd0\x96x") && matches(c, "_\xf0\x9f\x98\x80"));
    CHECK(!viable(c, "d"));
    exl_constraint_free(c);
}

EXL_TEST(gbnf_errors_name_the_fault) {
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"root ::= foo\n", "'foo' is used but not defined"},
        {"root ::= \"a\"\nroot ::= \"b\"\n", "defined twice"},
        {"expr ::= \"a\"\n", "no rule named 'root'"},
        {"root ::= root \"a\" | \"b\"\n", "left-recursive"},
        {"root ::= x\nx ::= y? root\ny ::= \"y\"\n", "left-recursive"},
        {"root ::= (\"a\"?)*\n", "left-recursive"},
        {"root ::= \"abc\n", "unterminated string"},
        {"root ::= [abc\n", "unterminated character class"},
        {"root ::= (\"a\"\n", "expected ')'"},
        {"root ::= \"a\"{3,2}\n", "maximum is below its minimum"},
        {"root ::= \"a\"{99999}\n", "too large"},
        {"root ::= *\n", "nothing before it"},
        {"root ::= \"\\q\"\n", "unknown escape"},
        {"root := \"a\"\n", "expected '::='"},
        {"root ::= \"a\" ) \n", "line 1, column 14"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_constraint *c = NULL;
        exl_status st = exl_constraint_compile(EXL_CONSTRAINT_GBNF, cases[i].src, strlen(cases[i].src), &c);
        CHECK_MSG(st != EXL_OK && !c && strstr(exl_last_error(), cases[i].want), "case %zu: %s -> '%s'", i,
                  cases[i].src, exl_last_error());
        exl_constraint_free(c);
    }
}

/* ---------------------------------------------------------------- regular expressions */

EXL_TEST(regex_matches_whole_output) {
    static const struct {
        const char *re;
        const char *yes[4], *no[4];
    } cases[] = {
        {"\\d{3}-\\d{4}", {"555-1234"}, {"5551234", "555-12345", "55a-1234"}},
        {"^(a|bc)*d$", {"d", "abcad", "bcbcd"}, {"ab", "abd", "dd"}},
        {"[a-z]+@[a-z]+\\.(com|org)", {"me@x.com", "ab@cd.org"}, {"@x.com", "me@x.co", "me@x.comm"}},
        {"(?:x|y)?z+\\s\\w", {"z a", "xzz\t_", "yz\n9"}, {"xyz a", "z  a"}},
        {"[^a-c\\d]{2}\\.?", {"zz", "ZZ.", "\xc3\xa9!"}, {"az", "z1", "z"}},
        {"a.b",
         {"axb", "a\xe2\x82\xac"
                 "b"},
         {"a\nb", "ab"}},
        {"\\$\\(\\)\\[\\]\\{\\}\\|\\*\\+\\?\\.\\\\\\/\\^", {"$()[]{}|*+?.\\/^"}, {"x"}},
        {"colou?r{2}\\x41\\u00e9", {"colorrA\xc3\xa9", "colourrA\xc3\xa9"}, {"colorA\xc3\xa9"}},
        {"(?<year>\\d{4})-(?P<m>\\d\\d)", {"2024-01"}, {"24-01"}},
        {"a{2,}?b{,}", {"aab{,}", "aaaab{,}"}, {"ab{,}"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_constraint *c = compile(EXL_CONSTRAINT_REGEX, cases[i].re);
        CHECK_MSG(c, "regex %s", cases[i].re);
        if (!c)
            continue;
        for (int k = 0; k < 4 && cases[i].yes[k]; k++)
            CHECK_MSG(matches(c, cases[i].yes[k]), "%s should match %s", cases[i].re, cases[i].yes[k]);
        for (int k = 0; k < 4 && cases[i].no[k]; k++)
            CHECK_MSG(!matches(c, cases[i].no[k]), "%s should not match %s", cases[i].re, cases[i].no[k]);
        exl_constraint_free(c);
    }
}

EXL_TEST(regex_unsupported_is_named) {
    static const struct {
        const char *re, *want;
    } cases[] = {
        {"(a)\\1", "backreferences"},
        {"a(?=b)", "lookaround"},
        {"\\bword", "word boundaries"},
        {"(?i)abc", "inline flags"},
        {"a^b", "anchors"},
        {"[\\D]", "negated shorthand"},
        {"(ab", "missing ')'"},
        {"ab)", "unmatched ')'"},
        {"*a", "nothing before it"},
        {"a**", "quantifier after a quantifier"},
        {"[b-a]", "end comes before its start"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        exl_constraint *c = NULL;
        exl_status st = exl_constraint_compile(EXL_CONSTRAINT_REGEX, cases[i].re, strlen(cases[i].re), &c);
        CHECK_MSG(st != EXL_OK && strstr(exl_last_error(), cases[i].want), "%s -> %s", cases[i].re, exl_last_error());
        exl_constraint_free(c);
    }
}

/* ---------------------------------------------------------------- integer ranges */

EXL_TEST(int_range_exact) {
    static const int64_t ranges[][2] = {{0, 0},     {0, 9},       {3, 7},     {0, 100},  {7, 1234},  {-5, 5},
                                        {-120, -3}, {-1000, 999}, {10, 19},   {99, 101}, {100, 999}, {-9, -1},
                                        {1, 1},     {-1, -1},     {250, 255}, {0, 1000}, {-999, 0},  {37, 370}};
    for (size_t r = 0; r < sizeof ranges / sizeof ranges[0]; r++) {
        exl_str g = EXL_STR_INIT;
        exl_str_puts(&g, "root ::= ");
        REQUIRE(!exl_int_range_gbnf(ranges[r][0], ranges[r][1], &g));
        exl_str_puts(&g, "\n");
        exl_constraint *c = compile(EXL_CONSTRAINT_GBNF, g.data);
        CHECK_MSG(c, "range %lld..%lld: %s", (long long)ranges[r][0], (long long)ranges[r][1], g.data);
        int bad = 0;
        for (int64_t v = -1300; c && v <= 1300 && bad < 3; v++) {
            char buf[32];
            snprintf(buf, sizeof buf, "%lld", (long long)v);
            int want = v >= ranges[r][0] && v <= ranges[r][1];
            if (matches(c, buf) != want) {
                CHECK_MSG(0, "range %lld..%lld: %s %s", (long long)ranges[r][0], (long long)ranges[r][1], buf,
                          want ? "rejected" : "accepted");
                bad++;
            }
        }
        CHECK(!c || (!matches(c, "-0") && !matches(c, "007") && !matches(c, "")));
        exl_constraint_free(c);
        exl_str_free(&g);
    }
}

/* ---------------------------------------------------------------- token trie and masks */

/* Every token allowed by the mask of state st is exactly one whose bytes the matcher survives, and
 * exl_mask_any (asked first, before the mask is cached) says whether there is one. */
static void check_mask_brute_force(exl_constraint *c, const exl_token_trie *t, int32_t st, const char *what,
                                   int expect_some) {
    const uint32_t *mask;
    int any;
    REQUIRE_OK(exl_mask_any(&c->matcher, t, st, &any));
    REQUIRE_OK(exl_mask_get(&c->matcher, t, st, &mask));
    int bad = 0, allowed = 0;
    for (int32_t id = 0; id < t->vocab && bad < 3; id++) {
        int32_t end = EXL_MATCH_DEAD;
        if (t->tok_len[id] > 0)
            REQUIRE_OK(exl_matcher_walk(&c->matcher, st, t->bytes + t->tok_off[id], (size_t)t->tok_len[id], &end));
        int want = end >= 0, got = (mask[id >> 5] >> (id & 31)) & 1;
        allowed += got;
        if (want != got) {
            CHECK_MSG(0, "%s: token %d (%.*s) %s", what, id, t->tok_len[id], t->bytes + t->tok_off[id],
                      want ? "missing from the mask" : "wrongly allowed");
            bad++;
        }
    }
    CHECK_MSG(allowed > 0 || !expect_some, "%s: nothing allowed", what);
    CHECK_MSG(any == (allowed > 0), "%s: exl_mask_any says %d, the mask allows %d", what, any, allowed);
}

/* full_charset: the vocabulary spells every byte (the TinyStories one has no braces, brackets or
 * non-ASCII characters, so some states allow no token). */
static void mask_states(const char *tok_dir, int32_t vocab_extra, int full_charset) {
    exl_tokenizer *tok;
    REQUIRE_OK(exl_tokenizer_load(exl_test_shared(tok_dir), &tok));
    exl_token_trie *t;
    REQUIRE_OK(exl_token_trie_build(tok, exl_tokenizer_vocab_size(tok) + vocab_extra, &t));
    const char *schema =
        "{\"type\": \"object\", \"properties\": {\"name\": {\"type\": \"string\", \"maxLength\": 12},"
        " \"age\": {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 150},"
        " \"tags\": {\"type\": \"array\", \"items\": {\"enum\": [\"a b\", \"\\u00e9\", \"x\\\"y\"]},"
        " \"maxItems\": 3}}, \"required\": [\"name\", \"age\", \"tags\"], \"additionalProperties\": false}";
    exl_constraint *c = compile(EXL_CONSTRAINT_JSON_SCHEMA, schema);
    REQUIRE(c);
    static const char *const prefixes[] = {"",
                                           "{",
                                           "{\"na",
                                           "{\"name\": \"J",
                                           "{\"name\":\"caf\xc3",
                                           "{\"name\": \"\\",
                                           "{\"name\": \"\\u00",
                                           "{\"name\": \"ab\", \"age\": 1",
                                           "{\"name\": \"ab\", \"age\": 15",
                                           "{\"name\": \"\",\"age\":0,\"tags\":[",
                                           "{\"name\": \"\",\"age\":0,\"tags\":[\"x\\",
                                           "{\"name\": \"\",\"age\":0,\"tags\":[]"};
    for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
        int32_t st = walk(c, prefixes[i], strlen(prefixes[i]));
        CHECK_MSG(st >= 0, "prefix %s", prefixes[i]);
        if (st >= 0)
            check_mask_brute_force(c, t, st, prefixes[i], full_charset);
    }
    exl_constraint_free(c);
    exl_token_trie_free(t);
    exl_tokenizer_free(tok);
}

EXL_TEST(mask_equals_brute_force_sentencepiece) { mask_states("models/tinystories-656k", 5, 0); }
EXL_TEST(mask_equals_brute_force_bytelevel_128k) { mask_states("tokenizers/llama3", 0, 1); }

/* Token bytes concatenate to the text the detokenizer streams. */
static void token_bytes_concat(const char *tok_dir) {
    exl_tokenizer *tok;
    REQUIRE_OK(exl_tokenizer_load(exl_test_shared(tok_dir), &tok));
    static const char text[] =
        "Once upon a time, caf\xc3\xa9 \xe2\x98\x95 costs 12.50 \xf0\x9f\x98\x80!\n\t{\"a\": [1]}";
    int32_t *ids, n;
    REQUIRE_OK(exl_tokenizer_encode(tok, text, strlen(text), 0, &ids, &n));
    int32_t *ctx, n_ctx; /* text before: the tokens come in the middle, as generated ones do */
    REQUIRE_OK(exl_tokenizer_encode(tok, "Hi.", 3, 0, &ctx, &n_ctx));
    exl_detokenizer *d;
    REQUIRE_OK(exl_detokenizer_init(tok, 1, &d));
    const char *piece;
    size_t len;
    for (int32_t i = 0; i < n_ctx; i++)
        REQUIRE_OK(exl_detokenizer_push(d, ctx[i], &piece, &len));
    exl_ids_free(ctx);
    exl_str streamed = EXL_STR_INIT, joined = EXL_STR_INIT;
    for (int32_t i = 0; i < n; i++) {
        REQUIRE_OK(exl_detokenizer_push(d, ids[i], &piece, &len));
        exl_str_append(&streamed, piece, len);
        char buf[256];
        int32_t bl;
        REQUIRE_OK(exl_tokenizer_token_bytes(tok, ids[i], buf, sizeof buf, &bl));
        REQUIRE(bl >= 0 && bl <= (int32_t)sizeof buf);
        exl_str_append(&joined, buf, (size_t)bl);
    }
    REQUIRE_OK(exl_detokenizer_flush(d, &piece, &len));
    exl_str_append(&streamed, piece, len);
    CHECK_MSG(streamed.len == joined.len && !memcmp(streamed.data, joined.data, joined.len), "%s: '%s' vs '%s'",
              tok_dir, streamed.data, joined.data);
    exl_token_trie *t; /* special tokens are never in the trie */
    REQUIRE_OK(exl_token_trie_build(tok, exl_tokenizer_vocab_size(tok), &t));
    CHECK(t->tok_len[exl_tokenizer_eos_id(tok)] == -1);
    exl_token_trie_free(t);
    exl_str_free(&streamed);
    exl_str_free(&joined);
    exl_detokenizer_free(d);
    exl_ids_free(ids);
    exl_tokenizer_free(tok);
}

EXL_TEST(token_bytes_match_detokenizer) {
    token_bytes_concat("models/tinystories-656k");
    token_bytes_concat("tokenizers/llama3");
    token_bytes_concat("tokenizers/qwen3");
    token_bytes_concat("tokenizers/mistral-7b-instruct-v0.3");
}
