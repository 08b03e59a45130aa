/* test_jinja.c - the Jinja-subset interpreter: syntax, scoping, filters, tests, methods,
 * whitespace control, tojson, errors with line:column, limits and allocation failures.
 * Expected outputs are what Jinja 3.1 renders with transformers' settings. */
#include "test.h"

#include "base/alloc.h"
#include "jinja/jinja.h"

#include <string.h>

/* Render src with the JSON context (NULL: none); returns the output or NULL. */
static char *render(const char *src, const char *ctx_json, exl_status *st_out) {
    cJSON *ctx = ctx_json ? cJSON_Parse(ctx_json) : NULL;
    exl_jinja *t = NULL;
    char *out = NULL;
    exl_status st = exl_jinja_parse(NULL, src, strlen(src), &t);
    if (st == EXL_OK)
        st = exl_jinja_render(t, ctx, NULL, &out);
    exl_jinja_free(t);
    cJSON_Delete(ctx);
    if (st_out)
        *st_out = st;
    return out;
}

static const char *CTX = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}, "
                         "{\"role\": \"assistant\", \"content\": \" yo \"}], \"n\": 3, \"f\": 1.5, "
                         "\"s\": \"h\\u00e9llo w\\u00f6rld\", \"d\": {\"b\": 1, \"a\": [1, 2, {\"x\": null}]}, "
                         "\"e\": [], \"t\": true}";

#define EXPECT(src, want)                                                               \
    do {                                                                                \
        exl_status st_;                                                                 \
        char *got_ = render(src, CTX, &st_);                                            \
        CHECK_MSG(got_ && !strcmp(got_, want), "%s\n      got  %s\n      want %s", src, \
                  got_ ? got_ : exl_last_error(), want);                                \
        exl_free(got_);                                                                 \
    } while (0)

/* The render fails with status st and a message containing msg. */
#define EXPECT_FAIL(src, st, msg)                                                                      \
    do {                                                                                               \
        exl_status st_;                                                                                \
        char *got_ = render(src, CTX, &st_);                                                           \
        CHECK_MSG(!got_ && st_ == (st) && strstr(exl_last_error(), msg), "%s\n      got %s / %s", src, \
                  got_ ? got_ : exl_status_str(st_), exl_last_error());                                \
        exl_free(got_);                                                                                \
    } while (0)

EXL_TEST(literals_and_operators) {
    EXPECT("{{ [1,'a',none,true,1.5,{'k':'v\"'}] }}", "[1, 'a', None, True, 1.5, {'k': 'v\"'}]");
    EXPECT("{{ 1e20 }} {{ 1.0 }} {{ 0.1+0.2 }} {{ 1e16 }} {{ 1e15 }} {{ 1e-5 }} {{ 7/2 }}",
           "1e+20 1.0 0.30000000000000004 1e+16 1000000000000000.0 1e-05 3.5");
    EXPECT("{{ 7//2 }} {{ -7//2 }} {{ -7 % 3 }} {{ 2**10 }} {{ 2.0**0.5 }}", "3 -4 2 1024 1.4142135623730951");
    EXPECT("{{ true == 1 }} {{ none }} {{ 'x' ~ 1 ~ none }}", "True None x1None");
    EXPECT("{{ n * 'ab' }} {{ [1] * 3 }} {{ n - 5 }} {{ -n }} {{ 1 + 2.5 }} {{ (1, 2) }} {{ [1,2] + [3] }}",
           "ababab [1, 1, 1] -2 -3 3.5 (1, 2) [1, 2, 3]");
    EXPECT("{{ 1 < 2 < 3 }} {{ 3 > 2 > 2 }} {{ 'a' in 'cat' }} {{ 'x' not in ['x'] }} {{ 'b' in d }}",
           "True False True False True");
    EXPECT("{{ not n }} {{ n and 'y' }} {{ 0 or 'z' }}", "False y z");
    EXPECT("{{ 'a' if n > 2 else 'b' }} {{ 'a' if n > 5 }}| {{ n if false else 'z' }}", "a | z");
    EXPECT("{{ ['it\\'s', \"a\\\"b\", 'e\"f\\'g'] }}", "[\"it's\", 'a\"b', 'e\"f\\'g']");
    EXPECT("{{ 'tab\\there' }} {{ '\\u00e9\\x41' }} {{ 'a' 'b' }}", "tab\there \xc3\xa9"
                                                                    "A ab");
}

