/* utf8.h - UTF-8 helpers shared by the tokenizer, the generator's text, the server and the CLI:
 * validation, decoding and encoding, complete-prefix length, lossy repair, and White_Space. */
#ifndef EXL_BASE_UTF8_H
#define EXL_BASE_UTF8_H

#include "base/str.h"

#include <stddef.h>
#include <stdint.h>

/* Length of the UTF-8 sequence a lead byte c starts (1 for ASCII and for an invalid byte). */
int exl_utf8_len(unsigned char c);
/* Decode one code point of valid UTF-8; returns its byte length. */
int exl_utf8_decode(const char *s, int32_t *cp);
/* Encode cp (at most U+10FFFF) into out (4 bytes of room); returns the byte length. */
int exl_utf8_encode(int32_t cp, char *out);
/* Is s[0..n) valid UTF-8 (no surrogates, no overlongs)? */
int exl_utf8_valid(const char *s, size_t n);
/* Length of the longest prefix of s[0..n) that ends on a character boundary, treating a
 * trailing incomplete (but so far valid) sequence as not yet complete. */
size_t exl_utf8_complete_prefix(const char *s, size_t n);
/* Where the character that ends at s[end) starts (s valid UTF-8, end > 0). */
size_t exl_utf8_prev(const char *s, size_t end);
/* Append s[0..n) with every maximal invalid subsequence replaced by U+FFFD (as Rust's
 * String::from_utf8_lossy does). */
int exl_utf8_append_lossy(exl_str *out, const char *s, size_t n);
/* Unicode White_Space, as Oniguruma's \s and Rust's char::is_whitespace. */
int exl_unicode_is_space(int32_t cp);

#endif
