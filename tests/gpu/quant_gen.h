/* quant_gen.h - random EXL2 / GPTQ matrices in the file layouts of docs/formats.md, and a
 * plain reference dequantization written straight from that document (no code shared with
 * the backends). Used by the GPU op test and the GPU benchmark. */
#ifndef EXL_TESTS_GPU_QUANT_GEN_H
#define EXL_TESTS_GPU_QUANT_GEN_H

#include "backend/backend.h"
#include "base/half.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t qg_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static inline float qg_uniform(uint64_t *s) { return (float)((qg_next(s) >> 40) * (1.0 / 16777216.0)); }

/* A linear source owning its host buffers. */
typedef struct qgen {
    exl_linear_src src;
    void *buf[8];
} qgen;

static inline void qgen_free(qgen *g) {
    for (int i = 0; i < 8; i++)
        free(g->buf[i]);
    memset(g, 0, sizeof *g);
}

static inline void qg_fill_words(uint32_t *w, size_t n, uint64_t *s) {
    for (size_t i = 0; i < n; i++)
        w[i] = (uint32_t)qg_next(s);
}

/* EXL2 with the given groups (bits descending as the converter writes them; rows each). */
static inline void qgen_exl2(qgen *g, int32_t K, int32_t N, int n_groups, const int *bits, const int *rows,
                             uint64_t *s) {
    memset(g, 0, sizeof *g);
    int32_t np = (N + 31) / 32 * 32, q_rows = 0;
    for (int i = 0; i < n_groups; i++)
        q_rows += rows[i] * bits[i] / 32;
    int32_t *qw = malloc((size_t)q_rows * np * 4), *inv = malloc((size_t)K * 4);
    int32_t *qs = malloc((size_t)n_groups * (np / 8) * 4);
    uint16_t *qmax = malloc((size_t)n_groups * 2);
    int16_t *qg = malloc((size_t)n_groups * 4);
    qg_fill_words((uint32_t *)qw, (size_t)q_rows * np, s);
    qg_fill_words((uint32_t *)qs, (size_t)n_groups * (np / 8), s);
    for (int32_t k = 0; k < K; k++)
        inv[k] = k;
    for (int32_t k = K - 1; k > 0; k--) {
        int32_t j = (int32_t)(qg_next(s) % (uint64_t)(k + 1)), t = inv[k];
        inv[k] = inv[j];
        inv[j] = t;
    }
    for (int i = 0, q0 = 0; i < n_groups; i++) {
        qmax[i] = exl_f32_to_f16(0.004f + 0.004f * qg_uniform(s));
        qg[2 * i] = (int16_t)bits[i];
        qg[2 * i + 1] = (int16_t)q0;
        q0 += rows[i] * bits[i] / 32;
    }
    g->buf[0] = qw, g->buf[1] = inv, g->buf[2] = qs, g->buf[3] = qmax, g->buf[4] = qg;
    g->src.kind = EXL_LINEAR_EXL2;
    g->src.in_features = K;
    g->src.out_features = N;
    g->src.exl2 = (exl_exl2_src){qw, inv, qs, qmax, qg, q_rows, np, n_groups};
    g->src.name = "random exl2";
}

/* GPTQ, `bits` wide, groups of group_size; act_order: a random g_idx (each group still
 * group_size rows); zero_offset 1 (v1) or 0 (v2). */
