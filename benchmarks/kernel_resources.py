"""Registers, stack and spills of every CUDA kernel image, without a GPU. Compiles CUDA translation
units (src/cuda/*.cu) of a revision for sm_90a with ptxas -v and prints one row per kernel entry:
registers, stack frame, spill stores and loads (bytes). With --base REV each row shows the base
revision's figures beside its own, and the rows that changed are marked.

    python benchmarks/kernel_resources.py [--rev REV] [--base REV] [--units replay_f32 ...]
        [--filter REGEX] [--sass]

--rev defaults to the working tree. --sass also reads the machine code (nvdisasm on PATH or in
$NVDISASM; PyPI's nvidia-cuda-nvdisasm has it) and counts each kernel's local loads and stores
(LDL, STL) and its "waiting spills": spill stores of a value that came from a global load or
atomic a few instructions before, where the warp waits for that round trip at the spill (a
spilled atomic result can stall a whole CTA this way). Registers and spills are not speed; a
change that moves them still needs the GPU benchmark.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from compare_ptx import NVCC_BASE, UNITS, tree

NVCC_FLAGS = [*NVCC_BASE, "-cubin", "-Xptxas", "-v"]
ENTRY = re.compile(r"Compiling entry function '(\S+)'")
FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
USED = re.compile(r"Used (\d+) registers")
# Instructions whose result arrives from memory outside the SM: the warp waits at its first use.
GLOBAL_RESULT = re.compile(r"^(?:LDG|LD|ATOMG|ATOM)\b")
WAIT_WINDOW = 4  # instructions between such a load and a spill of (a value computed from) it


def demangle(names):
    out = subprocess.run(
        ["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True
    ).stdout.splitlines()
    return [re.sub(r"gdn::(?:\w+::)*", "", n) for n in out]


def compile_unit(src, unit, work):
    """Entry (mangled) -> (registers, stack, spill stores, spill loads), and the cubin's path."""
    cubin = os.path.join(work, unit + ".cubin")
    log = subprocess.run(
        [
            "nvcc",
            *NVCC_FLAGS,
            "-I",
            os.path.join(src, "include"),
            os.path.join(src, "src", "cuda", unit + ".cu"),
            "-o",
            cubin,
        ],
        capture_output=True,
        text=True,
    )
    if log.returncode:
        sys.exit(f"{unit}: nvcc failed\n{log.stderr[-2000:]}")
    found, name, frame = {}, None, None
    for line in log.stderr.splitlines():
        if m := ENTRY.search(line):
            name, frame = m.group(1), None
        elif (m := FRAME.search(line)) and name:
            frame = tuple(int(x) for x in m.groups())
        elif (m := USED.search(line)) and name:
            found[name] = (int(m.group(1)), *(frame or (0, 0, 0)))
            name = None
    return found, cubin


def sass_counts(cubin, nvdisasm):
    """Entry (mangled) -> (LDL count, STL count, waiting spills) from the machine code."""
    sass = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True, check=True).stdout
    out, name, recent, counts = {}, None, [], [0, 0, 0]
    for line in sass.splitlines():
        if m := re.match(r"^\s*\.text\.(\S+):", line):
            if name:
                out[name] = tuple(counts)
            name, recent, counts = m.group(1), [], [0, 0, 0]
            continue
        m = re.search(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?);", line)
        if not m or not name:
            continue
        op, args = m.group(1), m.group(2)
        regs = re.findall(r"\bR\d+\b", args)  # the destination first, except for stores
        if op.startswith("LDL"):
            counts[0] += 1
        if op.startswith("STL"):
            counts[1] += 1
            # A spill of a register written by a global load or atomic in the last few
            # instructions, directly or through one instruction computed from it.
            stored = regs[-1:]
            tainted = set()
            for prev_op, prev_regs in recent:
                if GLOBAL_RESULT.match(prev_op) and prev_regs:
                    tainted.add(prev_regs[0])
                elif prev_regs and not prev_op.startswith(("ST", "RED")) and tainted.intersection(prev_regs[1:]):
                    tainted.add(prev_regs[0])
            if tainted.intersection(stored):
                counts[2] += 1
        recent = (recent + [(op, regs)])[-WAIT_WINDOW:]
    if name:
        out[name] = tuple(counts)
    return out


def measure(src, units, work, nvdisasm):
    os.makedirs(work, exist_ok=True)
    with ThreadPoolExecutor(max_workers=len(units)) as pool:
        results = list(pool.map(lambda u: compile_unit(src, u, work), units))
    rows = {}
    for unit, (found, cubin) in zip(units, results):
        sass = sass_counts(cubin, nvdisasm) if nvdisasm else {}
        for name, figures in found.items():
            rows[(unit, name)] = figures + sass.get(name, ())
    return rows


def cells(figures, sass):
    regs, stack, st, ld = figures[:4]
    text = f"{regs:4d} regs {stack:4d} stack {st:4d}/{ld:<4d} spill"
    if sass and len(figures) > 4:
        text += f" {figures[4]:3d} LDL {figures[5]:3d} STL {figures[6]:2d} waiting"
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rev", help="revision to measure (default: the working tree)")
    ap.add_argument("--base", help="revision to compare against")
    ap.add_argument("--units", nargs="+", default=UNITS, choices=UNITS)
    ap.add_argument("--filter", help="only kernels whose demangled name matches this regex")
    ap.add_argument("--sass", action="store_true", help="also count LDL/STL in the machine code")
    args = ap.parse_args(argv)
    nvdisasm = None
    if args.sass:
        nvdisasm = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
        if not nvdisasm:
            sys.exit("--sass needs nvdisasm on PATH or in $NVDISASM (pip install nvidia-cuda-nvdisasm)")
    with tempfile.TemporaryDirectory() as tmp:
        revs = {"new": args.rev, **({"base": args.base} if args.base else {})}
        with ThreadPoolExecutor(max_workers=len(revs)) as pool:
            measured = dict(
                zip(
                    revs,
                    pool.map(
                        lambda r: measure(
                            tree(revs[r], os.path.join(tmp, r)), args.units, os.path.join(tmp, r + "_out"), nvdisasm
                        ),
                        revs,
                    ),
                )
            )
    keys = sorted(set().union(*(m.keys() for m in measured.values())))
    names = dict(zip(keys, demangle([k[1] for k in keys])))
    changed = 0
    for key in keys:
        if args.filter and not re.search(args.filter, names[key]):
            continue
        new, base = measured["new"].get(key), measured.get("base", {}).get(key)
        line = f"{key[0]:16s} {cells(new, args.sass) if new else '(absent)':>52s}"
        if args.base:
            mark = " " if new == base else "*"
            changed += new != base
            line += f" | base {cells(base, args.sass) if base else '(absent)'} {mark}"
        print(line, names[key])
    if args.base:
        print(f"{changed} kernel(s) changed against {args.base}")


if __name__ == "__main__":
    main()
