/* shard_linear.c - one rank's part of a linear layer's weights (shard.h). A part that lies contiguous in the
 * files (dense output rows, GPTQ input rows, EXL2 whole groups) points into them; any other is copied: dense input
 * columns, quantized output columns (GPTQ zeros and EXL2 scales re-packed column by column), the bias slices and
 * EXL2's permutation of the part's features. */
#include "model/shard.h"

#include "base/alloc.h"
#include "base/error.h"
#include "format/quant.h"

#include <string.h>

void exl_shard_mem_free(exl_shard_mem *mem) {
    for (int32_t i = 0; i < mem->n; i++)
        exl_free(mem->blocks[i]);
    exl_free(mem->blocks);
    *mem = (exl_shard_mem){0};
}

/* zeroed bytes held by mem; NULL with a message */
static void *mem_alloc(exl_shard_mem *mem, size_t bytes) {
    if (mem->n == mem->cap) {
        int32_t cap = mem->cap ? 2 * mem->cap : 16;
        void **b = exl_realloc(mem->blocks, (size_t)cap * sizeof *b);
        if (!b) {
            exl_fail(EXL_ERR_NOMEM, "out of memory");
            return NULL;
        }
        mem->blocks = b;
        mem->cap = cap;
    }
    void *p = exl_calloc(1, bytes ? bytes : 1);
    if (!p)
        exl_fail(EXL_ERR_NOMEM, "out of memory sharding weights (%zu bytes)", bytes);
    else
        mem->blocks[mem->n++] = p;
    return p;
}

static const char *name_of(const exl_linear_src *src) { return src->name ? src->name : "linear"; }

/* 1 when cols are first, first + 1, ... */
static int contiguous(const int32_t *idx, int32_t n) {
    for (int32_t i = 1; i < n; i++)
        if (idx[i] != idx[0] + i)
            return 0;
    return 1;
}

static exl_status bias_cols(const exl_linear_src *src, const int32_t *cols, int32_t n, exl_shard_mem *mem,
                            exl_linear_src *out) {
    if (!src->bias)
        return EXL_OK;
    size_t e = exl_dtype_size(src->bias_dtype);
    unsigned char *b = mem_alloc(mem, (size_t)n * e);
    if (!b)
        return EXL_ERR_NOMEM;
    for (int32_t j = 0; j < n; j++)
        memcpy(b + (size_t)j * e, (const unsigned char *)src->bias + (size_t)cols[j] * e, e);
    out->bias = b;
    return EXL_OK;
}

/* ---- by output columns */

static exl_status dense_cols(const exl_linear_src *src, const int32_t *cols, int32_t n, exl_shard_mem *mem,
                             exl_linear_src *out) {
    size_t row = (size_t)src->in_features * exl_dtype_size(src->dense.dtype);
    const unsigned char *w = src->dense.data;
    if (contiguous(cols, n)) { /* [out, in] rows: a slice of the file */
        out->dense.data = w + (size_t)cols[0] * row;
        return EXL_OK;
    }
    unsigned char *d = mem_alloc(mem, (size_t)n * row);
    if (!d)
        return EXL_ERR_NOMEM;
    for (int32_t j = 0; j < n; j++)
        memcpy(d + (size_t)j * row, w + (size_t)cols[j] * row, row);
    out->dense.data = d;
    return EXL_OK;
}

static exl_status exl2_cols(const exl_linear_src *src, const int32_t *cols, int32_t n, exl_shard_mem *mem,
                            exl_linear_src *out) {
    const exl_exl2_src *e = &src->exl2;
    int32_t np = (n + 31) / 32 * 32;
    int32_t *qw = mem_alloc(mem, (size_t)e->q_rows * np * sizeof(int32_t));
    int32_t *qs = qw ? mem_alloc(mem, (size_t)e->n_groups * (np / 8) * sizeof(int32_t)) : NULL;
    if (!qs)
        return EXL_ERR_NOMEM;
    for (int64_t r = 0; r < e->q_rows; r++)
        for (int32_t j = 0; j < n; j++)
            qw[r * np + j] = e->q_weight[r * e->n_padded + cols[j]];
    for (int64_t g = 0; g < e->n_groups; g++)
        for (int32_t j = 0; j < n; j++)
            qs[g * (np / 8) + j / 8] |= (int32_t)(exl_exl2_scale_code(e, g, cols[j]) << (4 * (j % 8)));
    out->exl2.q_weight = qw;
    out->exl2.q_scale = qs;
    out->exl2.n_padded = np;
    return EXL_OK;
}

