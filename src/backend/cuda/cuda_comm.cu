/* cuda_comm.cu - tensor parallelism's collectives over NCCL (backend.h: comm_init, all_reduce, gather_cols).
 *
 * NCCL is loaded at run time (libnccl.so.2, or $EXL_NCCL_LIBRARY), as the core loads this library: a build needs
 * no NCCL headers, and a machine without NCCL runs everything but --tp. One process drives every GPU, a thread per
 * rank (model/tp.c): the communicators are made together (ncclCommInitAll), each collective is queued on its
 * rank's stream, so it is captured into that rank's CUDA graph like any launch. NVLink multicast (NVLS) stays off:
 * NCCL_NVLS_ENABLE=0 is set before the communicators are made.
 *
 * Small all-reduces (a decode step's: up to $EXL_TP_P2P_MAX floats, default 64K) go over peer memory instead of
 * NCCL where every pair of GPUs can reach each other's memory; EXL_TP_P2P picks how:
 *   2 (the default): the push all-reduce (cuda_allreduce.cu): each rank stores its values into every peer's
 *     receive buffer and sums what it receives in its own; with the residual add after it fused (cuda_plan.cu);
 *   1: the pull one-shot: each rank copies its values into its staging buffer (two, used by turns), tells every
 *     rank so through a flag in that rank's memory, waits for every rank's flag of the same round, and sums the
 *     ranks' staging buffers in rank order (remote loads). A rank two rounds ahead cannot exist (it would need this
 *     rank's flag of the round between), so two buffers suffice;
 *   0: NCCL for every size.
 * 1 or 2 given where some pair of GPUs has no peer access is an error; by default those machines use NCCL.
 * With the push all-reduce, gathers of up to as many floats go through its kernel and buffers too (the head's
 * vocabulary slices, EXL2 models' attention outputs and o_proj columns); EXL_TP_PUSH_GATHER=0 sends them to NCCL. */
#include "backend/cuda/cuda_internal.h"

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

/* the few NCCL declarations used (nccl.h's, ABI-stable since NCCL 2.0) */
typedef struct ncclComm *ncclComm_t;
typedef int ncclResult_t; /* 0: ncclSuccess */
enum { NCCL_FLOAT32 = 7, NCCL_SUM = 0 };

typedef struct nccl_api {
    ncclResult_t (*comm_init_all)(ncclComm_t *comms, int n, const int *devices);
    ncclResult_t (*comm_destroy)(ncclComm_t comm);
    ncclResult_t (*all_reduce)(const void *send, void *recv, size_t count, int dtype, int op, ncclComm_t comm,
                               cudaStream_t stream);
    ncclResult_t (*broadcast)(const void *send, void *recv, size_t count, int dtype, int root, ncclComm_t comm,
                              cudaStream_t stream);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    const char *(*error_string)(ncclResult_t r);
} nccl_api;

static nccl_api nccl;

#define MAX_RANKS 16
#define P2P_MAX (64 * 1024) /* floats of the largest pull all-reduce, and the push one's by default */
#define PUSH_MAX_LIMIT ((int64_t)1 << 22)
#define P2P_THREADS 1024

/* every rank's staging buffers [2 * P2P_MAX] and flags [MAX_RANKS + 1] (the last: this rank's round), passed by
 * value to the kernel (so a CUDA graph keeps them) */
typedef struct p2p_peers {
    float *stage[MAX_RANKS];
    unsigned *flags[MAX_RANKS];
} p2p_peers;

enum { MODE_NCCL, MODE_PULL, MODE_PUSH };

struct exl_cuda_comm {
    int32_t n, refs;
    ncclComm_t comms[MAX_RANKS];
    int mode;           /* how all-reduces of up to p2p_max floats go (the top) */
    int64_t p2p_max;    /* floats */
    int push_gather;    /* MODE_PUSH: gathers too (EXL_TP_PUSH_GATHER, default 1) */
    p2p_peers peers;    /* MODE_PULL */
    exl_cuda_push push; /* MODE_PUSH */
};

