#!/usr/bin/env bash
# gpu_moe.sh - on the GPU machine: a mixture of experts of Qwen3-30B-A3B's shape (48 layers, hidden 2048, 32 q / 4 KV
# heads of 128, 128 experts of ffn 768, top 8, vocab 151936) with random EXL2 weights, 4.0 bpw and a 6-bit head:
# decode tok/s at batch 1 and 16 against the bound of the bytes a step reads (the chosen experts', attention,
# routers, head), and prefill tok/s of a 2048-token prompt. `gpu_bench moe` builds the model in memory from one
# random matrix of each shape (seconds; nothing is carried). Three runs: the default (routes and experts on the
# device, decode steps captured as CUDA graphs), EXL_CUDA_GRAPHS=0 (the same launches one by one), and
# EXL_CUDA_MOE_DEVICE=0 (every step's routes read back on the host and each chosen expert's matmuls launched
# apart, never captured: the path before).
# usage (from the repo root): bench/gpu_moe.sh [BIN_DIR]   (default .gpu/bin, as tests/gpu/prepare.sh fills it;
# without it, builds build-gpu here). Logs go to $OUT (default .gpu/out); the table rows are printed at the end.
set -uo pipefail
bin=${1:-.gpu/bin}
out=${OUT:-.gpu/out}
mkdir -p "$out"
if [ ! -x "$bin/gpu_bench" ]; then
    bin=build-gpu
    cmake -S . -B "$bin" -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >"$out/moe_build.log" 2>&1 &&
        cmake --build "$bin" -j"$(nproc)" --target gpu_bench exl_cuda >>"$out/moe_build.log" 2>&1 ||
        { tail -30 "$out/moe_build.log"; exit 1; }
fi
bin=$(cd "$bin" && pwd)
export LD_LIBRARY_PATH="$bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
log=$out/moe.log
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$log"
rc=0
for env in "" EXL_CUDA_GRAPHS=0 EXL_CUDA_MOE_DEVICE=0; do
    echo "==== ${env:-default}" | tee -a "$log"
    env $env timeout 180 "$bin/gpu_bench" moe >>"$log" 2>&1 || rc=$?
done
echo "==== table rows (the first row's header once)"
grep -m1 '^| MoE' "$log"
grep -m1 '^|---' "$log"
grep -E '^\| (device|routes)' "$log"
grep '^moe: load' "$log" | head -1
exit $rc
