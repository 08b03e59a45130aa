/* make_random_model.c - write a random-weight Hugging Face model directory of any shape.
 *
 * For speed work and tests where no real checkpoint of the shape can be had: a
 * config.json plus safetensors (sharded with an index above --shard-mb), tensors
 * generated and written one at a time so any size fits in little memory. */
#include "base/half.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

typedef struct {
    const char *name;
    int hidden, layers, heads, kv_heads, ffn, vocab, head_dim, tied;
} preset;

static const preset presets[] = {
    {"tiny", 256, 2, 4, 2, 768, 2048, 64, 0},
    {"small", 1024, 8, 16, 4, 2816, 32000, 64, 0},
    {"llama2-7b", 4096, 32, 32, 32, 11008, 32000, 128, 0},
    {"llama3-8b", 4096, 32, 32, 8, 14336, 128256, 128, 0},
    {"llama2-70b", 8192, 80, 64, 8, 28672, 32000, 128, 0},
};

typedef struct {
    char name[128];
    int64_t rows, cols; /* cols == 0: a vector of rows */
    float std, mean;
} tensor_spec;

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform with the given standard deviation (cheap; the shape of the law is irrelevant here). */
static float rng_uniform(float std) { return (float)(((rng_next() >> 11) * 0x1.0p-53) * 2 - 1) * std * 1.7320508f; }

static void usage(void) {
    printf("usage: make_random_model -o DIR [--preset NAME] [--hidden H] [--layers L] [--heads N]\n"
           "         [--kv-heads K] [--ffn F] [--vocab V] [--head-dim D] [--tied] [--dtype f16|bf16|f32]\n"
           "         [--seed S] [--shard-mb M] [--tokenizer-from DIR] [--std S]\n\n"
           "Write a Llama-architecture model with random weights (std 0.02 or --std, norms 1 +- 0.1).\n"
           "Presets:");
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
        printf(" %s", presets[i].name);
    printf("\n");
}

static int copy_file(const char *src, const char *dst) {
    FILE *in = fopen(src, "rb");
    if (!in)
        return -1;
    FILE *out = fopen(dst, "wb");
    if (!out) {
        fclose(in);
        return -1;
    }
    char buf[1 << 16];
    size_t n;
    int ok = 1;
    while ((n = fread(buf, 1, sizeof buf, in)) > 0)
        ok &= fwrite(buf, 1, n, out) == n;
    fclose(in);
    return (fclose(out) == 0 && ok) ? 0 : -1;
}

