#!/usr/bin/env bash
# gpu_generator_bench.sh - on the GPU machine: write a random 7B EXL2 model and run
# bench/generator_bench.c on it with the CUDA backend. Binaries and the llama2 tokenizer are
# prepared here into .gpugen/ (bin/: generator_bench, make_random_quant, libexl_cuda.so and the
# core's shared libraries; tok/: tokenizer files) and carried; results go to $OUT/gen.log.
# Preparing here:
#   cmake -S . -B build-gpu -DEXL_CUDA=ON -DEXL_CUDA_ARCHS=90 && cmake --build build-gpu --target exl make_random_quant exl_cuda
#   cc -O2 -Iinclude bench/generator_bench.c build-gpu/libexl.a $(pkg-config --libs libcjson libpcre2-8 libutf8proc) \
#      -lm -lpthread -ldl -o build-gpu/generator_bench
#   copy generator_bench, make_random_quant, libexl_cuda.so and the non-libc libraries ldd lists into .gpugen/bin,
#   and ../shared/tokenizers/llama2-hf/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} into .gpugen/tok
set -x
export LD_LIBRARY_PATH=$PWD/.gpugen/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
M=/tmp/m7b
time .gpugen/bin/make_random_quant -o $M --format exl2 --hidden 4096 --layers 32 --heads 32 --kv-heads 32 --ffn 11008 --vocab 32000 --tokenizer-from .gpugen/tok
ls -la $M
EXL_BENCH_DEVICE=cuda timeout 400 .gpugen/bin/generator_bench $M 32 64 1 1 4 16 64 2>&1 | tee $OUT/gen.log
