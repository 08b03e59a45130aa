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
 * Block: 8 warps x 16 columns = 128 columns, MT m16 tiles of rows (1, 2 or 4, as few as the
 * rows need: every decoded code feeds MT x parts mma), a range of chunks (split-K to fill one
 * wave of the GPU; the splits' partial sums are added in split order by a second kernel, so
 * results do not depend on timing). The block's chunk descriptors are read into shared memory
 * first. Activations and code words are staged in shared memory 2-4 chunks at a time (the
 * block's 128 columns of a word row are 512 contiguous bytes, one warp's copy) in a ring of
 * N_STAGES buffers: the next stages are copied (cp.async) while the current one is
 * multiplied; each thread's copies are planned once. The words of the first stages are
 * requested before the wait for the previous kernel. Consecutive chunks of one group are
 * summed before their common scale is applied, and a group's scales and zeros are loaded once.
 *
 * The k order inside an mma is free as long as A and B agree: thread (g = lane / 4,
 * t = lane % 4) decodes pairs 4t .. 4t+3 of its column's chunk (for 4-bit codes, one word),
 * and k step s uses pairs 4t+2s and 4t+2s+1 as its B registers; the A registers are then
 * slots 8t+4s, 8t+4s+1 (a0: row g, a1: row g + 8) and 8t+4s+2, 8t+4s+3 (a2, a3). */
#include "backend/cuda/cuda_async.cuh"
#include "backend/cuda/cuda_mma.cuh"
#include "backend/cuda/cuda_qdecode.cuh"

#include <string.h>

#define MMA_WARPS 8
#define MMA_COLS (MMA_WARPS * 16)
#define MAX_MT 4                /* m16 tiles of rows per block at most */
#define N_STAGES 3              /* stage buffers in the ring: two copies in flight while one is multiplied */
#define FRAG_HALVES 512         /* one m16 tile of one chunk: 2 k steps x 32 lanes x 8 halves */
#define W_STRIDE (MMA_COLS + 8) /* words per staged word row; +8 spreads t over banks */

/* The staged code words of a column's chunk (col: its first word row) that pairs 4t .. 4t+3
 * (slots 8t .. 8t+7) need. */
template <int B>
__device__ __forceinline__ void load_words(const uint32_t *col, int t, uint32_t (&w)[MAX_WORDS]) {
#pragma unroll
    for (int i = 0; i < MAX_WORDS; i++)
        w[i] = i < quarter_words<B>() ? col[(quarter_first<B>(t) + i) * W_STRIDE] : 0u;
}

/* What a thread holds of its chunk's group: the zeros of its two columns (g, g + 8 of the
 * warp's 16; GPTQ only, EXL2's zero is 2^(bits - 1)) and the scales of the columns of its C
 * fragment (2t, 2t + 1 of each 8). */
typedef struct group_regs {
    int group;
    uint32_t zz[2], sc[2]; /* half2 bits */
} group_regs;

typedef struct qmma_args {
    exl_qmatrix q;
    const __half *xh; /* [2][row tiles of 16][n_chunks][FRAG_HALVES]: hi, then lo (qmma_gather_kernel;
                       * lo neither written nor read with parts = 1) */
    float *out;       /* [rows, n_out] */
    float *partial;   /* the split partials [split][rows][n_pad] (more than one split) */
    const float *bias;
    int32_t rows, n_out;
    int32_t chunks_per_split;
    int32_t accumulate; /* out += */
} qmma_args;

/* A chunk descriptor in shared memory: x = first word row, y = bits | group << 8. */
__device__ __forceinline__ int meta_bits(int2 m) { return m.y & 255; }
__device__ __forceinline__ int meta_group(int2 m) { return m.y >> 8; }

