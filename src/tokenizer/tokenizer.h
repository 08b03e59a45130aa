/* tokenizer.h - internals of the tokenizer shared by its files: the loaded pipeline
 * (normalizers, pre-tokenizers, BPE model, post-processor, decoders), the hash maps
 * it runs on, and the accessors the chat-template code uses.
 *
 * Encoding follows Hugging Face `tokenizers`: added tokens are cut out of the raw text
 * (non-normalized ones) or of the normalized text (normalized ones), the remaining
 * pieces are normalized, pre-tokenized into words, and each word goes through BPE.
 * A loaded tokenizer is immutable, so one may be shared by threads. */
#ifndef EXL_TOKENIZER_INTERNAL_H
#define EXL_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>

#include "base/str.h"
#include "base/utf8.h"
#include "exl.h"

/* ---------------------------------------------------------------- arena + maps */

/* Bump allocator for strings that live as long as the tokenizer (never moves). */
typedef struct exl_tok_arena_block exl_tok_arena_block;
typedef struct exl_tok_arena {
    exl_tok_arena_block *head;
} exl_tok_arena;

char *exl_tok_arena_dup(exl_tok_arena *a, const char *s, size_t n); /* NUL-terminated copy */
void exl_tok_arena_free(exl_tok_arena *a);

/* Open-addressing map from byte strings to int32; keys are not copied. */
typedef struct exl_strmap_slot {
    const char *key;
    uint32_t len;
    uint32_t hash;
    int32_t val;
} exl_strmap_slot;

typedef struct exl_strmap {
    exl_strmap_slot *slots;
    size_t cap; /* power of two */
    size_t count;
} exl_strmap;

uint32_t exl_tok_hash(const char *s, size_t n);
int exl_strmap_init(exl_strmap *m, size_t expected);
void exl_strmap_free(exl_strmap *m);
/* Insert or overwrite; -1 on allocation failure. */
int exl_strmap_put(exl_strmap *m, const char *key, size_t len, int32_t val);
/* The value, or -1 when absent. */
int32_t exl_strmap_get(const exl_strmap *m, const char *key, size_t len);

/* Map from a pair of token ids to (rank, merged id). */
typedef struct exl_pairmap_slot {
    uint64_t key; /* (a << 32 | b) + 1; 0 = empty */
    uint32_t rank;
    int32_t id;
} exl_pairmap_slot;

typedef struct exl_pairmap {
    exl_pairmap_slot *slots;
    size_t cap;
    size_t count;
} exl_pairmap;

int exl_pairmap_init(exl_pairmap *m, size_t expected);
void exl_pairmap_free(exl_pairmap *m);
/* A repeated pair overwrites the earlier entry (as in `tokenizers`); -1 on allocation failure. */
int exl_pairmap_put(exl_pairmap *m, int32_t a, int32_t b, uint32_t rank, int32_t id);
/* Returns the slot or NULL. */
const exl_pairmap_slot *exl_pairmap_get(const exl_pairmap *m, int32_t a, int32_t b);

/* ---------------------------------------------------------------- pipeline pieces */

typedef enum exl_tok_split_behavior {
    EXL_TOK_SPLIT_REMOVED,
    EXL_TOK_SPLIT_ISOLATED,
    EXL_TOK_SPLIT_MERGED_WITH_PREVIOUS,
    EXL_TOK_SPLIT_MERGED_WITH_NEXT,
    EXL_TOK_SPLIT_CONTIGUOUS,
} exl_tok_split_behavior;

/* A pattern: a literal string or a compiled regex. */
typedef struct exl_tok_pattern {
    const char *literal; /* arena or static string, or NULL for a regex */
    size_t literal_len;
    pcre2_code *re;
} exl_tok_pattern;

typedef enum exl_tok_norm_kind {
    EXL_TOK_NORM_NFC,
    EXL_TOK_NORM_NFD,
    EXL_TOK_NORM_NFKC,
    EXL_TOK_NORM_NFKD,
    EXL_TOK_NORM_LOWERCASE,
    EXL_TOK_NORM_STRIP, /* a = left, b = right */
    EXL_TOK_NORM_STRIP_ACCENTS,
    EXL_TOK_NORM_REPLACE,        /* pattern -> content */
    EXL_TOK_NORM_PREPEND,        /* content */
    EXL_TOK_NORM_SPM_WHITESPACE, /* SentencePiece remove_extra_whitespaces */
} exl_tok_norm_kind;

typedef struct exl_tok_norm {
    exl_tok_norm_kind kind;
    int a, b;
    exl_tok_pattern pattern;
    const char *content;
    size_t content_len;
} exl_tok_norm;

