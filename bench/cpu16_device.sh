#!/usr/bin/env bash
# cpu16_device.sh - the issue-38 table (exl against llama.cpp on the CPU) on the GPU machine's 16 cores, which has
# no network and no ../shared. Two steps:
#   here:   bench/cpu16_device.sh --prepare [BUILD_DIR] [LLAMA_SRC]   fills the git-ignored .gpucpu/ (~8 MB):
#           exl and make_random_quant from BUILD_DIR (default build; the CPU kernels pick the ISA at run time) with
#           the libraries they need beyond libc, and llama.cpp's sources (LLAMA_SRC, default bench/tmp/llama's
#           sdist) without models, docs, tests and GPU backends, to build llama-bench there for that CPU.
#   device: bench/cpu16_device.sh [GGUF]   (carry .gpucpu; GGUF: /tmp/exl-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
#           prints the CPU, builds llama-bench with every core, then bench/llama_cpp_compare.sh for 1, 2 and all
#           cores (THREADS; nproc, or a cgroup CPU quota if lower): prefill 512, decode at context 16 and 512,
#           engines alternated, median of 3, with the read bandwidth exl bench measures after each decode; then
#           (unless KV_AB=0) bench/cpu_kv16_ab.sh: decode with the fp32 and the fp16 KV cache alternated. About 7
#           minutes on 16 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
kit=.gpucpu

if [ "${1:-}" = --prepare ]; then
    build=${2:-build}
    src=${3:-$(ls -d bench/tmp/llama/src/llama_cpp_python-*/vendor/llama.cpp | head -1)}
    rm -rf "$kit" && mkdir -p "$kit/bin"
    for f in exl make_random_quant; do strip -o "$kit/bin/$f" "$build/$f"; done
    for lib in $(ldd "$build/exl" "$build/make_random_quant" | awk '/=> \// { print $3 }' | sort -u); do
        case $(basename "$lib") in
        libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so*) ;;
        *) cp -L "$lib" "$kit/bin/" ;;
        esac
    done
    # llama-bench needs ggml (CPU), llama, common, vendor and the tools CMake adds
    drop=(models docs media gguf-py .github benches conversion tests examples pocs scripts tools/ui tools/server)
    for b in cuda vulkan opencl sycl hexagon metal et webgpu cann musa hip; do drop+=("ggml/src/ggml-$b"); done
    tar -czf "$kit/llama-src.tar.gz" -C "$src" "${drop[@]/#/--exclude=./}" .
    du -sh "$kit"/*
    exit 0
fi

gguf=${1:-/tmp/exl-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
work=${WORK:-/tmp/exl-cpu16}
[ -f "$gguf" ] || { echo "cpu16_device.sh: no GGUF at $gguf" >&2; exit 1; }
[ -x "$kit/bin/exl" ] || { echo "cpu16_device.sh: no $kit/bin/exl (run --prepare here and carry $kit)" >&2; exit 1; }
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0)) s] $*" >&2; }

# the cores this container may use: nproc, or fewer where a cgroup quota caps it
cores=$(nproc)
read -r quota period 2>/dev/null </sys/fs/cgroup/cpu.max || quota=max
if [ "${quota:-max}" != max ] && [ $(((quota + period - 1) / period)) -lt "$cores" ]; then
    cores=$(((quota + period - 1) / period))
fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) logical CPUs, using $cores"
lscpu | grep -E '^(Socket|Core|Thread|NUMA node\(s\)|L2|L3)' | sed 's/  */ /g' || true
echo "ISA: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' |
    grep -E '^(avx2|avx512f|avx512bw|avx512_vnni|avx_vnni|avx512_bf16|amx_tile|amx_int8)$' | tr '\n' ' ')"
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"

export LD_LIBRARY_PATH="$(pwd)/$kit/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
"$kit/bin/exl" bench --help >/dev/null 2>&1 || { echo "cpu16_device.sh: $kit/bin/exl does not run here" >&2; exit 1; }
if [ ! -x "$work/llama-build/bin/llama-bench" ]; then
    stamp "building llama-bench"
    rm -rf "$work/llama-src" && mkdir -p "$work/llama-src"
    tar -xzf "$kit/llama-src.tar.gz" -C "$work/llama-src"
fi
WORK=$work LLAMA_SRC=$work/llama-src GGUF=$gguf JOBS=$cores SETUP_ONLY=1 bench/llama_cpp_compare.sh "$kit/bin"
stamp "built; running"
WORK=$work LLAMA_SRC=$work/llama-src GGUF=$gguf THREADS=${THREADS:-"1 2 $cores"} bench/llama_cpp_compare.sh "$kit/bin"
if [ "${KV_AB:-1}" = 1 ]; then # the CPU KV cache's element, fp32 against fp16 (the default), same runs alternated
    stamp "KV cache A/B"
    THREADS=${THREADS:-"1 2 $cores"} bench/cpu_kv16_ab.sh "$work/smollm2-exl2-4.0" "$kit/bin"
fi
echo "load: $(cut -d' ' -f1-3 /proc/loadavg)"
stamp "done"
