#!/usr/bin/env bash
# gpu_constrained.sh - on the GPU machine: what constrained decoding costs on CUDA (issue 34's "Cost"): batch-1
# decode and 32 concurrent jobs, free against three constraints (bench/constrained_bench.c), on a random-weight
# Llama-3-8B-shaped EXL2 4.0 bpw model (vocabulary 128256 with the Llama 3 tokenizer; make_random_quant).
# Preparing here (binaries and the tokenizer carried in .gpucon/):
#   cmake -S . -B build-gpu -DEXL_CUDA=ON -DEXL_CUDA_ARCHS=90
#   cmake --build build-gpu --target exl make_random_quant exl_cuda
#   cc -O2 -Iinclude bench/constrained_bench.c build-gpu/libexl.a $(pkg-config --libs libcjson libpcre2-8
#      libutf8proc) -lm -lpthread -ldl -o .gpucon/bin/constrained_bench
#   copy build-gpu/{make_random_quant,libexl_cuda.so} and the non-libc libraries ldd lists into .gpucon/bin, and
#   ../shared/tokenizers/llama3/* into .gpucon/tok
# usage on the GPU machine: bench/gpu_constrained.sh   (OUT defaults to .gpucon/out); prints two tables
set -uo pipefail
bin=${BIN:-.gpucon/bin}
out=${OUT:-.gpucon/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
m=/tmp/m7b-l3-exl2-4.0
log=$out/constrained.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
[ -f "$m/config.json" ] || "$bin/make_random_quant" -o "$m" --format exl2 --hidden 4096 --layers 32 --heads 32 \
    --kv-heads 8 --ffn 14336 --vocab 128256 --tokenizer-from .gpucon/tok >>"$log" 2>&1
echo "### batch 1 (128 tokens x 4 seeds, best of 3 rounds)"
EXL_BENCH_DEVICE=cuda "$bin/constrained_bench" "$m" 128 4 3 1 2>>"$log"
echo "### 32 concurrent jobs (128 tokens x 32 seeds, best of 3 rounds)"
EXL_BENCH_DEVICE=cuda "$bin/constrained_bench" "$m" 128 32 3 32 2>>"$log"
