#!/usr/bin/env bash
# gpu_prefill_ppl.sh - what the fp16 prompt path costs in quality on the GPU: `exl perplexity` of tinystories-656k
# (fp32 weights), its GPTQ 4-bit conversion and a random-weight EXL2 5.0 bpw Llama (head_dim 64: the prompt attention
# on tensor cores) on the TinyStories validation text, with the default fp16 prompt matmuls and attention and with
# EXL_CUDA_EXACT_PREFILL=1 (~22 bits), windows of 512 tokens, each one forward step. Prints a table for
# bench/RESULTS.md.
# usage (on the GPU machine, from the repo root): bench/gpu_prefill_ppl.sh [DIR]
#   DIR (default .gpu) as tests/gpu/run.sh takes it: DIR/bin/exl (tests/gpu/prepare.sh) and the fixtures in DIR/shared
#   or its staging folder; without DIR/bin/exl the build-gpu folder's.
set -uo pipefail
dir=${1:-.gpu}
stage=${EXL_GPU_STAGE:-/tmp/exl-gpu-stage}
shared=$dir/shared
[ -d "$shared" ] || shared=$stage/shared
exl=$dir/bin/exl
if [ -x "$exl" ]; then
    export LD_LIBRARY_PATH="$dir/bin:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
else
    exl=build-gpu/exl
fi
text=$shared/data/tinystories_val.txt
ppl() { "$exl" perplexity -m "$shared/models/$1" -f "$text" --device cuda --ctx 512 --stride 512 --max-windows 32 \
    2>/dev/null | sed -n 's/^perplexity: //p'; }
echo "| model | perplexity, fp16 prompts (default) | EXL_CUDA_EXACT_PREFILL=1 | change |"
echo "|---|---|---|---|"
for m in tinystories-656k tinystories-656k-gptq-4bit-g32-actorder-asym rand-llama-exl2-5.0bpw-h8; do
    fast=$(ppl "$m")
    exact=$(EXL_CUDA_EXACT_PREFILL=1 ppl "$m")
    change=$(awk -v a="$fast" -v b="$exact" 'BEGIN { if (b > 0) printf "%+.4f%%", 100 * (a / b - 1); else print "?" }')
    echo "| $m | $fast | $exact | $change |"
done
