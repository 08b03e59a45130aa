/* openai_response.c - JSON for completion / chat completion responses and SSE chunks,
 * shaped as in the OpenAI API reference. Texts are written with their lengths (cJSON's own
 * strings would end at a generated U+0000); a token whose bytes are not whole UTF-8 (part of
 * a character) is named "bytes:\\xe2\\x80" as OpenAI does, and chat's `bytes` are its raw bytes. */
#include "server/openai_response.h"

#include "base/alloc.h"
#include "base/utf8.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- small helpers */

static const char *object_name(const exl_oai_header *h, int chunk) {
    if (h->kind == EXL_OAI_COMPLETION)
        return "text_completion";
    return chunk ? "chat.completion.chunk" : "chat.completion";
}

static cJSON *header_object(const exl_oai_header *h, int chunk) {
    cJSON *o = cJSON_CreateObject();
    if (o && cJSON_AddStringToObject(o, "id", h->id) && cJSON_AddStringToObject(o, "object", object_name(h, chunk)) &&
        cJSON_AddNumberToObject(o, "created", (double)h->created) && cJSON_AddStringToObject(o, "model", h->model))
        return o;
    cJSON_Delete(o);
    return NULL;
}

static cJSON *usage_object(const exl_oai_usage *u) {
    cJSON *o = cJSON_CreateObject();
    if (o && cJSON_AddNumberToObject(o, "prompt_tokens", u->prompt_tokens) &&
        cJSON_AddNumberToObject(o, "completion_tokens", u->completion_tokens) &&
        cJSON_AddNumberToObject(o, "total_tokens", u->prompt_tokens + u->completion_tokens))
        return o;
    cJSON_Delete(o);
    return NULL;
}

/* Serialize, free o, and return an exl_malloc'd copy. */
static char *finish_json(cJSON *o) {
    char *s = o ? cJSON_PrintUnformatted(o) : NULL;
    char *out = s ? exl_strdup(s) : NULL;
    cJSON_free(s);
    cJSON_Delete(o);
    return out;
}

const char *exl_oai_finish_str(exl_finish_reason r) { return r == EXL_FINISH_LENGTH ? "length" : "stop"; }

int exl_json_quote(exl_str *out, const char *s, size_t n) {
    if (exl_str_reserve(out, n + 2) || exl_str_putc(out, '"'))
        return -1;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        const char *esc = c == '"'    ? "\\\""
                          : c == '\\' ? "\\\\"
                          : c == '\n' ? "\\n"
                          : c == '\r' ? "\\r"
                          : c == '\t' ? "\\t"
                                      : NULL;
        int rc = esc        ? exl_str_puts(out, esc)
                 : c < 0x20 ? exl_str_printf(out, "\\u%04x", c)
                            : exl_str_putc(out, (char)c);
        if (rc)
            return -1;
    }
    return exl_str_putc(out, '"');
}

cJSON *exl_json_string(const char *s, size_t n) {
    exl_str q = EXL_STR_INIT;
    cJSON *item = exl_json_quote(&q, s, n) ? NULL : cJSON_CreateRaw(q.data);
    exl_str_free(&q);
    return item;
}

/* A number as cJSON prints it: the shortest of 15 or 17 significant digits that reads back. */
static int json_number(exl_str *out, double v) {
    char buf[32];
    snprintf(buf, sizeof buf, "%1.15g", v);
    if (strtod(buf, NULL) != v)
        snprintf(buf, sizeof buf, "%1.17g", v);
    return exl_str_puts(out, buf);
}

