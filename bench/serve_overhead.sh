#!/usr/bin/env bash
# serve_overhead.sh - the CPU proxy for the server's overhead (issue 31): the same work, 16 completions of NEW
# (default 256) tokens at temperature 0.8 + top-p 0.95 (and greedy), done by `exl run` as one batch and by
# `exl serve` for 16 concurrent streaming clients (bench/server_load.py), both on one compute thread. Counted in CPU
# seconds of the exl process (user + system), which unlike wall time does not depend on what else the shared
# machine runs; `exl run`'s start (its run with -n 1) is taken off. Best of REPEATS (default 3). Prints a Markdown
# table and the ratios:
#   server rate / exl run rate   (CPU per token of exl run / of the server; wanted >= 0.80)
#   top-p cost / greedy cost     (exl run's CPU per token; wanted <= 1.15)
# usage: bench/serve_overhead.sh [MODEL_DIR] [REPEATS]   (default ../shared/models/tinystories-656k, 3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
model=${1:-$root/../shared/models/tinystories-656k}
repeats=${2:-3}
exl=${EXL:-$root/build/exl}
prompts=("Once upon a time" "The little dog" "Tom and Sue went to the park" "One day, a bird") # server_load.py's
args=()
for i in $(seq 0 15); do args+=(-p "${prompts[$((i % 4))]}"); done
new=${NEW:-256}

# CPU seconds of one `exl run` of the 16 prompts (extra options: sampling, -n)
run_cpu() {
    local f
    f=$(mktemp)
    /usr/bin/time -f "%U %S" -o "$f" "$exl" run -m "$model" "${args[@]}" --ignore-eos -t 1 "$@" >/dev/null 2>&1
    awk '{printf "%.3f", $1 + $2}' "$f"
    rm -f "$f"
}
best_run() {
    local best=999999 c
    for _ in $(seq "$repeats"); do
        c=$(run_cpu "$@")
        best=$(awk -v a="$best" -v b="$c" 'BEGIN {print (b < a) ? b : a}')
    done
    echo "$best"
}
# the server's CPU ms per token for 16 clients, one 128-token request each (best of REPEATS levels, one server)
serve_ms() {
    local levels
    levels=$(printf '16,%.0s' $(seq "$repeats"))
    python3 "$root/bench/server_load.py" --exl "$exl" -m "$model" --serve-args "-t 1" --concurrency "${levels%,}" \
        --requests-per-client 1 --max-tokens $new --json "$@" |
        python3 -c 'import json, sys; print("%.4f" % min(json.loads(l)["server_cpu_ms_per_token"] for l in sys.stdin))'
}

start=$(best_run -n 1 --temperature 0.8 --top-p 0.95)
topp=$(best_run -n $new --temperature 0.8 --top-p 0.95)
greedy=$(best_run -n $new --greedy)
host_topp=$(EXL_DEVICE_SAMPLING=0 best_run -n $new --temperature 0.8 --top-p 0.95)
s_topp=$(serve_ms --top-p 0.95)
s_greedy=$(serve_ms --temperature 0)
tokens=$((16 * new))
ms() { awk -v c="$1" -v s="$start" -v n=$tokens 'BEGIN {printf "%.4f", (c - s) * 1000 / n}'; }
r_topp=$(ms "$topp") r_greedy=$(ms "$greedy") r_host=$(ms "$host_topp")
echo "| what | CPU ms per token |"
echo "|---|---|"
echo "| exl run, 16 prompts, greedy | $r_greedy |"
echo "| exl run, 16 prompts, temperature 0.8 + top-p 0.95 (sample op) | $r_topp |"
echo "| exl run, same, EXL_DEVICE_SAMPLING=0 (host sampler) | $r_host |"
echo "| exl serve, 16 clients, greedy | $s_greedy |"
echo "| exl serve, 16 clients, temperature 0.8 + top-p 0.95 | $s_topp |"
echo
awk -v a="$r_topp" -v b="$s_topp" 'BEGIN {printf "server rate / exl run rate (top-p): %.2f (wanted >= 0.80)\n", a / b}'
awk -v a="$r_greedy" -v b="$s_greedy" 'BEGIN {printf "server rate / exl run rate (greedy): %.2f\n", a / b}'
awk -v a="$r_topp" -v b="$r_greedy" 'BEGIN {printf "top-p cost / greedy cost (exl run): %.2f (wanted <= 1.15)\n", a / b}'
awk -v a="$r_host" -v b="$r_greedy" 'BEGIN {printf "top-p on the host sampler / greedy (exl run): %.2f\n", a / b}'
