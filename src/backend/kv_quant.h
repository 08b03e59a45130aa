/* kv_quant.h - how a KV cache layer lays out its slots, full precision or quantized to 8, 6 or 4 bits: shared by
 * the model (sizes, page copies) and the backends, whose kernels write and read it.
 *
 * A cache layer holds its keys (or values) as slots one after another, exl_kv_slot_bytes each; a slot is one
 * token's row of width = n_kv_heads * head_dim values. At 16 bits (or 0) it is width values of the backend's own
 * element (kv_elem_bytes: fp16 on CUDA and by default on the CPU, fp32 on the CPU's exact path). Quantized, it is
 *   codes    width * bits / 8 bytes: value i of the row in bits [i * bits, (i + 1) * bits) of them, read as one
 *            little-endian number (so head h's codes start at byte h * head_dim * bits / 8);
 *   scales   width / G fp16 values, one per group of G consecutive values (a group never straddles two heads:
 *            G divides head_dim);
 *   padding  to a multiple of 16 bytes.
 * G is 32 where head_dim is a multiple of 32, else 16 or 8 (exl_kv_group). A group x of G values is stored rotated,
 * y = H x with H the G x G Walsh-Hadamard matrix over sqrt(G) (orthogonal and its own inverse), which spreads an
 * outlier over the group; then with z = (2^bits - 1) / 2 and the scale s = fp16(2 max|y| / (2^bits - 1)), each
 * code is c = clamp(round(y / s + z), 0, 2^bits - 1) and reads back as (c - z) s. Attention needs no inverse
 * for the scores, q . x = (H q) . y group by group, and one for a weighted sum of values: sum p x = H sum p y. */
#ifndef EXL_BACKEND_KV_QUANT_H
#define EXL_BACKEND_KV_QUANT_H

#include <stddef.h>
#include <stdint.h>

#define EXL_KV_MAX_GROUP 32

/* 1 for the bit widths a cache side takes: 16 (0 too: the default), 8, 6, 4 */
static inline int exl_kv_bits_ok(int32_t bits) {
    return bits == 0 || bits == 16 || bits == 8 || bits == 6 || bits == 4;
}

/* 1 when a side of that width is quantized */
static inline int exl_kv_quantized(int32_t bits) { return bits > 0 && bits < 16; }

/* Values per group for a head_dim (0: none fits, the cache cannot be quantized). */
static inline int32_t exl_kv_group(int32_t head_dim) {
    return head_dim % 32 == 0 ? 32 : head_dim % 16 == 0 ? 16 : head_dim % 8 == 0 ? 8 : 0;
}

/* Bytes of a slot's codes (the scales follow them). */
static inline size_t exl_kv_codes_bytes(int32_t width, int32_t bits) { return (size_t)width * (size_t)bits / 8; }

/* Bytes of one slot of width values at bits (groups of group values), elem_bytes each at full precision. */
static inline size_t exl_kv_slot_bytes(int32_t width, int32_t bits, int32_t group, size_t elem_bytes) {
    if (!exl_kv_quantized(bits))
        return (size_t)width * elem_bytes;
    size_t n = exl_kv_codes_bytes(width, bits) + (size_t)(width / group) * 2;
    return (n + 15) / 16 * 16;
}

/* The zero point z of a width, times 2 (an integer): codes read back as (2c - z2) s / 2. */
static inline int32_t exl_kv_zero2(int32_t bits) { return (1 << bits) - 1; }

#endif
