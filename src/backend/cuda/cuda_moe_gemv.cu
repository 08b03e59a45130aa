/* cuda_moe_gemv.cu - the grouped GEMVs of a mixture of experts: one launch runs one projection (gate and up
 * together, or down) of every expert a step chose, each chosen expert's weights read once for all the rows that
 * chose it.
 *
 * The routes come grouped by expert from cuda_moe.cu (exl_cuda_moe_groups: group g is an expert, the first of
 * its slots and how many; a slot is one (row, choice) pair). The grid is fixed for a step's shape, so that a CUDA
 * graph can hold it: x = column tiles of the projection's matrices, y = the groups (as many as the step has
 * pairs or experts, fewer active: the others return at once), z = a split of the input chunks. A block reads its
 * group's expert from the device table of the layer's matrices (exl_linear copies), then, R slots at a time,
 * gathers their inputs, multiplies, and writes or adds its sums:
 *   - quantized (EXL2, GPTQ): 256 columns a block, 4 warp pairs taking every 4th chunk, activations gathered into
 *     slot order in fp16 pairs (pieces of PIECE chunks), products summed in fp16 over 8 inputs, then in fp32 and
 *     scaled per chunk, as cuda_qgemv.cu does;
 *   - dense fp16: a warp an output column, fp32 activations and sums.
 * The input is x at each slot's row (gate and up), or act(gate) * up at the slot (down). The output is stored
 * (split 1), added atomically (split sums onto outputs zeroed before), or, weighted by the slot's routing weight,
 * added atomically to its row of the layer's output (down: the combine fused in). */
#include "backend/cuda/cuda_qdecode.cuh"

#define MOE_THREADS 256
#define SUBS (MOE_THREADS / 64)
#define TILE EXL_QW_TILE
#define PIECE 96 /* chunks of activations gathered at a time: R x PIECE x 64 bytes of shared memory */
#define DENSE_WARPS (MOE_THREADS / 32)

typedef struct moe_args {
    const exl_linear *mats; /* device [n_experts][3]: gate, up, down */
    int32_t role0, n_roles; /* the matrices of this launch: role0 .. role0 + n_roles - 1 */
    int32_t in, n_out, col_blocks;
    int32_t chunks_per_block; /* quantized: the input chunks of a split */
    const int32_t *g_expert, *g_start, *g_count, *slot_row, *slot_pair;
    const float *x, *up; /* up NULL: x at the slots' rows; else act(x) * up at the slots */
    int32_t act;
    float *out[2];
    const float *pair_weight; /* combine: out[0] is the layer's output [rows, n_out] */
    int32_t combine, atomic;
} moe_args;

/* the offset of a slot's input row */
__device__ __forceinline__ int64_t input_row(const moe_args &a, int slot) {
    return (int64_t)(a.up ? slot : __ldg(a.slot_row + slot)) * a.in;
}

__device__ __forceinline__ float input_at(const moe_args &a, int64_t row, int s) {
    if (s < 0)
        return 0.0f;
    return a.up ? exl_cuda_activate(a.x[row + s], a.act) * a.up[row + s] : a.x[row + s];
}

/* a sum of the block for a slot: stored, added, or weighted into its row of the layer's output */
__device__ __forceinline__ void put(const moe_args &a, int role, int slot, int col, float v) {
    if (a.combine) {
        const int pair = __ldg(a.slot_pair + slot), row = __ldg(a.slot_row + slot);
        atomicAdd(a.out[0] + (int64_t)row * a.n_out + col, __ldg(a.pair_weight + pair) * v);
    } else if (a.atomic) {
        atomicAdd(a.out[role] + (int64_t)slot * a.n_out + col, v);
    } else {
        a.out[role][(int64_t)slot * a.n_out + col] = v;
    }
}

/* ---- quantized */

