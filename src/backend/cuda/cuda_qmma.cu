/* cuda_qmma.cu - quantized matmul on tensor cores for many rows (batched decode, prefill).
 *
 * The weights are never dequantized to memory: each warp decodes the codes of its 16 columns
 * chunk by chunk into exact fp16 (q - z) values, multiplies them with the activations on the
 * tensor cores (mma.sync, fp32 accumulation) and scales the chunk's sums by the chunk's group
 * scale in fp32. The activations are gathered first (qmma_gather_kernel) into slot order, as
 * two fp16 parts (x = hi + lo), both multiplied, so the products are those of the fp32
 * activations to ~22 bits and the weights are exact (for the rows of decode steps only hi, at
 * half the tensor-core work, as the one-row GEMV rounds them); they are laid out in the order the mma
 * A fragments are read, so a thread's fragment for one k step is one 16-byte load.
 *
 * Block: 8 warps x 16 columns = 128 columns, MT m16 tiles of rows (1 or 2, as few as the rows
 * need; 4 measured slower for 4-bit matrices), a range of chunks (split-K when the row and
 * column tiles alone would not fill the GPU; the splits' partial sums are added in split order
 * by a second kernel, so results do not depend on timing). The block's chunk descriptors are
 * read into shared memory first. Activations and code words are staged in shared memory
 * STAGE_CHUNKS chunks at a time (the block's 128 columns of a word row are 512 contiguous
 * bytes) in a ring of N_STAGES buffers: the next stages are copied (cp.async) while the
 * current one is multiplied. Each warp loads the scales and zeros of its next chunk before it
 * multiplies the current one, and consecutive chunks of one group are summed before their
 * common scale is applied.
 *
 * The k order inside an mma is free as long as A and B agree: thread (g = lane / 4,
 * t = lane % 4) decodes pairs 4t .. 4t+3 of its column's chunk (for 4-bit codes, one word),
 * and k step s uses pairs 4t+2s and 4t+2s+1 as its B registers; the A registers are then
 * slots 8t+4s, 8t+4s+1 (a0: row g, a1: row g + 8) and 8t+4s+2, 8t+4s+3 (a2, a3). */
#include "backend/cuda/cuda_qdecode.cuh"

#define MMA_WARPS 8
#define MMA_COLS (MMA_WARPS * 16)
#define MAX_MT 2 /* m16 tiles of rows per block at most */
#define STAGE_CHUNKS 2
#define N_STAGES 3 /* stage buffers in the ring: two copies in flight while one is multiplied */
#define FRAG_HALVES 512 /* one m16 tile of one chunk: 2 k steps x 32 lanes x 8 halves */
#define MAX_WORDS 6                          /* code words a thread reads per column and chunk */
#define W_STRIDE (MMA_COLS + 8)              /* words per staged word row; +8 spreads t over banks */
#define STAGE_WORDS (STAGE_CHUNKS * 8 * W_STRIDE) /* up to 8 word rows per chunk */

/* c += a · b for one m16n8k16 tile (two m16n8k8 before sm_80). */
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#else
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(b0));
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a2), "r"(a3), "r"(b1));
#endif
}

__device__ __forceinline__ uint32_t half2_bits(__half2 h) {
    uint32_t u;
    memcpy(&u, &h, 4);
    return u;
}

/* The staged code words of a column's chunk (col: its first word row) that pairs 4t .. 4t+3
 * (slots 8t .. 8t+7) need. */
template <int B>
__device__ __forceinline__ void load_words(const uint32_t *col, int t, uint32_t (&w)[MAX_WORDS]) {
    constexpr int count = B == 4 || B == 2 ? 1 : B == 8 ? 2 : B;
    const int first = B == 4 ? t : B == 2 ? t / 2 : B == 8 ? 2 * t : 0;
#pragma unroll
    for (int i = 0; i < MAX_WORDS; i++)
        w[i] = i < count ? col[(first + i) * W_STRIDE] : 0u;
}