void exl_oai_call_id(const exl_oai_header *h, int32_t index, int32_t k, char out[32]) {
    static const char digits[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    uint64_t x = 1469598103934665603ull;
    for (const char *p = h->id; *p; p++)
        x = (x ^ (unsigned char)*p) * 1099511628211ull;
    x ^= ((uint64_t)index << 32) ^ (uint64_t)k;
    memcpy(out, "call_", 5);
    for (int i = 0; i < 24; i++) { /* splitmix64 steps */
        uint64_t z = (x += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        out[5 + i] = digits[(z ^ (z >> 31)) % 62];
    }
    out[29] = 0;
}

/* {"id", "type": "function", "function": {"name", "arguments"}} (id, name NULL: left out) */
static cJSON *call_object(const char *id, const char *name, const char *args, int32_t stream_index) {
    cJSON *o = cJSON_CreateObject();
    cJSON *fn = NULL;
    int ok = o && (stream_index < 0 || cJSON_AddNumberToObject(o, "index", stream_index)) &&
             (!id || (cJSON_AddStringToObject(o, "id", id) && cJSON_AddStringToObject(o, "type", "function"))) &&
             (fn = cJSON_AddObjectToObject(o, "function")) && (!name || cJSON_AddStringToObject(fn, "name", name)) &&
             cJSON_AddStringToObject(fn, "arguments", args);
    if (ok)
        return o;
    cJSON_Delete(o);
    return NULL;
}

static cJSON *tool_calls_array(const exl_oai_header *h, int32_t index, const exl_tool_calls *calls) {
    cJSON *a = cJSON_CreateArray();
    for (int32_t k = 0; a && k < calls->n; k++) {
        char id[32];
        exl_oai_call_id(h, index, k, id);
        cJSON *c = call_object(id, calls->v[k].name, calls->v[k].arguments, -1);
        if (!c || !cJSON_AddItemToArray(a, c)) {
            cJSON_Delete(c);
            cJSON_Delete(a);
            return NULL;
        }
    }
    return a;
}

/* ---------------------------------------------------------------- log-probabilities */

cJSON *exl_oai_logprobs_new(exl_oai_kind kind) {
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    int ok = kind == EXL_OAI_CHAT
                 ? cJSON_AddArrayToObject(o, "content") != NULL
                 : cJSON_AddArrayToObject(o, "tokens") && cJSON_AddArrayToObject(o, "token_logprobs") &&
                       cJSON_AddArrayToObject(o, "top_logprobs") && cJSON_AddArrayToObject(o, "text_offset");
    if (ok)
        return o;
    cJSON_Delete(o);
    return NULL;
}

static double finite_lp(float lp) { return isfinite(lp) ? lp : -9999.0; }

/* ---------------------------------------------------------------- a token's bytes and name */

/* "<0xAB>" -> 0xAB, else -1. */
static int byte_token(const char *s) {
    unsigned v;
    char end;
    return strlen(s) == 6 && sscanf(s, "<0x%2X%c", &v, &end) == 2 && end == '>' ? (int)v : -1;
}

/* The byte a ByteLevel (GPT-2) vocabulary character stands for, else -1: printable bytes stand
 * for themselves, the others are U+0100 onwards in byte order. */
static int bytelevel_byte(int32_t cp) {
    int printable = (cp >= 33 && cp <= 126) || (cp >= 161 && cp <= 172) || (cp >= 174 && cp <= 255);
    if (printable)
        return cp;
    for (int b = 0, k = 256; b < 256 && cp >= 256; b++)
        if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) && k++ == cp)
            return b;
    return -1;
}

static int bytelevel_bytes(const char *vocab, exl_str *out) {
    size_t n = strlen(vocab), mark = out->len;
    if (!n || !exl_utf8_valid(vocab, n))
        return -1;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        i += (size_t)exl_utf8_decode(vocab + i, &cp);
        int b = bytelevel_byte(cp);
        if (b < 0 || exl_str_putc(out, (char)b)) {
            out->len = mark;
            return -1;
        }
    }
    return 0;
}

/* The bytes a token stands for: a byte-fallback token's byte; a ByteLevel token's bytes when
 * decoding it alone does not give whole characters; else what decoding it alone gives. An id the
 * model has and the tokenizer does not (a padded vocabulary) stands for nothing. */
static int token_bytes(const exl_tokenizer *tok, int32_t id, exl_str *out) {
    if (id >= exl_tokenizer_vocab_size(tok))
        return exl_str_reserve(out, 0);
    const char *vocab = exl_tokenizer_token_text(tok, id);
    int b = vocab ? byte_token(vocab) : -1;
    if (b >= 0)
        return exl_str_putc(out, (char)b);
    char *text = NULL;
    if (exl_tokenizer_decode(tok, &id, 1, 0, &text) != EXL_OK)
        return -1;
    int partial = !*text || strstr(text, "\xEF\xBF\xBD"); /* empty: a NUL, or a lone piece of a character */
    int rc = partial && vocab && bytelevel_bytes(vocab, out) == 0 ? 0 : exl_str_puts(out, text);
    exl_string_free(text);
    return rc;
}

/* A token as a JSON string: its text, or "bytes:\\xe2\\x80" when its bytes are not whole UTF-8. */
static int token_name(exl_str *out, const exl_str *bytes) {
    const char *b = bytes->data ? bytes->data : "";
    if (exl_utf8_valid(b, bytes->len))
        return exl_json_quote(out, b, bytes->len);
    exl_str name = EXL_STR_INIT;
    int rc = exl_str_puts(&name, "bytes:");
    for (size_t i = 0; i < bytes->len && !rc; i++)
        rc = exl_str_printf(&name, "\\x%02x", (unsigned char)b[i]);
    rc = rc || exl_json_quote(out, name.data, name.len);
    exl_str_free(&name);
    return rc;
}

