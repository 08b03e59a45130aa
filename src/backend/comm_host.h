/* comm_host.h - the collectives of tensor parallelism between ranks that share the host's memory: threads of
 * one process, each running one rank's CPU backend (backend.h: comm_init). Every rank calls each collective in
 * the same order from its own thread; the sums are taken in rank order, so every rank gets the same bits. */
#ifndef EXL_BACKEND_COMM_HOST_H
#define EXL_BACKEND_COMM_HOST_H

#include "backend/graph.h"
#include "exl.h"

#include <stdint.h>

typedef struct exl_host_comm exl_host_comm;

/* A communicator of n ranks, held by n references (one per rank): exl_host_comm_release drops one. */
exl_status exl_host_comm_create(int32_t n, exl_host_comm **out);
void exl_host_comm_release(exl_host_comm *c);
/* x = the sum over the ranks of their x (n floats, the same n on every rank). */
void exl_host_comm_all_reduce(exl_host_comm *c, int32_t rank, float *x, int64_t n);
/* graph.h's gather_cols: each rank's slice copied into every rank's out. */
void exl_host_comm_gather_cols(exl_host_comm *c, int32_t rank, const exl_gather_cols_node *n);
/* A rank failed: every wait of the others ends at once (results undefined) until resumed (resume 1), which the
 * caller does once no rank is inside a collective any more. */
void exl_host_comm_abort(exl_host_comm *c, int resume);

#endif
