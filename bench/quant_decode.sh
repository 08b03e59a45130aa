#!/usr/bin/env bash
# quant_decode.sh - CPU decode speed and peak memory of one model shape as fp16, EXL2 4.0 bpw
# (uniform 4-bit groups of 128, 6-bit head) and GPTQ 4-bit (groups of 128, fp16 head), all
# with random weights: `exl bench` gives tokens/s and the bound weights-bytes-per-token /
# measured read bandwidth; `/usr/bin/time -v exl logits` (64 tokens) gives the peak RSS.
# Prints the rows of the "## Quantized CPU decode" table of bench/RESULTS.md.
# usage: bench/quant_decode.sh [WORK_DIR] [RUNS]   (default /tmp/exl-quant-bench, 3 runs: best kept)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-/tmp/exl-quant-bench}
runs=${2:-3}
build=$root/build-bench
shape="--hidden 2048 --layers 16 --heads 16 --kv-heads 4 --ffn 5632 --vocab 32000"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target exl-cli make_random_model make_random_quant -j"$(nproc)" >/dev/null
mkdir -p "$work"
[ -f "$work/fp16/config.json" ] || "$build/make_random_model" -o "$work/fp16" $shape --dtype f16 >/dev/null
[ -f "$work/exl2/config.json" ] || "$build/make_random_quant" -o "$work/exl2" --format exl2 $shape >/dev/null
[ -f "$work/gptq/config.json" ] || "$build/make_random_quant" -o "$work/gptq" --format gptq $shape >/dev/null
ids=$(seq 0 63 | awk '{printf "%s%d", (NR > 1 ? "," : ""), ($1 * 37) % 32000}')

echo "| model | file MiB | read/token MiB | decode tok/s (best of $runs) | bandwidth GB/s | bound tok/s | % of bound | peak RSS MiB |"
echo "|---|---|---|---|---|---|---|---|"
for m in fp16 exl2 gptq; do
  best=""
  for _ in $(seq "$runs"); do
    out=$("$build/exl" bench -m "$work/$m" -p 16 -n 32 --device cpu)
    tps=$(sed -n 's/^decode: .* = \([0-9.]*\) tokens\/s.*/\1/p' <<<"$out")
    if [ -z "$best" ] || awk "BEGIN{exit !($tps > $best)}"; then best=$tps; bestout=$out; fi
  done
  file=$(sed -n 's/.*, \([0-9.]*\) MiB of weights.*/\1/p' <<<"$bestout")
  per=$(sed -n 's/.*weights, \([0-9.]*\) MiB read per.*/\1/p' <<<"$bestout")
  bw=$(sed -n 's/^memory: *\([0-9.]*\) GB\/s.*/\1/p' <<<"$bestout")
  bound=$(sed -n 's/^bound: *\([0-9.]*\) tokens.*/\1/p' <<<"$bestout")
  rss=$(/usr/bin/time -v "$build/exl" logits -m "$work/$m" --ids "$ids" -o "$work/logits.safetensors" --device cpu 2>&1 |
        sed -n 's/.*Maximum resident set size (kbytes): //p')
  pct=$(awk "BEGIN{printf \"%.0f\", 100 * $best / $bound}")
  echo "| $m | $file | $per | $best | $bw | $bound | $pct | $(awk "BEGIN{printf \"%.0f\", $rss / 1024}") |"
done