EXL_TEST(subscripts_and_slices) {
    EXPECT("{{ 'abc'[::-1] }} {{ s|length }} {{ s[1] }} {{ s[2:5] }} {{ s[-3:] }}", "cba 11 \xc3\xa9 llo rld");
    EXPECT("{{ [1,2,3,4,5][1::2] }} {{ [1,2,3][5:] }} {{ [1,2,3][-2] }} {{ [1,2,3][:-1] }}", "[2, 4] [] 2 [1, 2]");
    EXPECT("{{ messages[0]['role'] }} {{ messages[-1].content }} {{ messages[5] is defined }} {{ d.a.2.x }}",
           "user  yo  False None");
}

EXL_TEST(loops) {
    EXPECT("{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.first }}/{{ loop.last }}/"
           "{{ loop.length }}/{{ loop.revindex }} {{ m.role }};{% endfor %}",
           "1/0/True/False/2/2 user;2/1/False/True/2/1 assistant;");
    EXPECT("{% for k, v in d.items() %}{{ k }}={{ v }},{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
           "b=1,a=[1, 2, {'x': None}],ba");
    EXPECT("{% for x in e %}no{% else %}empty{% endfor %}", "empty");
    EXPECT("{% for x in [1,2,3,4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}", "2242");
    EXPECT("{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 5 %}{% break %}"
           "{% endif %}{{ x }}{% endfor %}",
           "0134");
    EXPECT("{% for x in 'h\xc3\xa9y' %}{{ x }}.{% endfor %}", "h.\xc3\xa9.y.");
    EXPECT("{% for a, b in [[1,2],[3,4]] %}{{ a + b }}{% endfor %}", "37");
    EXPECT("{% for x in [1,2,3] %}{{ loop.cycle('a', 'b') }}{{ loop.previtem is defined }}{% endfor %}",
           "aFalsebTrueaTrue");
}

EXL_TEST(scoping_and_namespace) {
    EXPECT("{% for i in [1,2] %}{% if i == 2 %}[{{ x }}]{% endif %}{% set x = i %}{% endfor %}{{ x }}", "[]");
    EXPECT("{% set x = 5 %}{% for i in [1,2] %}{{ x }}{% set x = i %}{{ x }}{% endfor %}{{ x }}", "51525");
    EXPECT("{% set ns = namespace(a=1, b=[]) %}{% for i in range(3) %}{% set ns.a = ns.a + i %}"
           "{% set ns.b = ns.b + [i] %}{% endfor %}{{ ns.a }} {{ ns.b }}",
           "4 [0, 1, 2]");
    EXPECT("{% macro f(a, b=2) %}{{ a }}-{{ b }}-{{ x }}{% endmacro %}{% set x = 9 %}{{ f(1) }}{{ f(1, b=3) }}",
           "1-2-91-3-9");
    EXPECT("{%- set x -%}\n  hello {{ n }}\n{%- endset -%}[{{ x }}]", "[hello 3]");
    EXPECT("{% set a, b = 1, 2 %}{{ b }}{{ a }}", "21");
}

EXL_TEST(whitespace_control) {
    EXPECT("  {% if true %}\n  x\n  {% endif %}\n  y  {#- c #}  \n z", "  x\n  y  \n z");
    EXPECT("a\n{% if true %}\nb\n{% endif %}\nc\n", "a\nb\nc");
    EXPECT("a  {%- if true -%}  b  {%- endif -%}  c", "abc");
    EXPECT("{% raw %}{{ not parsed }}{% endraw %}", "{{ not parsed }}");
    EXPECT("  {%+ if true %}x{% endif +%}\ny", "  x\ny");
    EXPECT("{# comment #}\nafter\n  {# c2 #}\nz", "after\nz");
    EXPECT("a\r\nb {{- ' c' }}\r\n", "a\nb c");
}

