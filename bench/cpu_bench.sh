#!/usr/bin/env bash
# cpu_bench.sh - CPU prefill/decode speed of tinystories-656k and a ~300 MB random fp16 model,
# each against the read bandwidth measured in the same run. Prints a Markdown table.
# usage: bench/cpu_bench.sh [BUILD_DIR]   (uses ../shared/models/tinystories-656k)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
shared=${EXL_SHARED:-$(cd .. && pwd)/shared}
mkdir -p bench/tmp
[ -d bench/tmp/small-f16 ] || "$build/make_random_model" -o bench/tmp/small-f16 --preset small >/dev/null 2>&1
echo "| model | weights read/token | prefill tok/s (128) | decode tok/s | read GB/s | decode bound tok/s | decode / bound |"
echo "|---|---|---|---|---|---|---|"
for m in "$shared/models/tinystories-656k" bench/tmp/small-f16; do
    out=$("$build/exl" bench -m "$m" -p 128 -n 64 --device cpu)
    name=$(basename "$m")
    mib=$(echo "$out" | sed -n 's/.*, \([0-9.]*\) MiB read per decoded token.*/\1/p')
    pre=$(echo "$out" | sed -n 's/^prefill:.*= \([0-9.]*\) tokens\/s/\1/p')
    dec=$(echo "$out" | sed -n 's/^decode:.*= \([0-9.]*\) tokens\/s.*/\1/p')
    bw=$(echo "$out" | sed -n 's/^memory: *\([0-9.]*\) GB\/s.*/\1/p')
    bound=$(echo "$out" | sed -n 's/^bound: *\([0-9.]*\) tokens\/s.*/\1/p')
    frac=$(echo "$out" | sed -n 's/.*reached \([0-9.]*%\).*/\1/p')
    echo "| $name | $mib MiB | $pre | $dec | $bw | $bound | $frac |"
done
