#!/bin/bash
# run.sh - the CUDA backend's tests and benchmarks, in one command on a GPU machine.
#
# usage (from the repo root): tests/gpu/run.sh [--stage] [DIR]
#   DIR (default .gpu) holds shared/ or fixtures-N.tar.gz parts (fixtures: models/ and reference/ as in ../shared,
#   packed by prepare.sh), which are unpacked into $EXL_GPU_STAGE (default /tmp/exl-gpu-stage) and kept there for
#   later calls on the same machine; --stage only unpacks the parts given and exits. DIR also holds
#   optionally bin/ (programs built elsewhere by tests/gpu/prepare.sh). Without bin/ it
#   builds here (cmake, EXL_CUDA_ARCHS=${EXL_CUDA_ARCHS:-90}).
# Logs go to $OUT (or DIR/out); the last lines are a summary. BENCH_ARGS passes arguments
# to gpu_bench (e.g. "exl2 --layers 8").
set -uo pipefail
stage_only=0
[ "${1:-}" = --stage ] && stage_only=1 && shift
dir=${1:-.gpu}
out=${OUT:-$dir/out}
mkdir -p "$out"
stage=${EXL_GPU_STAGE:-/tmp/exl-gpu-stage}
for part in "$dir"/fixtures-*.tar.gz; do
    [ -f "$part" ] || continue
    mkdir -p "$stage" && tar xzf "$part" -C "$stage" && echo "staged $part"
done
[ $stage_only -eq 1 ] && exit 0
[ -d "$dir/shared" ] || [ ! -d "$stage/shared" ] || ln -s "$stage/shared" "$dir/shared"
if [ -x "$dir/bin/test_gpu" ]; then
    bin=$dir/bin
    export LD_LIBRARY_PATH="$bin:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
else
    bin=build-gpu
    cmake -S . -B "$bin" -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >"$out/build.log" 2>&1 &&
        cmake --build "$bin" -j"$(nproc)" --target test_gpu gpu_bench exl_cuda >>"$out/build.log" 2>&1 ||
        { tail -30 "$out/build.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"

timeout 300 "$bin/test_gpu" "$dir/shared" >"$out/test_gpu.log" 2>&1
test_rc=$?
# again with every many-row quantized matmul through the weights decoded for cuBLAS (the
# fixtures' prompts are shorter than the default threshold)
EXL_CUDA_DEQUANT_ROWS=1 timeout 300 "$bin/test_gpu" "$dir/shared" >"$out/test_gpu_dequant.log" 2>&1
dequant_rc=$?
# and with prompts' attention on CUDA cores (the kernel used below sm_80 and for head_dim 256),
# and the decode GEMV's split sums added in a fixed order
EXL_CUDA_PREFILL_ATTENTION=fp32 EXL_CUDA_DETERMINISTIC=1 timeout 300 "$bin/test_gpu" "$dir/shared" >"$out/test_gpu_fp32_attention.log" 2>&1
fp32att_rc=$?
timeout 420 "$bin/gpu_bench" ${BENCH_ARGS:-} >"$out/bench.log" 2>"$out/bench_detail.log"
bench_rc=$?
# the same decode without CUDA graphs (every op launched singly), for comparison
EXL_CUDA_GRAPHS=0 timeout 120 "$bin/gpu_bench" exl2 >"$out/bench_nographs.log" 2>/dev/null
# prefill with the ~22-bit prompt path (EXL_CUDA_EXACT_PREFILL=1) against the default fp16 one, in the same call
EXL_CUDA_EXACT_PREFILL=1 timeout 180 "$bin/gpu_bench" exl2 --prefill-only >"$out/bench_exact_prefill.log" 2>/dev/null

echo "==== test_gpu (rc $test_rc): failures and skips"
grep -E "^(FAIL|SKIP)" "$out/test_gpu.log" | head -40
grep -E "^ok .*(logits|decode token|decode 2-16 rows ==|GPU vs CPU)" "$out/test_gpu.log"
grep -c "^ok   moe" "$out/test_gpu.log" | sed 's/^/mixture-of-experts op checks passed: /'
grep -E "speculative" "$out/test_gpu.log"
tail -1 "$out/test_gpu.log"
echo "==== test_gpu with EXL_CUDA_DEQUANT_ROWS=1 (rc $dequant_rc)"
grep -E "^(FAIL|SKIP)" "$out/test_gpu_dequant.log" | head -40
grep -E "^ok .*logits" "$out/test_gpu_dequant.log"
tail -1 "$out/test_gpu_dequant.log"
echo "==== test_gpu with EXL_CUDA_PREFILL_ATTENTION=fp32 EXL_CUDA_DETERMINISTIC=1 (rc $fp32att_rc)"
grep -E "^(FAIL|SKIP)" "$out/test_gpu_fp32_attention.log" | head -40
grep -E "^ok .*attention prefill" "$out/test_gpu_fp32_attention.log"
tail -1 "$out/test_gpu_fp32_attention.log"
echo "==== gpu_bench (rc $bench_rc)"
cat "$out/bench_detail.log" | tail -30
cat "$out/bench.log"
echo "without CUDA graphs:"
tail -1 "$out/bench_nographs.log"
echo "prefill with EXL_CUDA_EXACT_PREFILL=1:"
tail -1 "$out/bench_exact_prefill.log"
echo "whole decode steps of 1-16 sequences and verification steps of 1-16 rows (ratio to one row):"
grep -E "decode steps of|verification steps" "$out/bench_detail.log"
[ $test_rc -eq 0 ] && [ $dequant_rc -eq 0 ] && [ $fp32att_rc -eq 0 ] && [ $bench_rc -eq 0 ]
