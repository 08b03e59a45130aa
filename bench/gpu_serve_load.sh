#!/usr/bin/env bash
# gpu_serve_load.sh - serving throughput on the GPU machine, for issue 31: a random Llama-2-7B-shaped EXL2 4.0 bpw
# model (as bench/gpu_generator_bench.sh makes it), then
#   gen:   generator_bench at 1..256 jobs (8-token prompts, 128 new tokens): greedy, sampled (temperature 0.8, top-p
#          0.95, sampled on the device) and the same sampled with EXL_DEVICE_SAMPLING=0 (logits to the host: before);
#   serve: `exl serve --max-jobs 64` under bench/server_load.py at 1/16/32/64 streaming clients (128-token
#          completions, temperature 0.8 + top-p 0.95), on the device and with EXL_DEVICE_SAMPLING=0;
#   ahead: generator_bench at 1/16/32/64 jobs: greedy, sampled (queued ahead) and sampled with EXL_SAMPLED_AHEAD=0;
#   ahead-serve: the serve phase's load with EXL_SAMPLED_AHEAD=1 and 0.
# SERVE_VALUES (default "1 0"): the values the serve phases' variable takes. SERVE_REQS (default 2): requests a
# client sends one after another in the serve phases (1: the same 1-64 jobs as generator_bench; more: a longer
# steady state against the ramps).
# Each table goes to stdout and $OUT/serve_load.log. The serve phases' servers write a step trace (EXL_STEP_TRACE,
# src/generator/trace.c) to $OUT/step_trace_<variable>_<value>.txt, summed up by bench/step_trace.py after each run
# (per level: the engine's TTFT, in ms and in steps, and its parts).
#
# usage, here (builds the programs and copies them with the llama2 tokenizer into .gpuserve/, git-ignored):
#   bench/gpu_serve_load.sh --prepare [SHARED_DIR]
# then on the GPU machine (carry .gpuserve; PHASES: gen, serve (both: the default), ahead, ahead-serve):
#   bench/gpu_serve_load.sh [PHASES...]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
kit=$root/.gpuserve
if [ "${1:-}" = --prepare ]; then
    shared=$(cd "${2:-$root/../shared}" && pwd)
    set -e
    cmake -S "$root" -B "$root/build-gpu" -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >/dev/null
    cmake --build "$root/build-gpu" -j"$(nproc)" --target exl exl-cli make_random_quant exl_cuda >/dev/null
    cc -O2 -I"$root/include" "$root/bench/generator_bench.c" "$root/build-gpu/libexl.a" \
        $(pkg-config --libs libcjson libpcre2-8 libutf8proc) -lm -lpthread -ldl -o "$root/build-gpu/generator_bench"
    rm -rf "$kit" && mkdir -p "$kit/bin" "$kit/tok"
    for f in exl generator_bench make_random_quant libexl_cuda.so; do strip -o "$kit/bin/$f" "$root/build-gpu/$f"; done
    for lib in $(ldd "$root"/build-gpu/{exl,generator_bench,make_random_quant} | awk '/=> \// {print $3}' | sort -u); do
        case $(basename "$lib") in
        libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | libgcc_s.so* | libstdc++.so* | libcublas*) ;;
        *) cp -L "$lib" "$kit/bin/" ;;
        esac
    done
    cp "$shared"/tokenizers/llama2-hf/{tokenizer.json,tokenizer_config.json,special_tokens_map.json} "$kit/tok/" 2>/dev/null ||
        cp "$shared"/tokenizers/llama2-hf/tokenizer.json "$shared"/tokenizers/llama2-hf/tokenizer_config.json "$kit/tok/"
    du -sh "$kit"
    exit 0
fi

phases=${*:-gen serve}
out=${OUT:-$root/.gpuserve/out}
mkdir -p "$out"
log=$out/serve_load.log
export LD_LIBRARY_PATH=$kit/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bin=$kit/bin
M=${EXL_SERVE_MODEL:-/tmp/m7b}
say() { echo "$@" | tee -a "$log"; }
say "# $(nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader) - $(date -u +%F) - $(git -C "$root" rev-parse --short HEAD 2>/dev/null)"
if [ ! -f "$M/config.json" ]; then
    "$bin/make_random_quant" -o "$M" --format exl2 --hidden 4096 --layers 32 --heads 32 --kv-heads 32 --ffn 11008 \
        --vocab 32000 --tokenizer-from "$kit/tok" >/dev/null || { say "make_random_quant failed"; exit 1; }
fi
levels="1 2 4 8 16 32 64 128 256"
# the server under bench/server_load.py's streaming top-p clients, with the variable $1 at 1 and then 0
serve_load() {
    command -v python3 >/dev/null || { say "no python3 here: the serve phases need it"; return; }
    for v in ${SERVE_VALUES:-1 0}; do
        say "## exl serve --max-jobs 64, ${SERVE_REQS:-2} 128-token streamed completions a client, temperature 0.8 + top-p 0.95, $1=$v"
        trace=$out/step_trace_$1_$v.txt
        rm -f "$trace"
        env "$1=$v" EXL_STEP_TRACE="$trace" timeout "$2" python3 "$root/bench/server_load.py" --exl "$bin/exl" -m "$M" \
            --serve-args "--max-jobs 64" --top-p 0.95 --concurrency 1,16,32,64 --requests-per-client "${SERVE_REQS:-2}" \
            --max-tokens 128 2>&1 | tee -a "$log"
        say "### step trace ($trace): the engine's side of each burst of arrivals"
        python3 "$root/bench/step_trace.py" "$trace" 2>&1 | tee -a "$log"
    done
}
for phase in $phases; do
    case $phase in
    gen)
        say "## generator_bench, 7B EXL2 4.0 bpw, 8-token prompts, 128 new tokens, best of 1"
        say "### greedy"
        EXL_BENCH_DEVICE=cuda EXL_BENCH_TEMPERATURE=0 timeout 300 "$bin/generator_bench" "$M" 8 128 1 $levels 2>&1 | tee -a "$log"
        say "### sampled: temperature 0.8, top-p 0.95 (sampled on the device)"
        EXL_BENCH_DEVICE=cuda EXL_BENCH_TOP_K=0 timeout 300 "$bin/generator_bench" "$M" 8 128 1 $levels 2>&1 | tee -a "$log"
        say "### sampled, EXL_DEVICE_SAMPLING=0 (logits to the host)"
        EXL_DEVICE_SAMPLING=0 EXL_BENCH_DEVICE=cuda EXL_BENCH_TOP_K=0 timeout 300 "$bin/generator_bench" "$M" 8 128 1 \
            1 16 32 64 2>&1 | tee -a "$log"
        ;;
    serve) serve_load EXL_DEVICE_SAMPLING 400 ;;
    ahead)
        say "## generator_bench, sampled steps queued ahead (EXL_SAMPLED_AHEAD) against greedy, 1-64 jobs"
        for mode in greedy sampled sampled-waiting; do
            say "### $mode"
            t=0.8 sa=1
            [ $mode = greedy ] && t=0
            [ $mode = sampled-waiting ] && sa=0
            EXL_SAMPLED_AHEAD=$sa EXL_BENCH_DEVICE=cuda EXL_BENCH_TEMPERATURE=$t EXL_BENCH_TOP_K=0 timeout 200 \
                "$bin/generator_bench" "$M" 8 128 1 1 16 32 64 2>&1 | tee -a "$log"
        done
        ;;
    ahead-serve) serve_load EXL_SAMPLED_AHEAD 280 ;;
    *) say "unknown phase $phase (gen, serve, ahead, ahead-serve)" ;;
    esac
done
