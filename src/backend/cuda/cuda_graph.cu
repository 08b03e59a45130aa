/* cuda_graph.cu - the op table's entries, and CUDA graphs for decode steps.
 *
 * The forward pass issues the same few hundred ops for every decoded token, with the same
 * buffers and sizes. Launched one by one, their launch cost exceeds the GPU time of a
 * 4-bit 7B model. So each op call is recorded (kind and arguments) on a tape; a step runs
 * from the first op after a synchronisation point (download, synchronize, upload, ...) to
 * the next one:
 *   - with no tape, the step is captured into a graph while it is recorded;
 *   - with a tape, the calls are only compared with it; if the whole step matches, the
 *     cached graph is launched at the synchronisation point and no op is launched singly;
 *   - on the first difference, capture starts, the matched prefix is re-issued from the
 *     tape, and the step continues as a capture (the graph is then updated in place when
 *     its shape allows, else instantiated again).
 * Steps of more than EXL_CUDA_GRAPH_MAX_ROWS rows and prompt pieces (prefill: cuBLAS, large
 * scratch) run directly, as does the rest of a step in which something cannot be captured (a
 * scratch buffer growing). EXL_CUDA_GRAPHS=0 turns graphs off. */
#include "backend/cuda/cuda_internal.h"

#include <stdlib.h>
#include <string.h>

enum { GRAPH_IDLE, GRAPH_MATCHING, GRAPH_CAPTURING, GRAPH_BYPASS };

enum {
    OP_EMBED,
    OP_RMSNORM,
    OP_MATMUL,
    OP_ROPE,
    OP_KV_STORE,
    OP_ATTENTION,
    OP_GLU,
    OP_ADD,
    OP_GATHER_ROWS,
    OP_MATMUL_FUSED,
    OP_ROPE_KV_STORE,
    OP_ROPE_ATTENTION,
    OP_ARGMAX,
};

/* One recorded call; compared byte for byte, so always built from a zeroed struct. */
typedef struct exl_cuda_op {
    int32_t kind;
    int32_t i[5];
    int64_t n;
    float f[2];
    const void *p[8];
    exl_batch b;        /* device pointers and sizes only (host pointers cleared) */
    exl_attn_shape sh;
    exl_matmul_fused mf;
} exl_cuda_op;

static void run(exl_cuda_backend *cb, const exl_cuda_op *o) {
    exl_backend *be = &cb->base;
    switch (o->kind) {
    case OP_EMBED:
        exl_cuda_run_embed(be, (float *)o->p[0], (const exl_linear *)o->p[1], (const int32_t *)o->p[2], o->i[0],
                           o->f[0]);
        break;
    case OP_RMSNORM:
        exl_cuda_run_rmsnorm(be, (float *)o->p[0], (const float *)o->p[1], (const exl_vector *)o->p[2], o->i[0],
                             o->i[1], o->f[0]);
        break;
    case OP_MATMUL:
        exl_cuda_run_matmul(be, (float *)o->p[0], (const float *)o->p[1], (const exl_linear *)o->p[2], o->i[0]);
        break;
    case OP_ROPE:
        exl_cuda_run_rope(be, (float *)o->p[0], (const int32_t *)o->p[1], o->i[0], o->i[1], o->i[2], o->i[3],
                          (const float *)o->p[2], o->f[0]);
        break;
    case OP_KV_STORE:
        exl_cuda_run_kv_store(be, (void *)o->p[0], (void *)o->p[1], (const float *)o->p[2], (const float *)o->p[3],
                              &o->b, o->i[0]);
        break;
    case OP_ATTENTION:
        exl_cuda_run_attention(be, (float *)o->p[0], (const float *)o->p[1], (const float *)o->p[4],
                               (const float *)o->p[5], o->p[2], o->p[3], &o->b, &o->sh);
        break;
    case OP_GLU: exl_cuda_run_glu(be, (float *)o->p[0], (const float *)o->p[1], o->i[0], o->i[1], o->i[2]); break;
    case OP_ADD: exl_cuda_run_add(be, (float *)o->p[0], (const float *)o->p[1], o->n); break;
    case OP_GATHER_ROWS:
        exl_cuda_run_gather_rows(be, (float *)o->p[0], (const float *)o->p[1], (const int32_t *)o->p[2], o->i[0],
                                 o->i[1]);
        break;
    case OP_MATMUL_FUSED: exl_cuda_run_matmul_fused(be, &o->mf); break;
    case OP_ROPE_KV_STORE:
        exl_cuda_run_rope_kv_store(be, (float *)o->p[0], (float *)o->p[1], (const float *)o->p[2], (void *)o->p[3],
                                   (void *)o->p[4], &o->b, &o->sh, o->i[0], (const float *)o->p[5], o->f[0]);
        break;
    case OP_ROPE_ATTENTION:
        exl_cuda_run_rope_attention(be, (float *)o->p[6], (float *)o->p[0], (float *)o->p[1], (const float *)o->p[2],
                                    (void *)o->p[3], (void *)o->p[4], &o->b, &o->sh, o->i[0], (const float *)o->p[5],
                                    o->f[0], (const exl_linear *)o->p[7]);
        break;
    case OP_ARGMAX:
        exl_cuda_run_argmax(be, (int32_t *)o->p[0], (const float *)o->p[1], o->i[0], o->i[1]);
        break;
    }
}

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
    cb->graph_state = GRAPH_CAPTURING;
    return 1;
}

