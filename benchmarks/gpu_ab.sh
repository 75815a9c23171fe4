#!/usr/bin/env bash
# A/B of decode_mtp builds on one GPU machine, in one run: every source tree named in VARIANTS
# (for example `git archive REV | tar -x -C build/ab/NAME` for each revision) has its extension
# built, all in parallel; then optional tests run on the last tree, and each tree runs the same
# benchmark in turn, PASSES times (default 1; the trees alternate within each pass, so that a
# drift of the machine shows as a disagreement between passes rather than as a change). Prints
# every row's median time per tree (the mean over the passes) and its change against the first
# tree in each pass; JSON and logs go to $OUT.
#
#   VARIANTS="build/ab/base build/ab/new" PASSES=2 \
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

PASSES=${PASSES:-1}
names=()
for tree in "${trees[@]}"; do names+=("$(basename "$tree")"); done
for pass in $(seq 1 "$PASSES"); do
  # Pass 1 keeps the names of a single-pass run; later passes add their number.
  suffix=$([ "$pass" = 1 ] && echo "" || echo "_p$pass")
  for tree in "${trees[@]}"; do
    name=$(basename "$tree")
    # shellcheck disable=SC2086
    (cd "$tree" && PYTHONPATH=build/gpu/pkg python3 benchmarks/bench_decode_mtp.py ${BENCH_ARGS:-} \
       --json "$OUT/bench_$name$suffix.json" --png /dev/null > "$OUT/bench_$name$suffix.log" 2>&1
     echo "bench $name pass $pass exit $?")
  done
done

python3 - "$OUT" "$PASSES" "${names[@]}" <<'PY'
import json
import sys

out, passes, names = sys.argv[1], int(sys.argv[2]), sys.argv[3:]


def load(name, p):
    suffix = "" if p == 1 else f"_p{p}"
    try:
        results = json.load(open(f"{out}/bench_{name}{suffix}.json"))["results"]
    except (OSError, ValueError, KeyError):
        results = []
    return {(r["impl"], r.get("shape", "TP1"), r["state"], r["T"], r["B"], r.get("split")):
            r["us"] for r in results if "us" in r}


runs = {name: [load(name, p) for p in range(1, passes + 1)] for name in names}
base = runs[names[0]]


def mean(name, key):
    times = [run[key] for run in runs[name] if key in run]
    return sum(times) / len(times) if times else None


def changes(name, key):
    per_pass = [f"{(run[key] / ref[key] - 1) * 100:+.1f}" if key in run and key in ref else "-"
                for run, ref in zip(runs[name], base)]
    return "-" if set(per_pass) == {"-"} else "/".join(per_pass) + "%"


print("impl shape state T B split | " + " ".join(f"{n:>10}" for n in names)
      + f" | change against {names[0]}" + (" (pass 1 / pass 2 / ...)" if passes > 1 else ""))
for key in sorted(base[0], key=lambda k: (*k[:5], k[5] or 0)):
    cells = " ".join(f"{t:10.2f}" if t else f"{'-':>10}" for t in (mean(n, key) for n in names))
    print(*key, "|", cells, "|", " ".join(changes(n, key) for n in names[1:]))
PY
