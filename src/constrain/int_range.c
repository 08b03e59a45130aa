/* int_range.c - integer ranges as GBNF: split by digit count, then for two equal-length bounds
 * a shared first digit is written and the rest recursed on, while differing first digits give
 * the low bound's tail, a run of full middle digits, and the high bound's tail. */
#include "constrain/int_range.h"

#include <stdio.h>
#include <string.h>

static int all_of(const char *s, int n, char c) {
    for (int i = 0; i < n; i++)
        if (s[i] != c)
            return 0;
    return 1;
}

/* The numbers a..b of n digits each (as strings), as a GBNF sequence or group. */
static int same_length(const char *a, const char *b, int n, exl_str *out) {
    if (n == 0)
        return exl_str_puts(out, "\"\"");
    if (n == 1)
        return a[0] == b[0] ? exl_str_printf(out, "\"%c\"", a[0]) : exl_str_printf(out, "[%c-%c]", a[0], b[0]);
    if (a[0] == b[0])
        return exl_str_printf(out, "\"%c\" ", a[0]) || same_length(a + 1, b + 1, n - 1, out);
    char nines[20], zeros[20];
    memset(nines, '9', sizeof nines);
    memset(zeros, '0', sizeof zeros);
    int lo_full = all_of(a + 1, n - 1, '0'), hi_full = all_of(b + 1, n - 1, '9'), any = 0;
    char d1 = (char)(a[0] + !lo_full), d2 = (char)(b[0] - !hi_full);
    if (exl_str_puts(out, "("))
        return -1;
    if (!lo_full) {
        if (exl_str_printf(out, "\"%c\" (", a[0]) || same_length(a + 1, nines, n - 1, out) || exl_str_puts(out, ")"))
            return -1;
        any = 1;
    }
    if (d1 <= d2) {
        if ((any && exl_str_puts(out, " | ")) ||
            (d1 == d2 ? exl_str_printf(out, "\"%c\"", d1) : exl_str_printf(out, "[%c-%c]", d1, d2)) ||
            exl_str_printf(out, " [0-9]{%d}", n - 1))
            return -1;
        any = 1;
    }
    if (!hi_full) {
        if ((any && exl_str_puts(out, " | ")) || exl_str_printf(out, "\"%c\" (", b[0]) ||
            same_length(zeros, b + 1, n - 1, out) || exl_str_puts(out, ")"))
            return -1;
    }
    return exl_str_puts(out, ")");
}

static int64_t pow10_of(int k) {
    int64_t p = 1;
    while (k-- > 0)
        p *= 10;
    return p;
}

/* 0 <= a <= b: alternatives joined by " | " (no enclosing group). */
static int non_negative(int64_t a, int64_t b, exl_str *out) {
    char sa[24], sb[24];
    int la = snprintf(sa, sizeof sa, "%lld", (long long)a), lb = snprintf(sb, sizeof sb, "%lld", (long long)b);
    for (int len = la; len <= lb; len++) {
        int64_t lo = len == la ? a : pow10_of(len - 1), hi = len == lb ? b : pow10_of(len) - 1;
        char x[24], y[24];
        snprintf(x, sizeof x, "%lld", (long long)lo);
        snprintf(y, sizeof y, "%lld", (long long)hi);
        if ((len > la && exl_str_puts(out, " | ")) || same_length(x, y, len, out))
            return -1;
    }
    return 0;
}

int exl_int_range_gbnf(int64_t lo, int64_t hi, exl_str *out) {
    lo = lo < -EXL_INT_RANGE_LIMIT ? -EXL_INT_RANGE_LIMIT : lo > EXL_INT_RANGE_LIMIT ? EXL_INT_RANGE_LIMIT : lo;
    hi = hi < -EXL_INT_RANGE_LIMIT ? -EXL_INT_RANGE_LIMIT : hi > EXL_INT_RANGE_LIMIT ? EXL_INT_RANGE_LIMIT : hi;
    if (exl_str_puts(out, "("))
        return -1;
    if (hi < 0) {
        if (exl_str_puts(out, "\"-\" (") || non_negative(-hi, -lo, out) || exl_str_puts(out, ")"))
            return -1;
    } else if (lo < 0) {
        if (exl_str_puts(out, "\"-\" (") || non_negative(1, -lo, out) || exl_str_puts(out, ") | ") ||
            non_negative(0, hi, out))
            return -1;
    } else if (non_negative(lo, hi, out)) {
        return -1;
    }
    return exl_str_puts(out, ")");
}
