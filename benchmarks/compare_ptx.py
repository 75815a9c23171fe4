"""Does a change alter the generated code of the CUDA kernels? Compiles CUDA translation units of two
revisions to PTX (nvcc, no GPU needed) and compares every kernel's PTX after renaming registers and
labels in order of first use, so that a refactor that only moves code between functions reads as
"same" and one that changes what the kernel executes reads as "differs".

--sass compares machine code instead: both revisions are compiled to sm_90a cubins and each kernel's
code section is compared byte for byte (and its .nv.info attribute section by size, since that
section names symbols by index), pairing kernels by content so that renamed kernels pair up.
Identical machine code runs identically, so no benchmark is needed; PTX may differ in instruction
order that ptxas schedules away.

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
UNITS = ["decode_mtp_f32", "decode_mtp_bf16", "decode_mtp_f16", "replay_f32", "replay_bf16", "replay_f16"]
# How the kernels are compiled here (kernel_resources.py adds its own output flags).
NVCC_BASE = ["-std=c++20", "-arch=sm_90a", "-DGDN_HAS_CUDA", "--expt-relaxed-constexpr", "-O3"]
REGISTER = re.compile(r"%(?:rd|rs|fd|hh|r|f|p|h)\d+|\$L__BB\d+_\d+")


def tree(rev, into):
    """The source tree of `rev` (None: the working tree) under `into`."""
    if rev is None:
        return ROOT
    os.makedirs(into)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)
    return into


def compile_unit(src, unit, out, output_flag):
    """nvcc of src/cuda/<unit>.cu of the tree `src` into `out` (output_flag: -ptx or -cubin)."""
    source = os.path.join(src, "src", "cuda", unit + ".cu")
    include = os.path.join(src, "include")
    subprocess.run(["nvcc", *NVCC_BASE, output_flag, "-I", include, source, "-o", out], check=True)
    return out


def ptx(src, unit, out):
    return compile_unit(src, unit, out, "-ptx")


def cubin(src, unit, out):
    return compile_unit(src, unit, out, "-cubin")


def elf_sections(path):
    """Section name -> bytes of an ELF64 little-endian file (a cubin)."""
    import struct

    data = open(path, "rb").read()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx]
    out = {}
    for h in heads:
        start = names[4] + h[0]
        name = data[start : data.index(b"\0", start)].decode()
        out[name] = data[h[4] : h[4] + h[5]] if h[1] != 8 else b""  # SHT_NOBITS: no bytes
    return out


def machine_code(path):
    """Kernel name -> (code bytes, attribute bytes) of a cubin."""
    sections = elf_sections(path)
    return {
        name[6:]: (code, sections.get(".nv.info." + name[6:], b""))
        for name, code in sections.items()
        if name.startswith(".text.")
    }


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


def anonymous(name, body):
    """The kernel's code with its own name (in its parameter names) replaced."""
    return body.replace(name, "KERNEL")


def pair_by_content(unit, base, new, key):
    """Pairs base and new kernels (name -> value) whose key(name, value) is equal, one to one;
    prints each pair and what is left over. Returns (pairs, unmatched count)."""
    pool = {}
    for name, value in new.items():
        pool.setdefault(key(name, value), []).append(name)
    pairs, unmatched = [], 0
    for name, value in sorted(base.items()):
        match = pool.get(key(name, value))
        if match:
            pairs.append((name, match.pop(0)))
        else:
            unmatched += 1
            print(f"{unit:16} no match     {name}")
    for names in pool.values():
        for name in names:
            unmatched += 1
            print(f"{unit:16} only in new  {name}")
    return pairs, unmatched


def compile_both(args, tmp, compile_unit_to, ext):
    """Compiles every unit of the base and new trees (in parallel); returns path(i, unit) of the
    output of tree i (0: base, 1: new)."""
    trees = [tree(args.base, os.path.join(tmp, "base")), tree(args.new, os.path.join(tmp, "new"))]
    path = lambda i, u: os.path.join(tmp, f"{i}_{u}.{ext}")  # noqa: E731
    jobs = [(t, u, path(i, u)) for i, t in enumerate(trees) for u in args.units]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        list(pool.map(lambda j: compile_unit_to(*j), jobs))
    return path


def compare_sass(args):
    with tempfile.TemporaryDirectory() as tmp:
        path = compile_both(args, tmp, cubin, "cubin")
        differs = total = 0
        for u in args.units:
            base, new = (machine_code(path(i, u)) for i in (0, 1))
            total += len(base)
            pairs, differs_here = pair_by_content(u, base, new, lambda name, value: value[0])
            for name, other in pairs:
                same_info = len(base[name][1]) == len(new[other][1])
                differs_here += not same_info
                print(f"{u:16} {'same' if same_info else 'attributes':12} {name} -> {other}")
            differs += differs_here
        print(f"{total} kernel(s) in base, {differs} without identical machine code in new")
        return 1 if differs else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--units", nargs="+", default=UNITS)
    ap.add_argument(
        "--rename",
        nargs=2,
        metavar=("PATTERN", "REPLACEMENT"),
        help="regular expression substitution applied to the new revision's PTX",
    )
    ap.add_argument(
        "--by-body",
        action="store_true",
        help="match kernels by their code instead of their names (a change that renames "
        "kernels or moves them to other templates): each unit's kernels must pair "
        "up one to one with identical code",
    )
    ap.add_argument(
        "--sass", action="store_true", help="compare machine code (sm_90a cubins), pairing kernels by content"
    )
    args = ap.parse_args()
    if args.sass:
        return compare_sass(args)
    with tempfile.TemporaryDirectory() as tmp:
        path = compile_both(args, tmp, ptx, "ptx")
        differs = 0
        for u in args.units:
            base, new = (kernels(path(i, u), args.rename if i else None) for i in (0, 1))
            if args.by_body:
                pairs, unmatched = pair_by_content(u, base, new, anonymous)
                for name, other in pairs:
                    print(f"{u:16} same         {name} -> {other}")
                differs += unmatched
                continue
            for name in sorted(set(base) | set(new)):
                state = (
                    "same"
                    if base.get(name) == new.get(name)
                    else "only in base"
                    if name not in new
                    else "only in new"
                    if name not in base
                    else "differs"
                )
                differs += state != "same"
                print(f"{u:16} {state:12} {name}")
        print(f"{differs} kernel(s) not the same")
        return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
