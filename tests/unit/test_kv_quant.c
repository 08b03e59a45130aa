/* test_kv_quant.c - the quantized KV cache format on the CPU backend's ops: kv_store writes what
 * backend/kv_quant.h describes (read back here by a decoder of its own: nearest codes, scales from the group's
 * largest value), and attention over such a cache equals attention over the decoded keys and values, computed in
 * double, with the step's own rows exact; for every width and mixed widths, prefill and decode in one batch, with and
 * without soft-capped scores (Gemma 2). */
#include "backend/backend.h"
#include "backend/kv_quant.h"
#include "base/alloc.h"
#include "base/half.h"
#include "test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { KV_HEADS = 2, HEADS = 4, HD = 64, WIDTH = KV_HEADS * HD, PAGE = 4, PAGES = 16 };

static float rnd(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return (float)((*x >> 11) * 0x1.0p-53 * 2 - 1);
}

/* y = H x over n values, in double (the format's rotation) */
static void hadamard_ref(const float *x, int n, double *y) {
    for (int i = 0; i < n; i++) {
        double s = 0;
        for (int j = 0; j < n; j++)
            s += (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) * x[j];
        y[i] = s / sqrt((double)n);
    }
}

/* value i of a quantized slot, still rotated: (c - z) s */
static double code_value(const unsigned char *slot, int bits, int group, int i) {
    int64_t bit = (int64_t)i * bits;
    uint32_t w = slot[bit / 8] | (uint32_t)slot[bit / 8 + 1] << 8;
    uint32_t c = (w >> (bit % 8)) & ((1u << bits) - 1);
    uint16_t h;
    memcpy(&h, slot + exl_kv_codes_bytes(WIDTH, bits) + 2 * (i / group), 2);
    return ((double)c - 0.5 * ((1 << bits) - 1)) * exl_f16_to_f32(h);
}

/* the row a slot holds, decoded: x = H y group by group (or the fp32 or fp16 row at full precision) */
static void decode_row(const unsigned char *slot, int bits, int group, size_t elem_bytes, double *x) {
    if (!exl_kv_quantized(bits)) {
        for (int i = 0; i < WIDTH; i++)
            x[i] = elem_bytes == 2 ? exl_f16_to_f32(((const uint16_t *)(const void *)slot)[i])
                                   : ((const float *)(const void *)slot)[i];
        return;
    }
    for (int g = 0; g < WIDTH; g += group) {
        float y[EXL_KV_MAX_GROUP] = {0};
        double back[EXL_KV_MAX_GROUP];
        for (int i = 0; i < group; i++)
            y[i] = (float)code_value(slot, bits, group, g + i);
        hadamard_ref(y, group, back);
        for (int i = 0; i < group; i++)
            x[g + i] = back[i];
    }
}

typedef struct fixture {
    exl_backend *be;
    void *k_cache, *v_cache;
    size_t k_slot, v_slot;
    exl_kv_format fmt;
} fixture;

/* a CPU backend of n_threads with its full-precision cache in fp16 (kv16) or fp32 */
static exl_backend *cpu_backend(int n_threads, int kv16) {
    exl_backend *be = NULL;
    setenv("EXL_CPU_KV", kv16 ? "fp16" : "fp32", 1);
    exl_status st = exl_backend_cpu_init(n_threads, &be);
    unsetenv("EXL_CPU_KV");
    return st == EXL_OK ? be : NULL;
}

static int fixture_init(fixture *f, int k_bits, int v_bits, int kv16) {
    memset(f, 0, sizeof *f);
    if (!(f->be = cpu_backend(1, kv16)))
        return -1;
    f->fmt = (exl_kv_format){k_bits, v_bits, exl_kv_group(HD)};
    f->k_slot = exl_kv_slot_bytes(WIDTH, k_bits, f->fmt.group, f->be->kv_elem_bytes);
    f->v_slot = exl_kv_slot_bytes(WIDTH, v_bits, f->fmt.group, f->be->kv_elem_bytes);
    f->k_cache = exl_calloc((size_t)PAGES * PAGE, f->k_slot);
    f->v_cache = exl_calloc((size_t)PAGES * PAGE, f->v_slot);
    return f->k_cache && f->v_cache ? 0 : -1;
}

