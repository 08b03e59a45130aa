#!/usr/bin/env bash
# gpu_speculative.sh - speculative decoding on the GPU: a random 7B EXL2 4.0 bpw target (Llama-2-7B shape) and a small
# random draft of the same vocabulary (hidden 1024, 4 layers, 4.0 bpw), both written by make_random_quant, measured by
# bench/spec_bench.c in one process (the target loaded twice, once as its own draft): one greedy job of 256 tokens,
# decode tok/s against plain decoding, for the model drafting for itself at K = 1..8 (acceptance 1.0 with a draft as
# dear as the model), the random draft forced to agree at alpha = 0.5 .. 1.0 (the test-only hook
# EXL_SPEC_TEST_ORACLE / EXL_SPEC_TEST_ALPHA, src/generator/draft_oracle.c, replaces its proposals by plain
# decoding's tokens with probability alpha) at K = 2, 4, 8 and adaptive, and n-gram drafting on a prompt that asks to
# repeat a passage. Every row says whether its tokens are plain decoding's. The table goes to $OUT/spec_table.md (for
# bench/RESULTS.md), the rest to $OUT/spec.log. First, gpu_bench's cost of one sequence's verification step of K + 1
# rows against a one-row step (ctx 128 and 2048) and of decode steps of n sequences, the same 7B shape built in memory
# (`gpu_bench exl2 --kernels-only`; its whole output to $OUT/gpu_bench.log; VERIFY_BENCH=0 skips it): both in one
# call of under 10 minutes, spec_bench getting what is left of 580 s.
#
# Preparing here (a CUDA build; binaries, libraries and the llama2 tokenizer go to .gpuspec/, git-ignored):
#   bench/gpu_speculative.sh --prepare
# On the GPU machine (carry .gpuspec): bench/gpu_speculative.sh
set -uo pipefail
if [ "${1:-}" = --prepare ]; then
    set -e
    cmake -S . -B build-gpu -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >/dev/null
    cmake --build build-gpu -j"$(nproc)" --target exl make_random_quant exl_cuda gpu_bench >/dev/null
    cc -O2 -std=c11 -Iinclude bench/spec_bench.c build-gpu/libexl.a \
        $(pkg-config --libs libcjson libpcre2-8 libutf8proc) -lm -lpthread -ldl -o build-gpu/spec_bench
    rm -rf .gpuspec && mkdir -p .gpuspec/bin .gpuspec/tok
    for f in spec_bench make_random_quant gpu_bench libexl_cuda.so; do strip -o ".gpuspec/bin/$f" "build-gpu/$f"; done
    for lib in $(ldd build-gpu/spec_bench build-gpu/make_random_quant build-gpu/gpu_bench |
        awk '/=> \// {print $3}' | sort -u); do
        case $(basename "$lib") in
        libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libgcc_s.so* | libstdc++.so* | libcublas*) ;;
        *) cp -L "$lib" .gpuspec/bin/ ;;
        esac
    done
    cp ../shared/tokenizers/llama2-hf/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} .gpuspec/tok/
    du -sh .gpuspec
    exit 0
fi
bin=${BIN:-.gpuspec/bin}
out=${OUT:-.gpuspec/out}
mkdir -p "$out"
export LD_LIBRARY_PATH=$PWD/$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
m=/tmp/m7b-exl2-4.0
d=/tmp/draft-exl2-4.0
log=$out/spec.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
if [ "${VERIFY_BENCH:-1}" != 0 ]; then
    timeout 200 "$bin/gpu_bench" exl2 --kernels-only >"$out/gpu_bench.log" 2>&1
    grep -E "decode steps of n sequences|verification steps of one sequence" "$out/gpu_bench.log"
fi
[ -f "$m/config.json" ] || "$bin/make_random_quant" -o "$m" --format exl2 --hidden 4096 --layers 32 --heads 32 \
    --kv-heads 32 --ffn 11008 --vocab 32000 --tokenizer-from .gpuspec/tok >>"$log" 2>&1
[ -f "$d/config.json" ] || "$bin/make_random_quant" -o "$d" --format exl2 --hidden 1024 --layers 4 --heads 16 \
    --kv-heads 16 --ffn 2816 --vocab 32000 --seed 7 --tokenizer-from .gpuspec/tok >>"$log" 2>&1
timeout $((580 - SECONDS)) "$bin/spec_bench" "$m" "$d" 256 cuda 2>>"$log" | tee "$out/spec_table.md"