__device__ __forceinline__ void load_group(const qmma_args &a, int2 meta, int col_base, int g, int t, group_regs &r) {
    const uint32_t n_pad = (uint32_t)a.q.n_pad, at = (uint32_t)meta_group(meta) * n_pad + col_base;
    r.group = meta_group(meta);
#pragma unroll
    for (int n = 0; n < 2; n++) {
        r.zz[n] = a.q.zeros ? half2_bits(zero_pair(a.q.zeros, at + n * 8 + g, meta_bits(meta))) : 0u;
        r.sc[n] = __ldg((const uint32_t *)(a.q.scales + at + n * 8 + 2 * t));
    }
}

/* Chunks a stage holds: four, or two where MT m16 tiles of both activation parts would make
 * the ring too large for two blocks per SM. */
__host__ __device__ constexpr int stage_chunks(int mt, int parts) { return mt * parts >= 8 ? 2 : 4; }
__host__ __device__ constexpr int stage_halves(int mt, int parts) {
    return parts * mt * stage_chunks(mt, parts) * FRAG_HALVES;
}
__host__ __device__ constexpr int stage_words(int mt, int parts) { return stage_chunks(mt, parts) * 8 * W_STRIDE; }

/* One chunk of B-bit codes (words staged at sw: the chunk's first word row) times the staged
 * activations at ac (this thread's fragment of the chunk in the first tile's hi part):
 * decode, multiply into part, and when the chunk ends its group, scale part into acc and
 * load the next group's scales and zeros. */
template <int B, int MT, int P>
__device__ __forceinline__ void chunk_step(const qmma_args &a, group_regs &gr, const int2 *meta, int c, int c_end,
                                           const __half *ac, const uint32_t *sw, int col_base, int g, int t,
                                           float (&part)[MT][2][4], float (&acc)[MT][2][4]) {
    constexpr int SC = stage_chunks(MT, P);
    uint32_t pr[2][4];
    const __half2 z_exl2 = __float2half2_rn(1024.0f + (float)(1 << (B - 1)));
#pragma unroll
    for (int n = 0; n < 2; n++) {
        uint32_t w[MAX_WORDS];
        load_words<B>(sw + (threadIdx.x / 32) * 16 + n * 8 + g, t, w);
        decode_quarter<B>(w, t, a.q.zeros ? u32_as_half2(gr.zz[n]) : z_exl2, pr[n]);
    }
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int h = 0; h < P; h++) { /* hi, then lo */
            const __half *base = ac + (h * MT + m) * SC * FRAG_HALVES;
            uint4 f0 = *(const uint4 *)base, f1 = *(const uint4 *)(base + FRAG_HALVES / 2);
#pragma unroll
            for (int n = 0; n < 2; n++) {
                mma16816(part[m][n], f0.x, f0.y, f0.z, f0.w, pr[n][0], pr[n][1]);
                mma16816(part[m][n], f1.x, f1.y, f1.z, f1.w, pr[n][2], pr[n][3]);
            }
        }
    const bool more = c + 1 < c_end;
    const int2 next = meta[more ? c + 1 : c];
    if (more && meta_group(next) == gr.group)
        return;
#pragma unroll
    for (int n = 0; n < 2; n++) {
        const __half2 sc = u32_as_half2(gr.sc[n]);
        const float s_lo = __low2float(sc), s_hi = __high2float(sc);
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
    if (more)
        load_group(a, next, col_base, g, t, gr);
}

/* out[r, col .. col + 1] (+)= v (+ bias), the columns below n_out */
__device__ __forceinline__ void store_out(const qmma_args &a, int r, int col, float v0, float v1) {
    float *o = a.out + (int64_t)r * a.n_out + col;
    for (int i = 0; i < 2 && col + i < a.n_out; i++) {
        const float v = (i ? v1 : v0) + (a.bias ? a.bias[col + i] : 0.0f);
        o[i] = a.accumulate ? o[i] + v : v;
    }
}

static size_t qmma_smem_bytes(int mt, int parts, int chunks) {
    return (size_t)N_STAGES * (stage_halves(mt, parts) * sizeof(__half) + stage_words(mt, parts) * sizeof(uint32_t)) +
           (size_t)chunks * sizeof(int2);
}

