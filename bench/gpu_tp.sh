#!/usr/bin/env bash
# gpu_tp.sh - tensor parallelism and the layer split on a machine with 2-4 GPUs (NCCL: libnccl.so.2 on the loader
# path or $EXL_NCCL_LIBRARY; NVLink multicast off). Prepare here: bench/gpu_tp_prepare.sh && tests/gpu/prepare.sh;
# then there, from the repo root: bench/gpu_tp.sh (carry .gputp, .gpu/bin, .gpu/fixtures-*.tar.gz). Logs in $OUT.
#   1. correctness: the fixtures' logits with --tp 2 against the references (test_gpu, fp16 bound 5e-3, argmax
#      equal: the bound one GPU is held to), and exl run --greedy with --tp 2 equal to one GPU's tokens;
#   2. speed of random-weight EXL2 4.0 bpw models of the Llama-2-70B and 7B shapes on 1, 2 and 4 GPUs: prefill of
#      2048 tokens and decode at batch 1 (exl bench), generation at batch 1 and 32 (generator_bench);
#   2b. A/B at --tp > 1: the r2-tp3 path (EXL_TP_PUSH_GATHER=0: gathers through NCCL, not the push kernel;
#      EXL_CUDA_ZERO_NORMED=0: o_proj and down_proj merge their split sums in their last block instead of adding
#      them atomically into outputs an earlier GEMV zeroed), each of the two alone; the push kernels' time inside
#      the kernel on each rank (EXL_TP_PUSH_TRACE=1: the "trace" notices); with P2P=1 every collective through
#      NCCL (EXL_TP_P2P=0) and with PULL=1 the pull one-shot (EXL_TP_P2P=1);
#   3. the collectives' time per decode step: the same decode with EXL_TP_NO_COMM=1 (collectives left out, wrong
#      tokens), the difference being their cost;
#   4. --gpu-split with a model larger than one GPU's share: the 7B shape under EXL_CUDA_MEMORY_LIMIT=4GiB (split
#      1.7,1.9: each device also holds its CUDA context, ~0.75 GiB, and NCCL's buffers, which the limit counts), then the 70B shape
#      (~35 GB) with EXL_CUDA_MEMORY_LIMIT=24GiB (each GPU pretends to have 24 GiB): refused on one GPU, split 20,20
#      over two. Loading prints a line per device every 5 s and when done; stdout is line-buffered into the logs.
# A device call lasts 10 minutes at most: run the parts one call each (the machine keeps /tmp while it is held;
# speed and split make the model they need when /tmp lacks it):
#   bench/gpu_tp.sh check; bench/gpu_tp.sh speed m7b; TP_SIZES="1 2" bench/gpu_tp.sh speed m70b;
#   bench/gpu_tp.sh split        (no argument: all of them)
# Timing plan of `TP_SIZES="1 2" speed m70b` (a 33 GB load ~40 s, each line one load): making the model 22 s;
# --tp 1 bench; --tp 2 bench (default), as r2-tp3, without collectives, NCCL gathers, merged sums, traced; then
# the generator at --tp 1 and 2: 9 loads, ~450 s in all (GEN=0: ~350 s; P2P=1 adds NCCL: ~50 s).
# split: making the models ~30 s, the 7B runs ~20 s, the 70B refusal (most of a load), the split load ~40 s: ~150 s.
# env: TP_SIZES (default "1 2 4"), AB=0 (at --tp > 1 only the default and without collectives), P2P=1 (add
# NCCL), PULL=1 (with P2P=1: add the pull one-shot), GEN=0 (no generator_bench)
set -uo pipefail
what=${1:-all}
model_arg=${2:-}
out=${OUT:-.gputp/out}
mkdir -p "$out"
bin=.gputp/bin
export LD_LIBRARY_PATH=$PWD/$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
ldconfig -p | grep -q libnccl.so.2 || [ -n "${EXL_NCCL_LIBRARY:-}" ] || echo "WARNING: no libnccl.so.2 on the loader path"

check() {
echo "==== 1. correctness"
tests/gpu/run.sh --stage .gpu >/dev/null 2>&1
EXL_TEST_ONLY=tp EXL_TEST_TP=2 timeout 400 "$bin/test_gpu" "$shared" >"$out/test_gpu_tp2.log" 2>&1
grep -E "^(FAIL|SKIP|info)|^ok .*--tp|^test_gpu" "$out/test_gpu_tp2.log"
grep -cE "^ok .*(all_reduce|gather_cols)" "$out/test_gpu_tp2.log" |
    sed 's/^/all_reduce and gather_cols checks passed: /'
for tp in 1 2; do
    "$bin/exl" run -m "$shared/models/rand-llama" --device cuda --tp $tp -p "Once upon a time" -p "The dog" -n 48 \
        --greedy --json 2>/dev/null | md5sum | sed "s/-/greedy tokens, --tp $tp/"
done
}

make() { # dir hidden layers heads kv_heads ffn vocab
    [ -d "$1" ] || "$bin/make_random_quant" -o "$1" --format exl2 --bits 4 --hidden "$2" --layers "$3" --heads "$4" \
        --kv-heads "$5" --ffn "$6" --vocab "$7" --tokenizer-from .gputp/tok --same-layers >/dev/null
}
models() {
    model m7b
    model m70b
    du -sh /tmp/m7b /tmp/m70b
}

model() { # name: made unless /tmp has it
    case $1 in
    m7b) make /tmp/m7b 4096 32 32 32 11008 32000 ;;
    m70b) make /tmp/m70b 8192 80 64 8 28672 32000 ;;
    *) echo "no model $1" && exit 2 ;;
    esac
}

