/* cuda_qrows.cu - a lean quantized matmul for the few rows of decode and verification steps (up to 16), one launch
 * (exl_cuda_qmma hands it 5-8 rows of matrices 8192 or more wide by default, every step up to 16 rows with
 * EXL_CUDA_QROWS=1: cuda_internal.h).
 *
 * The weights are the mma's A operand (m16: 16 output columns), the rows its B operand (n8: one n8 tile up to 8
 * rows, two up to 16), so every decoded weight feeds one mma per 8 rows. Lane (g = lane / 4, t = lane % 4) of a warp
 * owns columns 4g .. 4g + 3 of the warp's 32 (one 16-byte word of the column-tile layout) and decodes pairs
 * 4t .. 4t + 3 of each (slots 8t .. 8t + 7, cuda_qdecode.cuh's quarter); column 4g + 2m is row g of A tile m and
 * 4g + 2m + 1 its row g + 8, so the A fragment of k step s is (pair 4t + 2s, 4t + 2s + 1) of those two columns and
 * the B fragment the activations of row g at slots 8t + 4s .. 8t + 4s + 3: one 16-byte shared load covers both k
 * steps of a chunk. A chunk's two k steps are summed in fp32 and scaled by the columns' group scales (one FFMA an
 * output element a chunk: the scale is not folded into the fp16 weights, which would round (q - z) * s to 11 bits).
 * EXL2 4-bit codes go to the mma as they lie in the word (1024 + q, 1024 + 16 q: four lop3 and a shift for eight
 * weights), the high nibbles' activations divided by 16 in the gather, the mma starting from minus the offset this
 * adds (a chunk's row's, summed once a matmul by the gather kernel); other widths and GPTQ are decoded to exact
 * (q - z).
 *
 * Block: 8 warps, 256 columns (one qw tile), a range of chunks (split-K to fill the GPU in about one wave, whatever
 * the rows). Each warp streams its 32 columns' code words, scales (and GPTQ zeros) two chunks at a time through a ring
 * of QR_STAGES buffers of its own (cp.async, 16 bytes a lane; no block barrier in the loop), all but one requested
 * before the wait for the previous kernel: the split's words of a warp are one stream of 1 KB rows, so a lane's source
 * is a pointer moved on by each pair's word rows, and a pair's descriptor (word rows, both widths, both scale rows) is
 * one 16-byte shared load; a pair of two 4-bit chunks takes one unrolled path, other widths a dispatch a chunk. A
 * small kernel before (qrows_gather_kernel) gathers the rows' activations once a matmul (slot order, the GLU applied,
 * rounded to fp16 as qmma_gather_kernel rounds them) with the 4-bit chunks' offsets; each block copies its chunks'
 * share into shared memory (cp.async, L2 hits). With several splits each block stores its partial sums and the last
 * block of a column tile to arrive (a counter per tile in cb->gemv_counters, reset by that block) adds them in split
 * order: deterministic, no further launch. */
#include "backend/cuda/cuda_async.cuh"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_qdecode.cuh"

#include <string.h>

#define QR_WARPS 8
#define QR_COLS (QR_WARPS * 32) /* columns of a block: one EXL_QW_TILE */
#define QR_SCALE_AT 2048        /* a buffer: up to 16 word rows of 32 columns, then the two chunks' scales, */
#define QR_ZERO_AT 2176         /* then their zeros (GPTQ) */
#define QR_STAGE_BYTES 2304
#define QR_MAX_SPLITS 16 /* splits at most: the partial sums a tile's last block adds */

static_assert(QR_COLS == EXL_QW_TILE, "a block's columns are one tile of qw");

/* ring buffers a warp, two chunks each: three pairs in flight while one is multiplied (3.4 KB a warp at 4 bits, 54 KB
 * an SM with two blocks) */
#define QR_STAGES 4
/* chunks a split at most (its activations in shared memory: 8 nt rows of them; two blocks an SM) */
__host__ __device__ constexpr int qr_max_cps(int nt) { return nt == 1 ? 48 : 24; }