template <int R, int B>
__device__ __forceinline__ void chunk_dot(const uint32_t *wcol, const exl_qmatrix &q, int col0, int4 meta,
                                          const __half2 *xs, float (&acc)[R][4]) {
    uint4 wv[B];
#pragma unroll
    for (int i = 0; i < B; i++)
        wv[i] = __ldg((const uint4 *)(wcol + (int64_t)(meta.x + i) * EXL_QW_TILE));
    const int64_t g0 = (int64_t)meta.z * q.n_pad + col0;
    uint2 sraw = __ldg((const uint2 *)(q.scales + g0));
    __half sc[4];
    memcpy(sc, &sraw, 8);
#pragma unroll
    for (int c = 0; c < 4; c++) {
        uint32_t w[B];
#pragma unroll
        for (int i = 0; i < B; i++)
            w[i] = c == 0 ? wv[i].x : c == 1 ? wv[i].y : c == 2 ? wv[i].z : wv[i].w;
        const __half2 zz = zero_pair(q.zeros, g0 + c, B);
        float part[R];
        __half2 h[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            part[r] = 0.0f;
            h[r] = __float2half2_rn(0.0f);
        }
        decode_chunk<B>(w, zz, [&](int p, __half2 v) {
#pragma unroll
            for (int r = 0; r < R; r++) {
                h[r] = __hfma2(v, xs[r * PIECE * 16 + p], h[r]);
                if ((p & 3) == 3) {
                    float2 f = __half22float2(h[r]);
                    part[r] += f.x + f.y;
                    h[r] = __float2half2_rn(0.0f);
                }
            }
        });
        const float s = __half2float(sc[c]);
#pragma unroll
        for (int r = 0; r < R; r++)
            acc[r][c] += s * part[r];
    }
}

template <int R>
__device__ __forceinline__ void chunk_any(const uint32_t *wcol, const exl_qmatrix &q, int col0, int4 meta,
                                          const __half2 *xs, float (&acc)[R][4]) {
    switch (meta.y) {
    case 8: chunk_dot<R, 8>(wcol, q, col0, meta, xs, acc); break;
    case 6: chunk_dot<R, 6>(wcol, q, col0, meta, xs, acc); break;
    case 5: chunk_dot<R, 5>(wcol, q, col0, meta, xs, acc); break;
    case 3: chunk_dot<R, 3>(wcol, q, col0, meta, xs, acc); break;
    case 2: chunk_dot<R, 2>(wcol, q, col0, meta, xs, acc); break;
    default: chunk_dot<R, 4>(wcol, q, col0, meta, xs, acc); break;
    }
}

