#!/usr/bin/env bash
# Where the decode_mtp kernel's warps wait, per SASS instruction: builds the extension, then for
# each configuration profiles one launch with Nsight Compute (SourceCounters and the usual
# sections) and writes its source page (per instruction: instructions executed and warp-stall
# samples by reason; columns "Instructions Executed", "Warp Stall Sampling (All Samples)") as CSV
# and its sections as text to $OUT. Grouping the instructions by how often they run per head
# separates the token loops from per-chunk and per-warp code.
#
#   CONFIGS="replay_b8_t4_fp32=--impl replay --B 8 --T 4 --state fp32" OUT=/tmp/prof \
#     benchmarks/profile_source.sh
#
# Environment: OUT (default ./profile_out), JOBS (16), GDN_CUDA_ARCHITECTURES (90a), CONFIGS
# (';'-separated NAME=profile_decode_mtp.py arguments), SKIP_BUILD (1: use build/gpu as it is),
# EXTRA_SECTIONS (more ncu sections, e.g. "ComputeWorkloadAnalysis MemoryWorkloadAnalysis_Tables"
# for the pipes' and shared memory's utilisation).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-$root/profile_out}
JOBS=${JOBS:-16}
ARCHS=${GDN_CUDA_ARCHITECTURES:-90a}
BUILD=$root/build/gpu
CONFIGS=${CONFIGS:-"replay_b8_t4_fp32=--impl replay --B 8 --T 4 --state fp32"}
mkdir -p "$OUT"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  GDN_BUILD_JOBS=$JOBS scripts/dev_build.sh "$BUILD" -DGDN_ENABLE_CUDA=ON -DGDN_BUILD_TESTS=OFF \
    -DGDN_CUDA_ARCHITECTURES="$ARCHS" -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" > /tmp/profile_build.log \
    2>&1 || { tail -20 /tmp/profile_build.log; exit 1; }
fi
export PYTHONPATH=$BUILD/pkg${PYTHONPATH:+:$PYTHONPATH}
IFS=';' read -r -a cfgs <<< "$CONFIGS"
extra=()
for sec in ${EXTRA_SECTIONS:-}; do extra+=(--section "$sec"); done
for entry in "${cfgs[@]}"; do
  name=${entry%%=*}
  args=${entry#*=}
  rep=/tmp/profile_$name
  echo "--- $name: $args"
  # shellcheck disable=SC2086
  timeout 120 ncu --clock-control none -k regex:decode_mtp_kernel --launch-skip 2 --launch-count 1 --import-source yes \
    --section SourceCounters --section SpeedOfLight --section LaunchStats --section Occupancy \
    --section WarpStateStats --section SchedulerStats "${extra[@]}" -f -o "$rep" \
    python3 benchmarks/profile_decode_mtp.py $args 2>&1 | grep -vE "^==PROF==|^\s*$" | tail -3
  ncu -i "$rep.ncu-rep" --page source --print-source sass --csv > "$OUT/src_$name.csv" 2>&1
  ncu -i "$rep.ncu-rep" --page source --print-source cuda,sass --csv > "$OUT/srcmix_$name.csv" 2>&1
  ncu -i "$rep.ncu-rep" --page details > "$OUT/details_$name.txt" 2>&1
  grep -E "Duration|DRAM Throughput|Issued Warp Per Scheduler|Achieved Occupancy|Registers Per|Block Limit (Reg|Shared)" \
    "$OUT/details_$name.txt" | sed -E "s/ +/ /g"
  wc -l "$OUT/src_$name.csv"
done
