#!/bin/bash
# gpu_lora.sh - what LoRA adapters cost the CUDA decode (issue 33's two numbers), on a GPU machine:
#   7B EXL2 (4-bit, random weights of Llama-2-7B's shape) batch-1 greedy decode with a rank-16 adapter on all seven
#   projections vs none (target: overhead <= 10%), and 32 sequences spread over 4 adapters vs 32 with none (target:
#   >= 85% of the no-adapter rate). Prints tests/gpu/gpu_lora_bench.c's markdown table: both cases through each path
#   (the default: one row folded into the GEMVs, 32 uses through the batch path with its shrink beside the matmul;
#   EXL_CUDA_LORA_OVERLAP=0; the lora launches, r2-lora2's paths). The batch-32 case alone: through every path
#   and their logits, bench/gpu_lora.sh DIR -- --only32 2; through the environment's, [EXL_CUDA_LORA_OVERLAP=0] ...
#   --only32 1
#
# usage (from the repo root): bench/gpu_lora.sh [DIR] [-- gpu_lora_bench args: --rank R --layers N --ctx C]
#   DIR (default .gpu): bin/gpu_lora_bench built by tests/gpu/prepare.sh; without it, builds here (build-gpu,
#   EXL_CUDA_ARCHS=${EXL_CUDA_ARCHS:-90}).
set -euo pipefail
dir=.gpu
[ $# -gt 0 ] && [ "$1" != -- ] && dir=$1 && shift
[ "${1:-}" = -- ] && shift
if [ -x "$dir/bin/gpu_lora_bench" ]; then
    bin=$dir/bin
    export LD_LIBRARY_PATH="$bin:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
else
    bin=build-gpu
    cmake -S . -B "$bin" -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >/dev/null
    cmake --build "$bin" -j"$(nproc)" --target gpu_lora_bench exl_cuda >/dev/null
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%d)"
"$bin/gpu_lora_bench" --rank 16 "$@"
