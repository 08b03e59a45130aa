/* tok_load_json.c - reads a Hugging Face tokenizer.json into an exl_tokenizer: the BPE
 * model (vocab, merges in "a b" or ["a","b"] form), added tokens, and the normalizer,
 * pre-tokenizer, post-processor and decoder trees (flattened into lists). Every field is
 * checked; a malformed file gives a one-line message naming the file and the field. */
#include "tokenizer.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <string.h>

#include "base/alloc.h"
#include "base/error.h"

#define MAX_TOKEN_ID (1 << 24)

/* The word splits built into the ByteLevel and Whitespace pre-tokenizers. */
#define GPT2_SPLIT "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+"
#define WHITESPACE_SPLIT "\\w+|[^\\w\\s]+"

typedef struct loader {
    exl_tokenizer *tok;
    const char *path;
} loader;

static exl_status bad(const loader *L, const char *field, const char *what) {
    return exl_fail(EXL_ERR_FORMAT, "%s: %s: %s", L->path, field, what);
}

static exl_status nomem(const loader *L) { return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", L->path); }

/* ---------------------------------------------------------------- field helpers */

/* A string field; *out NULL when absent or null and !required. */
static exl_status get_str(const loader *L, const cJSON *obj, const char *key, const char *where, int required,
                          const char **out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NULL;
    if (!v || cJSON_IsNull(v)) {
        if (!required)
            return EXL_OK;
        char f[128];
        snprintf(f, sizeof f, "%s.%s", where, key);
        return bad(L, f, "missing");
    }
    if (!cJSON_IsString(v)) {
        char f[128];
        snprintf(f, sizeof f, "%s.%s", where, key);
        return bad(L, f, "expected a string");
    }
    *out = v->valuestring;
    return EXL_OK;
}

static exl_status get_bool(const loader *L, const cJSON *obj, const char *key, const char *where, int dflt, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = dflt;
    if (!v || cJSON_IsNull(v))
        return EXL_OK;
    if (!cJSON_IsBool(v)) {
        char f[128];
        snprintf(f, sizeof f, "%s.%s", where, key);
        return bad(L, f, "expected true or false");
    }
    *out = cJSON_IsTrue(v);
    return EXL_OK;
}

static exl_status get_int(const loader *L, const cJSON *obj, const char *key, const char *where, int dflt, int lo,
                          int hi, int *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = dflt;
    if (!v || cJSON_IsNull(v))
        return EXL_OK;
    /* the range first: casting a double outside long long's range is undefined */
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo && v->valuedouble <= hi) ||
        v->valuedouble != (double)(long long)v->valuedouble) {
        char f[128];
        snprintf(f, sizeof f, "%s.%s", where, key);
        char w[96];
        snprintf(w, sizeof w, "expected an integer in [%d, %d]", lo, hi);
        return bad(L, f, w);
    }
    *out = (int)v->valuedouble;
    return EXL_OK;
}

static char *arena_str(exl_tokenizer *tok, const char *s) { return exl_tok_arena_dup(&tok->arena, s, strlen(s)); }

/* {"String": "..."} or {"Regex": "..."} */
static exl_status get_pattern(const loader *L, const cJSON *obj, const char *where, exl_tok_pattern *out) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(obj, "pattern");
    char f[128];
    snprintf(f, sizeof f, "%s.pattern", where);
    if (!cJSON_IsObject(p))
        return bad(L, f, "expected an object with \"String\" or \"Regex\"");
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(p, "String");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(p, "Regex");
    if (cJSON_IsString(s)) {
        if (!s->valuestring[0])
            return bad(L, f, "empty string pattern");
        out->literal_len = strlen(s->valuestring);
        out->literal = exl_tok_arena_dup(&L->tok->arena, s->valuestring, out->literal_len);
        return out->literal ? EXL_OK : nomem(L);
    }
    if (cJSON_IsString(r))
        return exl_tok_regex_compile(L->path, f, r->valuestring, strlen(r->valuestring), &out->re);
    return bad(L, f, "expected an object with \"String\" or \"Regex\"");
}

