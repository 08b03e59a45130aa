/* rope.c - rotary embedding frequencies for every scaling type, as transformers defines them. */
#include "model/model.h"

#include <math.h>

static double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * log(scale) + 1.0; }

static double yarn_correction_dim(double rotations, int32_t dim, double base, double max_pos) {
    return (dim * log(max_pos / (rotations * 2 * M_PI))) / (2 * log(base));
}

void exl_rope_frequencies(const exl_hf_config *cfg, const exl_rope_config *r, int32_t dim, int32_t seq_len,
                          float *inv_freq, float *attn_factor) {
    int32_t half = dim / 2;
    double base = r->theta;
    *attn_factor = 1.0f;
    if (r->type == EXL_ROPE_DYNAMIC) {
        int32_t max_pos = r->original_max_pos ? r->original_max_pos : cfg->max_pos;
        if (seq_len > max_pos)
            base = base * pow(r->factor * seq_len / max_pos - (r->factor - 1), (double)dim / (dim - 2));
    }
    /* transformers computes base ** (arange(0, dim, 2) / dim) in float32 */
    for (int32_t i = 0; i < half; i++)
        inv_freq[i] = 1.0f / powf((float)base, (float)(2 * i) / (float)dim);

    switch (r->type) {
    case EXL_ROPE_DEFAULT:
    case EXL_ROPE_DYNAMIC: break;
    case EXL_ROPE_LINEAR:
        for (int32_t i = 0; i < half; i++)
            inv_freq[i] = inv_freq[i] / (float)r->factor;
        break;
    case EXL_ROPE_LLAMA3: {
        double old_ctx = r->original_max_pos;
        double low_wavelen = old_ctx / r->low_freq_factor, high_wavelen = old_ctx / r->high_freq_factor;
        for (int32_t i = 0; i < half; i++) {
            float f = inv_freq[i];
            float wavelen = 2.0f * (float)M_PI / f;
            if (wavelen > low_wavelen) {
                inv_freq[i] = f / (float)r->factor;
            } else if (wavelen >= high_wavelen) {
                float smooth = ((float)old_ctx / wavelen - (float)r->low_freq_factor) /
                               (float)(r->high_freq_factor - r->low_freq_factor);
                inv_freq[i] = (1.0f - smooth) * f / (float)r->factor + smooth * f;
            }
        }
        break;
    }
    case EXL_ROPE_LONGROPE: {
        /* the long factors past the original context, the short ones within it; the attention factor derives
         * from the ratio of the two lengths */
        const float *ext = seq_len > r->original_max_pos ? r->long_factor : r->short_factor;
        for (int32_t i = 0; i < half && i < r->n_factors; i++)
            inv_freq[i] = 1.0f / (ext[i] * powf((float)base, (float)(2 * i) / (float)dim));
        double af = r->attention_factor;
        if (af < 0)
            af = r->factor <= 1 ? 1.0 : sqrt(1 + log(r->factor) / log((double)r->original_max_pos));
        *attn_factor = (float)af;
        break;
    }
    case EXL_ROPE_YARN: {
        double factor = r->factor;
        double orig = r->original_max_pos ? r->original_max_pos : cfg->max_pos;
        if (r->original_max_pos) /* transformers: the ratio of the two lengths sets the scale */
            factor = (double)cfg->max_pos / r->original_max_pos;
        double af = r->attention_factor;
        if (af < 0) {
            if (r->mscale > 0 && r->mscale_all_dim > 0)
                af = yarn_mscale(factor, r->mscale) / yarn_mscale(factor, r->mscale_all_dim);
            else
                af = yarn_mscale(factor, 1.0);
        }
        *attn_factor = (float)af;
        double low = yarn_correction_dim(r->beta_fast, dim, base, orig);
        double high = yarn_correction_dim(r->beta_slow, dim, base, orig);
        if (r->truncate) {
            low = floor(low);
            high = ceil(high);
        }
        if (low < 0)
            low = 0;
        if (high > dim - 1)
            high = dim - 1;
        if (low == high)
            high += 0.001;
        for (int32_t i = 0; i < half; i++) {
            float pos_freq = powf((float)base, (float)(2 * i) / (float)dim);
            float extrap = 1.0f / pos_freq;
            float interp = 1.0f / ((float)factor * pos_freq);
            float ramp = ((float)i - (float)low) / (float)(high - low);
            ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
            float extrap_factor = 1.0f - ramp;
            inv_freq[i] = interp * (1.0f - extrap_factor) + extrap * extrap_factor;
        }
        break;
    }
    }
}