template <int R>
__global__ void __launch_bounds__(MOE_THREADS) moe_qgemv_kernel(const __grid_constant__ moe_args a) {
    __shared__ __half2 xs[R * PIECE * 16];
    __shared__ float red[SUBS][R][TILE];
    exl_pdl_start();
    const int e = a.g_expert[blockIdx.y];
    if (e < 0)
        return;
    const int s0 = a.g_start[blockIdx.y], n_slots = a.g_count[blockIdx.y];
    const int role = blockIdx.x / a.col_blocks, tile = blockIdx.x % a.col_blocks;
    const exl_linear *L = a.mats + e * 3 + a.role0 + role;
    const exl_qmatrix q = L->q;
    const float *bias = blockIdx.z == 0 ? L->bias : nullptr;
    const int tid = threadIdx.x, quad = tid % 64, sub = tid / 64;
    const int cb0 = blockIdx.z * a.chunks_per_block, cb1 = min(q.n_chunks, cb0 + a.chunks_per_block);
    const int col0 = tile * TILE + quad * 4, col = tile * TILE + tid;
    const uint32_t *wcol = exl_qw_col(q, col0);
    for (int b0 = 0; b0 < n_slots; b0 += R) {
        const int nr = min(R, n_slots - b0);
        int64_t row[R];
#pragma unroll
        for (int r = 0; r < R; r++)
            row[r] = input_row(a, s0 + b0 + (r < nr ? r : 0));
        float acc[R][4];
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                acc[r][c] = 0.0f;
        for (int p0 = cb0; p0 < cb1; p0 += PIECE) {
            const int n_loc = min(PIECE, cb1 - p0);
            for (int i = tid; i < n_loc * 16; i += MOE_THREADS) {
                const int2 sp = __ldg((const int2 *)(q.slot_src + p0 * CHUNK) + i);
#pragma unroll
                for (int r = 0; r < R; r++)
                    xs[r * PIECE * 16 + i] = r < nr ? __floats2half2_rn(input_at(a, row[r], sp.x),
                                                                        input_at(a, row[r], sp.y))
                                                    : __float2half2_rn(0.0f);
            }
            __syncthreads();
            for (int lc = sub; lc < n_loc; lc += SUBS)
                chunk_any<R>(wcol, q, col0, __ldg(q.chunks + p0 + lc), xs + lc * 16, acc);
            __syncthreads();
        }
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int c = 0; c < 4; c++)
                red[sub][r][quad * 4 + c] = acc[r][c];
        __syncthreads();
        if (col < a.n_out)
#pragma unroll
            for (int r = 0; r < R; r++) {
                if (r >= nr)
                    break;
                float v = bias ? bias[col] : 0.0f;
#pragma unroll
                for (int s = 0; s < SUBS; s++)
                    v += red[s][r][tid];
                put(a, role, s0 + b0 + r, col, v);
            }
        __syncthreads();
    }
}

/* ---- dense fp16 */

template <int R>
__global__ void __launch_bounds__(MOE_THREADS) moe_dense_kernel(const __grid_constant__ moe_args a) {
    exl_pdl_start();
    const int e = a.g_expert[blockIdx.y];
    if (e < 0)
        return;
    const int s0 = a.g_start[blockIdx.y], n_slots = a.g_count[blockIdx.y];
    const int role = blockIdx.x / a.col_blocks, lane = threadIdx.x % 32;
    const int col = (blockIdx.x % a.col_blocks) * DENSE_WARPS + threadIdx.x / 32;
    if (col >= a.n_out)
        return;
    const exl_linear *L = a.mats + e * 3 + a.role0 + role;
    const __half *wr = L->w + (int64_t)col * a.in;
    const float *bias = L->bias;
    const int vec_end = a.in % 8 == 0 ? a.in : 0;
    for (int b0 = 0; b0 < n_slots; b0 += R) {
        const int nr = min(R, n_slots - b0);
        int64_t row[R];
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            row[r] = input_row(a, s0 + b0 + (r < nr ? r : 0));
            acc[r] = 0.0f;
        }
        for (int k = lane * 8; k < vec_end; k += 256) {
            uint4 raw = __ldg((const uint4 *)(wr + k));
            __half2 h[4];
            memcpy(h, &raw, 16);
            float wf[8];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float2 f = __half22float2(h[i]);
                wf[2 * i] = f.x, wf[2 * i + 1] = f.y;
            }
#pragma unroll
            for (int r = 0; r < R; r++) {
                const float4 *xr = (const float4 *)(a.x + row[r] + k);
                float4 u = __ldg(xr), v = __ldg(xr + 1);
                float xv[8] = {u.x, u.y, u.z, u.w, v.x, v.y, v.z, v.w};
                if (a.up) {
                    const float4 *ur = (const float4 *)(a.up + row[r] + k);
                    float4 uu = __ldg(ur), uv = __ldg(ur + 1);
                    const float upv[8] = {uu.x, uu.y, uu.z, uu.w, uv.x, uv.y, uv.z, uv.w};
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        xv[i] = exl_cuda_activate(xv[i], a.act) * upv[i];
                }
#pragma unroll
                for (int i = 0; i < 8; i++)
                    acc[r] += wf[i] * xv[i];
            }
        }
        for (int k = vec_end + lane; k < a.in; k += 32) {
            const float w = __half2float(wr[k]);
#pragma unroll
            for (int r = 0; r < R; r++)
                acc[r] += w * input_at(a, row[r], k);
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            for (int o = 16; o > 0; o >>= 1)
                acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
            if (lane == 0 && r < nr)
                put(a, role, s0 + b0 + r, col, acc[r] + (bias ? bias[col] : 0.0f));
        }
    }
}