typedef enum exl_tok_pretok_kind {
    EXL_TOK_PRE_SPLIT,     /* pattern, behavior, invert */
    EXL_TOK_PRE_BYTELEVEL, /* a = add_prefix_space, b = use_regex */
    EXL_TOK_PRE_METASPACE, /* content = replacement, a = prepend scheme, b = split */
    EXL_TOK_PRE_DIGITS,    /* a = individual digits */
    EXL_TOK_PRE_WSPLIT,    /* split on whitespace */
    EXL_TOK_PRE_PUNCT,     /* behavior */
} exl_tok_pretok_kind;

enum { EXL_TOK_PREPEND_ALWAYS, EXL_TOK_PREPEND_FIRST, EXL_TOK_PREPEND_NEVER };

typedef struct exl_tok_pretok {
    exl_tok_pretok_kind kind;
    int a, b;
    int invert;
    exl_tok_split_behavior behavior;
    exl_tok_pattern pattern;
    const char *content;
    size_t content_len;
} exl_tok_pretok;

typedef enum exl_tok_dec_kind {
    EXL_TOK_DEC_BYTELEVEL,
    EXL_TOK_DEC_REPLACE, /* pattern -> content */
    EXL_TOK_DEC_BYTEFALLBACK,
    EXL_TOK_DEC_FUSE,
    EXL_TOK_DEC_STRIP,     /* content (one char), a = start, b = stop */
    EXL_TOK_DEC_METASPACE, /* content = replacement, a = prepend scheme */
} exl_tok_dec_kind;

typedef struct exl_tok_dec {
    exl_tok_dec_kind kind;
    int a, b;
    exl_tok_pattern pattern;
    const char *content;
    size_t content_len;
} exl_tok_dec;

/* An added token as cut out of the text before the model sees it. */
typedef struct exl_tok_added {
    int32_t id;
    const char *match; /* what is searched for: content, normalized when `normalized` */
    uint32_t match_len;
    uint8_t special, lstrip, rstrip, normalized, single_word;
} exl_tok_added;

/* Byte trie over added-token strings, for leftmost-longest matching. */
typedef struct exl_tok_trie_node {
    int32_t child;   /* first child, -1 if none */
    int32_t sibling; /* next sibling, -1 if none */
    int32_t added;   /* index in tok->added ending here, -1 if none */
    uint8_t byte;
} exl_tok_trie_node;

typedef struct exl_tok_trie {
    exl_tok_trie_node *nodes;
    int32_t n, cap;
    uint8_t first[256]; /* bytes that start some pattern */
} exl_tok_trie;

/* Per-token flags. */
enum {
    EXL_TOK_F_SPECIAL = 2,
    EXL_TOK_F_SKIP = 4, /* dropped by decode(skip_special) */
};

/* ---------------------------------------------------------------- the tokenizer */

struct exl_tokenizer {
    char *path; /* the file the vocabulary came from (for messages) */
    exl_tok_arena arena;

    int32_t n_vocab;   /* highest id + 1 */
    const char **text; /* per id: vocabulary text (NULL for a hole) */
    uint32_t *text_len;
    const char **dec_text; /* per id: the string the decoders see */
    uint32_t *dec_len;
    uint8_t *flags;

    /* BPE model */
    exl_strmap vocab; /* model vocabulary text -> id */
    exl_pairmap merges;
    int32_t unk_id; /* -1: none */
    int byte_fallback, fuse_unk, ignore_merges;
    const char *subword_prefix; /* continuing_subword_prefix ("" if none) */
    const char *word_suffix;    /* end_of_word_suffix ("" if none) */
    int32_t byte_ids[256];      /* <0xXX> tokens, -1 when missing */
    exl_pairmap char_pairs;     /* code point pairs adjacent inside some token: BPE
                                    may cut a long word between any other pair */

    /* added tokens */
    exl_tok_added *added;
    int32_t n_added;
    exl_tok_trie trie_raw, trie_norm;

    /* pipeline */
    exl_tok_norm *norms;
    int32_t n_norms;
    exl_tok_pretok *pretoks;
    int32_t n_pretoks;
    int32_t *post_prefix, *post_suffix; /* ids added around a single sequence */
    int32_t n_post_prefix, n_post_suffix;
    exl_tok_dec *decs;
    int32_t n_decs;
    int has_decoder;  /* no decoder: tokens are joined with spaces */
    int stream_exact; /* every decoder lets exl_detokenizer stream */

    /* tokenizer_config.json */
    int32_t bos_id, eos_id;
    char *bos_text, *eos_text; /* exl_malloc'd or NULL */
    char *chat_template;       /* exl_malloc'd or NULL */
};

/* ---------------------------------------------------------------- between files */

