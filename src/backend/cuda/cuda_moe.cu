/* cuda_moe.cu - mixture of experts on the GPU: routes, and the chosen experts run on the rows that chose them.
 *
 * moe_route: a warp a row picks its top_k experts (a warp-wide arg max per choice, the CPU's order: larger
 * first, lower id first among equals, NaN after every number) and their softmax weights, as cpu_moe.c does.
 *
 * moe_experts, decode-sized steps (exl_cuda_moe_on_device): no host round trip and launches of a fixed shape, so
 * that the step is captured into a CUDA graph like a dense one. One block sorts the step's (row, choice) pairs by
 * expert into slots and groups (exl_cuda_moe_groups: each chosen expert once, with its slots); then one grouped
 * GEMV launch computes every chosen expert's gate and up, and one its down_proj of act(gate) * up, whose sums,
 * weighted by the routes, it adds straight onto the layer's output (cuda_moe_gemv.cu). Each chosen expert's
 * weights are read once per launch, however many rows chose it. The experts' matrices are read from a device
 * table per layer (their exl_linear structs), uploaded the first time a layer runs. With EXL_CUDA_DETERMINISTIC=1
 * no sums are added atomically: down_proj stores each slot's output and a combine launch adds them in order.
 *
 * Prompts (more rows, or prompt pieces: exl_cuda_prompt_piece, cuda_internal.h) wait for the routes on the
 * host (one read-back a layer), sort the pairs there (a counting sort), gather each chosen expert's rows and run
 * its gate and up as one fused matmul and its down_proj with the GLU fused in, through the many-row kernels (tensor
 * cores, cuBLAS) at prompt precision, then combine: a prompt step is never captured. EXL_CUDA_MOE_DEVICE=0 sends
 * decode steps that way too (the earlier behaviour, for comparisons). */
#include "backend/cuda/cuda_internal.h"

#include <stdlib.h>
#include <string.h>

#define ROUTE_WARPS 4
#define ROW_THREADS 256
/* the device path: experts a warp's taken mask covers (route), threads of the sorting block (groups) */
#define MAX_DEVICE_EXPERTS 1024
#define MAX_DEVICE_PAIRS 1024

/* ---- moe_route */

/* 1 if (v, e) comes before (bv, be) in the CPU's order */
__device__ __forceinline__ bool route_before(float v, int e, float bv, int be) {
    const bool vn = v != v, bn = bv != bv;
    if (vn != bn)
        return bn;
    if (!vn && v != bv)
        return v > bv;
    return e < be;
}

__global__ void __launch_bounds__(ROUTE_WARPS * 32)
    moe_route_kernel(float *weights, int32_t *ids, const float *logits, int32_t rows, int32_t n_experts, int32_t top_k,
                     int32_t renormalize) {
    exl_pdl_start();
    const int r = blockIdx.x * ROUTE_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= rows)
        return;
    const float *l = logits + (int64_t)r * n_experts;
    int32_t *id = ids + (int64_t)r * top_k;
    float *w = weights + (int64_t)r * top_k;
    uint32_t taken = 0; /* bit i: expert lane + 32 i chosen */
    float top = 0.0f;
    for (int j = 0; j < top_k; j++) {
        float bv = 0.0f;
        int be = -1;
        for (int i = 0, e = lane; e < n_experts; i++, e += 32)
            if (!(taken >> i & 1u) && (be < 0 || route_before(l[e], e, bv, be)))
                bv = l[e], be = e;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe >= 0 && (be < 0 || route_before(ov, oe, bv, be)))
                bv = ov, be = oe;
        }
        if (be >= 0 && be % 32 == lane)
            taken |= 1u << (be / 32);
        if (j == 0)
            top = bv;
        if (lane == 0)
            id[j] = be;
    }
    float sum = 0.0f;
    for (int e = lane; e < n_experts; e += 32)
        sum += expf(l[e] - top);
    for (int o = 16; o > 0; o >>= 1)
        sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane != 0)
        return;
    float chosen = 0.0f;
    for (int j = 0; j < top_k; j++) {
        w[j] = expf(l[id[j]] - top) / sum;
        chosen += w[j];
    }
    for (int j = 0; renormalize && j < top_k; j++)
        w[j] /= chosen;
}

void exl_cuda_run_moe_route(exl_backend *be, const exl_moe_route_node *n) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n->rows < 1)
        return;
    if (n->n_experts > 32 * 32) {
        exl_cuda_set_sticky(cb, EXL_ERR_UNSUPPORTED, "moe route: %d experts (CUDA routes up to %d)", n->n_experts,
                            32 * 32);
        return;
    }
    exl_cuda_launch(cb, moe_route_kernel, dim3((unsigned)((n->rows + ROUTE_WARPS - 1) / ROUTE_WARPS)),
                    dim3(ROUTE_WARPS * 32), 0, n->weights, n->ids, n->logits, n->rows, n->n_experts, n->top_k,
                    n->renormalize);
    exl_cuda_check_launch(cb, "moe route");
}

