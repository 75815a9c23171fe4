#!/usr/bin/env bash
# A/B of decode_mtp builds on one GPU machine, in one run: every source tree named in VARIANTS
# (for example `git archive REV | tar -x -C build/ab/NAME` for each revision) has its extension
# built, all in parallel; then optional tests run on the last tree, and each tree runs the same
# benchmark in turn. Prints every row's median time per tree and its change against the first
# tree; JSON and logs go to $OUT.
#
#   VARIANTS="build/ab/base build/ab/new" \
#   BENCH_ARGS="--quick --no-fla --tokens 2 4 8 --batches 1 8 32 128" \
#   TEST_ARGS="tests/py/test_replay.py" OUT=/tmp/ab benchmarks/gpu_ab.sh
#
# The benchmark arguments must be ones every tree's bench_decode_mtp.py accepts.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
VARIANTS=${VARIANTS:?"VARIANTS: the source trees to compare, first is the baseline"}
OUT=${OUT:-$root/ab_out}
JOBS=${JOBS:-16}
ARCHS=${GDN_CUDA_ARCHITECTURES:-90a}
mkdir -p "$OUT"
read -r -a trees <<< "$VARIANTS"
per_build=$(( JOBS / ${#trees[@]} > 0 ? JOBS / ${#trees[@]} : 1 ))

for tree in "${trees[@]}"; do
  name=$(basename "$tree")
  (cd "$tree" && GDN_BUILD_JOBS=$per_build scripts/dev_build.sh build/gpu -DGDN_ENABLE_CUDA=ON \
     -DGDN_BUILD_TESTS=OFF -DGDN_CUDA_ARCHITECTURES="$ARCHS" -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
     > "$OUT/build_$name.log" 2>&1; echo "build $name exit $?") &
done
wait

if [ -n "${TEST_ARGS:-}" ]; then
  last=${trees[-1]}
  xdist=()  # the CUDA test files take minutes on one process
  python3 -c "import xdist" 2>/dev/null && xdist=(-n 12)
  # Two CPU threads per worker, as gpu_check.sh (its whole suite: 100 s on an H200 machine). With
  # torch's default thread count twelve workers oversubscribe the CPUs: test_replay.py alone had run
  # 36 of its 90 tests after 180 s.
  # shellcheck disable=SC2086
  (cd "$last" && OMP_NUM_THREADS=2 PYTHONPATH=build/gpu/pkg timeout "${TEST_TIMEOUT:-300}" \
     python3 -m pytest -q -p no:cacheprovider "${xdist[@]}" $TEST_ARGS > "$OUT/test.log" 2>&1
   rc=$?  # before any command substitution, which would reset $?
   echo "test ${last##*/} exit $rc")
  tail -n 3 "$OUT/test.log"
fi

names=()
for tree in "${trees[@]}"; do
  name=$(basename "$tree")
  names+=("$name")
  # shellcheck disable=SC2086
  (cd "$tree" && PYTHONPATH=build/gpu/pkg python3 benchmarks/bench_decode_mtp.py ${BENCH_ARGS:-} \
     --json "$OUT/bench_$name.json" --png /dev/null > "$OUT/bench_$name.log" 2>&1
   echo "bench $name exit $?")
done

python3 - "$OUT" "${names[@]}" <<'PY'
import json
import sys

out, names = sys.argv[1], sys.argv[2:]
runs = {}
for name in names:
    try:
        results = json.load(open(f"{out}/bench_{name}.json"))["results"]
    except (OSError, ValueError, KeyError):
        results = []
    runs[name] = {(r["impl"], r.get("shape", "TP1"), r["state"], r["T"], r["B"], r.get("split")):
                  r["us"] for r in results if "us" in r}
base = runs[names[0]]
print("impl shape state T B split | " + " ".join(f"{n:>10}" for n in names)
      + f" | change against {names[0]}")
for key in sorted(base, key=lambda k: (*k[:5], k[5] or 0)):
    times = [runs[n].get(key) for n in names]
    cells = " ".join(f"{t:10.2f}" if t else f"{'-':>10}" for t in times)
    change = " ".join(f"{(t / base[key] - 1) * 100:+6.1f}%" if t else "     -" for t in times[1:])
    print(*key, "|", cells, "|", change)
PY
