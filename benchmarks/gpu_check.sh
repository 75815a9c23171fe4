#!/usr/bin/env bash
# One script for a GPU machine (H200): build the extension and the C++ tests, run ctest (labels gpu
# and cpu) and the whole pytest suite, run compute-sanitizer (memcheck, racecheck) on the decode_mtp
# and replay GPU tests, the demo in both state modes, then the decode_mtp and host-overhead benchmarks,
# and an Nsight Compute reading of four configurations (profile). Logs, results JSON and plot go to
# $OUT. The key logs of the last full check live in benchmarks/results/gpu_check/ (build, test,
# sanitize, demo, bench, host_overhead logs): a new full check replaces them, and its
# decode_mtp_h200.json and host_overhead_*.json replace those in benchmarks/results/.
#
#   STAGES="build test bench demo sanitize profile" benchmarks/gpu_check.sh     (default: all six)
#   BENCH_ARGS="--quick --sweep-split" STAGES="build bench" benchmarks/gpu_check.sh
#
# The whole check takes about 10 minutes on an H200 machine (build 50 s, tests 220 s, sanitizers
# 310 s one after another, 132 s four at a time; full benchmark matrix with FLA
# 60-200 s). Where one command may run for at most 10 minutes, run it as two:
# STAGES="build test demo sanitize", then STAGES="build bench"; or as one with the quick matrix,
# BENCH_ARGS="--quick --budget 60" (every stage but profile: 514-578 s on an H200 machine, and
# past 600 s once, when the build took 137 s: the host-overhead runs at the end were cut off).
#
# Environment: OUT (default ./gpu_out), JOBS (16), GDN_CUDA_ARCHITECTURES (90a), GDN_GIT_SHA (pass it
# when the copy of the tree on the GPU machine has no .git)
# (recorded in the results), BENCH_ARGS, PYTEST_ARGS (default tests/py), PYTEST_TIMEOUT (400 s),
# SANITIZE_TIMEOUT (300 s per run: four at once, the longest (memcheck of the ratio-8 replay chains)
# ran past 120 s; alone it takes 70 s), SANITIZE_JOBS (4 runs at once), SANITIZE_PYTEST (1: also the
# pytest selections),
# PROFILE_CONFIGS (';'-separated profile_decode_mtp.py arguments). GoogleTest comes from .deps/gtest (scripts/stage_gtest.sh)
# when the system has none; Python wheels in .whl (e.g. fla-core, einops) are installed into a
# private directory for the benchmark's baseline.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
STAGES=${STAGES:-"build test bench demo sanitize profile"}
OUT=${OUT:-$root/gpu_out}
JOBS=${JOBS:-16}
ARCHS=${GDN_CUDA_ARCHITECTURES:-90a}
BUILD=$root/build/gpu
mkdir -p "$OUT"
export GDN_GIT_SHA=${GDN_GIT_SHA:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}
export PYTHONUNBUFFERED=1
status=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
stage() { echo "=== $1 ($(date +%T))"; }

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gdn_site .whl/*.whl && export PYTHONPATH=/tmp/gdn_site${PYTHONPATH:+:$PYTHONPATH}
fi
gtest_args=()
if [ -d .deps/gtest ]; then
  gtest_args=(-DGTest_DIR="$root/.deps/gtest/lib/x86_64-linux-gnu/cmake/GTest")
fi

if has build; then
  stage build
  {
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    nvcc --version | tail -2
    time (GDN_BUILD_JOBS=$JOBS scripts/dev_build.sh "$BUILD" -DGDN_ENABLE_CUDA=ON \
      -DGDN_CUDA_ARCHITECTURES="$ARCHS" -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" "${gtest_args[@]}")
  } > "$OUT/build.log" 2>&1 || { status=1; echo "build FAILED"; }
  grep -E "error|FAILED|PYTHONPATH|^real" "$OUT/build.log" | grep -v "nodiscard" | tail -20
fi
export PYTHONPATH=$BUILD/pkg${PYTHONPATH:+:$PYTHONPATH}

if has test; then
  stage test
  {
    ctest --test-dir "$BUILD" -L "gpu|cpu" --output-on-failure -j "$JOBS" --no-tests=error
    echo "ctest exit $?"
    # The GPU test binary directly as well (independent of ctest's test discovery).
    "$BUILD/tests/cpp/gdn_gpu_tests" --gtest_brief=1
    echo "gtest-gpu exit $?"
    xdist=()
    python3 -c "import xdist" 2>/dev/null && xdist=(-n 12)
    # shellcheck disable=SC2086
    OMP_NUM_THREADS=2 timeout "${PYTEST_TIMEOUT:-400}" python3 -m pytest ${PYTEST_ARGS:-tests/py} \
      -q -rs "${xdist[@]}" -p no:cacheprovider
    echo "pytest exit $?"
  } > "$OUT/test.log" 2>&1
  grep -qE "^gtest-gpu exit 0$" "$OUT/test.log" && grep -qE "^pytest exit 0$" "$OUT/test.log" || status=1
  grep -E "tests passed|tests failed|passed|failed|error|exit [0-9]" "$OUT/test.log" | tail -15
fi

if has bench; then
  stage bench
  # shellcheck disable=SC2086
  python3 benchmarks/bench_decode_mtp.py ${BENCH_ARGS:-} --json "$OUT/decode_mtp_h200.json" \
    --png "$OUT/decode_mtp_h200.png" > "$OUT/bench.log" 2>&1 || status=1
  tail -n 60 "$OUT/bench.log"
  # prefill and conv prefill against FLA's chunked layer call and a copy of the conv's bytes.
  python3 benchmarks/bench_prefill.py --conv --json "$OUT/prefill_h200.json" > "$OUT/bench_prefill.log" 2>&1 ||
    status=1
  tail -n 30 "$OUT/bench_prefill.log"
  # Host cost of one eager call (function, torch op, binding) next to x.add_(1).
  python3 benchmarks/bench_host_overhead.py --device cuda --json "$OUT/host_overhead_h200.json" \
    > "$OUT/host_overhead.log" 2>&1 || status=1
  tail -n 20 "$OUT/host_overhead.log"
  # The same with the torch ops' Python kernels (what a torch the library was not built for gets).
  GDN_TORCH_OP_KERNELS=python python3 benchmarks/bench_host_overhead.py --device cuda \
    --json "$OUT/host_overhead_python_kernels_h200.json" > "$OUT/host_overhead_python.log" 2>&1 ||
    status=1
  grep -E "torch.ops" "$OUT/host_overhead_python.log" | head -6
fi

if has demo; then
  stage demo
  {
    for flags in "" "--graphs" "--state-mode replay" "--state-mode replay --graphs"; do
      echo "--- python -m gdn demo --device cuda $flags"
      python3 -m gdn demo --device cuda $flags --no-progress
      echo "demo${flags:+ $flags} exit $?"
    done
  } > "$OUT/demo.log" 2>&1
  grep -E "speculative  :|speed-up|acceptance|time, spec|PASS|FAIL|exit [0-9]" "$OUT/demo.log"
  grep -qE "exit [1-9]" "$OUT/demo.log" && status=1
fi

if has sanitize; then
  stage sanitize
  # Each run in the background, SANITIZE_JOBS at a time (the tools are bound by the CPU: run one
  # after another they took 310 s), each with its own log; sanitize.log gets them in this order.
  # SANITIZE_JOBS=1 runs them one after another, as before.
  san_jobs=${SANITIZE_JOBS:-4}
  san_threads=$((JOBS / san_jobs > 0 ? JOBS / san_jobs : 1))  # each run's share of the CPUs
  runs_dir=$OUT/sanitize_runs
  rm -rf "$runs_dir" && mkdir -p "$runs_dir"
  runs=0
  # sanitize_run LABEL TOOL TAIL COMMAND...: one compute-sanitizer run, "LABEL exit N" at its end.
  sanitize_run() {
    local label=$1 tool=$2 lines=$3
    shift 3
    runs=$((runs + 1))
    while [ "$(jobs -rp | wc -l)" -ge "$san_jobs" ]; do sleep 1; done
    {
      echo "--- compute-sanitizer --tool $tool ($label: ${*: -1})"
      OMP_NUM_THREADS=$san_threads timeout "${SANITIZE_TIMEOUT:-300}" compute-sanitizer \
        --tool "$tool" --error-exitcode 3 "$@" 2>&1 | tail -"$lines"
      echo "$label exit ${PIPESTATUS[0]}"
    } > "$runs_dir/$(printf %02d $runs).log" 2>&1 &
  }
  # memcheck on every device test (one of the long replay chains); racecheck where shared memory
  # is used (the decode_mtp kernel, also in replay mode and replay's closed form).
  # The prefill kernels' shared tiles: racecheck on their checkpoint and invalid-row cases.
  for run in "memcheck:*:-*ReplayCudaChain*" "memcheck:*ReplayCudaChain*r8*" \
             "racecheck:*DecodeMtp*:*ReplayCuda.*" "racecheck:*ReplayCudaChain*closed_form*3_steps*" \
             "racecheck:*PrefillCuda.Checkpoints*:*PrefillCuda.Invalid*:*GpuConvPrefill*"; do
    tool=${run%%:*}
    sanitize_run "$tool" "$tool" 25 "$BUILD/tests/cpp/gdn_gpu_tests" --gtest_brief=1 \
      --gtest_filter="${run#*:}"
  done
  if [ "${SANITIZE_PYTEST:-1}" = 1 ]; then
    pytest_q=(python3 -m pytest -q -p no:cacheprovider)
    # Device-index, strided, paged and large-batch cases, the split launches, replay, the 16-bit
    # closed form (FMA and tensor cores) and token-by-token replay with 4 rows per lane (r2 of each
    # state dtype).
    sanitize_run pytest-memcheck memcheck 8 "${pytest_q[@]}" tests/py/test_decode_mtp_cuda.py \
      tests/py/test_replay.py -k "hostile or large_batch or strided_views or split_launch \
      or padded_but_aligned \
      or (replay and cuda) \
      or (head_per_sm and token_by_token and state_bf16 and r2) or (four_rows and r2 and act_bf16) \
      or (head_per_sm and (closed_form or tensor_cores) and (state_bf16 or state_fp16) and r2)"
    # The closed form of a 16-bit state on tensor cores (its fragments replace the solve's arrays),
    # bf16 and fp16, at six and at eight CTAs per SM.
    sanitize_run pytest-racecheck-tensor-cores racecheck 4 "${pytest_q[@]}" tests/py/test_replay.py \
      -k "head_per_sm and tensor_cores and (state_bf16 or state_fp16) and r2"
    # The plain-load path where bulk copies would stream through one chunk buffer (fp32 replay,
    # "kv" layout, 4+ heads per SM): the launcher must give it two.
    sanitize_run pytest-racecheck racecheck 4 "${pytest_q[@]}" tests/py/test_replay.py \
      -k "kv_layout and cuda and not four_rows"
    # 16-bit token-by-token replay in its staged-first image (one and four heads per SM).
    sanitize_run pytest-racecheck-staged-first racecheck 4 "${pytest_q[@]}" tests/py/test_replay.py \
      -k "head_per_sm and token_by_token and state_bf16 and r2"
    # Write-all heads split over clustered CTAs (2 and 4 per head, the norm's partials exchanged).
    sanitize_run pytest-racecheck-split racecheck 4 "${pytest_q[@]}" \
      tests/py/test_decode_mtp_cuda.py -k "split_launch and state_fp32"
  fi
  wait
  cat "$runs_dir"/*.log > "$OUT/sanitize.log"
  grep -E "ERROR SUMMARY|RACECHECK SUMMARY|exit [0-9]|passed|failed" "$OUT/sanitize.log"
  grep -qE "exit [1-9]" "$OUT/sanitize.log" && status=1
  [ "$(grep -cE "exit [0-9]" "$OUT/sanitize.log")" = "$runs" ] || status=1  # every run reported
fi

if has profile; then
  stage profile
  {
    IFS=';' read -r -a cfgs <<< "${PROFILE_CONFIGS:---B 128 --T 1 --state fp32;--B 1 --T 1 --state fp32;--B 128 --T 4 --state bf16;--impl replay --B 128 --T 4 --state fp32}"
    for cfg in "${cfgs[@]}"; do
      echo "--- ncu decode_mtp kernels $cfg"
      # shellcheck disable=SC2086
      timeout 60 ncu --clock-control none -k "regex:write_all_kernel|replay_(tokens|closed_form)_kernel" \
        --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section SchedulerStats --section MemoryWorkloadAnalysis \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 benchmarks/profile_decode_mtp.py $cfg 2>&1 | grep -vE "^==PROF==|^\s*$"
    done
    echo "--- ncu FLA fused_recurrent (dense) --B 128 --T 1 --state fp32"
    timeout 90 ncu --clock-control none -k regex:fused_recurrent --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section WarpStateStats \
      python3 benchmarks/profile_decode_mtp.py --impl fla --B 128 --T 1 2>&1 | grep -vE "^==PROF==|^\s*$"
  } > "$OUT/ncu.txt" 2>&1
  # The headline figures, and the stall reasons that cost at least 0.5 cycles per issued instruction.
  grep -E "^---|Duration|DRAM Throughput|Compute \(SM\) Throughput|Issued Warp Per Scheduler|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|Block Limit (Reg|Shared)" "$OUT/ncu.txt" |
    sed -E "s/ +/ /g"
  awk '/^---/{print} /issue_stalled_/ && $NF >= 0.5 {sub(/smsp__average_warps_issue_stalled_/, ""); sub(/_per_issue_active.ratio/, ""); print "  stall", $1, $NF}' "$OUT/ncu.txt"
fi
stage "done (status $status)"
exit $status