/* ---- the experts' device tables */

struct exl_cuda_moe_table {
    const exl_expert *key; /* the node's host array */
    int32_t n_experts;
    exl_linear *host, *dev; /* [n_experts][3]: gate, up, down, as uploaded */
};

static void fill_mats(exl_linear *m, const exl_moe_experts_node *n) {
    for (int32_t e = 0; e < n->n_experts; e++) {
        m[3 * e] = *n->experts[e].gate;
        m[3 * e + 1] = *n->experts[e].up;
        m[3 * e + 2] = *n->experts[e].down;
    }
}

/* the device table of n's experts, uploaded when new or changed (outside any capture); NULL on failure (sticky
 * set) */
static const exl_linear *moe_table(exl_cuda_backend *cb, const exl_moe_experts_node *n) {
    const size_t bytes = (size_t)n->n_experts * 3 * sizeof(exl_linear);
    exl_cuda_moe_table *t = NULL;
    for (int32_t i = 0; i < cb->n_moe_tables && !t; i++)
        if (cb->moe_tables[i].key == n->experts && cb->moe_tables[i].n_experts == n->n_experts)
            t = &cb->moe_tables[i];
    exl_linear *now = (exl_linear *)calloc((size_t)n->n_experts * 3, sizeof *now);
    if (!now) {
        exl_cuda_set_sticky(cb, EXL_ERR_NOMEM, "out of host memory for a mixture of experts' table");
        return NULL;
    }
    fill_mats(now, n);
    if (t && !memcmp(t->host, now, bytes)) {
        free(now);
        return t->dev;
    }
    if (!t) {
        if (cb->n_moe_tables == cb->cap_moe_tables) {
            int32_t cap = cb->cap_moe_tables ? 2 * cb->cap_moe_tables : 64;
            exl_cuda_moe_table *g = (exl_cuda_moe_table *)realloc(cb->moe_tables, (size_t)cap * sizeof *g);
            if (!g) {
                free(now);
                exl_cuda_set_sticky(cb, EXL_ERR_NOMEM, "out of host memory for a mixture of experts' table");
                return NULL;
            }
            cb->moe_tables = g;
            cb->cap_moe_tables = cap;
        }
        t = &cb->moe_tables[cb->n_moe_tables++];
        memset(t, 0, sizeof *t);
        t->key = n->experts, t->n_experts = n->n_experts;
    }
    exl_cuda_graph_flush(cb); /* no allocation or upload inside a capture */
    free(t->host);
    t->host = now;
    if (!t->dev && exl_cuda_malloc((void **)&t->dev, bytes, "experts' table") != EXL_OK) {
        exl_cuda_set_sticky(cb, EXL_ERR_NOMEM, "out of GPU memory for a mixture of experts' table");
        return NULL;
    }
    cudaError_t e = cudaMemcpyAsync(t->dev, now, bytes, cudaMemcpyHostToDevice, cb->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cb->stream); /* pageable memory */
    if (e != cudaSuccess) {
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: the experts' table: %s", cudaGetErrorString(e));
        return NULL;
    }
    return t->dev;
}

void exl_cuda_moe_free(exl_cuda_backend *cb) {
    for (int32_t i = 0; i < cb->n_moe_tables; i++) {
        free(cb->moe_tables[i].host);
        cudaFree(cb->moe_tables[i].dev);
    }
    free(cb->moe_tables);
    cudaFree(cb->moe_groups);
    free(cb->moe_host);
}

/* 1 if the grouped kernels take every expert of n: gate and up of one kind (dense or quantized), down of one, all
 * of the node's shapes */
static int experts_uniform(const exl_moe_experts_node *n) {
    const exl_expert *x0 = &n->experts[0];
    if (!x0->gate || !x0->up || !x0->down || (x0->gate->kind == EXL_LINEAR_DENSE) != (x0->up->kind == EXL_LINEAR_DENSE))
        return 0;
    for (int32_t e = 0; e < n->n_experts; e++) {
        const exl_linear *m[3] = {n->experts[e].gate, n->experts[e].up, n->experts[e].down};
        const exl_linear *m0[3] = {x0->gate, x0->gate, x0->down};
        for (int i = 0; i < 3; i++) {
            if (!m[i] || (m[i]->kind == EXL_LINEAR_DENSE) != (m0[i]->kind == EXL_LINEAR_DENSE) ||
                m[i]->in != (i == 2 ? n->ffn : n->width) || m[i]->out != (i == 2 ? n->width : n->ffn))
                return 0;
            if (m[i]->kind != EXL_LINEAR_DENSE && m[i]->q.n_pad != m0[i]->q.n_pad)
                return 0;
        }
    }
    return 1;
}