static exl_status gptq_cols(const exl_linear_src *src, const int32_t *cols, int32_t n, exl_shard_mem *mem,
                            exl_linear_src *out) {
    const exl_gptq_src *q = &src->gptq;
    int64_t N = src->out_features, words = src->in_features * q->bits / 32;
    if ((int64_t)n * q->bits % 32)
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: tensor parallelism: %d of its output columns do not fill whole %d-bit words of qzeros",
                        name_of(src), n, q->bits);
    int64_t zw = (int64_t)n * q->bits / 32;
    int32_t *qw = mem_alloc(mem, (size_t)words * n * sizeof(int32_t));
    int32_t *qz = qw ? mem_alloc(mem, (size_t)q->n_groups * zw * sizeof(int32_t)) : NULL;
    uint16_t *sc = qz ? mem_alloc(mem, (size_t)q->n_groups * n * sizeof(uint16_t)) : NULL;
    if (!sc)
        return EXL_ERR_NOMEM;
    for (int64_t r = 0; r < words; r++)
        for (int32_t j = 0; j < n; j++)
            qw[r * n + j] = q->qweight[r * N + cols[j]];
    int64_t src_zw = N * q->bits / 32;
    for (int64_t g = 0; g < q->n_groups; g++)
        for (int32_t j = 0; j < n; j++) {
            uint32_t z = exl_qstream_get(q->qzeros + g * src_zw, 1, (int64_t)cols[j] * q->bits, q->bits);
            exl_qstream_put(qz + g * zw, 1, (int64_t)j * q->bits, q->bits, z);
            sc[g * n + j] = q->scales[g * N + cols[j]];
        }
    out->gptq.qweight = qw;
    out->gptq.qzeros = qz;
    out->gptq.scales = sc;
    return EXL_OK;
}

exl_status exl_shard_cols(const exl_linear_src *src, const int32_t *cols, int32_t n, exl_shard_mem *mem,
                          exl_linear_src *out) {
    *out = *src;
    out->out_features = n;
    for (int32_t j = 0; j < n; j++)
        if (cols[j] < 0 || cols[j] >= src->out_features)
            return exl_fail(EXL_ERR_ARG, "%s: shard column %d outside 0..%lld", name_of(src), cols[j],
                            (long long)src->out_features - 1);
    EXL_TRY(bias_cols(src, cols, n, mem, out));
    switch (src->kind) {
    case EXL_LINEAR_DENSE: return dense_cols(src, cols, n, mem, out);
    case EXL_LINEAR_EXL2: return exl2_cols(src, cols, n, mem, out);
    case EXL_LINEAR_GPTQ: return gptq_cols(src, cols, n, mem, out);
    }
    return exl_fail(EXL_ERR_ARG, "%s: unknown linear kind", name_of(src));
}

/* ---- by input features */

/* EXL2: the groups [*g0, *g1) whose stream rows are exactly the features' (0 when there are none such) */
static int exl2_groups_of(const exl_exl2_src *e, const int32_t *features, int32_t n, int32_t *g0, int32_t *g1,
                          int64_t *row0) {
    int64_t lo = INT64_MAX, hi = -1;
    for (int32_t i = 0; i < n; i++) {
        int64_t r = e->q_invperm[features[i]];
        lo = r < lo ? r : lo;
        hi = r > hi ? r : hi;
    }
    if (n < 1 || hi - lo + 1 != n) /* features are distinct: n rows in a span of n are all of it */
        return 0;
    *g0 = *g1 = -1;
    for (exl_exl2_group g = EXL_EXL2_WALK; exl_exl2_next_group(e, &g);) {
        if (g.row == lo)
            *g0 = g.index, *row0 = lo;
        if (g.row + g.n_rows == hi + 1)
            *g1 = g.index + 1;
    }
    return *g0 >= 0 && *g1 > *g0;
}

/* GPTQ: features a contiguous range that fills whole words, and (without g_idx) whole groups */
static int gptq_range_fits(const exl_linear_src *src, const int32_t *features, int32_t n) {
    const exl_gptq_src *q = &src->gptq;
    int64_t k0 = features[0], k1 = k0 + n;
    if (!contiguous(features, n) || k0 * q->bits % 32 || (int64_t)n * q->bits % 32)
        return 0;
    return q->g_idx || (k0 % q->group_size == 0 && (k1 % q->group_size == 0 || k1 == src->in_features));
}

