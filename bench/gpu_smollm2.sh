#!/bin/bash
# gpu_smollm2.sh - issue 37 on the GPU machine: exl quantize of SmolLM2-135M-Instruct on cuda, timed (the measuring
# and quantizing passes apart, peak host and GPU memory), and the quality table (bpw exl reports, size, wikitext-2
# perplexity with --ctx 2048 --stride 2048 --max-windows 40, ratio to fp32). The kits come from
# bench/gpu_smollm2_prepare.sh, in two consecutive calls while the machine stays warm (files in /tmp survive):
#
#   bench/gpu_smollm2.sh part1   (carry .gpuq1)  copies the exl binaries and the GGUF's first piece to $STAGE
#   bench/gpu_smollm2.sh part2   (carry .gpuq2)  joins the GGUF ($STAGE/SmolLM2-135M-Instruct.Q4_1.gguf), converts
#                                                it (tools/gguf_to_hf.py), quantizes EXL2 4.0 (measures), 3.0, 2.5,
#                                                5.0, 6.0 (head 6, reusing the measurement) and GPTQ 4-bit g128,
#                                                measures each perplexity, checks GPU against CPU perplexity on two
#                                                windows of the fp32 model, prints the table
#   bench/gpu_smollm2.sh time4   (carry .gpuq2)  instead of part2 (joins and converts as it does): issue 37's timing
#                                                alone, EXL2 4.0 / head 6 from scratch each call (EXL_QUANT_PROFILE=1:
#                                                the passes, the profile, peak memory), then its perplexity (40
#                                                windows; r2-quant3's run: 32.328); HOST=1 the same with the host's
#                                                rounding (EXL_QUANT_DEVICE_GPTQ=0: the baseline on the same machine)
#
# Steps already done are kept: part2 called again (same warm machine) resumes an interrupted quantization and goes
# on. part2 stops starting new work after $BUDGET seconds (default 510: a call may run 600). Logs go to $OUT (copied
# there from $STAGE/logs at the end of each call).
set -uo pipefail
STAGE=${STAGE:-/tmp/exl-smollm2}
# the logs stay in $STAGE/logs across calls (a device call's $OUT is a new empty folder each time, and the table
# reads every earlier call's logs); they are copied to $OUT at the end
RESULT_DIR=${OUT:-$STAGE/out}
OUT=$STAGE/logs
BUDGET=${BUDGET:-510}
DEVICE=${DEVICE:-cuda} # cpu: a dry run of the script elsewhere
PYTHON=${PYTHON:-python3} # with numpy
GGUF=$STAGE/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$STAGE" "$OUT" "$RESULT_DIR"
start=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - start))); }

if [ "${1:-}" = part1 ]; then
    [ -d .gpuq1/bin ] || { echo "no .gpuq1/bin: carry .gpuq1 (bench/gpu_smollm2_prepare.sh)" >&2; exit 1; }
    rm -rf "$STAGE/bin"
    cp -r .gpuq1/bin "$STAGE/bin" && cp .gpuq1/gguf.part1 "$STAGE/" || exit 1
    ls -l "$STAGE" "$STAGE/bin"
    echo "part1 staged in $STAGE: now call part2 with .gpuq2"
    exit 0