/* End a capture and launch it; keep = make it the cached graph (else a one-off). */
static void end_capture(exl_cuda_backend *cb, int keep) {
    cudaGraph_t g = NULL;
    cudaError_t e = cudaStreamEndCapture(cb->stream, &g);
    cb->graph_state = GRAPH_IDLE;
    if (e != cudaSuccess) {
        graphs_fail(cb, "end capture", e);
        return;
    }
    cudaGraphExec_t x = NULL;
    if (keep && cb->exec) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(cb->exec, g, &info) == cudaSuccess) {
            x = cb->exec;
        } else {
            cudaGetLastError();
            cudaGraphExecDestroy(cb->exec);
            cb->exec = NULL;
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
        cb->exec = x;
    } else {
        if (cb->exec == x)
            cb->exec = NULL;
        cudaGraphExecDestroy(x);
    }
}

static void drop_tape(exl_cuda_backend *cb) {
    cb->tape_len = 0;
    if (cb->exec) {
        cudaGraphExecDestroy(cb->exec);
        cb->exec = NULL;
    }
}

static int tape_push(exl_cuda_backend *cb, const exl_cuda_op *o) {
    if (cb->tape_len == cb->tape_cap) {
        int32_t cap = cb->tape_cap ? 2 * cb->tape_cap : 1024;
        exl_cuda_op *t = (exl_cuda_op *)realloc(cb->tape, (size_t)cap * sizeof *t);
        if (!t)
            return 0;
        cb->tape = t;
        cb->tape_cap = cap;
    }
    cb->tape[cb->tape_len++] = *o;
    return 1;
}

void exl_cuda_graph_flush(exl_cuda_backend *cb) {
    if (cb->graph_state == GRAPH_CAPTURING) {
        end_capture(cb, 0);
    } else if (cb->graph_state == GRAPH_MATCHING) {
        for (int32_t i = 0; i < cb->match_pos; i++)
            run(cb, &cb->tape[i]);
    }
    drop_tape(cb); /* buffers it refers to may be about to change */
    if (cb->graph_state != GRAPH_IDLE)
        cb->graph_state = GRAPH_BYPASS;
}

void exl_cuda_graph_forget(exl_cuda_backend *cb) {
    exl_cuda_graph_finish(cb);
    drop_tape(cb);
}

void exl_cuda_graph_finish(exl_cuda_backend *cb) {
    switch (cb->graph_state) {
    case GRAPH_CAPTURING: end_capture(cb, 1); break;
    case GRAPH_MATCHING:
        if (cb->match_pos == cb->tape_len) {
            cudaError_t e = cudaGraphLaunch(cb->exec, cb->stream);
            if (e != cudaSuccess)
                graphs_fail(cb, "launch", e);
        } else { /* the step was a prefix of the tape: a different step */
            for (int32_t i = 0; i < cb->match_pos; i++)
                run(cb, &cb->tape[i]);
            drop_tape(cb);
        }
        break;
    default: break;
    }
    cb->graph_state = GRAPH_IDLE;
    exl_cuda_argmax_mark(cb);
}

void exl_cuda_graph_free(exl_cuda_backend *cb) {
    drop_tape(cb);
    free(cb->tape);
    cb->tape = NULL;
    cb->tape_cap = 0;
}

/* Route one op: run it now, capture it, or match it against the tape. */
static void submit(exl_cuda_backend *cb, exl_cuda_op *o, int graphable) {
    if (cb->graph_state == GRAPH_IDLE) {
        if (cb->graphs_off || !graphable || cb->sticky != EXL_OK) {
            cb->graph_state = GRAPH_BYPASS;
        } else if (cb->tape_len && cb->exec) {
            cb->graph_state = GRAPH_MATCHING;
            cb->match_pos = 0;
        } else {
            cb->tape_len = 0;
            if (!begin_capture(cb))
                cb->graph_state = GRAPH_BYPASS;
        }
    }
    if (cb->graph_state != GRAPH_BYPASS && !graphable)
        exl_cuda_graph_flush(cb);
    if (cb->graph_state == GRAPH_MATCHING) {
        if (cb->match_pos < cb->tape_len && !memcmp(&cb->tape[cb->match_pos], o, sizeof *o)) {
            cb->match_pos++;
            return;
        }
        cb->tape_len = cb->match_pos; /* keep the matched prefix, capture from here */
        if (!begin_capture(cb)) {
            exl_cuda_graph_flush(cb);
        } else {
            for (int32_t i = 0; i < cb->tape_len; i++)
                run(cb, &cb->tape[i]);
        }
    }
    if (cb->graph_state == GRAPH_CAPTURING && !tape_push(cb, o))
        exl_cuda_graph_flush(cb);
    run(cb, o);
}

