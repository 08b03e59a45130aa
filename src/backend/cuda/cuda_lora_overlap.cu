/* cuda_lora_overlap.cu - the lora op's batch path (cuda_lora_batch.cu) beside the matmul it goes with, its shrink off
 * the step's critical path (EXL_CUDA_LORA_OVERLAP=1 by default, 0: off; r2-lora6, issue 33).
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
 * the same meaning as the wait it would do); the expand with it (it may start while the matmul's last kernel ends,
 * as any kernel after another; its dependency on the shrink is the join's).
 * What the overlap can win depends on the block scheduler: cuda_qmma.cu's blocks (125 registers, 2 an SM) fill an
 * SM's registers, so a shrink block (256 threads, ~102 registers) beside them takes the place of one of them until it
 * ends, and the matmul's next kernels, launched early (PDL), hold their places while they wait. The shrink alone is
 * latency-bound (~40% of the registers of the SMs it runs on, 10-19 us), so beside the matmul it should cost its
 * share of the SMs' time, not its length; if it is starved instead (dispatched only where the matmul leaves room),
 * the join waits for the rest. Variants that lost on an H100 (bench/RESULTS.md, removed): the expand without PDL
 * (0.817 against 0.835), the shrink at the greatest stream priority (0.811), the expand on the second stream too
 * (0.785), the expand inside cuda_qmma.cu's split-sum reduce (0.769 against 0.838). */
#include "backend/cuda/cuda_lora_batch.cuh"

#include <stdlib.h>

#define OVERLAP_DEFAULT 1 /* EXL_CUDA_LORA_OVERLAP unset: 1 (H100: batch 32 over 4 adapters 0.801 -> 0.835) */

/* EXL_CUDA_LORA_OVERLAP: 1, else 0; read at each call (a plan compiled with it pairs its nodes; a benchmark compares the
 * modes with steps of different graphs) */
static int overlap_mode(void) {
    const char *e = getenv("EXL_CUDA_LORA_OVERLAP");
    const int v = e && *e ? atoi(e) : OVERLAP_DEFAULT;
    return v == 1;
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
    cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
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
    cb->lora_side = s, cb->lora_fork = fork, cb->lora_join = join;
    return 1;
}

void exl_cuda_lora_fork(exl_cuda_backend *cb, const exl_lora_node *n) {
    cb->lora_forked = NULL;
    float *t, *ss;
    unsigned *sync;
    /* the scratch first: growing it ends a capture and sets it to zero on the backend's stream, before the fork */
    if (!overlap_mode() || !exl_cuda_lora_batch_takes(cb, n) || !side_ready(cb) ||
        !exl_cuda_lora_scratch(cb, n, &t, &ss, &sync))
        return;
    if (cudaEventRecord(cb->lora_fork, cb->stream) != cudaSuccess ||
        cudaStreamWaitEvent(cb->lora_side, cb->lora_fork, 0) != cudaSuccess) {
        exl_cuda_check_launch(cb, "LoRA fork");
        return;
    }
    exl_cuda_lora_batch_shrink(cb, n, t, ss, cb->lora_side, 0);
    cb->lora_forked = n;
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
    exl_cuda_lora_side_close(cb);
    cb->lora_forked = NULL;
    float *t, *ss;
    unsigned *sync;
    if (exl_cuda_lora_scratch(cb, n, &t, &ss, &sync)) /* as the fork had it: no growth */
        exl_cuda_lora_batch_expand(cb, n, t, ss, sync);
}

void exl_cuda_lora_side_free(exl_cuda_backend *cb) {
    if (!cb->lora_side)
        return;
    cudaStreamSynchronize(cb->lora_side);
    cudaEventDestroy(cb->lora_fork);
    cudaEventDestroy(cb->lora_join);
    cudaStreamDestroy(cb->lora_side);
    cb->lora_side = NULL;
}