fi
[ "${1:-}" = part2 ] || [ "${1:-}" = time4 ] || { echo "usage: $0 part1|part2|time4" >&2; exit 2; }
[ -x "$STAGE/bin/exl" ] || { echo "$STAGE/bin/exl missing: the machine was not kept warm, run part1 again" >&2; exit 1; }
export LD_LIBRARY_PATH="$STAGE/bin:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
EXL=$STAGE/bin/exl
if [ -d .gpuq2 ]; then
    cp -r .gpuq2/data .gpuq2/*.whl .gpuq2/gguf.sha256 "$STAGE/" 2> /dev/null
    [ -f .gpuq2/gguf.part2 ] && [ ! -f "$GGUF" ] && cp .gpuq2/gguf.part2 "$STAGE/"
fi
if [ ! -f "$GGUF" ]; then
    [ -f "$STAGE/gguf.part1" ] && [ -f "$STAGE/gguf.part2" ] || { echo "a GGUF piece is missing in $STAGE" >&2; exit 1; }
    cat "$STAGE/gguf.part1" "$STAGE/gguf.part2" > "$GGUF.tmp" && mv "$GGUF.tmp" "$GGUF"
    (cd "$STAGE" && sha256sum -c gguf.sha256) || { rm -f "$GGUF"; exit 1; }
    rm -f "$STAGE/gguf.part1" "$STAGE/gguf.part2"
fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null || echo "no GPU"; } |
    tee "$OUT/gpu.txt"
nproc > "$OUT/cores.txt"
CAL=("$STAGE"/data/calibration/*.utf8)
TEXT=$STAGE/data/wikitext2_test.txt
FP32=$STAGE/smollm2-135m-instruct-fp32
WORK=$STAGE/work
mkdir -p "$WORK"

# the fp32 model (the gguf wheel on the path; a stand-in for PyYAML, which gguf imports for model cards only)
if [ ! -f "$FP32/config.json" ]; then
    py=$STAGE/py
    if [ ! -d "$py/gguf" ]; then
        mkdir -p "$py" && (cd "$py" && python3 -m zipfile -e "$STAGE"/gguf-*.whl .) || exit 1
        "$PYTHON" -c "import yaml" 2> /dev/null || echo "# stand-in: gguf imports yaml only to read model cards" > "$py/yaml.py"
    fi
    t0=$(date +%s)
    PYTHONPATH=$py "$PYTHON" tools/gguf_to_hf.py "$GGUF" "$FP32" > "$OUT/convert.log" 2>&1 ||
        { tail -20 "$OUT/convert.log"; exit 1; }
    echo "converted in $(($(date +%s) - t0)) s"
fi

ppl() { # DIR NAME [WINDOWS [DEVICE]] -> WORK/NAME.ppl
    [ -s "$WORK/$2.ppl" ] && return 0
    [ "$(left)" -gt 5 ] || return 1
    timeout "$(left)" "$EXL" perplexity -m "$1" -f "$TEXT" --ctx 2048 --stride 2048 --max-windows "${3:-40}" \
        --device "${4:-$DEVICE}" -t "$(nproc)" > "$OUT/$2.ppl.log" 2>&1
    grep -Eo 'perplexity: [0-9.]+' "$OUT/$2.ppl.log" | tail -1 | grep -Eo '[0-9.]+$' > "$WORK/$2.ppl"
    [ -s "$WORK/$2.ppl" ] || { rm -f "$WORK/$2.ppl"; tail -3 "$OUT/$2.ppl.log"; return 1; }
}

gpu_peak() { # poll the GPU's memory in use while pid $1 lives; the maximum (MiB) to $2
    local m=0 v
    while kill -0 "$1" 2> /dev/null; do
        v=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2> /dev/null | head -1)
        [ -n "$v" ] && [ "$v" -gt "$m" ] && m=$v
        sleep 0.5
    done
    echo "$m" > "$2"
}

quant() { # NAME ARGS... -> WORK/NAME (stdout NAME.out, stderr NAME.err in OUT); resumes an interrupted run
    local name=$1
    shift
    [ -f "$WORK/$name/config.json" ] && return 0
    [ "$(left)" -gt 10 ] || return 1
    echo "quantize $name: $*"
    EXL_QUANT_PROFILE=1 timeout "$(left)" "$EXL" quantize -i "$FP32" -o "$WORK/$name" --device "$DEVICE" "$@" \
        --calibration "${CAL[@]}" \
        > "$OUT/$name.out" 2>> "$OUT/$name.err" &
    local pid=$!
    gpu_peak "$pid" "$OUT/$name.gpumem" &
    wait "$pid"
    local rc=$?
    wait
    [ $rc -eq 0 ] || { tail -3 "$OUT/$name.err"; echo "quantize $name stopped (rc $rc): call part2 again"; return 1; }
    grep '^quantize: done' "$OUT/$name.err"
}

if [ "$1" = time4 ]; then
    name=t4.0$([ "${HOST:-0}" = 1 ] && echo -host)
    rm -rf "${WORK:?}/$name" "$WORK/$name.ppl" "$OUT/$name.err"
    [ "${HOST:-0}" = 1 ] && export EXL_QUANT_DEVICE_GPTQ=0
    quant "$name" --format exl2 --bpw 4.0 --head-bits 6 || exit 1
    echo "where the time went (EXL_QUANT_PROFILE=1, seconds per pass and part, entries in parentheses):"
    awk -f bench/quant_profile.awk "$OUT/$name.err"
    echo "peak GPU memory $(cat "$OUT/$name.gpumem") MiB; per layer:"
    grep -a -E "^(measured|quantized) layer" "$OUT/$name.err" | sed -n '1,2p;$p'
    unset EXL_QUANT_DEVICE_GPTQ
    ppl "$WORK/$name" "$name" && echo "$name perplexity (40 windows): $(cat "$WORK/$name.ppl") (r2-quant3's 4.0: 32.328)"
    [ "$RESULT_DIR" = "$OUT" ] || cp "$OUT"/* "$RESULT_DIR/" 2> /dev/null
    exit 0
fi
ppl "$FP32" fp32
quant e4.0 --format exl2 --bpw 4.0 --head-bits 6 && ppl "$WORK/e4.0" e4.0
M=$WORK/e4.0/measurement.json
for b in 3.0 2.5 5.0 6.0; do
    quant "e$b" --format exl2 --bpw "$b" --head-bits 6 --measurement "$M" && ppl "$WORK/e$b" "e$b"
done
quant gptq --format gptq --bits 4 --group-size 128 && ppl "$WORK/gptq" gptq
# GPU against CPU: the fp32 model's perplexity over the first two windows (fp16 activations on the GPU)
ppl "$FP32" fp32-w2-cuda 2 "$DEVICE" && ppl "$FP32" fp32-w2-cpu 2 cpu

echo
echo "## SmolLM2-135M-Instruct on $(cut -d, -f1 "$OUT/gpu.txt"), $(cat "$OUT/cores.txt") cores"
echo "| model | bpw (exl's report) | size | perplexity | vs fp32 | quantize wall | measuring / quantizing | peak host / GPU memory |"
echo "|---|---|---|---|---|---|---|---|"
base=$(cat "$WORK/fp32.ppl" 2> /dev/null)
[ -n "$base" ] && echo "| fp32 | 32 | $(du -sh "$FP32/model.safetensors" | cut -f1) | $base | 1.00x | | | |"
for s in e2.5 e3.0 e4.0 e5.0 e6.0 gptq; do
    [ -f "$WORK/$s/config.json" ] || continue
    p=$(cat "$WORK/$s.ppl" 2> /dev/null || echo "?")
    bpw=$(grep -Eo 'decoder layers: [0-9.]+' "$OUT/$s.out" 2> /dev/null | grep -Eo '[0-9.]+$' || echo "4 + g128")
    size=$(du -sh "$WORK/$s"/*.safetensors | cut -f1)
    done_line=$(grep '^quantize: done' "$OUT/$s.err" | tail -1)
    wall=$(echo "$done_line" | grep -Eo 'done in [0-9.]+ s' | grep -Eo '[0-9.]+')
    passes=$(echo "$done_line" | grep -Eo 'measuring [0-9.]+ s over [0-9]+ layers, quantizing [0-9.]+ s')
    rss=$(echo "$done_line" | grep -Eo 'peak memory [0-9]+ MiB' | grep -Eo '[0-9]+ MiB')
    ratio=$([ -n "$base" ] && [ "$p" != "?" ] && awk -v a="$p" -v b="$base" 'BEGIN {printf "%.2f", a / b}' || echo "?")
    echo "| ${s/e/EXL2 } | $bpw | $size | $p | ${ratio}x | ${wall} s | $passes | $rss / $(cat "$OUT/$s.gpumem" 2> /dev/null) MiB |"
done
echo
echo "where the time went (EXL_QUANT_PROFILE=1, seconds per pass and part, entries in parentheses):"
for s in e4.0 e3.0 gptq; do
    [ -f "$OUT/$s.err" ] && awk -f bench/quant_profile.awk "$OUT/$s.err" | sed "s/^/$s /"
done
echo
echo "perplexity over 2 windows of the fp32 model: cuda $(cat "$WORK/fp32-w2-cuda.ppl" 2> /dev/null), cpu" \
    "$(cat "$WORK/fp32-w2-cpu.ppl" 2> /dev/null) (this model on the 2-core machine, same protocol: 18.837617)"
cp "$WORK"/*.ppl "$OUT/" 2> /dev/null
[ "$RESULT_DIR" = "$OUT" ] || cp "$OUT"/* "$RESULT_DIR/" 2> /dev/null
[ -f "$WORK/gptq/config.json" ] && [ -s "$WORK/fp32-w2-cpu.ppl" ] && echo "all done" ||
    echo "not all done in ${BUDGET} s: call part2 again on the same machine to go on"
