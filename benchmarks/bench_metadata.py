"""Host (and device) time of one step's GDN metadata for G KV-cache groups.

Paths compared, for G in {1, 3, 6}, N in {1, 64, 256, 1024} requests, S in {2, 5, 9}:

- ``fused (py)``: gdn.metadata.Builder.step from Python: the shared plan once + one state-row pass
  for all groups (CPU loop; on CUDA one async plan copy + one launch);
- ``fused (C++)``: the same step of the C++ builder (gdn::metadata::Builder) timed in C++ by
  ``benchmarks/cpp/metadata_host_timer`` (no Python in the loop), on the same step and tables;
- ``per-group (C++)``: per group, a one-group C++ builder's step (our code, G times);
- ``per-group ref (C++)``: the shadow check's plain per-group build (CPU only);
- ``vLLM-style (torch)``: a Python re-implementation of the per-group builder engines run today
  (vLLM's GDN builder algorithm, peers.md §3.3/3.4: CPU-side counting, per-group block-table
  gathers, repeat_interleave/argsort for mixed batches, CUDA-graph staging copies into
  persistent buffers), run once per group with torch ops on the device of the block tables.

The batch is a pure speculative-verify step (every request verifies num_spec drafts), mode
"none", staged for a CUDA graph of N rows; the target point (G=6, N=256, S=5) is also run with a
mixed batch (prefills + decodes + spec rows) and in mode "align". On a CUDA machine the script also
measures the device time of the fused launch (CUDA-graph replay of 100 launches, CUDA events) and
counts kernels/copies per step with the torch profiler.

    python benchmarks/bench_metadata.py [--quick] [--json PATH] [--timer PATH | --gdn-dir DIR]

The C++ columns need the timer: ``--timer`` names a built ``metadata_host_timer``; otherwise it is
configured and built (cmake) into build/bench_metadata_timer against the libgdn package at
``--gdn-dir`` (a directory holding gdnConfig.cmake, or a libgdn CMake build tree, which is
installed there first), else that of the installed wheel, else the build tree of a development
build's ``gdn._C`` (scripts/dev_build.sh). Without one the C++ columns are left out.

Writes benchmarks/results/metadata_<cpu|h200>.json by default (git SHA, machine, versions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch

import gdn
from gdn import metadata as M

PAD_SLOT = 0
TARGET = dict(G=6, N=256, S=5, cpp_host_us=15.0, py_host_us=25.0, launches=1)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- inputs ---------------------------------------------------------------------------------------


def make_step(N: int, S: int, kind: str, rng) -> Dict[str, np.ndarray]:
    """Host arrays of one step. kind "spec": every row verifies S-1 drafts; "mixed": a quarter
    prefills (8..64 tokens), a quarter decodes, half spec rows with 0..S-1 drafts."""
    if kind == "spec":
        drafts = np.full(N, S - 1, np.int32)
        T = drafts + 1
    else:
        r = np.arange(N) % 4
        drafts = np.where(r >= 2, rng.integers(0, S, size=N), -1).astype(np.int32)
        T = np.where(r == 0, rng.integers(8, 65, size=N), np.where(r == 1, 1, drafts + 1))
        if not (drafts > 0).any() and N:
            drafts[-1], T[-1] = S - 1, S
    T = T.astype(np.int32)
    computed = rng.integers(1, 4000, size=N).astype(np.int32)
    return dict(
        qsl=np.concatenate([[0], np.cumsum(T)]).astype(np.int32),
        seq_lens=(computed + T).astype(np.int32),
        drafts=drafts,
        acc=rng.integers(1, S + 1, size=N).astype(np.int32),
        computed=computed,
    )


def make_tables(G: int, N: int, cols: int, device: str, rng) -> List[torch.Tensor]:
    return [torch.from_numpy(rng.integers(1, 1 << 20, size=(N, cols)).astype(np.int32)).to(device) for _ in range(G)]


# ---- vLLM-style per-group builder (our re-implementation, torch ops) ---------------------------------


class VllmStyleGroupBuilder:
    """One KV-cache group's builder as engines run it today: everything recomputed per group.

    Written from the algorithm in docs peers.md §3.3-3.5 (not vLLM's code): classification counted
    on CPU tensors (no device sync), the block table transformed per group (align mode gathers
    columns [start, start + S)), state rows gathered with the CPU mask, token split by
    repeat_interleave + stable argsort for mixed batches, and the CUDA-graph staging of a pure
    spec batch into persistent buffers (copy live rows, fill padded rows).
    """

    def __init__(self, num_spec: int, max_bs: int, device: str):
        S = num_spec + 1
        self.S, self.device = S, device
        i32 = dict(dtype=torch.int32, device=device)
        self.spec_state_indices = torch.zeros(max_bs, S, **i32)
        self.non_spec_state_indices = torch.zeros(max_bs, **i32)
        self.spec_sequence_masks = torch.zeros(max_bs, dtype=torch.bool, device=device)
        self.spec_query_start_loc = torch.zeros(max_bs + 1, **i32)
        self.non_spec_query_start_loc = torch.zeros(max_bs + 1, **i32)
        self.num_accepted_tokens = torch.zeros(max_bs, **i32)
        self.max_bs = max_bs

    def build(
        self, c: Dict[str, Any], block_table: torch.Tensor, mode: str, block_size: int, padded_rows: int
    ) -> Dict[str, Any]:
        S, dev = self.S, self.device
        qsl_cpu, drafts_cpu = c["qsl_cpu"], c["drafts_cpu"]
        if mode == "align":  # the slot model's per-group table transform
            start = torch.clamp((c["seq_lens"] - 1) // block_size, min=0)
            cols = start[:, None] + torch.arange(S, device=dev, dtype=start.dtype)
            block_table = block_table[: len(start)].gather(1, cols.long())
        spec_cpu = None
        if drafts_cpu is not None and int(drafts_cpu[drafts_cpu >= 0].sum()) > 0:
            spec_cpu = drafts_cpu >= 0
        qlens_cpu = qsl_cpu[1:] - qsl_cpu[:-1]
        md: Dict[str, Any] = {}
        if spec_cpu is None:
            md["num_decodes"] = int((qlens_cpu == 1).sum())
            md["num_prefills"] = int((qlens_cpu > 1).sum())
            md["non_spec_state_indices"] = block_table[:, 0]
            md["non_spec_query_start_loc"] = c["qsl"]
            md["num_spec_decodes"] = 0
        else:
            spec = spec_cpu.to(dev, non_blocking=True)
            n_spec = int(spec_cpu.sum())
            ns_lens = qlens_cpu[~spec_cpu]
            decodes = int((ns_lens == 1).sum())
            zero = int((ns_lens == 0).sum())
            prefills = int(ns_lens.numel()) - decodes - zero
            ns_tokens = int(ns_lens.sum())
            if decodes:  # reclassified as prefills when spec rows exist
                prefills, decodes = prefills + decodes, 0
            md.update(num_prefills=prefills, num_decodes=decodes, num_spec_decodes=n_spec)
            if prefills == 0:
                total = int(qsl_cpu[-1])
                md["spec_token_indx"] = torch.arange(min(n_spec * S, total), dtype=torch.int32, device=dev)
                md["spec_state_indices"] = block_table[:, :S]
                md["spec_query_start_loc"] = c["qsl"]
            else:
                qlens = c["qsl"][1:] - c["qsl"][:-1]
                token_mask = torch.repeat_interleave(spec, qlens, output_size=int(qsl_cpu[-1]))
                order = torch.argsort(token_mask.to(torch.int8), stable=True)
                md["non_spec_token_indx"] = order[:ns_tokens]
                md["spec_token_indx"] = order[ns_tokens:]
                md["spec_state_indices"] = block_table[spec_cpu, :S]
                md["non_spec_state_indices"] = block_table[~spec_cpu, 0]
                sq = torch.zeros(n_spec + 1, dtype=torch.int32, device=dev)
                torch.cumsum(qlens[spec], dim=0, out=sq[1:])
                nq = torch.zeros(len(ns_lens) + 1, dtype=torch.int32, device=dev)
                torch.cumsum(qlens[~spec], dim=0, out=nq[1:])
                md["spec_query_start_loc"], md["non_spec_query_start_loc"] = sq, nq
                md["has_initial_state"] = (c["computed"] > 0)[~spec]
            md["num_accepted_tokens"] = c["acc"][spec_cpu]
            md["spec_sequence_masks"] = spec
        # CUDA-graph staging of a pure spec batch into the persistent buffers.
        n = md["num_spec_decodes"]
        if n and md["num_prefills"] == 0 and md["num_decodes"] == 0 and padded_rows <= self.max_bs:
            b = padded_rows
            self.spec_state_indices[:n].copy_(md["spec_state_indices"][:n], non_blocking=True)
            self.spec_state_indices[n:b].fill_(PAD_SLOT)
            self.spec_sequence_masks[:n].copy_(md["spec_sequence_masks"][:n], non_blocking=True)
            self.spec_sequence_masks[n:b].fill_(False)
            self.spec_query_start_loc[: n + 1].copy_(md["spec_query_start_loc"][: n + 1], non_blocking=True)
            self.spec_query_start_loc[n + 1 : b + 1].fill_(int(qsl_cpu[n]))
            self.num_accepted_tokens[:n].copy_(md["num_accepted_tokens"], non_blocking=True)
            self.num_accepted_tokens[n:b].fill_(1)
        return md


def vllm_style_common(step: Dict[str, np.ndarray], device: str) -> Dict[str, Any]:
    """The per-step common metadata an engine already holds (CPU and device copies)."""
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    return dict(
        qsl_cpu=t(step["qsl"]),
        drafts_cpu=t(step["drafts"]),
        qsl=t(step["qsl"]).to(device),
        seq_lens=t(step["seq_lens"]).to(device),
        acc=t(step["acc"]).to(device),
        computed=t(step["computed"]).to(device),
    )


# ---- the C++ timer (benchmarks/cpp) --------------------------------------------------------------


def _gdn_package(gdn_dir: Optional[str], build: str) -> Optional[str]:
    """A directory holding gdnConfig.cmake: `gdn_dir`, else the installed wheel's, else (a
    development build, whose gdn._C lives in a CMake build tree) that tree installed under
    `build`."""
    candidates = [gdn_dir] if gdn_dir else [gdn.cmake_dir(), os.path.dirname(os.path.realpath(gdn._C.__file__))]
    for d in candidates:
        if os.path.isfile(os.path.join(d, "CMakeCache.txt")):  # a build tree: install it first
            prefix = os.path.join(build, "gdn")
            subprocess.run(["cmake", "--install", d, "--prefix", prefix], check=True, capture_output=True, text=True)
            return os.path.join(prefix, "share", "cmake", "gdn")
        if os.path.isfile(os.path.join(d, "gdnConfig.cmake")):
            return d
    return None


def cpp_timer(timer: Optional[str], gdn_dir: Optional[str]) -> Optional[str]:
    """Path of a runnable metadata_host_timer, building it when needed; None (with a note) when
    there is no libgdn package to build it against or the build fails."""
    if timer:
        return timer
    build = os.path.join(ROOT, "build", "bench_metadata_timer")
    try:
        package = _gdn_package(gdn_dir, build)
        if package is None:
            print("note: no libgdn CMake package found: C++ columns left out (pass --gdn-dir or --timer)")
            return None
        subprocess.run(
            [
                "cmake",
                "-S",
                os.path.join(ROOT, "benchmarks", "cpp"),
                "-B",
                build,
                f"-Dgdn_DIR={os.path.abspath(package)}",
                "-DCMAKE_BUILD_TYPE=Release",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        subprocess.run(["cmake", "--build", build], check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        out = getattr(e, "stderr", "") or getattr(e, "stdout", "") or str(e)
        print(f"note: building the C++ timer failed, C++ columns left out:\n{out[-2000:]}")
        return None
    return os.path.join(build, "metadata_host_timer")


def write_step(
    path: str,
    step: Dict[str, np.ndarray],
    tables: List[np.ndarray],
    S: int,
    mode: str,
    block_size: int,
    padded: int,
    max_rows: int,
    max_tokens: int,
) -> None:
    """The step in the timer's text format (benchmarks/cpp/metadata_host_timer.cpp)."""
    with open(path, "w") as f:
        f.write(
            f"gdn-metadata-step G {len(tables)} num_spec {S - 1} mode {mode} block_size "
            f"{block_size} pad_id {PAD_SLOT} padded_rows {padded} max_rows {max_rows} "
            f"max_tokens {max_tokens}\n"
        )
        for name, key in (
            ("query_start_loc", "qsl"),
            ("seq_lens", "seq_lens"),
            ("num_draft_tokens", "drafts"),
            ("num_accepted_tokens", "acc"),
            ("num_computed_tokens", "computed"),
        ):
            a = step[key]
            f.write(f"{name} {len(a)} {' '.join(map(str, a.tolist()))}\n")
        for t in tables:
            f.write(f"table {t.shape[0]} {t.shape[1]} {' '.join(map(str, t.reshape(-1).tolist()))}\n")


