"""Probe: how fast can any kernel move decode_mtp's write-all state traffic? A Triton kernel with
no math (each program loads BV rows of a request's source slice and stores them, unchanged, to
the request's T slots: one state read and T state writes, the pattern and bytes of write-all
decode_mtp without activations) gives the stream ceiling of each (T, B, state dtype) row, to read
libgdn's own figures against: how far from what the memory system delivers for this pattern is
the kernel, rather than from the copy-bandwidth floor (one read per write).

Same timing method as bench_decode_mtp.py (rotating pools larger than L2, one CUDA graph,
median per call). Slots as bench_decode_mtp.py: random and distinct, the source column the
accepted count's (random in 1..T), so one of the T stores lands in place.

    python benchmarks/probe_write_stream.py [--tokens 1 2 4 8] [--batches 32 128 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_mtp as bench  # noqa: E402

H, HV = bench.SHAPES["TP1"]
D = bench.DIM


@triton.jit
def _stream(
    pool,
    idx,
    acc,
    slot_stride,
    T: tl.constexpr,
    S: tl.constexpr,
    HVc: tl.constexpr,
    BV: tl.constexpr,
    DIMc: tl.constexpr,
):
    rb = tl.program_id(0)
    head = tl.program_id(1)
    n = head // HVc
    hv = head % HVc
    a = tl.load(acc + n)
    src = tl.load(idx + n * S + a - 1).to(tl.int64)
    rows = rb * BV + tl.arange(0, BV)
    cols = tl.arange(0, DIMc)
    offs = hv * DIMc * DIMc + rows[:, None] * DIMc + cols[None, :]
    x = tl.load(pool + src * slot_stride + offs)
    for t in tl.static_range(T):
        dst = tl.load(idx + n * S + t).to(tl.int64)
        tl.store(pool + dst * slot_stride + offs, x)


def make_set(B, T, dtype, g):
    slots = B * T
    pool = torch.randn(slots, HV, D, D, device="cuda", generator=g).to(dtype)
    idx = torch.randperm(slots, device="cuda", generator=g).to(torch.int32).view(B, T).contiguous()
    acc = torch.randint(1, T + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
    return pool, idx, acc


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--states", nargs="+", default=["fp32", "bf16"])
    ap.add_argument("--json", default="probe_write_stream_h200.json")
    args = ap.parse_args()
    env = bench.environment()
    env["copy_tbps"] = copy_tbps = bench.copy_bandwidth()
    rows = []
    for sdt in args.states:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[sdt]
        esize = torch.finfo(dtype).bits // 8
        for T in args.tokens:
            for B in args.batches:
                g = torch.Generator(device="cuda").manual_seed(1000 * T + B)
                slice_bytes = HV * D * D * esize
                set_bytes = B * T * slice_bytes
                n_sets = bench.rotating_sets(set_bytes)
                sets = [make_set(B, T, dtype, g) for _ in range(n_sets)]
                state_bytes = B * (1 + T) * slice_bytes  # one read, T writes per request
                pool, idx, acc = sets[0]
                want = pool[idx[torch.arange(B, device="cuda"), acc.long() - 1].long()].clone()
                for bv, warps in ((8, 1), (32, 4)):

                    def call(i, bv=bv, warps=warps):
                        pool, idx, acc = sets[i % n_sets]
                        _stream[(D // bv, B * HV)](
                            pool, idx, acc, pool.stride(0), T=T, S=T, HVc=HV, BV=bv, DIMc=D, num_warps=warps
                        )

                    call(0)  # every slot of a request holds its source slice afterwards
                    same = all(torch.equal(pool[idx[:, t].long()], want) for t in range(T))
                    n_calls = max(bench.MIN_CALLS, n_sets)
                    med, lo, hi = bench.time_graph([(lambda i=i: call(i)) for i in range(n_calls)])
                    tbps = state_bytes / med / 1e12
                    rows.append(
                        {
                            "state": sdt,
                            "T": T,
                            "B": B,
                            "rows_per_program": bv,
                            "warps": warps,
                            "sets": n_sets,
                            "us": med * 1e6,
                            "us_min": lo * 1e6,
                            "us_max": hi * 1e6,
                            "state_bytes": state_bytes,
                            "tbps": tbps,
                            "pct_copy": 100 * tbps / copy_tbps,
                            "stores_checked": same,
                        }
                    )
                    print(
                        f"{sdt} T={T} B={B:4d} {bv:2d} rows/{warps} warps {med * 1e6:9.2f} us "
                        f"{tbps:5.2f} TB/s ({100 * tbps / copy_tbps:5.1f}% copy) stores checked: {same}",
                        flush=True,
                    )
                sets = pool = want = None
                torch.cuda.empty_cache()
    with open(args.json, "w") as fh:
        json.dump({"environment": env, "method": __doc__, "results": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