/* c ? x : y as one selp the compiler cannot turn back into an array index */
__device__ __forceinline__ uint32_t select_u32(int c, uint32_t x, uint32_t y) {
    uint32_t r;
    asm("{ .reg .pred p; setp.ne.s32 p, %3, 0; selp.b32 %0, %1, %2, p; }" : "=r"(r) : "r"(x), "r"(y), "r"(c));
    return r;
}

/* B bits from bit `bit` of the stream w[0 .. B) (as extract in cuda_qdecode.cuh), with the word
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

/* Those pairs as exact (q - z) fp16 pairs; the pair layout is decode_chunk's (cuda_qdecode.cuh). */
template <int B>
__device__ __forceinline__ void decode_quarter(const uint32_t (&w)[MAX_WORDS], int t, __half2 zz, uint32_t (&pr)[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t v;
        if constexpr (B == 4)
            v = (w[0] >> (4 * j)) & 0x000f000fu;
        else if constexpr (B == 2)
            v = (w[0] >> (2 * ((t & 1) * 4 + j))) & 0x00030003u;
        else if constexpr (B == 8)
            v = (w[j / 2] >> (8 * (j & 1))) & 0x00ff00ffu;
        else
            v = bits_at<B>(w, (4 * t + j) * B) | (bits_at<B>(w, (4 * t + j + 16) * B) << 16);
        pr[j] = half2_bits(__hsub2(u32_as_half2(v | 0x64006400u), zz));
    }
}

/* What a thread reads of one chunk besides its code words: the zeros of its two columns
 * (g, g + 8 of the warp's 16) and the scales of the columns of its C fragment (2t, 2t + 1 of
 * each 8). */
typedef struct chunk_regs {
    int bits, group;
    uint32_t zz[2], sc[2]; /* half2 bits */
} chunk_regs;

typedef struct qmma_args {
    exl_qmatrix q;
    const __half *xh; /* [2][row tiles of 16][n_chunks][FRAG_HALVES]: hi, then lo (qmma_gather_kernel;
                       * lo neither written nor read with parts = 1) */
    float *out;       /* [rows, n_out], or the split partials [split][rows][n_pad] */
    const float *bias;
    int32_t rows, n_out;
    int32_t chunks_per_split;
    int32_t direct;     /* 1: write out (+ bias); 0: write the split's partials */
    int32_t parts;      /* activation parts multiplied: 2 (hi + lo), or 1 (hi: decode rows) */
    int32_t accumulate; /* with direct: out += */
} qmma_args;

/* A chunk descriptor in shared memory: x = first word row, y = bits | group << 8. */
__device__ __forceinline__ int meta_bits(int2 m) { return m.y & 255; }
__device__ __forceinline__ int meta_group(int2 m) { return m.y >> 8; }

__device__ __forceinline__ void load_chunk(const qmma_args &a, int2 meta, int col_base, int g, int t,
                                           chunk_regs &r) {
    const uint32_t n_pad = (uint32_t)a.q.n_pad, at = (uint32_t)meta_group(meta) * n_pad + col_base;
    r.bits = meta_bits(meta), r.group = meta_group(meta);
#pragma unroll
    for (int n = 0; n < 2; n++) {
        r.zz[n] = half2_bits(zero_pair(a.q.zeros, at + n * 8 + g, r.bits));
        r.sc[n] = __ldg((const uint32_t *)(a.q.scales + at + n * 8 + 2 * t));
    }
}

/* 16 bytes global -> shared; asynchronous from sm_80 on. */
__device__ __forceinline__ void copy16(void *dst, const void *src) {
#if __CUDA_ARCH__ >= 800
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
#else
    *(uint4 *)dst = __ldg((const uint4 *)src);
#endif
}

__device__ __forceinline__ void copy_commit(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}

template <int N>
__device__ __forceinline__ void copy_wait(void) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