/* ---- launch */

template <int R>
static void launch_rows(exl_cuda_backend *cb, const moe_args &a, int dense, dim3 grid) {
    if (dense)
        exl_cuda_launch(cb, moe_dense_kernel<R>, grid, dim3(MOE_THREADS), 0, a);
    else
        exl_cuda_launch(cb, moe_qgemv_kernel<R>, grid, dim3(MOE_THREADS), 0, a);
}

/* The expected number of distinct experts among `pairs` uniform choices of n (at least 1): the blocks a split
 * is sized for (a function of the step's shape, so that the launch is the same step after step). */
static double expected_active(int32_t n_experts, int32_t pairs) {
    double none = 1.0;
    for (int32_t i = 0; i < pairs; i++)
        none *= 1.0 - 1.0 / n_experts;
    double a = n_experts * (1.0 - none);
    return a < 1.0 ? 1.0 : a;
}

void exl_cuda_moe_gemv(exl_cuda_backend *cb, const exl_cuda_moe_launch *l) {
    const exl_cuda_moe_groups *g = l->groups;
    const exl_linear *first = l->first;
    const int dense = first->kind == EXL_LINEAR_DENSE;
    moe_args a;
    memset(&a, 0, sizeof a);
    a.mats = l->mats, a.role0 = l->role0, a.n_roles = l->n_roles;
    a.in = first->in, a.n_out = first->out;
    a.g_expert = g->expert, a.g_start = g->start, a.g_count = g->count;
    a.slot_row = g->slot_row, a.slot_pair = g->slot_pair;
    a.x = l->x, a.up = l->up, a.act = l->act;
    a.out[0] = l->out[0], a.out[1] = l->out[1];
    a.pair_weight = l->pair_weight, a.combine = l->pair_weight != NULL;
    const double active = expected_active(g->n_experts, g->pairs);
    /* slots a group has on average: rows a pass multiplies together (1 for one row: its choices differ) */
    const double per_group = g->pairs / active;
    const int R = g->rows == 1 ? 1 : per_group <= 2.0 ? 2 : 4;
    int split = 1;
    if (dense) {
        a.col_blocks = (first->out + DENSE_WARPS - 1) / DENSE_WARPS;
    } else {
        a.col_blocks = first->q.n_pad / TILE;
        const int n_chunks = l->n_chunks, max_split = n_chunks / (2 * SUBS) > 1 ? n_chunks / (2 * SUBS) : 1;
        split = (int)(3.0 * cb->n_sms / (a.col_blocks * l->n_roles * active));
        split = split > max_split ? max_split : split < 1 ? 1 : split;
        /* a split's sums are added atomically: onto outputs zeroed for them, or weighted onto the layer's output */
        split = l->out_zeroed || a.combine ? split : 1;
        a.chunks_per_block = (n_chunks + split - 1) / split;
        split = (n_chunks + a.chunks_per_block - 1) / a.chunks_per_block;
    }
    a.atomic = split > 1;
    const dim3 grid((unsigned)(a.col_blocks * l->n_roles), (unsigned)g->n_groups, (unsigned)split);
    switch (R) {
    case 1: launch_rows<1>(cb, a, dense, grid); break;
    case 2: launch_rows<2>(cb, a, dense, grid); break;
    default: launch_rows<4>(cb, a, dense, grid); break;
    }
    exl_cuda_check_launch(cb, "moe grouped GEMV");
}
