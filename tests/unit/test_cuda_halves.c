/* test_cuda_halves.c - the CUDA backend's 3/5-bit code layout (cuda_halves.h), on the CPU: the
 * packer's whole-chunk move equals placing code by code, and the pairs the device decodes
 * (decode_chunk's formulas, re-stated here) give back every row's code of the file's stream. */
#include "backend/cuda/cuda_halves.h"
#include "test.h"

#include <stdint.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint32_t next_u32(void) {
    rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
    return (uint32_t)rng_state;
}

/* row t's code in the stream st (bit t b) */
static uint32_t stream_code(const uint32_t *st, int b, int t) { return exl_stream_bits(st, t * b, b); }

/* pair p's two codes as the device decodes them: (low << 16 | high) halves, masked */
static uint32_t device_pair(const uint32_t *wd, int b, int p) {
    int k = 16 / b;
    uint32_t m = ((1u << b) - 1) * 0x00010001u;
    if (p < b * k)
        return (wd[p / k] >> ((p % k) * b)) & m;
    uint32_t v = 0;
    for (int i = 0; i < b; i++)
        v |= (wd[i] >> (15 - i)) & (0x00010001u << i);
    return v;
}

EXL_TEST(whole_chunk_equals_code_by_code_and_decodes) {
    const int widths[2] = {3, 5};
    for (int wi = 0; wi < 2; wi++) {
        const int b = widths[wi];
        int bad_move = 0, bad_decode = 0;
        for (int trial = 0; trial < 2000; trial++) {
            uint32_t st[6], placed[5] = {0}, moved[5];
            for (int i = 0; i < 6; i++)
                st[i] = trial == 0 ? 0xffffffffu : next_u32(); /* all ones first: every bit lands */
            for (int t = 0; t < 32; t++) /* the backend's slot order at 3/5 bits: pairs (t, t + 16) */
                exl_halves_place(placed, b, t < 16 ? 2 * t : 2 * (t - 16) + 1, stream_code(st, b, t));
            exl_halves_from_stream(b, st, moved);
            for (int u = 0; u < b; u++)
                bad_move += moved[u] != placed[u];
            for (int t = 0; t < 32; t++) {
                uint32_t pair = device_pair(moved, b, t % 16);
                uint32_t code = t < 16 ? pair & 0xffffu : pair >> 16;
                bad_decode += code != stream_code(st, b, t);
            }
        }
        CHECK_MSG(bad_move == 0, "%d bits: %d words differ from code-by-code placement", b, bad_move);
        CHECK_MSG(bad_decode == 0, "%d bits: %d codes decode wrong", b, bad_decode);
    }
}

EXL_TEST(only_3_and_5_bits_use_it) {
    for (int b = 2; b <= 8; b++)
        CHECK(exl_halves_layout(b) == (b == 3 || b == 5));
}
