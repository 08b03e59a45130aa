/* qkernels_impl.h - the fused quantized group kernel of qkernels.h, written once over a
 * handful of vector macros; qkernels_scalar.c, _avx2.c and _avx512.c define them and
 * include this file. Not a public header.
 *
 * The macros: VL (lanes), vint / vflt / vmask types, VMASK(n) (first n lanes),
 * VI_LOADM(p, m), VI_SRL / VI_SLL / VI_SRA (by a count, constant or not), VI_AND, VI_OR,
 * VI_XOR, VI_SUB, VI_SET1,
 * VF_CVT (int to float), VF_SET1, VF_FMA(a, b, c) = a*b + c, VF_MUL, VF_SUB, VF_ZERO,
 * VF_LOAD, VF_STORE; QNR, the rows one call handles. Optional: VI_ANDOR and VF_BITS, which
 * turn on the 3-op path for 4-bit chunks (q_chunk4).
 *
 * Shape of the loop: rows whose stream bit is word aligned are taken a chunk at a time
 * (32 / gcd(b, 32) rows in b / gcd(b, 32) words), the chunk unrolled for a constant width
 * so every shift is an immediate; rows before the first aligned bit and after the last
 * whole chunk (only where a GPTQ group run starts mid-word) go one at a time.
 *
 * Codes are used centered, c = code - 2^(b-1), which keeps sum x*c free of the
 * cancellation that sum x*code - zero * sum x would suffer. In a chunk the centering is
 * free: XOR the midpoint bit of every code into the words once, and each field read with
 * a sign-extending shift pair is already code - 2^(b-1). */
#ifndef QKERNEL_NAME
#error "define the vector macros and QKERNEL_NAME before including qkernels_impl.h"
#endif

#define QNV 4            /* vectors per tile */
#define QTILE (QNV * VL) /* columns per tile */
#define QPREFETCH 4      /* chunks ahead to prefetch */
#define QINLINE static inline __attribute__((always_inline))

/* Centered codes (code - 2^(b-1)) at one stream bit position for VL columns, read one at
 * a time: rows outside whole aligned chunks. */
QINLINE vint q_code_any(const int32_t *w, int64_t ld, vmask m, int64_t bit, int B) {
    int64_t wi = bit >> 5;
    int s = (int)(bit & 31);
    vint v = VI_SRL(VI_LOADM(w + wi * ld, m), s);
    if (s + B > 32)
        v = VI_OR(v, VI_SLL(VI_LOADM(w + (wi + 1) * ld, m), 32 - s));
    return VI_SUB(VI_AND(v, VI_SET1((1 << B) - 1)), VI_SET1(1 << (B - 1)));
}

/* Centered code at constant bit `bit` of a chunk whose words were XORed with the midpoint
 * bit of every code: the code's field, sign-extended, is then code - 2^(b-1). */
QINLINE vint q_code_chunk(const vint *wv, int bit, int B) {
    int wi = bit >> 5, s = bit & 31;
    if (s + B <= 32)
        return VI_SRA(VI_SLL(wv[wi * QNV], 32 - B - s), 32 - B);
    vint v = VI_OR(VI_SRL(wv[wi * QNV], s), VI_SLL(wv[(wi + 1) * QNV], 32 - s));
    return VI_SRA(VI_SLL(v, 32 - B), 32 - B);
}

/* Broadcast the activations of one kernel row: xb[r] = x[r][idx], xs[r] += it. */
QINLINE void q_x(int NR, const float *x, int64_t ldx, int64_t idx, vflt *xb, float *xs) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        float xv = x[r * ldx + idx];
        xs[r] += xv;
        xb[r] = VF_SET1(xv);
    }
}

QINLINE void q_fma(int NR, vflt f, const vflt *xb, vflt acc[][QNV], int v) {
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++)
        acc[r][v] = VF_FMA(xb[r], f, acc[r][v]);
}

