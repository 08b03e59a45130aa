/* draft_model.c - drafting with a second, smaller model: its KV cache (the target's page geometry, indexed by
 * the jobs' own page tables), the record of which draft K/V each page holds, and the batched draft steps that
 * bring the draft up to each job's sequence and then propose its tokens one at a time.
 *
 * The draft K/V of a slot is a function of the tokens up to it, so a page's draft slots serve any job whose
 * sequence up to there is the same: a page records the chain hash of the tokens before it (d_parent) and the
 * tokens of its draft slots (d_tokens, the first d_valid of them). A job's draft prefix is found page by page
 * from its start; rejected drafts, pages released and taken by other jobs, prefixes attached from the prefix cache
 * all show up there as a mismatch, after which the draft recomputes (no rollback needed). */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <string.h>

exl_status exl_draft_model_init(exl_generator *g) {
    exl_spec *sp = g->spec;
    exl_model *d = g->params.draft_model;
    int32_t n_pages = g->params.n_pages, ps = g->params.page_size;
    if (!d->fs.max_rows)
        return exl_fail(EXL_ERR_ARG, "generator: the draft model was loaded for inspection only");
    sp->draft = d;
    sp->draft_vocab = d->cfg.vocab_size;
    EXL_TRY(exl_kv_cache_init(d, n_pages, ps, 16, 16, &sp->cache));
    sp->d_parent = exl_calloc((size_t)n_pages, sizeof *sp->d_parent);
    sp->d_valid = exl_calloc((size_t)n_pages, sizeof *sp->d_valid);
    sp->d_tokens = exl_malloc((size_t)n_pages * ps * sizeof *sp->d_tokens);
    sp->row = exl_malloc((size_t)g->vocab * sizeof *sp->row);
    if (!sp->d_parent || !sp->d_valid || !sp->d_tokens || !sp->row)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    return EXL_OK;
}

void exl_draft_model_free(exl_spec *sp) {
    if (sp->cache)
        exl_kv_cache_free(sp->draft, sp->cache);
    exl_free(sp->d_parent);
    exl_free(sp->d_valid);
    exl_free(sp->d_tokens);
    exl_free(sp->d_logits);
    exl_free(sp->row);
}

/* ---------------------------------------------------------------- which draft K/V a page holds */

/* How many leading positions of job j (at most limit) have their draft K/V in its pages. */
static int32_t draft_cached(const exl_spec *sp, exl_job *j, int32_t ps, int32_t limit) {
    int32_t pos = 0;
    for (int32_t i = 0; pos < limit && i < j->n_pages; i++) {
        int32_t page = j->pages[i];
        if (sp->d_parent[page] != exl_job_parent_hash(j, ps, i))
            break;
        int32_t n = sp->d_valid[page] < limit - pos ? sp->d_valid[page] : limit - pos, k = 0;
        const int32_t *t = sp->d_tokens + (size_t)page * ps;
        while (k < n && t[k] == j->tokens[pos + k])
            k++;
        pos += k;
        if (k < ps)
            break;
    }
    return pos;
}

/* The draft wrote positions [from, to) of job j (from: where draft_cached stopped, or further on). */
static void draft_note(exl_spec *sp, exl_job *j, int32_t ps, int32_t from, int32_t to) {
    for (int32_t p = from; p < to; p++) {
        int32_t page = j->pages[p / ps], slot = p % ps;
        if (slot == 0)
            sp->d_parent[page] = exl_job_parent_hash(j, ps, p / ps);
        sp->d_tokens[(size_t)page * ps + slot] = j->tokens[p];
        sp->d_valid[page] = slot + 1;
    }
}

/* ---------------------------------------------------------------- drafting */

/* Draft token i of job j from the draft's logits d (draft_vocab of them), processed with the job's settings; a
 * sampled job's distribution goes to its q row i. -1 when every token is banned. */