/* ---------------------------------------------------------------- per-token entries */

/* {"token", "logprob", "bytes"} (chat), as JSON text */
static int chat_token(exl_str *out, const exl_tokenizer *tok, int32_t id, float lp) {
    exl_str bytes = EXL_STR_INIT;
    int rc = token_bytes(tok, id, &bytes) || exl_str_puts(out, "{\"token\":") || token_name(out, &bytes) ||
             exl_str_puts(out, ",\"logprob\":") || json_number(out, finite_lp(lp)) || exl_str_puts(out, ",\"bytes\":[");
    for (size_t i = 0; i < bytes.len && !rc; i++)
        rc = exl_str_printf(out, i ? ",%u" : "%u", (unsigned char)bytes.data[i]);
    rc = rc || exl_str_putc(out, ']');
    exl_str_free(&bytes);
    return rc;
}

static int add_chat_token(cJSON *content, const exl_tokenizer *tok, const exl_stream_event *e, int32_t i) {
    exl_str o = EXL_STR_INIT;
    int rc = chat_token(&o, tok, e->ids[i], e->logprobs ? e->logprobs[i] : NAN) ||
             exl_str_puts(&o, ",\"top_logprobs\":[");
    for (int32_t k = 0; k < e->n_top && !rc; k++) {
        const exl_token_logprob *t = &e->top_logprobs[(size_t)i * (size_t)e->n_top + (size_t)k];
        rc = (k && exl_str_putc(&o, ',')) || chat_token(&o, tok, t->id, t->logprob) || exl_str_putc(&o, '}');
    }
    rc = rc || exl_str_puts(&o, "]}");
    cJSON *item = rc ? NULL : cJSON_CreateRaw(o.data);
    exl_str_free(&o);
    if (!item || !cJSON_AddItemToArray(content, item)) {
        cJSON_Delete(item);
        return -1;
    }
    return 0;
}

/* {"name": logprob, ...} of the alternatives, the first of equal names kept (as JSON text). */
static cJSON *completion_tops(const exl_tokenizer *tok, const exl_stream_event *e, int32_t i) {
    exl_str o = EXL_STR_INIT, bytes = EXL_STR_INIT, names = EXL_STR_INIT;
    int rc = exl_str_putc(&o, '{');
    for (int32_t k = 0; k < e->n_top && !rc; k++) {
        const exl_token_logprob *t = &e->top_logprobs[(size_t)i * (size_t)e->n_top + (size_t)k];
        size_t mark = names.len;
        exl_str_clear(&bytes);
        rc = token_bytes(tok, t->id, &bytes) || token_name(&names, &bytes) || exl_str_putc(&names, '\n');
        if (rc)
            break;
        /* the name just added, quoted, with a newline after it; earlier ones before it */
        size_t len = names.len - mark;
        const char *dup = NULL;
        for (const char *p = names.data; p < names.data + mark; p = strchr(p, '\n') + 1)
            if ((size_t)(strchr(p, '\n') - p) + 1 == len && !memcmp(p, names.data + mark, len))
                dup = p;
        if (dup)
            continue;
        rc = (o.len > 1 && exl_str_putc(&o, ',')) || exl_str_append(&o, names.data + mark, len - 1) ||
             exl_str_putc(&o, ':') || json_number(&o, finite_lp(t->logprob));
    }
    rc = rc || exl_str_putc(&o, '}');
    cJSON *item = rc ? NULL : cJSON_CreateRaw(o.data);
    exl_str_free(&o);
    exl_str_free(&bytes);
    exl_str_free(&names);
    return item;
}

static int add_completion_token(cJSON *lp, const exl_tokenizer *tok, const exl_stream_event *e, int32_t i,
                                size_t *offset) {
    exl_str bytes = EXL_STR_INIT, name = EXL_STR_INIT;
    int rc = token_bytes(tok, e->ids[i], &bytes) || token_name(&name, &bytes);
    cJSON *tops = rc ? NULL : e->n_top ? completion_tops(tok, e, i) : cJSON_CreateNull();
    cJSON *token = tops ? cJSON_CreateRaw(name.data) : NULL;
    int ok = token && cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "tokens"), token);
    if (!ok)
        cJSON_Delete(token);
    ok = ok &&
         cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "token_logprobs"),
                              cJSON_CreateNumber(finite_lp(e->logprobs ? e->logprobs[i] : NAN))) &&
         cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "text_offset"),
                              cJSON_CreateNumber((double)*offset)) &&
         cJSON_AddItemToArray(cJSON_GetObjectItemCaseSensitive(lp, "top_logprobs"), tops);
    *offset += bytes.len;
    exl_str_free(&bytes);
    exl_str_free(&name);
    if (!ok) {
        cJSON_Delete(tops); /* the last thing added: not in lp when anything failed */
        return -1;
    }
    return 0;
}

