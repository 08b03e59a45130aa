/* constrained.c - the generator's side of constrained output: the vocabulary trie and the step's
 * logit masks, the grammar advanced by each sampled token, and text the grammar forces.
 *
 * A row's mask is the grammar state's token mask (constrain/mask.h), plus the job's end tokens
 * where the output may end there. Masks are filled while the device computes the step's logits
 * (exl_model_forward_masked); they cannot be filled a step earlier, because a row's state depends
 * on the token its previous step samples.
 *
 * Where no token of the vocabulary can continue (a vocabulary without braces asked for JSON, or
 * a literal the tokens cannot spell), the grammar's next bytes are written directly until some
 * token can go on again: the one viable byte, or of several the one that leaves the model the most
 * tokens to choose from next (so "[" then "{" rather than "]" for a list of objects: the model,
 * not the spelling, decides where output ends). Those bytes are the job's text, and their
 * tokenization is what the model is fed (it may contain <unk>). */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"
#include "base/utf8.h"
#include "constrain/mask.h"

#include <math.h>
#include <string.h>

#define MAX_FORCED 256 /* bytes written in one go without the model */

int exl_gen_step_constrained(const exl_generator *g) {
    for (int32_t s = 0; s < g->n_step; s++)
        if (g->steps[s].want_logits && g->step_jobs[s]->constraint)
            return 1;
    return 0;
}

