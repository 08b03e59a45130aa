/* cuda_graph.cu - graph_run and the op table's other entries, and CUDA graphs for decode steps.
 *
 * The forward pass hands over each step as a graph (graph.h), which cuda_plan.cu compiles into launches. A decode
 * step issues the same few hundred launches for every token, with the same buffers and sizes; launched one by one,
 * their launch cost exceeds the GPU time of a 4-bit 7B model. So a step lasts from graph_run to the next
 * synchronisation point (download, synchronize, upload, ...), an argmax called in between (decode ahead) being its
 * tail, and a decode-sized step (cuda_plan.cu's graphable; speculative verification steps too) is:
 *   - for a graph unlike every cached one: compiled, and captured into a CUDA graph while its launches are issued,
 *     which the synchronisation point launches and keeps with its plan in an entry of the cache (an empty one, else
 *     the least recently used, whose CUDA graph is updated in place where the topology allows);
 *   - for a graph equal to a cached one (exl_cuda_plan_matches): not launched at all until the synchronisation
 *     point, which launches that entry's CUDA graph; a tail unlike the entry's has the step captured anew.
 * The cache keeps EXL_CUDA_GRAPH_CACHE shapes, so that steps alternating between shapes (a draft model's catch-up
 * and one-token steps, verification steps of a changing K) replay each. Prompts (more rows, longer pieces) run
 * launch by launch. Something that cannot be captured (a buffer growing) flushes: what was captured so far is
 * launched, every cached graph dropped, the rest of the step runs directly. The op table's
 * primitive ops end the step in flight and launch at once. EXL_CUDA_GRAPHS=0 turns graphs off. */
#include "backend/cuda/cuda_internal.h"

#include <stdlib.h>
#include <string.h>

enum { STEP_IDLE, STEP_REPLAY, STEP_CAPTURE };

static void graphs_fail(exl_cuda_backend *cb, const char *what, cudaError_t e) {
    exl_cuda_set_sticky(cb, EXL_ERR_DEVICE, "CUDA graph: %s: %s", what, cudaGetErrorString(e));
    cb->graphs_off = 1;
}

static int begin_capture(exl_cuda_backend *cb) {
    cudaError_t e = cudaStreamBeginCapture(cb->stream, cudaStreamCaptureModeThreadLocal);
    if (e != cudaSuccess) {
        graphs_fail(cb, "begin capture", e);
        return 0;
    }
    cb->step_state = STEP_CAPTURE;
    return 1;
}

/* the entry the step in flight replays or is captured into */
static exl_cuda_step_graph *current(exl_cuda_backend *cb) { return &cb->step_graphs[cb->step_graph]; }

static void drop_exec(exl_cuda_step_graph *sg) {
    sg->valid = 0;
    if (sg->exec) {
        cudaGraphExecDestroy(sg->exec);
        sg->exec = NULL;
    }
}

static void drop_all(exl_cuda_backend *cb) {
    for (int i = 0; i < EXL_CUDA_GRAPH_CACHE; i++)
        drop_exec(&cb->step_graphs[i]);
}

/* End a capture and launch it; keep = make it the current entry's graph (else a one-off). */
static void end_capture(exl_cuda_backend *cb, int keep) {
    exl_cuda_step_graph *sg = current(cb);
    cudaGraph_t g = NULL;
    exl_cuda_lora_side_close(cb); /* a shrink forked beside a matmul that grew a buffer: joined first */
    cudaError_t e = cudaStreamEndCapture(cb->stream, &g);
    cb->step_state = STEP_IDLE;
    if (e != cudaSuccess) {
        graphs_fail(cb, "end capture", e);
        return;
    }
    cudaGraphExec_t x = NULL;
    if (keep && sg->exec) { /* the entry's earlier graph updated in place where the topology allows */
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(sg->exec, g, &info) == cudaSuccess) {
            x = sg->exec;
        } else {
            cudaGetLastError();
            drop_exec(sg);
        }
    }
    if (!x && (e = cudaGraphInstantiate(&x, g, 0)) != cudaSuccess) {
        cudaGraphDestroy(g);
        graphs_fail(cb, "instantiate", e);
        return;
    }
    cudaGraphDestroy(g);
    if ((e = cudaGraphLaunch(x, cb->stream)) != cudaSuccess)
        graphs_fail(cb, "launch", e);
    if (keep) {
        sg->exec = x;
        sg->valid = e == cudaSuccess;
    } else {
        cudaGraphExecDestroy(x);
    }
}