static exl_status load_nccl(void) {
    if (nccl.all_reduce)
        return EXL_OK;
    const char *path = getenv("EXL_NCCL_LIBRARY");
    void *h = dlopen(path && *path ? path : "libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        return exl_cuda_fail(EXL_ERR_UNSUPPORTED, "tensor parallelism needs NCCL: %s", dlerror());
    nccl_api a;
    a.comm_init_all = (ncclResult_t(*)(ncclComm_t *, int, const int *))dlsym(h, "ncclCommInitAll");
    a.comm_destroy = (ncclResult_t(*)(ncclComm_t))dlsym(h, "ncclCommDestroy");
    a.all_reduce = (ncclResult_t(*)(const void *, void *, size_t, int, int, ncclComm_t,
                                    cudaStream_t))dlsym(h, "ncclAllReduce");
    a.broadcast = (ncclResult_t(*)(const void *, void *, size_t, int, int, ncclComm_t,
                                   cudaStream_t))dlsym(h, "ncclBroadcast");
    a.group_start = (ncclResult_t(*)(void))dlsym(h, "ncclGroupStart");
    a.group_end = (ncclResult_t(*)(void))dlsym(h, "ncclGroupEnd");
    a.error_string = (const char *(*)(ncclResult_t))dlsym(h, "ncclGetErrorString");
    if (!a.comm_init_all || !a.comm_destroy || !a.all_reduce || !a.broadcast || !a.group_start || !a.group_end ||
        !a.error_string) {
        dlclose(h);
        return exl_cuda_fail(EXL_ERR_UNSUPPORTED, "libnccl.so.2 lacks the functions exl uses (NCCL 2.x)");
    }
    nccl = a; /* the library stays loaded for the process lifetime */
    return EXL_OK;
}

static void comm_free(exl_cuda_comm *c) {
    for (int32_t k = 0; k < c->n; k++) {
        if (c->comms[k])
            nccl.comm_destroy(c->comms[k]);
        cudaFree(c->peers.stage[k]);
        cudaFree(c->peers.flags[k]);
    }
    exl_cuda_push_free(&c->push, c->n);
    free(c);
}

void exl_cuda_comm_release(exl_cuda_backend *cb) {
    exl_cuda_comm *c = cb->comm;
    if (!c)
        return;
    cb->comm = NULL;
    if (--c->refs > 0) /* the ranks are freed one after another (model/tp.c) */
        return;
    comm_free(c);
}

/* Peer access between every pair of the devices (comm_init's thread, left on some device); 0 where some pair of
 * GPUs cannot reach each other (or a device is twice in the list). */
static int peer_access(const exl_cuda_comm *c, const int *devices) {
    for (int32_t r = 0; r < c->n; r++) {
        if (cudaSetDevice(devices[r]) != cudaSuccess)
            return 0;
        for (int32_t k = 0; k < c->n; k++) {
            int can = 0;
            if (k == r)
                continue;
            if (cudaDeviceCanAccessPeer(&can, devices[r], devices[k]) != cudaSuccess || !can)
                return 0;
            cudaError_t e = cudaDeviceEnablePeerAccess(devices[k], 0);
            if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled)
                return 0;
            cudaGetLastError();
        }
    }
    return 1;
}

