/* cuda_quant.cu - EXL2 and GPTQ weights repacked once at load into the backend's
 * quantized layout (exl_qmatrix, see cuda_internal.h).
 *
 * Both formats are, per output column, little-endian bit streams of b-bit codes down the
 * input rows; they differ in where a row's code lies, its group, and its zero. Here every
 * group becomes chunks of 32 rows (padded rows read activation 0). A full chunk whose 32
 * codes are contiguous and word-aligned in the source is copied word for word (the
 * common case: EXL2, GPTQ without act-order), or at 3 and 5 bits moved word by word into the
 * halves layout (cuda_halves.h); anything else (act-order, ragged groups) is re-encoded code
 * by code. Act-order GPTQ rows are sorted by group, so the activation
 * gather does the permutation and each group is contiguous. */
#include "backend/cuda/cuda_halves.h"
#include "backend/cuda/cuda_internal.h"

#include "base/half.h"
#include "format/exl2.h"

#include <stdlib.h>
#include <string.h>

#define CHUNK 32

int exl_cuda_slot_of(int bits, int row) {
    if (bits == 3 || bits == 5 || bits == 6) /* pairs (p, p + 16) */
        return row < 16 ? 2 * row : 2 * (row - 16) + 1;
    int v = 32 / bits, u = row / v, j = row % v, half = v / 2; /* pairs (i, i + v/2) within a word */
    return j < half ? u * v + 2 * j : u * v + 2 * (j - half) + 1;
}

/* A source stream: column n's word w lies at words[w * stride + n]. */
typedef struct {
    const uint32_t *words;
    int64_t stride;
} stream_src;

static inline uint32_t read_code(const stream_src *s, int64_t bit, int bits, int64_t n) {
    int64_t w = bit >> 5;
    int off = (int)(bit & 31);
    uint64_t v = s->words[w * s->stride + n] >> off;
    if (off + bits > 32)
        v |= (uint64_t)s->words[(w + 1) * s->stride + n] << (32 - off);
    return (uint32_t)v & ((1u << bits) - 1);
}

/* One segment: the rows of one group, in stream order. */
typedef struct {
    int bits, group;
    int64_t n_rows;
    const int64_t *src_bit; /* [n_rows] stream bit position of each row */
    const int32_t *src_row; /* [n_rows] input feature of each row */
} segment;

typedef struct {
    int64_t n, n_pad;
    stream_src src;
    int64_t n_chunks, word_rows, total_word_rows;
    uint32_t *qw;
    int4 *chunks;
    int32_t *slot_src;
} packer;

/* where word row w of column n goes (the tiled layout of exl_qmatrix.qw) */
static inline uint32_t *word_at(const packer *pk, int64_t w, int64_t n) {
    return pk->qw + (n / EXL_QW_TILE) * pk->total_word_rows * EXL_QW_TILE + w * EXL_QW_TILE + n % EXL_QW_TILE;
}

/* a whole 3- or 5-bit chunk that is the file's contiguous stream from col, into the halves
 * layout (cuda_halves.h); called with a literal b */
static inline __attribute__((always_inline)) void halves_chunk(packer *pk, const uint32_t *col, int64_t wr, int b) {
    for (int64_t n = 0; n < pk->n; n++) {
        uint32_t st[6] = {0}, wd[5];
        for (int w = 0; w < b; w++)
            st[w] = col[w * pk->src.stride + n];
        exl_halves_from_stream(b, st, wd);
        for (int w = 0; w < b; w++)
            *word_at(pk, wr + w, n) = wd[w];
    }
}

