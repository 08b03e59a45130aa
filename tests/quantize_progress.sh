#!/usr/bin/env bash
# quantize_progress.sh EXL_BINARY SHARED_DIR - CTest entry: `exl quantize` with stderr not a terminal prints a line
# per finished layer (accuracy, bits, seconds) and a final summary; a run killed (SIGKILL) after its first layer
# resumes when the command is given again and writes the same bytes as an uninterrupted run (GPTQ 4-bit g32 of
# rand-gemma3, 4 layers, 16 rows x 128 tokens).
set -euo pipefail
exl=$1
shared=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
args=(-i "$shared/models/rand-gemma3" --format gptq --group-size 32 --rows 16 --length 128 --threads 2
      --calibration "$shared/data/calibration/tiny.utf8")
fail() { echo "FAIL: $*"; exit 1; }

# 1: straight through; the layer lines and the summary on stderr
"$exl" quantize "${args[@]}" -o "$work/a" > "$work/a.out" 2> "$work/a.err" || fail "exl quantize: $(cat "$work/a.err")"
for l in 1 2 3 4; do
    grep -Eq "^quantized layer $l/4 in [0-9.]+ s: self_attn accuracy 0\.[0-9]+ at [0-9.]+ bpw, mlp accuracy" \
        "$work/a.err" || fail "no line for layer $l on stderr: $(cat "$work/a.err")"
done
grep -q "^quantize: done in" "$work/a.err" || fail "no final summary on stderr"

# 2: killed once the first layer is reported, then resumed
mkfifo "$work/pipe"
"$exl" quantize "${args[@]}" -o "$work/b" > /dev/null 2> "$work/pipe" &
pid=$!
killed=0
while IFS= read -r line; do
    echo "$line" >> "$work/b1.err"
    if [[ $killed == 0 && $line == "quantized layer 1/4"* ]]; then
        kill -9 "$pid" && killed=1
    fi
done < "$work/pipe"
{ wait "$pid"; } 2> /dev/null && fail "the run finished before it could be killed (killed=$killed)"
[[ -f "$work/b/.exl-quant/state.json" ]] || fail "no resumable state after the kill"
"$exl" quantize "${args[@]}" -o "$work/b" > /dev/null 2> "$work/b2.err" || fail "resume: $(cat "$work/b2.err")"
grep -q "^quantized layer 1/4" "$work/b2.err" && fail "the resumed run quantized layer 1 again"
grep -q "^quantized layer 2/4" "$work/b2.err" || fail "the resumed run did not quantize layer 2"
for f in model.safetensors config.json quantize_config.json; do
    cmp -s "$work/a/$f" "$work/b/$f" || fail "$f differs between the resumed and the uninterrupted run"
done
echo "ok: layer lines on stderr; killed after layer 1, resumed at layer 2, same bytes"