typedef struct qrows_args {
    exl_qmatrix q;
    const __half *xg; /* [8 NT][n_chunks * CHUNK] the activations in slot order (qrows_gather_kernel) */
    const float *kg;  /* [n_chunks][32] the EXL2 4-bit chunks' offsets in the C fragment order, 0 elsewhere */
    int32_t rows, n_out;
    int32_t chunks_per_split;
    int32_t ld;         /* halves per row of the shared activations */
    float *out;         /* [rows, n_out] */
    float *partial;     /* [split][rows][n_pad] (more than one split) */
    unsigned *counters; /* [column tiles], zero at rest (more than one split) */
    const float *bias;
    int32_t accumulate; /* out += */
} qrows_args;

/* Pairs 4t .. 4t+3 of a 4-bit column's chunk (its word t) as exact (q - z) pairs: the low nibbles of each byte pair
 * or'ed into 1024 minus zz = 1024 + z, the high ones in place, (1024 + 16 q) / 16 + c with c = 960 - zz; one shift,
 * four lop3 and four half2 operations for eight weights. */
__device__ __forceinline__ void decode_word4(uint32_t w, __half2 zz, __half2 c, uint32_t (&pr)[4]) {
    const uint32_t m = magic_1024(), hi = w >> 8;
    const __half2 s = __float2half2_rn(0.0625f);
    pr[0] = half2_bits(__hsub2(u32_as_half2(and_or<0x000f000fu>(w, m)), zz));
    pr[1] = half2_bits(__hfma2(u32_as_half2(and_or<0x00f000f0u>(w, m)), s, c));
    pr[2] = half2_bits(__hsub2(u32_as_half2(and_or<0x000f000fu>(hi, m)), zz));
    pr[3] = half2_bits(__hfma2(u32_as_half2(and_or<0x00f000f0u>(hi, m)), s, c));
}

/* d = c + a b for one m16n8k16 tile, c apart from d (several tiles start from the same c) */
__device__ __forceinline__ void qr_mma_from(float (&d)[4], float4 c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                            uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c.x), "f"(c.y), "f"(c.z), "f"(c.w));
#else
    d[0] = c.x, d[1] = c.y, d[2] = c.z, d[3] = c.w;
    mma16816(d, a0, a1, a2, a3, b0, b1);
#endif
}

/* EXL2 4 bits: pairs 4t .. 4t+3 of a column's chunk (its word t) as they lie, 1024 + q (low nibbles) and
 * 1024 + 16 q (high ones, whose activations the gather divided by 16): one shift and four lop3 for eight weights; the
 * mma starts from minus the offset this adds (the kernel's kt) */
__device__ __forceinline__ void raw_word4(uint32_t w, uint32_t (&pr)[4]) {
    const uint32_t m = magic_1024(), hi = w >> 8;
    pr[0] = and_or<0x000f000fu>(w, m);
    pr[1] = and_or<0x00f000f0u>(w, m);
    pr[2] = and_or<0x000f000fu>(hi, m);
    pr[3] = and_or<0x00f000f0u>(hi, m);
}

/* One chunk of B-bit codes staged at st (this warp's 32 columns; its zeros at zr) times the activations bx (row 8n + g,
 * slots 8t .. 8t + 7 of the chunk): decode this lane's four columns, two mma a row tile, into p (unscaled), starting
 * from the chunk's offsets at kl (EXL2: n8 tile n's C fragment at kl + 16 n; 0 but at 4 bits). */