int exl_shard_rows_fit(const exl_linear_src *src, const int32_t *features, int32_t n) {
    int32_t g0, g1;
    int64_t row0;
    switch (src->kind) {
    case EXL_LINEAR_DENSE: return n > 0;
    case EXL_LINEAR_EXL2: return exl2_groups_of(&src->exl2, features, n, &g0, &g1, &row0);
    case EXL_LINEAR_GPTQ: return n > 0 && gptq_range_fits(src, features, n);
    }
    return 0;
}

static exl_status dense_rows(const exl_linear_src *src, const int32_t *features, int32_t n, exl_shard_mem *mem,
                             exl_linear_src *out) {
    size_t e = exl_dtype_size(src->dense.dtype);
    int64_t N = src->out_features, K = src->in_features;
    unsigned char *d = mem_alloc(mem, (size_t)N * n * e);
    if (!d)
        return EXL_ERR_NOMEM;
    const unsigned char *w = src->dense.data;
    for (int64_t o = 0; o < N; o++)
        for (int32_t i = 0; i < n; i++)
            memcpy(d + ((size_t)o * n + i) * e, w + ((size_t)o * K + features[i]) * e, e);
    out->dense.data = d;
    return EXL_OK;
}

static exl_status exl2_rows(const exl_linear_src *src, const int32_t *features, int32_t n, exl_shard_mem *mem,
                            exl_linear_src *out) {
    const exl_exl2_src *e = &src->exl2;
    int32_t g0, g1;
    int64_t row0;
    if (!exl2_groups_of(e, features, n, &g0, &g1, &row0))
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: tensor parallelism: the %d input features of a shard are not whole EXL2 groups of its "
                        "permuted rows",
                        name_of(src), n);
    int32_t q0 = e->q_groups[2 * g0 + 1], q1 = g1 < e->n_groups ? e->q_groups[2 * g1 + 1] : e->q_rows;
    int32_t *perm = mem_alloc(mem, (size_t)n * sizeof(int32_t));
    int16_t *groups = perm ? mem_alloc(mem, (size_t)(g1 - g0) * 2 * sizeof(int16_t)) : NULL;
    if (!groups)
        return EXL_ERR_NOMEM;
    for (int32_t i = 0; i < n; i++)
        perm[i] = (int32_t)(e->q_invperm[features[i]] - row0);
    for (int32_t g = g0; g < g1; g++) {
        groups[2 * (g - g0)] = e->q_groups[2 * g];
        groups[2 * (g - g0) + 1] = (int16_t)(e->q_groups[2 * g + 1] - q0);
    }
    out->exl2.q_weight = e->q_weight + (size_t)q0 * e->n_padded;
    out->exl2.q_invperm = perm;
    out->exl2.q_scale = e->q_scale + (size_t)g0 * (e->n_padded / 8);
    out->exl2.q_scale_max = e->q_scale_max + g0;
    out->exl2.q_groups = groups;
    out->exl2.q_rows = q1 - q0;
    out->exl2.n_groups = g1 - g0;
    return exl_exl2_check(out);
}

static exl_status gptq_rows(const exl_linear_src *src, const int32_t *features, int32_t n, exl_linear_src *out) {
    const exl_gptq_src *q = &src->gptq;
    if (!gptq_range_fits(src, features, n))
        return exl_fail(EXL_ERR_UNSUPPORTED,
                        "%s: tensor parallelism would split its input at feature %d, inside a GPTQ %s (group size %d, "
                        "%d-bit words): choose another --tp",
                        name_of(src), features[0], q->g_idx ? "packed word" : "group", q->group_size, q->bits);
    int64_t k0 = features[0], N = src->out_features;
    out->gptq.qweight = q->qweight + k0 * q->bits / 32 * N;
    if (q->g_idx) { /* act-order: the shard's rows keep their groups, every group's scales stay */
        out->gptq.g_idx = q->g_idx + k0;
    } else {
        int64_t g0 = k0 / q->group_size;
        out->gptq.qzeros = q->qzeros + g0 * (N * q->bits / 32);
        out->gptq.scales = q->scales + g0 * N;
        out->gptq.n_groups = (int32_t)((n + q->group_size - 1) / q->group_size);
    }
    return exl_gptq_check(out);
}

