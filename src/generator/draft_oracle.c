/* draft_oracle.c - TEST-ONLY hook, not part of the public API: drafts that agree with the model at a chosen rate,
 * to measure speculative decoding's speed against its acceptance rate (bench/gpu_speculative.sh).
 *
 * EXL_SPEC_TEST_ORACLE names a file of token ids (whitespace or comma separated): the completion plain greedy
 * decoding gives for the prompt. With EXL_SPEC_TEST_ALPHA=a, each draft of a greedy job at generated position i
 * is replaced, with probability a, by the file's token i, else by another token; the draft model (if any) still
 * runs, so its cost is paid. Greedy verification accepts a draft exactly when it is the model's own token, so each
 * is accepted with probability a while the output stays plain decoding's. */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdio.h>
#include <stdlib.h>

exl_status exl_draft_oracle_init(exl_spec *sp) {
    const char *path = getenv("EXL_SPEC_TEST_ORACLE"), *alpha = getenv("EXL_SPEC_TEST_ALPHA");
    if (!path || !*path)
        return EXL_OK;
    FILE *f = fopen(path, "r");
    if (!f)
        return exl_fail(EXL_ERR_IO, "EXL_SPEC_TEST_ORACLE: cannot open %s", path);
    int32_t cap = 0;
    long id;
    int c;
    exl_status st = EXL_OK;
    while (st == EXL_OK && (c = fgetc(f)) != EOF) {
        if (c < '0' || c > '9')
            continue;
        ungetc(c, f);
        if (fscanf(f, "%ld", &id) != 1)
            break;
        if (sp->n_oracle == cap) {
            cap = cap ? 2 * cap : 256;
            int32_t *o = exl_realloc(sp->oracle, (size_t)cap * sizeof *o);
            if (!o) {
                st = exl_fail(EXL_ERR_NOMEM, "out of memory");
                break;
            }
            sp->oracle = o;
        }
        sp->oracle[sp->n_oracle++] = (int32_t)id;
    }
    fclose(f);
    sp->oracle_alpha = alpha && *alpha ? atof(alpha) : 1.0;
    exl_sampling s = {.seed = 12345};
    exl_sampler_init(&sp->oracle_rng, &s);
    return st;
}

void exl_draft_oracle_apply(exl_spec *sp, exl_job *j, int32_t vocab) {
    if (j->spec.q_row >= 0)
        return;
    for (int32_t i = 0; i < j->spec.n_draft; i++) {
        int32_t at = j->n_tokens + i - j->n_prompt;
        if (at >= sp->n_oracle)
            return;
        int32_t right = sp->oracle[at];
        double u = exl_sampler_uniform(&sp->oracle_rng);
        j->tokens[j->n_tokens + i] = u < sp->oracle_alpha ? right : (right + 1) % vocab;
    }
}
