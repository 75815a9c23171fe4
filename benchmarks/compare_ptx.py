"""Does a change alter the generated code of the CUDA kernels? Compiles CUDA translation units of two
revisions to PTX (nvcc, no GPU needed) and compares every kernel's PTX after renaming registers and
labels in order of first use, so that a refactor that only moves code between functions reads as
"same" and one that changes what the kernel executes reads as "differs".

    python benchmarks/compare_ptx.py BASE_REV [NEW_REV] [--units decode_mtp_f32 replay_bf16 ...]

NEW_REV defaults to the working tree. A kernel whose PTX is the same compiles to the same machine
code, so its measured speed carries over; one that differs needs the GPU check and a benchmark.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNITS = ["decode_mtp_f32", "decode_mtp_bf16", "decode_mtp_f16", "replay_f32", "replay_bf16",
         "replay_f16"]
NVCC_FLAGS = ["-std=c++20", "-arch=sm_90a", "-DGDN_HAS_CUDA", "--expt-relaxed-constexpr", "-O3",
              "-ptx"]
REGISTER = re.compile(r"%(?:rd|rs|fd|hh|r|f|p|h)\d+|\$L__BB\d+_\d+")


def tree(rev, into):
    """The source tree of `rev` (None: the working tree) under `into`."""
    if rev is None:
        return ROOT
    os.makedirs(into)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def ptx(src, unit, out):
    subprocess.run(["nvcc", *NVCC_FLAGS, "-I", os.path.join(src, "include"),
                    os.path.join(src, "src", "cuda", unit + ".cu"), "-o", out], check=True)
    return out


def kernels(path):
    """Entry name -> PTX body with registers and labels renamed in order of first use."""
    out, name, lines = {}, None, []
    for line in open(path):
        if line.startswith(".visible .entry"):
            if name:
                out[name] = "".join(lines)
            name, lines, names = line.split()[2].split("(")[0], [], {}
        if name is None or line.lstrip().startswith(".reg"):
            continue
        lines.append(REGISTER.sub(lambda m: names.setdefault(m.group(0), f"v{len(names)}"), line))
    if name:
        out[name] = "".join(lines)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--units", nargs="+", default=UNITS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = [tree(args.base, os.path.join(tmp, "base")), tree(args.new, os.path.join(tmp, "new"))]
        jobs = [(t, u, os.path.join(tmp, f"{i}_{u}.ptx")) for i, t in enumerate(trees)
                for u in args.units]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            list(pool.map(lambda j: ptx(*j), jobs))
        differs = 0
        for u in args.units:
            base, new = (kernels(os.path.join(tmp, f"{i}_{u}.ptx")) for i in (0, 1))
            for name in sorted(set(base) | set(new)):
                state = ("same" if base.get(name) == new.get(name)
                         else "only in base" if name not in new
                         else "only in new" if name not in base else "differs")
                differs += state != "same"
                print(f"{u:16} {state:12} {name}")
        print(f"{differs} kernel(s) not the same")
        return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