int main(int argc, char **argv) {
    preset p = presets[0];
    const char *out = NULL, *dtype = "f16", *tok_from = NULL;
    long shard_mb = 4096;
    int head_dim_given = 0;
    float std = 0.02f;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage();
            return 0;
        }
        if (!v) {
            fprintf(stderr, "make_random_model: '%s' needs a value or is unknown\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "-o"))
            out = v;
        else if (!strcmp(a, "--preset")) {
            size_t k = 0;
            for (; k < sizeof presets / sizeof presets[0]; k++)
                if (!strcmp(presets[k].name, v))
                    break;
            if (k == sizeof presets / sizeof presets[0]) {
                fprintf(stderr, "make_random_model: unknown preset '%s'\n", v);
                return 2;
            }
            p = presets[k];
        } else if (!strcmp(a, "--hidden"))
            p.hidden = atoi(v);
        else if (!strcmp(a, "--layers"))
            p.layers = atoi(v);
        else if (!strcmp(a, "--heads"))
            p.heads = atoi(v), p.head_dim = head_dim_given ? p.head_dim : 0;
        else if (!strcmp(a, "--kv-heads"))
            p.kv_heads = atoi(v);
        else if (!strcmp(a, "--ffn"))
            p.ffn = atoi(v);
        else if (!strcmp(a, "--vocab"))
            p.vocab = atoi(v);
        else if (!strcmp(a, "--head-dim")) {
            p.head_dim = atoi(v);
            head_dim_given = 1;
        } else if (!strcmp(a, "--tied")) {
            p.tied = 1;
            i--;
        } else if (!strcmp(a, "--dtype"))
            dtype = v;
        else if (!strcmp(a, "--seed"))
            rng_state ^= strtoull(v, NULL, 10) * 0x2545f4914f6cdd1dull;
        else if (!strcmp(a, "--shard-mb"))
            shard_mb = atol(v);
        else if (!strcmp(a, "--tokenizer-from"))
            tok_from = v;
        else if (!strcmp(a, "--std"))
            std = strtof(v, NULL);
        else {
            fprintf(stderr, "make_random_model: unknown option '%s'\n", a);
            return 2;
        }
    }
    if (!head_dim_given && !p.head_dim && p.heads > 0)
        p.head_dim = p.hidden / p.heads;
    int esz = !strcmp(dtype, "f32") ? 4 : 2;
    const char *st_dtype = !strcmp(dtype, "f32") ? "F32" : !strcmp(dtype, "bf16") ? "BF16" : "F16";
    if (!out || p.hidden < 1 || p.layers < 1 || p.heads < 1 || p.kv_heads < 1 || p.heads % p.kv_heads || p.ffn < 1 ||
        p.vocab < 1 || p.head_dim < 2 || shard_mb < 1 || !(std > 0) ||
        (strcmp(dtype, "f16") && strcmp(dtype, "bf16") && strcmp(dtype, "f32"))) {
        fprintf(stderr, "make_random_model: need -o DIR and a valid shape (see --help)\n");
        return 2;
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "make_random_model: cannot create %s: %s\n", out, strerror(errno));
        return 1;
    }

    /* ---- the tensor list */
    int n_specs = 3 + p.layers * 9;
    tensor_spec *specs = calloc((size_t)n_specs, sizeof *specs);
    int n = 0;
    int64_t q = (int64_t)p.heads * p.head_dim, kv = (int64_t)p.kv_heads * p.head_dim;
    specs[n++] = (tensor_spec){"model.embed_tokens.weight", p.vocab, p.hidden, std, 0};
    for (int l = 0; l < p.layers; l++) {
        struct {
            const char *suffix;
            int64_t r, c;
        } lin[] = {{"self_attn.q_proj.weight", q, p.hidden},  {"self_attn.k_proj.weight", kv, p.hidden},
                   {"self_attn.v_proj.weight", kv, p.hidden}, {"self_attn.o_proj.weight", p.hidden, q},
                   {"mlp.gate_proj.weight", p.ffn, p.hidden}, {"mlp.up_proj.weight", p.ffn, p.hidden},
                   {"mlp.down_proj.weight", p.hidden, p.ffn}};
        for (int k = 0; k < 7; k++) {
            tensor_spec *t = &specs[n++];
            snprintf(t->name, sizeof t->name, "model.layers.%d.%s", l, lin[k].suffix);
            t->rows = lin[k].r;
            t->cols = lin[k].c;
            t->std = std;
        }
        tensor_spec *t = &specs[n++];
        snprintf(t->name, sizeof t->name, "model.layers.%d.input_layernorm.weight", l);
        *t = (tensor_spec){"", p.hidden, 0, 0.1f, 1.0f};
        snprintf(t->name, sizeof t->name, "model.layers.%d.input_layernorm.weight", l);
        t = &specs[n++];
        *t = (tensor_spec){"", p.hidden, 0, 0.1f, 1.0f};
        snprintf(t->name, sizeof t->name, "model.layers.%d.post_attention_layernorm.weight", l);
    }
    specs[n++] = (tensor_spec){"model.norm.weight", p.hidden, 0, 0.1f, 1.0f};
    if (!p.tied)
        specs[n++] = (tensor_spec){"lm_head.weight", p.vocab, p.hidden, std, 0};

    /* ---- assign tensors to shards */
    int *shard_of = calloc((size_t)n, sizeof *shard_of);
    int n_shards = 1;
    uint64_t cur = 0, limit = (uint64_t)shard_mb << 20, total = 0;
    for (int i = 0; i < n; i++) {
        uint64_t bytes = (uint64_t)specs[i].rows * (specs[i].cols ? specs[i].cols : 1) * esz;
        if (cur && cur + bytes > limit) {
            n_shards++;
            cur = 0;
        }
        shard_of[i] = n_shards - 1;
        cur += bytes;
        total += bytes;
    }

    /* ---- config.json */
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", out);
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "make_random_model: cannot write %s\n", path);
        return 1;
    }
    fprintf(f,
            "{\n  \"architectures\": [\"LlamaForCausalLM\"],\n  \"model_type\": \"llama\",\n"
            "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"num_hidden_layers\": %d,\n"
            "  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n"
            "  \"vocab_size\": %d,\n  \"max_position_embeddings\": 8192,\n  \"rms_norm_eps\": 1e-05,\n"
            "  \"rope_theta\": 10000.0,\n  \"tie_word_embeddings\": %s,\n  \"bos_token_id\": 1,\n"
            "  \"eos_token_id\": 2,\n  \"hidden_act\": \"silu\",\n  \"torch_dtype\": \"%s\"\n}\n",
            p.hidden, p.ffn, p.layers, p.heads, p.kv_heads, p.head_dim, p.vocab, p.tied ? "true" : "false",
            !strcmp(dtype, "f32")    ? "float32"
            : !strcmp(dtype, "bf16") ? "bfloat16"
                                     : "float16");
    fclose(f);

    /* ---- shards */
    FILE *index = NULL;
    if (n_shards > 1) {
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
        index = fopen(path, "w");
        fprintf(index, "{\"metadata\": {\"total_size\": %llu}, \"weight_map\": {", (unsigned long long)total);
    }
    size_t buf_cap = 0;
    void *buf = NULL;
    int first_entry = 1;
    for (int s = 0; s < n_shards; s++) {
        char shard[128];
        if (n_shards > 1)
            snprintf(shard, sizeof shard, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        else
            snprintf(shard, sizeof shard, "model.safetensors");
        /* header */
        size_t hcap = 1 << 16, hlen = 0;
        char *hdr = malloc(hcap);
        hlen += (size_t)snprintf(hdr + hlen, hcap - hlen, "{");
        uint64_t off = 0;
        for (int i = 0; i < n; i++) {
            if (shard_of[i] != s)
                continue;
            uint64_t bytes = (uint64_t)specs[i].rows * (specs[i].cols ? specs[i].cols : 1) * esz;
            if (hcap - hlen < 512) {
                hcap *= 2;
                hdr = realloc(hdr, hcap);
            }
            if (specs[i].cols)
                hlen += (size_t)
                    snprintf(hdr + hlen, hcap - hlen,
                             "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld,%lld],\"data_offsets\":[%llu,%llu]}",
                             hlen > 1 ? "," : "", specs[i].name, st_dtype, (long long)specs[i].rows,
                             (long long)specs[i].cols, (unsigned long long)off, (unsigned long long)(off + bytes));
            else
                hlen += (size_t)snprintf(hdr + hlen, hcap - hlen,
                                         "%s\"%s\":{\"dtype\":\"%s\",\"shape\":[%lld],\"data_offsets\":[%llu,%llu]}",
                                         hlen > 1 ? "," : "", specs[i].name, st_dtype, (long long)specs[i].rows,
                                         (unsigned long long)off, (unsigned long long)(off + bytes));
            off += bytes;
            if (index) {
                fprintf(index, "%s\"%s\": \"%s\"", first_entry ? "" : ", ", specs[i].name, shard);
                first_entry = 0;
            }
        }
        hlen += (size_t)snprintf(hdr + hlen, hcap - hlen, "}");
        while (hlen % 8) {
            if (hlen + 1 >= hcap)
                hdr = realloc(hdr, hcap *= 2);
            hdr[hlen++] = ' ';
        }
        snprintf(path, sizeof path, "%s/%s", out, shard);
        f = fopen(path, "wb");
        if (!f) {
            fprintf(stderr, "make_random_model: cannot write %s\n", path);
            return 1;
        }
        uint8_t len8[8];
        for (int b = 0; b < 8; b++)
            len8[b] = (uint8_t)((uint64_t)hlen >> (8 * b));
        int ok = fwrite(len8, 1, 8, f) == 8 && fwrite(hdr, 1, hlen, f) == hlen;
        free(hdr);
        for (int i = 0; ok && i < n; i++) {
            if (shard_of[i] != s)
                continue;
            int64_t cols = specs[i].cols ? specs[i].cols : 1;
            size_t row_bytes = (size_t)cols * esz;
            if (row_bytes > buf_cap)
                buf = realloc(buf, buf_cap = row_bytes);
            for (int64_t r = 0; ok && r < specs[i].rows; r++) {
                for (int64_t c = 0; c < cols; c++) {
                    float v = specs[i].mean + rng_uniform(specs[i].std);
                    if (esz == 4)
                        ((float *)buf)[c] = v;
                    else if (!strcmp(dtype, "bf16"))
                        ((uint16_t *)buf)[c] = exl_f32_to_bf16(v);
                    else
                        ((uint16_t *)buf)[c] = exl_f32_to_f16(v);
                }
                ok = fwrite(buf, 1, row_bytes, f) == row_bytes;
            }
        }
        if (fclose(f) != 0 || !ok) {
            fprintf(stderr, "make_random_model: write failed for %s\n", path);
            return 1;
        }
        fprintf(stderr, "\rmake_random_model: wrote shard %d/%d", s + 1, n_shards);
    }
    fprintf(stderr, "\n");
    if (index) {
        fprintf(index, "}}\n");
        fclose(index);
    }
    if (tok_from) {
        const char *files[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                               "generation_config.json"};
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            char src[4096];
            snprintf(src, sizeof src, "%s/%s", tok_from, files[i]);
            snprintf(path, sizeof path, "%s/%s", out, files[i]);
            copy_file(src, path); /* optional files: absent ones are skipped */
        }
    }
    printf("%s: %.1f MiB of %s weights in %d file(s)\n", out, total / 1048576.0, st_dtype, n_shards);
    free(buf);
    free(specs);
    free(shard_of);
    return 0;
}
