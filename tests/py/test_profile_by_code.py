"""benchmarks/profile_by_code.py: a profiled kernel's source lines summed by the part of the code
they belong to (device functions, structs, a kernel's numbered steps and named branches)."""

import csv
import importlib.util
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_by_code.py"
_spec = importlib.util.spec_from_file_location("profile_by_code", _SCRIPT)
profile_by_code = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(profile_by_code)

KERNEL = """\
#pragma once
template <int kRows>
__device__ __forceinline__ float dot_rows(const float* x) {
  return x[0] * kRows;
}
struct Plan {
  int k, q;
};
__global__ void __launch_bounds__(128, 6)
    step_kernel(const __grid_constant__ Args args) {
  int setup = 0;
  // 1. Metadata.
  load();
  // 2. Rows.
  if (replay) {
    if (!closed) {
      // Token by token: one token at a time.
      advance();
    } else {
      // Closed form: every dot first.
      dots();
    }
  }
}
"""

HEADER = ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)",
          "Warp Stall Sampling (Not-issued Samples)", "# Samples", "Instructions Executed"]


def write_page(path: Path, files: dict[str, list[tuple[int, int, int]]]) -> None:
    """An ncu source page: per file, (line, stall samples, instructions) rows, each followed by a
    SASS row without a line number (which the reader must skip)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        for name, rows in files.items():
            w.writerow(["File Path", f"/src/{name}"])
            w.writerow(["Function Name", "step_kernel(Args)"])
            w.writerow(HEADER)
            for line, samples, instr in rows:
                w.writerow([str(line), "src", "-", "-", str(samples), "0", str(samples), str(instr)])
                w.writerow(["", "", "0x1", "FFMA R1, R2, R3, R4", "99", "0", "0", "99"])


def test_parts_of_names_functions_structs_steps_and_branches():
    parts = profile_by_code.parts_of(KERNEL.splitlines())
    assert parts[3] == "dot_rows"  # line 4: the function's body
    assert parts[6] == "Plan"
    assert parts[10] == "step_kernel"  # setup before step 1
    assert parts[12] == "step_kernel: 1. Metadata."
    assert parts[17] == "step_kernel: 2. Rows. / Token by token"
    assert parts[20] == "step_kernel: 2. Rows. / Closed form"
    assert parts[22] == "step_kernel: 2. Rows. / Closed form"


def test_summarize_sums_lines_by_part_and_other_files_by_name(tmp_path):
    source = tmp_path / "kernel.cuh"
    source.write_text(KERNEL)
    page = tmp_path / "page.csv"
    write_page(page, {
        "kernel.cuh": [(4, 10, 300), (13, 5, 100), (18, 20, 400), (21, 5, 100)],
        "cuda_fp16.hpp": [(708, 60, 100)],
    })
    summary = profile_by_code.summarize(profile_by_code.read_source_page(page), [source])
    assert summary["instructions"] == 1000  # the SASS rows (99 each) are not counted again
    assert summary["stall_samples"] == 100
    parts = {p["part"]: (p["instructions_pct"], p["stall_samples_pct"]) for p in summary["parts"]}
    assert parts == {
        "step_kernel: 2. Rows. / Token by token": (40.0, 20.0),
        "dot_rows": (30.0, 10.0),
        "step_kernel: 1. Metadata.": (10.0, 5.0),
        "step_kernel: 2. Rows. / Closed form": (10.0, 5.0),
        "[cuda_fp16.hpp]": (10.0, 60.0),
    }
    assert summary["lines"][0]["line"] == 18


def test_a_page_without_source_lines_is_an_error(tmp_path):
    page = tmp_path / "empty.csv"
    page.write_text('"File Path","/src/kernel.cuh"\n')
    with pytest.raises(SystemExit, match="no source page"):
        profile_by_code.read_source_page(page)


def test_opcodes_are_counted_per_line_from_its_sass_rows(tmp_path):
    source = tmp_path / "kernel.cuh"
    source.write_text(KERNEL)
    page = tmp_path / "page.csv"
    sass = {4: [("FFMA R1, R2, R3, R4", 30), ("@!P0 IMAD.WIDE.U32 R2, R3, 4, R4", 10)],
            13: [("@P1 BRA 0x100", 60)]}
    with open(page, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["File Path", "/src/kernel.cuh"])
        w.writerow(HEADER)
        for line, rows in sass.items():
            w.writerow([str(line), "src", "-", "-", "0", "0", "0", str(sum(n for _, n in rows))])
            for text, n in rows:
                w.writerow(["", "", "0x1", text, "0", "0", "0", str(n)])
    opcodes = {}
    rows = profile_by_code.read_source_page(page, opcodes)
    assert opcodes[("kernel.cuh", 4)] == {"FFMA": 30, "IMAD": 10}  # predicate and suffixes dropped
    summary = profile_by_code.summarize(rows, [source], opcodes)
    assert summary["opcodes_pct"] == {"BRA": 60.0, "FFMA": 30.0, "IMAD": 10.0}
    assert summary["lines"][0]["opcodes_pct"] == {"BRA": 60.0}
    assert "opcodes_pct" not in profile_by_code.summarize(rows, [source])["lines"][0]
