/* cuda_comm.cu - tensor parallelism's collectives over NCCL (backend.h: comm_init, all_reduce, gather_cols).
 *
 * NCCL is loaded at run time (libnccl.so.2, or $EXL_NCCL_LIBRARY), as the core loads this library: a build needs
 * no NCCL headers, and a machine without NCCL runs everything but --tp. One process drives every GPU, a thread per
 * rank (model/tp.c): the communicators are made together (ncclCommInitAll), each collective is queued on its
 * rank's stream, so it is captured into that rank's CUDA graph like any launch. NVLink multicast (NVLS) stays off:
 * NCCL_NVLS_ENABLE=0 is set before the communicators are made. */
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

struct exl_cuda_comm {
    int32_t n, refs;
    ncclComm_t comms[MAX_RANKS];
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

void exl_cuda_comm_release(exl_cuda_backend *cb) {
    exl_cuda_comm *c = cb->comm;
    if (!c)
        return;
    cb->comm = NULL;
    if (--c->refs > 0) /* the ranks are freed one after another (model/tp.c) */
        return;
    for (int32_t k = 0; k < c->n; k++)
        if (c->comms[k])
            nccl.comm_destroy(c->comms[k]);
    free(c);
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
    for (int32_t k = 0; k < n; k++) {
        exl_cuda_backend *cb = exl_cuda(ranks[k]);
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
    check(cb, nccl.all_reduce(x, x, (size_t)n, NCCL_FLOAT32, NCCL_SUM, cb->comm->comms[cb->rank], cb->stream),
          "all_reduce");
}

/* Each rank's slice broadcast from it: straight into out for one row, else into tmp (rank-major) and from there
 * into out's columns. */
void exl_cuda_run_gather_cols(exl_backend *be, const exl_gather_cols_node *g) {
    exl_cuda_backend *cb = exl_cuda(be);
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

void exl_cuda_all_reduce(exl_backend *be, float *x, int64_t n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_all_reduce(be, x, n);
}

void exl_cuda_gather_cols(exl_backend *be, const exl_gather_cols_node *n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_gather_cols(be, n);
}
