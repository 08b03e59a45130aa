/* comm_host.c - collectives between ranks that are threads of one process (comm_host.h): a barrier with a
 * generation count, every rank's buffer published in a shared table, and a shared accumulator. */
#include "backend/comm_host.h"

#include "base/alloc.h"
#include "base/error.h"

#include <pthread.h>
#include <string.h>

struct exl_host_comm {
    int32_t n, refs;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int32_t waiting;
    int64_t generation;
    int aborted;
    const float **bufs; /* [n]: each rank's buffer in the collective under way */
    float *acc;         /* all_reduce's sums, acc_cap floats */
    int64_t acc_cap;
    int acc_failed; /* the accumulator could not grow: the sums stay undone (a message on rank 0) */
};

exl_status exl_host_comm_create(int32_t n, exl_host_comm **out) {
    *out = NULL;
    exl_host_comm *c = exl_calloc(1, sizeof *c);
    if (!c || !(c->bufs = exl_calloc((size_t)n, sizeof *c->bufs))) {
        exl_free(c);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    c->n = c->refs = n;
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    *out = c;
    return EXL_OK;
}

void exl_host_comm_release(exl_host_comm *c) {
    if (!c)
        return;
    pthread_mutex_lock(&c->lock);
    int last = --c->refs == 0;
    pthread_mutex_unlock(&c->lock);
    if (!last)
        return;
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->cond);
    exl_free_aligned(c->acc);
    exl_free(c->bufs);
    exl_free(c);
}

/* Wait until every rank has arrived; 0 when aborted. */
static int barrier(exl_host_comm *c) {
    pthread_mutex_lock(&c->lock);
    int64_t gen = c->generation;
    if (++c->waiting == c->n) {
        c->waiting = 0;
        c->generation++;
        pthread_cond_broadcast(&c->cond);
    } else {
        while (gen == c->generation && !c->aborted)
            pthread_cond_wait(&c->cond, &c->lock);
    }
    int ok = !c->aborted;
    pthread_mutex_unlock(&c->lock);
    return ok;
}

void exl_host_comm_abort(exl_host_comm *c, int resume) {
    pthread_mutex_lock(&c->lock);
    c->aborted = !resume;
    if (resume)
        c->waiting = 0;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
}

/* Rank 0 makes the accumulator hold n floats while the others wait at the next barrier. */
static void ensure_acc(exl_host_comm *c, int32_t rank, int64_t n) {
    if (rank != 0 || n <= c->acc_cap)
        return;
    exl_free_aligned(c->acc);
    c->acc = exl_malloc_aligned((size_t)n * sizeof(float));
    c->acc_cap = c->acc ? n : 0;
    c->acc_failed = !c->acc;
    if (!c->acc)
        exl_fail(EXL_ERR_NOMEM, "all_reduce: out of memory for %lld floats", (long long)n);
}

void exl_host_comm_all_reduce(exl_host_comm *c, int32_t rank, float *x, int64_t n) {
    ensure_acc(c, rank, n);
    c->bufs[rank] = x;
    if (!barrier(c) || c->acc_failed)
        return;
    /* each rank sums its share of the floats over the ranks, in rank order */
    int64_t begin = n * rank / c->n, end = n * (rank + 1) / c->n;
    for (int64_t i = begin; i < end; i++) {
        float s = c->bufs[0][i];
        for (int32_t k = 1; k < c->n; k++)
            s += c->bufs[k][i];
        c->acc[i] = s;
    }
    if (!barrier(c))
        return;
    memcpy(x, c->acc, (size_t)n * sizeof(float));
    barrier(c); /* the accumulator is read before anyone reuses it */
}

void exl_host_comm_gather_cols(exl_host_comm *c, int32_t rank, const exl_gather_cols_node *n) {
    c->bufs[rank] = n->x;
    if (!barrier(c))
        return;
    for (int32_t k = 0; k < c->n; k++) {
        int32_t col = n->cols[k], width = n->cols[k + 1] - col;
        for (int32_t r = 0; r < n->rows; r++)
            memcpy(n->out + (size_t)r * n->out_width + col, c->bufs[k] + (size_t)r * width,
                   (size_t)width * sizeof(float));
    }
    barrier(c); /* every slice is read before its rank goes on */
}
