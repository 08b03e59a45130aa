#!/usr/bin/env bash
# gpu_rows.sh - on the GPU machine: decode of 2-16 rows (issue 31; issue 32's verification steps). Correctness
# (test_gpu's "decode 2-16 rows" lines, also with EXL_CUDA_DETERMINISTIC=1), then the per-matrix times of 1-64
# decode rows and their ratio to one row (gpu_bench exl2 --layers 1 --kernels-only) for each configuration of
# KERNEL_CFGS, then whole decode steps of the 32-layer 7B shape (1-32 sequences a step and one sequence's 1-16-row
# verification steps) for each of STEP_CFGS, with the per-matrix times again (so KERNELS=0 loses nothing for the
# configurations STEP_CFGS names). A configuration is "default" or environment settings joined by commas; by default
# the kernels compare the default (CUDA cores up to 4 rows, cuda_qmma.cu's three launches from 5: gather, matmul,
# reduce; the head's 5-16 rows on GEMV-A) with the head kept on cuda_qmma.cu (EXL_CUDA_QMMA_WIDE_A=0), and the steps
# run the default. The variants measured and removed (the rows-as-m16 tensor-core GEMV, GEMV-A for every matrix,
# cuda_qmma.cu in one launch) are in bench/LOG.md.
# r2-rows6's: cuda_qrows.cu for 5-16 rows in one launch (EXL_CUDA_QROWS=1; its checks: test_gpu's "qrows" lines).
# usage (from the repo root): bench/gpu_rows.sh [DIR]   DIR as tests/gpu/run.sh's (default .gpu: bin/ from
# tests/gpu/prepare.sh, shared/ or staged fixtures); without DIR/bin it builds build-gpu here. TESTS=0, KERNELS=0,
# STEPS=0 skip the three parts (about 3, 1 and 3 minutes on an H100), e.g. to keep a device call under 10 minutes;
# the tests run test_gpu's rows group (EXL_TEST_ONLY, default rows; wide: only the head's GEMV-A checks, seconds);
# DET=0 skips the tests' second run (EXL_CUDA_DETERMINISTIC=1); STEP_ARGS: more gpu_bench arguments for the steps
# (e.g. --layers 8 for a shorter A/B); GPU_BENCH_REPS=N (gpu_bench's) shortens the per-matrix times (no prompt rows).
set -uo pipefail
dir=${1:-.gpu}
out=${OUT:-$dir/out}
mkdir -p "$out"
stage=${EXL_GPU_STAGE:-/tmp/exl-gpu-stage}
[ -d "$dir/shared" ] || [ ! -d "$stage/shared" ] || ln -s "$stage/shared" "$dir/shared"
if [ -x "$dir/bin/gpu_bench" ]; then
    bin=$dir/bin
    export LD_LIBRARY_PATH="$bin:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
else
    bin=build-gpu
    cmake -S . -B "$bin" -DEXL_CUDA=ON -DEXL_CUDA_ARCHS="${EXL_CUDA_ARCHS:-90}" >"$out/rows_build.log" 2>&1 &&
        cmake --build "$bin" -j"$(nproc)" --target test_gpu gpu_bench exl_cuda >>"$out/rows_build.log" 2>&1 ||
        { tail -30 "$out/rows_build.log"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
git log -1 --format='commit %h %cd' 2>/dev/null
if [ "${TESTS:-1}" != 0 ]; then
    EXL_TEST_ONLY=${EXL_TEST_ONLY:-rows} timeout 300 "$bin/test_gpu" "$dir/shared" >"$out/rows_test_gpu.log" 2>&1
    echo "==== test_gpu (rc $?): decode of 2-16 rows against one row"
    grep -E "decode 2-16 rows|wide matrix|qrows|^FAIL" "$out/rows_test_gpu.log"
    tail -1 "$out/rows_test_gpu.log"
fi
if [ "${TESTS:-1}" != 0 ] && [ "${DET:-1}" != 0 ]; then
    EXL_TEST_ONLY=${EXL_TEST_ONLY:-rows} EXL_CUDA_DETERMINISTIC=1 timeout 300 "$bin/test_gpu" "$dir/shared" >"$out/rows_test_gpu_det.log" 2>&1
    echo "==== test_gpu with EXL_CUDA_DETERMINISTIC=1 (rc $?): the split sums added by the last block"
    grep -E "decode 2-16 rows|wide matrix|qrows|^FAIL" "$out/rows_test_gpu_det.log"
    tail -1 "$out/rows_test_gpu_det.log"
fi
kernel_cfgs=${KERNEL_CFGS:-"default EXL_CUDA_QMMA_WIDE_A=0"}
[ "${KERNELS:-1}" = 0 ] || for cfg in $kernel_cfgs; do
    [ "$cfg" = default ] && cfg=""
    echo "==== per matrix, ${cfg:-default}"
    tag=${cfg:-default}
    tag=${tag//,/_}
    env ${cfg//,/ } timeout 120 "$bin/gpu_bench" exl2 --layers 1 --kernels-only 2>"$out/rows_kernels_$tag.log" >/dev/null
    grep -E "^  [a-z_]+ [0-9]+x[0-9]+ |as decode rows" "$out/rows_kernels_$tag.log" |
        sed -E 's/ *\| [0-9]+ rows [^|]*//g'
done
step_cfgs=${STEP_CFGS:-default}
[ "${STEPS:-1}" = 0 ] || for cfg in $step_cfgs; do
    [ "$cfg" = default ] && cfg=""
    echo "==== whole decode steps, 32 layers, ${cfg:-default}"
    tag=${cfg:-default}
    tag=${tag//,/_}
    env ${cfg//,/ } timeout 240 "$bin/gpu_bench" exl2 --kernels-only ${STEP_ARGS:-} 2>"$out/rows_steps_$tag.log" \
        >/dev/null
    grep -E "^  [a-z_]+ [0-9]+x[0-9]+ |as decode rows|decode steps|verification steps" "$out/rows_steps_$tag.log" |
        sed -E 's/ *\| [0-9]+ rows [^|]*//g'
done
