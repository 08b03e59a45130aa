/* kv_size.c - how large a KV cache may be: bytes per token, the tokens that fit in the device's memory (exl.h's
 * KV cache sizing), and the check that a cache of a given size fits at all. */
#include "model/model.h"

#include "base/error.h"

#include <unistd.h>

#define DEFAULT_MEMORY_FRACTION 0.9
#define GPU_MARGIN_BYTES ((int64_t)512 << 20) /* for buffers that grow after the cache is taken */
#define CPU_CACHE_MAX_BYTES ((int64_t)4 << 30)

static int64_t ram_bytes(void) {
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    return pages > 0 && page > 0 ? (int64_t)pages * page : 0;
}

exl_status exl_cache_token_bytes(const exl_model *m, int32_t k_bits, int32_t v_bits, int64_t *bytes) {
    *bytes = 0;
    if (!m)
        return exl_fail(EXL_ERR_ARG, "exl_cache_token_bytes: NULL model");
    exl_kv_format fmt;
    EXL_TRY(exl_kv_cache_format(m, k_bits, v_bits, &fmt));
    *bytes = exl_kv_cache_token_bytes(m, &fmt);
    return EXL_OK;
}

exl_status exl_cache_fit_tokens(exl_model *m, int32_t k_bits, int32_t v_bits, float fraction, int64_t *tokens) {
    *tokens = 0;
    int64_t per_token;
    EXL_TRY(exl_cache_token_bytes(m, k_bits, v_bits, &per_token));
    if (!(fraction >= 0.0f && fraction <= 1.0f))
        return exl_fail(EXL_ERR_ARG, "kv cache: the memory fraction must be in 0..1, not %g", (double)fraction);
    int64_t budget;
    if (m->be->ops->memory) {
        size_t free_b, total_b;
        EXL_TRY(m->be->ops->memory(m->be, &free_b, &total_b));
        double f = fraction > 0.0f ? fraction : DEFAULT_MEMORY_FRACTION;
        budget = (int64_t)(f * (double)total_b) - (int64_t)(total_b - free_b) - GPU_MARGIN_BYTES;
    } else {
        exl_model_desc d;
        exl_model_describe(m, &d);
        budget = (ram_bytes() - (int64_t)d.file_bytes) / 4;
        budget = budget < CPU_CACHE_MAX_BYTES ? budget : CPU_CACHE_MAX_BYTES;
    }
    *tokens = budget > 0 ? budget / per_token : 0;
    return EXL_OK;
}

exl_status exl_kv_cache_check_fits(const exl_model *m, int64_t bytes, int64_t tokens) {
    if (m->be->ops->memory) {
        size_t free_b, total_b;
        EXL_TRY(m->be->ops->memory(m->be, &free_b, &total_b));
        if (bytes > (int64_t)free_b)
            return exl_fail(EXL_ERR_NOMEM,
                            "a kv cache of %lld tokens needs %.1f MiB, more than the %.1f MiB free on "
                            "the GPU",
                            (long long)tokens, bytes / 1048576.0, free_b / 1048576.0);
        return EXL_OK;
    }
    int64_t ram = ram_bytes();
    if (ram > 0 && bytes > ram)
        return exl_fail(EXL_ERR_NOMEM, "a kv cache of %lld tokens needs %.1f MiB, more than the %.1f MiB of RAM",
                        (long long)tokens, bytes / 1048576.0, ram / 1048576.0);
    return EXL_OK;
}