/* Start copying a stage: the activation fragments of the block's m16 tiles for chunks
 * [c0, c1) (hi and lo), and the chunks' word rows of the block's columns (meta: the
 * descriptors of chunks c0 ...). */
template <int MT>
__device__ void stage_copy(const qmma_args &a, const int2 *meta, __half *sa, uint32_t *sw, int tile0, int col0,
                           int c0, int c1) {
    const int n_tiles = (a.rows + 15) / 16;
    for (int i = threadIdx.x; i < a.parts * MT * STAGE_CHUNKS * (FRAG_HALVES / 8); i += MMA_WARPS * 32) {
        int v = i % (FRAG_HALVES / 8), ci = (i / (FRAG_HALVES / 8)) % STAGE_CHUNKS;
        int m = (i / (STAGE_CHUNKS * FRAG_HALVES / 8)) % MT, part = i / (MT * STAGE_CHUNKS * FRAG_HALVES / 8);
        if (tile0 + m < n_tiles && c0 + ci < c1)
            copy16(sa + ((part * MT + m) * STAGE_CHUNKS + ci) * FRAG_HALVES + v * 8,
                   a.xh + (((int64_t)part * n_tiles + tile0 + m) * a.q.n_chunks + c0 + ci) * FRAG_HALVES + v * 8);
    }
    for (int i = threadIdx.x; i < STAGE_CHUNKS * 8 * (MMA_COLS / 4); i += MMA_WARPS * 32) {
        int x = i % (MMA_COLS / 4), wr = (i / (MMA_COLS / 4)) % 8, ci = i / (8 * (MMA_COLS / 4));
        if (c0 + ci >= c1)
            break;
        int2 m = meta[ci];
        if (wr < meta_bits(m))
            copy16(sw + (ci * 8 + wr) * W_STRIDE + 4 * x,
                   a.q.qw + (uint32_t)(m.x + wr) * (uint32_t)a.q.n_pad + col0 + 4 * x);
    }
}

/* One chunk of B-bit codes (words staged at sw, scales and zeros in cr) times the staged
 * activations at ac (this thread's fragments of the chunk's first tile, hi part):
 * decode, start loading the next chunk into cr, multiply into part, and when the next chunk
 * starts another group (or there is none), scale part into acc. */
template <int B, int MT, int P>
__device__ __forceinline__ void chunk_step(const qmma_args &a, chunk_regs &cr, const int2 *meta, int c, int c_end,
                                           const __half *ac,
                                           const uint32_t *sw, int col_base, int g, int t,
                                           float (&part)[MT][2][4], float (&acc)[MT][2][4]) {
    uint32_t pr[2][4];
#pragma unroll
    for (int n = 0; n < 2; n++) {
        uint32_t w[MAX_WORDS];
        load_words<B>(sw + (threadIdx.x / 32) * 16 + n * 8 + g, t, w);
        decode_quarter<B>(w, t, u32_as_half2(cr.zz[n]), pr[n]);
    }
    const __half2 sc0 = u32_as_half2(cr.sc[0]), sc1 = u32_as_half2(cr.sc[1]);
    const int group = cr.group;
    if (c + 1 < c_end) /* the next chunk's loads fly while this one is multiplied */
        load_chunk(a, meta[c + 1], col_base, g, t, cr);
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < P; h++) { /* hi, then lo */
            const __half *base = ac + (h * MT + m) * STAGE_CHUNKS * FRAG_HALVES;
            uint4 f0 = *(const uint4 *)base, f1 = *(const uint4 *)(base + FRAG_HALVES / 2);
#pragma unroll
            for (int n = 0; n < 2; n++) {
                mma16816(part[m][n], f0.x, f0.y, f0.z, f0.w, pr[n][0], pr[n][1]);
                mma16816(part[m][n], f1.x, f1.y, f1.z, f1.w, pr[n][2], pr[n][3]);
            }
        }
    if (c + 1 < c_end && cr.group == group)
        return;
