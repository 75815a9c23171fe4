"""Host cost of one eager decode_mtp call, next to torch's own floor, and where it goes.

Engines run GDN layers eagerly in mixed prefill/decode steps, so the host time of a call is paid
per layer per step. This measures, in one process, the wall time per call of N back-to-back calls
(one synchronisation at the end, so on CUDA the GPU work overlaps and the host is what is timed):

- ``x.add_(1)`` on a small tensor: torch's floor for launching one kernel from Python;
- ``gdn.decode_mtp`` (the Python function), ``torch.ops.gdn.decode_mtp`` (the custom op) and
  ``gdn._C.decode_mtp`` with the stream given (the binding alone);
- the pieces: ``torch.cuda.current_stream()``, one ``tensor.__dlpack__()``.

On the CPU the kernel itself runs inside the call, so shapes are tiny (K = V = 8) and the numbers
are an upper bound on the host overhead. Target (GPU): each gdn call <= 2x ``x.add_(1)``.

Usage: python benchmarks/bench_host_overhead.py [--device cpu|cuda] [--calls N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

import torch

import gdn


def per_call_us(fn, device, calls, repeats=7):
    """Median over repeats of the wall time per call of `calls` back-to-back calls."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(max(calls // 10, 10)):  # warm-up
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def make_call(device, B, T, dim):
    H, HV = 2, 4
    g = torch.Generator(device=device.type).manual_seed(B * 10 + T)
    L = B * T
    kw = dict(device=device, generator=g)
    args = dict(
        mixed_qkv=torch.randn(L, 2 * H * dim + HV * dim, **kw).bfloat16(),
        ba=torch.randn(L, 2 * HV, **kw).bfloat16(),
        A_log=0.5 * torch.randn(HV, **kw), dt_bias=0.1 * torch.randn(HV, **kw),
        state=0.01 * torch.randn(B * T + 1, HV, dim, dim, **kw),
        state_indices=torch.arange(1, B * T + 1, device=device, dtype=torch.int32).view(B, T),
        cu_seqlens=torch.arange(0, L + 1, T, device=device, dtype=torch.int32),
        out=torch.empty(L, HV, dim, device=device, dtype=torch.bfloat16),
        z=torch.randn(L, HV, dim, **kw).bfloat16(), norm_weight=torch.ones(dim, device=device),
        acc=torch.ones(B, device=device, dtype=torch.int32),
    )
    a, b = args["ba"][:, :HV], args["ba"][:, HV:]
    pos = (args["mixed_qkv"], a, b, args["A_log"], args["dt_bias"], args["state"],
           args["state_indices"], args["cu_seqlens"], args["out"])
    kwargs = dict(z=args["z"], norm_weight=args["norm_weight"], num_accepted_tokens=args["acc"])
    stream = torch.cuda.current_stream().cuda_stream if device.type == "cuda" else None
    return {
        "gdn.decode_mtp": lambda: gdn.decode_mtp(*pos, **kwargs),
        "torch.ops.gdn.decode_mtp": lambda: torch.ops.gdn.decode_mtp(*pos, **kwargs),
        "gdn._C.decode_mtp (stream given)": lambda: gdn._C.decode_mtp(*pos, **kwargs, stream=stream),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dim = 128 if device.type == "cuda" else 8
    x = torch.zeros(16, device=device)
    t = torch.zeros(16, device=device)
    rows = [("x.add_(1)", per_call_us(lambda: x.add_(1), device, args.calls)),
            ("tensor.__dlpack__()", per_call_us(lambda: t.__dlpack__(), device, args.calls))]
    if device.type == "cuda":
        rows.append(("torch.cuda.current_stream()",
                     per_call_us(torch.cuda.current_stream, device, args.calls)))
    floor = rows[0][1]
    results = []
    for B, T in ((1, 1), (1, 4), (8, 1), (8, 4)):
        for name, fn in make_call(device, B, T, dim).items():
            us = per_call_us(fn, device, args.calls)
            results.append(dict(call=name, B=B, T=T, us=us, vs_add=us / floor))
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else platform.processor()}), "
          f"torch {torch.__version__}, gdn {gdn.__version__}, K = V = {dim}")
    for name, us in rows:
        print(f"  {name:<34} {us:8.2f} us")
    for r in results:
        print(f"  {r['call']:<34} B={r['B']} T={r['T']}: {r['us']:8.2f} us  ({r['vs_add']:.1f}x add_)")
    if args.json:
        sha = os.environ.get("GDN_GIT_SHA") or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        doc = {"environment": {"git_sha": sha, "device": str(device), "torch": torch.__version__,
                               "cpu": platform.processor(), "cpus": os.cpu_count(),
                               "python": platform.python_version(), "K": dim, "calls": args.calls},
               "reference_us": dict(rows), "results": results, "method": __doc__}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