/* launch the current entry's step, which the step in flight has matched so far */
static void launch_replay(exl_cuda_backend *cb) {
    exl_cuda_step_graph *sg = current(cb);
    if (sg->tail.set && !sg->tail.seen) { /* it ended before the argmax the CUDA graph holds */
        exl_cuda_plan_run(cb, sg->plan);
        return;
    }
    cudaError_t e = cudaGraphLaunch(sg->exec, cb->stream);
    if (e != cudaSuccess)
        graphs_fail(cb, "launch", e);
}

void exl_cuda_graph_finish(exl_cuda_backend *cb) {
    if (cb->step_state == STEP_CAPTURE)
        end_capture(cb, 1);
    else if (cb->step_state == STEP_REPLAY)
        launch_replay(cb);
    cb->step_state = STEP_IDLE;
    exl_cuda_argmax_mark(cb);
}

void exl_cuda_graph_flush(exl_cuda_backend *cb) {
    if (cb->step_state == STEP_CAPTURE)
        end_capture(cb, 0);
    else if (cb->step_state == STEP_REPLAY)
        launch_replay(cb);
    cb->step_state = STEP_IDLE;
    drop_all(cb); /* buffers they refer to may be about to change */
}

void exl_cuda_graph_forget(exl_cuda_backend *cb) {
    exl_cuda_graph_finish(cb);
    drop_all(cb);
}

void exl_cuda_graph_free(exl_cuda_backend *cb) {
    drop_all(cb);
    for (int i = 0; i <= EXL_CUDA_GRAPH_CACHE; i++) {
        exl_cuda_plan **p = i < EXL_CUDA_GRAPH_CACHE ? &cb->step_graphs[i].plan : &cb->direct;
        if (*p) {
            exl_cuda_plan_free(*p);
            free(*p);
            *p = NULL;
        }
    }
}

/* the entry a new decode-sized step is captured into: an empty one, else the least recently used */
static int32_t capture_entry(const exl_cuda_backend *cb) {
    int32_t v = 0;
    for (int32_t i = 1; i < EXL_CUDA_GRAPH_CACHE; i++) {
        const exl_cuda_step_graph *a = &cb->step_graphs[i], *b = &cb->step_graphs[v];
        if ((a->valid ? a->used : 0) < (b->valid ? b->used : 0))
            v = i;
    }
    return v;
}

/* ---- the op table's entries */

exl_status exl_cuda_graph_run(exl_backend *be, const exl_graph *g) {
    exl_cuda_backend *cb = exl_cuda(be);
    exl_cuda_graph_finish(cb);
    if (!cb->direct && !(cb->direct = (exl_cuda_plan *)calloc(1, sizeof *cb->direct)))
        return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
    cb->graph_clock++;
    for (int32_t i = 0; i < EXL_CUDA_GRAPH_CACHE; i++) {
        exl_cuda_step_graph *sg = &cb->step_graphs[i];
        if (sg->valid && exl_cuda_plan_matches(sg->plan, g)) {
            cb->step_graph = i;
            cb->step_state = STEP_REPLAY;
            sg->used = cb->graph_clock;
            sg->tail.seen = 0;
            return EXL_OK;
        }
    }
    EXL_TRY(exl_cuda_plan_compile(cb, g, cb->direct));
    if (cb->direct->graphable && !cb->graphs_off && cb->sticky == EXL_OK) {
        /* a new entry's step; the CUDA graph the entry held stays to be updated in place where it can */
        const int32_t v = capture_entry(cb);
        exl_cuda_step_graph *sg = &cb->step_graphs[v];
        if (!sg->plan && !(sg->plan = (exl_cuda_plan *)calloc(1, sizeof *sg->plan)))
            return exl_cuda_fail(EXL_ERR_NOMEM, "out of host memory");
        exl_cuda_plan *p = sg->plan;
        sg->plan = cb->direct;
        cb->direct = p;
        sg->valid = 0;
        sg->tail.set = 0;
        sg->used = cb->graph_clock;
        cb->step_graph = v;
        begin_capture(cb);
        exl_cuda_plan_run(cb, sg->plan);
        return EXL_OK;
    }
    exl_cuda_plan_run(cb, cb->direct);
    return EXL_OK;
}