template <int B, int NT, bool GPTQ>
__device__ __forceinline__ void qrows_chunk(const unsigned char *st, const unsigned char *zr, const float *kl, int g,
                                            int t, const uint4 (&bx)[NT], float (&p)[2][NT][4]) {
    __half2 zz[4]; /* 1024 + z */
    if constexpr (GPTQ) {
        const uint2 zw = *(const uint2 *)(zr + 8 * g);
        const __half2 z01 = u32_as_half2(zw.x), z23 = u32_as_half2(zw.y), k = __float2half2_rn(1024.0f);
        zz[0] = __hadd2(__low2half2(z01), k), zz[1] = __hadd2(__high2half2(z01), k);
        zz[2] = __hadd2(__low2half2(z23), k), zz[3] = __hadd2(__high2half2(z23), k);
    } else {
#pragma unroll
        for (int c = 0; c < 4; c++)
            zz[c] = __float2half2_rn(1024.0f + (float)(1 << (B - 1)));
    }
    uint32_t pr[4][4]; /* [column 4g + c][pair 4t + j] */
    if constexpr (B == 4) {
        const uint4 wv = *(const uint4 *)(st + t * 128 + 16 * g);
        const uint32_t wc[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
        for (int c = 0; c < 4; c++)
            if constexpr (GPTQ)
                decode_word4(wc[c], zz[c], __hsub2(__float2half2_rn(960.0f), zz[c]), pr[c]);
            else
                raw_word4(wc[c], pr[c]);
    } else {
        uint32_t w[4][MAX_WORDS];
#pragma unroll
        for (int i = 0; i < MAX_WORDS; i++) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (i < quarter_words<B>())
                v = *(const uint4 *)(st + (quarter_first<B>(t) + i) * 128 + 16 * g);
            w[0][i] = v.x, w[1][i] = v.y, w[2][i] = v.z, w[3][i] = v.w;
        }
#pragma unroll
        for (int c = 0; c < 4; c++)
            decode_quarter<B>(w[c], t, zz[c], pr[c]);
    }
#pragma unroll
    for (int m = 0; m < 2; m++) /* A tile m: columns 4g + 2m (its row g) and 4g + 2m + 1 (row g + 8) */
#pragma unroll
        for (int n = 0; n < NT; n++) {
            const float4 k = GPTQ ? make_float4(0.0f, 0.0f, 0.0f, 0.0f) : *(const float4 *)(kl + 16 * n);
            qr_mma_from(p[m][n], k, pr[2 * m][0], pr[2 * m + 1][0], pr[2 * m][1], pr[2 * m + 1][1], bx[n].x, bx[n].y);
            mma16816(p[m][n], pr[2 * m][2], pr[2 * m + 1][2], pr[2 * m][3], pr[2 * m + 1][3], bx[n].z, bx[n].w);
        }
}

/* acc += p scaled by the columns' group scales at sz (lane g's columns 4g .. 4g + 3): C fragment of tile m, n8
 * tile n: c0, c1 at column 4g + 2m, c2, c3 at column 4g + 2m + 1 */
template <int NT>
__device__ __forceinline__ void qrows_scale(const unsigned char *sz, int g, const float (&p)[2][NT][4],
                                            float (&acc)[2][NT][4]) {
    const uint2 sr = *(const uint2 *)(sz + 8 * g);
    const float2 s01 = __half22float2(u32_as_half2(sr.x)), s23 = __half22float2(u32_as_half2(sr.y));
    const float sc[4] = {s01.x, s01.y, s23.x, s23.y};
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < NT; n++) {
            acc[m][n][0] += sc[2 * m] * p[m][n][0];
            acc[m][n][1] += sc[2 * m] * p[m][n][1];
            acc[m][n][2] += sc[2 * m + 1] * p[m][n][2];
            acc[m][n][3] += sc[2 * m + 1] * p[m][n][3];
        }
}

/* out[r, col .. col + 1] (+)= v (+ bias), the columns below n_out */
__device__ __forceinline__ void qrows_store(const qrows_args &a, int r, int col, float v0, float v1) {
    float *o = a.out + (int64_t)r * a.n_out + col;
    for (int i = 0; i < 2 && col + i < a.n_out; i++) {
        const float v = (i ? v1 : v0) + (a.bias ? a.bias[col + i] : 0.0f);
        o[i] = a.accumulate ? o[i] + v : v;
    }
}

/* The last block of column tile blockIdx.x to finish: out (+)= the splits' partial sums in split order (+ bias),
 * four columns a thread, eight splits' loads in flight. */