EXL_TEST(filters) {
    EXPECT("{{ 'hello world-foo(bar' | title }} {{ 'hello world-foo(bar'.title() }} {{ 'ab cd'|capitalize }}",
           "Hello World-Foo(Bar Hello World-Foo(Bar Ab cd");
    EXPECT("{{ s|upper }} {{ 'ÀB'|lower }}", "H\xc3\x89LLO W\xc3\x96RLD \xc3\xa0"
                                             "b");
    EXPECT("{{ messages|selectattr('role', 'equalto', 'user')|list|length }} "
           "{{ messages|map(attribute='role')|join(', ') }} "
           "{{ messages|rejectattr('role','eq','user')|map(attribute='content')|list }}",
           "1 user, assistant [' yo ']");
    EXPECT("{{ [3,1,2]|sort }} {{ ['b','A','c']|sort }} {{ [3,1,2]|sort(reverse=true) }} {{ [1,2,1,3]|unique|list }}",
           "[1, 2, 3] ['A', 'b', 'c'] [3, 2, 1] [1, 2, 3]");
    EXPECT("{{ [1,2,3]|reverse|list }} {{ 'abc'|reverse }} {{ [1,5,2]|max }} {{ [1,5,2]|min }} {{ [1,2,3]|sum }}",
           "[3, 2, 1] cba 5 1 6");
    EXPECT("{{ x|default('dflt') }} {{ none|default('dflt') }} {{ ''|default('dflt', true) }} {{ n|string + 'x' }}",
           "dflt None dflt 3x");
    EXPECT("{{ '42'|int + 1 }} {{ '4.5'|float }} {{ 3.7|int }} {{ 2.5|round }} {{ 3.14159|round(2) }} {{ -3|abs }}",
           "43 4.5 3 2.0 3.14 3");
    EXPECT("{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(2, blank=true) }}",
           "a\n  b\n\n  c|  a\n  b|a\n  \n  b");
    EXPECT("{{ {'a': 1}|items|list }} {{ d|dictsort }} {{ 'ab'|list }} {{ 3|string|length }}",
           "[('a', 1)] [('a', [1, 2, {'x': None}]), ('b', 1)] ['a', 'b'] 1");
    EXPECT("{{ [] | first }} {{ [1,2]|first }} {{ [1,2]|last }} {{ 'abc'|first }} {{ '<a&\"b'|e }} {{ 'x'|safe }}",
           " 1 2 a &lt;a&amp;&#34;b x");
    EXPECT("{{ [0, 1, '', 'a']|select|list }} {{ [1,2,3,4]|reject('odd')|list }} {{ ['a','b']|map('upper')|list }}",
           "[1, 'a'] [2, 4] ['A', 'B']");
    EXPECT("{{ '  x  '|trim }}|{{ 'a-b-c'|replace('-', '', 1) }}|{{ e|length }}", "x|ab-c|0");
}

EXL_TEST(tojson) {
    EXPECT("{{ d|tojson }}", "{\"b\": 1, \"a\": [1, 2, {\"x\": null}]}");
    EXPECT("{{ '\xc3\xa9\"\\n\\t\\u0001\\\\'|tojson }}", "\"\xc3\xa9\\\"\\n\\t\\u0001\\\\\"");
    EXPECT("{{ d|tojson(indent=2) }}",
           "{\n  \"b\": 1,\n  \"a\": [\n    1,\n    2,\n    {\n      \"x\": null\n    }\n  ]\n}");
    EXPECT("{{ e|tojson(indent=2) }} {{ {'z':1,'a':2}|tojson(sort_keys=true) }} {{ f|tojson }} {{ t|tojson }}",
           "[] {\"a\": 2, \"z\": 1} 1.5 true");
    EXPECT("{{ s|tojson }}", "\"h\xc3\xa9llo w\xc3\xb6rld\"");
    EXPECT_FAIL("{{ namespace()|tojson }}", EXL_ERR_ARG, "not JSON serializable");
}

