#!/usr/bin/env bash
# gpu_tp_prepare.sh - here, before bench/gpu_tp.sh runs on a machine with 2-4 GPUs: build the GPU programs and
# fill .gputp/ (git-ignored through /.gpu*/... add it to .git/info/exclude if not) with them and the core's shared
# libraries; the fixtures come from tests/gpu/prepare.sh (.gpu/). BUILD (default build-gpu) is the CUDA build dir.
#   bench/gpu_tp_prepare.sh && tests/gpu/prepare.sh
# then on the GPU machine: bench/gpu_tp.sh   (carry .gputp, .gpu/bin and .gpu/fixtures-*.tar.gz)
set -euo pipefail
build=${BUILD:-build-gpu}
cmake -S . -B "$build" -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >/dev/null
cmake --build "$build" -j"$(nproc)" --target exl-cli test_gpu make_random_quant exl_cuda exl >/dev/null
cc -O2 -Iinclude bench/generator_bench.c "$build/libexl.a" $(pkg-config --libs libcjson libpcre2-8 libutf8proc) \
    -lm -lpthread -ldl -o "$build/generator_bench"
rm -rf .gputp/bin && mkdir -p .gputp/bin
for f in exl test_gpu make_random_quant generator_bench libexl_cuda.so; do strip -o ".gputp/bin/$f" "$build/$f"; done
for lib in $(ldd "$build/exl" "$build/test_gpu" | awk '/=> \// {print $3}' | sort -u); do
    case $(basename "$lib") in
    libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libgcc_s.so* | libstdc++.so* | libcublas*) ;;
    *) cp -L "$lib" .gputp/bin/ ;;
    esac
done
# the models' tokenizer: Llama 2's (32000 tokens, as the shapes' vocabularies)
mkdir -p .gputp/tok
cp "${SHARED:-../shared}"/tokenizers/llama2-hf/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} .gputp/tok/
du -sh .gputp
