/* tokenizer.c - the public tokenizer API: loading a model directory (tokenizer.json,
 * else tokenizer.model, plus tokenizer_config.json), the accessors, and encode, which
 * cuts out added tokens, normalizes, pre-tokenizes and runs BPE on each word. */
#include "tokenizer.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "base/alloc.h"
#include "base/error.h"
#include "io/json_file.h"

/* ---------------------------------------------------------------- files */

/* Read a whole file; *data is NUL-terminated. Returns EXL_ERR_IO (ENOENT kept in errno). */

static int file_exists(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

static char *join(const char *dir, const char *name) {
    exl_str s = EXL_STR_INIT;
    if (exl_str_printf(&s, "%s/%s", dir, name)) {
        exl_str_free(&s);
        return NULL;
    }
    return exl_str_steal(&s);
}

/* ---------------------------------------------------------------- building */

exl_status exl_tok_alloc_ids(exl_tokenizer *tok, int32_t n, const char *path) {
    tok->n_vocab = n;
    tok->text = exl_calloc((size_t)n, sizeof *tok->text);
    tok->text_len = exl_calloc((size_t)n, sizeof *tok->text_len);
    tok->dec_text = exl_calloc((size_t)n, sizeof *tok->dec_text);
    tok->dec_len = exl_calloc((size_t)n, sizeof *tok->dec_len);
    tok->flags = exl_calloc((size_t)n, sizeof *tok->flags);
    if (!tok->text || !tok->text_len || !tok->dec_text || !tok->dec_len || !tok->flags)
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    return EXL_OK;
}

/* Record which code points stand next to each other inside tokens. Merges only ever
 * produce tokens, so a word can be cut between two known characters that never do,
 * without changing the result (see exl_tok_bpe). */
static exl_status build_char_pairs(exl_tokenizer *tok, const char *path) {
    if (tok->subword_prefix[0] || tok->word_suffix[0])
        return EXL_OK; /* cutting would move the prefix / suffix: never cut */
    if (exl_pairmap_init(&tok->char_pairs, tok->vocab.count))
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < tok->vocab.cap; i++) {
        const exl_strmap_slot *sl = &tok->vocab.slots[i];
        if (!sl->key || !exl_utf8_valid(sl->key, sl->len))
            continue;
        int32_t prev = -1, cp;
        for (size_t k = 0; k < sl->len; prev = cp) {
            k += (size_t)exl_utf8_decode(sl->key + k, &cp);
            if (prev >= 0 && exl_pairmap_put(&tok->char_pairs, prev, cp, 0, 0))
                return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
        }
    }
    return EXL_OK;
}

exl_status exl_tok_finish(exl_tokenizer *tok, const char *path) {
    EXL_TRY(exl_tok_build_tries(tok, path));
    EXL_TRY(build_char_pairs(tok, path));
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        tok->byte_ids[b] = exl_strmap_get(&tok->vocab, name, 6);
    }
    tok->stream_exact = 1;
    for (int32_t i = 0; i < tok->n_decs; i++)
        if (tok->decs[i].kind == EXL_TOK_DEC_STRIP && tok->decs[i].b > 0)
            tok->stream_exact = 0; /* stripping the end needs the whole text */
    return EXL_OK;
}

/* The id of a token given by its text: added tokens first, then the model vocabulary. */
static int32_t find_token(const exl_tokenizer *tok, const char *s) {
    size_t n = strlen(s);
    for (int32_t i = 0; i < tok->n_added; i++) {
        int32_t id = tok->added[i].id;
        if (tok->text_len[id] == n && !memcmp(tok->text[id], s, n))
            return id;
    }
    return exl_strmap_get(&tok->vocab, s, n);
}

/* ---------------------------------------------------------------- tokenizer_config.json */

/* "bos_token": "<s>" or {"content": "<s>", ...} */
static const char *token_field(const cJSON *cfg, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (cJSON_IsString(v))
        return v->valuestring;
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(v, "content");
    return cJSON_IsString(c) ? c->valuestring : NULL;
}

static exl_status parse_json_file(const char *path, cJSON **out) {
    char *data;
    size_t len;
    *out = NULL;
    EXL_TRY(exl_file_read(path, &data, &len));
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(data, len, &end, 0);
    size_t at = end && end >= data && end <= data + len ? (size_t)(end - data) : 0;
    exl_free(data);
    if (!root)
        return exl_fail(EXL_ERR_FORMAT, "%s: not valid JSON (error near byte %zu)", path, at);
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return exl_fail(EXL_ERR_FORMAT, "%s: expected a JSON object", path);
    }
    *out = root;
    return EXL_OK;
}

