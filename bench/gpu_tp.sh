#!/usr/bin/env bash
# gpu_tp.sh - tensor parallelism on a machine with 2-4 GPUs (NCCL from the CUDA image, libnccl.so.2; NVLink
# multicast off): correctness of --tp 2 against the references, then speed on 1, 2 and 4 GPUs of random-weight
# EXL2 4.0 bpw models of the Llama-2-70B and 7B shapes: prefill of 2048 tokens and decode at batch 1 (exl bench),
# decode at batch 32 (generator_bench), the all-reduce's share of a decode step (EXL_CUDA_GRAPHS=0 timing with
# and without the collectives is not separable here: see bench/LOG.md), and a model larger than one GPU's share.
#
# Prepare here (as gpu_generator_bench.sh): build-gpu with EXL_CUDA=ON, then copy exl, test_gpu, generator_bench,
# make_random_quant, libexl_cuda.so and the core's shared libraries into .gputp/bin, the llama2 tokenizer into
# .gputp/tok, and the fixtures (tests/gpu/prepare.sh) into .gpu/. On the GPU machine, from the repo root:
#   bench/gpu_tp.sh            (carry .gputp and .gpu; results in $OUT)
set -uo pipefail
out=${OUT:-.gputp/out}
mkdir -p "$out"
bin=.gputp/bin
export LD_LIBRARY_PATH=$PWD/$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | wc -l)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
ldconfig -p | grep -q libnccl.so.2 || echo "no libnccl.so.2 on the loader path: set EXL_NCCL_LIBRARY"

# 1. correctness: every fixture with --tp 2 against the references (fp16 bound 5e-3, argmax equal)
tests/gpu/run.sh --stage .gpu >/dev/null 2>&1
EXL_TEST_TP=2 timeout 300 "$bin/test_gpu" .gpu/shared >"$out/test_gpu_tp2.log" 2>&1
grep -E "^(ok|FAIL|SKIP).*--tp" "$out/test_gpu_tp2.log"

# 2. speed: 70B and 7B shapes, EXL2 4.0 bpw, random weights
make() { # dir hidden layers heads kv ffn vocab
    [ -d "$1" ] || "$bin/make_random_quant" -o "$1" --format exl2 --bits 4 --hidden "$2" --layers "$3" --heads "$4" \
        --kv-heads "$5" --ffn "$6" --vocab "$7" --tokenizer-from .gputp/tok >/dev/null
}
make /tmp/m70b 8192 80 64 8 28672 32000
make /tmp/m7b 4096 32 32 32 11008 32000
for m in /tmp/m7b /tmp/m70b; do
    for tp in 1 2 4; do
        [ "$tp" -le "$gpus" ] || continue
        echo "== $(basename $m) --tp $tp"
        timeout 300 "$bin/exl" bench -m "$m" --device cuda --tp "$tp" -p 2048 -n 64 2>&1 | tee "$out/bench_$(basename $m)_tp$tp.log" | tail -4
        EXL_BENCH_DEVICE=cuda EXL_BENCH_TP=$tp EXL_BENCH_TEMPERATURE=0 timeout 300 "$bin/generator_bench" "$m" 32 64 1 1 32 \
            2>&1 | tee "$out/gen_$(basename $m)_tp$tp.log" | tail -2
    done
done

# 3. the all-reduce's cost: NCCL's own all-reduce of a decode step's size (8192 floats) and a prefill's
#    (2048 x 8192), timed by nccl-tests where the image has them
command -v all_reduce_perf >/dev/null && all_reduce_perf -b 32K -e 64M -f 4 -g "$gpus" | tee "$out/nccl.log" | tail -12

# 4. --gpu-split is not implemented yet (bench/LOG.md): a model larger than one GPU's share runs with --tp instead
echo "== 70B fp16-sized check: /tmp/m70b at 4.0 bpw is ~35 GB; --tp $gpus puts $((35 / gpus)) GB on each GPU"
