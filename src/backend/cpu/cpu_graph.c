/* cpu_graph.c - the CPU's graph_run: the generic executor (graph_exec.c), except that neighbouring decode matmuls of
 * one input (q, k and v; gate and up) run as one job of the pool, one fork-join instead of two or three, each with
 * the results it has alone. */
#include "backend/cpu/cpu.h"
#include "base/error.h"

/* nodes [a, b) of g through the generic executor */
static exl_status run_range(exl_backend *be, const exl_graph *g, int32_t a, int32_t b) {
    exl_graph part = *g;
    part.nodes = g->nodes + a;
    part.n_nodes = b - a;
    return exl_graph_exec(be, &part, NULL, NULL);
}

static int fusable(exl_backend *be, const exl_node *n) {
    return n->op == EXL_OP_MATMUL && !n->matmul.accumulate && exl_cpu_qmatmul_fusable(be, n->matmul.w, n->matmul.rows);
}

/* How many matmuls from node i on can run as one job (1: none to fuse) */
static int fused_run(exl_backend *be, const exl_graph *g, int32_t i) {
    const exl_node *first = &g->nodes[i];
    if (!fusable(be, first))
        return 1;
    int n = 1;
    while (n < EXL_CPU_FUSED_MATMULS && i + n < g->n_nodes) {
        const exl_node *next = &g->nodes[i + n];
        if (!fusable(be, next) || next->matmul.x != first->matmul.x || next->matmul.rows != first->matmul.rows)
            break;
        n++;
    }
    return n;
}

exl_status exl_cpu_graph_run(exl_backend *be, const exl_graph *g) {
    int32_t done = 0, i = 0;
    while (i < g->n_nodes) {
        const int n = fused_run(be, g, i);
        if (n < 2) {
            i++;
            continue;
        }
        if (i > done)
            EXL_TRY(run_range(be, g, done, i));
        float *outs[EXL_CPU_FUSED_MATMULS];
        const exl_linear *ws[EXL_CPU_FUSED_MATMULS];
        for (int k = 0; k < n; k++)
            outs[k] = g->nodes[i + k].matmul.out, ws[k] = g->nodes[i + k].matmul.w;
        exl_cpu_qmatmul_many(be, outs, g->nodes[i].matmul.x, ws, n, g->nodes[i].matmul.rows);
        i += n;
        done = i;
    }
    return done < g->n_nodes ? run_range(be, g, done, g->n_nodes) : EXL_OK;
}