#pragma unroll
    for (int n = 0; n < 2; n++) {
        float s_lo = __low2float(n ? sc1 : sc0), s_hi = __high2float(n ? sc1 : sc0);
#pragma unroll
        for (int m = 0; m < MT; m++) {
            acc[m][n][0] += s_lo * part[m][n][0];
            acc[m][n][1] += s_hi * part[m][n][1];
            acc[m][n][2] += s_lo * part[m][n][2];
            acc[m][n][3] += s_hi * part[m][n][3];
#pragma unroll
            for (int i = 0; i < 4; i++)
                part[m][n][i] = 0.0f;
        }
    }
}

/* Shared memory of a block: the stage ring (activation fragments, then code words) and the
 * descriptors of its chunks. */
__host__ __device__ constexpr int stage_halves(int mt) { return 2 * mt * STAGE_CHUNKS * FRAG_HALVES; }
static size_t qmma_smem_bytes(int mt, int chunks) {
    return (size_t)N_STAGES * (stage_halves(mt) * sizeof(__half) + STAGE_WORDS * sizeof(uint32_t)) +
           (size_t)chunks * sizeof(int2);
}

template <int MT, int P>
__global__ void __launch_bounds__(MMA_WARPS * 32) qmma_kernel(const __grid_constant__ qmma_args a) {
    exl_pdl_start();
    extern __shared__ __align__(16) unsigned char smem[];
    __half *sa = (__half *)smem;
    uint32_t *sw = (uint32_t *)(sa + N_STAGES * stage_halves(MT));
    int2 *meta = (int2 *)(sw + N_STAGES * STAGE_WORDS);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int row0 = blockIdx.x * MT * 16;
    const int col_base = blockIdx.y * MMA_COLS + warp * 16; /* this warp's 16 columns */
    const int c_begin = blockIdx.z * a.chunks_per_split;
    const int n_chunks = min(a.q.n_chunks, c_begin + a.chunks_per_split) - c_begin;
    const int n_stages = (n_chunks + STAGE_CHUNKS - 1) / STAGE_CHUNKS;
    for (int i = threadIdx.x; i < n_chunks; i += MMA_WARPS * 32) {
        int4 m = __ldg(a.q.chunks + c_begin + i); /* word row, bits, group */
        meta[i] = make_int2(m.x, m.y | m.z << 8);
    }
    __syncthreads();

    float acc[MT][2][4], part[MT][2][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[m][n][i] = part[m][n][i] = 0.0f;

    chunk_regs cr;
    if (n_chunks > 0)
        load_chunk(a, meta[0], col_base, g, t, cr);
    /* the ring: stage s in buffer s % N_STAGES, N_STAGES - 1 stages in flight; one copy group
     * is committed per stage (empty ones too) so wait_group counts stages */
    for (int s = 0; s < N_STAGES - 1; s++) {
        if (s < n_stages)
            stage_copy<MT>(a, meta + s * STAGE_CHUNKS, sa + s * stage_halves(MT), sw + s * STAGE_WORDS,
                           blockIdx.x * MT, blockIdx.y * MMA_COLS, c_begin + s * STAGE_CHUNKS,
                           c_begin + min(n_chunks, (s + 1) * STAGE_CHUNKS));
        copy_commit();
    }
    for (int st = 0; st < n_stages; st++) {
        copy_wait<N_STAGES - 2>();
        __syncthreads(); /* stage st is in; everyone is done with the buffer of stage st - 1 */
        const int nx = st + N_STAGES - 1, b = nx % N_STAGES;
        if (nx < n_stages)
            stage_copy<MT>(a, meta + nx * STAGE_CHUNKS, sa + b * stage_halves(MT), sw + b * STAGE_WORDS,
                           blockIdx.x * MT, blockIdx.y * MMA_COLS, c_begin + nx * STAGE_CHUNKS,
                           c_begin + min(n_chunks, (nx + 1) * STAGE_CHUNKS));
        copy_commit();
        const int s0 = st * STAGE_CHUNKS, s1 = min(n_chunks, s0 + STAGE_CHUNKS);
        const __half *buf = sa + (st % N_STAGES) * stage_halves(MT);
        for (int c = s0; c < s1; c++) {
            const __half *ac = buf + (c - s0) * FRAG_HALVES + 8 * lane;
            const uint32_t *wc = sw + (st % N_STAGES) * STAGE_WORDS + (c - s0) * 8 * W_STRIDE;
            switch (cr.bits) { /* one branch per chunk, the same in the whole warp */
            case 2: chunk_step<2, MT, P>(a, cr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 3: chunk_step<3, MT, P>(a, cr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 4: chunk_step<4, MT, P>(a, cr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 5: chunk_step<5, MT, P>(a, cr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 6: chunk_step<6, MT, P>(a, cr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            default: chunk_step<8, MT, P>(a, cr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            }
        }
    }

    /* C fragment: c0, c1 at (row g, cols 2t, 2t+1), c2, c3 at (row g + 8, same cols) */
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int r = row0 + m * 16 + g + (i >= 2 ? 8 : 0), col = col_base + n * 8 + 2 * t + (i & 1);
                if (r >= a.rows)
                    continue;
                if (!a.direct) {
                    a.out[((int64_t)blockIdx.z * a.rows + r) * a.q.n_pad + col] = acc[m][n][i];
                } else if (col < a.n_out) {
                    float v = acc[m][n][i] + (a.bias ? a.bias[col] : 0.0f);
                    float *o = a.out + (int64_t)r * a.n_out + col;
                    *o = a.accumulate ? *o + v : v;
                }
            }
}

/* out (+)= the splits' partial sums in split order, + bias */
__global__ void qmma_reduce_kernel(float *out, const float *partial, const float *bias, int32_t rows, int32_t n_out,
                                   int64_t n_pad, int32_t splits, int32_t accumulate) {
    exl_pdl_start();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)rows * n_out)
        return;
    int64_t r = i / n_out, col = i % n_out;
    float v = 0.0f;
    for (int s = 0; s < splits; s++)
        v += partial[((int64_t)s * rows + r) * n_pad + col];
    v += bias ? bias[col] : 0.0f;
    out[i] = accumulate ? out[i] + v : v;
}

template <int MT, int P>
static void launch_qmma(exl_cuda_backend *cb, dim3 grid, size_t smem, const qmma_args *a) {
    static size_t allowed = 48 * 1024; /* beyond it, the kernel must opt in */
    if (smem > allowed) {
        if (cudaFuncSetAttribute(qmma_kernel<MT, P>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) !=
            cudaSuccess) {
            exl_cuda_check_launch(cb, "quantized matmul (shared memory)");
            return;
        }
        allowed = smem;
    }
    exl_cuda_launch(cb, qmma_kernel<MT, P>, grid, dim3(MMA_WARPS * 32), smem, *a);
}

/* x [rows, in] (fp32) into the fragment order of qmma_args.xh: element i of a part is half
 * h of lane (g, t) of k step s of chunk c of tile m, which is row 16m + g (+ 8 for the odd
 * registers h / 2) at slot 32c + 8t + 4s (+ 2 for registers 2, 3) + h % 2. */
__global__ void qmma_gather_kernel(__half *dst, const float *x, const float *up, int32_t act, const int32_t *slot_src,
                                   int32_t in, int32_t rows, int64_t total, int32_t n_chunks, int32_t parts) {
    exl_pdl_start();
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total)
        return;
    int h = (int)(i % 8), lane = (int)(i / 8 % 32), s = (int)(i / 256 % 2);
    int64_t tc = i / FRAG_HALVES;
    int chunk = (int)(tc % n_chunks), reg = h / 2;
    int64_t row = tc / n_chunks * 16 + lane / 4 + (reg & 1) * 8;
    int src = slot_src[chunk * CHUNK + 8 * (lane % 4) + 4 * s + (reg >> 1) * 2 + h % 2];
    float v = row < rows && src >= 0 ? x[row * in + src] : 0.0f;
    if (up && row < rows && src >= 0)
        v = exl_cuda_activate(v, act) * up[row * in + src];
    __half hi = __float2half_rn(v);
    dst[i] = hi;
    if (parts == 2)
        dst[total + i] = __float2half_rn(v - __half2float(hi));
}

void exl_cuda_qmma(exl_cuda_backend *cb, float *out, const float *x, const float *up, int act, const exl_linear *w,
                   int32_t rows, int accumulate, int parts) {
    const exl_qmatrix *q = &w->q;
    int64_t total = (int64_t)(rows + 15) / 16 * q->n_chunks * FRAG_HALVES; /* halves per part */
    if (!exl_cuda_ensure(cb, &cb->scratch, &cb->scratch_bytes, 2 * (size_t)total * sizeof(__half),
                         "fp16 activations"))
        return;
    __half *xh = (__half *)cb->scratch;
    exl_cuda_launch(cb, qmma_gather_kernel, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, xh, x, up, act,
                    q->slot_src, w->in, rows, total, q->n_chunks, parts);
    if (!exl_cuda_check_launch(cb, "quantized matmul (activations)"))
        return;
    const int mt = rows <= 16 ? 1 : MAX_MT;
    /* hi alone measured slower than hi + lo with one m16 tile (16 rows: q_proj 29.0 against
     * 20.8 us, bench/RESULTS.md); cause not established */
    parts = mt == 1 ? 2 : parts;
    int32_t row_tiles = (rows + 16 * mt - 1) / (16 * mt), col_tiles = q->n_pad / MMA_COLS;
    int32_t want = 4 * cb->n_sms, blocks = row_tiles * col_tiles;
    int32_t splits = blocks >= want ? 1 : (want + blocks - 1) / blocks;
    int32_t max_splits = (q->n_chunks + STAGE_CHUNKS - 1) / STAGE_CHUNKS;
    splits = splits < max_splits ? splits : max_splits;
    qmma_args a;
    memset(&a, 0, sizeof a);
    a.q = *q, a.xh = xh, a.bias = w->bias, a.rows = rows, a.n_out = w->out;
    /* whole stages per split, so only the last split has a short stage */
    a.chunks_per_split = ((q->n_chunks + splits - 1) / splits + STAGE_CHUNKS - 1) / STAGE_CHUNKS * STAGE_CHUNKS;
    splits = (q->n_chunks + a.chunks_per_split - 1) / a.chunks_per_split;
    a.direct = splits == 1, a.accumulate = accumulate, a.out = out, a.parts = parts;
    if (!a.direct) {
        size_t bytes = (size_t)splits * rows * q->n_pad * sizeof(float);
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_partial, &cb->gemv_partial_bytes, bytes, "matmul partial sums"))
            return;
        a.out = cb->gemv_partial;
    }
    dim3 grid((unsigned)row_tiles, (unsigned)col_tiles, (unsigned)splits);
    size_t smem = qmma_smem_bytes(mt, a.chunks_per_split);
    if (mt == 1)
        parts == 1 ? launch_qmma<1, 1>(cb, grid, smem, &a) : launch_qmma<1, 2>(cb, grid, smem, &a);
    else
        parts == 1 ? launch_qmma<MAX_MT, 1>(cb, grid, smem, &a) : launch_qmma<MAX_MT, 2>(cb, grid, smem, &a);
    if (!exl_cuda_check_launch(cb, "quantized matmul (tensor cores)") || a.direct)
        return;
    int64_t n_sums = (int64_t)rows * w->out;
    exl_cuda_launch(cb, qmma_reduce_kernel, dim3((unsigned)((n_sums + 255) / 256)), dim3(256), 0, out,
            cb->gemv_partial, w->bias, rows, w->out, q->n_pad, splits, accumulate);
    exl_cuda_check_launch(cb, "quantized matmul (split sums)");
}