/* The memory of c's mode, each rank's on its device (comm_init's thread, left on some device). */
static exl_status p2p_alloc(exl_cuda_comm *c, const int *devices) {
    for (int32_t r = 0; r < c->n; r++) {
        if (cudaSetDevice(devices[r]) != cudaSuccess)
            return exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: selecting device %d", devices[r]);
        if (c->mode == MODE_PUSH) {
            EXL_TRY(exl_cuda_push_alloc(&c->push, r, c->n, c->p2p_max));
            continue;
        }
        if (cudaMalloc((void **)&c->peers.stage[r], 2 * P2P_MAX * sizeof(float)) != cudaSuccess ||
            cudaMalloc((void **)&c->peers.flags[r], (MAX_RANKS + 1) * sizeof(unsigned)) != cudaSuccess ||
            cudaMemset(c->peers.flags[r], 0, (MAX_RANKS + 1) * sizeof(unsigned)) != cudaSuccess)
            return exl_cuda_fail(EXL_ERR_NOMEM, "CUDA: the all-reduce's buffers on device %d: %s", devices[r],
                                 cudaGetErrorString(cudaGetLastError()));
    }
    if (cudaDeviceSynchronize() != cudaSuccess)
        return exl_cuda_fail(EXL_ERR_DEVICE, "CUDA: %s", cudaGetErrorString(cudaGetLastError()));
    return EXL_OK;
}

/* EXL_TP_P2P and EXL_TP_P2P_MAX into c's mode and size, and what the mode needs (comm_init's thread, left on some
 * device) */
static exl_status p2p_init(exl_cuda_comm *c, const int *devices) {
    const char *mode = getenv("EXL_TP_P2P"), *max = getenv("EXL_TP_P2P_MAX");
    const int given = mode && *mode;
    c->mode = given ? atoi(mode) : MODE_PUSH;
    if (c->mode < MODE_NCCL || c->mode > MODE_PUSH)
        return exl_cuda_fail(EXL_ERR_ARG, "EXL_TP_P2P=%s: 0 (NCCL), 1 (pull one-shot) or 2 (push)", mode);
    const long long floats = max && *max ? atoll(max) : P2P_MAX;
    if (floats < 4 || floats > PUSH_MAX_LIMIT) /* the push all-reduce's; the pull one's is P2P_MAX */
        return exl_cuda_fail(EXL_ERR_ARG, "EXL_TP_P2P_MAX=%s: floats, 4 .. %lld", max, (long long)PUSH_MAX_LIMIT);
    c->p2p_max = (floats + 3) / 4 * 4;
    const char *gather = getenv("EXL_TP_PUSH_GATHER");
    c->push_gather = !gather || strcmp(gather, "0");
    if (c->mode == MODE_NCCL)
        return EXL_OK;
    if (!peer_access(c, devices)) {
        cudaGetLastError();
        if (given)
            return exl_cuda_fail(EXL_ERR_UNSUPPORTED, "EXL_TP_P2P=%s: some pair of the %d GPUs has no peer access",
                                 mode, c->n);
        c->mode = MODE_NCCL;
        return EXL_OK;
    }
    return p2p_alloc(c, devices);
}

__global__ void __launch_bounds__(P2P_THREADS)
    p2p_all_reduce_kernel(float *x, int n, p2p_peers p, int rank, int n_ranks) {
    __shared__ unsigned round;
    unsigned *mine = p.flags[rank];
    if (threadIdx.x == 0)
        round = mine[MAX_RANKS] + 1;
    __syncthreads();
    const size_t half = (round & 1) * (size_t)P2P_MAX;
    float *stage = p.stage[rank] + half;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        stage[i] = x[i];
    __syncthreads();
    if (threadIdx.x < n_ranks) {
        __threadfence_system(); /* the block's staged values before the flag that announces them */
        *(volatile unsigned *)(p.flags[threadIdx.x] + rank) = round;
        volatile unsigned *theirs = mine + threadIdx.x;
        while ((int)(*theirs - round) < 0) /* the rank's flag of this round (or a later one) */
            ;
        __threadfence_system();
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float s = 0;
        for (int k = 0; k < n_ranks; k++)
            s += ((volatile const float *)(p.stage[k] + half))[i];
        x[i] = s;
    }
    if (threadIdx.x == 0)
        mine[MAX_RANKS] = round;
}

