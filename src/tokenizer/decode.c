/* decode.c - ids back to text: the decoder chain of tokenizer.json (ByteLevel, Replace,
 * ByteFallback, Fuse, Strip, Metaspace) over the list of token strings, and the
 * streaming detokenizer, which re-decodes a small window of recent tokens and yields
 * only the text no later token can change. */
#include "tokenizer.h"

#include <string.h>

#include "base/alloc.h"
#include "base/error.h"

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "out of memory"); }

/* A list of strings in one buffer. */
typedef struct strlist {
    exl_str buf;
    exl_tok_ranges r;
} strlist;

static void strlist_free(strlist *l) {
    exl_str_free(&l->buf);
    exl_free(l->r.off);
    exl_free(l->r.len);
}

static void strlist_clear(strlist *l) {
    exl_str_clear(&l->buf);
    l->r.n = 0;
}

static int strlist_push(strlist *l, const char *s, size_t n) {
    size_t at = l->buf.len;
    return exl_str_append(&l->buf, s, n) || exl_tok_ranges_push(&l->r, at, n);
}

/* Extend the last string by s (it must be the last thing in the buffer). */
static int strlist_extend(strlist *l, const char *s, size_t n) {
    if (exl_str_append(&l->buf, s, n))
        return -1;
    l->r.len[l->r.n - 1] += (uint32_t)n;
    return 0;
}

#define STR_AT(l, i) ((l)->buf.data + (l)->r.off[i])

/* ---------------------------------------------------------------- helpers */

