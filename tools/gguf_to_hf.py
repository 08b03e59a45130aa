#!/usr/bin/env python3
"""gguf_to_hf.py - a llama-architecture GGUF file to a Hugging Face model directory in fp32.

    python3 tools/gguf_to_hf.py FILE.gguf OUT_DIR

Writes model.safetensors (every tensor dequantized to fp32, under the Hugging Face names; q_proj and k_proj
un-permuted back from the rotary layout llama.cpp's converter stores them in), config.json (LlamaForCausalLM, from
the file's llama.* keys; tied embeddings when the file has no output.weight), generation_config.json,
tokenizer.json (the gpt2-style byte-level BPE of tokenizer.ggml.*: vocabulary, merges, control tokens as added
special tokens, the pre-tokenizer its tokenizer.ggml.pre names) and tokenizer_config.json (with the chat template).

Needs the `gguf` package (it reads the file and dequantizes) and numpy; no PyTorch.
"""
import json
import os
import struct
import sys

import numpy as np
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

# Pre-tokenizers of the tokenizer.ggml.pre values this converter knows (Hugging Face's tokenizer.json form).
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
PRE_TOKENIZERS = {
    "smollm": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, BYTE_LEVEL]},
    "gpt-2": BYTE_LEVEL,
    "default": BYTE_LEVEL,
}
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    t = f.types[0]
    if t == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    if t == GGUFValueType.ARRAY:
        if f.types[1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    return f.parts[f.data[0]].tolist()[0]


def hf_name(gguf_name):
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return "model.layers.%s.%s.%s" % (parts[1], LAYER_NAMES[parts[2]], parts[3])
    raise SystemExit("gguf_to_hf: tensor %s has no Hugging Face name here (only llama models)" % gguf_name)


def unpermute(w, n_head):
    """Undo llama.cpp's rotary permutation of q_proj / k_proj rows ([out, in], heads of interleaved halves)."""
    out = w.shape[0]
    return w.reshape(n_head, out // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_safetensors(path, tensors):
    header, offset = {}, 0
    for name, t in tensors:
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, t in tensors:
            f.write(np.ascontiguousarray(t, dtype="<f4").tobytes())


def tokenizer_json(reader):
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise SystemExit("gguf_to_hf: tokenizer.ggml.model %r: only gpt2 (byte-level BPE) is converted" % model)
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = field(reader, "tokenizer.ggml.merges", [])
    pre = field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise SystemExit("gguf_to_hf: tokenizer.ggml.pre %r is not one this converter knows" % pre)
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": types[i] == TOKEN_TYPE_CONTROL}
        for i, tok in enumerate(tokens) if types[i] in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)},
                  "merges": [m.split(" ", 1) for m in merges]},
    }


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    reader = GGUFReader(sys.argv[1])
    out_dir = sys.argv[2]
    arch = field(reader, "general.architecture")
    if arch != "llama":
        raise SystemExit("gguf_to_hf: general.architecture %r: only llama is converted" % arch)
    n_head = field(reader, "llama.attention.head_count")
    n_kv = field(reader, "llama.attention.head_count_kv", n_head)
    hidden = field(reader, "llama.embedding_length")
    tokens = field(reader, "tokenizer.ggml.tokens")
    tensors, names = [], set()
    for t in reader.tensors:
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape.tolist())])
        name = hf_name(t.name)
        if t.name.endswith("attn_q.weight"):
            w = unpermute(w, n_head)
        elif t.name.endswith("attn_k.weight"):
            w = unpermute(w, n_kv)
        tensors.append((name, w))
        names.add(name)
    os.makedirs(out_dir, exist_ok=True)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    bos = field(reader, "tokenizer.ggml.bos_token_id")
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    pad = field(reader, "tokenizer.ggml.padding_token_id")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": field(reader, "llama.feed_forward_length"),
        "num_hidden_layers": field(reader, "llama.block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": field(reader, "llama.rope.dimension_count", hidden // n_head),
        "max_position_embeddings": field(reader, "llama.context_length"),
        "rms_norm_eps": field(reader, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": field(reader, "llama.rope.freq_base", 10000.0),
        "vocab_size": field(reader, "llama.vocab_size", len(tokens)),
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in names,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "torch_dtype": "float32",
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}, f, indent=2)
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        json.dump(tokenizer_json(reader), f, ensure_ascii=False)
    tok_config = {
        "add_bos_token": bool(field(reader, "tokenizer.ggml.add_bos_token", False)),
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "pad_token": tokens[pad] if pad is not None else None,
        "unk_token": tokens[field(reader, "tokenizer.ggml.unknown_token_id", 0)],
        "model_max_length": config["max_position_embeddings"],
        "tokenizer_class": "GPT2Tokenizer",
        "clean_up_tokenization_spaces": False,
    }
    template = field(reader, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tok_config, f, indent=2, ensure_ascii=False)
    print("gguf_to_hf: %d tensors (fp32) and the configs in %s" % (len(tensors), out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
