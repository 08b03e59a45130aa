/* cuda_lora_overlap.cu - the lora op's batch path (cuda_lora_batch.cu) beside the matmul it goes with, its shrink off
 * the step's critical path (EXL_CUDA_LORA_OVERLAP=1 by default, r2-lora6, issue 33), its expand inside the matmul's
 * split-sum reduces (=4, r2-lora8), or neither (=0).
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
 * 97 us of kernel time (ncu); with =1 the expands (~41 us) stay on the critical path (H100: 32 jobs over 4 adapters
 * 0.801 -> 0.835 of the no-adapter rate). The shrink goes without programmatic dependent launch (a full dependency on
 * the kernel before the fork, which has the same meaning as the wait it would do), the expand with it. Lost and
 * removed (numbers in bench/LOG.md): the expand without PDL (0.817), the shrink at the greatest priority (0.811), the
 * expand on the second stream too, into a delta the reduce added (r2-lora7, 0.785: it competed with the matmul).
 *
 * =4: no expand launch where the matmul's outputs are finished by cuda_qmma.cu's split-sum reduce (a decode step's
 * quantized matmuls of 5 to 95 rows whose split-K has more than one split: every matmul of a 7B layer at 32 rows).
 * The reduce of each of the node's outputs adds the expand's update of its element (row r, column c) itself, beside
 * the bias, before it stores (or adds onto the residual: down_proj's, whose node is paired with the matmul after it):
 *   sum over the row's uses u of scale_u (times 1 / RMS of the row where the node has a norm) * t[u, o, j] * Bt[j, c],
 * the same math as the batch path's expand. The backend's stream joins the second right before the first of those
 * reduces (exl_cuda_lora_reduce_take, called by cuda_qmma.cu as it launches one): the shrink has the gather and the
 * split-K kernel of the node's first projection to hide in. Outputs no reduce took (a single split, the GEMVs at up
 * to 4 rows, cuBLAS's many rows, dense weights, prompts and verification steps, which the fork does not offer) get
 * theirs from the expand after the matmul, as with =1, skipping the others.
 * Pairing is offered only where the matmul's kernels store plain rows: no slot order, no zeroing for or by a GEMV
 * (the plan gives those to GEMVs alone, and cuda_matmul.cu refuses them elsewhere), the node's rows the matmul's.
 * The scratch: the expand sets t and ss back to zero in its last block; the reduces cannot (several launches, none
 * knowing it is the last reader), so a node whose outputs they all took leaves its sums there (cb->lora_dirty). The
 * next fork sets them to zero with a memset on the second stream right after its fork event, before its shrink: off
 * the critical path (the event orders it after every reduce that read them, and the shrink after it). Other users of
 * the scratch (the batch path run directly) set them to zero on the backend's stream first, and so does the end
 * of every step (exl_cuda_lora_settle, one memset a step), so that a step starts with them zero whether it runs
 * directly, is captured or is replayed. */
#include "backend/cuda/cuda_lora_batch.cuh"

#include <stdlib.h>

#define OVERLAP_DEFAULT 1 /* EXL_CUDA_LORA_OVERLAP unset: 1 (H100: batch 32 over 4 adapters 0.801 -> 0.835) */
#define OVERLAP_REDUCE 4  /* the expand inside the split-sum reduces */
/* what a reduce's shared memory holds of a node (cuda_qmma.cu qmma_reduce_lora_kernel): t of its uses, then its
 * rows' updates over 32 columns: at most 16 + 16 KB */
#define REDUCE_MAX_T 4096
#define REDUCE_MAX_ROWS 128

/* EXL_CUDA_LORA_OVERLAP: 1 or 4, else 0; read at each call (a plan compiled with it pairs its nodes; a benchmark
 * compares the modes with steps of different graphs) */
