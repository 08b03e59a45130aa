#!/usr/bin/env bash
# test-all.sh - the whole test suite: the format check, a release build with every unit test (CTest), the same
# tests under ASan+UBSan, and a short run of every libFuzzer target. The last line is
# CTest's summary of the release run. Set EXL_FUZZ_SECONDS (default 20) per fuzz target.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=$(nproc)
shared=${EXL_SHARED:-$(cd .. && pwd)/shared}
# a clone of a local checkout elsewhere (git clone /path/to/exl /tmp/x): the fixtures beside the original
origin=$(git config --get remote.origin.url 2>/dev/null || true)
if [ -z "${EXL_SHARED:-}" ] && [ ! -d "$shared/models" ] && [ -d "$origin/../shared/models" ]; then
    shared=$(cd "$origin/../shared" && pwd)
fi
if [ ! -d "$shared/models" ]; then
    echo "test-all.sh: the shared fixtures are not at $shared (no models/ there): clone the project beside" \
        "../shared, or set EXL_SHARED=/path/to/shared" >&2
    exit 1
fi

echo "== format (clang-format with .clang-format)"
scripts/check-format.sh

echo "== release build"
# CI builds one CUDA architecture (when the toolkit is present) to catch compile errors
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-75}" -DEXL_SHARED_DIR="$shared" \
    >/dev/null
cmake --build build -j"$jobs"

echo "== ASan+UBSan build and tests"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DEXL_SANITIZE=ON -DEXL_CUDA=OFF -DEXL_SHARED_DIR="$shared" >/dev/null
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" --timeout 900 -E '^test_reference_(scalar|avx2)$'

echo "== fuzzing (clang libFuzzer, ${EXL_FUZZ_SECONDS:-20}s per target)"
cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCMAKE_BUILD_TYPE=Debug -DEXL_FUZZ=ON -DEXL_CUDA=OFF \
    -DEXL_SHARED_DIR="$shared" >/dev/null
cmake --build build-fuzz -j"$jobs" --target $(ls tests/fuzz/fuzz_*.c | xargs -n1 basename | sed 's/\.c$//')
corpus=$(mktemp -d)
scripts/fuzz-seed.sh "$corpus" "$shared"
for src in tests/fuzz/fuzz_*.c; do
    target=build-fuzz/$(basename "$src" .c)
    name=$(basename "$target" | sed 's/^fuzz_//')
    dir="$corpus/$name"
    mkdir -p "$dir"
    echo "-- $target"
    if ! "$target" -max_total_time="${EXL_FUZZ_SECONDS:-20}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        "$dir" >"$corpus/log" 2>&1; then
        tail -n 60 "$corpus/log"
        echo "fuzzer $target failed"
        exit 1
    fi
    grep -E "^stat::number_of_executed_units" "$corpus/log" || true
done
rm -rf "$corpus"

echo "== Python package: pip wheel ., the wheel installed in a fresh venv without building, pytest"
rm -rf build-py
python3 -m venv build-py/venv
CMAKE_BUILD_PARALLEL_LEVEL=$jobs build-py/venv/bin/pip wheel --quiet --disable-pip-version-check . -w build-py/wheel
build-py/venv/bin/pip install --quiet --disable-pip-version-check --no-index --only-binary=:all: \
    build-py/wheel/exl-*.whl
build-py/venv/bin/pip install --quiet --disable-pip-version-check pytest
(cd build-py && EXL_SHARED="$shared" venv/bin/python -m pytest -q ../python/tests)

echo "== release tests"
ctest --test-dir build --output-on-failure -j"$jobs" --timeout 900
