/* regex.h - a regular expression as GBNF text: the whole output must match it.
 *
 * Supported: literals, escapes (\d \w \s and their negations, \n \r \t \f \v \0, \xHH, \uHHHH,
 * escaped punctuation), classes [...] and [^...] with ranges and \d \w \s inside, `.` (any code
 * point but newline), groups ( ) (?: ) (?<name> ) (?P<name> ), alternation, the quantifiers
 * * + ? {m} {m,} {m,n} (lazy and possessive forms match the same strings), and ^ / $ at the
 * very start / end. Anything else (backreferences, lookaround, word boundaries, inline flags,
 * anchors elsewhere) is an error naming it. */
#ifndef EXL_CONSTRAIN_REGEX_H
#define EXL_CONSTRAIN_REGEX_H

#include "base/str.h"
#include "exl.h"

#include <stddef.h>

/* Append to out a GBNF grammar whose root matches exactly the strings the regex matches as a whole. */
exl_status exl_regex_to_gbnf(const char *re, size_t len, exl_str *out);

#endif
