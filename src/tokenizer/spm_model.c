/* spm_model.c - reads a SentencePiece tokenizer.model (protobuf ModelProto, parsed by
 * hand) with a BPE model, and sets up the same pipeline Hugging Face's converter builds:
 * Prepend/Replace U+2581 normalizers, BPE whose merges come from the piece scores (the
 * pair whose merged piece scores highest goes first, leftmost on ties), byte fallback,
 * control pieces as special tokens, and the Replace/ByteFallback/Fuse/Strip decoder. */
#include "tokenizer.h"

#include <stdlib.h>
#include <string.h>

#include "base/alloc.h"
#include "base/error.h"

enum { PIECE_NORMAL = 1, PIECE_UNKNOWN = 2, PIECE_CONTROL = 3, PIECE_USER = 4, PIECE_UNUSED = 5, PIECE_BYTE = 6 };
enum { MODEL_UNIGRAM = 1, MODEL_BPE = 2 };

/* ---------------------------------------------------------------- protobuf reader */

typedef struct pb {
    const unsigned char *p, *end;
} pb;

typedef struct pb_field {
    uint32_t num;
    int wire;
    uint64_t v;               /* varint or fixed value */
    const unsigned char *buf; /* length-delimited payload */
    size_t len;
} pb_field;

static int pb_varint(pb *r, uint64_t *out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
        if (r->p >= r->end)
            return -1;
        unsigned char c = *r->p++;
        v |= (uint64_t)(c & 0x7F) << shift;
        if (!(c & 0x80)) {
            *out = v;
            return 0;
        }
    }
    return -1;
}

/* Next field; 1 when one was read, 0 at the end, -1 when malformed. */
static int pb_next(pb *r, pb_field *f) {
    if (r->p >= r->end)
        return 0;
    uint64_t key;
    if (pb_varint(r, &key) || (key >> 3) == 0 || (key >> 3) > 0x1FFFFFFF)
        return -1;
    f->num = (uint32_t)(key >> 3);
    f->wire = (int)(key & 7);
    f->buf = NULL;
    f->len = 0;
    switch (f->wire) {
    case 0: return pb_varint(r, &f->v) ? -1 : 1;
    case 1:
        if (r->end - r->p < 8)
            return -1;
        memcpy(&f->v, r->p, 8);
        r->p += 8;
        return 1;
    case 5: {
        if (r->end - r->p < 4)
            return -1;
        uint32_t x;
        memcpy(&x, r->p, 4);
        f->v = x;
        r->p += 4;
        return 1;
    }
    case 2: {
        uint64_t len;
        if (pb_varint(r, &len) || len > (uint64_t)(r->end - r->p))
            return -1;
        f->buf = r->p;
        f->len = (size_t)len;
        r->p += len;
        return 1;
    }
    default: return -1; /* groups are not used by sentencepiece */
    }
}

/* ---------------------------------------------------------------- model */

typedef struct spm_piece {
    const unsigned char *text;
    size_t len;
    float score;
    int type;
} spm_piece;

typedef struct spm {
    spm_piece *pieces;
    int32_t n;
    int model_type, byte_fallback, whitespace_suffix;
    int64_t unk_id, bos_id, eos_id;
    int add_dummy_prefix, remove_extra_ws, escape_ws;
    int identity, has_charsmap; /* normalizer name "identity"; a precompiled map present */
} spm;

static exl_status bad(const char *path, const char *what) { return exl_fail(EXL_ERR_FORMAT, "%s: %s", path, what); }