int64_t exl_cuda_argmax(exl_backend *be, int32_t *ids, const float *logits, int32_t rows, int32_t vocab) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (rows < 1 || rows > EXL_ARGMAX_ROWS || vocab < 1) {
        exl_cuda_fail(EXL_ERR_ARG, "argmax: %d rows of %d (1 .. %d rows)", rows, vocab, EXL_ARGMAX_ROWS);
        return -1;
    }
    if (!exl_cuda_argmax_ready(cb))
        return -1;
    exl_cuda_step_graph *sg = current(cb);
    int same = sg->tail.set && !sg->tail.seen && sg->tail.ids == ids && sg->tail.logits == logits &&
               sg->tail.rows == rows && sg->tail.vocab == vocab;
    if (cb->step_state == STEP_REPLAY && same) {
        sg->tail.seen = 1;
    } else {
        if (cb->step_state == STEP_REPLAY) { /* the entry's step with another tail: capture it anew */
            sg->valid = 0;
            sg->tail.set = 0;
            begin_capture(cb);
            exl_cuda_plan_run(cb, sg->plan);
        } else if (cb->step_state == STEP_CAPTURE && sg->tail.set) { /* a second argmax */
            exl_cuda_graph_flush(cb);
        }
        if (cb->step_state == STEP_CAPTURE) {
            sg->tail.ids = ids, sg->tail.logits = logits, sg->tail.rows = rows, sg->tail.vocab = vocab;
            sg->tail.set = 1;
        }
        exl_cuda_run_argmax(be, ids, logits, rows, vocab);
    }
    cb->argmax_rows[cb->argmax_issued % EXL_ARGMAX_KEEP] = rows;
    return cb->argmax_issued++;
}

void exl_cuda_embed(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows,
                    float scale) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_embed(be, out, table, ids, rows, scale);
}

void exl_cuda_rmsnorm(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                      float eps) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_rmsnorm(be, out, x, w, rows, width, eps);
}

void exl_cuda_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_matmul(be, out, x, w, rows);
}

void exl_cuda_rope(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                   int32_t rot_dim, const float *inv_freq, float attn_factor) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_rope(be, x, pos, rows, n_heads, head_dim, rot_dim, inv_freq, attn_factor);
}

void exl_cuda_kv_store(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                       const exl_batch *b, int32_t kv_width) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_batch d = exl_cuda_device_batch(b);
    exl_cuda_run_kv_store(be, k_cache, v_cache, k, v, &d, kv_width);
}

void exl_cuda_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                        const void *k_cache, const void *v_cache, const exl_batch *b, const exl_attn_shape *shape) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_batch d = exl_cuda_device_batch(b);
    exl_cuda_run_attention(be, out, q, k, v, k_cache, v_cache, &d, shape);
}

void exl_cuda_glu(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_glu(be, gate, up, rows, width, act);
}

void exl_cuda_add(exl_backend *be, float *x, const float *y, int64_t n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_add(be, x, y, n);
}

void exl_cuda_gather_rows(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n, int32_t width) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_gather_rows(be, out, x, idx, n, width);
}

void exl_cuda_copy_cols(exl_backend *be, float *out, const float *x, int32_t rows, int32_t width, int32_t x_width,
                        int32_t col) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_copy_cols(be, out, x, rows, width, x_width, col);
}

void exl_cuda_softcap(exl_backend *be, float *x, int64_t n, float cap) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_softcap(be, x, n, cap);
}

void exl_cuda_row_gate(exl_backend *be, float *x, const float *g, int32_t rows, int32_t width) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_row_gate(be, x, g, rows, width);
}

void exl_cuda_moe_route(exl_backend *be, const exl_moe_route_node *n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_moe_route(be, n);
}

void exl_cuda_moe_experts(exl_backend *be, const exl_moe_experts_node *n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_moe_experts(be, n, 0);
}

void exl_cuda_lora(exl_backend *be, const exl_lora_node *n) {
    exl_cuda_graph_finish(exl_cuda(be));
    exl_cuda_run_lora(be, n);
}
