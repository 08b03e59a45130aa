/* cuda_lora_overlap.cu - the lora op's batch path (cuda_lora_batch.cu) beside the matmul it goes with, its shrink off
 * the step's critical path (EXL_CUDA_LORA_OVERLAP=1 by default, 2, 3 or 0: off; r2-lora6, issue 33).
 *
 * The shrink reads only the node's input (x, normed on the way or through the GLU), which the matmul beside the node
 * does not write: the projections' own matmul right before it (q/k/v, o, gate/up: the node adds to their outputs),
 * or down_proj's right after it (the node reads the GLU's input, and adds to the residual that down_proj adds onto).
 * The plan hands the node to that matmul's launch (cuda_plan.cu, plan_lora_overlap), which then runs
 *   fork   the node's scratch ready, an event recorded on the backend's stream, the second stream waiting for it, the
 *          shrink launched there;
 *   the matmul's kernels on the backend's stream, while the shrink runs;
 *   join   an event recorded on the second stream after the shrink, the backend's stream waiting for it, the expand
 *          on the backend's stream (after the matmul: the updates go onto its outputs, or onto ones it adds to).
 * In a captured step the two events are the CUDA graph's fork and join (legal during capture): the shrink becomes a
 * parallel branch beside the matmul's nodes. At 32 uses of a 7B layer the four shrinks were 56 of the batch path's
 * 97 us of kernel time (ncu); the expands (~41 us) stay on the critical path.
 * The shrink goes without programmatic dependent launch (a full dependency on the kernel before the fork, which has
 * the same meaning as the wait it would do); the expand with it (=1: it may start while the matmul's last kernel
 * ends, as any kernel after another; its dependency on the shrink is the join's), or without it (=2: full
 * dependencies on both, should a driver refuse a programmatic edge into a node that joins two streams).
 * What the overlap can win depends on the block scheduler: cuda_qmma.cu's blocks (125 registers, 2 an SM) fill an
 * SM's registers, so a shrink block (256 threads, ~102 registers) beside them takes the place of one of them until it
 * ends, and the matmul's next kernels, launched early (PDL), hold their places while they wait. The shrink alone is
 * latency-bound (~40% of the registers of the SMs it runs on, 10-19 us), so beside the matmul it should cost its
 * share of the SMs' time, not its length; if it is starved instead (dispatched only where the matmul leaves room),
 * the join waits for the rest. =3: as 1, the shrink at the device's greatest scheduling priority (its blocks
 * dispatched before the matmul's waiting ones; the CUDA graph instantiated with per-node priorities).
 * =4 (r2-lora7): the expand leaves the critical path too. It runs on the second stream right after the shrink, into
 * a delta buffer of its own (cb->lora_delta: [rows, out_features[o]] one output after another, zero at rest), not
 * onto the matmul's outputs; the updates then go where those outputs are finished anyway: cuda_qmma.cu's split-sum
 * reduce of the node's last output (or of any output after it, once joined) takes its delta beside the bias and sets
 * it back to zero (exl_cuda_lora_delta_take: the join right before that reduce, where the matmul's out, rows and
 * width are exactly the node's output's), and adds those of the outputs whose own reduces came before it (q and k
 * beside v's, gate beside up's) with threads of its own. The outputs no reduce took (one split, the fused last-block
 * sums, the GEMVs, cuBLAS, dense weights) get theirs from one add kernel after the join, at the place where =1's
 * expand adds them. */
#include "backend/cuda/cuda_lora_batch.cuh"

#include <stdlib.h>
#include <string.h>

#define OVERLAP_DEFAULT 1 /* EXL_CUDA_LORA_OVERLAP unset: 1 (H100: batch 32 over 4 adapters 0.801 -> 0.835) */
#define OVERLAP_DELTA 4   /* the mode whose expand runs on the second stream too */

/* lora_delta_state's bits: the forked node's updates wait in cb->lora_delta; the second stream joined by a reduce
 * that took some; output o's taken (DELTA_TAKEN << o); output o's reduce launched before the join (DELTA_DONE << o:
 * the output is finished when the joining reduce runs, which may add its updates too) */
enum { DELTA_PENDING = 1, DELTA_JOINED = 2, DELTA_TAKEN = 4, DELTA_DONE = 4 << EXL_LORA_MAX_OUT };

/* EXL_CUDA_LORA_OVERLAP: 1, 2 or 3 (expand with or without programmatic dependent launch; 3: as 1, the shrink at the
 * greatest priority), 4 (the expand on the second stream as well, into cb->lora_delta), else 0; read at each call (a
 * plan compiled with it pairs its nodes; a benchmark compares the modes with steps of different graphs) */