int exl_oai_logprobs_add(cJSON *lp, exl_oai_kind kind, const exl_tokenizer *tok, const exl_stream_event *e,
                         size_t text_offset) {
    int32_t n = e->n_ids;
    if (e->finish == EXL_FINISH_STOP && n > 0 && e->stop_token >= 0 && e->ids[n - 1] == e->stop_token)
        n--; /* the end-of-sequence token is not part of the text */
    cJSON *content = cJSON_GetObjectItemCaseSensitive(lp, "content");
    for (int32_t i = 0; i < n; i++)
        if (kind == EXL_OAI_CHAT ? add_chat_token(content, tok, e, i)
                                 : add_completion_token(lp, tok, e, i, &text_offset))
            return -1;
    return 0;
}

/* ---------------------------------------------------------------- whole responses */

static cJSON *choice_object(const exl_oai_header *h, int32_t index, const exl_oai_choice *c) {
    cJSON *o = cJSON_CreateObject();
    if (!o || !cJSON_AddNumberToObject(o, "index", index))
        goto fail;
    const char *body = c->text.data ? c->text.data : "";
    cJSON *text = NULL;
    if (h->kind == EXL_OAI_CHAT && c->calls.n) { /* the text before the calls is the content, if any */
        size_t end = c->calls.content_len;
        while (end && strchr(" \t\r\n", body[end - 1]))
            end--;
        cJSON *m = cJSON_AddObjectToObject(o, "message");
        text = end ? exl_json_string(body, end) : cJSON_CreateNull();
        cJSON *calls = tool_calls_array(h, index, &c->calls);
        if (!m || !text || !calls || !cJSON_AddStringToObject(m, "role", "assistant") ||
            !cJSON_AddItemToObject(m, "content", text)) {
            cJSON_Delete(calls);
            goto fail_text;
        }
        if (!cJSON_AddItemToObject(m, "tool_calls", calls)) {
            cJSON_Delete(calls);
            goto fail;
        }
    } else if (h->kind == EXL_OAI_CHAT) {
        text = exl_json_string(body, c->text.len);
        cJSON *m = cJSON_AddObjectToObject(o, "message");
        if (!m || !cJSON_AddStringToObject(m, "role", "assistant") || !cJSON_AddItemToObject(m, "content", text))
            goto fail_text;
    } else if (!(text = exl_json_string(body, c->text.len)) || !cJSON_AddItemToObject(o, "text", text)) {
        goto fail_text;
    }
    cJSON *lp = c->logprobs ? cJSON_Duplicate(c->logprobs, 1) : cJSON_CreateNull();
    if (!cJSON_AddItemToObject(o, "logprobs", lp)) {
        cJSON_Delete(lp);
        goto fail;
    }
    if (cJSON_AddStringToObject(o, "finish_reason", c->calls.n ? "tool_calls" : exl_oai_finish_str(c->finish)))
        return o;
    goto fail;
fail_text:
    cJSON_Delete(text);
fail:
    cJSON_Delete(o);
    return NULL;
}

char *exl_oai_response_json(const exl_oai_header *h, const exl_oai_choice *choices, int32_t n,
                            const exl_oai_usage *usage) {
    cJSON *o = header_object(h, 0);
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "choices") : NULL;
    if (!arr) {
        cJSON_Delete(o);
        return NULL;
    }
    for (int32_t i = 0; i < n; i++) {
        cJSON *c = choice_object(h, i, &choices[i]);
        if (!c || !cJSON_AddItemToArray(arr, c)) {
            cJSON_Delete(o);
            return NULL;
        }
    }
    cJSON *u = usage_object(usage);
    if (!u || !cJSON_AddItemToObject(o, "usage", u)) {
        cJSON_Delete(u);
        cJSON_Delete(o);
        return NULL;
    }
    return finish_json(o);
}

/* ---------------------------------------------------------------- streamed chunks */

static int append_event(exl_str *out, cJSON *o) {
    char *s = finish_json(o);
    int rc = !s || exl_str_puts(out, "data: ") || exl_str_puts(out, s) || exl_str_puts(out, "\n\n") ? -1 : 0;
    exl_free(s);
    return rc;
}