static exl_status get_behavior(const loader *L, const cJSON *obj, const char *where, exl_tok_split_behavior dflt,
                               exl_tok_split_behavior *out) {
    const char *b;
    EXL_TRY(get_str(L, obj, "behavior", where, 0, &b));
    *out = dflt;
    if (!b)
        return EXL_OK;
    static const char *names[] = {"Removed", "Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
    for (int i = 0; i < 5; i++)
        if (!strcmp(b, names[i])) {
            *out = (exl_tok_split_behavior)i;
            return EXL_OK;
        }
    char f[128];
    snprintf(f, sizeof f, "%s.behavior", where);
    return bad(L, f, "unknown split behavior");
}

/* "prepend_scheme" (always/first/never), or the older boolean "add_prefix_space". */
static exl_status get_prepend_scheme(const loader *L, const cJSON *obj, const char *where, int *out) {
    const char *s;
    EXL_TRY(get_str(L, obj, "prepend_scheme", where, 0, &s));
    if (s) {
        if (!strcmp(s, "always"))
            *out = EXL_TOK_PREPEND_ALWAYS;
        else if (!strcmp(s, "first"))
            *out = EXL_TOK_PREPEND_FIRST;
        else if (!strcmp(s, "never"))
            *out = EXL_TOK_PREPEND_NEVER;
        else {
            char f[128];
            snprintf(f, sizeof f, "%s.prepend_scheme", where);
            return bad(L, f, "expected \"always\", \"first\" or \"never\"");
        }
        return EXL_OK;
    }
    int add;
    EXL_TRY(get_bool(L, obj, "add_prefix_space", where, 1, &add));
    *out = add ? EXL_TOK_PREPEND_ALWAYS : EXL_TOK_PREPEND_NEVER;
    return EXL_OK;
}

static exl_status get_replacement(const loader *L, const cJSON *obj, const char *where, const char **out, size_t *len) {
    const char *r;
    EXL_TRY(get_str(L, obj, "replacement", where, 0, &r));
    if (!r)
        r = "\xE2\x96\x81";
    if (!*r) {
        char f[128];
        snprintf(f, sizeof f, "%s.replacement", where);
        return bad(L, f, "empty");
    }
    *len = strlen(r);
    *out = exl_tok_arena_dup(&L->tok->arena, r, *len);
    return *out ? EXL_OK : nomem(L);
}

/* Grow an array of n items of size sz by one; returns the new item (zeroed) or NULL. */
static void *push_item(void **arr, int32_t *n, size_t sz) {
    char *p = exl_realloc(*arr, (size_t)(*n + 1) * sz);
    if (!p)
        return NULL;
    *arr = p;
    memset(p + (size_t)*n * sz, 0, sz);
    return p + (size_t)(*n)++ * sz;
}

static const char *type_of(const loader *L, const cJSON *obj, const char *where, exl_status *st) {
    const char *t = NULL;
    *st = get_str(L, obj, "type", where, 1, &t);
    return t;
}

typedef exl_status (*component_fn)(const loader *L, const cJSON *n, const char *where, int depth);

/* The common head of a normalizer, pre-tokenizer, post-processor or decoder: an object with a
 * "type". A "Sequence" has each entry of its `list_key` array parsed by fn, and *type is set
 * to NULL; otherwise *type is the component's type for the caller to handle. */
static exl_status parse_component(const loader *L, const cJSON *n, const char *where, int depth, const char *list_key,
                                  component_fn fn, const char **type) {
    *type = NULL;
    if (depth > 16)
        return bad(L, where, "nested too deeply");
    if (!cJSON_IsObject(n))
        return bad(L, where, "expected an object");
    exl_status st;
    const char *t = type_of(L, n, where, &st);
    EXL_TRY(st);
    if (strcmp(t, "Sequence")) {
        *type = t;
        return EXL_OK;
    }
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(n, list_key);
    if (!cJSON_IsArray(list))
        return exl_fail(EXL_ERR_FORMAT, "%s: %s: Sequence needs a \"%s\" array", L->path, where, list_key);
    int i = 0;
    for (const cJSON *c = list->child; c; c = c->next, i++) {
        char f[128];
        snprintf(f, sizeof f, "%s.%s[%d]", where, list_key, i);
        EXL_TRY(fn(L, c, f, depth + 1));
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- normalizer */

static exl_status parse_normalizer(const loader *L, const cJSON *n, const char *where, int depth) {
    exl_tokenizer *tok = L->tok;
    const char *type;
    EXL_TRY(parse_component(L, n, where, depth, "normalizers", parse_normalizer, &type));
    if (!type)
        return EXL_OK;
    exl_tok_norm *o = push_item((void **)&tok->norms, &tok->n_norms, sizeof *o);
    if (!o)
        return nomem(L);
    if (!strcmp(type, "NFC"))
        o->kind = EXL_TOK_NORM_NFC;
    else if (!strcmp(type, "NFD"))
        o->kind = EXL_TOK_NORM_NFD;
    else if (!strcmp(type, "NFKC") || !strcmp(type, "Precompiled"))
        o->kind = EXL_TOK_NORM_NFKC; /* Precompiled (SentencePiece nmt_nfkc) is approximated by NFKC */
    else if (!strcmp(type, "NFKD"))
        o->kind = EXL_TOK_NORM_NFKD;
    else if (!strcmp(type, "Lowercase"))
        o->kind = EXL_TOK_NORM_LOWERCASE;
    else if (!strcmp(type, "StripAccents"))
        o->kind = EXL_TOK_NORM_STRIP_ACCENTS;
    else if (!strcmp(type, "Strip")) {
        o->kind = EXL_TOK_NORM_STRIP;
        EXL_TRY(get_bool(L, n, "strip_left", where, 1, &o->a));
        EXL_TRY(get_bool(L, n, "strip_right", where, 1, &o->b));
    } else if (!strcmp(type, "Replace")) {
        o->kind = EXL_TOK_NORM_REPLACE;
        const char *c;
        EXL_TRY(get_pattern(L, n, where, &o->pattern));
        EXL_TRY(get_str(L, n, "content", where, 1, &c));
        o->content_len = strlen(c);
        if (!(o->content = arena_str(tok, c)))
            return nomem(L);
    } else if (!strcmp(type, "Prepend")) {
        o->kind = EXL_TOK_NORM_PREPEND;
        const char *c;
        EXL_TRY(get_str(L, n, "prepend", where, 1, &c));
        o->content_len = strlen(c);
        if (!(o->content = arena_str(tok, c)))
            return nomem(L);
    } else {
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: %s: normalizer type '%s' is not supported", L->path, where, type);
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- pre-tokenizer */

static exl_status parse_pretok(const loader *L, const cJSON *n, const char *where, int depth) {
    exl_tokenizer *tok = L->tok;
    const char *type;
    EXL_TRY(parse_component(L, n, where, depth, "pretokenizers", parse_pretok, &type));
    if (!type)
        return EXL_OK;
    if (!strcmp(type, "BertPreTokenizer")) {
        exl_tok_pretok *o = push_item((void **)&tok->pretoks, &tok->n_pretoks, sizeof *o);
        if (!o)
            return nomem(L);
        o->kind = EXL_TOK_PRE_WSPLIT;
        if (!(o = push_item((void **)&tok->pretoks, &tok->n_pretoks, sizeof *o)))
            return nomem(L);
        o->kind = EXL_TOK_PRE_PUNCT;
        o->behavior = EXL_TOK_SPLIT_ISOLATED;
        return EXL_OK;
    }
    exl_tok_pretok *o = push_item((void **)&tok->pretoks, &tok->n_pretoks, sizeof *o);
    if (!o)
        return nomem(L);
    if (!strcmp(type, "ByteLevel")) {
        o->kind = EXL_TOK_PRE_BYTELEVEL;
        EXL_TRY(get_bool(L, n, "add_prefix_space", where, 1, &o->a));
        EXL_TRY(get_bool(L, n, "use_regex", where, 1, &o->b));
        if (o->b)
            EXL_TRY(exl_tok_regex_compile(L->path, where, GPT2_SPLIT, strlen(GPT2_SPLIT), &o->pattern.re));
    } else if (!strcmp(type, "Split")) {
        o->kind = EXL_TOK_PRE_SPLIT;
        EXL_TRY(get_pattern(L, n, where, &o->pattern));
        EXL_TRY(get_behavior(L, n, where, EXL_TOK_SPLIT_REMOVED, &o->behavior));
        EXL_TRY(get_bool(L, n, "invert", where, 0, &o->invert));
    } else if (!strcmp(type, "Metaspace")) {
        o->kind = EXL_TOK_PRE_METASPACE;
        EXL_TRY(get_replacement(L, n, where, &o->content, &o->content_len));
        EXL_TRY(get_prepend_scheme(L, n, where, &o->a));
        EXL_TRY(get_bool(L, n, "split", where, 1, &o->b));
    } else if (!strcmp(type, "Digits")) {
        o->kind = EXL_TOK_PRE_DIGITS;
        EXL_TRY(get_bool(L, n, "individual_digits", where, 0, &o->a));
    } else if (!strcmp(type, "Whitespace")) {
        /* keep the matches of \w+|[^\w\s]+ */
        o->kind = EXL_TOK_PRE_SPLIT;
        o->behavior = EXL_TOK_SPLIT_REMOVED;
        o->invert = 1;
        EXL_TRY(exl_tok_regex_compile(L->path, where, WHITESPACE_SPLIT, strlen(WHITESPACE_SPLIT), &o->pattern.re));
    } else if (!strcmp(type, "WhitespaceSplit")) {
        o->kind = EXL_TOK_PRE_WSPLIT;
    } else if (!strcmp(type, "Punctuation")) {
        o->kind = EXL_TOK_PRE_PUNCT;
        EXL_TRY(get_behavior(L, n, where, EXL_TOK_SPLIT_ISOLATED, &o->behavior));
    } else {
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: %s: pre-tokenizer type '%s' is not supported", L->path, where, type);
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- post-processor */

static exl_status push_ids(const loader *L, int32_t **arr, int32_t *n, int32_t id) {
    if (id < 0 || id >= L->tok->n_vocab)
        return bad(L, "post_processor", "special token id out of range");
    int32_t *p = exl_realloc(*arr, (size_t)(*n + 1) * sizeof *p);
    if (!p)
        return nomem(L);
    p[(*n)++] = id;
    *arr = p;
    return EXL_OK;
}

/* [content, id] pairs of BertProcessing / RobertaProcessing. */
static exl_status pair_id(const loader *L, const cJSON *n, const char *key, int32_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(n, key);
    if (!cJSON_IsArray(v) || cJSON_GetArraySize(v) != 2 || !cJSON_IsNumber(cJSON_GetArrayItem(v, 1)))
        return bad(L, "post_processor", "expected [token, id] pairs for cls and sep");
    double d = cJSON_GetArrayItem(v, 1)->valuedouble;
    if (d < 0 || d >= L->tok->n_vocab)
        return bad(L, "post_processor", "special token id out of range");
    *out = (int32_t)d;
    return EXL_OK;
}

static exl_status parse_template(const loader *L, const cJSON *n) {
    exl_tokenizer *tok = L->tok;
    const cJSON *single = cJSON_GetObjectItemCaseSensitive(n, "single");
    const cJSON *specials = cJSON_GetObjectItemCaseSensitive(n, "special_tokens");
    if (!cJSON_IsArray(single))
        return bad(L, "post_processor.single", "expected an array");
    int seen_seq = 0;
    for (const cJSON *it = single->child; it; it = it->next) {
        const cJSON *sp = cJSON_GetObjectItemCaseSensitive(it, "SpecialToken");
        const cJSON *sq = cJSON_GetObjectItemCaseSensitive(it, "Sequence");
        if (sq) {
            seen_seq = 1;
            continue;
        }
        const cJSON *name = cJSON_GetObjectItemCaseSensitive(sp, "id");
        if (!cJSON_IsString(name))
            return bad(L, "post_processor.single", "expected SpecialToken or Sequence items");
        const cJSON *entry = cJSON_GetObjectItemCaseSensitive(specials, name->valuestring);
        const cJSON *ids = cJSON_GetObjectItemCaseSensitive(entry, "ids");
        if (!cJSON_IsArray(ids))
            return exl_fail(EXL_ERR_FORMAT, "%s: post_processor.special_tokens: no ids for '%s'", L->path,
                            name->valuestring);
        for (const cJSON *id = ids->child; id; id = id->next) {
            if (!cJSON_IsNumber(id))
                return bad(L, "post_processor.special_tokens", "ids must be numbers");
            if (id->valuedouble < 0 || id->valuedouble >= tok->n_vocab)
                return bad(L, "post_processor.special_tokens", "special token id out of range");
            if (seen_seq)
                EXL_TRY(push_ids(L, &tok->post_suffix, &tok->n_post_suffix, (int32_t)id->valuedouble));
            else
                EXL_TRY(push_ids(L, &tok->post_prefix, &tok->n_post_prefix, (int32_t)id->valuedouble));
        }
    }
    return EXL_OK;
}

static exl_status parse_post(const loader *L, const cJSON *n, const char *where, int depth) {
    const char *type;
    EXL_TRY(parse_component(L, n, where, depth, "processors", parse_post, &type));
    if (!type)
        return EXL_OK;
    if (!strcmp(type, "TemplateProcessing"))
        return parse_template(L, n);
    if (!strcmp(type, "ByteLevel"))
        return EXL_OK; /* only trims offsets, which exl does not report */
    if (!strcmp(type, "BertProcessing") || !strcmp(type, "RobertaProcessing")) {
        int32_t cls, sep;
        EXL_TRY(pair_id(L, n, "cls", &cls));
        EXL_TRY(pair_id(L, n, "sep", &sep));
        EXL_TRY(push_ids(L, &L->tok->post_prefix, &L->tok->n_post_prefix, cls));
        return push_ids(L, &L->tok->post_suffix, &L->tok->n_post_suffix, sep);
    }
    return exl_fail(EXL_ERR_UNSUPPORTED, "%s: %s: post_processor type '%s' is not supported", L->path, where, type);
}

/* ---------------------------------------------------------------- decoder */

static exl_status parse_decoder(const loader *L, const cJSON *n, const char *where, int depth) {
    exl_tokenizer *tok = L->tok;
    const char *type;
    EXL_TRY(parse_component(L, n, where, depth, "decoders", parse_decoder, &type));
    if (!type)
        return EXL_OK;
    exl_tok_dec *o = push_item((void **)&tok->decs, &tok->n_decs, sizeof *o);
    if (!o)
        return nomem(L);
    if (!strcmp(type, "ByteLevel")) {
        o->kind = EXL_TOK_DEC_BYTELEVEL;
    } else if (!strcmp(type, "ByteFallback")) {
        o->kind = EXL_TOK_DEC_BYTEFALLBACK;
    } else if (!strcmp(type, "Fuse")) {
        o->kind = EXL_TOK_DEC_FUSE;
    } else if (!strcmp(type, "Replace")) {
        o->kind = EXL_TOK_DEC_REPLACE;
        const char *c;
        EXL_TRY(get_pattern(L, n, where, &o->pattern));
        EXL_TRY(get_str(L, n, "content", where, 1, &c));
        o->content_len = strlen(c);
        if (!(o->content = arena_str(tok, c)))
            return nomem(L);
    } else if (!strcmp(type, "Strip")) {
        o->kind = EXL_TOK_DEC_STRIP;
        const char *c;
        EXL_TRY(get_str(L, n, "content", where, 1, &c));
        if (!*c || (size_t)exl_utf8_len((unsigned char)*c) != strlen(c) || !exl_utf8_valid(c, strlen(c)))
            return bad(L, where, "Strip content must be one character");
        o->content_len = strlen(c);
        if (!(o->content = arena_str(tok, c)))
            return nomem(L);
        EXL_TRY(get_int(L, n, "start", where, 0, 0, 1 << 20, &o->a));
        EXL_TRY(get_int(L, n, "stop", where, 0, 0, 1 << 20, &o->b));
    } else if (!strcmp(type, "Metaspace")) {
        o->kind = EXL_TOK_DEC_METASPACE;
        EXL_TRY(get_replacement(L, n, where, &o->content, &o->content_len));
        EXL_TRY(get_prepend_scheme(L, n, where, &o->a));
    } else {
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: %s: decoder type '%s' is not supported", L->path, where, type);
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- model */

static exl_status max_id_of(const loader *L, const cJSON *vocab, const cJSON *added, int32_t *out) {
    int32_t mx = -1;
    for (const cJSON *v = vocab->child; v; v = v->next) {
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= 0 && v->valuedouble < MAX_TOKEN_ID) ||
            v->valuedouble != (double)(int64_t)v->valuedouble) /* the range before the cast */
            return exl_fail(EXL_ERR_FORMAT, "%s: model.vocab: id of '%.40s' is not an integer in [0, %d)", L->path,
                            v->string, MAX_TOKEN_ID);
        if ((int32_t)v->valuedouble > mx)
            mx = (int32_t)v->valuedouble;
    }
    int i = 0;
    for (const cJSON *a = added ? added->child : NULL; a; a = a->next, i++) {
        int id;
        char f[64];
        snprintf(f, sizeof f, "added_tokens[%d]", i);
        if (!cJSON_IsObject(a))
            return bad(L, f, "expected an object");
        EXL_TRY(get_int(L, a, "id", f, -1, 0, MAX_TOKEN_ID - 1, &id));
        if (id < 0)
            return exl_fail(EXL_ERR_FORMAT, "%s: %s.id: missing", L->path, f);
        if (id > mx)
            mx = id;
    }
    *out = mx + 1;
    return EXL_OK;
}

static exl_status parse_vocab(const loader *L, const cJSON *vocab) {
    exl_tokenizer *tok = L->tok;
    if (exl_strmap_init(&tok->vocab, (size_t)cJSON_GetArraySize(vocab)))
        return nomem(L);
    for (const cJSON *v = vocab->child; v; v = v->next) {
        int32_t id = (int32_t)v->valuedouble;
        size_t len = strlen(v->string);
        char *s = exl_tok_arena_dup(&tok->arena, v->string, len);
        if (!s || exl_strmap_put(&tok->vocab, s, len, id))
            return nomem(L);
        if (!tok->text[id]) {
            tok->text[id] = tok->dec_text[id] = s;
            tok->text_len[id] = tok->dec_len[id] = (uint32_t)len;
        }
    }
    return EXL_OK;
}

static exl_status add_merge(const loader *L, exl_str *key, int i, const char *a, size_t al, const char *b, size_t bl) {
    exl_tokenizer *tok = L->tok;
    int32_t ia = exl_strmap_get(&tok->vocab, a, al), ib = exl_strmap_get(&tok->vocab, b, bl);
    size_t pl = strlen(tok->subword_prefix);
    if (pl && bl >= pl && !memcmp(b, tok->subword_prefix, pl)) {
        b += pl;
        bl -= pl;
    }
    exl_str_clear(key);
    if (exl_str_append(key, a, al) || exl_str_append(key, b, bl))
        return nomem(L);
    int32_t id = exl_strmap_get(&tok->vocab, key->data, key->len);
    if (ia < 0 || ib < 0 || id < 0)
        return exl_fail(EXL_ERR_FORMAT,
                        "%s: model.merges[%d]: '%.40s' + '%.40s' uses a token missing from the vocabulary", L->path, i,
                        a, b);
    if (exl_pairmap_put(&tok->merges, ia, ib, (uint32_t)i, id))
        return nomem(L);
    return EXL_OK;
}

static exl_status parse_merges(const loader *L, const cJSON *merges) {
    exl_tokenizer *tok = L->tok;
    if (exl_pairmap_init(&tok->merges, (size_t)cJSON_GetArraySize(merges)))
        return nomem(L);
    exl_str key = EXL_STR_INIT;
    exl_status st = EXL_OK;
    int i = 0;
    for (const cJSON *m = merges->child; m && st == EXL_OK; m = m->next, i++) {
        if (cJSON_IsString(m)) {
            const char *s = m->valuestring;
            const char *sp = strchr(s, ' ');
            if (!sp || sp == s || !sp[1] || strchr(sp + 1, ' ')) {
                char f[64];
                snprintf(f, sizeof f, "model.merges[%d]", i);
                st = bad(L, f, "expected \"a b\"");
                break;
            }
            st = add_merge(L, &key, i, s, (size_t)(sp - s), sp + 1, strlen(sp + 1));
        } else if (cJSON_IsArray(m) && cJSON_GetArraySize(m) == 2 && cJSON_IsString(m->child) &&
                   cJSON_IsString(m->child->next)) {
            const char *a = m->child->valuestring, *b = m->child->next->valuestring;
            st = add_merge(L, &key, i, a, strlen(a), b, strlen(b));
        } else {
            char f[64];
            snprintf(f, sizeof f, "model.merges[%d]", i);
            st = bad(L, f, "expected \"a b\" or [\"a\", \"b\"]");
        }
    }
    exl_str_free(&key);
    return st;
}

static exl_status parse_model(const loader *L, const cJSON *model) {
    exl_tokenizer *tok = L->tok;
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (t && !cJSON_IsString(t))
        return bad(L, "model.type", "expected a string");
    if (t && strcmp(t->valuestring, "BPE"))
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: model type '%s' is not supported (only BPE)", L->path,
                        t->valuestring);
    const char *unk, *prefix, *suffix;
    EXL_TRY(get_str(L, model, "unk_token", "model", 0, &unk));
    EXL_TRY(get_str(L, model, "continuing_subword_prefix", "model", 0, &prefix));
    EXL_TRY(get_str(L, model, "end_of_word_suffix", "model", 0, &suffix));
    EXL_TRY(get_bool(L, model, "byte_fallback", "model", 0, &tok->byte_fallback));
    EXL_TRY(get_bool(L, model, "fuse_unk", "model", 0, &tok->fuse_unk));
    EXL_TRY(get_bool(L, model, "ignore_merges", "model", 0, &tok->ignore_merges));
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) && !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0.0))
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: model.dropout: BPE dropout is not supported", L->path);
    tok->subword_prefix = arena_str(tok, prefix ? prefix : "");
    tok->word_suffix = arena_str(tok, suffix ? suffix : "");
    if (!tok->subword_prefix || !tok->word_suffix)
        return nomem(L);
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!cJSON_IsArray(merges))
        return bad(L, "model.merges", "expected an array");
    EXL_TRY(parse_merges(L, merges));
    tok->unk_id = -1;
    if (unk) {
        tok->unk_id = exl_strmap_get(&tok->vocab, unk, strlen(unk));
        if (tok->unk_id < 0)
            return exl_fail(EXL_ERR_FORMAT, "%s: model.unk_token: '%.40s' is not in the vocabulary", L->path, unk);
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- the file */

static exl_status parse_added(const loader *L, const cJSON *added) {
    int i = 0;
    for (const cJSON *a = added->child; a; a = a->next, i++) {
        char f[64];
        snprintf(f, sizeof f, "added_tokens[%d]", i);
        const char *content;
        int id, special, lstrip, rstrip, normalized, single;
        EXL_TRY(get_int(L, a, "id", f, -1, 0, MAX_TOKEN_ID - 1, &id));
        EXL_TRY(get_str(L, a, "content", f, 1, &content));
        EXL_TRY(get_bool(L, a, "special", f, 0, &special));
        EXL_TRY(get_bool(L, a, "lstrip", f, 0, &lstrip));
        EXL_TRY(get_bool(L, a, "rstrip", f, 0, &rstrip));
        EXL_TRY(get_bool(L, a, "normalized", f, !special, &normalized));
        EXL_TRY(get_bool(L, a, "single_word", f, 0, &single));
        if (!*content)
            continue; /* tokenizers ignores empty added tokens */
        EXL_TRY(exl_tok_add_token(L->tok, L->path, id, content, strlen(content), special, lstrip, rstrip, normalized,
                                  single));
    }
    return EXL_OK;
}

exl_status exl_tok_load_json(exl_tokenizer *tok, const char *path, const char *data, size_t len) {
    loader L = {tok, path};
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(data, len, &end, 0);
    if (!root) {
        size_t at = end && end >= data && end <= data + len ? (size_t)(end - data) : 0;
        return exl_fail(EXL_ERR_FORMAT, "%s: not valid JSON (error near byte %zu)", path, at);
    }
    exl_status st = EXL_OK;
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    const cJSON *added = cJSON_GetObjectItemCaseSensitive(root, "added_tokens");
    const cJSON *n;
    int32_t n_vocab = 0;
    const cJSON *mtype = cJSON_GetObjectItemCaseSensitive(model, "type");
    if (!cJSON_IsObject(root))
        st = bad(&L, "top level", "expected an object");
    else if (!cJSON_IsObject(model))
        st = bad(&L, "model", "missing or not an object");
    else if (cJSON_IsString(mtype) && strcmp(mtype->valuestring, "BPE"))
        st = exl_fail(EXL_ERR_UNSUPPORTED, "%s: model type '%s' is not supported (only BPE)", path, mtype->valuestring);
    else if (!cJSON_IsObject(vocab))
        st = bad(&L, "model.vocab", "missing or not an object (only BPE models are supported)");
    else if (added && !cJSON_IsArray(added) && !cJSON_IsNull(added))
        st = bad(&L, "added_tokens", "expected an array");
    if (st == EXL_OK)
        st = max_id_of(&L, vocab, cJSON_IsArray(added) ? added : NULL, &n_vocab);
    if (st == EXL_OK && n_vocab == 0)
        st = bad(&L, "model.vocab", "empty vocabulary");
    if (st == EXL_OK)
        st = exl_tok_alloc_ids(tok, n_vocab, path);
    if (st == EXL_OK)
        st = parse_vocab(&L, vocab);
    if (st == EXL_OK)
        st = parse_model(&L, model);
    if (st == EXL_OK && (n = cJSON_GetObjectItemCaseSensitive(root, "normalizer")) && !cJSON_IsNull(n))
        st = parse_normalizer(&L, n, "normalizer", 0);
    if (st == EXL_OK && (n = cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer")) && !cJSON_IsNull(n))
        st = parse_pretok(&L, n, "pre_tokenizer", 0);
    if (st == EXL_OK && (n = cJSON_GetObjectItemCaseSensitive(root, "decoder")) && !cJSON_IsNull(n)) {
        tok->has_decoder = 1;
        st = parse_decoder(&L, n, "decoder", 0);
    }
    if (st == EXL_OK && cJSON_IsArray(added))
        st = parse_added(&L, added);
    if (st == EXL_OK && (n = cJSON_GetObjectItemCaseSensitive(root, "post_processor")) && !cJSON_IsNull(n))
        st = parse_post(&L, n, "post_processor", 0);
    cJSON_Delete(root);
    return st;
}