static exl_status parse_piece(const char *path, const pb_field *f, spm_piece *out) {
    pb r = {f->buf, f->buf + f->len};
    pb_field g;
    int rc;
    out->type = PIECE_NORMAL;
    out->text = NULL;
    while ((rc = pb_next(&r, &g)) == 1) {
        if (g.num == 1 && g.wire == 2) {
            out->text = g.buf;
            out->len = g.len;
        } else if (g.num == 2 && g.wire == 5) {
            uint32_t x = (uint32_t)g.v;
            memcpy(&out->score, &x, 4);
        } else if (g.num == 3 && g.wire == 0) {
            out->type = (int)g.v;
        }
    }
    if (rc < 0 || !out->text)
        return bad(path, "malformed piece (truncated file?)");
    if (!out->len || !exl_utf8_valid((const char *)out->text, out->len))
        return bad(path, "a piece is empty or not valid UTF-8");
    return EXL_OK;
}

static exl_status parse_spec(const char *path, const pb_field *f, spm *m, int trainer) {
    pb r = {f->buf, f->buf + f->len};
    pb_field g;
    int rc;
    while ((rc = pb_next(&r, &g)) == 1) {
        if (trainer && g.wire == 0) {
            switch (g.num) {
            case 3: m->model_type = (int)g.v; break;
            case 24: m->whitespace_suffix = g.v != 0; break;
            case 35: m->byte_fallback = g.v != 0; break;
            case 40: m->unk_id = (int32_t)g.v; break;
            case 41: m->bos_id = (int32_t)g.v; break;
            case 42: m->eos_id = (int32_t)g.v; break;
            default: break;
            }
        } else if (!trainer) {
            if (g.num == 1 && g.wire == 2)
                m->identity = g.len == 8 && !memcmp(g.buf, "identity", 8);
            else if (g.num == 2 && g.wire == 2)
                m->has_charsmap = g.len > 0;
            else if (g.num == 3 && g.wire == 0)
                m->add_dummy_prefix = g.v != 0;
            else if (g.num == 4 && g.wire == 0)
                m->remove_extra_ws = g.v != 0;
            else if (g.num == 5 && g.wire == 0)
                m->escape_ws = g.v != 0;
        }
    }
    return rc < 0 ? bad(path, trainer ? "malformed trainer_spec" : "malformed normalizer_spec") : EXL_OK;
}

static exl_status parse_model(const char *path, const unsigned char *data, size_t len, spm *m) {
    pb r = {data, data + len};
    pb_field f;
    int rc;
    int32_t cap = 0;
    while ((rc = pb_next(&r, &f)) == 1) {
        if (f.num == 1 && f.wire == 2) {
            if (m->n == cap) {
                cap = cap ? cap * 2 : 1024;
                if (cap > (1 << 24))
                    return bad(path, "too many pieces");
                spm_piece *p = exl_realloc(m->pieces, (size_t)cap * sizeof *p);
                if (!p)
                    return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
                m->pieces = p;
            }
            EXL_TRY(parse_piece(path, &f, &m->pieces[m->n]));
            m->n++;
        } else if ((f.num == 2 || f.num == 3) && f.wire == 2) {
            EXL_TRY(parse_spec(path, &f, m, f.num == 2));
        }
    }
    if (rc < 0)
        return bad(path, "not a SentencePiece model (malformed or truncated protobuf)");
    if (!m->n)
        return bad(path, "no pieces (not a SentencePiece model?)");
    if (m->model_type != MODEL_BPE)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: SentencePiece model type %d is not supported (only BPE)", path,
                        m->model_type);
    if (m->whitespace_suffix)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: treat_whitespace_as_suffix is not supported", path);
    return EXL_OK;
}

/* ---------------------------------------------------------------- pipeline */

typedef struct scored {
    float score;
    int32_t id;
} scored;

static int by_score(const void *a, const void *b) {
    const scored *x = a, *y = b;
    if (x->score != y->score)
        return x->score > y->score ? -1 : 1;
    return x->id - y->id;
}

static int mergeable(int type) { return type == PIECE_NORMAL || type == PIECE_USER; }

