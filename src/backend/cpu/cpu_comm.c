/* cpu_comm.c - the CPU backend's collectives for tensor parallelism: ranks are CPU backends in threads of one
 * process, joined by a shared-memory communicator (backend/comm_host.h). */
#include "backend/comm_host.h"
#include "backend/cpu/cpu.h"

#include "base/error.h"

#include <string.h>

exl_status exl_cpu_comm_init(exl_backend *const *ranks, int32_t n) {
    for (int32_t k = 0; k < n; k++)
        if (ranks[k]->ops != ranks[0]->ops)
            return exl_fail(EXL_ERR_ARG, "comm_init: rank %d is not a CPU backend", k);
    exl_host_comm *c;
    EXL_TRY(exl_host_comm_create(n, &c));
    for (int32_t k = 0; k < n; k++) {
        exl_cpu_backend *cb = exl_cpu(ranks[k]);
        exl_host_comm_release(cb->comm);
        cb->comm = c;
        cb->rank = k;
    }
    return EXL_OK;
}

void exl_cpu_comm_abort(exl_backend *be, int resume) {
    if (exl_cpu(be)->comm)
        exl_host_comm_abort(exl_cpu(be)->comm, resume);
}

void exl_cpu_all_reduce(exl_backend *be, float *x, int64_t n) {
    exl_cpu_backend *cb = exl_cpu(be);
    if (cb->comm)
        exl_host_comm_all_reduce(cb->comm, cb->rank, x, n);
}

void exl_cpu_gather_cols(exl_backend *be, const exl_gather_cols_node *n) {
    exl_cpu_backend *cb = exl_cpu(be);
    if (cb->comm) {
        exl_host_comm_gather_cols(cb->comm, cb->rank, n);
        return;
    }
    for (int32_t r = 0; r < n->rows; r++) /* one rank: its slice is all there is */
        memcpy(n->out + (size_t)r * n->out_width, n->x + (size_t)r * n->out_width,
               (size_t)n->out_width * sizeof(float));
}
