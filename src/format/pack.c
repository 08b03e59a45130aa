/* pack.c - write known codes in the EXL2 and GPTQ layouts (tests, random models).
 *
 * The inverse of dequant.c's reading: codes go into the column bit streams
 * described in format/qstream.h, scales and zeros into their own packed rows. */
#include "format/quant.h"

#include <string.h>

int32_t exl_exl2_q_rows(const int32_t *bits, const int32_t *rows, int32_t n_groups) {
    int64_t q = 0;
    for (int32_t g = 0; g < n_groups; g++)
        q += ((int64_t)rows[g] * bits[g] + 31) / 32;
    return (int32_t)q;
}

void exl_exl2_pack(int64_t K, int64_t N, int32_t n_groups, const int32_t *bits, const int32_t *rows,
                   const uint8_t *codes, const uint8_t *scale_codes, int32_t *q_weight, int32_t *q_scale,
                   int16_t *q_groups) {
    int64_t Np = (N + 31) / 32 * 32;
    int32_t Q = exl_exl2_q_rows(bits, rows, n_groups);
    memset(q_weight, 0, (size_t)Q * (size_t)Np * sizeof *q_weight);
    memset(q_scale, 0, (size_t)n_groups * (size_t)(Np / 8) * sizeof *q_scale);
    int64_t r = 0, qrow = 0;
    for (int32_t g = 0; g < n_groups; g++) {
        int b = bits[g];
        q_groups[2 * g] = (int16_t)b;
        q_groups[2 * g + 1] = (int16_t)qrow;
        for (int64_t j = 0; j < rows[g] && r + j < K; j++)
            for (int64_t n = 0; n < N; n++)
                exl_qstream_put(q_weight + qrow * Np + n, Np, j * b, b, codes[(r + j) * N + n]);
        for (int64_t n = 0; n < N; n++)
            q_scale[g * (Np / 8) + n / 8] |= (int32_t)((uint32_t)(scale_codes[g * N + n] & 15u) << (4 * (n % 8)));
        r += rows[g];
        qrow += ((int64_t)rows[g] * b + 31) / 32;
    }
}

void exl_gptq_pack(int bits, int64_t K, int64_t N, int32_t n_groups, const uint8_t *codes, const uint8_t *zeros,
                   int32_t *qweight, int32_t *qzeros) {
    memset(qweight, 0, (size_t)(K * bits / 32) * (size_t)N * sizeof *qweight);
    memset(qzeros, 0, (size_t)n_groups * (size_t)(N * bits / 32) * sizeof *qzeros);
    for (int64_t k = 0; k < K; k++)
        for (int64_t n = 0; n < N; n++)
            exl_qstream_put(qweight + n, N, k * bits, bits, codes[k * N + n]);
    for (int64_t g = 0; g < n_groups; g++)
        for (int64_t n = 0; n < N; n++)
            exl_qstream_put(qzeros + g * (N * bits / 32), 1, n * bits, bits, zeros[g * N + n]);
}