static void fixture_free(fixture *f) {
    exl_free(f->k_cache);
    exl_free(f->v_cache);
    if (f->be)
        f->be->ops->destroy(f->be);
}

/* rows [n, WIDTH] into the slots */
static void store(fixture *f, const float *k, const float *v, const int32_t *slots, int32_t n) {
    exl_batch b = {.n_rows = n, .slots = slots, .d_slots = slots, .kv = f->fmt};
    f->be->ops->kv_store(f->be, f->k_cache, f->v_cache, k, v, &b, WIDTH);
}

EXL_TEST(store_writes_nearest_codes) {
    static const int widths[] = {8, 6, 4};
    uint64_t seed = 7;
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        const int bits = widths[w], top = (1 << bits) - 1;
        fixture f;
        REQUIRE(fixture_init(&f, bits, bits, 0) == 0);
        float k[3][WIDTH], v[3][WIDTH];
        for (int r = 0; r < 3; r++)
            for (int i = 0; i < WIDTH; i++) {
                k[r][i] = rnd(&seed) * (i == 5 ? 20.0f : 1.0f); /* an outlier in one group */
                v[r][i] = r == 2 ? 0.0f : rnd(&seed);           /* an all-zero row */
            }
        const int32_t slots[3] = {9, 0, 33};
        store(&f, &k[0][0], &v[0][0], slots, 3);
        const int G = f.fmt.group;
        double worst = 0;
        for (int r = 0; r < 3; r++)
            for (int side = 0; side < 2; side++) {
                const float *x = side ? v[r] : k[r];
                const unsigned char *slot = side ? (unsigned char *)f.v_cache + slots[r] * f.v_slot
                                                 : (unsigned char *)f.k_cache + slots[r] * f.k_slot;
                for (int g = 0; g < WIDTH; g += G) {
                    double y[EXL_KV_MAX_GROUP], mx = 0;
                    hadamard_ref(x + g, G, y);
                    for (int i = 0; i < G; i++)
                        mx = fabs(y[i]) > mx ? fabs(y[i]) : mx;
                    uint16_t h;
                    memcpy(&h, slot + exl_kv_codes_bytes(WIDTH, bits) + 2 * (g / G), 2);
                    double s = exl_f16_to_f32(h), want = 2 * mx / top;
                    CHECK_MSG(fabs(s - want) <= want * 1e-3 + 1e-7, "%d bits: scale %g, want %g", bits, s, want);
                    for (int i = 0; i < G; i++) {
                        double err = fabs(code_value(slot, bits, G, g + i) - y[i]);
                        CHECK_MSG(err <= 0.5 * s * (1 + 1e-4) + 1e-6, "%d bits: value off by %g (scale %g)", bits, err,
                                  s);
                        worst = err > worst ? err : worst;
                    }
                }
            }
        CHECK(worst > 0);
        fixture_free(&f);
    }
}

/* Two sequences in one step: 5 cached tokens and 3 new ones, 18 cached and 1 new; pages scattered. */
typedef struct scene {
    exl_attn_seq seqs[2];
    int32_t pages[12], slots[4], pos[4];
    float past_k[23][WIDTH], past_v[23][WIDTH]; /* the cached tokens: seq 0's 5, then seq 1's 18 */
    float k[4][WIDTH], v[4][WIDTH], q[4][HEADS * HD];
} scene;

static int32_t slot_of(const scene *s, int seq, int t) {
    const int32_t *pages = s->pages + s->seqs[seq].page_start;
    return pages[t / PAGE] * PAGE + t % PAGE;
}