exl_status exl_shard_rows(const exl_linear_src *src, const int32_t *features, int32_t n, int keep_bias,
                          exl_shard_mem *mem, exl_linear_src *out) {
    *out = *src;
    out->in_features = n;
    if (!keep_bias)
        out->bias = NULL;
    for (int32_t i = 0; i < n; i++)
        if (features[i] < 0 || features[i] >= src->in_features || (i && features[i] <= features[i - 1]))
            return exl_fail(EXL_ERR_ARG, "%s: shard features not ascending within 0..%lld", name_of(src),
                            (long long)src->in_features - 1);
    switch (src->kind) {
    case EXL_LINEAR_DENSE:
        if (contiguous(features, n) && n == src->in_features)
            return EXL_OK;
        return dense_rows(src, features, n, mem, out);
    case EXL_LINEAR_EXL2: return exl2_rows(src, features, n, mem, out);
    case EXL_LINEAR_GPTQ: return gptq_rows(src, features, n, out);
    }
    return exl_fail(EXL_ERR_ARG, "%s: unknown linear kind", name_of(src));
}

/* ---- where to split */

/* boundaries[0 .. n_ranks] of a range of `total` in steps of `unit` (the last part takes the rest) */
static int64_t split_at(int64_t total, int64_t unit, int32_t k, int32_t n_ranks) {
    if (k == n_ranks)
        return total;
    int64_t units = (total + unit - 1) / unit;
    return (units * k + n_ranks / 2) / n_ranks * unit;
}

static exl_status range_features(int64_t k0, int64_t k1, int32_t **features, int32_t *n) {
    *n = (int32_t)(k1 - k0);
    if (!(*features = exl_malloc((size_t)(*n ? *n : 1) * sizeof(int32_t))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; i < *n; i++)
        (*features)[i] = (int32_t)(k0 + i);
    return EXL_OK;
}

/* EXL2: the groups nearest to an equal share of the rows each, then the features whose rows they hold */
static exl_status exl2_plan(const exl_linear_src *src, int32_t rank, int32_t n_ranks, int32_t **features, int32_t *n) {
    const exl_exl2_src *e = &src->exl2;
    int64_t K = src->in_features, lo = -1, hi = -1;
    for (exl_exl2_group g = EXL_EXL2_WALK; exl_exl2_next_group(e, &g);) {
        int64_t end = g.row + g.n_rows;
        /* a group goes to the rank whose share holds its middle row */
        int32_t owner = (int32_t)((g.row + g.n_rows / 2) * n_ranks / K);
        if (owner == rank) {
            lo = lo < 0 ? g.row : lo;
            hi = end;
        }
    }
    if (lo < 0)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: %d EXL2 groups are too few for %d tensor-parallel ranks",
                        name_of(src), e->n_groups, n_ranks);
    *n = (int32_t)(hi - lo);
    if (!(*features = exl_malloc((size_t)*n * sizeof(int32_t))))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    int32_t i = 0;
    for (int64_t k = 0; k < K; k++)
        if (e->q_invperm[k] >= lo && e->q_invperm[k] < hi)
            (*features)[i++] = (int32_t)k;
    return EXL_OK;
}

exl_status exl_shard_plan_rows(const exl_linear_src *src, int32_t rank, int32_t n_ranks, int32_t **features,
                               int32_t *n) {
    *features = NULL;
    *n = 0;
    int64_t K = src->in_features, unit = K % (32 * n_ranks) == 0 ? 32 : 1;
    if (src->kind == EXL_LINEAR_EXL2)
        return exl2_plan(src, rank, n_ranks, features, n);
    if (src->kind == EXL_LINEAR_GPTQ) /* whole words (32 rows fill them at any width), whole groups */
        unit = src->gptq.g_idx ? 32 : src->gptq.group_size;
    int64_t k0 = split_at(K, unit, rank, n_ranks), k1 = split_at(K, unit, rank + 1, n_ranks);
    if (k1 <= k0)
        return exl_fail(EXL_ERR_UNSUPPORTED, "%s: %lld input features in parts of %lld are too few for %d ranks",
                        name_of(src), (long long)K, (long long)unit, n_ranks);
    return range_features(k0, k1, features, n);
}
