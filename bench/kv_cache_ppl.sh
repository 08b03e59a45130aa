#!/usr/bin/env bash
# kv_cache_ppl.sh - what each KV cache format costs, on the CPU: `exl perplexity` of tinystories-656k (head_dim 16)
# on the TinyStories validation text with windows of 256 fed in pieces of 32 (--chunk), against the one-pass value;
# then tools/kv_cache_kl (perplexity, KL against the 16-bit cache's distributions, top-1 agreement) on it and on a
# random-weight Llama of head_dim 128 (tools/make_random_model, std 0.06). Prints the tables of bench/RESULTS.md's
# "KV cache" section.
# usage: bench/kv_cache_ppl.sh [SHARED_DIR]   (default ../shared)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shared=$(cd "${1:-$root/../shared}" && pwd)
build=$root/build
cmake -S "$root" -B "$build" -DEXL_CUDA=OFF >/dev/null
cmake --build "$build" --target exl-cli kv_cache_kl make_random_model -j"$(nproc)" >/dev/null
ts=$shared/models/tinystories-656k
text=$shared/data/tinystories_val.txt
formats="16 8 6 4 8,4 4,8"

ppl() { "$build/exl" perplexity -m "$ts" -f "$text" --device cpu --ctx 256 --stride 256 --max-windows 16 "$@" \
    2>/dev/null | sed -n 's/^perplexity: //p'; }
one=$(ppl --chunk 256)
echo "| --cache-bits | perplexity (--chunk 32) | vs one pass |"
echo "|---|---|---|"
echo "| one pass (--chunk 256) | $one | |"
for f in $formats; do
    p=$(ppl --chunk 32 --cache-bits "$f")
    echo "| $f | $p | $(awk -v a="$p" -v b="$one" 'BEGIN { printf "%+.3f%%", 100 * (a / b - 1) }') |"
done
echo
hd128=$root/bench/tmp/rand-hd128
mkdir -p "$root/bench/tmp"
[ -f "$hd128/model.safetensors" ] || "$build/make_random_model" -o "$hd128" --hidden 512 --layers 4 --heads 4 \
    --kv-heads 2 --head-dim 128 --ffn 1536 --vocab 2048 --std 0.06 --tokenizer-from "$ts" >/dev/null
for m in "$ts" "$hd128"; do
    "$build/kv_cache_kl" -m "$m" -f "$text" --ctx 256 --windows 16 --chunk 32 ${formats#16 }
    echo
done
