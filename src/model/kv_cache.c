/* kv_cache.c - paged K/V storage on the model's backend, full precision or quantized (backend/kv_quant.h). */
#include "model/model.h"
#include "model/tp.h"

#include "backend/kv_quant.h"
#include "base/alloc.h"
#include "base/error.h"

exl_status exl_kv_cache_format(const exl_model *m, int32_t k_bits, int32_t v_bits, exl_kv_format *fmt) {
    *fmt = (exl_kv_format){0};
    if (!exl_kv_bits_ok(k_bits) || !exl_kv_bits_ok(v_bits))
        return exl_fail(EXL_ERR_ARG, "kv cache: %d bits per %s is not supported (16, 8, 6 or 4)",
                        exl_kv_bits_ok(k_bits) ? v_bits : k_bits, exl_kv_bits_ok(k_bits) ? "value" : "key");
    int32_t group = exl_kv_group(m->cfg.head_dim);
    if ((exl_kv_quantized(k_bits) || exl_kv_quantized(v_bits)) && !group)
        return exl_fail(EXL_ERR_UNSUPPORTED, "kv cache: quantizing it needs a head_dim that is a multiple of 8 (%d)",
                        m->cfg.head_dim);
    fmt->k_bits = k_bits ? k_bits : 16;
    fmt->v_bits = v_bits ? v_bits : 16;
    fmt->group = exl_kv_quantized(k_bits) || exl_kv_quantized(v_bits) ? group : 0;
    return EXL_OK;
}

int64_t exl_kv_cache_token_bytes(const exl_model *m, const exl_kv_format *fmt) {
    int32_t width = m->cfg.n_kv_heads * m->cfg.head_dim, layers = 0;
    size_t e = m->be->kv_elem_bytes;
    for (int32_t i = 0; i < m->cfg.n_layers; i++) /* the layers on this device (a layer split holds some) */
        layers += exl_tp_holds_layer(m, i);
    return (int64_t)layers * (int64_t)(exl_kv_slot_bytes(width, fmt->k_bits, fmt->group, e) +
                                       exl_kv_slot_bytes(width, fmt->v_bits, fmt->group, e));
}

exl_status exl_kv_cache_init(exl_model *m, int32_t n_pages, int32_t page_size, int32_t k_bits, int32_t v_bits,
                             exl_kv_cache **out) {
    if (m->tp)
        return exl_tp_kv_cache_init(m, n_pages, page_size, k_bits, v_bits, out);
    return exl_kv_cache_init_local(m, n_pages, page_size, k_bits, v_bits, out);
}

void exl_kv_cache_free(exl_model *m, exl_kv_cache *c) {
    if (m->tp)
        exl_tp_kv_cache_free(m, c);
    else
        exl_kv_cache_free_local(m, c);
}

exl_status exl_kv_cache_copy_page(exl_model *m, exl_kv_cache *c, int32_t src, int32_t dst, int32_t n_slots) {
    if (m->tp)
        return exl_tp_kv_cache_copy_page(m, c, src, dst, n_slots);
    return exl_kv_cache_copy_page_local(m, c, src, dst, n_slots);
}

exl_status exl_kv_cache_init_local(exl_model *m, int32_t n_pages, int32_t page_size, int32_t k_bits, int32_t v_bits,
                                   exl_kv_cache **out) {
    *out = NULL;
    if (n_pages < 1 || page_size < 1)
        return exl_fail(EXL_ERR_ARG, "kv cache: need at least one page of at least one token");
    exl_kv_format fmt;
    EXL_TRY(exl_kv_cache_format(m, k_bits, v_bits, &fmt));
    int64_t tokens = (int64_t)n_pages * page_size;
    EXL_TRY(exl_kv_cache_check_fits(m, tokens * exl_kv_cache_token_bytes(m, &fmt), tokens));
    exl_kv_cache *c = exl_calloc(1, sizeof *c);
    if (!c)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    c->n_pages = n_pages;
    c->page_size = page_size;
    c->n_layers = m->cfg.n_layers;
    c->kv_width = m->cfg.n_kv_heads * m->cfg.head_dim;
    c->fmt = fmt;
    c->k_slot_bytes = exl_kv_slot_bytes(c->kv_width, fmt.k_bits, fmt.group, m->be->kv_elem_bytes);
    c->v_slot_bytes = exl_kv_slot_bytes(c->kv_width, fmt.v_bits, fmt.group, m->be->kv_elem_bytes);
    c->k = exl_calloc((size_t)c->n_layers, sizeof *c->k);
    c->v = exl_calloc((size_t)c->n_layers, sizeof *c->v);
    if (!c->k || !c->v) {
        exl_kv_cache_free_local(m, c);
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    size_t slots = (size_t)n_pages * (size_t)page_size;
    for (int32_t i = 0; i < c->n_layers; i++) {
        if (!exl_tp_holds_layer(m, i))
            continue;
        c->k[i] = m->be->ops->alloc(m->be, slots * c->k_slot_bytes);
        c->v[i] = c->k[i] ? m->be->ops->alloc(m->be, slots * c->v_slot_bytes) : NULL;
        if (!c->v[i]) {
            exl_kv_cache_free_local(m, c);
            return exl_fail_prefix(EXL_ERR_NOMEM, "kv cache of %d pages x %d tokens", n_pages, page_size);
        }
    }
    *out = c;
    return EXL_OK;
}

void exl_kv_cache_free_local(exl_model *m, exl_kv_cache *c) {
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

exl_status exl_kv_cache_copy_page_local(exl_model *m, exl_kv_cache *c, int32_t src, int32_t dst, int32_t n_slots) {
    if (src < 0 || src >= c->n_pages || dst < 0 || dst >= c->n_pages || n_slots < 0 || n_slots > c->page_size)
        return exl_fail(EXL_ERR_ARG, "kv cache: cannot copy %d slots from page %d to page %d", n_slots, src, dst);
    if (!n_slots || src == dst)
        return EXL_OK;
    /* Through the host: the op table has no device-to-device copy, and this is rare. Slots are whole units of
     * either format (a quantized slot holds its scales), so the first n_slots of a page copy alone. */
    size_t most = c->k_slot_bytes > c->v_slot_bytes ? c->k_slot_bytes : c->v_slot_bytes;
    unsigned char *tmp = exl_malloc((size_t)n_slots * most);
    if (!tmp)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    exl_status st = EXL_OK;
    for (int32_t l = 0; l < c->n_layers && st == EXL_OK; l++) {
        void *kv[2] = {c->k[l], c->v[l]};
        size_t slot_bytes[2] = {c->k_slot_bytes, c->v_slot_bytes};
        for (int i = 0; i < 2 && st == EXL_OK && kv[i]; i++) {
            size_t page_bytes = (size_t)c->page_size * slot_bytes[i], bytes = (size_t)n_slots * slot_bytes[i];
            st = m->be->ops->download(m->be, tmp, (unsigned char *)kv[i] + (size_t)src * page_bytes, bytes);
            if (st == EXL_OK)
                st = m->be->ops->upload(m->be, (unsigned char *)kv[i] + (size_t)dst * page_bytes, tmp, bytes);
        }
    }
    exl_free(tmp);
    return st;
}