static void pack_segment(packer *pk, const segment *sg) {
    int b = sg->bits;
    for (int64_t r0 = 0; r0 < sg->n_rows; r0 += CHUNK) {
        int64_t c = pk->n_chunks++, wr = pk->word_rows;
        int n_valid = sg->n_rows - r0 < CHUNK ? (int)(sg->n_rows - r0) : CHUNK;
        pk->chunks[c] = make_int4((int)wr, b, sg->group, 0);
        pk->word_rows += b;
        int contiguous = n_valid == CHUNK && (sg->src_bit[r0] & 31) == 0;
        for (int t = 0; t < CHUNK; t++) {
            pk->slot_src[c * CHUNK + exl_cuda_slot_of(b, t)] = t < n_valid ? sg->src_row[r0 + t] : -1;
            if (t < n_valid && sg->src_bit[r0 + t] != sg->src_bit[r0] + (int64_t)t * b)
                contiguous = 0;
        }
        if (contiguous && exl_halves_layout(b)) {
            const uint32_t *col = pk->src.words + (sg->src_bit[r0] >> 5) * pk->src.stride;
            if (b == 3)
                halves_chunk(pk, col, wr, 3);
            else
                halves_chunk(pk, col, wr, 5);
            continue;
        }
        if (contiguous) {
            int64_t sw = sg->src_bit[r0] >> 5;
            for (int w = 0; w < b; w++)
                for (int64_t n = 0; n < pk->n; n++)
                    *word_at(pk, wr + w, n) = pk->src.words[(sw + w) * pk->src.stride + n];
            continue;
        }
        if (exl_halves_layout(b)) {
            for (int64_t n = 0; n < pk->n; n++) {
                uint32_t wd[5] = {0};
                for (int t = 0; t < n_valid; t++)
                    exl_halves_place(wd, b, exl_cuda_slot_of(b, t), read_code(&pk->src, sg->src_bit[r0 + t], b, n));
                for (int w = 0; w < b; w++)
                    *word_at(pk, wr + w, n) = wd[w];
            }
            continue;
        }
        for (int64_t n = 0; n < pk->n; n++) {
            uint64_t acc = 0;
            int have = 0, w = 0;
            for (int t = 0; t < CHUNK; t++) {
                uint64_t code = t < n_valid ? read_code(&pk->src, sg->src_bit[r0 + t], b, n) : 0;
                acc |= code << have;
                have += b;
                if (have >= 32) {
                    *word_at(pk, wr + w++, n) = (uint32_t)acc;
                    acc >>= 32;
                    have -= 32;
                }
            }
        }
    }
}

static int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

/* ---- building the segments of each format */

typedef struct {
    int n_segments;
    segment *seg;
    int64_t *bits_buf;
    int32_t *rows_buf;
    int64_t total_chunks, total_word_rows;
    int n_groups;
    uint16_t *scales; /* host fp16 [n_groups, n_pad] */
    uint16_t *zeros;  /* host fp16 [n_groups, n_pad] or NULL */
} layout;

static void layout_free(layout *l) {
    free(l->seg);
    free(l->bits_buf);
    free(l->rows_buf);
    free(l->scales);
    free(l->zeros);
}

static void count_chunks(layout *l) {
    for (int i = 0; i < l->n_segments; i++) {
        int64_t c = (l->seg[i].n_rows + CHUNK - 1) / CHUNK;
        l->total_chunks += c;
        l->total_word_rows += c * l->seg[i].bits;
    }
}

static exl_status exl2_layout(const exl_linear_src *src, int64_t n_pad, layout *l, stream_src *ss) {
    const exl_exl2_src *e = &src->exl2;
    const char *name = src->name ? src->name : "linear";
    int64_t K = src->in_features, N = src->out_features;
    int G = e->n_groups;
    if (G < 1 || e->n_padded < N || e->n_padded % 8 || e->q_rows < 1)
        return exl_cuda_fail(EXL_ERR_FORMAT, "%s: inconsistent EXL2 shapes", name);
    l->seg = (segment *)calloc((size_t)G, sizeof *l->seg);
    l->bits_buf = (int64_t *)malloc((size_t)K * sizeof(int64_t));
    l->rows_buf = (int32_t *)malloc((size_t)K * sizeof(int32_t));
    l->scales = (uint16_t *)calloc((size_t)G * n_pad, sizeof(uint16_t));
    if (!l->seg || !l->bits_buf || !l->rows_buf || !l->scales)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    /* perm = argsort(q_invperm): stream row r holds input feature perm[r] */
    for (int64_t k = 0; k < K; k++)
        l->rows_buf[k] = -1;
    for (int64_t k = 0; k < K; k++) {
        int32_t r = e->q_invperm[k];
        if (r < 0 || r >= K || l->rows_buf[r] != -1)
            return exl_cuda_fail(EXL_ERR_FORMAT, "%s: q_invperm is not a permutation", name);
        l->rows_buf[r] = (int32_t)k;
    }
    exl_exl2_group g = EXL_EXL2_WALK;
    while (exl_exl2_next_group(e, &g)) {
        int b = g.bits;
        if (b != 2 && b != 3 && b != 4 && b != 5 && b != 6 && b != 8)
            return exl_cuda_fail(EXL_ERR_FORMAT, "%s: group %d has %d bits", name, g.index, b);
        if (g.q_end <= g.q_row || g.q_end > e->q_rows || ((g.q_end - g.q_row) * 32) % b)
            return exl_cuda_fail(EXL_ERR_FORMAT, "%s: group %d has a bad q_weight row range", name, g.index);
        if (g.row + g.n_rows > K)
            return exl_cuda_fail(EXL_ERR_FORMAT, "%s: groups hold more rows than the %lld inputs", name, (long long)K);
        segment *s = &l->seg[l->n_segments++];
        s->bits = b;
        s->group = g.index;
        s->n_rows = g.n_rows;
        s->src_bit = l->bits_buf + g.row;
        s->src_row = l->rows_buf + g.row;
        for (int64_t j = 0; j < g.n_rows; j++)
            l->bits_buf[g.row + j] = g.q_row * 32 + j * b;
        for (int64_t n = 0; n < N; n++)
            l->scales[(int64_t)g.index * n_pad + n] = exl_exl2_scale_f16(e->q_scale_max[g.index],
                                                                         exl_exl2_scale_code(e, g.index, n));
    }
    if (g.row != K) /* the walk's row: every group's rows */
        return exl_cuda_fail(EXL_ERR_FORMAT, "%s: groups hold %lld rows, expected %lld", name, (long long)g.row,
                             (long long)K);
    l->n_groups = G;
    ss->words = (const uint32_t *)e->q_weight;
    ss->stride = e->n_padded;
    return EXL_OK;
}

