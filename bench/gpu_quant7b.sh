#!/bin/bash
# gpu_quant7b.sh - issue 37 on the GPU machine: `exl quantize --device cuda --format exl2 --bpw 4.0 --head-bits 6` of
# a random fp16 Llama-2-7B-shaped model (32 layers, hidden 4096, ffn 11008, vocab 32000; ~13 GB, generated there by
# the carried make_random_model with rand-llama's tokenizer), timed, with EXL_QUANT_PROFILE=1's breakdown per pass.
#
# After bench/gpu_smollm2.sh part1 on the same warm machine (it stages kit .gpuq1 in $STAGE: the CUDA exl, the
# generator, the tokenizer, the calibration texts), or carrying .gpuq1 itself (bench/gpu_smollm2_prepare.sh):
#
#   bench/gpu_quant7b.sh            generate (once), quantize until $BUDGET s (default 540) have gone, then stop;
#                                   called again on the same machine it resumes the interrupted quantization
#   LAYERS=2 bench/gpu_quant7b.sh   a cut of the same shape with 2 layers (a quick profile; its own directories)
#
# It prints the progress lines (each layer: accuracy, bits, seconds; the estimate of the time left), the profile
# summed per pass (bench/quant_profile.awk) and, once done, exl's summary line (passes, peak host memory) and the
# peak GPU memory. Logs go to $OUT.
set -uo pipefail
STAGE=${STAGE:-/tmp/exl-smollm2}
OUT=${OUT:-$STAGE/out7b}
BUDGET=${BUDGET:-540}
LAYERS=${LAYERS:-32}
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }
mkdir -p "$STAGE" "$OUT"
if [ ! -x "$STAGE/bin/exl" ] || [ ! -x "$STAGE/bin/make_random_model" ]; then
    [ -d .gpuq1/bin ] || { echo "no $STAGE/bin and no .gpuq1: run bench/gpu_smollm2.sh part1 first" >&2; exit 1; }
    rm -rf "$STAGE/bin" && cp -r .gpuq1/bin "$STAGE/bin" || exit 1
fi
for d in tok calibration; do
    [ -d "$STAGE/$d" ] || cp -r ".gpuq1/$d" "$STAGE/$d" || { echo "no .gpuq1/$d" >&2; exit 1; }
done
export LD_LIBRARY_PATH="$STAGE/bin:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2> /dev/null || echo "no GPU"; } | tee "$OUT/gpu.txt"
MODEL=$STAGE/llama7b-l$LAYERS
Q=$STAGE/llama7b-l$LAYERS-exl2-4.0
NAME=l$LAYERS

if [ ! -f "$MODEL/config.json" ]; then
    t0=$(date +%s)
    rm -rf "$MODEL"
    "$STAGE/bin/make_random_model" -o "$MODEL" --preset llama2-7b --layers "$LAYERS" --dtype f16 \
        --tokenizer-from "$STAGE/tok" > "$OUT/make.log" 2>&1 || { tail -5 "$OUT/make.log"; exit 1; }
    echo "generated $(du -sh "$MODEL" | cut -f1) in $(($(date +%s) - t0)) s (disk left: $(df -h "$STAGE" |
        awk 'NR == 2 {print $4}'))"
fi

if [ ! -f "$Q/config.json" ]; then
    echo "quantize ($(left) s left in this call)"
    tq=$(date +%s)
    EXL_QUANT_PROFILE=1 timeout "$(left)" "$STAGE/bin/exl" quantize -i "$MODEL" -o "$Q" --device cuda \
        --format exl2 --bpw 4.0 --head-bits 6 --calibration "$STAGE"/calibration/*.utf8 \
        > "$OUT/$NAME.out" 2>> "$OUT/$NAME.err" &
    pid=$!
    m=0
    while kill -0 "$pid" 2> /dev/null; do
        v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2> /dev/null | head -1)
        [ -n "$v" ] && [ "$v" -gt "$m" ] && m=$v
        sleep 1
    done
    wait "$pid"
    rc=$?
    [ "$m" -gt "$(cat "$OUT/$NAME.gpumem" 2> /dev/null || echo 0)" ] && echo "$m" > "$OUT/$NAME.gpumem"
    echo "$(($(date +%s) - tq))" >> "$OUT/$NAME.walls"
    echo "exit status $rc (124: stopped at the budget; call again on the same machine to resume)"
fi
echo "---- layers (stderr, lines of finished layers)"
tr '\r' '\n' < "$OUT/$NAME.err" | grep -a -E "^(measured|quantized) layer|^quantize: " | tail -40
echo "---- the last progress line"
tr '\r' '\n' < "$OUT/$NAME.err" | grep -a "% of it\|left\]" | tail -1
echo "---- where the time went (EXL_QUANT_PROFILE=1; seconds per pass and part, entries in parentheses)"
awk -f bench/quant_profile.awk "$OUT/$NAME.err"
grep -a "exl: profile" "$OUT/$NAME.err" | head -2
echo "---- summary"
grep -a '^quantize: done' "$OUT/$NAME.err" | tail -1
[ -f "$OUT/$NAME.walls" ] && echo "quantize wall over $(wc -l < "$OUT/$NAME.walls") call(s): $(awk '{s += $1} END {print s}' \
    "$OUT/$NAME.walls") s (each: $(paste -sd' ' "$OUT/$NAME.walls"); a resumed call redoes the layer it was stopped in)"
echo "peak GPU memory $(cat "$OUT/$NAME.gpumem" 2> /dev/null) MiB"
[ -f "$Q/config.json" ] && echo "all done: $(du -sh "$Q" | cut -f1) in $Q" || echo "not done yet"