static cJSON *chunk_choice(const exl_oai_header *h, int32_t index, int role, const char *text, size_t text_len,
                           const cJSON *lp, const char *finish) {
    cJSON *c = cJSON_CreateObject();
    if (!c || !cJSON_AddNumberToObject(c, "index", index))
        goto fail;
    cJSON *t = exl_json_string(text ? text : "", text ? text_len : 0), *ok;
    if (!t)
        goto fail;
    if (h->kind == EXL_OAI_CHAT) {
        cJSON *d = cJSON_AddObjectToObject(c, "delta");
        ok = d && (!role || cJSON_AddStringToObject(d, "role", "assistant")) &&
                     (!text || cJSON_AddItemToObject(d, "content", t))
                 ? d
                 : NULL;
        if (!text || !ok)
            cJSON_Delete(t);
    } else {
        ok = cJSON_AddItemToObject(c, "text", t) ? c : NULL;
        if (!ok)
            cJSON_Delete(t);
    }
    cJSON *l = lp ? cJSON_Duplicate(lp, 1) : cJSON_CreateNull();
    if (!ok || !cJSON_AddItemToObject(c, "logprobs", l)) {
        cJSON_Delete(l);
        goto fail;
    }
    if (finish ? cJSON_AddStringToObject(c, "finish_reason", finish) : cJSON_AddNullToObject(c, "finish_reason"))
        return c;
fail:
    cJSON_Delete(c);
    return NULL;
}

int exl_oai_chunk_append(exl_str *out, const exl_oai_header *h, int32_t index, int role, const char *text,
                         size_t text_len, const cJSON *lp, const char *finish, int with_usage) {
    cJSON *o = header_object(h, 1);
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "choices") : NULL;
    cJSON *c = arr ? chunk_choice(h, index, role, text, text_len, lp, finish) : NULL;
    if (!c) {
        cJSON_Delete(o);
        return -1;
    }
    cJSON_AddItemToArray(arr, c); /* cannot fail: both exist */
    if (with_usage && !cJSON_AddNullToObject(o, "usage")) {
        cJSON_Delete(o);
        return -1;
    }
    return append_event(out, o);
}

/* One chunk whose delta holds one tool call entry. */
static int tool_chunk(exl_str *out, const exl_oai_header *h, int32_t index, cJSON *entry, int with_usage) {
    cJSON *o = header_object(h, 1);
    cJSON *arr = o ? cJSON_AddArrayToObject(o, "choices") : NULL;
    cJSON *c = arr ? cJSON_CreateObject() : NULL;
    cJSON *d = c && cJSON_AddItemToArray(arr, c) && cJSON_AddNumberToObject(c, "index", index)
                   ? cJSON_AddObjectToObject(c, "delta")
                   : NULL;
    cJSON *calls = d ? cJSON_AddArrayToObject(d, "tool_calls") : NULL;
    if (!calls || !cJSON_AddItemToArray(calls, entry) || !cJSON_AddNullToObject(c, "logprobs") ||
        !cJSON_AddNullToObject(c, "finish_reason") || (with_usage && !cJSON_AddNullToObject(o, "usage"))) {
        if (!calls)
            cJSON_Delete(entry);
        cJSON_Delete(o);
        return -1;
    }
    return append_event(out, o);
}

int exl_oai_tool_chunks_append(exl_str *out, const exl_oai_header *h, int32_t index, int32_t k,
                               const exl_tool_call *call, int with_usage) {
    char id[32];
    exl_oai_call_id(h, index, k, id);
    cJSON *head = call_object(id, call->name, "", k);
    if (!head || tool_chunk(out, h, index, head, with_usage))
        return -1;
    size_t n = strlen(call->arguments), piece = 24, len;
    for (size_t at = 0; at < n; at += len) { /* pieces on character boundaries */
        len = n - at < piece ? n - at : piece;
        while (at + len < n && ((unsigned char)call->arguments[at + len] & 0xc0) == 0x80)
            len++;
        char *part = exl_strndup(call->arguments + at, len);
        cJSON *entry = part ? call_object(NULL, NULL, part, k) : NULL;
        exl_free(part);
        if (!entry || tool_chunk(out, h, index, entry, with_usage))
            return -1;
    }
    return 0;
}

int exl_oai_usage_chunk_append(exl_str *out, const exl_oai_header *h, const exl_oai_usage *usage) {
    cJSON *o = header_object(h, 1);
    cJSON *u = usage_object(usage);
    if (!o || !u || !cJSON_AddArrayToObject(o, "choices") || !cJSON_AddItemToObject(o, "usage", u)) {
        cJSON_Delete(u);
        cJSON_Delete(o);
        return -1;
    }
    return append_event(out, o);
}