static void scene_init(scene *s, uint64_t seed) {
    static const int32_t pages[12] = {7, 2, 11, 0, 5, 9, 14, 3, 12, 1, 8, 15};
    memcpy(s->pages, pages, sizeof pages);
    s->seqs[0] = (exl_attn_seq){0, 3, 8, 0};
    s->seqs[1] = (exl_attn_seq){3, 1, 19, 2};
    for (int t = 0; t < 23; t++)
        for (int i = 0; i < WIDTH; i++)
            s->past_k[t][i] = rnd(&seed) * 2, s->past_v[t][i] = rnd(&seed);
    for (int r = 0; r < 4; r++) {
        for (int i = 0; i < WIDTH; i++)
            s->k[r][i] = rnd(&seed) * 2, s->v[r][i] = rnd(&seed);
        for (int i = 0; i < HEADS * HD; i++)
            s->q[r][i] = rnd(&seed);
    }
    for (int r = 0; r < 4; r++) {
        int seq = r < 3 ? 0 : 1, t = r < 3 ? 5 + r : 18;
        s->slots[r] = slot_of(s, seq, t);
        s->pos[r] = t;
    }
}

/* attention of row r, head h in double over the decoded cache and the exact new rows; scores soft-capped at cap > 0 */
static void reference(const fixture *f, const scene *s, int r, int h, double cap, double *out) {
    const int seq = r < 3 ? 0 : 1, kvh = h / (HEADS / KV_HEADS);
    const exl_attn_seq *sq = &s->seqs[seq];
    const int fresh = sq->n_kv - sq->n_q, last = fresh + r - sq->q_start;
    double score[32], kx[WIDTH], vx[32][WIDTH], m = -INFINITY, l = 0;
    for (int t = 0; t <= last; t++) {
        if (t >= fresh) {
            const int row = sq->q_start + t - fresh;
            for (int i = 0; i < WIDTH; i++)
                kx[i] = s->k[row][i], vx[t][i] = s->v[row][i];
        } else {
            const int32_t slot = slot_of(s, seq, t);
            decode_row((const unsigned char *)f->k_cache + slot * f->k_slot, f->fmt.k_bits, f->fmt.group,
                       f->be->kv_elem_bytes, kx);
            decode_row((const unsigned char *)f->v_cache + slot * f->v_slot, f->fmt.v_bits, f->fmt.group,
                       f->be->kv_elem_bytes, vx[t]);
        }
        double d = 0;
        for (int i = 0; i < HD; i++)
            d += s->q[r][h * HD + i] * kx[kvh * HD + i];
        score[t] = d / sqrt((double)HD);
        if (cap > 0)
            score[t] = cap * tanh(score[t] / cap);
        m = score[t] > m ? score[t] : m;
    }
    for (int i = 0; i < HD; i++)
        out[i] = 0;
    for (int t = 0; t <= last; t++) {
        double p = exp(score[t] - m);
        l += p;
        for (int i = 0; i < HD; i++)
            out[i] += p * vx[t][kvh * HD + i];
    }
    for (int i = 0; i < HD; i++)
        out[i] /= l;
}

/* the scene's cached tokens and new rows stored in f's cache, then attention of the new rows into out */
static void attend(fixture *f, scene *s, float cap, float out[4][HEADS * HD]) {
    int32_t past_slots[23];
    for (int t = 0; t < 23; t++)
        past_slots[t] = slot_of(s, t < 5 ? 0 : 1, t < 5 ? t : t - 5);
    store(f, &s->past_k[0][0], &s->past_v[0][0], past_slots, 23);
    store(f, &s->k[0][0], &s->v[0][0], s->slots, 4);
    exl_batch b = {.n_rows = 4,
                   .n_seqs = 2,
                   .max_q = 3,
                   .max_kv = 19,
                   .seqs = s->seqs,
                   .pos = s->pos,
                   .slots = s->slots,
                   .d_seqs = s->seqs,
                   .d_pos = s->pos,
                   .d_slots = s->slots,
                   .d_page_tables = s->pages,
                   .kv = f->fmt};
    exl_attn_shape sh = {HEADS, KV_HEADS, HD, PAGE, 0, 1.0f / sqrtf((float)HD), cap};
    f->be->ops->attention(f->be, &out[0][0], &s->q[0][0], &s->k[0][0], &s->v[0][0], f->k_cache, f->v_cache, &b, &sh);
}