/* Every split of a piece into two pieces is a merge ranked by the piece's score. */
static exl_status build_merges(exl_tokenizer *tok, const char *path, const spm *m) {
    scored *order = exl_malloc((size_t)m->n * sizeof *order);
    uint32_t *rank = exl_malloc((size_t)m->n * sizeof *rank);
    exl_status st = EXL_OK;
    if (!order || !rank || exl_pairmap_init(&tok->merges, (size_t)m->n * 4))
        st = exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    for (int32_t i = 0; st == EXL_OK && i < m->n; i++)
        order[i] = (scored){m->pieces[i].score, i};
    if (st == EXL_OK) {
        /* equal scores share a rank, so the leftmost pair wins among them */
        qsort(order, (size_t)m->n, sizeof *order, by_score);
        uint32_t r = 0;
        for (int32_t i = 0; i < m->n; i++) {
            if (i && order[i].score != order[i - 1].score)
                r++;
            rank[order[i].id] = r;
        }
    }
    for (int32_t id = 0; st == EXL_OK && id < m->n; id++) {
        const spm_piece *p = &m->pieces[id];
        if (!mergeable(p->type))
            continue;
        const char *s = (const char *)p->text;
        for (size_t cut = (size_t)exl_utf8_len((unsigned char)s[0]); cut < p->len;
             cut += (size_t)exl_utf8_len((unsigned char)s[cut])) {
            int32_t a = exl_strmap_get(&tok->vocab, s, cut), b = exl_strmap_get(&tok->vocab, s + cut, p->len - cut);
            if (a < 0 || b < 0 || !mergeable(m->pieces[a].type) || !mergeable(m->pieces[b].type))
                continue;
            if (exl_pairmap_put(&tok->merges, a, b, rank[id], id))
                st = exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
        }
    }
    exl_free(order);
    exl_free(rank);
    return st;
}

static void *push(void **arr, int32_t *n, size_t sz) {
    char *p = exl_realloc(*arr, (size_t)(*n + 1) * sz);
    if (!p)
        return NULL;
    *arr = p;
    memset(p + (size_t)*n * sz, 0, sz);
    return p + (size_t)(*n)++ * sz;
}

#define SPM_SPACE "\xE2\x96\x81"

static exl_status build_pipeline(exl_tokenizer *tok, const char *path, const spm *m) {
    exl_tok_norm *o;
    exl_tok_dec *d;
    const char *prefix = m->escape_ws ? SPM_SPACE : " ";
    if (m->has_charsmap && !m->identity) {
        if (!(o = push((void **)&tok->norms, &tok->n_norms, sizeof *o)))
            goto oom;
        o->kind = EXL_TOK_NORM_NFKC; /* the precompiled nmt_nfkc map, approximated */
    }
    if (m->remove_extra_ws) {
        if (!(o = push((void **)&tok->norms, &tok->n_norms, sizeof *o)))
            goto oom;
        o->kind = EXL_TOK_NORM_SPM_WHITESPACE;
    }
    if (m->add_dummy_prefix) {
        if (!(o = push((void **)&tok->norms, &tok->n_norms, sizeof *o)))
            goto oom;
        o->kind = EXL_TOK_NORM_PREPEND;
        o->content = prefix;
        o->content_len = strlen(prefix);
    }
    if (m->escape_ws) {
        if (!(o = push((void **)&tok->norms, &tok->n_norms, sizeof *o)))
            goto oom;
        o->kind = EXL_TOK_NORM_REPLACE;
        o->pattern.literal = " ";
        o->pattern.literal_len = 1;
        o->content = SPM_SPACE;
        o->content_len = 3;
    }
    tok->has_decoder = 1;
    if (m->escape_ws) {
        if (!(d = push((void **)&tok->decs, &tok->n_decs, sizeof *d)))
            goto oom;
        d->kind = EXL_TOK_DEC_REPLACE;
        d->pattern.literal = SPM_SPACE;
        d->pattern.literal_len = 3;
        d->content = " ";
        d->content_len = 1;
    }
    if (!(d = push((void **)&tok->decs, &tok->n_decs, sizeof *d)))
        goto oom;
    d->kind = EXL_TOK_DEC_BYTEFALLBACK;
    if (!(d = push((void **)&tok->decs, &tok->n_decs, sizeof *d)))
        goto oom;
    d->kind = EXL_TOK_DEC_FUSE;
    if (m->add_dummy_prefix) {
        if (!(d = push((void **)&tok->decs, &tok->n_decs, sizeof *d)))
            goto oom;
        d->kind = EXL_TOK_DEC_STRIP;
        d->content = " ";
        d->content_len = 1;
        d->a = 1;
    }
    return EXL_OK;
oom:
    return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
}

