"""Host cost of one eager decode_mtp call, next to torch's own floor, and where it goes.

Engines run GDN layers eagerly in mixed prefill/decode steps, so the host time of a call is paid
per layer per step. This measures, in one process, the wall time per call of back-to-back eager
calls (``--calls`` per repeat, fewer where a CPU kernel takes milliseconds; median of
``--repeats`` repeats). Each repeat times ``x.add_(1)`` right before the call it is compared
with, so load on the machine moves both; the ratio reported is the median of those paired
ratios. On CUDA the loop is timed without its closing
synchronisation and holds fewer launches than the launch queue, so the host is what is timed even
where the GPU work of a call is longer.

Rows (T tokens per request, B requests; H = 2, HV = 4, K = V = 128 on CUDA, 8 on the CPU):

- ``x.add_(1)`` on a 16-element tensor: torch's floor for one op from Python;
- ``gdn.decode_mtp`` (the Python function) and ``torch.ops.gdn.decode_mtp`` (the torch op, with
  the kernels ``gdn.ops.KERNELS`` names: C++ or the Python function; recorded in the JSON) at
  T in {1, 4} and B in {1, 128}; target: each <= 2x ``x.add_(1)`` at every T and B;
- ``gdn._C.decode_mtp`` with the stream given, positional (the binding alone);
- ``gdn.prefill`` and ``torch.ops.gdn.prefill`` for B requests of T = 64 tokens, B in {1, 8};
- pieces: one ``tensor.__dlpack__()`` (what nanobind's import calls per array),
  ``torch.cuda.current_stream()``, and one array through the binding's argument converter.

On the CPU the kernel itself runs inside the call, so the rows above include the CPU kernel's
work, which grows with B and T; the rows marked "trivial kernel" (one request with T = 0 tokens:
the call imports and validates every argument, then has no token to run) give the host cost of
a call on the CPU.

Usage: python benchmarks/bench_host_overhead.py [--device cpu|cuda] [--calls N] [--repeats R]
                                                [--json PATH]
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
import gdn.ops

H, HV = 2, 4


def _loop_us(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure(fn, floor, device, calls, repeats):
    """(median us per call of `fn`, median us per call of `floor`, median of their ratios), the
    two timed back to back in every repeat."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for f in (fn, floor):  # warm-up
        _loop_us(f, 10)
    sync()
    # Calls that run a CPU kernel of milliseconds get fewer calls per repeat (~20 ms a repeat).
    calls = max(5, min(calls, int(20e3 / max(_loop_us(fn, 3), 1e-3))))
    sync()
    fs, gs, ratios = [], [], []
    for _ in range(repeats):
        g = _loop_us(floor, calls)
        sync()
        f = _loop_us(fn, calls)
        sync()
        fs.append(f)
        gs.append(g)
        ratios.append(f / g)
    return statistics.median(fs), statistics.median(gs), statistics.median(ratios)


def make_call(device, B, T, dim, trivial=False):
    """The three forms of one decode_mtp call on fresh tensors. `trivial`: B requests with no
    tokens (cu_seqlens all zero) over T token rows: every argument is imported and validated, no
    token runs."""
    g = torch.Generator(device=device.type).manual_seed(B * 10 + T)
    L = B * T
    kw = dict(device=device, generator=g)
    mixed_qkv = torch.randn(L, 2 * H * dim + HV * dim, **kw).bfloat16()
    ba = torch.randn(L, 2 * HV, **kw).bfloat16()
    a, b = ba[:, :HV], ba[:, HV:]  # strided views, as an engine passes them
    A_log, dt_bias = 0.5 * torch.randn(HV, **kw), 0.1 * torch.randn(HV, **kw)
    state = 0.01 * torch.randn(B * T + 1, HV, dim, dim, **kw)
    state_indices = torch.arange(1, B * T + 1, device=device, dtype=torch.int32).view(B, T)
    cu_seqlens = (
        torch.zeros(B + 1, device=device, dtype=torch.int32)
        if trivial
        else torch.arange(0, L + 1, T, device=device, dtype=torch.int32)
    )
    out = torch.empty(L, HV, dim, device=device, dtype=torch.bfloat16)
    z = torch.randn(L, HV, dim, **kw).bfloat16()
    norm_weight = torch.ones(dim, device=device)
    acc = torch.ones(B, device=device, dtype=torch.int32)
    pos = (mixed_qkv, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, out)
    kwargs = dict(z=z, norm_weight=norm_weight, num_accepted_tokens=acc)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    binding_args = pos + (z, norm_weight, acc)  # the binding's optional arguments keep their defaults
    return {
        "gdn.decode_mtp": lambda: gdn.decode_mtp(*pos, **kwargs),
        "torch.ops.gdn.decode_mtp": lambda: torch.ops.gdn.decode_mtp(*pos, **kwargs),
        "gdn._C.decode_mtp (stream given)": lambda: gdn._C.decode_mtp(*binding_args, stream=stream),
    }