int exl_cuda_moe_on_device(const exl_cuda_backend *cb, const exl_moe_experts_node *n) {
    return !cb->moe_host_routes && n->rows >= 1 && n->rows <= EXL_CUDA_GRAPH_MAX_ROWS &&
           (int64_t)n->rows * n->top_k <= MAX_DEVICE_PAIRS && n->n_experts >= 1 && n->n_experts <= MAX_DEVICE_EXPERTS &&
           experts_uniform(n);
}

/* ---- the device path */

/* Block 0, a thread an expert: each expert's pairs in pair order become its slots (slot_row, slot_pair, and
 * pair_slot for each pair, -1 for an id outside the experts), each expert chosen at all a group (in expert
 * order: g_expert, g_start, g_count; the groups after the last one get expert -1). The other blocks zero the
 * n_zero floats of zero0 and zero1 (gate and up, for the split sums the grouped GEMV adds onto them). */
__global__ void moe_groups_kernel(int32_t *slot_row, int32_t *pair_slot, int32_t *slot_pair, int32_t *g_expert,
                                  int32_t *g_start, int32_t *g_count, const int32_t *ids, int32_t pairs,
                                  int32_t n_experts, int32_t top_k, int32_t n_groups, float *zero0, float *zero1,
                                  int64_t n_zero) {
    extern __shared__ int32_t sh_ids[]; /* [pairs] */
    __shared__ int2 scan[MAX_DEVICE_EXPERTS];
    exl_pdl_start();
    const int t = threadIdx.x;
    if (blockIdx.x > 0) {
        const int64_t stride = (int64_t)(gridDim.x - 1) * blockDim.x;
        for (int64_t i = (int64_t)(blockIdx.x - 1) * blockDim.x + t; i < n_zero; i += stride)
            zero0[i] = 0.0f, zero1[i] = 0.0f;
        return;
    }
    for (int p = t; p < pairs; p += blockDim.x) {
        const int32_t id = ids[p];
        sh_ids[p] = id;
        if (id < 0 || id >= n_experts)
            pair_slot[p] = -1;
    }
    __syncthreads();
    int count = 0;
    for (int p = 0; t < n_experts && p < pairs; p++)
        count += sh_ids[p] == t;
    scan[t] = make_int2(count, count > 0);
    for (int off = 1; off < (int)blockDim.x; off <<= 1) {
        __syncthreads();
        const int2 v = t >= off ? scan[t - off] : make_int2(0, 0);
        __syncthreads();
        scan[t].x += v.x, scan[t].y += v.y;
    }
    __syncthreads();
    const int n_active = scan[blockDim.x - 1].y;
    if (count > 0) {
        const int g = scan[t].y - 1;
        int s = scan[t].x - count;
        g_expert[g] = t, g_start[g] = s, g_count[g] = count;
        for (int p = 0; p < pairs; p++)
            if (sh_ids[p] == t) {
                slot_row[s] = p / top_k, slot_pair[s] = p;
                pair_slot[p] = s++;
            }
    }
    for (int g = n_active + t; g < n_groups; g += blockDim.x)
        g_expert[g] = -1, g_start[g] = 0, g_count[g] = 0;
}

/* out[r] += sum over r's choices j of weights[r, j] * ys[pair_slot[r, j]] */
__global__ void moe_combine_kernel(float *out, const float *ys, const float *weights, const int32_t *pair_slot,
                                   int32_t width, int32_t top_k) {
    exl_pdl_start();
    const int32_t r = blockIdx.y;
    for (int32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < width; i += gridDim.x * blockDim.x) {
        float acc = 0.0f;
        for (int32_t j = 0; j < top_k; j++) {
            const int32_t s = pair_slot[(int64_t)r * top_k + j];
            if (s >= 0)
                acc += weights[(int64_t)r * top_k + j] * ys[(int64_t)s * width + i];
        }
        out[(int64_t)r * width + i] += acc;
    }
}

static void combine(exl_cuda_backend *cb, const exl_moe_experts_node *n, const int32_t *pair_slot) {
    dim3 grid((unsigned)((n->width + ROW_THREADS - 1) / ROW_THREADS), (unsigned)n->rows);
    exl_cuda_launch(cb, moe_combine_kernel, grid, dim3(ROW_THREADS), 0, n->out, (const float *)n->xs, n->weights,
                    pair_slot, n->width, n->top_k);
    exl_cuda_check_launch(cb, "moe combine");
}