static exl_status set_token(exl_tokenizer *tok, const char *text, char **field, int32_t *id) {
    if (!text)
        return EXL_OK;
    exl_free(*field);
    if (!(*field = exl_strdup(text)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    int32_t found = find_token(tok, text);
    if (found >= 0)
        *id = found;
    return EXL_OK;
}

/* Read the chat template and BOS/EOS from tokenizer_config.json (or special_tokens_map.json). */
static exl_status load_config(exl_tokenizer *tok, const cJSON *cfg, const char *path) {
    EXL_TRY(set_token(tok, token_field(cfg, "bos_token"), &tok->bos_text, &tok->bos_id));
    EXL_TRY(set_token(tok, token_field(cfg, "eos_token"), &tok->eos_text, &tok->eos_id));
    const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
    const char *tmpl = NULL;
    if (cJSON_IsString(ct)) {
        tmpl = ct->valuestring;
    } else if (cJSON_IsArray(ct)) {
        /* [{"name": "default", "template": "..."}, ...]: the default one, else the first */
        for (const cJSON *e = ct->child; e; e = e->next) {
            const cJSON *name = cJSON_GetObjectItemCaseSensitive(e, "name");
            const cJSON *t = cJSON_GetObjectItemCaseSensitive(e, "template");
            if (!cJSON_IsString(t))
                continue;
            if (!tmpl || (cJSON_IsString(name) && !strcmp(name->valuestring, "default")))
                tmpl = t->valuestring;
        }
    } else if (ct && !cJSON_IsNull(ct)) {
        return exl_fail(EXL_ERR_FORMAT, "%s: chat_template: expected a string or a list of templates", path);
    }
    if (tmpl) {
        exl_free(tok->chat_template);
        if (!(tok->chat_template = exl_strdup(tmpl)))
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    return EXL_OK;
}

static exl_status load_side_files(exl_tokenizer *tok, const char *dir) {
    static const char *names[] = {"special_tokens_map.json", "tokenizer_config.json"};
    for (int i = 0; i < 2; i++) {
        char *p = join(dir, names[i]);
        if (!p)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        exl_status st = EXL_OK;
        if (file_exists(p)) {
            cJSON *cfg;
            st = parse_json_file(p, &cfg);
            if (st == EXL_OK)
                st = load_config(tok, cfg, p);
            cJSON_Delete(cfg);
        }
        exl_free(p);
        EXL_TRY(st);
    }
    char *p = join(dir, "chat_template.jinja");
    if (!p)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = EXL_OK;
    if (file_exists(p)) {
        char *data;
        size_t len;
        st = exl_file_read(p, &data, &len);
        if (st == EXL_OK) {
            exl_free(tok->chat_template);
            tok->chat_template = data;
        }
    }
    exl_free(p);
    return st;
}

/* add_bos_token / add_eos_token of tokenizer_config.json (for tokenizer.model). */
static exl_status spm_flags(const char *dir, int *add_bos, int *add_eos) {
    *add_bos = 1;
    *add_eos = 0;
    char *p = join(dir, "tokenizer_config.json");
    if (!p)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = EXL_OK;
    if (file_exists(p)) {
        cJSON *cfg;
        st = parse_json_file(p, &cfg);
        if (st == EXL_OK) {
            const cJSON *b = cJSON_GetObjectItemCaseSensitive(cfg, "add_bos_token");
            const cJSON *e = cJSON_GetObjectItemCaseSensitive(cfg, "add_eos_token");
            if (cJSON_IsBool(b))
                *add_bos = cJSON_IsTrue(b);
            if (cJSON_IsBool(e))
                *add_eos = cJSON_IsTrue(e);
            cJSON_Delete(cfg);
        }
    }
    exl_free(p);
    return st;
}

/* ---------------------------------------------------------------- load / free */

static exl_status load_file(exl_tokenizer *tok, const char *path, int is_spm, const char *dir) {
    char *data;
    size_t len;
    if (!(tok->path = exl_strdup(path)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    EXL_TRY(exl_file_read(path, &data, &len));
    exl_status st;
    if (is_spm) {
        int add_bos = 1, add_eos = 0;
        st = dir ? spm_flags(dir, &add_bos, &add_eos) : EXL_OK;
        if (st == EXL_OK)
            st = exl_tok_load_spm(tok, path, (const unsigned char *)data, len, add_bos, add_eos);
    } else {
        st = exl_tok_load_json(tok, path, data, len);
    }
    exl_free(data);
    EXL_TRY(st);
    EXL_TRY(exl_tok_finish(tok, path));
    if (tok->bos_id < 0 && tok->n_post_prefix == 1)
        tok->bos_id = tok->post_prefix[0];
    return EXL_OK;
}

exl_status exl_tokenizer_load(const char *model_dir, exl_tokenizer **out) {
    if (!model_dir || !out)
        return exl_fail(EXL_ERR_ARG, "exl_tokenizer_load: NULL argument");
    *out = NULL;
    exl_tokenizer *tok = exl_calloc(1, sizeof *tok);
    if (!tok)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    tok->bos_id = tok->eos_id = tok->unk_id = -1;
    exl_status st;
    struct stat sb;
    if (stat(model_dir, &sb) == 0 && S_ISREG(sb.st_mode)) {
        /* a tokenizer file given directly */
        size_t n = strlen(model_dir);
        int spm = n >= 6 && !strcmp(model_dir + n - 6, ".model");
        st = load_file(tok, model_dir, spm, NULL);
    } else if (stat(model_dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        st = exl_fail(EXL_ERR_IO, "%s: no such model directory", model_dir);
    } else {
        char *json = join(model_dir, "tokenizer.json"), *spm = join(model_dir, "tokenizer.model");
        if (!json || !spm)
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        else if (file_exists(json))
            st = load_file(tok, json, 0, model_dir);
        else if (file_exists(spm))
            st = load_file(tok, spm, 1, model_dir);
        else
            st = exl_fail(EXL_ERR_IO, "%s: no tokenizer.json or tokenizer.model in this directory", model_dir);
        exl_free(json);
        exl_free(spm);
        if (st == EXL_OK)
            st = load_side_files(tok, model_dir);
    }
    if (st != EXL_OK) {
        exl_tokenizer_free(tok);
        return st;
    }
    *out = tok;
    return EXL_OK;
}

static void free_pattern(exl_tok_pattern *p) {
    if (p->re)
        pcre2_code_free(p->re);
}

void exl_tokenizer_free(exl_tokenizer *tok) {
    if (!tok)
        return;
    for (int32_t i = 0; i < tok->n_norms; i++)
        free_pattern(&tok->norms[i].pattern);
    for (int32_t i = 0; i < tok->n_pretoks; i++)
        free_pattern(&tok->pretoks[i].pattern);
    for (int32_t i = 0; i < tok->n_decs; i++)
        free_pattern(&tok->decs[i].pattern);
    exl_free(tok->norms);
    exl_free(tok->pretoks);
    exl_free(tok->decs);
    exl_free(tok->post_prefix);
    exl_free(tok->post_suffix);
    exl_free(tok->added);
    exl_tok_trie_free(&tok->trie_raw);
    exl_tok_trie_free(&tok->trie_norm);
    exl_strmap_free(&tok->vocab);
    exl_pairmap_free(&tok->merges);
    exl_pairmap_free(&tok->char_pairs);
    exl_free(tok->text);
    exl_free(tok->text_len);
    exl_free(tok->dec_text);
    exl_free(tok->dec_len);
    exl_free(tok->flags);
    exl_free(tok->bos_text);
    exl_free(tok->eos_text);
    exl_free(tok->chat_template);
    exl_free(tok->path);
    exl_tok_arena_free(&tok->arena);
    exl_free(tok);
}

/* ---------------------------------------------------------------- accessors */

int32_t exl_tokenizer_vocab_size(const exl_tokenizer *tok) { return tok->n_vocab; }

const char *exl_tokenizer_token_text(const exl_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_vocab ? tok->text[id] : NULL;
}

int32_t exl_tokenizer_bos_id(const exl_tokenizer *tok) { return tok->bos_id; }
int32_t exl_tokenizer_eos_id(const exl_tokenizer *tok) { return tok->eos_id; }

int exl_tokenizer_is_special(const exl_tokenizer *tok, int32_t id) {
    return id >= 0 && id < tok->n_vocab && (tok->flags[id] & EXL_TOK_F_SPECIAL);
}

const char *exl_tokenizer_chat_template(const exl_tokenizer *tok) { return tok->chat_template; }
const char *exl_tokenizer_bos_text(const exl_tokenizer *tok) { return tok->bos_text; }
const char *exl_tokenizer_eos_text(const exl_tokenizer *tok) { return tok->eos_text; }

void exl_ids_free(int32_t *ids) { exl_free(ids); }

/* ---------------------------------------------------------------- encode */

int exl_tok_ids_push(exl_tok_ids *ids, int32_t id) {
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 64;
        int32_t *v = exl_realloc(ids->v, cap * sizeof *v);
        if (!v)
            return -1;
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return 0;
}

static exl_status push_all(exl_tok_ids *out, const int32_t *ids, int32_t n) {
    for (int32_t i = 0; i < n; i++)
        if (exl_tok_ids_push(out, ids[i]))
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
    return EXL_OK;
}

/* Pre-tokenize a normalized piece and run the model on each word. */
static exl_status encode_words(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, int at_start,
                               exl_tok_ids *out) {
    if (!n)
        return EXL_OK;
    const char *buf;
    const exl_tok_ranges *r;
    EXL_TRY(exl_tok_pretokenize(tok, w, s, n, at_start, &buf, &r));
    for (size_t i = 0; i < r->n; i++)
        EXL_TRY(exl_tok_bpe(tok, w, buf + r->off[i], r->len[i], out));
    return EXL_OK;
}

/* A piece of the raw text between non-normalized added tokens: normalize it, then cut out
 * the normalized added tokens. */
static exl_status encode_piece(const exl_tokenizer *tok, exl_tok_work *w, exl_str *norm, const char *s, size_t n,
                               int at_start, exl_tok_ids *out) {
    if (!n)
        return EXL_OK;
    if (tok->n_norms) {
        EXL_TRY(exl_tok_normalize(tok, s, n, norm));
        s = norm->data ? norm->data : "";
        n = norm->len;
    }
    size_t pos = 0;
    exl_tok_match m;
    while (exl_tok_added_next(tok, &tok->trie_norm, s, n, pos, &m)) {
        EXL_TRY(encode_words(tok, w, s + pos, m.start - pos, at_start && pos == 0, out));
        if (exl_tok_ids_push(out, m.id))
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        pos = m.end;
    }
    return encode_words(tok, w, s + pos, n - pos, at_start && pos == 0, out);
}

static exl_status encode_text(const exl_tokenizer *tok, exl_tok_work *w, const char *text, size_t len,
                              exl_tok_ids *out) {
    exl_str norm = EXL_STR_INIT;
    exl_status st = EXL_OK;
    size_t pos = 0;
    exl_tok_match m;
    while (st == EXL_OK && exl_tok_added_next(tok, &tok->trie_raw, text, len, pos, &m)) {
        st = encode_piece(tok, w, &norm, text + pos, m.start - pos, pos == 0, out);
        if (st == EXL_OK && exl_tok_ids_push(out, m.id))
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
        pos = m.end;
    }
    if (st == EXL_OK)
        st = encode_piece(tok, w, &norm, text + pos, len - pos, pos == 0, out);
    exl_str_free(&norm);
    return st;
}

exl_status exl_tokenizer_encode(const exl_tokenizer *tok, const char *text, size_t len, int add_special, int32_t **ids,
                                int32_t *n_ids) {
    if (!tok || (!text && len) || !ids || !n_ids)
        return exl_fail(EXL_ERR_ARG, "exl_tokenizer_encode: NULL argument");
    *ids = NULL;
    *n_ids = 0;
    if (len > (size_t)INT32_MAX / 2)
        return exl_fail(EXL_ERR_ARG, "exl_tokenizer_encode: text of %zu bytes is too long", len);
    if (!exl_utf8_valid(text, len))
        return exl_fail(EXL_ERR_ARG, "exl_tokenizer_encode: text is not valid UTF-8");
    exl_tok_work w;
    memset(&w, 0, sizeof w);
    exl_tok_ids out = {0};
    exl_status st = add_special ? push_all(&out, tok->post_prefix, tok->n_post_prefix) : EXL_OK;
    if (st == EXL_OK)
        st = encode_text(tok, &w, text ? text : "", len, &out);
    if (st == EXL_OK && add_special)
        st = push_all(&out, tok->post_suffix, tok->n_post_suffix);
    if (st == EXL_OK && !out.v && exl_tok_ids_push(&out, 0) == 0)
        out.n = 0; /* an empty result is still a valid allocation */
    if (st == EXL_OK && !out.v)
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_tok_work_free(&w);
    if (st != EXL_OK) {
        exl_free(out.v);
        return st;
    }
    *ids = out.v;
    *n_ids = (int32_t)out.n;
    return EXL_OK;
}