static exl_status gptq_layout(const exl_linear_src *src, int64_t n_pad, layout *l, stream_src *ss) {
    const exl_gptq_src *q = &src->gptq;
    const char *name = src->name ? src->name : "linear";
    int64_t K = src->in_features, N = src->out_features;
    int G = q->n_groups, b = q->bits;
    if (b != 2 && b != 3 && b != 4 && b != 8)
        return exl_cuda_fail(EXL_ERR_UNSUPPORTED, "%s: GPTQ with %d bits is not supported", name, b);
    if (G < 1 || (!q->g_idx && q->group_size < 1))
        return exl_cuda_fail(EXL_ERR_FORMAT, "%s: inconsistent GPTQ groups", name);
    l->seg = (segment *)calloc((size_t)G, sizeof *l->seg);
    l->bits_buf = (int64_t *)malloc((size_t)K * sizeof(int64_t));
    l->rows_buf = (int32_t *)malloc((size_t)K * sizeof(int32_t));
    l->scales = (uint16_t *)calloc((size_t)G * n_pad, sizeof(uint16_t));
    l->zeros = (uint16_t *)calloc((size_t)G * n_pad, sizeof(uint16_t));
    int64_t *start = (int64_t *)calloc((size_t)G + 1, sizeof(int64_t));
    if (!l->seg || !l->bits_buf || !l->rows_buf || !l->scales || !l->zeros || !start) {
        free(start);
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    }
    /* counting sort of the rows by group (stable: keeps the file order inside a group) */
    for (int64_t k = 0; k < K; k++) {
        int64_t g = q->g_idx ? q->g_idx[k] : k / q->group_size;
        if (g < 0 || g >= G) {
            free(start);
            return exl_cuda_fail(EXL_ERR_FORMAT, "%s: row %lld is in group %lld of %d", name, (long long)k,
                                 (long long)g, G);
        }
        start[g + 1]++;
    }
    for (int g = 0; g < G; g++)
        start[g + 1] += start[g];
    for (int64_t k = 0; k < K; k++) {
        int64_t g = q->g_idx ? q->g_idx[k] : k / q->group_size;
        int64_t at = start[g]++;
        l->rows_buf[at] = (int32_t)k;
        l->bits_buf[at] = k * b;
    }
    int64_t row = 0;
    for (int g = 0; g < G; g++) {
        int64_t rows = start[g] - row; /* start[g] now points past group g */
        if (rows > 0) {
            segment *s = &l->seg[l->n_segments++];
            s->bits = b;
            s->group = g;
            s->n_rows = rows;
            s->src_bit = l->bits_buf + row;
            s->src_row = l->rows_buf + row;
        }
        row = start[g];
        stream_src zs = {(const uint32_t *)q->qzeros + (int64_t)g * (N * b / 32), 1};
        for (int64_t n = 0; n < N; n++) {
            l->scales[(int64_t)g * n_pad + n] = q->scales[(int64_t)g * N + n];
            uint32_t z = read_code(&zs, n * b, b, 0) + (uint32_t)q->zero_offset;
            l->zeros[(int64_t)g * n_pad + n] = exl_f32_to_f16((float)z);
        }
    }
    free(start);
    l->n_groups = G;
    ss->words = (const uint32_t *)q->qweight;
    ss->stride = N;
    return EXL_OK;
}

