"""Does a change alter the generated code of the CUDA kernels? Compiles CUDA translation units of two
revisions to PTX (nvcc, no GPU needed) and compares every kernel's PTX after renaming registers and
labels in order of first use, so that a refactor that only moves code between functions reads as
"same" and one that changes what the kernel executes reads as "differs".

    python benchmarks/compare_ptx.py BASE_REV [NEW_REV] [--units decode_mtp_f32 replay_bf16 ...]
        [--rename PATTERN REPLACEMENT]

NEW_REV defaults to the working tree. --rename rewrites the new revision's PTX (a Python regular
expression) before the comparison, for a change of a kernel template's signature that renames every
kernel: a defaulted template argument added at the end reads as "same" where the code is the same,
for example --rename '(Li[n0-9]+E(?:Lb[01]E){3})Lb0E(EEv)' '\1\2' for a sixth bool parameter.
A kernel whose PTX is the same compiles to the same machine code, so its measured speed carries
over; one that differs needs the GPU check and a benchmark.
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
# How the kernels are compiled here (kernel_resources.py adds its own output flags).
NVCC_BASE = ["-std=c++20", "-arch=sm_90a", "-DGDN_HAS_CUDA", "--expt-relaxed-constexpr", "-O3"]
NVCC_FLAGS = [*NVCC_BASE, "-ptx"]
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


def kernels(path, rename=None):
    """Entry name -> PTX body with registers and labels renamed in order of first use."""
    out, name, lines = {}, None, []
    text = open(path).read()
    if rename:
        text = re.sub(rename[0], rename[1], text)
    for line in text.splitlines(keepends=True):
        if line.startswith(".visible .entry"):
            if name:
                out[name] = "".join(lines).rstrip()
            name, lines, names = line.split()[2].split("(")[0], [], {}
        # .globl comments name the kernel that follows in the file, not this one's code.
        if name is None or line.lstrip().startswith((".reg", "// .globl")):
            continue
        lines.append(REGISTER.sub(lambda m: names.setdefault(m.group(0), f"v{len(names)}"), line))
    if name:
        out[name] = "".join(lines).rstrip()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--units", nargs="+", default=UNITS)
    ap.add_argument("--rename", nargs=2, metavar=("PATTERN", "REPLACEMENT"),
                    help="regular expression substitution applied to the new revision's PTX")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = [tree(args.base, os.path.join(tmp, "base")), tree(args.new, os.path.join(tmp, "new"))]
        jobs = [(t, u, os.path.join(tmp, f"{i}_{u}.ptx")) for i, t in enumerate(trees)
                for u in args.units]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            list(pool.map(lambda j: ptx(*j), jobs))
        differs = 0
        for u in args.units:
            base, new = (kernels(os.path.join(tmp, f"{i}_{u}.ptx"), args.rename if i else None)
                         for i in (0, 1))
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