QINLINE void q_row_any(int B, int NR, const int32_t *w, int64_t ld, const vmask *m, int64_t bit, const float *x,
                       int64_t ldx, int64_t idx, vflt acc[][QNV], float *xs) {
    vflt xb[QNR];
    q_x(NR, x, ldx, idx, xb, xs);
#pragma GCC unroll 4
    for (int v = 0; v < QNV; v++)
        q_fma(NR, VF_CVT(q_code_any(w + v * VL, ld, m[v], bit, B)), xb, acc, v);
}

#ifdef VI_ANDOR
/* A 4-bit chunk (one word, 8 rows) in 3 ops a code instead of shift, shift, convert, FMA:
 * the field at bit s (s <= 16, from the word shifted right 12 for the top three) is
 * masked and OR-ed into the mantissa of 2^23, which as a float is 2^23 + code * 2^s;
 * subtracting 2^23 + 8 * 2^s leaves (code - 8) * 2^s exactly, and the activation comes
 * pre-scaled by 2^-s, so each product, and each FMA, is bit-identical to the generic path.
 * Needs VI_ANDOR(v, m, o) = (v & m) | o and VF_BITS (reinterpret as float). */
QINLINE void q_chunk4(int NR, const int32_t *wc, int64_t ld, const vmask *m, const int32_t *perm, const float *x,
                      int64_t ldx, vflt acc[][QNV], float *xs) {
#pragma GCC unroll 4
    for (int v = 0; v<QNV; v += 64 / (VL * 4)> 0 ? 64 / (VL * 4) : 1)
        __builtin_prefetch(wc + (int64_t)QPREFETCH * ld + v * VL);
    vint lo[QNV], hi[QNV];
#pragma GCC unroll 4
    for (int v = 0; v < QNV; v++) {
        lo[v] = VI_LOADM(wc + v * VL, m[v]);
        hi[v] = VI_SRL(lo[v], 12);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) {
        int s = j < 5 ? 4 * j : 4 * j - 12;
        float down = 1.0f / (float)(1 << s);
        vflt xb[QNR];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float xv = x[r * ldx + perm[j]];
            xs[r] += xv;
            xb[r] = VF_SET1(xv * down);
        }
        vflt magic = VF_SET1(8388608.0f + 8.0f * (float)(1 << s));
#pragma GCC unroll 4
        for (int v = 0; v < QNV; v++)
            q_fma(NR, VF_SUB(VF_BITS(VI_ANDOR(j < 5 ? lo[v] : hi[v], 15 << s, 0x4B000000)), magic), xb, acc, v);
    }
}
#endif