EXL_TEST(tests_and_methods) {
    EXPECT("{{ x is defined }} {{ 3 is divisibleby 3 }} {{ none is none }} {{ n is number }} {{ t is boolean }}",
           "False True True True True");
    EXPECT("{{ d is mapping }} {{ e is iterable }} {{ 'a' is string }} {{ n is odd }} {{ n is not integer }}",
           "True True True True False");
    EXPECT("{{ 'xxaxx'.strip('x') }} {{ ' a '.lstrip() }}|{{ ' a '.rstrip() }}| {{ 'abc'.startswith('ab') }} "
           "{{ 'abc'.endswith(('x','c')) }} {{ 'a-b-c'.replace('-', '+') }}",
           "a a | a| True True a+b+c");
    EXPECT("{{ '{} and {}'.format(1, 'b') }} {{ '{0}{name}'.format('x', name='y') }}", "1 and b xy");
    EXPECT("{{ d.get('b') }} {{ d.get('zz', 'def') }} {{ d.get('zz') }} {{ d.keys()|list }} {{ d.values()|list }}",
           "1 def None ['b', 'a'] [1, [1, 2, {'x': None}]]");
    EXPECT("{{ 'a b c'.split(' ', 1) }} {{ ' a  b '.split(None, 1) }} {{ 'abc'.find('c') }} {{ 'aaa'.count('a') }}",
           "['a', 'b c'] ['a', 'b '] 2 3");
    EXPECT("{{ 'x'.join(['a','b']) }} {{ s.split('l') }}", "axb ['h\xc3\xa9', '', 'o w\xc3\xb6r', 'd']");
}

EXL_TEST(syntax_errors_have_line_and_column) {
    EXPECT_FAIL("{% for %}", EXL_ERR_FORMAT, "chat template:1:8: expected a name, got '%}'");
    EXPECT_FAIL("ab\n{% if x %}", EXL_ERR_FORMAT, ":2:11: expected 'elif' or 'else' or 'endif', got end of template");
    EXPECT_FAIL("{{ 1 + }}", EXL_ERR_FORMAT, ":1:8: expected an expression, got '}}'");
    EXPECT_FAIL("x\n  {{ \"abc }}", EXL_ERR_FORMAT, ":2:6: unterminated string literal");
    EXPECT_FAIL("{% endfor %}", EXL_ERR_FORMAT, ":1:4: unexpected 'endfor'");
    EXPECT_FAIL("{% foo %}", EXL_ERR_FORMAT, "unknown tag 'foo'");
    EXPECT_FAIL("{% include 'x' %}", EXL_ERR_UNSUPPORTED, "'include' tag is not supported");
    EXPECT_FAIL("{% if 1 %}{% break %}{% endif %}", EXL_ERR_FORMAT, ":1:14: 'break' outside of a loop");
    EXPECT_FAIL("{#", EXL_ERR_FORMAT, "unterminated comment");
    EXPECT_FAIL("{{ 99999999999999999999 }}", EXL_ERR_FORMAT, "integer literal too large");
}

EXL_TEST(runtime_errors) {
    EXPECT_FAIL("{{ raise_exception('boom') }}", EXL_ERR_ARG, "boom");
    exl_status st;
    CHECK(!render("{{ raise_exception('exactly this') }}", NULL, &st) && !strcmp(exl_last_error(), "exactly this"));
    EXPECT_FAIL("{{ undefined_thing.foo }}", EXL_ERR_ARG, ":1:19: 'undefined_thing' is undefined");
    EXPECT_FAIL("\n{{ 5 // 0 }}", EXL_ERR_ARG, ":2:6: integer division or modulo by zero");
    EXPECT_FAIL("{{ 1 + 'a' }}", EXL_ERR_ARG, "unsupported operand types for +: 'int' and 'string'");
    EXPECT_FAIL("{{ x | nofilter }}", EXL_ERR_UNSUPPORTED, "unknown filter 'nofilter'");
    EXPECT_FAIL("{% for a, b in [1] %}{% endfor %}", EXL_ERR_ARG, "cannot unpack");
    EXPECT_FAIL("{{ [1,2,3][1:2:0] }}", EXL_ERR_ARG, "slice step cannot be zero");
    EXPECT_FAIL("{% set x = 1 %}{% set x.y = 2 %}", EXL_ERR_ARG, "only on a namespace");
    /* a missing key computed at run time: the key string is gone by the time the error is
     * written (found by fuzz_jinja; a use after free under ASan) */
    EXPECT_FAIL("{% set d = {} %}{{ d['a' ~ 'b'] + 1 }}", EXL_ERR_ARG, "'value' is undefined");
}