static int overlap_mode(void) {
    const char *e = getenv("EXL_CUDA_LORA_OVERLAP");
    const int v = e && *e ? atoi(e) : OVERLAP_DEFAULT;
    return v >= 1 && v <= OVERLAP_DELTA ? v : 0;
}

/* output o's delta in cb->lora_delta (the outputs one after another) */
static float *delta_of(exl_cuda_backend *cb, const exl_lora_node *n, int32_t o) {
    float *d = cb->lora_delta;
    for (int32_t k = 0; k < o; k++)
        d += (int64_t)n->rows * n->out_features[k];
    return d;
}

/* cb->lora_delta large enough for n's outputs (new memory set to zero on the backend's stream, before the fork) */
static int delta_ready(exl_cuda_backend *cb, const exl_lora_node *n) {
    size_t floats = 0;
    for (int32_t o = 0; o < n->n_out; o++)
        floats += (size_t)n->rows * n->out_features[o];
    if (floats * sizeof(float) <= cb->lora_delta_bytes && cb->lora_delta)
        return 1;
    if (!exl_cuda_ensure(cb, (void **)&cb->lora_delta, &cb->lora_delta_bytes, floats * sizeof(float), "LoRA updates"))
        return 0;
    if (cudaMemsetAsync(cb->lora_delta, 0, cb->lora_delta_bytes, cb->stream) != cudaSuccess) {
        exl_cuda_check_launch(cb, "LoRA updates");
        return 0;
    }
    return 1;
}

/* out[o] += delta for the outputs whose bit in skip is clear, the delta set back to zero: one thread an element of
 * all outputs (total), one after another as in cb->lora_delta */
__global__ void lora_delta_add(exl_lora_node n, float *delta, int32_t skip, int64_t total) {
    exl_pdl_start();
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total)
        return;
    int64_t k = i;
    int32_t o = 0;
    while (o < n.n_out - 1 && k >= (int64_t)n.rows * n.out_features[o])
        k -= (int64_t)n.rows * n.out_features[o++];
    if (skip & (1 << o))
        return;
    float *out = n.out[0];
    for (int32_t q = 1; q <= o; q++)
        out = n.out[q];
    out[k] += __ldcg(delta + i);
    delta[i] = 0.0f;
}

unsigned long long exl_cuda_lora_graph_flags(void) {
    return overlap_mode() == 3 ? cudaGraphInstantiateFlagUseNodePriority : 0;
}

int exl_cuda_lora_overlaps(const exl_cuda_backend *cb, const exl_lora_node *n) {
    return overlap_mode() && exl_cuda_lora_batch_takes(cb, n);
}

/* the second stream and its events, created once, outside any capture */
static int side_ready(exl_cuda_backend *cb) {
    if (cb->lora_side)
        return 1;
    exl_cuda_graph_flush(cb); /* nothing created inside a capture (the rest of this step runs directly) */
    cudaStream_t s = NULL;
    cudaEvent_t fork = NULL, join = NULL;
    int least = 0, greatest = 0;
    cudaError_t e = cudaDeviceGetStreamPriorityRange(&least, &greatest);
    if (e == cudaSuccess)
        e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&fork, cudaEventDisableTiming);
    if (e == cudaSuccess)
        e = cudaEventCreateWithFlags(&join, cudaEventDisableTiming);
    if (e != cudaSuccess) {
        if (fork)
            cudaEventDestroy(fork);
        if (s)
            cudaStreamDestroy(s);
        cudaGetLastError();
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA: the LoRA side stream: %s", cudaGetErrorString(e));
        return 0;
    }
    cb->lora_side = s, cb->lora_fork = fork, cb->lora_join = join, cb->lora_priority = greatest;
    return 1;
}

void exl_cuda_lora_fork(exl_cuda_backend *cb, const exl_lora_node *n) {
    cb->lora_forked = NULL;
    float *t, *ss;
    unsigned *sync;
    /* the buffers first: growing one ends a capture and sets it to zero on the backend's stream, before the fork */
    cb->lora_delta_state = 0;
    const int mode = overlap_mode();
    if (!mode || !exl_cuda_lora_batch_takes(cb, n) || !side_ready(cb) ||
        (mode == OVERLAP_DELTA && !delta_ready(cb, n)) || !exl_cuda_lora_scratch(cb, n, &t, &ss, &sync))
        return;
    if (cudaEventRecord(cb->lora_fork, cb->stream) != cudaSuccess ||
        cudaStreamWaitEvent(cb->lora_side, cb->lora_fork, 0) != cudaSuccess) {
        exl_cuda_check_launch(cb, "LoRA fork");
        return;
    }
    exl_cuda_lora_batch_shrink(cb, n, t, ss, cb->lora_side, 0, mode == 3 ? cb->lora_priority : 0);
    if (mode == OVERLAP_DELTA) { /* the expand after it on the second stream, onto the delta (zero at rest) */
        exl_lora_node d = *n;
        for (int32_t o = 0; o < n->n_out; o++)
            d.out[o] = delta_of(cb, n, o);
        exl_cuda_lora_batch_expand(cb, &d, t, ss, sync, exl_cuda_lora_batch_on() == 3, cb->lora_side, 0);
        cb->lora_delta_state = DELTA_PENDING;
    }
    cb->lora_forked = n;
}