/* One group into out[r][i] += scale[i] * sum x * (code - 2^(b-1) - zero[i]). */
QINLINE void q_group(int B, int NR, const exl_qgroup *g, const int32_t *w, int64_t ld, const vmask *m,
                     const int32_t *perm, const float *x, int64_t ldx, const float *scale, const float *zero,
                     float *out, int64_t lda) {
    vflt acc[QNR][QNV];
    float xs[QNR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; r++) {
        xs[r] = 0;
#pragma GCC unroll 4
        for (int v = 0; v < QNV; v++)
            acc[r][v] = VF_ZERO;
    }
    const int CR = B == 3 || B == 5 ? 32 : B == 6 ? 16 : 32 / B, CW = CR * B / 32; /* rows, words per chunk */
    int32_t flip[5] = {0}; /* per chunk word: the midpoint bit of every code it holds */
    for (int bit = B - 1; bit < CW * 32; bit += B)
        flip[bit >> 5] |= (int32_t)(1u << (bit & 31));
    int64_t row = g->row0, end = g->row0 + g->n_rows, bit = g->bit0;
    for (; row < end && (bit & 31); row++, bit += B)
        q_row_any(B, NR, w, ld, m, bit, x, ldx, perm[row], acc, xs);
    for (; row + CR <= end; row += CR, bit += (int64_t)CR * B) {
        const int32_t *wc = w + (bit >> 5) * ld;
#ifdef VI_ANDOR
        if (B == 4) {
            q_chunk4(NR, wc, ld, m, perm + row, x, ldx, acc, xs);
            continue;
        }
#endif
        /* stream rows are ld words apart: fetch the tile's words QPREFETCH chunks ahead */
#pragma GCC unroll 5
        for (int c = 0; c < CW; c++)
#pragma GCC unroll 4
            for (int v = 0; v<QNV; v += 64 / (VL * 4)> 0 ? 64 / (VL * 4) : 1)
                __builtin_prefetch(wc + ((int64_t)QPREFETCH * CW + c) * ld + v * VL);
        vint wv[5 * QNV];
#pragma GCC unroll 5
        for (int c = 0; c < CW; c++)
#pragma GCC unroll 4
            for (int v = 0; v < QNV; v++)
                wv[c * QNV + v] = VI_XOR(VI_LOADM(wc + c * ld + v * VL, m[v]), VI_SET1(flip[c]));
#pragma GCC unroll 32
        for (int j = 0; j < CR; j++) {
            vflt xb[QNR];
            q_x(NR, x, ldx, perm[row + j], xb, xs);
#pragma GCC unroll 4
            for (int v = 0; v < QNV; v++)
                q_fma(NR, VF_CVT(q_code_chunk(wv + v, j * B, B)), xb, acc, v);
        }
    }
    for (; row < end; row++, bit += B)
        q_row_any(B, NR, w, ld, m, bit, x, ldx, perm[row], acc, xs);
#pragma GCC unroll 4
    for (int v = 0; v < QNV; v++) {
        vflt sc = VF_LOAD(scale + v * VL), z = VF_LOAD(zero + v * VL);
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) {
            float *o = out + r * lda + v * VL;
            VF_STORE(o, VF_FMA(sc, VF_SUB(acc[r][v], VF_MUL(z, VF_SET1(xs[r]))), VF_LOAD(o)));
        }
    }
}

/* One instantiation per (width, rows) pair, so all shifts and loop bounds are constants. */
#define Q_WIDTHS(NR)                                                                                                   \
    static void q_group_nr##NR(const exl_qgroup *g, const int32_t *w, int64_t ld, const vmask *m, const int32_t *perm, \
                               const float *x, int64_t ldx, const float *scale, const float *zero, float *out,         \
                               int64_t lda) {                                                                          \
        switch (g->bits) {                                                                                             \
        case 2: q_group(2, NR, g, w, ld, m, perm, x, ldx, scale, zero, out, lda); break;                               \
        case 3: q_group(3, NR, g, w, ld, m, perm, x, ldx, scale, zero, out, lda); break;                               \
        case 4: q_group(4, NR, g, w, ld, m, perm, x, ldx, scale, zero, out, lda); break;                               \
        case 5: q_group(5, NR, g, w, ld, m, perm, x, ldx, scale, zero, out, lda); break;                               \
        case 6: q_group(6, NR, g, w, ld, m, perm, x, ldx, scale, zero, out, lda); break;                               \
        default: q_group(8, NR, g, w, ld, m, perm, x, ldx, scale, zero, out, lda); break;                              \
        }                                                                                                              \
    }

Q_WIDTHS(1)
#if QNR >= 2
Q_WIDTHS(2)
#endif
#if QNR >= 4
Q_WIDTHS(4)
#endif

static void q_group_any(const exl_qgroup *g, const int32_t *words, int64_t ld, int width, const int32_t *perm,
                        const float *x, int64_t ldx, int nr, const float *scale, const float *zero, float *acc,
                        int64_t lda) {
    vmask m[QNV];
    for (int v = 0; v < QNV; v++)
        m[v] = VMASK(width - v * VL);
    int r = 0;
#if QNR >= 4
    for (; r + 4 <= nr; r += 4)
        q_group_nr4(g, words, ld, m, perm, x + r * ldx, ldx, scale, zero, acc + r * lda, lda);
#endif
#if QNR >= 2
    for (; r + 2 <= nr; r += 2)
        q_group_nr2(g, words, ld, m, perm, x + r * ldx, ldx, scale, zero, acc + r * lda, lda);
#endif
    for (; r < nr; r++)
        q_group_nr1(g, words, ld, m, perm, x + r * ldx, ldx, scale, zero, acc + r * lda, lda);
}
