#!/usr/bin/env bash
# fuzz.sh [--minutes N] [NAME...] - run the libFuzzer targets (tests/fuzz/fuzz_NAME.c; default: all) for N
# minutes each (default 5), one after another and at nice 10 (the machine is shared), each on its kept
# corpus ${EXL_FUZZ_CORPUS:-build-fuzz/corpus}/NAME, seeded by scripts/fuzz-seed.sh and growing from run
# to run. Crashes are written to build-fuzz/artifacts/NAME/. Prints one line per target; exit status 1
# when any target failed. Needs clang; the fixtures at ../shared (or EXL_SHARED).
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=5
names=()
while [ $# -gt 0 ]; do
    case $1 in
    --minutes) minutes=$2; shift 2 ;;
    -h | --help) sed -n '2,6p' "$0" | sed 's/^# //'; exit 0 ;;
    *) names+=("$1"); shift ;;
    esac
done
if [ ${#names[@]} -eq 0 ]; then
    mapfile -t names < <(ls tests/fuzz/fuzz_*.c | xargs -n1 basename | sed 's/^fuzz_//; s/\.c$//')
fi
shared=${EXL_SHARED:-$(cd .. && pwd)/shared}
[ -d "$shared/models" ] || { echo "fuzz.sh: no fixtures at $shared (set EXL_SHARED)" >&2; exit 2; }
corpus=${EXL_FUZZ_CORPUS:-$PWD/build-fuzz/corpus}

cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug -DEXL_FUZZ=ON -DEXL_CUDA=OFF \
    -DEXL_SHARED_DIR="$shared" >/dev/null
nice -n 10 cmake --build build-fuzz -j"$(nproc)" --target "${names[@]/#/fuzz_}" >/dev/null
mkdir -p "$corpus"
scripts/fuzz-seed.sh "$corpus" "$shared"

failed=0
for name in "${names[@]}"; do
    log=build-fuzz/fuzz_$name.log
    mkdir -p "build-fuzz/artifacts/$name"
    before=$(ls "$corpus/$name" | wc -l)
    start=$(date +%s)
    if nice -n 10 "build-fuzz/fuzz_$name" -max_total_time=$((minutes * 60)) -timeout=10 -rss_limit_mb=2048 \
        -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$name/" "$corpus/$name" >"$log" 2>&1; then
        result=clean
    else
        result="FAILED (see $log and build-fuzz/artifacts/$name/)"
        failed=1
    fi
    runs=$(grep -oE '^stat::number_of_executed_units: [0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
    printf '%-12s %4ds %10s runs  corpus %d -> %d  %s\n' "$name" $(($(date +%s) - start)) "$runs" "$before" \
        "$(ls "$corpus/$name" | wc -l)" "$result"
done
exit $failed