/* Parse tokenizer.json (whole text) into tok (path is used in messages). */
exl_status exl_tok_load_json(exl_tokenizer *tok, const char *path, const char *data, size_t len);
/* Parse a SentencePiece tokenizer.model. add_bos/add_eos set the post-processor. */
exl_status exl_tok_load_spm(exl_tokenizer *tok, const char *path, const unsigned char *data, size_t len, int add_bos,
                            int add_eos);

/* Allocate the per-id tables for ids 0..n-1 (all holes). */
exl_status exl_tok_alloc_ids(exl_tokenizer *tok, int32_t n, const char *path);
/* Register an added token (after the model vocabulary is in place); normalizes its
 * match string when `normalized`. */
exl_status exl_tok_add_token(exl_tokenizer *tok, const char *path, int32_t id, const char *content, size_t len,
                             int special, int lstrip, int rstrip, int normalized, int single_word);
/* Build the tries and the byte-fallback table once the vocabulary is complete. */
exl_status exl_tok_finish(exl_tokenizer *tok, const char *path);
exl_status exl_tok_build_tries(exl_tokenizer *tok, const char *path);
void exl_tok_trie_free(exl_tok_trie *t);

/* One added-token match: the token id and the bytes it covers (with stripped spaces). */
typedef struct exl_tok_match {
    size_t start, end;
    int32_t id;
} exl_tok_match;

/* Find the leftmost-longest match of trie t in s[from..n); 0 when there is none. */
int exl_tok_added_next(const exl_tokenizer *tok, const exl_tok_trie *t, const char *s, size_t n, size_t from,
                       exl_tok_match *m);

/* Compile a regex written for Oniguruma (\s spelled out for PCRE2). */
exl_status exl_tok_regex_compile(const char *path, const char *what, const char *src, size_t len, pcre2_code **out);

/* Normalize text with the whole normalizer chain into out (cleared first). */
exl_status exl_tok_normalize(const exl_tokenizer *tok, const char *s, size_t n, exl_str *out);

/* A list of byte ranges into one buffer. */
typedef struct exl_tok_ranges {
    uint32_t *off, *len;
    size_t n, cap;
} exl_tok_ranges;

/* Scratch reused across the pieces of one encode call. */
typedef struct exl_tok_work {
    exl_str buf[2];
    exl_tok_ranges rng[2];
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit;
    exl_tok_ranges seg; /* split segments; bit 31 of len marks a pattern match */
    exl_str tmp;
    /* BPE */
    void *sym;
    size_t sym_cap;
    void *heap;
    size_t heap_cap;
    exl_str key;
    /* word cache: word -> ids */
    exl_strmap cache;
    exl_tok_arena cache_arena;
    int32_t *cache_ids;
    size_t cache_n, cache_cap;
} exl_tok_work;

void exl_tok_work_free(exl_tok_work *w);
int exl_tok_ranges_push(exl_tok_ranges *r, size_t off, size_t len);

/* Pre-tokenize one normalized piece into words: *text is the buffer they index and
 * *words their ranges (both owned by w). at_start: the piece begins the original text. */
exl_status exl_tok_pretokenize(const exl_tokenizer *tok, exl_tok_work *w, const char *s, size_t n, int at_start,
                               const char **text, const exl_tok_ranges **words);

/* GPT-2's byte <-> character table of the ByteLevel pre-tokenizer and decoder. */
int32_t exl_bytelevel_char(uint8_t b);
/* The byte a character stands for, or -1 when it is not in the table. */
int exl_bytelevel_byte(int32_t cp);

/* Growable id list. */
typedef struct exl_tok_ids {
    int32_t *v;
    size_t n, cap;
} exl_tok_ids;

int exl_tok_ids_push(exl_tok_ids *ids, int32_t id);

/* Run BPE on one word (model alphabet) and append its ids. */
exl_status exl_tok_bpe(const exl_tokenizer *tok, exl_tok_work *w, const char *word, size_t n, exl_tok_ids *out);

/* Run a regex over s, calling fn(ctx, start, end) for each match (fn returns nonzero to
 * signal an allocation failure). */
exl_status exl_tok_regex_each(const pcre2_code *re, exl_tok_work *w, const char *s, size_t n,
                              int (*fn)(void *ctx, size_t start, size_t end), void *ctx);

/* Decode a list of token strings with the decoder chain, appending to out. */
exl_status exl_tok_decode_strings(const exl_tokenizer *tok, const char *const *strs, const uint32_t *lens, size_t n,
                                  exl_str *out);

/* For the chat-template code: tokenizer_config.json's chat_template (or
 * chat_template.jinja), and the BOS/EOS token texts; NULL when absent. */
const char *exl_tokenizer_chat_template(const exl_tokenizer *tok);
const char *exl_tokenizer_bos_text(const exl_tokenizer *tok);
const char *exl_tokenizer_eos_text(const exl_tokenizer *tok);

#endif
