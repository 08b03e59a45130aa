/* gen_util.c - helpers for the generator tests (see gen_util.h). */
#include "gen_util.h"

#include "test.h"

#include <stdio.h>
#include <string.h>

exl_model *gu_load(const char *name, exl_tokenizer **tok) {
    char rel[256], dir[4096];
    snprintf(rel, sizeof rel, "models/%s", name);
    snprintf(dir, sizeof dir, "%s", exl_test_shared(rel));
    exl_model_params p = exl_model_default_params();
    p.device = EXL_DEVICE_CPU;
    exl_model *m = NULL;
    *tok = NULL;
    if (exl_model_load(dir, &p, &m) != EXL_OK || exl_tokenizer_load(dir, tok) != EXL_OK) {
        exl_test_failed(__FILE__, __LINE__, "load %s: %s", dir, exl_last_error());
        exl_model_free(m);
        return NULL;
    }
    return m;
}

exl_generator *gu_generator(exl_model *m, const exl_tokenizer *tok, int32_t n_pages, int32_t page_size,
                            int32_t max_batch_tokens) {
    exl_generator_params p = exl_generator_default_params();
    if (n_pages)
        p.n_pages = n_pages;
    if (page_size)
        p.page_size = page_size;
    if (max_batch_tokens)
        p.max_batch_tokens = p.max_jobs = max_batch_tokens;
    exl_generator *g = NULL;
    if (exl_generator_init(m, tok, &p, &g) != EXL_OK)
        exl_test_failed(__FILE__, __LINE__, "generator: %s", exl_last_error());
    return g;
}

static int utf8_incomplete_end(const char *s, size_t n) {
    size_t i = n, k = 0;
    while (i > 0 && k < 4 && ((unsigned char)s[i - 1] & 0xc0) == 0x80) {
        i--;
        k++;
    }
    if (i == 0)
        return k > 0;
    unsigned char c = (unsigned char)s[i - 1];
    size_t need = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
    return need != k + 1;
}

exl_status gu_run(exl_generator *g, const exl_job_params *params, int n, gu_result *res) {
    for (int i = 0; i < n; i++) {
        exl_status st = exl_generator_submit(g, &params[i], &res[i].id);
        if (st != EXL_OK)
            return st;
        res[i].stop_token = -1;
    }
    while (exl_generator_pending(g) > 0) {
        const exl_gen_event *ev;
        int32_t n_ev;
        exl_status st = exl_generator_step(g, &ev, &n_ev);
        if (st != EXL_OK)
            return st;
        for (int32_t e = 0; e < n_ev; e++) {
            gu_result *r = res;
            while (r < res + n && r->id != ev[e].job)
                r++;
            if (r == res + n) /* a job the caller submitted itself */
                continue;
            r->n_events++;
            if (ev[e].text_len && utf8_incomplete_end(ev[e].text, ev[e].text_len))
                r->split_char = 1;
            if (r->text_len + ev[e].text_len < sizeof r->text) {
                memcpy(r->text + r->text_len, ev[e].text, ev[e].text_len);
                r->text_len += ev[e].text_len;
            }
            for (int32_t k = 0; k < ev[e].n_ids && r->n_ids < GU_MAX_IDS; k++) {
                if (ev[e].logprobs)
                    r->lp[r->n_ids] = ev[e].logprobs[k];
                for (int32_t t = 0; t < ev[e].n_top_logprobs && t < 4; t++)
                    r->top[r->n_ids * 4 + t] = ev[e].top_logprobs[k * ev[e].n_top_logprobs + t];
                r->ids[r->n_ids++] = ev[e].ids[k];
            }
            r->n_generated = ev[e].n_generated;
            if (ev[e].finish) {
                r->finish = ev[e].finish;
                r->stop_token = ev[e].stop_token;
                r->n_cached = ev[e].n_cached_tokens;
                if (ev[e].stop_string)
                    snprintf(r->stop_string, sizeof r->stop_string, "%s", ev[e].stop_string);
            }
        }
    }
    return EXL_OK;
}

void gu_random_ids(uint64_t seed, int32_t *ids, int32_t n, int32_t vocab) {
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int32_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ids[i] = i == 0 ? 1 : 3 + (int32_t)(x % (uint64_t)(vocab - 3));
    }
}