__device__ void qrows_add_splits(const qrows_args &a) {
    const int64_t stride = (int64_t)a.rows * a.q.n_pad;
    const unsigned splits = gridDim.y;
    for (int i = threadIdx.x; i < a.rows * (QR_COLS / 4); i += blockDim.x) {
        const int r = i / (QR_COLS / 4), col = blockIdx.x * QR_COLS + i % (QR_COLS / 4) * 4;
        const float *p = a.partial + (int64_t)r * a.q.n_pad + col;
        float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (unsigned z0 = 0; z0 < splits; z0 += 8) { /* (16 loads in flight spill the 9-16-row kernel) */
            float4 v[8];
#pragma unroll
            for (unsigned e = 0; e < 8; e++)
                v[e] = z0 + e < splits ? __ldcg((const float4 *)(p + (z0 + e) * stride))
                                       : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
            for (unsigned e = 0; e < 8; e++)
                if (z0 + e < splits)
                    s.x += v[e].x, s.y += v[e].y, s.z += v[e].z, s.w += v[e].w;
        }
        qrows_store(a, r, col, s.x, s.y);
        qrows_store(a, r, col + 2, s.z, s.w);
    }
}

/* The B fragments of a chunk (this lane's slots 8t .. 8t + 7 of rows g and 8 + g at xl) */
template <int NT>
__device__ __forceinline__ void qrows_load_x(const __half *xl, int ld, uint4 (&bx)[NT]) {
#pragma unroll
    for (int n = 0; n < NT; n++)
        bx[n] = *(const uint4 *)(xl + n * 8 * ld);
}

/* One chunk of width `bits` (any) at words, its scales (zeros) at sz, its activations at xl, into acc */
template <int NT, bool GPTQ>
__device__ __forceinline__ void qrows_any_chunk(int bits, const unsigned char *words, const unsigned char *sz,
                                                const __half *xl, const float *kl, int ld, int g, int t,
                                                float (&acc)[2][NT][4]) {
    uint4 bx[NT];
    qrows_load_x(xl, ld, bx);
    float p[2][NT][4];
    const unsigned char *zr = sz + (QR_ZERO_AT - QR_SCALE_AT);
    if (bits == 4)
        qrows_chunk<4, NT, GPTQ>(words, zr, kl, g, t, bx, p);
    else if (bits == 2)
        qrows_chunk<2, NT, GPTQ>(words, zr, kl, g, t, bx, p);
    else if (bits == 3)
        qrows_chunk<3, NT, GPTQ>(words, zr, kl, g, t, bx, p);
    else if (bits == 5)
        qrows_chunk<5, NT, GPTQ>(words, zr, kl, g, t, bx, p);
    else if (bits == 6)
        qrows_chunk<6, NT, GPTQ>(words, zr, kl, g, t, bx, p);
    else
        qrows_chunk<8, NT, GPTQ>(words, zr, kl, g, t, bx, p);
    qrows_scale(sz, g, p, acc);
}

/* The activations of every chunk (warp w of block b: chunk 8b + w, lane: its slot) for the 8 nt rows of the B operand
 * (zeros past `rows`): slot order, the GLU applied, fp16 as qmma_gather_kernel rounds them, the high nibbles' (slots
 * 4i + 2, 4i + 3) divided by 16 in EXL2 4-bit chunks (raw_word4), into xg [8 nt][n_chunks * CHUNK]; and such a
 * chunk's offset (the raw halves' mma gives sum (1024 + q) b over the low slots + (1024 + 16 q) b over the high ones =
 * sum (q - 8) x + 1032 sum_low b + 1152 sum_high b, b the fp16 values it reads), summed in fp32 for each row and
 * stored negated in the mma's C fragment order into kg [n_chunks][32]: n8 tile n, lane t: (-k(8n + 2t),
 * -k(8n + 2t + 1)) twice; 0 for other chunks. Once a matmul, so that the blocks only copy their chunks' share. */