static exl_status post_ids(exl_tokenizer *tok, const char *path, int32_t **arr, int32_t *n, int64_t id) {
    if (id < 0 || id >= tok->n_vocab)
        return EXL_OK;
    int32_t *p = push((void **)arr, n, sizeof *p);
    if (!p)
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    *p = (int32_t)id;
    return EXL_OK;
}

static exl_status build(exl_tokenizer *tok, const char *path, const spm *m, int add_bos, int add_eos) {
    EXL_TRY(exl_tok_alloc_ids(tok, m->n, path));
    if (exl_strmap_init(&tok->vocab, (size_t)m->n))
        return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
    for (int32_t id = 0; id < m->n; id++) {
        const spm_piece *p = &m->pieces[id];
        char *s = exl_tok_arena_dup(&tok->arena, (const char *)p->text, p->len);
        if (!s)
            return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
        tok->text[id] = tok->dec_text[id] = s;
        tok->text_len[id] = tok->dec_len[id] = (uint32_t)p->len;
        if (p->type != PIECE_UNUSED && exl_strmap_get(&tok->vocab, s, p->len) < 0 &&
            exl_strmap_put(&tok->vocab, s, p->len, id))
            return exl_fail(EXL_ERR_NOMEM, "%s: out of memory", path);
        if (p->type == PIECE_UNKNOWN)
            tok->unk_id = id;
    }
    if (tok->unk_id < 0 && m->unk_id >= 0 && m->unk_id < m->n)
        tok->unk_id = (int32_t)m->unk_id;
    tok->byte_fallback = m->byte_fallback;
    tok->fuse_unk = 1;
    tok->subword_prefix = tok->word_suffix = "";
    EXL_TRY(build_merges(tok, path, m));
    EXL_TRY(build_pipeline(tok, path, m));
    /* control pieces and <unk> are special tokens matched verbatim, user pieces plain ones */
    for (int32_t id = 0; id < m->n; id++) {
        int t = m->pieces[id].type;
        if (t == PIECE_CONTROL || t == PIECE_UNKNOWN || t == PIECE_USER)
            EXL_TRY(exl_tok_add_token(tok, path, id, tok->text[id], tok->text_len[id], t != PIECE_USER, 0, 0, 0, 0));
    }
    if (m->bos_id >= 0 && m->bos_id < m->n)
        tok->bos_id = (int32_t)m->bos_id;
    if (m->eos_id >= 0 && m->eos_id < m->n)
        tok->eos_id = (int32_t)m->eos_id;
    if (add_bos)
        EXL_TRY(post_ids(tok, path, &tok->post_prefix, &tok->n_post_prefix, m->bos_id));
    if (add_eos)
        EXL_TRY(post_ids(tok, path, &tok->post_suffix, &tok->n_post_suffix, m->eos_id));
    return EXL_OK;
}

exl_status exl_tok_load_spm(exl_tokenizer *tok, const char *path, const unsigned char *data, size_t len, int add_bos,
                            int add_eos) {
    spm m = {0};
    m.model_type = MODEL_UNIGRAM;
    m.unk_id = 0;
    m.bos_id = 1;
    m.eos_id = 2;
    m.add_dummy_prefix = m.remove_extra_ws = m.escape_ws = 1;
    exl_status st = parse_model(path, data, len, &m);
    if (st == EXL_OK)
        st = build(tok, path, &m, add_bos, add_eos);
    exl_free(m.pieces);
    return st;
}
