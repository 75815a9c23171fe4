"""Instructions and warp-stall samples of a profiled kernel, summed by the code they belong to.

Reads the source page that benchmarks/profile_source.sh writes (`ncu --page source --print-source
cuda,sass --csv`: per source line of every file, "Instructions Executed" and "Warp Stall Sampling
(All Samples)") and groups the lines of the given source files into parts: each device function (a
definition at column 0, or a struct), each numbered step of a kernel body (a comment `// N. ...` at the body's
indentation) and each named branch inside one (a comment `// Name: ...` nested deeper, such as
"Token by token:" or "Closed form:"). A line belongs to the last part that starts above it, so
code inlined from a helper counts at the helper. Lines of other files are summed by file.

    python benchmarks/profile_by_code.py profile_out/srcmix_NAME.csv \
        --source include/gdn/decode_mtp/cuda_kernel.cuh --source include/gdn/core/cuda/device.cuh \
        [--top 20] [--opcodes] [--json out.json]

--opcodes adds the instructions by SASS opcode, overall and for each busiest line (how much of a
kernel is address arithmetic, selects and branches rather than math).

The sources must be the revision that was profiled (their line numbers are the report's).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import Counter
from pathlib import Path

INSTRUCTIONS = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"

_FUNCTION = re.compile(r"^(?:template\s*<.*>\s*)?(?:__global__|__device__|__host__ __device__)\b")
_STRUCT = re.compile(r"^struct (\w+)")
_NAME = re.compile(r"(\w+)\s*\(")
_STEP = re.compile(r"^  // (\d+)\. (.*)")
_BRANCH = re.compile(r"^ {4,}// ([A-Z][\w ,-]*?):")


def parts_of(source_lines: list[str]) -> list[str]:
    """The part each line (1-based: index 0 is line 1) belongs to."""
    part, function, out = "(file scope)", "", []
    for i, line in enumerate(source_lines):
        if _FUNCTION.match(line):
            # The name is the identifier before the first '(' that is not an attribute's.
            text = re.sub(r"__\w+__\s*\([^)]*\)", "", line)
            if "(" not in text and i + 1 < len(source_lines):
                text = source_lines[i + 1]
            m = _NAME.search(text)
            function = m.group(1) if m else line.strip()
            part = function
        elif m := _STRUCT.match(line):
            function, part = "", m.group(1)
        elif function and (m := _STEP.match(line)):
            part = f"{function}: {m.group(1)}. {m.group(2)[:48].rstrip()}"
        elif function and (m := _BRANCH.match(line)):
            step = part.split(" / ")[0]
            part = f"{step} / {m.group(1)}"
        out.append(part)
    return out


_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def opcode_of(sass: str) -> str:
    """The base opcode of a SASS instruction ("@P0 IMAD.WIDE.U32 R2, ..." -> "IMAD")."""
    words = _PREDICATE.sub("", sass.strip()).split()
    return words[0].split(".")[0] if words else "?"


def read_source_page(csv_path: Path, opcodes: dict | None = None
                     ) -> list[tuple[str, int, int, int, str]]:
    """(file name, line, instructions executed, stall samples, source text) per source line. With
    `opcodes` (a dict), also fills opcodes[(file name, line)] with a Counter of the instructions
    executed by the line's SASS rows, by base opcode."""
    rows, file_name, columns = [], "", None  # columns: where the two counts are
    count = lambda row, i: int(row[i]) if i < len(row) and row[i].isdigit() else 0  # noqa: E731
    with open(csv_path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "File Path":
                file_name = Path(row[1]).name
            elif row[0] == "Line No":
                columns = (row.index(INSTRUCTIONS), row.index(SAMPLES))
            elif columns is not None and row[0].isdigit():  # a source line (SASS rows have none)
                rows.append((file_name, int(row[0]), count(row, columns[0]), count(row, columns[1]),
                             row[1].strip() if len(row) > 1 else ""))
            elif (opcodes is not None and rows and columns is not None and len(row) > 3
                  and row[2].startswith("0x")):  # a SASS row of the last source line
                key = rows[-1][:2]
                opcodes.setdefault(key, Counter())[opcode_of(row[3])] += count(row, columns[0])
    if columns is None:
        raise SystemExit(f"{csv_path}: no source page (no 'Line No' header)")
    return rows


def summarize(rows, sources: list[Path], opcodes: dict | None = None) -> dict:
    parts = {src.name: parts_of(src.read_text().splitlines()) for src in sources}
    by_part_i, by_part_s = Counter(), Counter()
    total_i = sum(r[2] for r in rows)
    total_s = sum(r[3] for r in rows)
    for file_name, line, instr, samples, _ in rows:
        if file_name in parts and 1 <= line <= len(parts[file_name]):
            key = parts[file_name][line - 1]
            if len(sources) > 1:
                key = f"{file_name}: {key}"
        else:
            key = f"[{file_name}]"
        by_part_i[key] += instr
        by_part_s[key] += samples
    pct = lambda x, t: round(100.0 * x / t, 1) if t else 0.0  # noqa: E731
    mix = sum(opcodes.values(), Counter()) if opcodes else Counter()
    top_ops = lambda c: {op: pct(n, total_i) for op, n in c.most_common(4)}  # noqa: E731
    return {
        "instructions": total_i,
        # % of the instructions by base opcode (--opcodes): integer and control against math.
        "opcodes_pct": {op: pct(n, total_i) for op, n in mix.most_common(25)},
        "stall_samples": total_s,
        "parts": [{"part": k, "instructions_pct": pct(v, total_i),
                   "stall_samples_pct": pct(by_part_s[k], total_s)}
                  for k, v in sorted(by_part_i.items(), key=lambda kv: -kv[1])],
        "lines": [{"file": f, "line": ln, "instructions_pct": pct(i, total_i),
                   "stall_samples_pct": pct(s, total_s), "source": text[:100],
                   **({"opcodes_pct": top_ops(opcodes.get((f, ln), Counter()))} if opcodes else {})}
                  for f, ln, i, s, text in sorted(rows, key=lambda r: -r[2])],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", type=Path, help="ncu source page (--print-source cuda,sass --csv)")
    ap.add_argument("--source", type=Path, action="append", required=True,
                    help="a source file whose lines are grouped (repeat for several)")
    ap.add_argument("--top", type=int, default=15, help="also list the N busiest lines")
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--opcodes", action="store_true",
                    help="also the instructions by SASS opcode, overall and per busiest line")
    args = ap.parse_args(argv)
    opcodes = {} if args.opcodes else None
    summary = summarize(read_source_page(args.csv, opcodes), args.source, opcodes)
    print(f"{summary['instructions']} instructions executed, {summary['stall_samples']} samples")
    if opcodes:
        print("by opcode (%): " + ", ".join(f"{op} {v}" for op, v in summary["opcodes_pct"].items()))
    print(f"{'instr %':>8} {'stall %':>8}  part")
    for p in summary["parts"]:
        if p["instructions_pct"] >= 0.3 or p["stall_samples_pct"] >= 0.5:
            print(f"{p['instructions_pct']:8.1f} {p['stall_samples_pct']:8.1f}  {p['part']}")
    if args.top:
        print(f"\nbusiest {args.top} lines:")
        for r in summary["lines"][:args.top]:
            ops = "  [" + ", ".join(f"{op} {v}" for op, v in r["opcodes_pct"].items()) + "]" \
                if "opcodes_pct" in r else ""
            print(f"{r['instructions_pct']:8.1f} {r['stall_samples_pct']:8.1f}  "
                  f"{r['file']}:{r['line']}  {r['source']}{ops}")
    if args.json:
        summary["lines"] = summary["lines"][:max(args.top, 50)]
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