bench() { # log name, then VAR=value ... : exl bench of /tmp/$m over $tp GPUs with that environment
    local log=$1
    shift
    env "$@" timeout 150 stdbuf -oL "$bin/exl" bench -m /tmp/$m --device cuda --tp $tp -p 2048 -n 128 \
        >"$out/$log.log" 2>&1
    grep -E "^(prefill|decode|greedy):|^exl:" "$out/$log.log" | cut -c1-300
    echo "   ($SECONDS s into the call)"
}

speed() { # model name (m7b or m70b)
    m=$1
    model "$m"
    echo "==== 2. speed of $m (tok/s)"
    for tp in ${TP_SIZES:-1 2 4}; do
        [ "$tp" -le "$gpus" ] || continue
        echo "== $m --tp $tp (the default collectives: push where the GPUs have peer access)"
        bench "bench_${m}_tp$tp"
        [ "$tp" -gt 1 ] || continue
        if [ "${AB:-1}" = 0 ]; then
            echo "-- without the collectives (EXL_TP_NO_COMM=1): their cost is the difference"
            bench "bench_${m}_tp${tp}_nocomm" EXL_TP_NO_COMM=1
            continue
        fi
        echo "-- as r2-tp3: gathers through NCCL, o_proj / down_proj merging their split sums in their last block"
        echo "   (EXL_TP_PUSH_GATHER=0 EXL_CUDA_ZERO_NORMED=0)"
        bench "bench_${m}_tp${tp}_tp3" EXL_TP_PUSH_GATHER=0 EXL_CUDA_ZERO_NORMED=0
        echo "-- without the collectives (EXL_TP_NO_COMM=1): their cost is the difference"
        bench "bench_${m}_tp${tp}_nocomm" EXL_TP_NO_COMM=1
        echo "-- gathers through NCCL alone (EXL_TP_PUSH_GATHER=0)"
        bench "bench_${m}_tp${tp}_nccl_gather" EXL_TP_PUSH_GATHER=0
        echo "-- merging split sums alone (EXL_CUDA_ZERO_NORMED=0)"
        bench "bench_${m}_tp${tp}_merged" EXL_CUDA_ZERO_NORMED=0
        echo "-- the default with the push kernels' in-kernel time traced (EXL_TP_PUSH_TRACE=1)"
        bench "bench_${m}_tp${tp}_trace" EXL_TP_PUSH_TRACE=1
        if [ "${P2P:-0}" = 1 ]; then
            echo "-- every collective through NCCL (EXL_TP_P2P=0)"
            bench "bench_${m}_tp${tp}_nccl" EXL_TP_P2P=0
            if [ "${PULL:-0}" = 1 ]; then
                echo "-- the same with the pull one-shot (EXL_TP_P2P=1)"
                bench "bench_${m}_tp${tp}_pull" EXL_TP_P2P=1
            fi
        fi
    done
    [ "${GEN:-1}" = 1 ] || return 0
    for tp in ${TP_SIZES:-1 2 4}; do
        [ "$tp" -le "$gpus" ] || continue
        echo "== generator_bench $m --tp $tp: 64 tokens at 1 and 32 jobs"
        EXL_BENCH_DEVICE=cuda EXL_BENCH_TP=$tp EXL_BENCH_TEMPERATURE=0 timeout 150 "$bin/generator_bench" /tmp/$m \
            32 64 1 1 32 >"$out/gen_${m}_tp$tp.log" 2>&1
        tail -2 "$out/gen_${m}_tp$tp.log"
        echo "   ($SECONDS s into the call)"
    done
}

split() {
echo "==== 4. --gpu-split with a model larger than one GPU's share (EXL_CUDA_MEMORY_LIMIT)"
# first the 7B shape (3.9 GB) under a 4 GiB limit: seconds, and it shows whether the split path runs at all; then the
# 70B shape under 24 GiB. Each run's output goes to its log as it comes (a timeout keeps what was printed).
model m7b
EXL_CUDA_MEMORY_LIMIT=4GiB timeout 60 stdbuf -oL "$bin/exl" bench -m /tmp/m7b --device cuda -p 512 -n 32 \
    >"$out/split_7b_one.log" 2>&1
tail -2 "$out/split_7b_one.log"
EXL_CUDA_MEMORY_LIMIT=4GiB timeout 120 stdbuf -oL "$bin/exl" bench -m /tmp/m7b --device cuda --gpu-split 1.7,1.9 \
    -p 512 -n 32 >"$out/split_7b.log" 2>&1
echo "   rc $? ($SECONDS s into the call)"
tail -8 "$out/split_7b.log"
model m70b
echo "   (the 70B model ready, $SECONDS s into the call)"
EXL_CUDA_MEMORY_LIMIT=24GiB timeout 150 stdbuf -oL "$bin/exl" bench -m /tmp/m70b --device cuda -p 512 -n 32 \
    >"$out/split_70b_one.log" 2>&1
tail -2 "$out/split_70b_one.log"
echo "   ($SECONDS s into the call)"
EXL_CUDA_MEMORY_LIMIT=24GiB timeout 300 stdbuf -oL "$bin/exl" bench -m /tmp/m70b --device cuda --gpu-split 20,20 \
    -p 512 -n 32 >"$out/split_70b.log" 2>&1
echo "   rc $? ($SECONDS s into the call)"
tail -12 "$out/split_70b.log"
}

shared=.gpu/shared
[ -d "$shared" ] || shared=${EXL_GPU_STAGE:-/tmp/exl-gpu-stage}/shared
case $what in
check) check ;;
models) models ;;
speed) speed "$model_arg" ;;
split) split ;;
all) check && models && speed m7b && speed m70b && split ;;
*) echo "usage: bench/gpu_tp.sh [check|models|speed m7b|speed m70b|split]" && exit 2 ;;
esac