__global__ void qrows_gather_kernel(__half *xg, float *kg, const float *x, const float *up, int32_t act,
                                    const int32_t *slot_src, const int4 *chunks, int32_t in, int32_t rows, int32_t nt,
                                    int32_t n_chunks, int32_t raw4) {
    exl_pdl_start(); /* xg, kg: the kernel before may still read them */
    const int lane = threadIdx.x % 32, c = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (c >= n_chunks)
        return;
    const int src = __ldg(slot_src + c * CHUNK + lane);
    const bool raw = raw4 && __ldg(chunks + c).y == 4, high = lane & 2;
    const float f = raw && high ? 0.0625f : 1.0f;
    const int64_t n_slots = (int64_t)n_chunks * CHUNK;
    float v[16], w[16];
#pragma unroll
    for (int r = 0; r < 16; r++)
        v[r] = r < rows && src >= 0 ? x[(int64_t)r * in + src] : 0.0f;
    if (up) {
#pragma unroll
        for (int r = 0; r < 16; r++)
            w[r] = r < rows && src >= 0 ? up[(int64_t)r * in + src] : 0.0f;
#pragma unroll
        for (int r = 0; r < 16; r++)
            v[r] = exl_cuda_activate(v[r], act) * w[r];
    }
    float k = 0.0f; /* row `lane`'s offset (lanes 0-15) */
#pragma unroll
    for (int r = 0; r < 16; r++) {
        if (r >= 8 * nt)
            break;
        const __half b = __float2half_rn(v[r] * f);
        xg[r * n_slots + c * CHUNK + lane] = b;
        float lo = high ? 0.0f : __half2float(b), hi = high ? __half2float(b) : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o /= 2)
            lo += __shfl_xor_sync(0xffffffffu, lo, o), hi += __shfl_xor_sync(0xffffffffu, hi, o);
        if (lane == r)
            k = raw ? -(1032.0f * lo + 1152.0f * hi) : 0.0f;
    }
    if (lane < 16) {
        float *kc = kg + c * 32 + lane / 8 * 16 + lane % 8 / 2 * 4 + lane % 2;
        kc[0] = k, kc[2] = k;
    }
}

/* Block: 256 columns (blockIdx.x), chunks of split blockIdx.y; NT n8 tiles of rows (rows <= 8 NT). Shared memory:
 * the warps' rings, the split's pair descriptors, the activations [8 NT][ld] fp16. */