EXL_TEST(hostile_templates_hit_limits) {
    char deep[1024];
    snprintf(
        deep, sizeof deep, "{{ %.*s1%.*s }}", 300,
        "((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((((",
        300,
        "))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))))");
    EXPECT_FAIL(deep, EXL_ERR_FORMAT, "nesting deeper than");
    EXPECT_FAIL("{{ 'a' * 1000000000 }}", EXL_ERR_UNSUPPORTED, "larger than");
    EXPECT_FAIL("{% set ns = namespace(x='ab') %}{% for i in range(100) %}{% set ns.x = ns.x + ns.x %}{% endfor %}",
                EXL_ERR_UNSUPPORTED, "larger than");
    EXPECT_FAIL("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", EXL_ERR_UNSUPPORTED, "nested deeper");
    EXPECT("{% set ns = namespace() %}{% set ns.a = ns %}{{ ns.a.a.a }}", "<Namespace>");
}

EXL_TEST(allocation_failures_are_reported) {
    const char *src = "{% set ns = namespace(k=[]) %}{% for m in messages %}{% set ns.k = ns.k + [m.role|upper] %}"
                      "{{ m|tojson }}{{ loop.index }}{% endfor %}{{ ns.k|join(',') }}{{ d|dictsort }}";
    cJSON *ctx = cJSON_Parse(CTX);
    int failures = 0, n;
    for (n = 0; n < 2000; n++) {
        exl_jinja *t = NULL;
        char *out = NULL;
        exl_alloc_fail_after(n);
        exl_status st = exl_jinja_parse(NULL, src, strlen(src), &t);
        if (st == EXL_OK)
            st = exl_jinja_render(t, ctx, NULL, &out);
        exl_alloc_fail_after(-1);
        exl_jinja_free(t);
        if (st == EXL_OK) {
            CHECK(out && strstr(out, "USER,ASSISTANT"));
            exl_free(out);
            break;
        }
        CHECK_MSG(st == EXL_ERR_NOMEM, "allocation %d: %s", n, exl_last_error());
        failures++;
    }
    cJSON_Delete(ctx);
    CHECK(failures > 50 && n < 2000);
}

EXL_TEST(custom_limits) {
    exl_jinja *t;
    const char *src = "{% for i in range(1000) %}x{% endfor %}";
    REQUIRE_OK(exl_jinja_parse("tiny", src, strlen(src), &t));
    exl_jinja_limits lim = {.max_steps = 500};
    char *out = NULL;
    CHECK(exl_jinja_render(t, NULL, &lim, &out) == EXL_ERR_UNSUPPORTED && !out);
    CHECK(strstr(exl_last_error(), "tiny:1:") != NULL);
    lim.max_steps = 0;
    lim.max_bytes = 100;
    CHECK(exl_jinja_render(t, NULL, &lim, &out) == EXL_ERR_UNSUPPORTED && !out);
    REQUIRE_OK(exl_jinja_render(t, NULL, NULL, &out));
    CHECK(strlen(out) == 1000);
    exl_free(out);
    exl_jinja_free(t);
}

EXL_TEST(large_dicts_are_indexed) {
    cJSON *ctx = cJSON_CreateObject(), *d = cJSON_AddObjectToObject(ctx, "d");
    char key[32];
    for (int i = 0; i < 50000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        cJSON_AddNumberToObject(d, key, i);
    }
    cJSON_AddNumberToObject(d, "k7", -7); /* a duplicate key: the last value wins, as in Python */
    const char *src = "{{ d|length }} {{ d.k49999 }} {{ d['k7'] }} {{ dict(d, k1='x').k1 }} {{ 'k123' in d }}";
    exl_jinja *t;
    char *out = NULL;
    REQUIRE_OK(exl_jinja_parse(NULL, src, strlen(src), &t));
    exl_status st = exl_jinja_render(t, ctx, NULL, &out);
    CHECK_MSG(st == EXL_OK && !strcmp(out, "50000 49999 -7 x True"), "%s", out ? out : exl_last_error());
    exl_free(out);
    exl_jinja_free(t);
    cJSON_Delete(ctx);
}