static int overlap_mode(void) {
    const char *e = getenv("EXL_CUDA_LORA_OVERLAP");
    const int v = e && *e ? atoi(e) : OVERLAP_DEFAULT;
    return v == 1 || v == OVERLAP_REDUCE ? v : 0;
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

/* 1 if the reduces of matmul f may add node n's updates (=4): a decode step's plain rows, the node's, and shared
 * memory enough for its t */
static int reduce_offered(const exl_lora_node *n, const exl_cuda_fused_mm *f) {
    int clears = 0;
    for (int k = 0; k < 3; k++)
        clears |= f->clear[k] != NULL;
    return overlap_mode() == OVERLAP_REDUCE && f->decode && f->rows == n->rows && n->rows <= REDUCE_MAX_ROWS &&
           (int64_t)n->n_uses * n->max_rank <= REDUCE_MAX_T && !f->out_map && !f->x_slots && !f->out_zeroed && !clears;
}

void exl_cuda_lora_fork(exl_cuda_backend *cb, const exl_lora_node *n, const exl_cuda_fused_mm *f) {
    cb->lora_forked = NULL;
    cb->lora_in_reduce = cb->lora_taken = 0;
    float *t, *ss;
    unsigned *sync;
    /* the scratch first: growing it ends a capture and sets it to zero on the backend's stream, before the fork */
    if (!overlap_mode() || !exl_cuda_lora_batch_takes(cb, n) || !side_ready(cb) ||
        !exl_cuda_lora_scratch_grow(cb, n, &t, &ss, &sync))
        return;
    if (cudaEventRecord(cb->lora_fork, cb->stream) != cudaSuccess ||
        cudaStreamWaitEvent(cb->lora_side, cb->lora_fork, 0) != cudaSuccess) {
        exl_cuda_check_launch(cb, "LoRA fork");
        return;
    }
    cb->lora_forked = n; /* from here the second stream is joined again (at the latest by side_close) */
    exl_cuda_lora_scratch_clean(cb, cb->lora_side); /* sums a node left: after the fork, before the shrink */
    exl_cuda_lora_batch_shrink(cb, n, t, ss, cb->lora_side, 0);
    cb->lora_in_reduce = reduce_offered(n, f);
}

int exl_cuda_lora_reduce_take(exl_cuda_backend *cb, const float *out, int32_t rows, int32_t width,
                              exl_cuda_lora_reduce *r) {
    const exl_lora_node *n = cb->lora_forked;
    if (!n || !cb->lora_in_reduce || rows != n->rows)
        return 0;
    for (int32_t o = 0; o < n->n_out; o++) {
        if (out != n->out[o] || width != n->out_features[o] || (cb->lora_taken >> o & 1))
            continue;
        float *t, *ss;
        unsigned *sync;
        if (!exl_cuda_lora_scratch_grow(cb, n, &t, &ss, &sync)) /* as the fork had it: no growth */
            return 0;
        if (!cb->lora_taken) /* the shrink's sums are needed from here */
            exl_cuda_lora_side_close(cb);
        cb->lora_taken |= 1 << o;
        r->n = *n, r->t = t, r->ss = ss, r->o = o;
        return 1;
    }
    return 0;
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
    const int32_t taken = cb->lora_taken;
    if (!taken)
        exl_cuda_lora_side_close(cb);
    cb->lora_forked = NULL;
    cb->lora_in_reduce = cb->lora_taken = 0;
    float *t, *ss;
    unsigned *sync;
    if (!exl_cuda_lora_scratch_grow(cb, n, &t, &ss, &sync)) /* as the fork had it: no growth */
        return;
    if (taken == (1 << n->n_out) - 1) { /* every output's updates added by its reduce: the sums stay for the next */
        const size_t bytes = (size_t)((int64_t)n->n_uses * n->n_out * n->max_rank + n->n_uses) * sizeof(float);
        cb->lora_dirty = bytes > cb->lora_dirty ? bytes : cb->lora_dirty;
        return;
    }
    exl_cuda_lora_batch_expand(cb, n, t, ss, sync, taken);
}

void exl_cuda_lora_settle(exl_cuda_backend *cb) { exl_cuda_lora_scratch_clean(cb, cb->stream); }

void exl_cuda_lora_side_free(exl_cuda_backend *cb) {
    if (!cb->lora_side)
        return;
    cudaStreamSynchronize(cb->lora_side);
    cudaEventDestroy(cb->lora_fork);
    cudaEventDestroy(cb->lora_join);
    cudaStreamDestroy(cb->lora_side);
    cb->lora_side = NULL;
}