exl_status exl_cuda_comm_init(exl_backend *const *ranks, int32_t n) {
    if (n < 1 || n > MAX_RANKS)
        return exl_cuda_fail(EXL_ERR_ARG, "comm_init: %d ranks (1 .. %d)", n, MAX_RANKS);
    int devices[MAX_RANKS];
    for (int32_t k = 0; k < n; k++) {
        if (ranks[k]->ops != ranks[0]->ops)
            return exl_cuda_fail(EXL_ERR_ARG, "comm_init: rank %d is not a CUDA backend", k);
        devices[k] = exl_cuda(ranks[k])->device;
    }
    EXL_TRY(load_nccl());
    setenv("NCCL_NVLS_ENABLE", "0", 1);
    /* connect every peer now: collectives are captured into CUDA graphs, and NCCL's connection at a communicator's
     * first collective (its default) sets up peer memory, which a capturing stream forbids ("operation not
     * permitted when stream is capturing": a layer split's first hand-over is inside a captured step) */
    setenv("NCCL_RUNTIME_CONNECT", "0", 1);
    exl_cuda_comm *c = (exl_cuda_comm *)calloc(1, sizeof *c);
    if (!c)
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    c->n = c->refs = n;
    ncclResult_t r = nccl.comm_init_all(c->comms, n, devices);
    cudaSetDevice(exl_cuda(ranks[0])->device); /* NCCL moved this thread between the devices */
    if (r != 0) {
        free(c);
        return exl_cuda_fail(EXL_ERR_DEVICE, "NCCL: making the communicators of %d GPUs: %s", n, nccl.error_string(r));
    }
    exl_status st = p2p_init(c, devices);
    cudaSetDevice(exl_cuda(ranks[0])->device);
    if (st != EXL_OK) {
        comm_free(c);
        return st;
    }
    for (int32_t k = 0; k < n; k++) {
        exl_cuda_backend *cb = exl_cuda(ranks[k]);
        exl_cuda_graph_forget(cb); /* its CUDA graphs hold the old communicator's buffers */
        exl_cuda_comm_release(cb);
        cb->comm = c;
        cb->rank = k;
    }
    return EXL_OK;
}

void exl_cuda_comm_abort(exl_backend *be, int resume) {
    (void)be;
    (void)resume; /* a rank that failed on the host queued no collective: the others' fail with their streams */
}

static void check(exl_cuda_backend *cb, ncclResult_t r, const char *what) {
    if (r != 0)
        exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "NCCL: %s: %s", what, nccl.error_string(r));
}

void exl_cuda_run_all_reduce(exl_backend *be, float *x, int64_t n) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (!cb->comm)
        return;
    exl_cuda_comm *c = cb->comm;
    if (c->mode == MODE_PUSH && n <= c->p2p_max) { /* the same choice on every rank: n is the same */
        exl_cuda_push_all_reduce(cb, &c->push, c->n, x, NULL, n);
        return;
    }
    if (c->mode == MODE_PULL && n <= P2P_MAX) {
        p2p_all_reduce_kernel<<<1, P2P_THREADS, 0, cb->stream>>>(x, (int)n, c->peers, cb->rank, c->n);
        cudaError_t e = cudaGetLastError();
        if (e != cudaSuccess)
            exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "all_reduce (peer to peer): %s", cudaGetErrorString(e));
        return;
    }
    check(cb, nccl.all_reduce(x, x, (size_t)n, NCCL_FLOAT32, NCCL_SUM, cb->comm->comms[cb->rank], cb->stream),
          "all_reduce");
}

void exl_cuda_run_all_reduce_add(exl_backend *be, float *sum, int64_t n, float *x) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_comm *c = cb->comm;
    if (c && c->mode == MODE_PUSH && n <= c->p2p_max) {
        exl_cuda_push_all_reduce(cb, &c->push, c->n, sum, x, n);
        return;
    }
    exl_cuda_run_all_reduce(be, sum, n);
    exl_cuda_run_add(be, x, sum, n);
}

