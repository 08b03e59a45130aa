/* stop_strings.c - occurrences and partial occurrences of a string set in text.
 * The sets are small and the held text short, so plain scans do. */
#include "generator/stop_strings.h"

#include <string.h>

int64_t exl_strings_find(const exl_string_set *set, const char *text, size_t n, int32_t *which) {
    int64_t best = -1;
    for (int32_t i = 0; i < set->n; i++) {
        const char *hit = memmem(text, n, set->s[i], set->len[i]);
        if (hit && (best < 0 || hit - text < best)) {
            best = hit - text;
            *which = i;
        }
    }
    return best;
}

size_t exl_strings_hold_from(const exl_string_set *set, const char *text, size_t n) {
    size_t from = n;
    for (int32_t i = 0; i < set->n; i++) {
        size_t k = set->len[i] - 1 < n ? set->len[i] - 1 : n;
        for (; k > 0 && n - k < from; k--)
            if (!memcmp(text + n - k, set->s[i], k)) {
                from = n - k;
                break;
            }
    }
    return from;
}
