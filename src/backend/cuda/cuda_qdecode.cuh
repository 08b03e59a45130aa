/* cuda_qdecode.cuh - decoding the codes of one 32-row chunk of one column of an exl_qmatrix
 * (cuda_internal.h) into fp16 pairs, shared by the GEMV and the dequantize kernels.
 *
 * A chunk of b-bit codes is b words. Codes become fp16 pairs with one mask-and-or (a single
 * lop3) per pair ((code | 0x6400) is 1024 + code); the zero is subtracted exactly ((1024 + q) - (1024 + z);
 * for 4-bit codes in the high nibble of a byte, (1024 + 16 q) / 16 - 64 - z in one hfma2).
 * Pair p holds slots 2p and 2p + 1 (the slot order of exl_cuda_slot_of). */
#ifndef EXL_CUDA_QDECODE_CUH
#define EXL_CUDA_QDECODE_CUH

#include "backend/cuda/cuda_internal.h"

#define CHUNK 32

__device__ __forceinline__ __half2 u32_as_half2(uint32_t u) {
    __half2 h;
    memcpy(&h, &u, 4);
    return h;
}

/* (w & mask) | magic in one instruction: written as C, the mask and the or are two (a LOP3
 * takes one immediate), so the magic number comes in a register */
template <uint32_t MASK>
__device__ __forceinline__ uint32_t and_or(uint32_t w, uint32_t magic) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(MASK), "r"(magic));
    return r;
}

/* 0x64006400 (fp16 1024 in both halves) in a register, for and_or */
__device__ __forceinline__ uint32_t magic_1024(void) {
    uint32_t m;
    asm("mov.b32 %0, 0x64006400;" : "=r"(m));
    return m;
}

template <int B>
__device__ __forceinline__ uint32_t extract(const uint32_t (&w)[B], int bit) {
    int lo = bit >> 5, off = bit & 31;
    uint32_t v = off + B <= 32 ? w[lo] >> off : __funnelshift_r(w[lo], w[lo + 1 < B ? lo + 1 : lo], off);
    return v & ((1u << B) - 1);
}

/* pair 15 of a 3- or 5-bit chunk: bit 15 (low code) and bit 31 (high code) of word k are bit k
 * of its codes; or'ed into `magic` */
template <int B, int N>
__device__ __forceinline__ uint32_t spare_pair(const uint32_t (&w)[N], uint32_t magic) {
    uint32_t v = magic;
#pragma unroll
    for (int k = 0; k < B; k++)
        v |= (w[k] >> (15 - k)) & (0x00010001u << k);
    return v;
}

/* Pair p's two codes (slots 2p, 2p + 1) in the low and high halves, or'ed into `magic`. 2, 3, 5
 * and 8 bits: the codes lie at the same place in the two halves of a word (16 / B codes a half);
 * at 3 and 5 bits pair 15 is the top bit of each half of the B words (spare_pair): one shift and
 * one lop3 a pair. 6 bits: the file's stream, pairs (p, p + 16). */
template <int B>
__device__ __forceinline__ uint32_t pair_codes(const uint32_t (&w)[B], int p, uint32_t magic) {
    if constexpr (B == 6) {
        return extract<B>(w, p * B) | (extract<B>(w, (p + 16) * B) << 16) | magic;
    } else {
        constexpr int K = 16 / B;
        constexpr uint32_t M = (1u << B) - 1, MM = M | (M << 16);
        return p < B * K ? and_or<MM>(w[p / K] >> ((p % K) * B), magic) : spare_pair<B>(w, magic);
    }
}

/* Calls f(pair, (q - z) as half2) for the 16 pairs of a chunk; pair p covers slots 2p, 2p+1. */
template <int B, typename F>
__device__ __forceinline__ void decode_chunk(const uint32_t (&w)[B], __half2 zz, F &&f) {
    /* the 1024s in a register for and_or's lop3 (6 bits ors it as an immediate) */
    const uint32_t m = B == 6 ? 0x64006400u : magic_1024();
    if constexpr (B == 4) {
        /* the codes at bits 4..7 (and 20..23) of a byte pair are taken in place: (1024 + 16 q) / 16
         * + (960 - (1024 + z)) = q - z, exact, in one hfma2; one shift serves two pairs */
        const __half2 c = __hsub2(__float2half2_rn(960.0f), zz), s = __float2half2_rn(0.0625f);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const uint32_t lo = w[u], hi = w[u] >> 8;
            f(4 * u, __hsub2(u32_as_half2(and_or<0x000f000fu>(lo, m)), zz));
            f(4 * u + 1, __hfma2(u32_as_half2(and_or<0x00f000f0u>(lo, m)), s, c));
            f(4 * u + 2, __hsub2(u32_as_half2(and_or<0x000f000fu>(hi, m)), zz));
            f(4 * u + 3, __hfma2(u32_as_half2(and_or<0x00f000f0u>(hi, m)), s, c));
        }
    } else {
#pragma unroll
        for (int p = 0; p < 16; p++)
            f(p, __hsub2(u32_as_half2(pair_codes<B>(w, p, m)), zz));
    }
}

