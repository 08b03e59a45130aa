/* cpu_sample.c - the sample op on the CPU: the reference that defines its result exactly.
 *
 * For one row (the settings of generator/sampler.c, which this follows up to the rounding of sums):
 *   1. edits: the biases added in order, each penalized id l -> (l > 0 ? l / rep : l * rep) - freq * count - pres,
 *      the banned ids -> -inf. With want_logprob, the chosen token's log-probability is taken from the unedited row.
 *   2. the argmax (lowest id among equals) over the finite logits; temperature <= 0 picks it.
 *   3. weights w = expf((l - max) / T) as float, and in fixed point W = (uint64_t)(w * 2^shift + 0.5) (backend.h).
 *      "Logit order" is larger logit first, lower id first among equals.
 *   4. top-k (0 < k < vocab, at least k finite logits): the first k in logit order.
 *   5. top-p: the shortest prefix in logit order whose W sum reaches ceil(top_p * total).
 *   6. min-p: w >= min_p (the largest w is 1).
 *   7. typical: q = w / total, entropy H = -sum q log q (double); "typical order" is larger -(float)|-log q - H|
 *      first, lower id first; the shortest prefix in that order whose W reaches ceil(typical_p * total).
 *   8. the draw, unless one candidate is left: the first candidate, in typical order after 7, else logit order
 *      after 4 or 5, else id order, at which the W sum reaches floor(u * total) + 1 (at most total).
 * Every sum is an exact integer, so any backend that computes the same weights picks the same token. */
#include "backend/cpu/cpu.h"

#include "base/alloc.h"
#include "base/error.h"

#include <math.h>
#include <string.h>

typedef struct sample_cand {
    uint32_t key; /* larger first: the logit's, or the typical distance's */
    int32_t id;
    float w;
    uint64_t wi;
} sample_cand;

