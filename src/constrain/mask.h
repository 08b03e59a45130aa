/* mask.h - the tokens a matcher state allows, as a bitset over the vocabulary (bit id % 32 of
 * word id / 32 set: allowed), from one walk of the token trie; kept per state, so a state met
 * again (a string's characters, a repeated structure) costs a lookup. */
#ifndef EXL_CONSTRAIN_MASK_H
#define EXL_CONSTRAIN_MASK_H

#include "constrain/matcher.h"
#include "constrain/token_trie.h"

#define EXL_MASK_CACHE_BYTES ((int64_t)256 << 20) /* masks one matcher keeps before it drops them all */

/* 32-bit words of a mask over a vocabulary (the backends' mask_logits takes the same layout). */
static inline int32_t exl_token_mask_words(int32_t vocab) { return (vocab + 31) / 32; }

/* The mask of state s for trie t (end-of-sequence tokens are not in it: the caller adds them in
 * accepting states). *mask stays valid until the next call on this matcher. */
exl_status exl_mask_get(exl_matcher *m, const exl_token_trie *t, int32_t s, const uint32_t **mask);

/* Whether state s allows some token of trie t: the cached mask's count, else a walk that stops at the
 * first token (it leaves the mask to exl_mask_get, which a step calls while the device computes). */
exl_status exl_mask_any(exl_matcher *m, const exl_token_trie *t, int32_t s, int *any);

#endif