__device__ __forceinline__ __half2 zero_pair(const __half *zeros, int64_t at, int bits) {
    float z = zeros ? __half2float(zeros[at]) : (float)(1 << (bits - 1));
    return __float2half2_rn(1024.0f + z);
}

/* ---- a quarter of a chunk: the pairs 4t .. 4t+3 (slots 8t .. 8t+7) of one column, which lane (g, t) of a warp
 * decodes for the B fragment of two m16n8k16 k steps (cuda_qmma.cu, the many-row GEMV of cuda_qgemv.cu) */

#define MAX_WORDS 6 /* code words a thread reads per column and chunk */

/* of a column's chunk of B-bit codes, the words that quarter t needs: quarter_words from word quarter_first(t) */
template <int B>
__host__ __device__ constexpr int quarter_words(void) {
    return B == 4 || B == 2 ? 1 : B == 8 ? 2 : B;
}
template <int B>
__device__ __forceinline__ int quarter_first(int t) {
    return B == 4 ? t : B == 2 ? t / 2 : B == 8 ? 2 * t : 0;
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) {
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}

/* c ? x : y as one selp the compiler cannot turn back into an array index */
__device__ __forceinline__ uint32_t select_u32(int c, uint32_t x, uint32_t y) {
    uint32_t r;
    asm("{ .reg .pred p; setp.ne.s32 p, %3, 0; selp.b32 %0, %1, %2, p; }" : "=r"(r) : "r"(x), "r"(y), "r"(c));
    return r;
}

/* B bits from bit `bit` of the stream w[0 .. B) (as extract above), with the word
 * picked by selects, not by a run-time array index, so w stays in registers. */
template <int B>
__device__ __forceinline__ uint32_t bits_at(const uint32_t (&w)[MAX_WORDS], int bit) {
    int lo = bit >> 5, off = bit & 31;
    uint32_t a = w[0], b = w[0];
#pragma unroll
    for (int k = 1; k < B; k++) {
        a = select_u32(lo == k, w[k], a);
        b = select_u32(lo + 1 == k, w[k], b);
    }
    uint32_t v = off + B <= 32 ? a >> off : __funnelshift_r(a, b, off);
    return v & ((1u << B) - 1);
}

/* (x & mask) | bits as one lop3 (the compiler otherwise makes two instructions of it) */
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask, uint32_t bits) {
    uint32_t r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));
    return r;
}

/* Those pairs as exact (q - z) fp16 pairs; the pair layout is decode_chunk's (cuda_qdecode.cuh). */
template <int B>
__device__ __forceinline__ void decode_quarter(const uint32_t (&w)[MAX_WORDS], int t, __half2 zz, uint32_t (&pr)[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t v;
        if constexpr (B == 4)
            v = and_or(w[0] >> (4 * j), 0x000f000fu, 0x64006400u);
        else if constexpr (B == 2)
            v = and_or(w[0] >> (2 * ((t & 1) * 4 + j)), 0x00030003u, 0x64006400u);
        else if constexpr (B == 8)
            v = and_or(w[j / 2] >> (8 * (j & 1)), 0x00ff00ffu, 0x64006400u);
        else if constexpr (B == 3 || B == 5) {
            /* pair p in word p / (16 / B); pair 15 (t = 3, j = 3) from the words' top bits */
            constexpr int K = 16 / B;
            const int p = 4 * t + j, u = p / K;
            uint32_t x = w[0];
#pragma unroll
            for (int k = 1; k < B; k++)
                x = select_u32(u == k, w[k], x);
            v = and_or(x >> ((p % K) * B), ((1u << B) - 1) * 0x00010001u, 0x64006400u);
            if (j == 3)
                v = select_u32(t == 3, spare_pair<B>(w, 0x64006400u), v);
        } else
            v = (bits_at<B>(w, (4 * t + j) * B) | (bits_at<B>(w, (4 * t + j + 16) * B) << 16)) | 0x64006400u;
        pr[j] = half2_bits(__hsub2(u32_as_half2(v), zz));
    }
}

#endif