/* a float as a key whose unsigned order is the float order */
static uint32_t float_key(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

static int before(const sample_cand *a, const sample_cand *b) {
    return a->key > b->key || (a->key == b->key && a->id < b->id);
}

static uint64_t mass_of(const sample_cand *c, int by_count) { return by_count ? 1 : c->wi; }

static void swap_cand(sample_cand *a, sample_cand *b) {
    sample_cand t = *a;
    *a = *b;
    *b = t;
}

/* The candidate of c[0..n) at which the sum of masses in order (key, then id) first reaches need
 * (1 <= need <= the total): c is reordered so that it and everything before it come first, and its
 * index is returned (so the prefix has index + 1). Masses are 1 each with by_count. */
static int32_t select_prefix(sample_cand *c, int32_t n, uint64_t need, int by_count) {
    int32_t lo = 0, hi = n;
    uint64_t acc = 0;
    while (hi - lo > 1) {
        swap_cand(&c[lo + (hi - lo) / 2], &c[hi - 1]);
        const sample_cand pivot = c[hi - 1];
        int32_t a = lo;
        uint64_t below = 0;
        for (int32_t i = lo; i < hi - 1; i++)
            if (before(&c[i], &pivot)) {
                below += mass_of(&c[i], by_count);
                swap_cand(&c[i], &c[a++]);
            }
        swap_cand(&c[a], &c[hi - 1]);
        if (acc + below >= need) {
            hi = a;
        } else if (acc + below + mass_of(&c[a], by_count) >= need) {
            return a;
        } else {
            acc += below + mass_of(&c[a], by_count);
            lo = a + 1;
        }
    }
    return lo;
}

static uint64_t total_mass(const sample_cand *c, int32_t n) {
    uint64_t t = 0;
    for (int32_t i = 0; i < n; i++)
        t += c[i].wi;
    return t;
}

static uint64_t mass_target(double fraction, uint64_t total) {
    double t = ceil(fraction * (double)total);
    return t < 1 ? 1 : t >= (double)total ? total : (uint64_t)t;
}

static void apply_edits(const exl_sample_params *p, const exl_logit_edit *e, float *x) {
    for (int32_t i = 0; i < p->n_bias; i++)
        x[e[i].id] += e[i].v;
    e += p->n_bias;
    for (int32_t i = 0; i < p->n_penalized; i++) {
        float l = x[e[i].id];
        if (p->repetition_penalty != 1.0f)
            l = l > 0 ? l / p->repetition_penalty : l * p->repetition_penalty;
        x[e[i].id] = l - p->frequency_penalty * e[i].v - p->presence_penalty;
    }
    e += p->n_penalized;
    for (int32_t i = 0; i < p->n_banned; i++)
        x[e[i].id] = -INFINITY;
}

static float log_sum_exp(const float *x, int32_t vocab) {
    float m = -INFINITY;
    for (int32_t i = 0; i < vocab; i++)
        m = x[i] > m ? x[i] : m;
    double sum = 0;
    for (int32_t i = 0; i < vocab; i++)
        sum += exp((double)x[i] - m);
    return m + (float)log(sum);
}

/* Typical order's keys over c[0..n), then its prefix; returns the new n. */
static int32_t typical_filter(sample_cand *c, int32_t n, float typical_p) {
    uint64_t total = total_mass(c, n);
    double wsum = 0, ent = 0;
    for (int32_t i = 0; i < n; i++)
        wsum += c[i].w;
    for (int32_t i = 0; i < n; i++) {
        double q = c[i].w / wsum;
        if (q > 0)
            ent -= q * log(q);
    }
    for (int32_t i = 0; i < n; i++) {
        double q = c[i].w / wsum;
        c[i].key = float_key(q > 0 ? -(float)fabs(-log(q) - ent) : -INFINITY);
    }
    return select_prefix(c, n, mass_target(typical_p, total), 0) + 1;
}

/* A row's weights: w (-1 for a -inf logit) and W per id, their sum; cand: room for candidates. */
typedef struct sample_space {
    const float *x;
    int32_t vocab;
    float *w;
    uint64_t *wi;
    uint64_t total;
    sample_cand *cand;
} sample_space;

/* The candidates whose weight is at least thr into cand, in id order: *mass their W. */
static int32_t gather(const sample_space *s, float thr, uint64_t *mass) {
    int32_t m = 0;
    uint64_t sum = 0;
    for (int32_t i = 0; i < s->vocab; i++)
        if (s->w[i] >= thr) {
            s->cand[m++] = (sample_cand){float_key(s->x[i]), i, s->w[i], s->wi[i]};
            sum += s->wi[i];
        }
    *mass = sum;
    return m;
}

/* The heaviest candidates, enough to hold the first `count` in logit order (count > 0) or the first `mass` of W:
 * every candidate of weight >= thr for thresholds 2^-6, 2^-12, ... down to every finite logit. Any candidate ranks
 * after every heavier one, so the prefix sought lies among them. */
static int32_t gather_head(const sample_space *s, int32_t count, uint64_t mass) {
    uint64_t got;
    for (float thr = 0x1p-6f; thr > 0x1p-120f; thr *= 0x1p-6f) {
        int32_t m = gather(s, thr, &got);
        if (count ? m >= count : got >= mass)
            return m;
    }
    return gather(s, 0, &got);
}

/* One row; cand, w and wi have room for vocab entries, raw for vocab logits. */
static exl_sample_result sample_row(const exl_sample_params *p, const exl_logit_edit *edits, float *x, int32_t vocab,
                                    sample_space *s, float *raw) {
    exl_sample_result r = {.id = -1};
    float lse = 0;
    if (p->want_logprob) {
        lse = log_sum_exp(x, vocab);
        memcpy(raw, x, (size_t)vocab * sizeof *raw);
    }
    apply_edits(p, edits + p->first_edit, x);
    float lmax = -INFINITY;
    int32_t best = -1, n_finite = 0;
    for (int32_t i = 0; i < vocab; i++) {
        if (x[i] > lmax)
            lmax = x[i], best = i;
        n_finite += x[i] > -INFINITY;
    }
    if (best < 0)
        return r;
    if (p->temperature <= 0) {
        r.id = best;
        r.n_kept = 1;
    } else {
        const float inv_t = 1.0f / p->temperature;
        const double scale = ldexp(1.0, exl_sample_shift(vocab));
        s->x = x;
        s->total = 0;
        for (int32_t i = 0; i < vocab; i++) {
            float w = x[i] > -INFINITY ? expf((x[i] - lmax) * inv_t) : -1.0f;
            s->w[i] = w;
            s->wi[i] = w > 0 ? (uint64_t)((double)w * scale + 0.5) : 0;
            s->total += s->wi[i];
        }
        sample_cand *cand = s->cand;
        int32_t n = -1;   /* -1: every finite logit (w, wi in id order); else cand[0..n) */
        int in_order = 0; /* 1: the draw goes by key */
        if (p->top_k > 0 && p->top_k < vocab && n_finite >= p->top_k) {
            n = select_prefix(cand, gather_head(s, p->top_k, 0), (uint64_t)p->top_k, 1) + 1;
            in_order = 1;
        }
        if (p->top_p < 1.0f) {
            if (n < 0) {
                uint64_t need = mass_target(p->top_p, s->total);
                n = select_prefix(cand, gather_head(s, 0, need), need, 0) + 1;
            } else {
                n = select_prefix(cand, n, mass_target(p->top_p, total_mass(cand, n)), 0) + 1;
            }
            in_order = 1;
        }
        if (p->min_p > 0.0f) {
            uint64_t unused;
            int32_t m = 0;
            if (n < 0)
                m = gather(s, p->min_p, &unused);
            for (int32_t i = 0; n >= 0 && i < n; i++)
                if (cand[i].w >= p->min_p)
                    cand[m++] = cand[i];
            n = m;
        }
        if (p->typical_p < 1.0f) {
            uint64_t unused;
            n = typical_filter(cand, n < 0 ? gather(s, 0, &unused) : n, p->typical_p);
            in_order = 1;
        }
        r.n_kept = n < 0 ? n_finite : n;
        if (r.n_kept == 0) { /* min-p above 1 keeps nothing */
            r.id = -1;
        } else if (r.n_kept == 1) {
            r.id = n < 0 ? best : cand[0].id;
        } else {
            uint64_t total = n < 0 ? s->total : total_mass(cand, n);
            uint64_t need = (uint64_t)floor(p->u * (double)total) + 1;
            need = need > total ? total : need;
            if (in_order) {
                r.id = cand[select_prefix(cand, n, need, 0)].id;
            } else if (n >= 0) { /* id order, as gathered */
                uint64_t acc = 0;
                int32_t i = 0;
                while (i < n - 1 && (acc += cand[i].wi) < need)
                    i++;
                r.id = cand[i].id;
            } else { /* id order over the whole row; need <= total, so some W reaches it */
                uint64_t acc = 0;
                int32_t i = 0;
                while ((acc += s->wi[i]) < need)
                    i++;
                r.id = i;
            }
        }
    }
    if (p->want_logprob && r.id >= 0)
        r.logprob = raw[r.id] - lse;
    return r;
}

typedef struct sample_job {
    exl_sample_result *out;
    float *logits;
    int32_t rows, vocab;
    const exl_sample_params *params;
    const exl_logit_edit *edits;
    void *scratch; /* per pool index: vocab candidates, weights, fixed-point weights, raw logits */
} sample_job;

#define SAMPLE_ROW_BYTES (sizeof(sample_cand) + sizeof(float) + sizeof(uint64_t) + sizeof(float))

static void sample_rows(void *ctx, int index, int count) {
    sample_job *t = ctx;
    size_t v = (size_t)t->vocab;
    sample_cand *cand = (sample_cand *)((char *)t->scratch + (size_t)index * v * SAMPLE_ROW_BYTES);
    uint64_t *wi = (uint64_t *)(cand + v);
    float *w = (float *)(wi + v), *raw = w + v;
    sample_space s = {.vocab = t->vocab, .w = w, .wi = wi, .cand = cand};
    for (int32_t r = index; r < t->rows; r += count)
        t->out[r] = sample_row(&t->params[r], t->edits, t->logits + (size_t)r * v, t->vocab, &s, raw);
}

exl_status exl_cpu_sample(exl_backend *be, exl_sample_result *out, float *logits, int32_t rows, int32_t vocab,
                          const exl_sample_params *params, const exl_logit_edit *edits, int32_t n_edits) {
    exl_cpu_backend *cb = exl_cpu(be);
    for (int32_t r = 0; r < rows; r++) {
        const exl_sample_params *p = &params[r];
        int64_t end = (int64_t)p->first_edit + p->n_bias + p->n_penalized + p->n_banned;
        if (p->first_edit < 0 || p->n_bias < 0 || p->n_penalized < 0 || p->n_banned < 0 || end > n_edits)
            return exl_fail(EXL_ERR_ARG, "sample: row %d's edits lie outside the %d given", r, n_edits);
        for (int64_t e = p->first_edit; e < end; e++)
            if (edits[e].id < 0 || edits[e].id >= vocab)
                return exl_fail(EXL_ERR_ARG, "sample: row %d edits token %d of a vocabulary of %d", r, edits[e].id,
                                vocab);
    }
    int n_pool = exl_pool_size(cb->pool);
    size_t need = (size_t)n_pool * vocab * SAMPLE_ROW_BYTES;
    if (need > cb->sample_bytes) {
        exl_free_aligned(cb->sample_scratch);
        cb->sample_bytes = 0;
        if (!(cb->sample_scratch = exl_malloc_aligned(need)))
            return exl_fail(EXL_ERR_NOMEM, "out of memory for sampling");
        cb->sample_bytes = need;
    }
    sample_job t = {out, logits, rows, vocab, params, edits, cb->sample_scratch};
    exl_pool_run_work(cb->pool, sample_rows, &t, rows > 1 ? (int64_t)rows * vocab * 64 : 0);
    return EXL_OK;
}