static exl_cuda_op new_op(int kind) {
    exl_cuda_op o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    return o;
}

/* ---- the op table's entries */

void exl_cuda_embed(exl_backend *be, float *out, const exl_linear *table, const int32_t *ids, int32_t rows,
                    float scale) {
    exl_cuda_op o = new_op(OP_EMBED);
    o.p[0] = out, o.p[1] = table, o.p[2] = ids, o.i[0] = rows, o.f[0] = scale;
    submit(exl_cuda(be), &o, rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_rmsnorm(exl_backend *be, float *out, const float *x, const exl_vector *w, int32_t rows, int32_t width,
                      float eps) {
    exl_cuda_op o = new_op(OP_RMSNORM);
    o.p[0] = out, o.p[1] = x, o.p[2] = w, o.i[0] = rows, o.i[1] = width, o.f[0] = eps;
    submit(exl_cuda(be), &o, rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_matmul(exl_backend *be, float *out, const float *x, const exl_linear *w, int32_t rows) {
    exl_cuda_op o = new_op(OP_MATMUL);
    o.p[0] = out, o.p[1] = x, o.p[2] = w, o.i[0] = rows;
    submit(exl_cuda(be), &o, rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_rope(exl_backend *be, float *x, const int32_t *pos, int32_t rows, int32_t n_heads, int32_t head_dim,
                   int32_t rot_dim, const float *inv_freq, float attn_factor) {
    exl_cuda_op o = new_op(OP_ROPE);
    o.p[0] = x, o.p[1] = pos, o.p[2] = inv_freq, o.i[0] = rows, o.i[1] = n_heads, o.i[2] = head_dim;
    o.i[3] = rot_dim, o.f[0] = attn_factor;
    submit(exl_cuda(be), &o, rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

/* the batch as the GPU ops read it */
static exl_batch device_batch(const exl_batch *b) {
    exl_batch d;
    memset(&d, 0, sizeof d);
    d.n_rows = b->n_rows, d.n_seqs = b->n_seqs, d.max_q = b->max_q;
    d.max_kv = (b->max_kv + EXL_CUDA_KV_BUCKET - 1) / EXL_CUDA_KV_BUCKET * EXL_CUDA_KV_BUCKET;
    d.d_seqs = b->d_seqs, d.d_ids = b->d_ids, d.d_pos = b->d_pos, d.d_slots = b->d_slots;
    d.d_page_tables = b->d_page_tables;
    return d;
}

void exl_cuda_kv_store(exl_backend *be, void *k_cache, void *v_cache, const float *k, const float *v,
                       const exl_batch *b, int32_t kv_width) {
    exl_cuda_op o = new_op(OP_KV_STORE);
    o.p[0] = k_cache, o.p[1] = v_cache, o.p[2] = k, o.p[3] = v, o.i[0] = kv_width;
    o.b = device_batch(b);
    submit(exl_cuda(be), &o, b->n_rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_attention(exl_backend *be, float *out, const float *q, const float *k, const float *v,
                        const void *k_cache, const void *v_cache, const exl_batch *b, const exl_attn_shape *shape) {
    exl_cuda_op o = new_op(OP_ATTENTION);
    o.p[0] = out, o.p[1] = q, o.p[2] = k_cache, o.p[3] = v_cache, o.p[4] = k, o.p[5] = v;
    o.b = device_batch(b);
    o.sh = *shape;
    submit(exl_cuda(be), &o, b->n_rows <= EXL_CUDA_GRAPH_MAX_ROWS && b->max_q <= EXL_CUDA_DECODE_MAX_Q);
}

void exl_cuda_glu(exl_backend *be, float *gate, const float *up, int32_t rows, int32_t width, int act) {
    exl_cuda_op o = new_op(OP_GLU);
    o.p[0] = gate, o.p[1] = up, o.i[0] = rows, o.i[1] = width, o.i[2] = act;
    submit(exl_cuda(be), &o, rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_add(exl_backend *be, float *x, const float *y, int64_t n) {
    exl_cuda_op o = new_op(OP_ADD);
    o.p[0] = x, o.p[1] = y, o.n = n;
    submit(exl_cuda(be), &o, 1);
}

void exl_cuda_gather_rows(exl_backend *be, float *out, const float *x, const int32_t *idx, int32_t n,
                          int32_t width) {
    exl_cuda_op o = new_op(OP_GATHER_ROWS);
    o.p[0] = out, o.p[1] = x, o.p[2] = idx, o.i[0] = n, o.i[1] = width;
    submit(exl_cuda(be), &o, n <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_matmul_fused(exl_backend *be, const exl_matmul_fused *f) {
    exl_cuda_backend *cb = exl_cuda(be);
    size_t need = exl_cuda_fused_scratch_need(cb, f) * sizeof(float);
    if (need && !exl_cuda_ensure(cb, (void **)&cb->fused_scratch, &cb->fused_scratch_bytes, need, "matmul scratch"))
        return;
    exl_cuda_op o = new_op(OP_MATMUL_FUSED);
    o.mf.rows = f->rows, o.mf.n = f->n, o.mf.in_features = f->in_features;
    o.mf.x = f->x, o.mf.norm = f->norm, o.mf.eps = f->eps, o.mf.up = f->up, o.mf.act = f->act;
    o.mf.accumulate = f->accumulate, o.mf.decode = f->decode, o.mf.out_zero = f->out_zero, o.mf.feeds = f->feeds;
    for (int i = 0; i < f->n && i < 3; i++)
        o.mf.out_features[i] = f->out_features[i], o.mf.w[i] = f->w[i], o.mf.out[i] = f->out[i];
    for (int i = 0; i < 3; i++)
        o.mf.clear[i] = f->n_clear[i] > 0 ? f->clear[i] : NULL, o.mf.n_clear[i] = o.mf.clear[i] ? f->n_clear[i] : 0;
    if (f->kv.k_cache) { /* field by field: the record is compared byte for byte */
        o.mf.kv.k_cache = f->kv.k_cache, o.mf.kv.v_cache = f->kv.v_cache, o.mf.kv.seqs = f->kv.seqs;
        o.mf.kv.page_tables = f->kv.page_tables, o.mf.kv.n_seqs = f->kv.n_seqs;
        o.mf.kv.page_size = f->kv.page_size, o.mf.kv.width = f->kv.width;
    }
    submit(cb, &o, f->rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_rope_kv_store(exl_backend *be, float *q, float *k, const float *v, void *k_cache, void *v_cache,
                            const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim, const float *inv_freq,
                            float attn_factor) {
    exl_cuda_op o = new_op(OP_ROPE_KV_STORE);
    o.p[0] = q, o.p[1] = k, o.p[2] = v, o.p[3] = k_cache, o.p[4] = v_cache, o.p[5] = inv_freq;
    o.i[0] = rot_dim, o.f[0] = attn_factor;
    o.b = device_batch(b);
    o.sh = *sh;
    submit(exl_cuda(be), &o, b->n_rows <= EXL_CUDA_GRAPH_MAX_ROWS);
}

void exl_cuda_rope_attention(exl_backend *be, float *out, float *q, float *k, const float *v, void *k_cache,
                             void *v_cache, const exl_batch *b, const exl_attn_shape *sh, int32_t rot_dim,
                             const float *inv_freq, float attn_factor, const exl_linear *feeds) {
    exl_cuda_op o = new_op(OP_ROPE_ATTENTION);
    o.p[0] = q, o.p[1] = k, o.p[2] = v, o.p[3] = k_cache, o.p[4] = v_cache, o.p[5] = inv_freq, o.p[6] = out;
    o.p[7] = feeds;
    o.i[0] = rot_dim, o.f[0] = attn_factor;
    o.b = device_batch(b);
    o.sh = *sh;
    submit(exl_cuda(be), &o, b->n_rows <= EXL_CUDA_GRAPH_MAX_ROWS && b->max_q <= EXL_CUDA_DECODE_MAX_Q);
}

int64_t exl_cuda_argmax(exl_backend *be, int32_t *ids, const float *logits, int32_t rows, int32_t vocab) {
    exl_cuda_backend *cb = exl_cuda(be);
    if (rows < 1 || rows > EXL_ARGMAX_ROWS || vocab < 1) {
        exl_cuda_fail(EXL_ERR_ARG, "argmax: %d rows of %d (1 .. %d rows)", rows, vocab, EXL_ARGMAX_ROWS);
        return -1;
    }
    if (!exl_cuda_argmax_ready(cb))
        return -1;
    exl_cuda_op o = new_op(OP_ARGMAX);
    o.p[0] = ids, o.p[1] = logits, o.i[0] = rows, o.i[1] = vocab;
    submit(cb, &o, 1);
    cb->argmax_rows[cb->argmax_issued % EXL_ARGMAX_KEEP] = rows;
    return cb->argmax_issued++;
}