static inline void qgen_gptq(qgen *g, int32_t K, int32_t N, int bits, int group_size, int act_order, int zero_offset,
                             uint64_t *s) {
    memset(g, 0, sizeof *g);
    int G = (K + group_size - 1) / group_size;
    int32_t *qw = malloc((size_t)K * bits / 32 * N * 4), *qz = malloc((size_t)G * N * bits / 32 * 4);
    uint16_t *sc = malloc((size_t)G * N * 2);
    int32_t *gi = act_order ? malloc((size_t)K * 4) : NULL;
    qg_fill_words((uint32_t *)qw, (size_t)K * bits / 32 * N, s);
    qg_fill_words((uint32_t *)qz, (size_t)G * N * bits / 32, s);
    for (size_t i = 0; i < (size_t)G * N; i++)
        sc[i] = exl_f32_to_f16((0.02f + 0.04f * qg_uniform(s)) / (float)(1 << (bits - 1)));
    if (gi) {
        for (int32_t k = 0; k < K; k++)
            gi[k] = k / group_size;
        for (int32_t k = K - 1; k > 0; k--) {
            int32_t j = (int32_t)(qg_next(s) % (uint64_t)(k + 1)), t = gi[k];
            gi[k] = gi[j];
            gi[j] = t;
        }
    }
    g->buf[0] = qw, g->buf[1] = qz, g->buf[2] = sc, g->buf[3] = gi;
    g->src.kind = EXL_LINEAR_GPTQ;
    g->src.in_features = K;
    g->src.out_features = N;
    g->src.gptq = (exl_gptq_src){qw, qz, sc, gi, bits, group_size, G, zero_offset};
    g->src.name = "random gptq";
}

/* b bits at stream bit `bit` of a column whose word w lies at words[w * stride]. */
static inline uint32_t qref_bits(const int32_t *words, int64_t stride, int64_t bit, int b) {
    uint64_t lo = (uint32_t)words[(bit / 32) * stride];
    uint64_t hi = (bit % 32) + b > 32 ? (uint32_t)words[(bit / 32 + 1) * stride] : 0;
    return (uint32_t)(((lo | hi << 32) >> (bit % 32)) & ((1u << b) - 1));
}

/* The dense [K, N] matrix W (row k = input feature k) of a quantized source, in fp32. */
static inline float *qref_dequant(const exl_linear_src *s) {
    int64_t K = s->in_features, N = s->out_features;
    float *w = malloc((size_t)(K * N) * sizeof(float));
    if (s->kind == EXL_LINEAR_EXL2) {
        const exl_exl2_src *e = &s->exl2;
        for (int64_t k = 0; k < K; k++) {
            int64_t r = e->q_invperm[k], start = 0;
            int g = 0, b = 0;
            for (;; g++) {
                b = e->q_groups[2 * g];
                int q1 = g + 1 < e->n_groups ? e->q_groups[2 * g + 3] : e->q_rows;
                int64_t n_rows = (int64_t)(q1 - e->q_groups[2 * g + 1]) * 32 / b;
                if (r < start + n_rows)
                    break;
                start += n_rows;
            }
            int64_t bit = (int64_t)e->q_groups[2 * g + 1] * 32 + (r - start) * b;
            float base = exl_f16_to_f32(exl_f32_to_f16(exl_f16_to_f32(e->q_scale_max[g]) / 256.0f));
            for (int64_t n = 0; n < N; n++) {
                uint32_t q = qref_bits(e->q_weight + n, e->n_padded, bit, b);
                uint32_t c = ((uint32_t)e->q_scale[g * (e->n_padded / 8) + n / 8] >> (4 * (n % 8))) & 15u;
                float scale = exl_f16_to_f32(exl_f32_to_f16(base * (float)((c + 1) * (c + 1))));
                w[k * N + n] = ((float)q - (float)(1 << (b - 1))) * scale;
            }
        }
    } else {
        const exl_gptq_src *q = &s->gptq;
        int b = q->bits;
        for (int64_t k = 0; k < K; k++) {
            int64_t g = q->g_idx ? q->g_idx[k] : k / q->group_size;
            for (int64_t n = 0; n < N; n++) {
                uint32_t code = qref_bits(q->qweight + n, N, k * b, b);
                uint32_t z = qref_bits(q->qzeros + g * (N * b / 32), 1, n * b, b) + (uint32_t)q->zero_offset;
                w[k * N + n] = ((float)code - (float)z) * exl_f16_to_f32(q->scales[g * N + n]);
            }
        }
    }
    return w;
}

#endif
