/* kv_cache.c - paged K/V storage on the model's backend. */
#include "model/model.h"

#include "base/alloc.h"
#include "base/error.h"

exl_status exl_kv_cache_init(exl_model *m, int32_t n_pages, int32_t page_size, exl_kv_cache **out) {
    *out = NULL;
    if (n_pages < 1 || page_size < 1)
        return exl_fail(EXL_ERR_ARG, "kv cache: need at least one page of at least one token");
    exl_kv_cache *c = exl_calloc(1, sizeof *c);
    if (!c)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    c->n_pages = n_pages;
    c->page_size = page_size;
    c->n_layers = m->cfg.n_layers;
    c->kv_width = m->cfg.n_kv_heads * m->cfg.head_dim;
    c->k = exl_calloc((size_t)c->n_layers, sizeof *c->k);
    c->v = exl_calloc((size_t)c->n_layers, sizeof *c->v);
    if (!c->k || !c->v) {
        exl_kv_cache_free(m, c);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    size_t bytes = (size_t)n_pages * page_size * c->kv_width * m->be->kv_elem_bytes;
    for (int32_t i = 0; i < c->n_layers; i++) {
        c->k[i] = m->be->ops->alloc(m->be, bytes);
        c->v[i] = c->k[i] ? m->be->ops->alloc(m->be, bytes) : NULL;
        if (!c->v[i]) {
            exl_kv_cache_free(m, c);
            return exl_fail_prefix(EXL_ERR_NOMEM, "kv cache of %d pages x %d tokens", n_pages, page_size);
        }
    }
    *out = c;
    return EXL_OK;
}

void exl_kv_cache_free(exl_model *m, exl_kv_cache *c) {
    if (!c)
        return;
    for (int32_t i = 0; i < c->n_layers; i++) {
        if (c->k && c->k[i])
            m->be->ops->free(m->be, c->k[i]);
        if (c->v && c->v[i])
            m->be->ops->free(m->be, c->v[i]);
    }
    exl_free(c->k);
    exl_free(c->v);
    exl_free(c);
}

exl_status exl_kv_cache_copy_page(exl_model *m, exl_kv_cache *c, int32_t src, int32_t dst, int32_t n_slots) {
    if (src < 0 || src >= c->n_pages || dst < 0 || dst >= c->n_pages || n_slots < 0 || n_slots > c->page_size)
        return exl_fail(EXL_ERR_ARG, "kv cache: cannot copy %d slots from page %d to page %d", n_slots, src, dst);
    /* Through the host: the op table has no device-to-device copy, and this is rare. */
    size_t slot_bytes = (size_t)c->kv_width * m->be->kv_elem_bytes, bytes = (size_t)n_slots * slot_bytes;
    size_t src_off = (size_t)src * c->page_size * slot_bytes, dst_off = (size_t)dst * c->page_size * slot_bytes;
    if (!bytes || src == dst)
        return EXL_OK;
    unsigned char *tmp = exl_malloc(bytes);
    if (!tmp)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = EXL_OK;
    for (int32_t l = 0; l < c->n_layers && st == EXL_OK; l++) {
        void *kv[2] = {c->k[l], c->v[l]};
        for (int i = 0; i < 2 && st == EXL_OK; i++) {
            st = m->be->ops->download(m->be, tmp, (unsigned char *)kv[i] + src_off, bytes);
            if (st == EXL_OK)
                st = m->be->ops->upload(m->be, (unsigned char *)kv[i] + dst_off, tmp, bytes);
        }
    }
    exl_free(tmp);
    return st;
}