template <int NT, bool GPTQ>
__global__ void __launch_bounds__(QR_WARPS * 32, 2) qrows_kernel(const __grid_constant__ qrows_args a) {
    constexpr int MAX_CPS = qr_max_cps(NT);
    extern __shared__ __align__(16) unsigned char smem[];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int c_begin = blockIdx.y * a.chunks_per_split;
    const int n_chunks = min(a.q.n_chunks - c_begin, a.chunks_per_split);
    const int n_pairs = (n_chunks + 1) / 2;
    const int col0 = blockIdx.x * QR_COLS + warp * 32; /* this warp's 32 columns */
    unsigned char *ring = smem + warp * QR_STAGES * QR_STAGE_BYTES;
    /* the split's chunk pairs (2u, 2u + 1) and one empty pair past the end: word rows of the pair, bits of its
     * chunks (byte 0, byte 1; 0 past the end), byte offsets of their scale (and zero) rows of 32 columns */
    int4 *pairs = (int4 *)(smem + QR_WARPS * QR_STAGES * QR_STAGE_BYTES);
    /* EXL2: the mma's start, [chunk][n8 tile][lane t] (-k(8n + 2t), -k(8n + 2t + 1)) twice, a C fragment */
    float *kt = (float *)(pairs + MAX_CPS / 2 + 1);
    __half *xs = (__half *)(kt + MAX_CPS * 32);
    exl_pdl_trigger();
    for (int u = threadIdx.x; u <= n_pairs; u += blockDim.x) {
        const int c0 = min(2 * u, n_chunks - 1), c1 = min(2 * u + 1, n_chunks - 1);
        const int4 m0 = __ldg(a.q.chunks + c_begin + c0), m1 = __ldg(a.q.chunks + c_begin + c1);
        const int b0 = u < n_pairs ? m0.y : 0, b1 = 2 * u + 1 < n_chunks ? m1.y : 0;
        pairs[u] = make_int4(b0 + b1, b0 | b1 << 8, m0.z * a.q.n_pad * 2, m1.z * a.q.n_pad * 2);
    }
    const int first_row = __ldg(a.q.chunks + c_begin).x;
    __syncthreads();

    /* Pair u into ring buffer `slot`: lane l copies 16 bytes of the pair's word rows l / 8 + 4k (k < 4) from wsrc,
     * which then moves past the pair's words (the warp's words of the split are one stream of 1 KB rows), lanes 0-7
     * the two chunks' scales, 8-15 their zeros (GPTQ); one commit group a pair, empty past the end, so that
     * wait_group counts pairs. */
    const int word_row = lane / 8;
    const char *wsrc = (const char *)(a.q.qw + ((int64_t)blockIdx.x * a.q.word_rows + first_row) * EXL_QW_TILE) +
                       word_row * EXL_QW_TILE * 4 + (warp * 32 + lane % 8 * 4) * 4;
    const bool sz_copy = lane < (GPTQ ? 16 : 8), sz_second = lane / 4 % 2;
    const char *sz_src = (const char *)(lane < 8 || !GPTQ ? a.q.scales : a.q.zeros) + col0 * 2 + lane % 4 * 16;
    const unsigned ring_lane = exl_smem_addr(ring + 16 * lane);
    auto request = [&](int u, int slot) {
        const int4 d = pairs[min(u, n_pairs)];
        const unsigned st = ring_lane + slot * QR_STAGE_BYTES;
#pragma unroll
        for (int k = 0; k < 4; k++)
            if (word_row + 4 * k < d.x)
                exl_cp16(st + 512 * k, wsrc + k * 4 * EXL_QW_TILE * 4);
        wsrc += d.x * EXL_QW_TILE * 4;
        if (sz_copy) /* past the end: the last chunk's again, unused */
            exl_cp16(st + QR_SCALE_AT, sz_src + (sz_second ? d.w : d.z));
        exl_cp_commit();
    };
    for (int u = 0; u < QR_STAGES - 1; u++)
        request(u, u);

    /* the split's activations and offsets (qrows_gather_kernel's, L2 hits), after it wrote them: one more commit group
     * (waited for with the ring's first pairs: the ring's count of groups a pair only gains one) */
    exl_pdl_wait();
    {
        const int q16 = n_chunks * CHUNK / 8; /* 16-byte pieces of a row's span */
        const int64_t n_slots = (int64_t)a.q.n_chunks * CHUNK;
        for (int i = threadIdx.x; i < 8 * NT * q16; i += blockDim.x) {
            const int r = i / q16, p = i % q16;
            exl_cp16(exl_smem_addr(xs + r * a.ld + 8 * p), a.xg + r * n_slots + (int64_t)c_begin * CHUNK + 8 * p);
        }
        if constexpr (!GPTQ)
            for (int i = threadIdx.x; i < n_chunks * 8; i += blockDim.x)
                exl_cp16(exl_smem_addr(kt + 4 * i), a.kg + (int64_t)c_begin * 32 + 4 * i);
        exl_cp_commit();
        exl_cp_wait<0>();
    }
    __syncthreads();

    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[m][n][i] = 0.0f;
    const __half *xl = xs + g * a.ld + 8 * t; /* pair u's activations: xl + 2 u CHUNK */
    const float *kl = kt + 4 * t;             /* pair u's offsets: kl + 64 u */
    int slot = 0;                             /* pair u's buffer: u % QR_STAGES */
    /* pair u is in, pair u + QR_STAGES - 1 requested: pair u's buffer */
    auto next_pair = [&](int u) {
        exl_cp_wait<QR_STAGES - 2>();
        __syncwarp(); /* pair u is in; every lane is done with the buffer pair u - 1 used */
        request(u + QR_STAGES - 1, slot == 0 ? QR_STAGES - 1 : slot - 1);
        const unsigned char *st = ring + slot * QR_STAGE_BYTES;
        slot = slot == QR_STAGES - 1 ? 0 : slot + 1;
        return st;
    };
    /* runs of pairs of two 4-bit chunks (word rows 0-3 and 4-7 of the buffer) in a loop of their own, so that the
     * other widths' registers do not weigh on it; each other pair, or the half pair at an odd end, between runs */
    int u = 0;
    while (u < n_pairs) {
#pragma unroll 1
        for (; u < n_pairs && pairs[u].y == (4 | 4 << 8); u++, xl += 2 * CHUNK, kl += 64) {
            const unsigned char *st = next_pair(u);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                uint4 bx[NT];
                qrows_load_x(xl + h * CHUNK, a.ld, bx);
                float p[2][NT][4];
                const unsigned char *sz = st + QR_SCALE_AT + h * 64;
                qrows_chunk<4, NT, GPTQ>(st + h * 512, sz + (QR_ZERO_AT - QR_SCALE_AT), kl + 32 * h, g, t, bx, p);
                qrows_scale(sz, g, p, acc);
            }
        }
        if (u == n_pairs)
            break;
        const int widths = pairs[u].y;
        const unsigned char *st = next_pair(u);
        const int b0 = widths & 0xff, b1 = widths >> 8;
        qrows_any_chunk<NT, GPTQ>(b0, st, st + QR_SCALE_AT, xl, kl, a.ld, g, t, acc);
        if (b1)
            qrows_any_chunk<NT, GPTQ>(b1, st + b0 * 128, st + QR_SCALE_AT + 64, xl + CHUNK, kl + 32, a.ld, g, t, acc);
        u++, xl += 2 * CHUNK, kl += 64;
    }

    exl_cp_wait<0>(); /* the copies of the pairs past the end, before the block's shared memory goes */

    /* C fragment of tile m, n8 tile n: c0, c1 at column 4g + 2m, rows 8n + 2t, 8n + 2t + 1; c2, c3 at column
     * 4g + 2m + 1, the same rows */
    const bool split = gridDim.y > 1;
