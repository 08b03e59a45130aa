#!/usr/bin/env bash
# KL of EXL2 4.0 bpw (head 6) conversions of the round-2 random fixtures (rand-phi3: fused linears; rand-qwen3moe
# and rand-mixtral: experts) from their fp32 references: `exl quantize` with the six default calibration files,
# ROWS rows (default 32, the quantizer's default) of 512 tokens, then tools/quant_kl (mean KL over the stored positions of sequences a and b),
# with the wall and CPU time of each quantization.
#
# usage: bench/quant_arch_kl.sh BUILD_DIR SHARED_DIR OUT_DIR [MODEL...]   (OUT_DIR's model folders are replaced)
set -euo pipefail
if [ $# -lt 3 ]; then
    echo "usage: $0 BUILD_DIR SHARED_DIR OUT_DIR [MODEL...]" >&2
    exit 2
fi
BUILD=$(realpath "$1")
SHARED=$(realpath "$2")
OUT=$3
shift 3
MODELS=("$@")
ROWS=${ROWS:-32}
[ ${#MODELS[@]} -gt 0 ] || MODELS=(rand-qwen3moe rand-phi3 rand-mixtral)
mkdir -p "$OUT"
for m in "${MODELS[@]}"; do
    dir=$OUT/$m-exl2-4.0bpw-h6
    rm -rf "$dir"
    start=$(date +%s.%N)
    times_before=$(awk '{print $14+$15+$16+$17}' /proc/$$/stat)
    "$BUILD/exl" quantize -i "$SHARED/models/$m" -o "$dir" --format exl2 --bpw 4.0 --head-bits 6 --rows "$ROWS" \
        --calibration "$SHARED"/data/calibration/*.utf8 > "$OUT/$m.quantize.out" 2> "$OUT/$m.quantize.err"
    times_after=$(awk '{print $14+$15+$16+$17}' /proc/$$/stat)
    wall=$(echo "$(date +%s.%N) - $start" | bc)
    cpu=$(echo "($times_after - $times_before) / $(getconf CLK_TCK)" | bc -l)
    kl=$("$BUILD/quant_kl" "$SHARED/reference/$m.logits.safetensors" "$dir")
    printf '%s (%s rows): quantize %.0f s wall, %.0f s CPU; %s\n' "$m" "$ROWS" "$wall" "$cpu" "$kl"
done
