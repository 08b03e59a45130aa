#!/usr/bin/env bash
# Perplexity of tinystories-656k against bits per weight: quantizes the model to EXL2 (2.5, 2.7, 3.0,
# 4.0, 4.35, 5.0, 6.0 bpw, head 6 bits; the 4.0 run measures, the others reuse its measurement.json;
# 4.35 matches GPTQ's stored bits per weight), GPTQ
# 4-bit g128 act-order and round-to-nearest 4-bit g128, runs `exl perplexity --ctx 256 --max-windows 64`
# on tinystories_val.txt for each and for the unquantized model, and records wall time and peak RSS
# (/usr/bin/time -v) of every quantize and perplexity run. Prints a Markdown table (also OUT_DIR/quant_ppl.md)
# and writes OUT_DIR/quant_ppl.csv for bench/plot_ppl.py. A failed run is kept in the table as failed.
#
# usage: bench/quant_ppl.sh EXL_BINARY SHARED_DIR OUT_DIR     (OUT_DIR's model folders are replaced)
set -euo pipefail

if [ $# -ne 3 ]; then
    echo "usage: $0 EXL_BINARY SHARED_DIR OUT_DIR" >&2
    exit 2
fi
EXL=$(realpath "$1")
SHARED=$(realpath "$2")
OUT=$3
TIME=/usr/bin/time
[ -x "$EXL" ] || { echo "$EXL: not an executable" >&2; exit 2; }
[ -x "$TIME" ] || { echo "needs GNU time at $TIME (apt-get install time)" >&2; exit 2; }

MODEL=$SHARED/models/tinystories-656k
TEXT=$SHARED/data/tinystories_val.txt
CAL=("$SHARED"/data/calibration/*.utf8)
PPL_ARGS=(--ctx 256 --max-windows 64)
mkdir -p "$OUT/logs"
CSV=$OUT/quant_ppl.csv
MD=$OUT/quant_ppl.md

# timed TAG CMD...: runs CMD under /usr/bin/time -v, output in logs/TAG.log, times in logs/TAG.time;
# sets RC, WALL (seconds) and PEAK (MiB).
timed() {
    local tag=$1
    shift
    RC=0
    "$TIME" -v -o "$OUT/logs/$tag.time" "$@" >"$OUT/logs/$tag.log" 2>&1 || RC=$?
    WALL=$(awk -F': ' '/Elapsed \(wall clock\)/ { n = split($2, p, ":"); s = 0;
                                                   for (i = 1; i <= n; i++) s = s * 60 + p[i];
                                                   printf "%.1f", s }' "$OUT/logs/$tag.time")
    PEAK=$(awk -F': ' '/Maximum resident set size/ { printf "%.1f", $2 / 1024 }' "$OUT/logs/$tag.time")
}

# last error line of a log (progress lines use \r)
last_error() { tr '\r' '\n' <"$1" | grep -v '^\s*$' | grep -v '^Command exited' | tail -n 1 | cut -c1-160 || true; }

echo "name,format,kind,target_bpw,bpw,bpw_source,perplexity,quant_wall_s,quant_peak_mib,ppl_wall_s,ppl_peak_mib,status" >"$CSV"
ROWS=()
FP32_PPL=

# row NAME FORMAT KIND TARGET DIR QUANT_CMD... : quantizes (unless KIND is fp32), measures perplexity,
# appends one CSV line.
row() {
    local name=$1 format=$2 kind=$3 target=$4 dir=$5
    shift 5
    local qwall="" qpeak="" bpw="" src="" ppl="" status=ok
    if [ "$kind" != fp32 ]; then
        rm -rf "$dir"
        timed "$name.quantize" "$@"
        qwall=$WALL qpeak=$PEAK
        if [ "$RC" -ne 0 ]; then
            status="quantize failed (exit $RC): $(last_error "$OUT/logs/$name.quantize.log")"
        elif [ "$kind" = exl2 ]; then
            bpw=$(tr '\r' '\n' <"$OUT/logs/$name.quantize.log" |
                  sed -n 's/^decoder layers: \([0-9.]*\) bits per weight.*/\1/p' | tail -n 1)
            src=quantize
        fi
        if [ "$status" = ok ] && [ -z "$bpw" ]; then
            # GPTQ/RTN: quantize prints no bpw; exl info counts codes, scales, zeros and g_idx
            bpw=$("$EXL" info -m "$dir" | sed -n 's/^bits\/weight: *\([0-9.]*\) decoder layers.*/\1/p') || true
            src="exl info"
        fi
    else
        bpw=32 src=fp32
    fi
    local pwall="" ppeak=""
    if [ "$status" = ok ]; then
        timed "$name.perplexity" "$EXL" perplexity -m "$dir" -f "$TEXT" "${PPL_ARGS[@]}"
        pwall=$WALL ppeak=$PEAK
        ppl=$(sed -n 's/^perplexity: *//p' "$OUT/logs/$name.perplexity.log" | tail -n 1)
        if [ "$RC" -ne 0 ] || [ -z "$ppl" ]; then
            status="perplexity failed (exit $RC): $(last_error "$OUT/logs/$name.perplexity.log")"
            ppl=""
        fi
    fi
    [ "$kind" = fp32 ] && FP32_PPL=$ppl
    status=${status//,/;}
    echo "$name,$format,$kind,$target,$bpw,$src,$ppl,$qwall,$qpeak,$pwall,$ppeak,$status" >>"$CSV"
    echo "done: $name ($status${ppl:+, perplexity $ppl})" >&2
}

START=$SECONDS
Q=("$EXL" quantize -i "$MODEL")
row fp32 "unquantized fp32" fp32 32 "$MODEL"
# the first EXL2 run measures; every other EXL2 run reuses its measurement.json
row exl2-4.0 "EXL2 4.0 (head 6; measures)" exl2 4.0 "$OUT/exl2-4.0" \
    "${Q[@]}" -o "$OUT/exl2-4.0" --format exl2 --bpw 4.0 --calibration "${CAL[@]}"
MEAS=$OUT/exl2-4.0/measurement.json
for b in 2.5 2.7 3.0 4.35 5.0 6.0; do
    row "exl2-$b" "EXL2 $b (head 6)" exl2 "$b" "$OUT/exl2-$b" \
        "${Q[@]}" -o "$OUT/exl2-$b" --format exl2 --bpw "$b" --measurement "$MEAS" --calibration "${CAL[@]}"
done
row gptq-4-g128 "GPTQ 4-bit g128 act-order" gptq 4 "$OUT/gptq-4-g128" \
    "${Q[@]}" -o "$OUT/gptq-4-g128" --format gptq --bits 4 --group-size 128 --act-order --calibration "${CAL[@]}"
row rtn-4-g128 "RTN 4-bit g128 (--rtn)" rtn 4 "$OUT/rtn-4-g128" \
    "${Q[@]}" -o "$OUT/rtn-4-g128" --format gptq --bits 4 --group-size 128 --rtn

# Markdown table, EXL2 rows sorted by target bpw
{
    echo "| model | format | bpw (reported) | perplexity | Δ vs fp32 | quantize wall s | quantize peak MiB | perplexity wall s | perplexity peak MiB |"
    echo "|---|---|---|---|---|---|---|---|---|"
    tail -n +2 "$CSV" | awk -F, '{ o = ($3 == "fp32") ? 0 : ($3 == "exl2") ? 1 : ($3 == "gptq") ? 2 : 3;
                                   print o "\t" $4 "\t" $0 }' |
        sort -t$'\t' -k1,1n -k2,2g | cut -f3- | awk -F, -v ref="$FP32_PPL" '
        function d(x) { return x == "" ? "–" : x }
        {
            bpw = $5 == "" ? "–" : ($6 == "exl info" ? $5 " (exl info)" : ($6 == "fp32" ? "32 (fp32)" : $5))
            if ($7 == "") { ppl = "**" $12 "**"; delta = "–" }
            else {
                ppl = sprintf("%.3f", $7)
                delta = ($3 == "fp32") ? "–" : sprintf("%+.3f (%+.1f%%)", $7 - ref, 100 * ($7 - ref) / ref)
            }
            printf "| tinystories-656k | %s | %s | %s | %s | %s | %s | %s | %s |\n",
                   $2, bpw, ppl, delta, d($8), d($9), d($10), d($11)
        }'
} | tee "$MD"
echo "total: $((SECONDS - START)) s; CSV: $CSV" >&2
