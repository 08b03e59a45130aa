#!/usr/bin/env bash
# generator_bench.sh - aggregate CPU throughput of the generator with 1, 4, 16 and 64
# concurrent jobs (32-token random prompts, 64 sampled tokens each) on tinystories-656k
# and a 64 MB random fp16 Llama (hidden 512, 8 layers, written by tools/make_random_model);
# writes the "## Generator (CPU)" section of bench/RESULTS.md.
# usage: bench/generator_bench.sh [SHARED_DIR]   (default ../shared)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shared=$(cd "${1:-$root/../shared}" && pwd)
build=$root/build-genbench
prompt=32
new=64
levels="1 4 16 64"

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target exl make_random_model -j"$(nproc)" >/dev/null
cc -O2 -I"$root/include" "$root/bench/generator_bench.c" "$build/libexl.a" \
  $(pkg-config --libs libcjson libpcre2-8 libutf8proc) -lm -lpthread -ldl -o "$build/generator_bench"
rand=$root/bench/tmp/rand-512x8
[ -f "$rand/model.safetensors" ] || "$build/make_random_model" -o "$rand" --hidden 512 --layers 8 --heads 8 \
  --kv-heads 4 --ffn 2048 --vocab 2048 --tokenizer-from "$shared/models/tinystories-656k" >/dev/null

tables=""
for m in "$shared/models/tinystories-656k" "$rand"; do
  echo "$(basename "$m")"
  repeats=3
  [ "$m" = "$rand" ] && repeats=2
  table=$("$build/generator_bench" "$m" "$prompt" "$new" "$repeats" $levels)
  echo "$table"
  tables+="### $(basename "$m")"$'\n\n'"$table"$'\n\n'
done

cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
load=$(cut -d' ' -f1-3 /proc/loadavg)
section="## Generator (CPU)

N jobs with distinct random ${prompt}-token prompts submitted at once, each generating $new tokens
(temperature 0.8, top-k 40, top-p 0.95, eos ignored), run to the end by one thread stepping the
generator (page size 256, token budget 256 per step, all CPU threads in the matmuls). \"generated tok/s\"
is the aggregate over all jobs, prefill included in the time; \"computed tok/s\" counts prompt tokens too.
Fastest of 3 runs (tinystories) or 2 runs (rand-512x8) per row.
rand-512x8: hidden 512, 8 layers, 8 heads / 4 KV heads, ffn 2048, vocab 2048, fp16 (64 MB).

${tables}Command: \`bench/generator_bench.sh\`. Machine: $cpu ($(nproc) cores, shared with other jobs:
load average $load at the end). Date: $(date -u +%Y-%m-%d).
"

results=$root/bench/RESULTS.md
[ -f "$results" ] || printf '# Benchmark results\n' >"$results"
SECTION="$section" python3 - "$results" <<'PY'
import os, re, sys
path = sys.argv[1]
doc = open(path, encoding="utf-8").read()
sec = os.environ["SECTION"].rstrip("\n") + "\n"
pat = re.compile(r"^## Generator \(CPU\)\n.*?(?=^## |\Z)", re.S | re.M)
doc = pat.sub(lambda m: sec + "\n", doc, count=1) if pat.search(doc) else doc.rstrip("\n") + "\n\n" + sec
open(path, "w", encoding="utf-8").write(doc)
PY
echo "wrote the Generator (CPU) section of $results"