static exl_status prepare(exl_generator *g) {
    if (!g->trie)
        EXL_TRY(exl_token_trie_build(g->tok, g->vocab, &g->trie));
    if (!g->masks) {
        g->masks = exl_malloc((size_t)g->params.max_jobs * (size_t)exl_mask_words(g->vocab) * sizeof *g->masks);
        if (!g->masks)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    return EXL_OK;
}

/* Whether the job may end in state s: an accepting state, and an end token to end with. */
static int may_end(const exl_generator *g, const exl_job *j, int32_t s) {
    if (!exl_matcher_accepting(&j->constraint->matcher, s))
        return 0;
    if (j->n_stop_ids)
        return 1;
    return !j->ignore_eos && g->n_eos > 0;
}

/* The mask of state s for job j into row (its end tokens set where it may end). */
static exl_status row_mask(exl_generator *g, exl_job *j, int32_t s, uint32_t *row) {
    const uint32_t *m;
    int32_t words = exl_mask_words(g->vocab);
    EXL_TRY(exl_mask_get(&j->constraint->matcher, g->trie, s, &m));
    memcpy(row, m, (size_t)words * sizeof *row);
    if (!may_end(g, j, s))
        return EXL_OK;
    for (int32_t i = 0; i < j->n_stop_ids; i++)
        row[j->stop_ids[i] >> 5] |= 1u << (j->stop_ids[i] & 31);
    for (int32_t i = 0; !j->ignore_eos && i < g->n_eos; i++)
        row[g->eos[i] >> 5] |= 1u << (g->eos[i] & 31);
    return EXL_OK;
}

exl_status exl_gen_fill_masks(void *user, uint32_t *masks, int32_t rows) {
    exl_generator *g = user;
    int32_t words = exl_mask_words(g->vocab), r = 0;
    for (int32_t s = 0; s < g->n_step && r < rows; s++) {
        exl_job *j = g->step_jobs[s];
        int32_t n = exl_seq_step_logit_rows(&g->steps[s]);
        for (int32_t i = 0; i < n && r < rows; i++, r++) {
            uint32_t *row = masks + (size_t)r * (size_t)words;
            if (j->constraint && g->steps[s].want_logits == 1)
                EXL_TRY(row_mask(g, j, j->cstate, row));
            else
                memset(row, 0xff, (size_t)words * sizeof *row);
        }
    }
    return EXL_OK;
}

int exl_gen_constraint_allows(const exl_generator *g, int32_t row, int32_t id) {
    const uint32_t *m = g->masks + (size_t)row * (size_t)exl_mask_words(g->vocab);
    return id >= 0 && id < g->vocab && ((m[id >> 5] >> (id & 31)) & 1);
}

/* Append forced tokens ids[0..n) (cut to the room left) as generated ones, probability 1. */
static int32_t append_forced(exl_generator *g, exl_job *j, const int32_t *ids, int32_t n) {
    int32_t room = j->max_new - (j->n_tokens - j->n_prompt);
    n = n < room ? n : room;
    for (int32_t i = 0; i < n; i++) {
        int32_t k = j->n_tokens - j->n_prompt;
        j->mu_hist[k] = j->rng.mu;
        j->lp[k] = 0.0f;
        for (int32_t t = 0; t < j->top_logprobs; t++)
            j->top[(size_t)k * j->top_logprobs + t] = (exl_token_logprob){ids[i], t ? -INFINITY : 0.0f};
        j->tokens[j->n_tokens++] = ids[i];
        g->stats.tokens_generated++;
    }
    return n;
}

/* How much a forced byte leading to state s leaves the model: the tokens allowed there (the end
 * tokens count one), 0 for a complete output. */
static exl_status choice_score(exl_generator *g, exl_job *j, int32_t s, int32_t *score) {
    const exl_matcher *m = &j->constraint->matcher;
    const uint32_t *mask;
    *score = 0;
    if (exl_matcher_complete(m, s))
        return EXL_OK;
    EXL_TRY(exl_mask_get(&j->constraint->matcher, g->trie, s, &mask));
    *score = m->states[s].mask_count + may_end(g, j, s);
    return EXL_OK;
}

/* Where no token can go on from the job's state: write the bytes the grammar leads to until one
 * can (or the output is complete), feed their tokens. Whether one can is a walk that stops at the
 * first token: a state's whole mask, on its first visit, is left to the next step's fill, which
 * runs while the device computes (here it would add to the step). */
static exl_status force_text(exl_generator *g, exl_job *j) {
    exl_matcher *m = &j->constraint->matcher;
    char bytes[MAX_FORCED + 4];
    size_t n = 0;
    int32_t s = j->cstate;
    for (;;) {
        if (exl_matcher_complete(m, s))
            break;
        int any = may_end(g, j, s);
        if (!any)
            EXL_TRY(exl_mask_any(m, g->trie, s, &any));
        if (any && exl_utf8_complete_prefix(bytes, n) == n)
            break;
        if (n >= MAX_FORCED)
            return exl_fail(EXL_ERR_UNSUPPORTED,
                            "constraint: no token of the vocabulary can continue the output, "
                            "and the grammar forces more than %d bytes",
                            MAX_FORCED);
        int32_t best = EXL_MATCH_DEAD, best_score = -1;
        unsigned char best_byte = 0;
        for (int b = 0; b < 256; b++) {
            int32_t next, score;
            EXL_TRY(exl_matcher_step(m, s, (unsigned char)b, &next));
            if (next < 0)
                continue;
            EXL_TRY(choice_score(g, j, next, &score));
            if (score > best_score) {
                best = next;
                best_score = score;
                best_byte = (unsigned char)b;
            }
        }
        if (best < 0)
            return exl_fail(EXL_ERR_STATE, "constraint: the grammar allows nothing here");
        bytes[n++] = (char)best_byte;
        s = best;
    }
    if (!n)
        return EXL_OK;
    int32_t *ids = NULL, n_ids = 0;
    EXL_TRY(exl_tokenizer_encode(g->tok, bytes, n, 0, &ids, &n_ids));
    for (int32_t i = 0; i < n_ids; i++)
        if (ids[i] >= g->vocab)
            n_ids = 0;
    if (n_ids == 0) {
        exl_ids_free(ids);
        return exl_fail(EXL_ERR_UNSUPPORTED, "constraint: the forced text '%.*s' has no tokens for the model", (int)n,
                        bytes);
    }
    int32_t added = append_forced(g, j, ids, n_ids);
    exl_ids_free(ids);
    j->cstate = s;
    return exl_job_text_force(g, j, bytes, n, added);
}

/* After the state moved: end where the output is complete, force text where no token can go on. */
static exl_status settle(exl_generator *g, exl_job *j) {
    EXL_TRY(force_text(g, j));
    if (j->stop_string)
        return exl_gen_finish(g, j, EXL_FINISH_STOP, NULL);
    if (exl_matcher_complete(&j->constraint->matcher, j->cstate))
        return exl_gen_finish(g, j, EXL_FINISH_STOP, NULL);
    if (j->n_tokens - j->n_prompt >= j->max_new)
        return exl_gen_finish(g, j, EXL_FINISH_LENGTH, NULL);
    return EXL_OK;
}

exl_status exl_gen_constraint_start(exl_generator *g, exl_job *j) {
    j->cstarted = 1;
    EXL_TRY(prepare(g));
    return settle(g, j);
}

exl_status exl_gen_constraint_advance(exl_generator *g, exl_job *j, int32_t id) {
    int32_t s;
    const exl_token_trie *t = g->trie;
    if (t->tok_len[id] < 0)
        return exl_fail(EXL_ERR_STATE, "constraint: token %d is not in the vocabulary's text", id);
    EXL_TRY(
        exl_matcher_walk(&j->constraint->matcher, j->cstate, t->bytes + t->tok_off[id], (size_t)t->tok_len[id], &s));
    if (s < 0)
        return exl_fail(EXL_ERR_STATE, "constraint: token %d leaves the grammar", id);
    j->cstate = s;
    return settle(g, j);
}
