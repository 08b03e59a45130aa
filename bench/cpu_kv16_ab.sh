#!/usr/bin/env bash
# cpu_kv16_ab.sh - same-run A/B of the CPU's KV cache element: `exl bench` decode with EXL_CPU_KV=fp32 and fp16
# alternated (fp32 first in odd repetitions, fp16 in even ones), at contexts 16 and 512, for each thread count; prints tok/s and the share of the read bandwidth that
# `exl bench` measures right after each decode (its "bound" line), one line per run, then the medians.
# usage: bench/cpu_kv16_ab.sh MODEL_DIR [BUILD_DIR]    env: THREADS ("1 2"), REPS (3), GEN (64)
set -euo pipefail
model=${1:?usage: bench/cpu_kv16_ab.sh MODEL_DIR [BUILD_DIR]}
build=${2:-build}
reps=${REPS:-3}
gen=${GEN:-64}
runs=$(mktemp)
trap 'rm -f "$runs"' EXIT
for t in ${THREADS:-1 2}; do
    for ctx in 16 512; do
        for rep in $(seq "$reps"); do
            order="fp32 fp16"
            [ $((rep % 2)) = 0 ] && order="fp16 fp32" # which runs first alternates too
            for kv in $order; do
                EXL_CPU_KV=$kv "$build/exl" bench -m "$model" -t "$t" -p "$ctx" -n "$gen" --device cpu |
                    awk -v t="$t" -v c="$ctx" -v kv="$kv" -v rep="$rep" '
                        /^decode:/ { for (i = 1; i <= NF; i++) if ($i == "tokens/s") d = $(i - 1) }
                        /^memory:/ { b = $2 } /^bound:/ { r = $NF; sub(/%/, "", r) }
                        END { printf "%s %s %s %s %s %s %s\n", t, c, kv, rep, d, b, r }' | tee -a "$runs"
            done
        done
    done
done
echo
echo "| threads | context | fp32 cache tok/s (% of read) | fp16 cache tok/s (% of read) | fp16 / fp32 |"
echo "|---|---|---|---|---|"
awk '{ k = $1 " " $2; v[k, $3] = v[k, $3] " " $5 " (" $7 "%)"; s[k, $3] = s[k, $3] " " $5; keys[k] = 1 }
     END { for (k in keys) print k "|" v[k, "fp32"] "|" v[k, "fp16"] "|" s[k, "fp32"] "|" s[k, "fp16"] }' "$runs" |
    sort -n | while IFS='|' read -r key a b sa sb; do
        med() { tr ' ' '\n' | grep . | sort -g | awk '{ x[NR] = $1 } END { print x[int((NR + 1) / 2)] }'; }
        ma=$(med <<<"$sa") mb=$(med <<<"$sb")
        set -- $key
        echo "| $1 | $2 |$a |$b | $(awk -v a="$ma" -v b="$mb" 'BEGIN { printf "%.2f", b / a }') |"
    done