/* the largest difference of out from the reference over the decoded cache */
static double off_reference(const fixture *f, const scene *s, double cap, float out[4][HEADS * HD]) {
    double worst = 0;
    for (int r = 0; r < 4; r++)
        for (int h = 0; h < HEADS; h++) {
            double want[HD];
            reference(f, s, r, h, cap, want);
            for (int i = 0; i < HD; i++)
                worst = fmax(worst, fabs(out[r][h * HD + i] - want[i]));
        }
    return worst;
}

/* for every format, with the full-precision side fp32 and fp16 (whose cache holds the step's own rows rounded: the
 * scene's new rows are fp16 values there, so that the reference's exact rows are what the cache holds) */
EXL_TEST(attention_reads_quantized_slots) {
    static const int formats[][2] = {{16, 16}, {8, 8}, {6, 6}, {4, 4}, {8, 4}, {16, 4}, {4, 16}, {6, 8}};
    scene *s = malloc(sizeof *s);
    REQUIRE(s);
    for (int kv16 = 0; kv16 <= 1; kv16++) {
        scene_init(s, 3);
        for (int r = 0; kv16 && r < 4; r++)
            for (int i = 0; i < WIDTH; i++) {
                s->k[r][i] = exl_f16_to_f32(exl_f32_to_f16(s->k[r][i]));
                s->v[r][i] = exl_f16_to_f32(exl_f32_to_f16(s->v[r][i]));
            }
        for (size_t fi = 0; fi < sizeof formats / sizeof formats[0]; fi++) {
            fixture f;
            REQUIRE(fixture_init(&f, formats[fi][0], formats[fi][1], kv16) == 0);
            float out[4][HEADS * HD];
            attend(&f, s, 0.0f, out);
            double worst = off_reference(&f, s, 0, out);
            CHECK_MSG(worst < 2e-5, "K%d/V%d (%s): attention off by %g", formats[fi][0], formats[fi][1],
                      kv16 ? "fp16" : "fp32", worst);
            fixture_free(&f);
        }
    }
    free(s);
}

/* Gemma 2's soft-capped scores (a cap below most scores here, so that it bites): over an 8-bit cache as over the
 * decoded one, and close to the same attention over the unquantized cache, which the cap changes. */
EXL_TEST(softcapped_attention_over_an_8_bit_cache) {
    const float cap = 0.5f;
    scene *s = malloc(sizeof *s);
    REQUIRE(s);
    scene_init(s, 5);
    fixture q8, full;
    REQUIRE(fixture_init(&q8, 8, 8, 0) == 0);
    REQUIRE(fixture_init(&full, 16, 16, 0) == 0);
    float out8[4][HEADS * HD], out16[4][HEADS * HD], uncapped[4][HEADS * HD];
    attend(&q8, s, cap, out8);
    attend(&full, s, cap, out16);
    attend(&full, s, 0.0f, uncapped);
    double worst8 = off_reference(&q8, s, cap, out8), worst16 = off_reference(&full, s, cap, out16);
    double apart = 0, capped_by = 0;
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < HEADS * HD; i++) {
            apart = fmax(apart, fabs(out8[r][i] - out16[r][i]));
            capped_by = fmax(capped_by, fabs(out16[r][i] - uncapped[r][i]));
        }
    CHECK_MSG(worst8 < 2e-5 && worst16 < 2e-5, "soft-capped attention off by %g (8-bit), %g (fp32)", worst8, worst16);
    CHECK_MSG(apart < 1e-2, "8-bit cache %g from the unquantized one", apart);
    CHECK_MSG(capped_by > 10 * apart, "the cap moves attention by %g only (8-bit error %g)", capped_by, apart);
    fixture_free(&q8);
    fixture_free(&full);
    free(s);
}

/* Decode over a long fp16 cache, where the row's keys are split into sequence blocks among the threads and merged:
 * one row at position 299 of a paged sequence, against double over the fp16 values, with and without a soft cap;
 * and close to the same attention over the fp32 cache. */