/* "<0xAB>" -> 0xAB, else -1. */
static int byte_token(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* The bytes a ByteLevel token stands for (its raw text when some character is not in
 * the table). */
static int bytelevel_bytes(const char *s, size_t n, exl_str *out) {
    size_t mark = out->len;
    for (size_t i = 0; i < n;) {
        int32_t cp;
        i += (size_t)exl_utf8_decode(s + i, &cp);
        int b = exl_bytelevel_byte(cp);
        if (b < 0) {
            out->len = mark;
            return exl_str_append(out, s, n);
        }
        if (exl_str_putc(out, (char)b))
            return -1;
    }
    return 0;
}

static int append_replaced(exl_str *out, const exl_tok_dec *d, const char *s, size_t n) {
    size_t pos = 0, ln = d->pattern.literal_len;
    for (;;) {
        const char *hit = pos + ln <= n ? memmem(s + pos, n - pos, d->pattern.literal, ln) : NULL;
        size_t at = hit ? (size_t)(hit - s) : n;
        if (exl_str_append(out, s + pos, at - pos))
            return -1;
        if (!hit)
            return 0;
        if (exl_str_append(out, d->content, d->content_len))
            return -1;
        pos = at + ln;
    }
}

/* ---------------------------------------------------------------- decoders */

static exl_status dec_replace(const exl_tok_dec *d, const strlist *in, strlist *out, exl_str *tmp) {
    for (size_t i = 0; i < in->r.n; i++) {
        exl_str_clear(tmp);
        const char *s = STR_AT(in, i);
        size_t n = in->r.len[i];
        if (d->pattern.literal) {
            if (append_replaced(tmp, d, s, n))
                return nomem();
        } else {
            pcre2_match_data *md = pcre2_match_data_create(1, NULL);
            if (!md)
                return nomem();
            size_t pos = 0, copied = 0;
            int fail = 0;
            while (pos < n) {
                int rc = pcre2_match(d->pattern.re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, md, NULL);
                if (rc < 0)
                    break;
                PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
                if (ov[1] <= ov[0]) {
                    pos = ov[0] + 1;
                    continue;
                }
                fail |= exl_str_append(tmp, s + copied, ov[0] - copied) ||
                        exl_str_append(tmp, d->content, d->content_len);
                copied = pos = ov[1];
            }
            pcre2_match_data_free(md);
            if (fail || exl_str_append(tmp, s + copied, n - copied))
                return nomem();
        }
        if (strlist_push(out, tmp->data ? tmp->data : "", tmp->len))
            return nomem();
    }
    return EXL_OK;
}

static int flush_bytes(strlist *out, exl_str *bytes, size_t count) {
    int r = 0;
    if (!count)
        return 0;
    if (exl_utf8_valid(bytes->data, bytes->len))
        r = strlist_push(out, bytes->data, bytes->len);
    else
        for (size_t i = 0; i < count && !r; i++)
            r = strlist_push(out, "\xEF\xBF\xBD", 3);
    exl_str_clear(bytes);
    return r;
}

static exl_status dec_bytefallback(const strlist *in, strlist *out, exl_str *tmp) {
    size_t count = 0;
    exl_str_clear(tmp);
    for (size_t i = 0; i < in->r.n; i++) {
        int b = byte_token(STR_AT(in, i), in->r.len[i]);
        if (b >= 0) {
            if (exl_str_putc(tmp, (char)b))
                return nomem();
            count++;
            continue;
        }
        if (flush_bytes(out, tmp, count) || strlist_push(out, STR_AT(in, i), in->r.len[i]))
            return nomem();
        count = 0;
    }
    return flush_bytes(out, tmp, count) ? nomem() : EXL_OK;
}

static exl_status dec_strip(const exl_tok_dec *d, const strlist *in, strlist *out) {
    for (size_t i = 0; i < in->r.n; i++) {
        const char *s = STR_AT(in, i);
        size_t a = 0, b = in->r.len[i], cl = d->content_len;
        for (int k = 0; k < d->a && b - a >= cl && !memcmp(s + a, d->content, cl); k++)
            a += cl;
        for (int k = 0; k < d->b && b - a >= cl && !memcmp(s + b - cl, d->content, cl); k++)
            b -= cl;
        if (strlist_push(out, s + a, b - a))
            return nomem();
    }
    return EXL_OK;
}

static exl_status dec_metaspace(const exl_tok_dec *d, const strlist *in, strlist *out) {
    for (size_t i = 0; i < in->r.n; i++) {
        const char *s = STR_AT(in, i);
        size_t n = in->r.len[i], pos = 0, cl = d->content_len;
        /* in the first token the replacement is dropped, elsewhere it becomes a space */
        int drop = i == 0 && d->a != EXL_TOK_PREPEND_NEVER;
        if (strlist_push(out, "", 0))
            return nomem();
        while (pos < n) {
            const char *hit = pos + cl <= n ? memmem(s + pos, n - pos, d->content, cl) : NULL;
            size_t at = hit ? (size_t)(hit - s) : n;
            if (strlist_extend(out, s + pos, at - pos))
                return nomem();
            if (!hit)
                break;
            if (!drop && strlist_extend(out, " ", 1))
                return nomem();
            pos = at + cl;
        }
    }
    return EXL_OK;
}

static exl_status dec_bytelevel(const strlist *in, strlist *out, exl_str *tmp) {
    exl_str_clear(tmp);
    for (size_t i = 0; i < in->r.n; i++)
        if (bytelevel_bytes(STR_AT(in, i), in->r.len[i], tmp))
            return nomem();
    if (strlist_push(out, "", 0) || exl_utf8_append_lossy(&out->buf, tmp->data ? tmp->data : "", tmp->len))
        return nomem();
    out->r.len[0] = (uint32_t)out->buf.len;
    return EXL_OK;
}

exl_status exl_tok_decode_strings(const exl_tokenizer *tok, const char *const *strs, const uint32_t *lens, size_t n,
                                  exl_str *out) {
    if (!tok->has_decoder) {
        for (size_t i = 0; i < n; i++)
            if ((i && exl_str_putc(out, ' ')) || exl_str_append(out, strs[i], lens[i]))
                return nomem();
        return exl_str_reserve(out, 0) ? nomem() : EXL_OK;
    }
    strlist a = {EXL_STR_INIT, {0}}, b = {EXL_STR_INIT, {0}};
    exl_str tmp = EXL_STR_INIT;
    strlist *cur = &a, *nxt = &b;
    exl_status st = EXL_OK;
    for (size_t i = 0; i < n && st == EXL_OK; i++)
        if (strlist_push(cur, strs[i], lens[i]))
            st = nomem();
    for (int32_t k = 0; k < tok->n_decs && st == EXL_OK; k++) {
        const exl_tok_dec *d = &tok->decs[k];
        strlist_clear(nxt);
        switch (d->kind) {
        case EXL_TOK_DEC_REPLACE: st = dec_replace(d, cur, nxt, &tmp); break;
        case EXL_TOK_DEC_BYTEFALLBACK: st = dec_bytefallback(cur, nxt, &tmp); break;
        case EXL_TOK_DEC_STRIP: st = dec_strip(d, cur, nxt); break;
        case EXL_TOK_DEC_METASPACE: st = dec_metaspace(d, cur, nxt); break;
        case EXL_TOK_DEC_BYTELEVEL: st = dec_bytelevel(cur, nxt, &tmp); break;
        case EXL_TOK_DEC_FUSE:
            if (strlist_push(nxt, "", 0))
                st = nomem();
            for (size_t i = 0; i < cur->r.n && st == EXL_OK; i++)
                if (strlist_extend(nxt, STR_AT(cur, i), cur->r.len[i]))
                    st = nomem();
            break;
        }
        strlist *t = cur;
        cur = nxt;
        nxt = t;
    }
    for (size_t i = 0; i < cur->r.n && st == EXL_OK; i++)
        if (exl_str_append(out, STR_AT(cur, i), cur->r.len[i]))
            st = nomem();
    if (st == EXL_OK && exl_str_reserve(out, 0))
        st = nomem();
    strlist_free(&a);
    strlist_free(&b);
    exl_str_free(&tmp);
    return st;
}

/* ---------------------------------------------------------------- decode */

/* Decode ids[0..n) (already filtered) into out. */
static exl_status decode_ids(const exl_tokenizer *tok, const int32_t *ids, size_t n, exl_str *out) {
    const char **strs = exl_malloc((n ? n : 1) * sizeof *strs);
    uint32_t *lens = exl_malloc((n ? n : 1) * sizeof *lens);
    exl_status st = strs && lens ? EXL_OK : nomem();
    size_t m = 0;
    for (size_t i = 0; i < n && st == EXL_OK; i++) {
        if (!tok->dec_text[ids[i]])
            continue; /* a hole in the vocabulary decodes to nothing */
        strs[m] = tok->dec_text[ids[i]];
        lens[m++] = tok->dec_len[ids[i]];
    }
    if (st == EXL_OK)
        st = exl_tok_decode_strings(tok, strs, lens, m, out);
    exl_free(strs);
    exl_free(lens);
    return st;
}

static exl_status check_id(const exl_tokenizer *tok, int32_t id) {
    if (id < 0 || id >= tok->n_vocab)
        return exl_fail(EXL_ERR_ARG, "token id %d is out of range (vocabulary of %d)", id, tok->n_vocab);
    return EXL_OK;
}

exl_status exl_tokenizer_decode(const exl_tokenizer *tok, const int32_t *ids, int32_t n, int skip_special,
                                char **text) {
    if (!tok || (!ids && n) || n < 0 || !text)
        return exl_fail(EXL_ERR_ARG, "exl_tokenizer_decode: bad argument");
    *text = NULL;
    int32_t *kept = exl_malloc((size_t)(n ? n : 1) * sizeof *kept);
    if (!kept)
        return nomem();
    size_t m = 0;
    exl_status st = EXL_OK;
    for (int32_t i = 0; i < n && st == EXL_OK; i++) {
        st = check_id(tok, ids[i]);
        if (st == EXL_OK && !(skip_special && (tok->flags[ids[i]] & EXL_TOK_F_SKIP)))
            kept[m++] = ids[i];
    }
    exl_str out = EXL_STR_INIT;
    if (st == EXL_OK)
        st = decode_ids(tok, kept, m, &out);
    exl_free(kept);
    if (st == EXL_OK && !(*text = exl_str_steal(&out)))
        st = nomem();
    exl_str_free(&out);
    return st;
}

/* ---------------------------------------------------------------- streaming */

struct exl_detokenizer {
    const exl_tokenizer *tok;
    int skip_special;
    int has_bytefallback, has_bytelevel;
    int32_t *ids; /* the window: ids[0..n), decoded from ctx on */
    size_t n, cap;
    size_t ctx;  /* first id of the context that is re-decoded */
    size_t read; /* ids before this one are emitted */
    exl_str prev, cur, out;
};

exl_status exl_detokenizer_init(const exl_tokenizer *tok, int skip_special, exl_detokenizer **out) {
    if (!tok || !out)
        return exl_fail(EXL_ERR_ARG, "exl_detokenizer_init: NULL argument");
    exl_detokenizer *d = exl_calloc(1, sizeof *d);
    if (!d)
        return nomem();
    d->tok = tok;
    d->skip_special = skip_special;
    for (int32_t i = 0; i < tok->n_decs; i++) {
        d->has_bytefallback |= tok->decs[i].kind == EXL_TOK_DEC_BYTEFALLBACK;
        d->has_bytelevel |= tok->decs[i].kind == EXL_TOK_DEC_BYTELEVEL;
    }
    *out = d;
    return EXL_OK;
}

void exl_detokenizer_free(exl_detokenizer *d) {
    if (!d)
        return;
    exl_free(d->ids);
    exl_str_free(&d->prev);
    exl_str_free(&d->cur);
    exl_str_free(&d->out);
    exl_free(d);
}

/* Would the bytes of ids[from..to) end inside a UTF-8 character? (ByteLevel) */
static int bytelevel_incomplete(exl_detokenizer *d, size_t from, size_t to) {
    exl_str_clear(&d->cur);
    for (size_t i = from; i < to; i++)
        if (bytelevel_bytes(d->tok->dec_text[d->ids[i]], d->tok->dec_len[d->ids[i]], &d->cur))
            return -1;
    return exl_utf8_complete_prefix(d->cur.data ? d->cur.data : "", d->cur.len) != d->cur.len;
}

/* How many ids of the window are final: later ids cannot change their text. */
static size_t stable_end(exl_detokenizer *d) {
    size_t s = d->n;
    if (!d->tok->stream_exact)
        return d->read;
    if (d->has_bytefallback) /* a run of <0xXX> tokens decodes as a whole */
        while (s > d->read && byte_token(d->tok->dec_text[d->ids[s - 1]], d->tok->dec_len[d->ids[s - 1]]) >= 0)
            s--;
    if (d->has_bytelevel)
        while (s > d->read && bytelevel_incomplete(d, d->read, s) != 0)
            s--;
    return s;
}

/* Emit decode(ids[ctx..upto)) minus decode(ids[ctx..read)), then advance. */
static exl_status emit(exl_detokenizer *d, size_t upto, const char **text, size_t *len) {
    exl_str_clear(&d->prev);
    exl_str_clear(&d->cur);
    exl_str_clear(&d->out);
    if (!d->ids) { /* nothing was ever pushed */
        if (exl_str_reserve(&d->out, 0))
            return nomem();
        *text = d->out.data;
        *len = 0;
        return EXL_OK;
    }
    EXL_TRY(decode_ids(d->tok, d->ids + d->ctx, d->read - d->ctx, &d->prev));
    EXL_TRY(decode_ids(d->tok, d->ids + d->ctx, upto - d->ctx, &d->cur));
    if (d->cur.len >= d->prev.len && (!d->prev.len || !memcmp(d->cur.data, d->prev.data, d->prev.len))) {
        if (exl_str_append(&d->out, d->cur.data + d->prev.len, d->cur.len - d->prev.len))
            return nomem();
        d->ctx = d->read;
        d->read = upto;
    }
    if (exl_str_reserve(&d->out, 0))
        return nomem();
    /* drop ids that no longer serve as context */
    if (d->ctx > 256) {
        memmove(d->ids, d->ids + d->ctx, (d->n - d->ctx) * sizeof *d->ids);
        d->n -= d->ctx;
        d->read -= d->ctx;
        d->ctx = 0;
    }
    *text = d->out.data;
    *len = d->out.len;
    return EXL_OK;
}

exl_status exl_detokenizer_push(exl_detokenizer *d, int32_t id, const char **text, size_t *len) {
    if (!d || !text || !len)
        return exl_fail(EXL_ERR_ARG, "exl_detokenizer_push: NULL argument");
    *text = "";
    *len = 0;
    EXL_TRY(check_id(d->tok, id));
    if (d->skip_special && (d->tok->flags[id] & EXL_TOK_F_SKIP))
        return EXL_OK;
    if (d->n == d->cap) {
        size_t cap = d->cap ? d->cap * 2 : 64;
        int32_t *p = exl_realloc(d->ids, cap * sizeof *p);
        if (!p)
            return nomem();
        d->ids = p;
        d->cap = cap;
    }
    d->ids[d->n++] = id;
    size_t s = stable_end(d);
    if (s <= d->read)
        return EXL_OK;
    return emit(d, s, text, len);
}

exl_status exl_detokenizer_flush(exl_detokenizer *d, const char **text, size_t *len) {
    if (!d || !text || !len)
        return exl_fail(EXL_ERR_ARG, "exl_detokenizer_flush: NULL argument");
    exl_status st = emit(d, d->n, text, len);
    d->n = d->ctx = d->read = 0; /* the next push starts a new sequence */
    return st;
}