#pragma unroll
    for (int m = 0; m < 2; m++)
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int r = 8 * n + 2 * t + h, col = col0 + 4 * g + 2 * m;
                const float v0 = acc[m][n][h], v1 = acc[m][n][2 + h];
                if (r >= a.rows)
                    continue;
                if (split)
                    *(float2 *)(a.partial + ((int64_t)blockIdx.y * a.rows + r) * a.q.n_pad + col) = make_float2(v0, v1);
                else
                    qrows_store(a, r, col, v0, v1);
            }
    if (!split)
        return;
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0)
        is_last = atomicAdd(&a.counters[blockIdx.x], 1u) == gridDim.y - 1;
    __syncthreads();
    if (!is_last)
        return;
    __threadfence();
    if (threadIdx.x == 0)
        a.counters[blockIdx.x] = 0; /* for the next launch or graph replay */
    qrows_add_splits(a);
}

typedef void (*qrows_kernel_fn)(qrows_args);
typedef int (*qrows_occupancy_fn)(const exl_cuda_backend *);

static size_t qrows_smem_bytes(int nt, int ld) {
    return (size_t)QR_WARPS * QR_STAGES * QR_STAGE_BYTES + (qr_max_cps(nt) / 2 + 1) * sizeof(int4) +
           qr_max_cps(nt) * 32 * sizeof(float) + (size_t)8 * nt * ld * 2;
}

/* halves per activation row for cps chunks: a multiple of 64 plus 32, so that the rows of a lane quad's 16-byte
 * loads fall on different banks */
static int qrows_ld(int cps) { return (cps * CHUNK + 63) / 64 * 64 + 32; }

/* Blocks of qrows_kernel<NT, GPTQ> an SM holds with its largest shared memory (the attribute set once per device), 0 when
 * it cannot be configured */
template <int NT, bool GPTQ>
static int qrows_blocks_per_sm(const exl_cuda_backend *cb) {
    static size_t allowed[EXL_CUDA_MAX_DEVICES];
    const size_t smem = qrows_smem_bytes(NT, qrows_ld(qr_max_cps(NT)));
    if (!exl_cuda_smem_opt_in(cb, (const void *)qrows_kernel<NT, GPTQ>, smem, allowed))
        return 0;
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, qrows_kernel<NT, GPTQ>, QR_WARPS * 32, smem) == cudaSuccess
               ? n
               : 0;
}

/* n arrival counters (zero at rest) in cb->gemv_counters, shared with the other split kernels (one launch at a time
 * uses them), or NULL on failure */
static unsigned *qrows_counters(exl_cuda_backend *cb, size_t n) {
    if (n > cb->gemv_counter_count) {
        size_t bytes = cb->gemv_counter_count * sizeof(unsigned);
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_counters, &bytes, n * sizeof(unsigned), "matmul counters"))
            return NULL;
        cb->gemv_counter_count = n;
        if (cudaMemsetAsync(cb->gemv_counters, 0, bytes, cb->stream) != cudaSuccess) {
            exl_cuda_check_launch(cb, "matmul counters");
            return NULL;
        }
    }
    return cb->gemv_counters;
}