/* Block: MT m16 row tiles (blockIdx.x), 128 columns (blockIdx.y; 16 a warp), the chunks of
 * split blockIdx.z. Shared memory: the stage ring (activation fragments [part][m][chunk],
 * then word rows [chunk][8][W_STRIDE]) and the descriptors of the block's chunks. */
template <int MT, int P>
__global__ void __launch_bounds__(MMA_WARPS * 32, 2) qmma_kernel(const __grid_constant__ qmma_args a) {
    constexpr int SC = stage_chunks(MT, P), SH = stage_halves(MT, P), SW = stage_words(MT, P);
    constexpr int A_VECS = SH / 8 / (MMA_WARPS * 32); /* 16-byte activation copies a thread makes a stage */
    static_assert(A_VECS * 8 * MMA_WARPS * 32 == SH, "activation stage not a whole number of copies");
    extern __shared__ __align__(16) unsigned char smem[];
    __half *sa = (__half *)smem;
    uint32_t *sw = (uint32_t *)(sa + N_STAGES * SH);
    int2 *meta = (int2 *)(sw + N_STAGES * SW);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const int n_tiles = (a.rows + 15) / 16, tile0 = blockIdx.x * MT;
    const int col0 = blockIdx.y * MMA_COLS, col_base = col0 + warp * 16; /* this warp's 16 columns */
    const int c_begin = blockIdx.z * a.chunks_per_split;
    const int n_chunks = min(a.q.n_chunks, c_begin + a.chunks_per_split) - c_begin;
    const int n_stages = (n_chunks + SC - 1) / SC;
    /* the descriptors and the code words do not depend on earlier kernels: read before the wait */
    exl_pdl_trigger();
    for (int i = threadIdx.x; i < n_chunks; i += MMA_WARPS * 32) {
        int4 m = __ldg(a.q.chunks + c_begin + i); /* word row, bits, group */
        meta[i] = make_int2(m.x, m.y | m.z << 8);
    }
    __syncthreads();
    /* activation copy i of a stage: vector v = threadIdx.x + 256 i of [part][m][chunk][64] */
    const __half *x_src = a.xh + ((int64_t)tile0 * a.q.n_chunks + c_begin) * FRAG_HALVES + threadIdx.x % 64 * 8;
    const uint32_t *w_src = exl_qw_col(a.q, col0 + 4 * lane); /* a warp copies word row `warp` of each chunk */
    auto copy_words = [&](int s) {
        uint32_t *dst = sw + (s % N_STAGES) * SW + warp * W_STRIDE + 4 * lane;
#pragma unroll
        for (int ci = 0; ci < SC; ci++) {
            const int c = s * SC + ci;
            if (c < n_chunks && warp < meta_bits(meta[c]))
                exl_cp16(exl_smem_addr(dst + ci * 8 * W_STRIDE),
                         w_src + (uint32_t)(meta[c].x + warp) * (uint32_t)EXL_QW_TILE);
        }
    };
    auto copy_acts = [&](int s) {
        __half *dst = sa + (s % N_STAGES) * SH + threadIdx.x * 8;
#pragma unroll
        for (int i = 0; i < A_VECS; i++) {
            const int u = threadIdx.x / 64 + i * (MMA_WARPS * 32 / 64);
            const int ci = u % SC, m = u / SC % MT, part = u / (SC * MT), c = s * SC + ci;
            if (c < n_chunks && tile0 + m < n_tiles)
                exl_cp16(exl_smem_addr(dst + i * MMA_WARPS * 32 * 8),
                         x_src + (((int64_t)part * n_tiles + m) * a.q.n_chunks + c) * FRAG_HALVES);
        }
    };
    /* the ring: stage s in buffer s % N_STAGES, N_STAGES - 1 stages in flight; one copy group
     * is committed per stage (empty ones too) so wait_group counts stages. The words of the
     * first stages go into the first group, before the wait for the activations. */
    for (int s = 0; s < N_STAGES - 1 && s < n_stages; s++)
        copy_words(s);
    exl_pdl_wait();
    for (int s = 0; s < N_STAGES - 1; s++) {
        if (s < n_stages)
            copy_acts(s);
        exl_cp_commit();
    }

    float acc[MT][2][4], part[MT][2][4];
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                acc[m][n][i] = part[m][n][i] = 0.0f;
    group_regs gr;
    if (n_chunks > 0)
        load_group(a, meta[0], col_base, g, t, gr);

    for (int st = 0; st < n_stages; st++) {
        exl_cp_wait<N_STAGES - 2>();
        __syncthreads(); /* stage st is in; everyone is done with the buffer of stage st - 1 */
        const int nx = st + N_STAGES - 1;
        if (nx < n_stages)
            copy_words(nx), copy_acts(nx);
        exl_cp_commit();
        const __half *buf = sa + (st % N_STAGES) * SH + 8 * lane;
        const uint32_t *wbuf = sw + (st % N_STAGES) * SW;
#pragma unroll 1
        for (int ci = 0; ci < SC; ci++) {
            const int c = st * SC + ci;
            if (c >= n_chunks)
                break;
            const __half *ac = buf + ci * FRAG_HALVES;
            const uint32_t *wc = wbuf + ci * 8 * W_STRIDE;
            switch (meta_bits(meta[c])) { /* one branch per chunk, the same in the whole warp */
            case 2: chunk_step<2, MT, P>(a, gr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 3: chunk_step<3, MT, P>(a, gr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 4: chunk_step<4, MT, P>(a, gr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 5: chunk_step<5, MT, P>(a, gr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            case 6: chunk_step<6, MT, P>(a, gr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            default: chunk_step<8, MT, P>(a, gr, meta, c, n_chunks, ac, wc, col_base, g, t, part, acc); break;
            }
        }
    }

    /* C fragment: c0, c1 at (row g, cols 2t, 2t+1), c2, c3 at (row g + 8, same cols) */
    const int row0 = tile0 * 16;
    const bool split = gridDim.z > 1;
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                const int r = row0 + m * 16 + g + hf * 8, col = col_base + n * 8 + 2 * t;
                const float v0 = acc[m][n][2 * hf], v1 = acc[m][n][2 * hf + 1];
                if (r >= a.rows)
                    continue;
                if (split)
                    *(float2 *)(a.partial + ((int64_t)blockIdx.z * a.rows + r) * a.q.n_pad + col) = make_float2(v0, v1);
                else
                    store_out(a, r, col, v0, v1);
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

/* Blocks of qmma_kernel<MT, P> an SM of cb's device holds with smem bytes of shared memory (the attribute set once
 * per kernel, size and device), 0 when the launch cannot be configured. */
template <int MT, int P>
static int qmma_blocks_per_sm(const exl_cuda_backend *cb, size_t smem) {
    static size_t allowed[EXL_CUDA_MAX_DEVICES];
    if (!exl_cuda_smem_opt_in(cb, (const void *)qmma_kernel<MT, P>, smem, allowed))
        return 0;
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, qmma_kernel<MT, P>, MMA_WARPS * 32, smem) == cudaSuccess
               ? n
               : 0;
}

typedef int (*qmma_occupancy_fn)(const exl_cuda_backend *, size_t);
typedef void (*qmma_kernel_fn)(qmma_args);

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
    const int qrows = cb->qrows == EXL_CUDA_QROWS_ALL ||
                      (cb->qrows == EXL_CUDA_QROWS_AUTO && rows <= EXL_CUDA_QROWS_AUTO_ROWS &&
                       (w->in >= EXL_CUDA_QROWS_AUTO_WIDTH || w->out >= EXL_CUDA_QROWS_AUTO_WIDTH));
    if (parts == 1 && qrows && exl_cuda_qrows(cb, out, x, up, act, w, rows, accumulate))
        return;
    static const qmma_kernel_fn kernels[3][2] = {{qmma_kernel<1, 1>, qmma_kernel<1, 2>},
                                                 {qmma_kernel<2, 1>, qmma_kernel<2, 2>},
                                                 {qmma_kernel<4, 1>, qmma_kernel<4, 2>}};
    static const qmma_occupancy_fn occupancy[3][2] = {{qmma_blocks_per_sm<1, 1>, qmma_blocks_per_sm<1, 2>},
                                                      {qmma_blocks_per_sm<2, 1>, qmma_blocks_per_sm<2, 2>},
                                                      {qmma_blocks_per_sm<4, 1>, qmma_blocks_per_sm<4, 2>}};
    const exl_qmatrix *q = &w->q;
    int64_t total = (int64_t)(rows + 15) / 16 * q->n_chunks * FRAG_HALVES; /* halves per part */
    if (!exl_cuda_ensure(cb, &cb->scratch, &cb->scratch_bytes, 2 * (size_t)total * sizeof(__half), "fp16 activations"))
        return;
    const int mt = rows <= 16 ? 1 : rows <= 32 ? 2 : MAX_MT, mi = mt == 1 ? 0 : mt == 2 ? 1 : 2;
    __half *xh = (__half *)cb->scratch;
    exl_cuda_launch(cb, qmma_gather_kernel, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, xh, x, up, act,
                    q->slot_src, w->in, rows, total, q->n_chunks, parts);
    if (!exl_cuda_check_launch(cb, "quantized matmul (activations)"))
        return;
    const int sc = stage_chunks(mt, parts);
    const size_t smem_max = qmma_smem_bytes(mt, parts, q->n_chunks);
    const int per_sm = occupancy[mi][parts - 1](cb, smem_max);
    if (per_sm < 1) {
        if (exl_cuda_check_launch(cb, "quantized matmul (shared memory)"))
            exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED,
                                "quantized matmul: a block with %zu bytes of shared memory does not fit on this GPU",
                                smem_max);
        return;
    }
    /* split-K to fill one wave of the GPU, in whole stages, so only the last split has a short one */
    int32_t row_tiles = (rows + 16 * mt - 1) / (16 * mt), col_tiles = q->n_pad / MMA_COLS;
    int32_t want = per_sm * cb->n_sms, blocks = row_tiles * col_tiles;
    int32_t splits = blocks >= want ? 1 : want / blocks;
    int32_t max_splits = (q->n_chunks + sc - 1) / sc;
    splits = splits < max_splits ? splits : max_splits;
    qmma_args a;
    memset(&a, 0, sizeof a);
    a.q = *q, a.xh = xh, a.bias = w->bias, a.rows = rows, a.n_out = w->out;
    a.chunks_per_split = ((q->n_chunks + splits - 1) / splits + sc - 1) / sc * sc;
    splits = (q->n_chunks + a.chunks_per_split - 1) / a.chunks_per_split;
    a.accumulate = accumulate, a.out = out;
    if (splits > 1) {
        size_t bytes = (size_t)splits * rows * q->n_pad * sizeof(float);
        if (!exl_cuda_ensure(cb, (void **)&cb->gemv_partial, &cb->gemv_partial_bytes, bytes, "matmul partial sums"))
            return;
        a.partial = cb->gemv_partial;
    }
    dim3 grid((unsigned)row_tiles, (unsigned)col_tiles, (unsigned)splits);
    exl_cuda_launch(cb, kernels[mi][parts - 1], grid, dim3(MMA_WARPS * 32),
                    qmma_smem_bytes(mt, parts, a.chunks_per_split), a);
    if (!exl_cuda_check_launch(cb, "quantized matmul (tensor cores)") || splits == 1)
        return;
    int64_t n_sums = (int64_t)rows * w->out;
    exl_cuda_launch(cb, qmma_reduce_kernel, dim3((unsigned)((n_sums + 255) / 256)), dim3(256), 0, out, cb->gemv_partial,
                    w->bias, rows, w->out, q->n_pad, splits, accumulate);
    exl_cuda_check_launch(cb, "quantized matmul (split sums)");
}
