#!/usr/bin/env bash
# Tuning sweep of decode_mtp's compile-time knobs on a GPU machine: for each variant
# "MAXNREG:PREFETCH" (register cap per thread : load the next head's state while computing), build
# the module and time the quick benchmark matrix with every head split. Results to $OUT.
#
#   VARIANTS="128:1 128:0 80:0 64:0" benchmarks/tune_decode_mtp.sh
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
OUT=${OUT:-$root/gpu_out}
JOBS=${JOBS:-16}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 GDN_GIT_SHA=${GDN_GIT_SHA:-$(git rev-parse --verify -q HEAD 2>/dev/null || echo unknown)}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gdn_site .whl/*.whl && export PYTHONPATH=/tmp/gdn_site${PYTHONPATH:+:$PYTHONPATH}
fi
base_path=${PYTHONPATH:-}
for v in ${VARIANTS:-"128:1 128:0 80:0 64:0"}; do
  nreg=${v%%:*}
  pre=${v##*:}
  build=$root/build/tune_${nreg}_${pre}
  echo "=== variant maxnreg=$nreg prefetch_next=$pre ($(date +%T))"
  GDN_BUILD_JOBS=$JOBS scripts/dev_build.sh "$build" -DGDN_ENABLE_CUDA=ON -DGDN_BUILD_TESTS=OFF \
    -DGDN_CUDA_ARCHITECTURES=90a -DCMAKE_CUDA_ARCHITECTURES=90a \
    "-DCMAKE_CUDA_FLAGS=-DGDN_DECODE_MTP_MAXNREG=$nreg -DGDN_DECODE_MTP_PREFETCH_NEXT=$pre" \
    > "$OUT/tune_build_${nreg}_${pre}.log" 2>&1 || { echo "build failed"; tail -20 "$OUT/tune_build_${nreg}_${pre}.log"; continue; }
  PYTHONPATH=$build/pkg${base_path:+:$base_path} python3 benchmarks/bench_decode_mtp.py --quick \
    --sweep-split ${TUNE_BENCH_ARGS:-} --json "$OUT/tune_${nreg}_${pre}.json" --png /dev/null \
    > "$OUT/tune_${nreg}_${pre}.log" 2>&1
  grep -E "T=1 B=  1|T=1 B=128|T=4 B=  8|T=4 B=128" "$OUT/tune_${nreg}_${pre}.log" | head -60
done
