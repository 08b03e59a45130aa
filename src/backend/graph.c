/* graph.c - building a step's graph (graph.h): its node array and outputs. */
#include "backend/graph.h"

#include "base/alloc.h"
#include "base/error.h"

#include <string.h>

void exl_graph_reset(exl_graph *g, const exl_batch *batch) {
    g->n_nodes = 0;
    g->n_outputs = 0;
    g->batch = batch;
    g->tmp = NULL;
    g->tmp_floats = 0;
}

exl_status exl_graph_add(exl_graph *g, const exl_node *n) {
    if (g->n_nodes == g->cap_nodes) {
        int32_t cap = g->cap_nodes ? 2 * g->cap_nodes : 64;
        exl_node *p = exl_realloc(g->nodes, (size_t)cap * sizeof *p);
        if (!p)
            return exl_fail(EXL_ERR_NOMEM, "out of memory building a step graph");
        g->nodes = p;
        g->cap_nodes = cap;
    }
    g->nodes[g->n_nodes++] = *n;
    return EXL_OK;
}

exl_status exl_graph_output(exl_graph *g, const float *p, int64_t n) {
    if (g->n_outputs == EXL_GRAPH_MAX_OUTPUTS)
        return exl_fail(EXL_ERR_ARG, "a graph has at most %d outputs", EXL_GRAPH_MAX_OUTPUTS);
    g->outputs[g->n_outputs++] = (exl_span){p, n};
    return EXL_OK;
}

void exl_graph_free(exl_graph *g) {
    exl_free(g->nodes);
    memset(g, 0, sizeof *g);
}