def make_prefill_call(device, N, T, dim):
    """The function and the op of one prefill call: N requests of T tokens from slots 1..N to
    slots N+1..2N."""
    g = torch.Generator(device=device.type).manual_seed(N * 10 + T + 1)
    L = N * T
    kw = dict(device=device, generator=g)
    mixed_qkv = torch.randn(L, 2 * H * dim + HV * dim, **kw).bfloat16()
    ba = torch.randn(L, 2 * HV, **kw).bfloat16()
    A_log, dt_bias = 0.5 * torch.randn(HV, **kw), 0.1 * torch.randn(HV, **kw)
    state = 0.01 * torch.randn(2 * N + 1, HV, dim, dim, **kw)
    initial = torch.arange(1, N + 1, device=device, dtype=torch.int32)
    final = initial + N
    cu_seqlens = torch.arange(0, L + 1, T, device=device, dtype=torch.int32)
    out = torch.empty(L, HV, dim, device=device, dtype=torch.bfloat16)
    z = torch.randn(L, HV, dim, **kw).bfloat16()
    norm_weight = torch.ones(dim, device=device)
    pos = (mixed_qkv, ba[:, :HV], ba[:, HV:], A_log, dt_bias, state, initial, final, cu_seqlens, out)
    kwargs = dict(z=z, norm_weight=norm_weight)
    return {
        "gdn.prefill": lambda: gdn.prefill(*pos, **kwargs),
        "torch.ops.gdn.prefill": lambda: torch.ops.gdn.prefill(*pos, **kwargs),
    }


def _git_sha():
    sha = os.environ.get("GDN_GIT_SHA")
    if sha:
        return sha
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__))
        ).stdout.strip()
    except OSError:
        return ""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--calls", type=int, default=200, help="back-to-back calls per repeat (keep below the CUDA launch queue, ~1000)"
    )
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    dim = 128 if device.type == "cuda" else 8
    x = torch.zeros(16, device=device)
    floor = lambda: x.add_(1)  # noqa: E731
    t = torch.zeros(16, device=device)

    def timed(fn):
        return measure(fn, floor, device, args.calls, args.repeats)

    pieces = {"tensor.__dlpack__()": timed(lambda: t.__dlpack__())}
    if device.type == "cuda":
        pieces["torch.cuda.current_stream()"] = timed(torch.cuda.current_stream)
    pieces["one array through the binding's converter"] = timed(lambda: gdn._C._accepts_readonly_array(t))
    fast = getattr(gdn._C, "_fast_import_available", None)
    fast_import = bool(fast(t)) if fast else False

    shapes = [(B, T) for T in (1, 4) for B in (1, 128)]
    results = []
    for B, T in shapes:
        for name, fn in make_call(device, B, T, dim).items():
            us, add_us, ratio = timed(fn)
            results.append(
                dict(
                    call=name,
                    B=B,
                    T=T,
                    us=us,
                    add_us=add_us,
                    vs_add=ratio,
                    kernel="cpu, inside the call" if device.type == "cpu" else "cuda, asynchronous",
                )
            )
    # prefill (target: the op within 1.5x x.add_(1)); T = prompt tokens, B = requests.
    for B, T in ((1, 64), (8, 64)):
        for name, fn in make_prefill_call(device, B, T, dim).items():
            us, add_us, ratio = timed(fn)
            kernel = "cpu, inside the call" if device.type == "cpu" else "cuda, asynchronous"
            results.append(dict(call=name, B=B, T=T, us=us, add_us=add_us, vs_add=ratio, kernel=kernel))
    if device.type == "cpu":
        for name, fn in make_call(device, 1, 1, dim, trivial=True).items():
            us, add_us, ratio = timed(fn)
            results.append(
                dict(
                    call=name,
                    B=1,
                    T=1,
                    us=us,
                    add_us=add_us,
                    vs_add=ratio,
                    kernel="trivial (no token runs): host cost only",
                )
            )

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
    print(
        f"device {device} ({where}), torch {torch.__version__}, gdn {gdn.__version__}, "
        f"H = {H}, HV = {HV}, K = V = {dim}; {args.calls} calls x {args.repeats} repeats; "
        f"torch tensors through the DLPack C exchange API: {'yes' if fast_import else 'no'}; "
        f"torch.ops.gdn kernels: {gdn.ops.KERNELS} ({gdn.ops.KERNELS_REASON})"
    )
    if device.type == "cpu":
        print(
            "CPU: the kernel runs inside the call, so rows grow with B and T; the 'trivial "
            "kernel' rows (T = 0: no token runs) are the host cost of a call."
        )
    add_us = statistics.median([p[1] for p in pieces.values()] + [r["add_us"] for r in results])
    print(f"  {'x.add_(1) (median of all paired timings)':<44} {add_us:8.2f} us")
    for name, (us, _, ratio) in pieces.items():
        print(f"  {name:<44} {us:8.2f} us  ({ratio:.2f}x add_)")
    for r in results:
        label = f"{r['call']}{' [trivial kernel]' if r['kernel'].startswith('trivial') else ''}"
        print(
            f"  {label:<44} B={r['B']:<3} T={r['T']}: {r['us']:8.2f} us  "
            f"({r['vs_add']:.2f}x add_ at {r['add_us']:.2f} us)"
        )
    if args.json:
        doc = {
            "environment": {
                "git_sha": _git_sha(),
                "device": str(device),
                "device_name": where,
                "torch": torch.__version__,
                "gdn": gdn.__version__,
                "built_with_cuda": bool(gdn._C.built_with_cuda),
                "python": platform.python_version(),
                "cpu": platform.processor(),
                "cpus": os.cpu_count(),
                "H": H,
                "HV": HV,
                "K": dim,
                "V": dim,
                "calls": args.calls,
                "repeats": args.repeats,
                "fast_import": fast_import,
                "torch_op_kernels": gdn.ops.KERNELS,
                "torch_op_kernels_reason": gdn.ops.KERNELS_REASON,
            },
            "add_us": add_us,
            "pieces": {
                name: {"us": us, "add_us": add_us, "vs_add": ratio} for name, (us, add_us, ratio) in pieces.items()
            },
            "results": results,
            "method": __doc__,
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
