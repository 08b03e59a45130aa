#!/usr/bin/env bash
# gpu_tp.sh - tensor parallelism and the layer split on a machine with 2-4 GPUs (NCCL: libnccl.so.2 on the loader
# path or $EXL_NCCL_LIBRARY; NVLink multicast off). Prepare here: bench/gpu_tp_prepare.sh && tests/gpu/prepare.sh;
# then there, from the repo root: bench/gpu_tp.sh (carry .gputp, .gpu/bin, .gpu/fixtures-*.tar.gz). Logs in $OUT.
#   1. correctness: the fixtures' logits with --tp 2 against the references (test_gpu, fp16 bound 5e-3, argmax
#      equal: the bound one GPU is held to), and exl run --greedy with --tp 2 equal to one GPU's tokens;
#   2. speed of random-weight EXL2 4.0 bpw models of the Llama-2-70B and 7B shapes on 1, 2 and 4 GPUs: prefill of
#      2048 tokens and decode at batch 1 (exl bench), generation at batch 1 and 32 (generator_bench);
#   2b. with EXL_TP_P2P=1: the one-shot peer-to-peer all-reduce instead of NCCL for sizes up to 64K floats;
#   3. the collectives' time per decode step: the same decode with EXL_TP_NO_COMM=1 (collectives left out, wrong
#      tokens), the difference being their cost;
#   4. --gpu-split with a model larger than one GPU's share: the 70B shape (~35 GB) with EXL_CUDA_MEMORY_LIMIT=24GiB
#      (each GPU pretends to have 24 GiB): refused on one GPU, split 20,20 over two.
# A device call lasts 10 minutes at most: run the parts one call each (the machine keeps /tmp while it is held):
#   bench/gpu_tp.sh check; bench/gpu_tp.sh models; bench/gpu_tp.sh speed m7b; bench/gpu_tp.sh speed m70b;
#   bench/gpu_tp.sh split        (no argument: all of them)
# env: TP_SIZES (default "1 2 4"), P2P=0 (leave out the peer-to-peer runs)
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
EXL_TEST_TP=2 timeout 300 "$bin/test_gpu" "$shared" >"$out/test_gpu_tp2.log" 2>&1
grep -E "^(ok|FAIL|SKIP).*--tp" "$out/test_gpu_tp2.log"
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
    make /tmp/m7b 4096 32 32 32 11008 32000
    make /tmp/m70b 8192 80 64 8 28672 32000
    du -sh /tmp/m7b /tmp/m70b
}

speed() { # model name (m7b or m70b)
    m=$1
    echo "==== 2. speed of $m (tok/s)"
    for tp in ${TP_SIZES:-1 2 4}; do
        [ "$tp" -le "$gpus" ] || continue
        echo "== $m --tp $tp"
        timeout 300 "$bin/exl" bench -m /tmp/$m --device cuda --tp $tp -p 2048 -n 128 >"$out/bench_${m}_tp$tp.log" 2>&1
        tail -4 "$out/bench_${m}_tp$tp.log"
        EXL_BENCH_DEVICE=cuda EXL_BENCH_TP=$tp EXL_BENCH_TEMPERATURE=0 timeout 300 "$bin/generator_bench" /tmp/$m 32 64 \
            1 1 32 >"$out/gen_${m}_tp$tp.log" 2>&1
        tail -2 "$out/gen_${m}_tp$tp.log"
        [ "$tp" -gt 1 ] || continue
        if [ "${P2P:-1}" = 1 ]; then
            echo "-- the same with the peer-to-peer all-reduce for small sizes (EXL_TP_P2P=1)"
            EXL_TP_P2P=1 timeout 300 "$bin/exl" bench -m /tmp/$m --device cuda --tp $tp -p 2048 -n 128 \
                >"$out/bench_${m}_tp${tp}_p2p.log" 2>&1
            tail -4 "$out/bench_${m}_tp${tp}_p2p.log"
        fi
        echo "-- the same without the collectives (EXL_TP_NO_COMM=1): their cost is the difference"
        EXL_TP_NO_COMM=1 timeout 300 "$bin/exl" bench -m /tmp/$m --device cuda --tp $tp -p 2048 -n 128 \
            >"$out/bench_${m}_tp${tp}_nocomm.log" 2>&1
        tail -4 "$out/bench_${m}_tp${tp}_nocomm.log"
    done
}

split() {
echo "==== 4. --gpu-split with a model larger than one GPU's share (EXL_CUDA_MEMORY_LIMIT=24GiB)"
export EXL_CUDA_MEMORY_LIMIT=24GiB
timeout 300 "$bin/exl" bench -m /tmp/m70b --device cuda -p 512 -n 32 2>&1 | tail -2
timeout 300 "$bin/exl" bench -m /tmp/m70b --device cuda --gpu-split 20,20 -p 512 -n 32 2>&1 | tail -6
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
