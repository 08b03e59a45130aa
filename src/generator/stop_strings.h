/* stop_strings.h - matching stop and banned strings in streamed text: where a string
 * occurs, and how much of the text's tail could still become one (to hold back). */
#ifndef EXL_GENERATOR_STOP_STRINGS_H
#define EXL_GENERATOR_STOP_STRINGS_H

#include <stddef.h>
#include <stdint.h>

/* A set of non-empty byte strings. */
typedef struct exl_string_set {
    char **s;
    size_t *len;
    int32_t n;
} exl_string_set;

/* The earliest complete occurrence of any string of the set in text[0..n): its offset,
 * or -1; *which receives the string's index (the first listed on a tie). */
int64_t exl_strings_find(const exl_string_set *set, const char *text, size_t n, int32_t *which);
/* Where the longest tail of text[0..n) that is a proper prefix of some string starts
 * (n when no tail is): text from there on may still turn into a match. */
size_t exl_strings_hold_from(const exl_string_set *set, const char *text, size_t n);

#endif