/* 1 if the push gather takes g (and x += its output, x NULL: none): the same choice on every rank (the sizes and
 * columns are the same; so are the overlaps, the ranks' buffers being laid out alike) */
static int push_takes_gather(const exl_cuda_comm *c, const exl_gather_cols_node *g, const float *x) {
    const int64_t n = (int64_t)g->rows * g->out_width;
    if (c->mode != MODE_PUSH || !c->push_gather || n > c->p2p_max || g->n_ranks != c->n)
        return 0;
    for (int32_t k = 0; k < g->n_ranks; k++)
        if (g->cols[k + 1] <= g->cols[k]) /* a rank without columns (a layer split's receivers) would never wait */
            return 0;
    const exl_span out = {g->out, n}, mine = {g->x, (int64_t)g->rows * (g->cols[g->rank + 1] - g->cols[g->rank])};
    const exl_span resid = {x, n};
    return !exl_spans_overlap(out, mine) && (!x || !exl_spans_overlap(out, resid));
}

/* Each rank's slice broadcast from it: straight into out for one row, else into tmp (rank-major) and from there
 * into out's columns; decode-sized gathers through the push all-reduce's buffers (cuda_allreduce.cu). */
void exl_cuda_run_gather_cols(exl_backend *be, const exl_gather_cols_node *g) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (cb->comm && push_takes_gather(cb->comm, g, NULL)) {
        exl_cuda_push_gather(cb, &cb->comm->push, g, NULL);
        return;
    }
    if (!cb->comm) {
        cudaMemcpyAsync(g->out, g->x, (size_t)g->rows * g->out_width * sizeof(float), cudaMemcpyDeviceToDevice,
                        cb->stream);
        return;
    }
    ncclComm_t comm = cb->comm->comms[cb->rank];
    int direct = g->rows == 1;
    check(cb, nccl.group_start(), "group start");
    for (int32_t k = 0; k < g->n_ranks; k++) {
        size_t count = (size_t)g->rows * (g->cols[k + 1] - g->cols[k]);
        if (!count) /* a rank without columns (a layer split's receivers): alike on every rank */
            continue;
        float *dst = direct ? g->out + g->cols[k] : g->tmp + (size_t)g->rows * g->cols[k];
        check(cb, nccl.broadcast(k == g->rank ? g->x : dst, dst, count, NCCL_FLOAT32, k, comm, cb->stream),
              "gather (broadcast)");
    }
    check(cb, nccl.group_end(), "group end");
    for (int32_t k = 0; !direct && k < g->n_ranks; k++) {
        size_t width = (size_t)(g->cols[k + 1] - g->cols[k]) * sizeof(float);
        if (!width)
            continue;
        cudaError_t e = cudaMemcpy2DAsync(g->out + g->cols[k], (size_t)g->out_width * sizeof(float),
                                          g->tmp + (size_t)g->rows * g->cols[k], width, width, (size_t)g->rows,
                                          cudaMemcpyDeviceToDevice, cb->stream);
        if (e != cudaSuccess)
            exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "gather_cols: %s", cudaGetErrorString(e));
    }
}

void exl_cuda_run_gather_cols_add(exl_backend *be, const exl_gather_cols_node *g, float *x) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (cb->comm && push_takes_gather(cb->comm, g, x)) {
        exl_cuda_push_gather(cb, &cb->comm->push, g, x);
        return;
    }
    exl_cuda_run_gather_cols(be, g);
    exl_cuda_run_add(be, x, g->out, (int64_t)g->rows * g->out_width);
}

void exl_cuda_all_reduce(exl_backend *be, float *x, int64_t n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_all_reduce(be, x, n);
}

void exl_cuda_gather_cols(exl_backend *be, const exl_gather_cols_node *n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_gather_cols(be, n);
}
