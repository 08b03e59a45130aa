#!/usr/bin/env bash
# gpu_kv_cache.sh - on the GPU machine: the KV cache formats on a random 7B EXL2 4.0 bpw model (Llama-2-7B shape,
# written by make_random_quant): decode tok/s at context 2k, 8k, 16k and 32k and prefill with the fp16, Q8 and Q4
# caches (`exl bench`), and how many 4096-token sequences fit beside the weights on a 24 GB card with each
# (`exl serve` under EXL_CUDA_MEMORY_LIMIT=24GiB with its defaults, which must start). Results go to $OUT/kv.log,
# the table for bench/RESULTS.md's "KV cache" section to $OUT/kv_table.md.
# Preparing here (binaries and the llama2 tokenizer carried in .gpukv/):
#   cmake -S . -B build-gpu -DEXL_CUDA=ON -DEXL_CUDA_ARCHS=90
#   cmake --build build-gpu --target exl-cli make_random_quant exl_cuda
#   copy build-gpu/{exl,make_random_quant,libexl_cuda.so} and the non-libc libraries ldd lists into .gpukv/bin,
#   and ../shared/tokenizers/llama2-hf/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} into .gpukv/tok
# usage on the GPU machine: bench/gpu_kv_cache.sh   (OUT defaults to .gpukv/out)
set -uo pipefail
bin=${BIN:-.gpukv/bin}
out=${OUT:-.gpukv/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
m=/tmp/m7b-exl2-4.0
log=$out/kv.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
[ -f "$m/config.json" ] || "$bin/make_random_quant" -o "$m" --format exl2 --hidden 4096 --layers 32 --heads 32 \
    --kv-heads 32 --ffn 11008 --vocab 32000 --tokenizer-from .gpukv/tok >>"$log" 2>&1

table=$out/kv_table.md
{
    echo "| cache | decode t/s ctx 2k | 8k | 16k | 32k | prefill t/s (32k prompt) | 4k sequences in 24 GB |"
    echo "|---|---|---|---|---|---|---|"
} >"$table"
for bits in 16 8 4; do
    row="| $bits-bit"
    prefill=""
    for ctx in 2048 8192 16384 32768; do
        r=$(timeout 300 "$bin/exl" bench -m "$m" --device cuda -p $ctx -n 64 --cache-bits $bits 2>&1)
        echo "== bits $bits ctx $ctx" >>"$log"
        echo "$r" >>"$log"
        row+=" | $(sed -n 's/^decode: .*= \([0-9.]*\) tokens\/s.*/\1/p' <<<"$r")"
        prefill=$(sed -n 's/^prefill: .*= \([0-9.]*\) tokens\/s.*/\1/p' <<<"$r")
    done
    # the server's defaults on a 24 GB card: it must start; its cache tokens / 4096
    EXL_CUDA_MEMORY_LIMIT=24GiB timeout 120 "$bin/exl" serve -m "$m" --device cuda --port 0 --cache-bits $bits \
        >/dev/null 2>"$out/serve_$bits.log" &
    pid=$!
    for _ in $(seq 600); do
        grep -q "http://" "$out/serve_$bits.log" && break
        kill -0 $pid 2>/dev/null || break
        sleep 0.1
    done
    kill $pid 2>/dev/null
    wait $pid 2>/dev/null
    cat "$out/serve_$bits.log" >>"$log"
    tokens=$(sed -n 's/.*kv cache of \([0-9]*\) tokens.*/\1/p' "$out/serve_$bits.log")
    row+=" | $prefill | ${tokens:+$((tokens / 4096)) ($tokens tokens)}${tokens:-did not start} |"
    echo "$row" >>"$table"
done
cat "$table"
