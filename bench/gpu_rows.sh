#!/usr/bin/env bash
# gpu_rows.sh - on the GPU machine: decode of 2-16 rows (issue 31; issue 32's verification steps). Correctness
# (test_gpu's "decode 2-16 rows" lines, also with EXL_CUDA_DETERMINISTIC=1), then the per-matrix times of 1-64
# decode rows and their ratio to one row (gpu_bench exl2 --layers 1 --kernels-only) for each configuration of
# KERNEL_CFGS, then whole decode steps of the 32-layer 7B shape (1-32 sequences a step and one sequence's 1-16-row
# verification steps) for each of STEP_CFGS, with the per-matrix times again (so KERNELS=0 loses nothing for the
# configurations STEP_CFGS names). A configuration is "default" or environment settings joined by commas,
# e.g. EXL_CUDA_GEMV_A=1,EXL_CUDA_GEMV_A_ROWS=5; by default both compare the default (CUDA cores up to 4 rows,
# cuda_qmma.cu's three launches from 5: gather, matmul, reduce) with cuda_qmma.cu in one launch
# (EXL_CUDA_QMMA_FUSED=1) and with the head's 5-16 rows on GEMV-A too (EXL_CUDA_QMMA_WIDE_A=1), the matrices also
# with the blocks' own gather only up to 16 rows (EXL_CUDA_QMMA_GATHER_ROWS=16: the gather kernel for 17-64, the
# split sums still fused). r2-rows4's configurations:
# the GEMV with the weights as the mma's A operand (EXL_CUDA_GEMV_A=1; two blocks an SM, or one:
# EXL_CUDA_GEMV_A_BLOCKS_PER_SM=1; from one row: EXL_CUDA_GEMV_A_ROWS=1), the rows-as-A tensor-core GEMV from
# 2 rows (EXL_CUDA_GEMV_MMA_ROWS=2), the RMSNorm in every block only up to 2 rows (EXL_CUDA_GEMV_MMA_NORM_ROWS=2).
# r2-rows6's: cuda_qrows.cu for 5-16 rows in one launch (EXL_CUDA_QROWS=1; its checks: test_gpu's "qrows" lines).
# usage (from the repo root): bench/gpu_rows.sh [DIR]   DIR as tests/gpu/run.sh's (default .gpu: bin/ from
# tests/gpu/prepare.sh, shared/ or staged fixtures); without DIR/bin it builds build-gpu here. TESTS=0, KERNELS=0,
# STEPS=0 skip the three parts (about 3, 1 and 3 minutes on an H100), e.g. to keep a device call under 10 minutes;
# the tests run test_gpu's rows group (EXL_TEST_ONLY, default rows; qmma: only the one-launch checks, seconds);
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
    grep -E "decode 2-16 rows|qmma one launch|qmma split sums|wide matrix|qrows|^FAIL" "$out/rows_test_gpu.log"
    tail -1 "$out/rows_test_gpu.log"
fi
if [ "${TESTS:-1}" != 0 ] && [ "${DET:-1}" != 0 ]; then
    EXL_TEST_ONLY=${EXL_TEST_ONLY:-rows} EXL_CUDA_DETERMINISTIC=1 timeout 300 "$bin/test_gpu" "$dir/shared" >"$out/rows_test_gpu_det.log" 2>&1
    echo "==== test_gpu with EXL_CUDA_DETERMINISTIC=1 (rc $?): the split sums added by the last block"
    grep -E "decode 2-16 rows|qmma one launch|qmma split sums|wide matrix|qrows|^FAIL" "$out/rows_test_gpu_det.log"
    tail -1 "$out/rows_test_gpu_det.log"
fi
kernel_cfgs=${KERNEL_CFGS:-"default EXL_CUDA_QMMA_FUSED=1 EXL_CUDA_QMMA_FUSED=1,EXL_CUDA_QMMA_GATHER_ROWS=16 EXL_CUDA_QMMA_WIDE_A=1"}
[ "${KERNELS:-1}" = 0 ] || for cfg in $kernel_cfgs; do
    [ "$cfg" = default ] && cfg=""
    echo "==== per matrix, ${cfg:-default}"
    tag=${cfg:-default}
    tag=${tag//,/_}
    env ${cfg//,/ } timeout 120 "$bin/gpu_bench" exl2 --layers 1 --kernels-only 2>"$out/rows_kernels_$tag.log" >/dev/null
    grep -E "^  [a-z_]+ [0-9]+x[0-9]+ |as decode rows" "$out/rows_kernels_$tag.log" |
        sed -E 's/ *\| [0-9]+ rows [^|]*//g'
done
step_cfgs=${STEP_CFGS:-"default EXL_CUDA_QMMA_FUSED=1 EXL_CUDA_QMMA_FUSED=1,EXL_CUDA_QMMA_WIDE_A=1"}
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