exl_cuda_lora_adds exl_cuda_lora_delta_take(exl_cuda_backend *cb, const float *out, int32_t rows, int32_t width) {
    exl_cuda_lora_adds adds;
    memset(&adds, 0, sizeof adds);
    const exl_lora_node *n = cb->lora_forked;
    if (!n || !(cb->lora_delta_state & DELTA_PENDING) || rows != n->rows)
        return adds;
    for (int32_t o = 0; o < n->n_out; o++) {
        if (out != n->out[o] || width != n->out_features[o] || (cb->lora_delta_state & (DELTA_TAKEN << o)))
            continue;
        if (!(cb->lora_delta_state & DELTA_JOINED)) { /* joined at the last output only, the others done by then */
            if (o != n->n_out - 1) {
                cb->lora_delta_state |= DELTA_DONE << o; /* its reduce follows: finished before the last's */
                return adds;
            }
            exl_cuda_lora_side_close(cb);
            cb->lora_delta_state |= DELTA_JOINED;
            for (int32_t k = 0; k < o; k++) /* the outputs whose reduces came before: their updates here too */
                if ((cb->lora_delta_state & (DELTA_DONE << k)) && !(cb->lora_delta_state & (DELTA_TAKEN << k))) {
                    adds.out_more[adds.n_more] = n->out[k], adds.more[adds.n_more] = delta_of(cb, n, k);
                    adds.n_more_floats[adds.n_more++] = (int64_t)n->rows * n->out_features[k];
                    cb->lora_delta_state |= DELTA_TAKEN << k;
                }
        }
        cb->lora_delta_state |= DELTA_TAKEN << o;
        adds.delta = delta_of(cb, n, o);
        return adds;
    }
    return adds;
}

void exl_cuda_lora_side_close(exl_cuda_backend *cb) {
    if (cb->lora_forked && (cudaEventRecord(cb->lora_join, cb->lora_side) != cudaSuccess ||
                            cudaStreamWaitEvent(cb->stream, cb->lora_join, 0) != cudaSuccess))
        exl_cuda_check_launch(cb, "LoRA join");
}

void exl_cuda_lora_join(exl_cuda_backend *cb, const exl_lora_node *n) {
    if (cb->lora_forked != n) { /* not forked (the switch, the path or the scratch): the whole op, here */
        exl_cuda_run_lora(&cb->base, n);
        return;
    }
    const int state = cb->lora_delta_state;
    if (!(state & DELTA_JOINED))
        exl_cuda_lora_side_close(cb);
    cb->lora_forked = NULL;
    cb->lora_delta_state = 0;
    if (state & DELTA_PENDING) { /* the outputs no reduce took: one add after the matmul, where =1 expands */
        int64_t total = 0;
        for (int32_t o = 0; o < n->n_out; o++)
            total += (int64_t)n->rows * n->out_features[o];
        const int skip = state / DELTA_TAKEN & ((1 << EXL_LORA_MAX_OUT) - 1);
        if (skip != (1 << n->n_out) - 1) {
            exl_cuda_launch(cb, lora_delta_add, dim3((unsigned)((total + 255) / 256)), dim3(256), 0, *n, cb->lora_delta,
                            skip, total);
            exl_cuda_check_launch(cb, "LoRA updates (add)");
        }
        return;
    }
    float *t, *ss;
    unsigned *sync;
    if (exl_cuda_lora_scratch(cb, n, &t, &ss, &sync)) /* as the fork had it: no growth */
        exl_cuda_lora_batch_expand(cb, n, t, ss, sync, exl_cuda_lora_batch_on() == 3, cb->stream, overlap_mode() != 2);
}

void exl_cuda_lora_side_free(exl_cuda_backend *cb) {
    if (!cb->lora_side)
        return;
    cudaStreamSynchronize(cb->lora_side);
    cudaEventDestroy(cb->lora_fork);
    cudaEventDestroy(cb->lora_join);
    cudaStreamDestroy(cb->lora_side);
    cb->lora_side = NULL;
    cudaFree(cb->lora_delta);
    cb->lora_delta = NULL;
    cb->lora_delta_bytes = 0;
}
