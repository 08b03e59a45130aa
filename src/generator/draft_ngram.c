/* draft_ngram.c - n-gram (prompt lookup) drafting: the continuation of the latest earlier occurrence of the
 * sequence's last tokens, from the job's own context; no model runs. */
#include "generator/speculative.h"

#include <string.h>

int32_t exl_draft_ngram(const int32_t *tokens, int32_t n_tokens, int32_t ngram, int32_t k, int32_t *out) {
    for (int32_t n = ngram < n_tokens - 1 ? ngram : n_tokens - 1; n >= 1; n--) {
        const int32_t *tail = tokens + n_tokens - n;
        /* the match at start s covers tokens[s, s + n) and must leave a token after it before the tail */
        for (int32_t s = n_tokens - n - 1; s >= 0; s--) {
            if (tokens[s] != tail[0] || memcmp(tokens + s, tail, (size_t)n * sizeof *tail) != 0)
                continue;
            int32_t from = s + n, avail = n_tokens - from;
            for (int32_t i = 0; i < k; i++) /* past the sequence's end: the drafts so far (a repeating pattern) */
                out[i] = i < avail ? tokens[from + i] : out[i - avail];
            return k;
        }
    }
    return 0;
}
