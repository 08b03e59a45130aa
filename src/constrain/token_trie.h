/* token_trie.h - the vocabulary as a trie of byte strings, for computing which tokens a grammar
 * state allows in one walk: a token is allowed when the matcher survives every byte of it.
 *
 * Nodes are stored in preorder with their subtree sizes, so a walk is a loop over an array that
 * skips a whole subtree when its first byte kills the state. Special tokens and tokens that show
 * as nothing are not in the trie: a grammar never allows them (end-of-sequence tokens are the
 * generator's to allow where the output is complete). */
#ifndef EXL_CONSTRAIN_TOKEN_TRIE_H
#define EXL_CONSTRAIN_TOKEN_TRIE_H

#include "exl.h"

#include <stdint.h>

typedef struct exl_token_trie {
    int32_t vocab;      /* mask width: the model's vocabulary (may exceed the tokenizer's) */
    int32_t n_nodes;    /* node 0 is the root (no byte) */
    uint8_t *byte;      /* per node: the byte that leads to it */
    uint16_t *depth;    /* per node: its byte count (the root 0) */
    int32_t *size;      /* per node: nodes in its subtree, itself included */
    int32_t *tok_first; /* per node: its tokens are order[tok_first .. tok_first + tok_n) */
    int32_t *tok_n;
    int32_t *order; /* the ids of the tokens in the trie, sorted by their bytes */
    int32_t n_order;
    int32_t max_depth;
    int64_t *tok_off; /* per id: where its bytes are in bytes[] */
    int32_t *tok_len; /* per id: their count; -1 when the token is not in the trie */
    char *bytes;
} exl_token_trie;

#define EXL_TOKEN_TRIE_MAX_LEN 65535 /* longer tokens are left out */

/* The trie of tok's tokens (exl_tokenizer_token_bytes) for a model vocabulary of `vocab` ids. */
exl_status exl_token_trie_build(const exl_tokenizer *tok, int32_t vocab, exl_token_trie **out);
void exl_token_trie_free(exl_token_trie *t);

#endif
