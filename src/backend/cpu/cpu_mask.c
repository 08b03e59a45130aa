/* cpu_mask.c - the mask_logits op on the CPU: the logits are host memory, so the mask is filled
 * and applied in place (a word with every bit set is skipped whole). */
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
            if (m[w] == 0xFFFFFFFFu)
                continue;
            int32_t end = w * 32 + 32 < vocab ? w * 32 + 32 : vocab;
            for (int32_t i = w * 32; i < end; i++)
                if (!((m[w] >> (i & 31)) & 1))
                    x[i] = -INFINITY;
        }
    }
    return EXL_OK;
}
