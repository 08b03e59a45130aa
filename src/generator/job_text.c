/* job_text.c - a job's completion text: streamed through exl_detokenizer (whole
 * characters only), held back while its tail could still become a stop or banned
 * string, cut at a stop string, and rewound when a banned string appears.
 *
 * text_end[k] is how many bytes of completion text the detokenizer had produced once
 * generated token k was pushed. With banned strings the held text always starts where
 * some token's text starts, so a rewind never takes back text that was emitted. */
#include "generator/generator.h"

#include "base/error.h"

#include <string.h>

#define CONTEXT_TOKENS 8 /* prompt tokens the detokenizer sees first (leading spaces) */

static exl_status nomem(void) { return exl_fail(EXL_ERR_NOMEM, "out of memory"); }

/* A fresh detokenizer that has seen tokens [from, to) of the sequence (their text dropped). */
static exl_status prime_detok(exl_generator *g, exl_job *j, int32_t from, int32_t to) {
    j->detok_ready = 0;
    exl_detokenizer_free(j->detok);
    j->detok = NULL;
    EXL_TRY(exl_detokenizer_init(g->tok, 1, &j->detok));
    const char *text;
    size_t len;
    for (int32_t i = from; i < to; i++)
        EXL_TRY(exl_detokenizer_push(j->detok, j->tokens[i], &text, &len));
    j->detok_ready = 1;
    return EXL_OK;
}

/* A fresh detokenizer that has seen the end of the prompt and generated tokens [0, k). */
static exl_status restart_detok(exl_generator *g, exl_job *j, int32_t k) {
    return prime_detok(g, j, j->n_prompt > CONTEXT_TOKENS ? j->n_prompt - CONTEXT_TOKENS : 0, j->n_prompt + k);
}

exl_status exl_job_text_init(exl_generator *g, exl_job *j) { return restart_detok(g, j, 0); }

static exl_status emit(exl_job *j, size_t n) {
    if (!n)
        return EXL_OK;
    if (exl_str_append(&j->ev_text, j->held.data, n))
        return nomem();
    memmove(j->held.data, j->held.data + n, j->held.len - n + 1);
    j->held.len -= n;
    j->emitted += (int64_t)n;
    return EXL_OK;
}

/* The first generated token whose text reaches beyond absolute offset `at`. */
static int32_t token_at(const exl_job *j, int64_t at) {
    int32_t n_gen = j->n_tokens - j->n_prompt, k = 0;
    while (k < n_gen - 1 && j->text_end[k] <= at)
        k++;
    return k;
}

/* The held text grew: look for stop and banned strings, emit what is final. */
static exl_status settle(exl_job *j, int32_t *banned_at) {
    *banned_at = -1;
    const char *h = j->held.data ? j->held.data : "";
    int32_t stop_i = 0, ban_i = 0;
    int64_t s = exl_strings_find(&j->stop, h, j->held.len, &stop_i);
    int64_t b = exl_strings_find(&j->banned, h, j->held.len, &ban_i);
    if (b >= 0 && (s < 0 || b < s)) {
        *banned_at = token_at(j, j->emitted + b);
        return EXL_OK;
    }
    if (s >= 0) {
        j->stop_string = j->stop.s[stop_i];
        j->held.len = (size_t)s;
        j->held.data[s] = 0;
        return EXL_OK;
    }
    size_t from = exl_strings_hold_from(&j->stop, h, j->held.len);
    size_t from_ban = exl_strings_hold_from(&j->banned, h, j->held.len);
    if (from_ban < j->held.len) { /* hold from the start of that token's text */
        int32_t t = token_at(j, j->emitted + (int64_t)from_ban);
        int64_t start = t ? j->text_end[t - 1] : 0;
        from_ban = start > j->emitted ? (size_t)(start - j->emitted) : 0;
    }
    return emit(j, from < from_ban ? from : from_ban);
}

exl_status exl_job_text_update(exl_generator *g, exl_job *j, int32_t *banned_at) {
    int32_t k = j->n_tokens - j->n_prompt - 1;
    const char *text;
    size_t len;
    EXL_TRY(exl_detokenizer_push(j->detok, j->tokens[j->n_tokens - 1], &text, &len));
    if (exl_str_append(&j->held, text, len))
        return nomem();
    j->text_end[k] = j->emitted + (int64_t)j->held.len;
    return settle(j, banned_at);
}

exl_status exl_job_text_force(exl_generator *g, exl_job *j, const char *bytes, size_t n, int32_t n_ids) {
    const char *text;
    size_t len;
    if (j->detok_ready) { /* the text of the tokens before, all of it: the forced tokens start afresh */
        EXL_TRY(exl_detokenizer_flush(j->detok, &text, &len));
        if (exl_str_append(&j->held, text, len))
            return nomem();
    }
    if (exl_str_append(&j->held, bytes, n))
        return nomem();
    for (int32_t k = j->n_tokens - j->n_prompt - n_ids; k < j->n_tokens - j->n_prompt; k++)
        j->text_end[k] = j->emitted + (int64_t)j->held.len;
    /* the forced tokens as the new context: text is forced only where no token can write the next
     * byte, so the vocabulary has no byte tokens for it and the forced tokens end on whole
     * characters, leaving nothing pending that the next push would emit */
    EXL_TRY(prime_detok(g, j, j->n_tokens - n_ids, j->n_tokens));
    int32_t banned_at;
    return settle(j, &banned_at);
}

exl_status exl_job_text_rewind(exl_generator *g, exl_job *j, int32_t k) {
    int64_t keep = (k ? j->text_end[k - 1] : 0) - j->emitted;
    if (keep < 0) /* cannot happen: held text starts at a token boundary */
        keep = 0;
    if ((size_t)keep < j->held.len) {
        j->held.len = (size_t)keep;
        j->held.data[keep] = 0;
    }
    return restart_detok(g, j, k);
}

exl_status exl_job_text_finish(exl_generator *g, exl_job *j) {
    if (!j->stop_string && j->detok_ready) { /* (not after a failed restart: its state is unusable) */
        const char *text;
        size_t len;
        EXL_TRY(exl_detokenizer_flush(j->detok, &text, &len));
        if (exl_str_append(&j->held, text, len))
            return nomem();
    }
    return emit(j, j->held.len);
}