/* ---- upload */

static exl_status upload(void **dst, const void *src, size_t bytes, const char *what) {
    EXL_TRY(exl_cuda_malloc(dst, bytes, what));
    CUDA_CHECK(cudaMemcpy(*dst, src, bytes, cudaMemcpyHostToDevice), what);
    return EXL_OK;
}

/* slot_of (exl_qmatrix) from slot_src, when the K slots hold each input row once (else none) */
static exl_status upload_slot_of(int32_t **dst, const int32_t *slot_src, int64_t K, const char *what) {
    int32_t *inv = (int32_t *)malloc((size_t)K * sizeof(int32_t));
    if (!inv)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory repacking %s", what);
    for (int64_t r = 0; r < K; r++)
        inv[r] = -1;
    int ok = 1;
    for (int64_t s = 0; s < K && ok; s++) {
        const int32_t r = slot_src[s];
        ok = r >= 0 && r < K && inv[r] < 0;
        if (ok)
            inv[r] = (int32_t)s;
    }
    exl_status st = ok ? upload((void **)dst, inv, (size_t)K * sizeof(int32_t), what) : EXL_OK;
    free(inv);
    return st;
}

exl_status exl_cuda_qmatrix_init(exl_cuda_backend *cb, const exl_linear_src *src, exl_qmatrix *q) {
    memset(q, 0, sizeof *q);
    const char *name = src->name ? src->name : "linear";
    int64_t N = src->out_features, n_pad = round_up(N, EXL_QW_TILE);
    layout l;
    memset(&l, 0, sizeof l);
    stream_src ss;
    exl_status st = src->kind == EXL_LINEAR_EXL2 ? exl2_layout(src, n_pad, &l, &ss) : gptq_layout(src, n_pad, &l, &ss);
    if (st != EXL_OK) {
        layout_free(&l);
        return st;
    }
    count_chunks(&l);
    packer pk;
    memset(&pk, 0, sizeof pk);
    pk.n = N;
    pk.n_pad = n_pad;
    pk.total_word_rows = l.total_word_rows;
    pk.src = ss;
    pk.qw = (uint32_t *)calloc((size_t)(l.total_word_rows * n_pad), sizeof(uint32_t));
    pk.chunks = (int4 *)malloc((size_t)l.total_chunks * sizeof(int4));
    pk.slot_src = (int32_t *)malloc((size_t)l.total_chunks * CHUNK * sizeof(int32_t));
    if (!pk.qw || !pk.chunks || !pk.slot_src) {
        st = exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory repacking %s", name);
    } else {
        for (int i = 0; i < l.n_segments; i++)
            pack_segment(&pk, &l.seg[i]);
        q->n_chunks = (int32_t)pk.n_chunks;
        q->n_pad = (int32_t)n_pad;
        q->n_groups = l.n_groups;
        q->word_rows = (int32_t)pk.word_rows;
        st = upload((void **)&q->qw, pk.qw, (size_t)pk.word_rows * n_pad * sizeof(uint32_t), name);
        if (st == EXL_OK)
            st = upload((void **)&q->chunks, pk.chunks, (size_t)pk.n_chunks * sizeof(int4), name);
        if (st == EXL_OK)
            st = upload((void **)&q->slot_src, pk.slot_src, (size_t)pk.n_chunks * CHUNK * sizeof(int32_t), name);
        if (st == EXL_OK && pk.n_chunks * CHUNK == src->in_features)
            st = upload_slot_of(&q->slot_of, pk.slot_src, src->in_features, name);
        if (st == EXL_OK)
            st = upload((void **)&q->scales, l.scales, (size_t)l.n_groups * n_pad * sizeof(uint16_t), name);
        if (st == EXL_OK && l.zeros)
            st = upload((void **)&q->zeros, l.zeros, (size_t)l.n_groups * n_pad * sizeof(uint16_t), name);
    }
    free(pk.qw);
    free(pk.chunks);
    free(pk.slot_src);
    layout_free(&l);
    if (st != EXL_OK)
        exl_cuda_qmatrix_free(q);
    return st;
}

void exl_cuda_qmatrix_free(exl_qmatrix *q) {
    cudaFree(q->slot_of);
    cudaFree(q->qw);
    cudaFree(q->chunks);
    cudaFree(q->scales);
    cudaFree(q->zeros);
    cudaFree(q->slot_src);
    memset(q, 0, sizeof *q);
}
