/* warmup.c - one throwaway prompt step when a generator starts on a GPU, so that the first burst of requests does not
 * pay for the backend's one-time setup of its many-row path (on an H100 the first step of 96+ rows took 110-180 ms
 * against ~35 warm: cuBLAS's first products, the decoded-weights buffer). The step writes keys and values to pages
 * that no job holds yet, which every job overwrites before it reads them; EXL_GEN_WARMUP=0 skips it. */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"

#include <stdlib.h>
#include <string.h>

#define WARMUP_ROWS 256 /* past the CUDA backend's many-row threshold (EXL_CUDA_DEQUANT_ROWS, default 96) */

exl_status exl_gen_warmup(exl_generator *g) {
    const char *e = getenv("EXL_GEN_WARMUP");
    if (!strcmp(g->model->be->name, "cpu") || (e && !strcmp(e, "0")))
        return EXL_OK;
    int64_t room = (int64_t)g->params.n_pages * g->params.page_size;
    int32_t rows = WARMUP_ROWS < g->params.max_batch_tokens ? WARMUP_ROWS : g->params.max_batch_tokens;
    rows = rows < room ? rows : (int32_t)room;
    int32_t n_pages = (rows + g->params.page_size - 1) / g->params.page_size;
    int32_t *ids = exl_calloc((size_t)rows, sizeof *ids), *pages = exl_malloc((size_t)n_pages * sizeof *pages);
    exl_status st = ids && pages ? EXL_OK : exl_fail(EXL_ERR_NOMEM, "out of memory");
    for (int32_t i = 0; st == EXL_OK && i < n_pages; i++)
        pages[i] = i;
    exl_seq_step step = {.ids = ids, .n_new = rows, .n_past = 0, .pages = pages, .n_pages = n_pages, .want_logits = 1};
    if (st == EXL_OK && rows > 0)
        st = exl_model_forward(g->model, g->cache, &step, 1, g->logits);
    exl_free(ids);
    exl_free(pages);
    return st;
}
