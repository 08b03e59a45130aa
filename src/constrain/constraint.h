/* constraint.h - the compiled constraint behind exl_constraint: the byte grammar and its
 * matcher, shared by reference between a caller and the jobs that use it. */
#ifndef EXL_CONSTRAIN_CONSTRAINT_H
#define EXL_CONSTRAIN_CONSTRAINT_H

#include "constrain/grammar.h"
#include "constrain/matcher.h"

#include <stdatomic.h>

struct exl_constraint {
    atomic_int refs;
    exl_grammar grammar;
    exl_matcher matcher;
};

/* Another reference (a job's). */
exl_constraint *exl_constraint_ref(exl_constraint *c);

#endif