def run_timer(timer: str, step_path: str, device: str, iters: int) -> Dict[str, float]:
    out = subprocess.run(
        [timer, "--device", device, "--iters", str(iters), "--repeats", "3", step_path],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- timing ---------------------------------------------------------------------------------------


def host_time(fn: Callable[[], Any], budget: float = 0.01, repeats: int = 7) -> float:
    """Median seconds per call over `repeats` loops of ~`budget` seconds each."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    k = max(1, min(20000, int(budget / one)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times)


def run_point(
    G: int,
    N: int,
    S: int,
    device: str,
    kind: str = "spec",
    mode: str = "none",
    quick: bool = False,
    seed: int = 0,
    timer: Optional[str] = None,
) -> Dict[str, Any]:
    rng = np.random.default_rng(seed + 1000 * G + 10 * N + S)
    step = make_step(N, S, kind, rng)
    cols = S + 2 if mode == "none" else 40
    block_size = 16 if mode == "none" else 256
    tables = make_tables(G, N, cols, device, rng)
    tokens = int(step["qsl"][-1])
    padded = N
    b = M.Builder(
        tables if device == "cuda" else [t.numpy() for t in tables],
        num_spec=S - 1,
        max_rows=N,
        max_tokens=max(tokens, 1),
        mode=mode,
        block_size=block_size,
        pad_id=PAD_SLOT,
    )
    kw = dict(
        num_draft_tokens=step["drafts"],
        num_accepted_tokens=step["acc"],
        num_computed_tokens=step["computed"],
        padded_rows=padded,
    )
    args = (step["qsl"], step["seq_lens"])
    budget, repeats = (0.004, 3) if quick else (0.01, 7)
    iters = 200 if quick else 1000
    row: Dict[str, Any] = dict(G=G, N=N, S=S, batch=kind, mode=mode, device=device)
    row["fused_py_us"] = 1e6 * host_time(lambda: b.step(*args, **kw), budget, repeats)
    if timer:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "step.txt")
            write_step(path, step, [t.cpu().numpy() for t in tables], S, mode, block_size, padded, N, max(tokens, 1))
            cpp = run_timer(timer, path, device, iters)
        row["fused_cpp_us"] = cpp["fused_us"]
        row["per_group_cpp_us"] = cpp["per_group_us"]
        if "per_group_reference_us" in cpp:
            row["per_group_ref_cpp_us"] = cpp["per_group_reference_us"]
    vb = [VllmStyleGroupBuilder(S - 1, N, device) for _ in range(G)]
    common = vllm_style_common(step, device)

    def vllm_step():
        return [vb[g].build(common, tables[g], mode, block_size, padded) for g in range(G)]

    row["vllm_style_us"] = 1e6 * host_time(vllm_step, budget * 2, repeats)
    if device == "cuda":
        torch.cuda.synchronize()
        if not quick or S == 5:  # a time-limited run measures the device part at S = 5 only
            per_group = [
                M.Builder(
                    [t],
                    num_spec=S - 1,
                    max_rows=N,
                    max_tokens=max(tokens, 1),
                    mode=mode,
                    block_size=block_size,
                    pad_id=PAD_SLOT,
                )
                for t in tables
            ]
            row.update(device_part(b, per_group, step, kw, vllm_step, N, quick))
    return row


def count_device_ops(fn: Callable[[], Any]) -> Dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = copies = 0
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name.lower()
        if "memcpy" in name or "memset" in name:
            copies += 1
        else:
            kernels += 1
    return {"kernels": kernels, "copies": copies}


def device_part(b: M.Builder, per_group: List[M.Builder], step, kw, vllm_step, N: int, quick: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    b.step(step["qsl"], step["seq_lens"], **kw)
    torch.cuda.synchronize()
    # Device time of the fused launch: a graph of 100 launches, replayed.
    reps = 100
    g = torch.cuda.CUDAGraph()
    b.launch(N)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        for _ in range(reps):
            b.launch(N)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(3 if quick else 10):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / reps)
    out["fused_launch_device_us"] = statistics.median(samples)
    fused = count_device_ops(lambda: b.step(step["qsl"], step["seq_lens"], **kw))
    out["fused_kernels_per_step"] = fused["kernels"]
    out["fused_copies_per_step"] = fused["copies"]
    per_group_ops = count_device_ops(lambda: [pb.step(step["qsl"], step["seq_lens"], **kw) for pb in per_group])
    out["per_group_kernels_per_step"] = per_group_ops["kernels"]
    vl = count_device_ops(vllm_step)
    out["vllm_style_kernels_per_step"] = vl["kernels"]
    out["vllm_style_copies_per_step"] = vl["copies"]
    return out


# ---- report ---------------------------------------------------------------------------------------


def git_sha() -> str:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=root, check=True
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - a tarball without .git
        return "unknown"


def machine() -> Dict[str, Any]:
    info: Dict[str, Any] = dict(platform=platform.platform(), processor=platform.processor(), cpu_count=os.cpu_count())
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            )
            info["driver"] = smi.stdout.strip().splitlines()[0]
        except Exception:  # noqa: BLE001
            pass
    return info


def versions() -> Dict[str, str]:
    return dict(
        python=platform.python_version(),
        torch=torch.__version__,
        numpy=np.__version__,
        gdn=gdn.__version__,
        gdn_cuda=str(gdn._C.built_with_cuda),
    )


def print_table(rows: List[Dict[str, Any]]) -> None:
    cols = [
        "G",
        "N",
        "S",
        "batch",
        "mode",
        "fused_py_us",
        "fused_cpp_us",
        "per_group_cpp_us",
        "per_group_ref_cpp_us",
        "vllm_style_us",
        "fused_launch_device_us",
        "fused_kernels_per_step",
        "per_group_kernels_per_step",
        "vllm_style_kernels_per_step",
    ]
    cols = [c for c in cols if any(c in r for r in rows)]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.2f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (for a time-limited run)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/...)")
    ap.add_argument("--timer", default=None, help="a built benchmarks/cpp metadata_host_timer")
    ap.add_argument("--gdn-dir", default=None, help="directory of gdnConfig.cmake to build it with")
    args = ap.parse_args()
    timer = cpp_timer(args.timer, args.gdn_dir)
    cuda = gdn._C.built_with_cuda and torch.cuda.is_available() and gdn.cuda_device_count() > 0
    device = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    torch.set_num_threads(1)  # the metadata of one step is a single-threaded host job
    rows = []
    for G in (1, 3, 6):
        for N in (1, 64, 256, 1024):
            for S in (2, 5, 9):
                rows.append(run_point(G, N, S, device, quick=args.quick, timer=timer))
                cpp = rows[-1].get("fused_cpp_us")
                print(
                    f"G={G} N={N} S={S}: fused {rows[-1]['fused_py_us']:.2f} us (py), "
                    f"{'-' if cpp is None else f'{cpp:.2f}'} us (C++), vLLM-style "
                    f"{rows[-1]['vllm_style_us']:.1f} us",
                    flush=True,
                )
    extra = [
        run_point(6, 256, 5, device, kind="mixed", quick=args.quick, timer=timer),
        run_point(6, 256, 5, device, mode="align", quick=args.quick, timer=timer),
    ]
    rows += extra
    target = next(r for r in rows if (r["G"], r["N"], r["S"], r["batch"], r["mode"]) == (6, 256, 5, "spec", "none"))
    verdict = dict(
        target=TARGET,
        measured_fused_py_us=target["fused_py_us"],
        measured_fused_cpp_us=target.get("fused_cpp_us"),
        host_time_met_from_python=target["fused_py_us"] <= TARGET["py_host_us"],
        host_time_met_in_cpp=(
            None if "fused_cpp_us" not in target else target["fused_cpp_us"] <= TARGET["cpp_host_us"]
        ),
    )
    if device == "cuda":
        verdict["state_row_launches_per_step"] = target["fused_kernels_per_step"]
    print_table(rows)
    print(json.dumps(verdict, indent=2))
    tag = (
        "cpu"
        if device == "cpu"
        else (
            "h200"
            if "H200" in torch.cuda.get_device_name(0)
            else torch.cuda.get_device_name(0).lower().replace(" ", "_")
        )
    )
    path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"metadata_{tag}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(
            dict(
                benchmark="metadata",
                git_sha=git_sha(),
                machine=machine(),
                versions=versions(),
                device=device,
                quick=args.quick,
                batch_note="spec: pure verify batch staged for a graph of N rows; "
                "mixed: prefills + decodes + spec rows",
                rows=rows,
                verdict=verdict,
            ),
            f,
            indent=1,
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
