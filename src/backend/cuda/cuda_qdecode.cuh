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

#endif