/* the most input chunks of the experts' gate and up (down 0) or down_proj (1), where quantized */
static int32_t most_chunks(const exl_moe_experts_node *n, int down) {
    int32_t most = 0;
    for (int32_t e = 0; e < n->n_experts; e++) {
        const exl_linear *m[2] = {down ? n->experts[e].down : n->experts[e].gate, down ? NULL : n->experts[e].up};
        for (int i = 0; i < 2; i++)
            if (m[i] && m[i]->kind != EXL_LINEAR_DENSE && m[i]->q.n_chunks > most)
                most = m[i]->q.n_chunks;
    }
    return most;
}

static void run_on_device(exl_cuda_backend *cb, const exl_moe_experts_node *n) {
    const exl_linear *mats = moe_table(cb, n);
    if (!mats)
        return;
    const int32_t pairs = n->rows * n->top_k, n_groups = pairs < n->n_experts ? pairs : n->n_experts;
    const size_t ints = (size_t)pairs + 3 * (size_t)n_groups;
    if (!exl_cuda_ensure(cb, (void **)&cb->moe_groups, &cb->moe_groups_bytes, ints * sizeof(int32_t),
                         "experts' groups"))
        return;
    int32_t *slot_row = n->slots, *pair_slot = n->slots + pairs;
    int32_t *slot_pair = cb->moe_groups, *g_expert = slot_pair + pairs, *g_start = g_expert + n_groups,
            *g_count = g_start + n_groups;
    /* gate and up zeroed alongside, unless their sums are stored (EXL_CUDA_DETERMINISTIC=1) */
    const int64_t n_zero = cb->deterministic ? 0 : (int64_t)pairs * n->ffn;
    const unsigned threads = (unsigned)((n->n_experts + 31) / 32 * 32);
    const unsigned zero_blocks = (unsigned)((n_zero + 8191) / 8192 < 64 ? (n_zero + 8191) / 8192 : 64);
    exl_cuda_launch(cb, moe_groups_kernel, dim3(1 + zero_blocks), dim3(threads), (size_t)pairs * sizeof(int32_t),
                    slot_row, pair_slot, slot_pair, g_expert, g_start, g_count, n->ids, pairs, n->n_experts, n->top_k,
                    n_groups, n->gate, n->up, n_zero);
    if (!exl_cuda_check_launch(cb, "moe groups"))
        return;
    const exl_cuda_moe_groups groups = {g_expert, g_start, g_count, slot_row,    slot_pair,
                                        n_groups, pairs,   n->rows, n->n_experts};
    exl_cuda_moe_launch l;
    memset(&l, 0, sizeof l);
    l.groups = &groups, l.mats = mats, l.act = n->act, l.out_zeroed = n_zero > 0;
    /* gate and up of each slot */
    l.first = n->experts[0].gate, l.role0 = 0, l.n_roles = 2, l.n_chunks = most_chunks(n, 0);
    l.x = n->x, l.out[0] = n->gate, l.out[1] = n->up;
    exl_cuda_moe_gemv(cb, &l);
    /* down_proj of act(gate) * up, weighted onto the output (or each slot's, then combined in order) */
    l.first = n->experts[0].down, l.role0 = 2, l.n_roles = 1, l.n_chunks = most_chunks(n, 1);
    l.x = n->gate, l.up = n->up, l.out[1] = NULL, l.out_zeroed = 0;
    if (cb->deterministic) {
        l.out[0] = n->xs;
        exl_cuda_moe_gemv(cb, &l);
        combine(cb, n, pair_slot);
    } else {
        l.out[0] = n->out, l.pair_weight = n->weights;
        exl_cuda_moe_gemv(cb, &l);
    }
}

/* ---- prompts: the routes on the host */

/* the host's copy of the routes and the sorted pairs: ids, slot_row, pair_slot, slot_expert of pairs each, then
 * n_experts + 1 slot counts */
static int32_t *host_tables(exl_cuda_backend *cb, int64_t pairs, int32_t n_experts) {
    size_t need = 4 * (size_t)pairs + (size_t)n_experts + 1;
    if (need > cb->moe_host_count) {
        int32_t *p = (int32_t *)realloc(cb->moe_host, need * sizeof *p);
        if (!p) {
            exl_cuda_set_sticky(cb, EXL_ERR_NOMEM, "out of host memory routing a mixture of experts");
            return NULL;
        }
        cb->moe_host = p;
        cb->moe_host_count = need;
    }
    return cb->moe_host;
}

