/* sampler.c - logits processing, truncation filters and the per-job random draw.
 *
 * Candidates are ordered by weight, ties by token id, so the result is a function of
 * the logits, the settings and the job's random state alone. Full sorts of the
 * vocabulary are avoided where a filter only needs its head (top-k, top-p). */
#include "generator/sampler.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- scratch + random stream */

exl_status exl_sampler_scratch_init(exl_sampler_scratch *s, int32_t vocab) {
    *s = (exl_sampler_scratch){.vocab = vocab};
    s->cand = exl_malloc((size_t)vocab * sizeof *s->cand);
    s->order = exl_malloc((size_t)vocab * sizeof *s->order);
    s->counts = exl_calloc((size_t)vocab, sizeof *s->counts);
    if (!s->cand || !s->order || !s->counts) {
        exl_sampler_scratch_free(s);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    return EXL_OK;
}

void exl_sampler_scratch_free(exl_sampler_scratch *s) {
    exl_free(s->cand);
    exl_free(s->order);
    exl_free(s->counts);
    *s = (exl_sampler_scratch){0};
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void exl_sampler_init(exl_sampler_state *st, const exl_sampling *p) {
    uint64_t x = p->seed;
    for (int i = 0; i < 4; i++)
        st->rng[i] = splitmix64(&x);
    st->mu = 2.0f * p->mirostat_tau;
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

double exl_sampler_uniform(exl_sampler_state *st) { /* xoshiro256** */
    uint64_t *s = st->rng;
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return (double)(r >> 11) * 0x1.0p-53;
}

/* ---------------------------------------------------------------- logits processing */

void exl_sampler_process(const exl_sampling *p, float *logits, int32_t vocab, const int32_t *history, int32_t n_history,
                         exl_sampler_scratch *s) {
    for (int32_t i = 0; i < p->n_logit_bias; i++)
        logits[p->logit_bias[i].id] += p->logit_bias[i].bias;
    if (p->repetition_penalty == 1.0f && p->frequency_penalty == 0.0f && p->presence_penalty == 0.0f)
        return;
    if (p->penalty_range > 0 && n_history > p->penalty_range) {
        history += n_history - p->penalty_range;
        n_history = p->penalty_range;
    }
    for (int32_t i = 0; i < n_history; i++)
        s->counts[history[i]]++;
    for (int32_t i = 0; i < n_history; i++) {
        int32_t id = history[i], c = s->counts[id];
        if (!c)
            continue; /* done at its first occurrence */
        float l = logits[id];
        if (p->repetition_penalty != 1.0f)
            l = l > 0 ? l / p->repetition_penalty : l * p->repetition_penalty;
        logits[id] = l - p->frequency_penalty * (float)c - p->presence_penalty;
        s->counts[id] = 0;
    }
}

/* ---------------------------------------------------------------- filters */

static int by_weight(const void *a, const void *b) {
    const exl_candidate *x = a, *y = b;
    if (x->p != y->p)
        return x->p > y->p ? -1 : 1;
    return (x->id > y->id) - (x->id < y->id);
}

static int heavier(const exl_candidate *x, const exl_candidate *y) {
    return x->p > y->p || (x->p == y->p && x->id < y->id);
}

/* Move the k heaviest of c[0..n) to the front, sorted (quickselect, then sort). */
static void select_top(exl_candidate *c, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n - 1;
    while (lo < hi) {
        exl_candidate pivot = c[lo + (hi - lo) / 2];
        int32_t i = lo, j = hi;
        while (i <= j) {
            while (heavier(&c[i], &pivot))
                i++;
            while (heavier(&pivot, &c[j]))
                j--;
            if (i <= j) {
                exl_candidate t = c[i];
                c[i++] = c[j];
                c[j--] = t;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            break;
    }
    qsort(c, (size_t)k, sizeof *c, by_weight);
}

static double total_weight(const exl_candidate *c, int32_t n) {
    double t = 0;
    for (int32_t i = 0; i < n; i++)
        t += c[i].p;
    return t;
}

/* Sort just enough of the head of c[0..n) to cover `mass` of the weight; returns how
 * many leading candidates are now sorted. */
static int32_t sort_head(exl_candidate *c, int32_t n, double mass) {
    float pmax = 0;
    for (int32_t i = 0; i < n; i++)
        pmax = c[i].p > pmax ? c[i].p : pmax;
    for (float thr = pmax / 64; thr > pmax * 1e-30f; thr /= 64) {
        int32_t m = 0;
        double sum = 0;
        for (int32_t i = 0; i < n; i++)
            if (c[i].p >= thr) {
                sum += c[i].p;
                exl_candidate t = c[m];
                c[m++] = c[i];
                c[i] = t;
            }
        if (sum >= mass) {
            qsort(c, (size_t)m, sizeof *c, by_weight);
            return m;
        }
    }
    qsort(c, (size_t)n, sizeof *c, by_weight);
    return n;
}

static int32_t top_p_filter(exl_candidate *c, int32_t n, int32_t sorted, float top_p) {
    double total = total_weight(c, n), target = top_p * total, cum = 0;
    if (sorted < n)
        sorted = sort_head(c, n, target);
    for (int32_t i = 0; i < sorted; i++) {
        cum += c[i].p;
        if (cum >= target)
            return i + 1;
    }
    return sorted;
}

static int32_t min_p_filter(exl_candidate *c, int32_t n, float min_p) {
    float pmax = 0;
    for (int32_t i = 0; i < n; i++)
        pmax = c[i].p > pmax ? c[i].p : pmax;
    int32_t m = 0;
    for (int32_t i = 0; i < n; i++)
        if (c[i].p >= min_p * pmax)
            c[m++] = c[i];
    return m;
}

/* Keep the tokens whose surprise is closest to the entropy, up to typical_p of the mass. */
static int32_t typical_filter(exl_candidate *c, int32_t n, float typical_p, exl_candidate *order) {
    double total = total_weight(c, n), ent = 0;
    for (int32_t i = 0; i < n; i++) {
        double q = c[i].p / total;
        if (q > 0)
            ent -= q * log(q);
    }
    for (int32_t i = 0; i < n; i++) {
        double q = c[i].p / total;
        /* order by distance (ascending), so negate it into the descending "weight" */
        order[i] = (exl_candidate){i, q > 0 ? -(float)fabs(-log(q) - ent) : -INFINITY};
    }
    qsort(order, (size_t)n, sizeof *order, by_weight);
    double cum = 0;
    int32_t keep = n;
    for (int32_t i = 0; i < n; i++) {
        cum += c[order[i].id].p / total;
        if (cum >= typical_p) {
            keep = i + 1;
            break;
        }
    }
    for (int32_t i = 0; i < keep; i++) /* order[].id are indices into c; stash the picks */
        order[i] = c[order[i].id];
    memcpy(c, order, (size_t)keep * sizeof *c);
    return keep;
}

/* Tail-free: cut where the normalized |second derivative| of the sorted probabilities
 * has accumulated beyond z; the first token always stays and the last always goes. */
static int32_t tail_free_filter(exl_candidate *c, int32_t n, float z) {
    if (n < 3)
        return n;
    qsort(c, (size_t)n, sizeof *c, by_weight);
    double total = total_weight(c, n), sum = 0;
    for (int32_t i = 0; i + 2 < n; i++)
        sum += fabs((c[i].p - 2.0 * c[i + 1].p + c[i + 2].p) / total);
    if (sum <= 0)
        return n;
    double cum = 0;
    for (int32_t i = 0; i + 2 < n; i++) {
        cum += fabs((c[i].p - 2.0 * c[i + 1].p + c[i + 2].p) / total) / sum;
        if (cum > z)
            return i + 1;
    }
    return n - 1;
}

/* The k largest logits (ties: lower id first) sorted into c, in one pass that keeps a
 * sorted list; c[].p holds the logit. Returns -1 when fewer than k logits are finite. */
static int32_t top_k_logits(const float *logits, int32_t vocab, int32_t k, exl_candidate *c) {
    int32_t m = 0;
    for (int32_t i = 0; i < vocab; i++) {
        float l = logits[i];
        if (!(l > -INFINITY) || (m == k && l <= c[k - 1].p))
            continue;
        int32_t at = m < k ? m++ : k - 1;
        while (at > 0 && c[at - 1].p < l) {
            c[at] = c[at - 1];
            at--;
        }
        c[at] = (exl_candidate){i, l};
    }
    return m == k ? m : -1;
}

/* Every finite logit as a weight exp((l - max) / T), in id order; *best gets the argmax. The first
 * loop gathers the finite logits without a data-dependent branch (masked -inf logits lie scattered
 * over the vocabulary where a constraint allows some of its tokens), so that expf sees finite
 * arguments only: for -inf it takes a slow path whose branch mispredicts as often as the mask
 * changes, which cost more than the weights of the allowed tokens themselves. */
static int32_t all_weights(const float *logits, int32_t vocab, float temperature, exl_candidate *c, int32_t *best) {
    float lmax = -INFINITY;
    int32_t n = 0;
    *best = -1;
    for (int32_t i = 0; i < vocab; i++) {
        float l = logits[i];
        c[n] = (exl_candidate){i, l}; /* kept when finite: n moves past it */
        n += l > -INFINITY;
        if (l > lmax) { /* rarely taken: a new maximum */
            lmax = l;
            *best = i;
        }
    }
    if (*best < 0 || temperature <= 0)
        return 0;
    float inv_t = 1.0f / temperature;
    for (int32_t k = 0; k < n; k++)
        c[k].p = expf((c[k].p - lmax) * inv_t);
    return n;
}

/* The filters after top-k and top-p's sort: c[0..n), the first `sorted` in order. */
static int32_t later_filters(const exl_sampling *p, exl_candidate *c, int32_t n, int32_t sorted,
                             exl_sampler_scratch *s) {
    if (p->top_p < 1.0f)
        n = top_p_filter(c, n, sorted, p->top_p);
    if (p->min_p > 0.0f)
        n = min_p_filter(c, n, p->min_p);
    if (p->typical_p < 1.0f)
        n = typical_filter(c, n, p->typical_p, s->order);
    if (p->tfs_z < 1.0f)
        n = tail_free_filter(c, n, p->tfs_z);
    return n;
}

/* From the top k (c[].p holding logits, sorted): weights, then the later filters. The order
 * by logit is the order by weight. */
static int32_t filter_head(const exl_sampling *p, exl_candidate *c, int32_t n, exl_sampler_scratch *s) {
    float inv_t = 1.0f / p->temperature, lmax = c[0].p;
    for (int32_t i = 0; i < n; i++)
        c[i].p = expf((c[i].p - lmax) * inv_t);
    return later_filters(p, c, n, n, s);
}

int32_t exl_sampler_filter(const exl_sampling *p, const exl_sampler_state *st, const float *logits, int32_t vocab,
                           exl_sampler_scratch *s) {
    exl_candidate *c = s->cand;
    int32_t n;
    if (p->temperature > 0 && p->mirostat != 2 && p->top_k > 0 && p->top_k < vocab &&
        (n = top_k_logits(logits, vocab, p->top_k, c)) > 0)
        return filter_head(p, c, n, s); /* top-k first: only k weights to compute */
    int32_t best;
    n = all_weights(logits, vocab, p->temperature, c, &best);
    if (best < 0)
        return 0;
    if (p->temperature <= 0) {
        c[0] = (exl_candidate){best, 1.0f};
        return 1;
    }
    if (p->mirostat == 2) { /* keep tokens whose surprise -log2(q) is at most mu */
        float thr = (float)(total_weight(c, n) * exp2(-(double)st->mu));
        int32_t m = 0;
        for (int32_t i = 0; i < n; i++)
            if (c[i].p >= thr)
                c[m++] = c[i];
        if (m == 0)
            c[m++] = (exl_candidate){best, 1.0f};
        return m;
    }
    int32_t sorted = 0;
    if (p->top_k > 0 && p->top_k < n) {
        select_top(c, n, p->top_k);
        n = sorted = p->top_k;
    }
    return later_filters(p, c, n, sorted, s);
}

/* ---------------------------------------------------------------- the draw */

int32_t exl_sampler_draw(const exl_sampling *p, exl_sampler_state *st, const exl_sampler_scratch *s, int32_t n) {
    const exl_candidate *c = s->cand;
    if (n == 1 && p->mirostat != 2)
        return c[0].id;
    double total = total_weight(c, n), u = exl_sampler_uniform(st) * total, acc = 0;
    int32_t pick = n - 1;
    for (int32_t i = 0; i < n; i++) {
        acc += c[i].p;
        if (u < acc) {
            pick = i;
            break;
        }
    }
    if (p->mirostat == 2) {
        double surprise = -log2(c[pick].p / total);
        st->mu -= p->mirostat_eta * (float)(surprise - p->mirostat_tau);
    }
    return c[pick].id;
}

int32_t exl_sampler_sample(const exl_sampling *p, exl_sampler_state *st, float *logits, int32_t vocab,
                           const int32_t *history, int32_t n_history, exl_sampler_scratch *s) {
    exl_sampler_process(p, logits, vocab, history, n_history, s);
    int32_t n = exl_sampler_filter(p, st, logits, vocab, s);
    return n > 0 ? exl_sampler_draw(p, st, s, n) : -1;
}

int32_t exl_sampler_head_size(const exl_sampling *p, int32_t vocab, int32_t max_k) {
    if (p->n_logit_bias || p->repetition_penalty != 1.0f || p->frequency_penalty != 0.0f ||
        p->presence_penalty != 0.0f || p->mirostat == 2)
        return 0;
    if (p->temperature <= 0)
        return max_k >= 1 ? 1 : 0;
    return p->top_k > 0 && p->top_k < vocab && p->top_k <= max_k ? p->top_k : 0;
}

int32_t exl_sampler_sample_head(const exl_sampling *p, exl_sampler_state *st, const int32_t *ids, const float *vals,
                                exl_sampler_scratch *s) {
    if (p->temperature <= 0)
        return ids[0];
    exl_candidate *c = s->cand;
    for (int32_t i = 0; i < p->top_k; i++)
        c[i] = (exl_candidate){ids[i], vals[i]};
    return exl_sampler_draw(p, st, s, filter_head(p, c, p->top_k, s));
}
