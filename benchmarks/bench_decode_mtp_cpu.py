"""CPU decode_mtp throughput: Qwen3-Next TP4 shape (H=4, HV=8, K=V=128), fp32 state, bf16 activations.

Reports per call: median time, tokens/s and GB/s of state traffic (1 state read + T state writes per
request, the write-every-token scheme). Pools rotate over distinct slots (>= 256 MiB) so states
stream from memory rather than cache.

    python benchmarks/bench_decode_mtp_cpu.py [--json benchmarks/results/decode_mtp_cpu.json]
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


def run_case(B: int, T: int, H=4, HV=8, K=128, V=128, repeats=7, pool_bytes=256 << 20):
    S = max(T, 1)
    state_bytes = HV * K * V * 4
    sets = max(2, pool_bytes // (B * S * state_bytes))
    slots = sets * B * S
    g = torch.Generator().manual_seed(B * 10 + T)
    state = 0.01 * torch.randn(slots, HV, V, K, generator=g)
    L = B * T
    mixed_qkv = torch.randn(L, 2 * H * K + HV * V, generator=g).bfloat16()
    ba = torch.randn(L, 2 * HV, generator=g).bfloat16()
    a, b = ba[:, :HV], ba[:, HV:]
    A_log = 0.5 * torch.randn(HV, generator=g)
    dt_bias = 0.1 * torch.randn(HV, generator=g)
    z = torch.randn(L, HV, V, generator=g).bfloat16()
    w = torch.randn(V, generator=g)
    out = torch.empty(L, HV, V, dtype=torch.bfloat16)
    cu = torch.arange(0, L + 1, T, dtype=torch.int32)
    acc = torch.ones(B, dtype=torch.int32)
    index_sets = [torch.arange(s * B * S, (s + 1) * B * S, dtype=torch.int32).view(B, S) for s in range(sets)]

    def call(i):
        gdn.decode_mtp(
            mixed_qkv,
            a,
            b,
            A_log,
            dt_bias,
            state,
            index_sets[i % sets],
            cu,
            out,
            z=z,
            norm_weight=w,
            num_accepted_tokens=acc,
        )

    call(0)  # warm-up
    calls = max(1, int(0.2 / max(1e-4, _time_one(call))))
    times = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            call(r * calls + i + 1)
        times.append((time.perf_counter() - t0) / calls)
    t = statistics.median(times)
    traffic = B * (1 + T) * state_bytes
    return {
        "B": B,
        "T": T,
        "H": H,
        "HV": HV,
        "K": K,
        "V": V,
        "state_dtype": "float32",
        "activation_dtype": "bfloat16",
        "us_per_call": t * 1e6,
        "tokens_per_s": B * T / t,
        "state_GB_per_s": traffic / t / 1e9,
        "min_us": min(times) * 1e6,
        "max_us": max(times) * 1e6,
    }


def _time_one(call) -> float:
    t0 = time.perf_counter()
    call(1)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write results here")
    args = p.parse_args()
    rows = []
    print(f"{'B':>4} {'T':>2} {'us/call':>10} {'tokens/s':>10} {'state GB/s':>10}")
    for B in (1, 8, 32):
        for T in (1, 4):
            r = run_case(B, T)
            rows.append(r)
            print(f"{B:4d} {T:2d} {r['us_per_call']:10.1f} {r['tokens_per_s']:10.0f} {r['state_GB_per_s']:10.2f}")
    if args.json:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(os.path.abspath(__file__))
        ).stdout.strip()
        meta = {
            "git_sha": sha,
            "gdn_version": gdn.__version__,
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "python": platform.python_version(),
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
