/* cpu_mask.c - the mask_logits op on the CPU: the logits are host memory, so the mask is filled
 * and applied in place, a word of 32 logits at a time (kept whole, cleared whole, or bit by bit
 * over the cleared bits only). */
#include "backend/cpu/cpu.h"

#include "base/error.h"

#include <math.h>

exl_status exl_cpu_mask_logits(exl_backend *be, float *logits, int32_t rows, int32_t vocab, uint32_t *mask,
                               exl_logit_mask_fn fill, void *user) {
    (void)be;
    EXL_TRY(fill(user, mask, rows));
    int32_t words = exl_mask_words(vocab);
    for (int32_t r = 0; r < rows; r++) {
        const uint32_t *m = mask + (size_t)r * (size_t)words;
        float *x = logits + (size_t)r * (size_t)vocab;
        for (int32_t w = 0; w < words; w++) {
            float *p = x + (size_t)w * 32;
            int32_t n = vocab - w * 32 < 32 ? vocab - w * 32 : 32;
            uint32_t drop = ~m[w] & (n == 32 ? 0xFFFFFFFFu : (1u << n) - 1);
            if (drop == 0xFFFFFFFFu) {
                for (int32_t k = 0; k < 32; k++)
                    p[k] = -INFINITY;
                continue;
            }
            for (; drop; drop &= drop - 1)
                p[__builtin_ctz(drop)] = -INFINITY;
        }
    }
    return EXL_OK;
}