EXL_TEST(fp16_cache_decode_over_a_long_context) {
    enum { T = 300, LPAGE = 16, LPAGES = 20 };
    float *k = malloc(sizeof(float) * T * WIDTH), *v = malloc(sizeof(float) * T * WIDTH);
    int32_t pages[LPAGES], slots[T], pos = T - 1;
    REQUIRE(k && v);
    uint64_t seed = 11;
    for (int i = 0; i < T * WIDTH; i++)
        k[i] = rnd(&seed) * 2, v[i] = rnd(&seed);
    float q[HEADS * HD];
    for (int i = 0; i < HEADS * HD; i++)
        q[i] = rnd(&seed);
    for (int p = 0; p < LPAGES; p++)
        pages[p] = (p * 7) % LPAGES;
    for (int t = 0; t < T; t++)
        slots[t] = pages[t / LPAGE] * LPAGE + t % LPAGE;
    exl_attn_seq seq = {0, 1, T, 0};
    for (int capped = 0; capped <= 1; capped++) {
        const float cap = capped ? 0.5f : 0.0f;
        float out[2][HEADS * HD];
        for (int kv16 = 0; kv16 <= 1; kv16++) {
            exl_backend *be = cpu_backend(4, kv16);
            REQUIRE(be);
            void *kc = exl_calloc((size_t)LPAGES * LPAGE, WIDTH * be->kv_elem_bytes);
            void *vc = exl_calloc((size_t)LPAGES * LPAGE, WIDTH * be->kv_elem_bytes);
            REQUIRE(kc && vc);
            exl_batch b = {.n_rows = T, .slots = slots, .d_slots = slots};
            be->ops->kv_store(be, kc, vc, k, v, &b, WIDTH);
            b = (exl_batch){.n_rows = 1,
                            .n_seqs = 1,
                            .max_q = 1,
                            .max_kv = T,
                            .seqs = &seq,
                            .pos = &pos,
                            .slots = slots + T - 1,
                            .d_seqs = &seq,
                            .d_pos = &pos,
                            .d_slots = slots + T - 1,
                            .d_page_tables = pages};
            exl_attn_shape sh = {HEADS, KV_HEADS, HD, LPAGE, 0, 1.0f / sqrtf((float)HD), cap};
            be->ops->attention(be, out[kv16], q, k + (T - 1) * WIDTH, v + (T - 1) * WIDTH, kc, vc, &b, &sh);
            exl_free(kc);
            exl_free(vc);
            be->ops->destroy(be);
        }
        double worst = 0, apart = 0;
        for (int h = 0; h < HEADS; h++) {
            const int kvh = h / (HEADS / KV_HEADS);
            double score[T], m = -INFINITY, l = 0, want[HD] = {0};
            for (int t = 0; t < T; t++) {
                double d = 0;
                for (int i = 0; i < HD; i++)
                    d += q[h * HD + i] * (double)exl_f16_to_f32(exl_f32_to_f16(k[t * WIDTH + kvh * HD + i]));
                score[t] = d / sqrt((double)HD);
                if (cap > 0)
                    score[t] = cap * tanh(score[t] / cap);
                m = fmax(m, score[t]);
            }
            for (int t = 0; t < T; t++) {
                double p = exp(score[t] - m);
                l += p;
                for (int i = 0; i < HD; i++)
                    want[i] += p * exl_f16_to_f32(exl_f32_to_f16(v[t * WIDTH + kvh * HD + i]));
            }
            for (int i = 0; i < HD; i++) {
                worst = fmax(worst, fabs(out[1][h * HD + i] - want[i] / l));
                apart = fmax(apart, fabs(out[1][h * HD + i] - out[0][h * HD + i]));
            }
        }
        CHECK_MSG(worst < 2e-5, "fp16 cache%s: attention off by %g", capped ? " (soft cap)" : "", worst);
        CHECK_MSG(apart < 2e-3, "fp16 cache%s: %g from the fp32 cache's attention", capped ? " (soft cap)" : "", apart);
    }
    free(k);
    free(v);
}
