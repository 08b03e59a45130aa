/* int_range.h - the decimal integers of a range as a GBNF expression (no leading zeros, no "-0"),
 * for JSON Schema's integer minimum / maximum. */
#ifndef EXL_CONSTRAIN_INT_RANGE_H
#define EXL_CONSTRAIN_INT_RANGE_H

#include "base/str.h"

#include <stdint.h>

#define EXL_INT_RANGE_LIMIT 9999999999999999LL /* 16 digits: the widest integer the grammars write */

/* Append "( ... )" matching exactly the integers lo..hi (clamped to +-EXL_INT_RANGE_LIMIT; lo <= hi
 * after clamping) to out; -1 when out of memory. */
int exl_int_range_gbnf(int64_t lo, int64_t hi, exl_str *out);

#endif