static int32_t pick(exl_generator *g, exl_job *j, int32_t i, const float *d) {
    exl_spec *sp = g->spec;
    int32_t v = g->vocab, n = sp->draft_vocab < v ? sp->draft_vocab : v;
    float *row = sp->row;
    memcpy(row, d, (size_t)n * sizeof *row);
    for (int32_t t = n; t < v; t++)
        row[t] = -INFINITY;
    exl_gen_prepare_logits(g, j, row);
    exl_sampler_process(&j->sampling, row, v, j->tokens, j->n_tokens + i, &g->scratch);
    int32_t m = exl_sampler_filter(&j->sampling, &j->spec.rng, row, v, &g->scratch);
    if (m <= 0)
        return -1;
    if (j->spec.q_row < 0)
        return g->scratch.cand[0].id; /* greedy: the argmax */
    float *q = sp->q + ((size_t)j->spec.q_row + i) * v;
    double total = 0;
    for (int32_t c = 0; c < m; c++)
        total += g->scratch.cand[c].p;
    memset(q, 0, (size_t)v * sizeof *q);
    for (int32_t c = 0; c < m; c++)
        q[g->scratch.cand[c].id] = (float)(g->scratch.cand[c].p / total);
    return exl_sampler_draw(&j->sampling, &j->spec.rng, &g->scratch, m);
}

/* Rows for the q of every sampled job's drafts. */
static exl_status assign_q_rows(exl_generator *g, exl_job **jobs, int32_t n) {
    exl_spec *sp = g->spec;
    int32_t rows = 0;
    for (int32_t i = 0; i < n; i++)
        if (jobs[i]->sampling.temperature > 0) {
            jobs[i]->spec.q_row = rows;
            rows += jobs[i]->spec.n_draft;
        }
    if (rows > sp->cap_q_rows) {
        float *q = exl_realloc(sp->q, (size_t)rows * g->vocab * sizeof *q);
        if (!q)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        sp->q = q;
        sp->cap_q_rows = rows;
    }
    sp->n_q_rows = rows;
    return EXL_OK;
}

/* Whether job j's drafts are each the plain argmax of the draft's logits: greedy without logit bias or penalties,
 * no bans ahead, stop tokens no longer suppressed. */
static int plain_argmax(const exl_generator *g, const exl_job *j) {
    if (exl_sampler_head_size(&j->sampling, g->vocab, 1) != 1 || j->n_tokens - j->n_prompt < j->min_new)
        return 0;
    for (int32_t i = 0; i < j->n_bans; i++)
        if (j->ban_pos[i] >= j->n_tokens)
            return 0;
    return 1;
}

/* One batched draft step: each job not done yet feeds its next tokens up to its newest draft (as many as the
 * draft's step takes), and those that reach it draft one more. Returns how many jobs took part (0: done). */
static exl_status draft_step(exl_generator *g, exl_job **jobs, int32_t n, int32_t *n_steps) {
    exl_spec *sp = g->spec;
    int32_t ps = g->pool.page_size, room = exl_model_max_rows(sp->draft), ns = 0, logit_rows = 0;
    for (int32_t i = 0; i < n && room > 0; i++) {
        exl_job *j = jobs[i];
        if (sp->d_rows[i] >= j->spec.n_draft)
            continue;
        int32_t end = j->n_tokens + sp->d_rows[i], feed = end - sp->d_pos[i];
        feed = feed < room ? feed : room;
        int want = sp->d_pos[i] + feed == end;
        sp->d_steps[ns] = (exl_seq_step){j->tokens + sp->d_pos[i], feed, sp->d_pos[i], j->pages, j->n_pages, want};
        sp->d_idx[ns++] = i;
        room -= feed;
        logit_rows += want;
    }
    *n_steps = ns;
    if (!ns)
        return EXL_OK;
    /* greedy rows need only the draft's argmax: from the device's top-k where it has one */
    int head = sp->draft_vocab <= g->vocab && exl_model_top_k_max(sp->draft) >= 1;
    for (int32_t s = 0; s < ns && head; s++)
        head = !sp->d_steps[s].want_logits || plain_argmax(g, jobs[sp->d_idx[s]]);
    if (head) {
        EXL_TRY(exl_model_forward_top_k(sp->draft, sp->cache, sp->d_steps, ns, 1, sp->d_head_ids, sp->d_head_vals));
    } else if (logit_rows > sp->cap_d_rows) {
        float *l = exl_realloc(sp->d_logits, (size_t)logit_rows * sp->draft_vocab * sizeof *l);
        if (!l)
            return exl_fail(EXL_ERR_NOMEM, "out of memory");
        sp->d_logits = l;
        sp->cap_d_rows = logit_rows;
    }
    if (!head)
        EXL_TRY(exl_model_forward(sp->draft, sp->cache, sp->d_steps, ns, sp->d_logits));
    int32_t row = 0;
    for (int32_t s = 0; s < ns; s++) {
        int32_t i = sp->d_idx[s];
        exl_job *j = jobs[i];
        draft_note(sp, j, ps, sp->d_pos[i], sp->d_pos[i] + sp->d_steps[s].n_new);
        sp->d_pos[i] += sp->d_steps[s].n_new;
        if (!sp->d_steps[s].want_logits)
            continue;
        int32_t id = head ? sp->d_head_ids[row++]
                          : pick(g, j, sp->d_rows[i], sp->d_logits + (size_t)row++ * sp->draft_vocab);
        if (id < 0) /* nothing to propose: the drafts so far stand */
            j->spec.n_draft = sp->d_rows[i];
        else
            j->tokens[j->n_tokens + sp->d_rows[i]++] = id;
    }
    return EXL_OK;
}

