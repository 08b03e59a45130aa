/* make_random_quant.c - write a random EXL2 or GPTQ Llama or Qwen3-MoE model directory of any shape.
 *
 * The quantized twin of make_random_model, for memory and speed work: every linear layer
 * gets random codes packed by format/ (EXL2: uniform groups of one width, the head at
 * --head-bits, a random row permutation; GPTQ: AutoGPTQ v1 layout with quantize_config.json),
 * with scales giving weights of std ~0.02; embeddings and norms are fp16. Tensors are
 * generated one layer at a time and written through the safetensors writer. With --experts, a
 * Qwen3-MoE model (q/k norms, an fp16 router, that many experts a layer): the experts' matrices
 * are generated once per shape and written for every expert (each its own copy in the file),
 * so that a model of Qwen3-30B-A3B's shape takes seconds to make. */
#include "base/half.h"
#include "format/quant.h"
#include "io/safetensors.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static uint32_t rnd(void) {
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return (uint32_t)((z ^ (z >> 31)) >> 16);
}

/* Everything written lives until the writer has written the file. */
static void **keep;
static size_t n_keep, cap_keep;

static void *alloc_kept(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p ||
        (n_keep == cap_keep && !(keep = realloc(keep, (cap_keep = cap_keep ? 2 * cap_keep : 256) * sizeof *keep)))) {
        fprintf(stderr, "make_random_quant: out of memory\n");
        exit(1);
    }
    return keep[n_keep++] = p;
}

/* The tensors of a linear as add_exl2 / add_gptq added them (name suffix after the prefix), while `recording` points
 * at a list; add_again adds them under another prefix, the same data. */
typedef struct recorded {
    char suffix[16];
    exl_dtype dt;
    int nd;
    int64_t d0, d1;
    const void *p;
} recorded;

typedef struct record_list {
    recorded t[8];
    int n;
} record_list;

static record_list *recording;

static void add(exl_st_writer *w, const char *name, exl_dtype dt, int nd, int64_t d0, int64_t d1, const void *p) {
    int64_t shape[2] = {d0, d1};
    if (exl_st_writer_add(w, name, dt, nd, shape, p) != EXL_OK) {
        fprintf(stderr, "make_random_quant: %s\n", exl_last_error());
        exit(1);
    }
    if (recording && recording->n < 8) {
        recorded *r = &recording->t[recording->n++];
        snprintf(r->suffix, sizeof r->suffix, "%s", strrchr(name, '.'));
        r->dt = dt, r->nd = nd, r->d0 = d0, r->d1 = d1, r->p = p;
    }
}

static void add_again(exl_st_writer *w, const char *prefix, const record_list *l) {
    for (int i = 0; i < l->n; i++) {
        char name[320];
        if (snprintf(name, sizeof name, "%s%s", prefix, l->t[i].suffix) >= (int)sizeof name) {
            fprintf(stderr, "make_random_quant: tensor name too long: %s\n", prefix);
            exit(1);
        }
        add(w, name, l->t[i].dt, l->t[i].nd, l->t[i].d0, l->t[i].d1, l->t[i].p);
    }
}

static uint16_t *random_f16(int64_t n, float mean, float spread) {
    uint16_t *v = alloc_kept((size_t)n * 2);
    for (int64_t i = 0; i < n; i++)
        v[i] = exl_f32_to_f16(mean + spread * ((float)(rnd() % 65536) / 32768.0f - 1.0f));
    return v;
}

/* Codes random in [0, 2^bits), their spread sd = 2^bits / sqrt(12); scale ~ 0.02 / sd. */
static float code_scale(int bits) { return 0.02f / ((float)(1 << bits) / 3.4641f); }