int exl_cuda_qrows(exl_cuda_backend *cb, float *out, const float *x, const float *up, int act, const exl_linear *w,
                   int32_t rows, int accumulate) {
    if (rows < 1 || rows > EXL_CUDA_QROWS_MAX_ROWS || w->kind == EXL_LINEAR_DENSE)
        return 0;
    const exl_qmatrix *q = &w->q;
    const int nt = rows <= 8 ? 1 : 2;
    const int gptq = q->zeros != NULL, kind = 2 * (nt - 1) + gptq;
    static const qrows_occupancy_fn occupancy[4] = {qrows_blocks_per_sm<1, false>, qrows_blocks_per_sm<1, true>,
                                                    qrows_blocks_per_sm<2, false>, qrows_blocks_per_sm<2, true>};
    static const qrows_kernel_fn kernels[4] = {qrows_kernel<1, false>, qrows_kernel<1, true>, qrows_kernel<2, false>,
                                               qrows_kernel<2, true>};
    const int per_sm = occupancy[kind](cb);
    if (per_sm < 1)
        return 0; /* cuda_qmma.cu takes it */
    /* split-K to fill one wave whatever the rows (with fewer blocks than SMs x 2 the 9-16-row form ran at half its
     * warps: down_proj 58.6 us), at most QR_MAX_SPLITS (the last block's sums), at least enough for the shared
     * activations */
    const int32_t col_tiles = q->n_pad / QR_COLS;
    int32_t splits = per_sm * cb->n_sms / col_tiles;
    splits = splits < QR_MAX_SPLITS ? splits : QR_MAX_SPLITS;
    splits = splits > 1 ? splits : 1;
    const int32_t least = (q->n_chunks + qr_max_cps(nt) - 1) / qr_max_cps(nt);
    if (least > QR_MAX_SPLITS)
        return 0; /* cuda_qmma.cu takes it */
    splits = splits > least ? splits : least;
    splits = splits < q->n_chunks ? splits : q->n_chunks;
    qrows_args a;
    memset(&a, 0, sizeof a);
    a.chunks_per_split = (q->n_chunks + splits - 1) / splits;
    splits = (q->n_chunks + a.chunks_per_split - 1) / a.chunks_per_split;
    a.q = *q, a.rows = rows, a.n_out = w->out;
    a.ld = qrows_ld(a.chunks_per_split), a.out = out, a.bias = w->bias, a.accumulate = accumulate;
    if (splits > 1) {
        const size_t bytes = (size_t)splits * rows * q->n_pad * sizeof(float);
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_partial, &cb->gemv_partial_bytes, bytes, "matmul partial sums"))
            return 1;
        a.partial = cb->gemv_partial;
        if (!(a.counters = qrows_counters(cb, (size_t)col_tiles)))
            return 1;
    }
    const size_t xg_bytes = (size_t)8 * nt * q->n_chunks * CHUNK * sizeof(__half);
    if (!exl_cuda_ensure(cb, &cb->scratch, &cb->scratch_bytes, xg_bytes + (size_t)q->n_chunks * 32 * sizeof(float),
                         "fp16 activations"))
        return 1;
    a.xg = (const __half *)cb->scratch, a.kg = (const float *)((char *)cb->scratch + xg_bytes);
    exl_cuda_launch(cb, qrows_gather_kernel, dim3((unsigned)((q->n_chunks + 7) / 8)), dim3(256), 0, (__half *)a.xg,
                    (float *)a.kg, x, up, act, q->slot_src, q->chunks, w->in, rows, nt, q->n_chunks, !gptq);
    if (!exl_cuda_check_launch(cb, "quantized matmul (few rows' activations)"))
        return 1;
    exl_cuda_launch(cb, kernels[kind], dim3((unsigned)col_tiles, (unsigned)splits), dim3(QR_WARPS * 32),
                    qrows_smem_bytes(nt, a.ld), a);
    exl_cuda_check_launch(cb, "quantized matmul (few rows)");
    return 1;
}
