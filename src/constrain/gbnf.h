/* gbnf.h - GBNF, llama.cpp's grammar notation, parsed into a byte grammar.
 *
 *   name ::= alternatives          a rule; `root` is where matching starts
 *   "text"  [a-z0-9_]  [^"\\]  .   literals, code point classes, any code point
 *   ( ... )  a | b                 groups, alternation
 *   x*  x+  x?  x{m}  x{m,}  x{m,n}  repetition of the item before
 *   # to the end of the line       a comment
 * Escapes: \n \r \t \\ \" \[ \] \- \/ \xHH \uHHHH \UHHHHHHHH (code points, written as UTF-8).
 * A newline ends a rule except inside a group or right after `|`. Rules may be used before they
 * are defined; left recursion is refused. */
#ifndef EXL_CONSTRAIN_GBNF_H
#define EXL_CONSTRAIN_GBNF_H

#include "constrain/grammar.h"

#define EXL_GBNF_MAX_REPEAT 10000 /* the largest m or n of x{m,n} */
#define EXL_GBNF_MAX_DEPTH 200    /* groups inside groups */

/* Parse src[0..len) into g (initialized, empty) and finish it with `root` as the start rule.
 * Messages give the line and column at fault. */
exl_status exl_gbnf_parse(const char *src, size_t len, exl_grammar *g);

#endif