/* a fused matmul of the prompt path (rows of prompt precision) */
static void run_fused(exl_cuda_backend *cb, exl_cuda_fused_mm *f) {
    const size_t need = exl_cuda_fused_scratch_need(cb, f) * sizeof(float);
    if (!need || exl_cuda_ensure(cb, (void **)&cb->fused_scratch, &cb->fused_scratch_bytes, need, "matmul scratch"))
        exl_cuda_run_matmul_fused(&cb->base, f);
}

/* The slots in expert order (a counting sort, pairs in order within an expert): slot_row, pair_slot (-1 for an id
 * outside the experts), slot_expert; the slots' number. */
static int64_t sort_pairs(const exl_moe_experts_node *n, int32_t *h, int64_t pairs) {
    int32_t *ids = h, *slot_row = h + pairs, *pair_slot = h + 2 * pairs, *slot_expert = h + 3 * pairs;
    int32_t *next = h + 4 * pairs; /* [n_experts + 1]: counts, then each expert's next slot */
    memset(next, 0, ((size_t)n->n_experts + 1) * sizeof *next);
    for (int64_t p = 0; p < pairs; p++)
        if (ids[p] >= 0 && ids[p] < n->n_experts)
            next[ids[p] + 1]++;
    for (int32_t x = 0; x < n->n_experts; x++)
        next[x + 1] += next[x];
    const int64_t s = next[n->n_experts];
    for (int64_t p = 0; p < pairs; p++) {
        const int32_t x = ids[p];
        if (x < 0 || x >= n->n_experts) {
            pair_slot[p] = -1;
            continue;
        }
        const int32_t at = next[x]++;
        slot_row[at] = (int32_t)(p / n->top_k), slot_expert[at] = x, pair_slot[p] = at;
    }
    return s;
}

static void run_on_host_routes(exl_cuda_backend *cb, const exl_moe_experts_node *n) {
    exl_backend *be = &cb->base;
    const int64_t pairs = (int64_t)n->rows * n->top_k;
    int32_t *h = pairs > 0 ? host_tables(cb, pairs, n->n_experts) : NULL;
    if (!h)
        return;
    cudaError_t e = cudaMemcpyAsync(h, n->ids, (size_t)pairs * sizeof(int32_t), cudaMemcpyDeviceToHost, cb->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(cb->stream);
    if (e != cudaSuccess) {
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: reading the experts' routes: %s", cudaGetErrorString(e));
        return;
    }
    const int64_t s = sort_pairs(n, h, pairs);
    const int32_t *slot_expert = h + 3 * pairs;
    /* slot_row then pair_slot, as the node's slots; pageable memory: the copy is staged before this returns */
    e = cudaMemcpyAsync(n->slots, h + pairs, 2 * (size_t)pairs * sizeof(int32_t), cudaMemcpyHostToDevice, cb->stream);
    if (e != cudaSuccess) {
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: the experts' row tables: %s", cudaGetErrorString(e));
        return;
    }
    exl_cuda_run_gather_rows(be, n->xs, n->x, n->slots, (int32_t)s, n->width);
    for (int64_t first = 0, end; first < s; first = end) {
        const exl_expert *x = &n->experts[slot_expert[first]];
        for (end = first + 1; end < s && slot_expert[end] == slot_expert[first];)
            end++;
        float *xs = n->xs + first * n->width, *gate = n->gate + first * n->ffn, *up = n->up + first * n->ffn;
        exl_cuda_fused_mm f;
        memset(&f, 0, sizeof f);
        f.rows = (int32_t)(end - first), f.n = 2, f.in_features = n->width; /* gate and up */
        f.out_features[0] = f.out_features[1] = n->ffn;
        f.x = xs, f.w[0] = x->gate, f.w[1] = x->up, f.out[0] = gate, f.out[1] = up;
        run_fused(cb, &f);
        f.n = 1; /* down_proj of the GLU, the slots' outputs where their inputs were */
        f.in_features = n->ffn, f.out_features[0] = n->width, f.out_features[1] = 0;
        f.x = gate, f.up = up, f.act = n->act, f.w[0] = x->down, f.w[1] = NULL, f.out[0] = xs, f.out[1] = NULL;
        run_fused(cb, &f);
    }
    combine(cb, n, (const int32_t *)n->slots + pairs);
}

void exl_cuda_run_moe_experts(exl_backend *be, const exl_moe_experts_node *n, int prompt) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (n->rows < 1)
        return;
    if (!prompt && exl_cuda_moe_on_device(cb, n))
        run_on_device(cb, n);
    else
        run_on_host_routes(cb, n);
}