static void add_exl2(exl_st_writer *w, const char *prefix, int64_t K, int64_t N, int bits, int group) {
    int32_t G = (int32_t)((K + group - 1) / group), *b = alloc_kept((size_t)G * 4), *rows = alloc_kept((size_t)G * 4);
    for (int32_t g = 0; g < G; g++) {
        b[g] = bits;
        rows[g] = (int32_t)(K - (int64_t)g * group < group ? K - (int64_t)g * group : group);
    }
    int64_t Np = (N + 31) / 32 * 32;
    int32_t Q = exl_exl2_q_rows(b, rows, G);
    uint8_t *codes = malloc((size_t)(K * N)), *sc = malloc((size_t)G * N);
    int32_t *qw = alloc_kept((size_t)Q * Np * 4), *qs = alloc_kept((size_t)G * (Np / 8) * 4);
    int32_t *inv = alloc_kept((size_t)K * 4);
    int16_t *qg = alloc_kept((size_t)G * 4);
    uint16_t *smax = alloc_kept((size_t)G * 2);
    if (!codes || !sc) {
        fprintf(stderr, "make_random_quant: out of memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < K * N; i++)
        codes[i] = (uint8_t)(rnd() & ((1u << bits) - 1));
    for (int64_t i = 0; i < (int64_t)G * N; i++)
        sc[i] = (uint8_t)(11 + rnd() % 5); /* (c + 1)^2 / 256 in 0.56..1 */
    for (int32_t g = 0; g < G; g++)
        smax[g] = exl_f32_to_f16(code_scale(bits) * 1.3f);
    for (int64_t k = 0; k < K; k++)
        inv[k] = (int32_t)k;
    for (int64_t k = K - 1; k > 0; k--) {
        int64_t j = rnd() % (uint32_t)(k + 1);
        int32_t t = inv[k];
        inv[k] = inv[j];
        inv[j] = t;
    }
    exl_exl2_pack(K, N, G, b, rows, codes, sc, qw, qs, qg);
    free(codes);
    free(sc);
    char name[320];
    snprintf(name, sizeof name, "%s.q_weight", prefix);
    add(w, strdup(name), EXL_DTYPE_I32, 2, Q, Np, qw);
    snprintf(name, sizeof name, "%s.q_invperm", prefix);
    add(w, strdup(name), EXL_DTYPE_I32, 1, K, 0, inv);
    snprintf(name, sizeof name, "%s.q_scale", prefix);
    add(w, strdup(name), EXL_DTYPE_I32, 2, G, Np / 8, qs);
    snprintf(name, sizeof name, "%s.q_scale_max", prefix);
    add(w, strdup(name), EXL_DTYPE_F16, 1, G, 0, smax);
    snprintf(name, sizeof name, "%s.q_groups", prefix);
    add(w, strdup(name), EXL_DTYPE_I16, 1, 2 * G, 0, qg);
}

static void add_gptq(exl_st_writer *w, const char *prefix, int64_t K, int64_t N, int bits, int group) {
    int32_t G = (int32_t)((K + group - 1) / group);
    uint8_t *codes = malloc((size_t)(K * N)), *zeros = malloc((size_t)G * N);
    int32_t *qw = alloc_kept((size_t)(K * bits / 32) * N * 4), *qz = alloc_kept((size_t)G * (N * bits / 32) * 4);
    int32_t *g_idx = alloc_kept((size_t)K * 4);
    if (!codes || !zeros) {
        fprintf(stderr, "make_random_quant: out of memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < K * N; i++)
        codes[i] = (uint8_t)(rnd() & ((1u << bits) - 1));
    for (int64_t i = 0; i < (int64_t)G * N; i++)
        zeros[i] = (uint8_t)((1 << (bits - 1)) - 1 - (rnd() & 1)); /* v1: stored zero = zero - 1 */
    for (int64_t k = 0; k < K; k++)
        g_idx[k] = (int32_t)(k / group);
    exl_gptq_pack(bits, K, N, G, codes, zeros, qw, qz);
    free(codes);
    free(zeros);
    char name[320];
    snprintf(name, sizeof name, "%s.qweight", prefix);
    add(w, strdup(name), EXL_DTYPE_I32, 2, K * bits / 32, N, qw);
    snprintf(name, sizeof name, "%s.qzeros", prefix);
    add(w, strdup(name), EXL_DTYPE_I32, 2, G, N * bits / 32, qz);
    snprintf(name, sizeof name, "%s.scales", prefix);
    add(w, strdup(name), EXL_DTYPE_F16, 2, G, N, random_f16((int64_t)G * N, code_scale(bits), 0.1f * code_scale(bits)));
    snprintf(name, sizeof name, "%s.g_idx", prefix);
    add(w, strdup(name), EXL_DTYPE_I32, 1, K, 0, g_idx);
}

static void add_linear(exl_st_writer *w, const char *prefix, int64_t K, int64_t N, int exl2, int bits, int group) {
    if (exl2)
        add_exl2(w, prefix, K, N, bits, group);
    else
        add_gptq(w, prefix, K, N, bits, group);
}

/* the experts' gate/up and down matrices, made once; with --same-layers, layer 0's linears */
static record_list expert_mats[2], layer_mats[7];

static void usage(void) {
    printf(
        "usage: make_random_quant -o DIR --format exl2|gptq [--hidden H] [--layers L] [--heads N]\n"
        "         [--kv-heads K] [--head-dim D] [--ffn F] [--vocab V] [--bits B] [--group-size G]\n"
        "         [--head-bits B] [--experts E [--top-k K] [--expert-ffn F]] [--seed S] [--tokenizer-from DIR]\n"
        "         [--same-layers]\n\n"
        "Write a Llama model with random quantized linear layers (default 4 bits, groups of\n"
        "128; EXL2 head at 6 bits, GPTQ head fp16) and fp16 embeddings and norms. With --experts,\n"
        "a Qwen3-MoE model: E experts a layer of --expert-ffn (default --ffn), K a token (default 8),\n"
        "an fp16 router, q/k norms; every expert's matrices are one random matrix of each shape.\n"
        "Qwen3-30B-A3B: --hidden 2048 --layers 48 --heads 32 --kv-heads 4 --head-dim 128 --vocab 151936\n"
        "--experts 128 --top-k 8 --expert-ffn 768.\n"
        "--same-layers: every layer's linears are layer 0's (the same random data: a 70B shape in under a minute).\n");
}

int main(int argc, char **argv) {
    const char *out = NULL, *format = NULL, *tok_from = NULL;
    int hidden = 1024, layers = 8, heads = 16, kv_heads = 4, ffn = 2816, vocab = 32000;
    int bits = 4, group = 128, head_bits = 6, head_dim = 0, experts = 0, top_k = 8, expert_ffn = 0, same = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage();
            return 0;
        }
        if (!strcmp(a, "--same-layers")) {
            same = 1;
            continue;
        }
        if (!v) {
            fprintf(stderr, "make_random_quant: '%s' needs a value\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "-o"))
            out = v;
        else if (!strcmp(a, "--format"))
            format = v;
        else if (!strcmp(a, "--hidden"))
            hidden = atoi(v);
        else if (!strcmp(a, "--layers"))
            layers = atoi(v);
        else if (!strcmp(a, "--heads"))
            heads = atoi(v);
        else if (!strcmp(a, "--head-dim"))
            head_dim = atoi(v);
        else if (!strcmp(a, "--experts"))
            experts = atoi(v);
        else if (!strcmp(a, "--top-k"))
            top_k = atoi(v);
        else if (!strcmp(a, "--expert-ffn"))
            expert_ffn = atoi(v);
        else if (!strcmp(a, "--kv-heads"))
            kv_heads = atoi(v);
        else if (!strcmp(a, "--ffn"))
            ffn = atoi(v);
        else if (!strcmp(a, "--vocab"))
            vocab = atoi(v);
        else if (!strcmp(a, "--bits"))
            bits = atoi(v);
        else if (!strcmp(a, "--group-size"))
            group = atoi(v);
        else if (!strcmp(a, "--head-bits"))
            head_bits = atoi(v);
        else if (!strcmp(a, "--seed"))
            rng_state ^= strtoull(v, NULL, 10) * 0x2545f4914f6cdd1dull;
        else if (!strcmp(a, "--tokenizer-from"))
            tok_from = v;
        else {
            fprintf(stderr, "make_random_quant: unknown option '%s'\n", a);
            return 2;
        }
    }
    int exl2 = format && !strcmp(format, "exl2"), gptq = format && !strcmp(format, "gptq");
    if (!out || (!exl2 && !gptq) || hidden < 32 || hidden % 32 || layers < 1 || heads < 1 || kv_heads < 1 ||
        heads % kv_heads || (!head_dim && hidden % heads) || head_dim < 0 || head_dim % 2 ||
        (int64_t)heads * head_dim % 32 || ffn < 32 || ffn % 32 || vocab < 32 || group < 32 || group % 32 ||
        experts < 0 || (experts && (top_k < 1 || top_k > experts || expert_ffn < 0 || expert_ffn % 32)) ||
        (exl2 && bits != 2 && bits != 3 && bits != 4 && bits != 5 && bits != 6 && bits != 8) ||
        (gptq && bits != 2 && bits != 3 && bits != 4 && bits != 8)) {
        fprintf(stderr, "make_random_quant: need -o DIR, --format exl2|gptq and a valid shape (see --help)\n");
        return 2;
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "make_random_quant: cannot create %s: %s\n", out, strerror(errno));
        return 1;
    }
    head_dim = head_dim ? head_dim : hidden / heads;
    expert_ffn = expert_ffn ? expert_ffn : ffn;
    exl_st_writer *w;
    if (exl_st_writer_init(&w) != EXL_OK)
        return 1;
    add(w, "model.embed_tokens.weight", EXL_DTYPE_F16, 2, vocab, hidden,
        random_f16((int64_t)vocab * hidden, 0, 0.035f));
    add(w, "model.norm.weight", EXL_DTYPE_F16, 1, hidden, 0, random_f16(hidden, 1, 0.1f));
    for (int l = 0; l < layers; l++) {
        struct {
            const char *name;
            int64_t in, out;
        } lin[] = {{"self_attn.q_proj", hidden, (int64_t)heads * head_dim},
                   {"self_attn.k_proj", hidden, (int64_t)kv_heads * head_dim},
                   {"self_attn.v_proj", hidden, (int64_t)kv_heads * head_dim},
                   {"self_attn.o_proj", (int64_t)heads * head_dim, hidden},
                   {"mlp.gate_proj", hidden, ffn},
                   {"mlp.up_proj", hidden, ffn},
                   {"mlp.down_proj", ffn, hidden}};
        char name[256];
        for (int k = 0; k < (experts ? 4 : 7); k++) {
            snprintf(name, sizeof name, "model.layers.%d.%s", l, lin[k].name);
            if (same && l > 0) {
                add_again(w, name, &layer_mats[k]);
                continue;
            }
            recording = same ? &layer_mats[k] : NULL;
            add_linear(w, name, lin[k].in, lin[k].out, exl2, bits, group);
            recording = NULL;
        }
        if (experts) {
            snprintf(name, sizeof name, "model.layers.%d.self_attn.q_norm.weight", l);
            add(w, name, EXL_DTYPE_F16, 1, head_dim, 0, random_f16(head_dim, 1, 0.1f));
            snprintf(name, sizeof name, "model.layers.%d.self_attn.k_norm.weight", l);
            add(w, name, EXL_DTYPE_F16, 1, head_dim, 0, random_f16(head_dim, 1, 0.1f));
            snprintf(name, sizeof name, "model.layers.%d.mlp.gate.weight", l);
            add(w, name, EXL_DTYPE_F16, 2, experts, hidden, random_f16((int64_t)experts * hidden, 0, 0.035f));
            for (int e = 0; e < experts; e++)
                for (int k = 0; k < 3; k++) {
                    snprintf(name, sizeof name, "model.layers.%d.mlp.experts.%d.%s", l, e,
                             k == 0   ? "gate_proj"
                             : k == 1 ? "up_proj"
                                      : "down_proj");
                    record_list *once = &expert_mats[k == 2];
                    if (once->n) {
                        add_again(w, name, once);
                        continue;
                    }
                    recording = once;
                    add_linear(w, name, k == 2 ? expert_ffn : hidden, k == 2 ? hidden : expert_ffn, exl2, bits, group);
                    recording = NULL;
                }
        }
        snprintf(name, sizeof name, "model.layers.%d.input_layernorm.weight", l);
        add(w, strdup(name), EXL_DTYPE_F16, 1, hidden, 0, random_f16(hidden, 1, 0.1f));
        snprintf(name, sizeof name, "model.layers.%d.post_attention_layernorm.weight", l);
        add(w, strdup(name), EXL_DTYPE_F16, 1, hidden, 0, random_f16(hidden, 1, 0.1f));
    }
    if (exl2)
        add_exl2(w, "lm_head", hidden, vocab, head_bits, group);
    else
        add(w, "lm_head.weight", EXL_DTYPE_F16, 2, vocab, hidden, random_f16((int64_t)vocab * hidden, 0, 0.035f));
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", out, exl2 ? "output.safetensors" : "model.safetensors");
    if (exl_st_writer_write(w, path) != EXL_OK) {
        fprintf(stderr, "make_random_quant: %s\n", exl_last_error());
        return 1;
    }
    exl_st_writer_free(w);
    snprintf(path, sizeof path, "%s/config.json", out);
    FILE *f = fopen(path, "w");
    if (!f)
        return 1;
    fprintf(f,
            "{\n  \"architectures\": [\"%s\"],\n  \"model_type\": \"%s\",\n"
            "  \"hidden_size\": %d,\n  \"intermediate_size\": %d,\n  \"num_hidden_layers\": %d,\n"
            "  \"num_attention_heads\": %d,\n  \"num_key_value_heads\": %d,\n  \"head_dim\": %d,\n"
            "  \"vocab_size\": %d,\n  \"max_position_embeddings\": 8192,\n  \"rms_norm_eps\": %s,\n"
            "  \"rope_theta\": %s,\n  \"tie_word_embeddings\": false,\n  \"bos_token_id\": 1,\n"
            "  \"eos_token_id\": 2,\n  \"hidden_act\": \"silu\",\n  \"torch_dtype\": \"float16\",\n",
            experts ? "Qwen3MoeForCausalLM" : "LlamaForCausalLM", experts ? "qwen3_moe" : "llama", hidden, ffn, layers,
            heads, kv_heads, head_dim, vocab, experts ? "1e-06" : "1e-05", experts ? "1000000.0" : "10000.0");
    if (experts)
        fprintf(f,
                "  \"num_experts\": %d,\n  \"num_experts_per_tok\": %d,\n  \"moe_intermediate_size\": %d,\n"
                "  \"norm_topk_prob\": true,\n  \"decoder_sparse_step\": 1,\n  \"mlp_only_layers\": [],\n",
                experts, top_k, expert_ffn);
    if (exl2)
        fprintf(f, "  \"quantization_config\": {\"quant_method\": \"exl2\", \"bits\": %d, \"head_bits\": %d}\n}\n",
                bits, head_bits);
    else
        fprintf(f,
                "  \"quantization_config\": {\"quant_method\": \"gptq\", \"bits\": %d, \"group_size\": %d, "
                "\"desc_act\": false, \"sym\": false, \"checkpoint_format\": \"gptq\"}\n}\n",
                bits, group);
    fclose(f);
    if (tok_from) {
        const char *files[] = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"};
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            char src[4096], buf[8192];
            snprintf(src, sizeof src, "%s/%s", tok_from, files[i]);
            snprintf(path, sizeof path, "%s/%s", out, files[i]);
            FILE *in = fopen(src, "rb"), *o = in ? fopen(path, "wb") : NULL;
            size_t n;
            while (o && (n = fread(buf, 1, sizeof buf, in)) > 0)
                fwrite(buf, 1, n, o);
            if (in)
                fclose(in);
            if (o)
                fclose(o);
        }
    }
    for (size_t i = 0; i < n_keep; i++)
        free(keep[i]);
    free(keep);
    printf("%s: random %s model, %d bits, groups of %d\n", out, exl2 ? "EXL2" : "GPTQ", bits, group);
    return 0;
}
