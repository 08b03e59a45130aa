#!/usr/bin/env bash
# tokenizer_speed.sh - single-threaded tokenizer throughput of exl vs Hugging Face
# `tokenizers` (pip install tokenizers) on wikitext-2 test (1.3 MB), for the llama3 and
# llama2 tokenizers; writes the "## Tokenizer speed" section of bench/RESULTS.md.
# usage: bench/tokenizer_speed.sh [SHARED_DIR]   (default ../shared)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shared=$(cd "${1:-$root/../shared}" && pwd)
text=$shared/data/wikitext2_test.txt
build=$root/build-bench
runs=5

cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target exl -j"$(nproc)" >/dev/null
cc -O2 -I"$root/include" "$root/bench/tokenizer_speed.c" "$build/libexl.a" \
  $(pkg-config --libs libcjson libpcre2-8 libutf8proc) -lm -lpthread -ldl -o "$build/tokenizer_speed"

hf_speed() { # model dir -> MB/s of tokenizers' encode, one thread, best of $runs
  RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false python3 - "$1/tokenizer.json" "$text" "$runs" <<'PY'
import sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
text = open(sys.argv[2], encoding="utf-8").read()
nbytes = len(text.encode("utf-8"))
best = min((lambda t0: (tok.encode(text, add_special_tokens=False), time.perf_counter() - t0)[1])(time.perf_counter())
           for _ in range(int(sys.argv[3])))
print(f"{nbytes / best / 1e6:.2f}")
PY
}

rows=""
for name in llama3 llama2-hf; do
  dir=$shared/tokenizers/$name
  line=$("$build/tokenizer_speed" "$dir" "$text" "$runs")
  echo "$line"
  exl=$(sed -E 's/.* = ([0-9.]+) MB\/s.*/\1/' <<<"$line")
  hf=$(hf_speed "$dir")
  echo "tokenizers $name: $hf MB/s"
  ratio=$(python3 -c "print(f'{$exl / $hf:.1f}')")
  rows+="| $name | $exl | $hf | ${ratio}x |"$'\n'
done

hfver=$(python3 -c "import tokenizers; print(tokenizers.__version__)")
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
section="## Tokenizer speed

Encode of \`data/wikitext2_test.txt\` (1.3 MB) in one call, one thread, best of $runs runs, MB/s
(higher is better). exl: \`bench/tokenizer_speed.c\`; Hugging Face \`tokenizers\` $hfver:
\`Tokenizer.from_file(...).encode(text, add_special_tokens=False)\` with RAYON_NUM_THREADS=1.

| tokenizer | exl MB/s | tokenizers MB/s | exl / tokenizers |
|---|---|---|---|
${rows}
Command: \`bench/tokenizer_speed.sh\`. Machine: $cpu ($(nproc) cores). Date: $(date -u +%Y-%m-%d).
"

results=$root/bench/RESULTS.md
[ -f "$results" ] || printf '# Benchmark results\n' >"$results"
SECTION="$section" python3 - "$results" <<'PY'
import os, re, sys
path = sys.argv[1]
doc = open(path, encoding="utf-8").read()
sec = os.environ["SECTION"].rstrip("\n") + "\n"
pat = re.compile(r"^## Tokenizer speed\n.*?(?=^## |\Z)", re.S | re.M)
doc = pat.sub(lambda m: sec + "\n", doc, count=1) if pat.search(doc) else doc.rstrip("\n") + "\n\n" + sec
open(path, "w", encoding="utf-8").write(doc)
PY
echo "wrote the Tokenizer speed section of $results"