/* ---------------------------------------------------------------- greedy drafts chained on the device */

/* Every job drafts its k tokens as argmaxes in one chain of draft steps, each queued on the device before the host
 * reads the tokens of the one before (exl_model_forward_argmax): when the jobs are greedy, draft as many each, and
 * their catch-up fits one draft step. *done 0: not the case, nothing was run. */
static exl_status draft_chain(exl_generator *g, exl_job **jobs, int32_t n, int *done) {
    exl_spec *sp = g->spec;
    int32_t k = jobs[0]->spec.n_draft, rows = 0, ps = g->pool.page_size;
    *done = 0;
    if (n > EXL_ARGMAX_ROWS || sp->draft_vocab > g->vocab)
        return EXL_OK;
    for (int32_t i = 0; i < n; i++) {
        if (jobs[i]->spec.n_draft != k || !plain_argmax(g, jobs[i]))
            return EXL_OK;
        rows += jobs[i]->n_tokens - sp->d_pos[i];
    }
    if (rows > exl_model_max_rows(sp->draft))
        return EXL_OK;
    *done = 1;
    int32_t ids[EXL_ARGMAX_ROWS];
    int64_t ticket = -1, next = -1;
    for (int32_t r = 0; r <= k; r++) {
        if (r < k) { /* queue round r: the catch-up and last token, then each job's newest draft from the device */
            for (int32_t i = 0; i < n; i++) {
                exl_job *j = jobs[i];
                sp->d_steps[i] = r == 0 ? (exl_seq_step){j->tokens + sp->d_pos[i],
                                                         j->n_tokens - sp->d_pos[i],
                                                         sp->d_pos[i],
                                                         j->pages,
                                                         j->n_pages,
                                                         1}
                                        : (exl_seq_step){NULL, 1, j->n_tokens + r - 1, j->pages, j->n_pages, 1};
            }
            EXL_TRY(exl_model_forward_argmax(sp->draft, sp->cache, sp->d_steps, n, &next));
        }
        if (r > 0) { /* round r - 1's tokens: draft r - 1 of each job */
            EXL_TRY(exl_model_argmax_wait(sp->draft, ticket, ids, n));
            for (int32_t i = 0; i < n; i++) {
                exl_job *j = jobs[i];
                if (ids[i] < 0 && j->spec.n_draft > r - 1) /* nothing to propose: the drafts so far stand */
                    j->spec.n_draft = r - 1;
                if (r - 1 < j->spec.n_draft)
                    j->tokens[j->n_tokens + r - 1] = ids[i];
            }
        }
        ticket = next;
    }
    for (int32_t i = 0; i < n; i++) /* fed: the sequence, then every draft but the last */
        draft_note(sp, jobs[i], ps, sp->d_pos[i], jobs[i]->n_tokens + jobs[i]->spec.n_draft - 1);
    return EXL_OK;
}

exl_status exl_draft_model_propose(exl_generator *g, exl_job **jobs, int32_t n) {
    exl_spec *sp = g->spec;
    EXL_TRY(assign_q_rows(g, jobs, n));
    for (int32_t i = 0; i < n; i++) {
        sp->d_pos[i] = draft_cached(sp, jobs[i], g->pool.page_size, jobs[i]->n_tokens - 1);
        sp->d_rows[i] = 0;
    }
    int done;
    EXL_TRY(draft_chain(g, jobs, n, &done));
    for (int32_t steps = !done; steps > 0;)
        EXL_TRY(draft_step(g, jobs, n, &steps));
    return EXL_OK;
}
