"""Probe: does the pool's slot stride set the speed of an fp32 state stream?

bench_decode_mtp.py with --shapes ratio4 (H = 16, HV = 64: a 4 MiB fp32 slot) ran write-all and
replay at 39-46 % of copy bandwidth from B = 64 on, where TP1 (HV = 32, a 2 MiB slot) with the
same number of heads and the same bytes runs at 89-93 %; FLA's dense kernel, which reads a
contiguous initial state and writes a new one, slowed down the same way. This probe times the
same bytes with the slot stride as the only change, next to torch's own gather of the same slots:

  contiguous  pool [slots, HV, 128, 128] (bench_decode_mtp.py's layout)
  padded      the same pool inside [slots, HV + 1, 128, 128]: slot stride one head larger
  gather      torch.index_select of the request slots into a dense tensor (one read, one write)
  copy        a dense copy of the same bytes (dst.copy_(src))

Same timing method as bench_decode_mtp.py (rotating sets larger than L2, one CUDA graph, median
per call); write-all decode_mtp at T = 1, fp32 state, bf16 activations.

    python benchmarks/probe_pool_stride.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_mtp as bench  # noqa: E402

import gdn  # noqa: E402

DIM = bench.DIM
# (H, HV, B): TP1 and HV = 64 at equal heads (4096) and at 2048 heads, and HV = 64 at B = 256.
CASES = [(16, 32, 128), (16, 64, 64), (16, 64, 32), (16, 32, 64), (16, 64, 256), (16, 32, 512)]


def make_sets(H, HV, B, pad, n_sets, seed):
    """bench_decode_mtp.make_sets at T = 1, fp32, with the pool's slot stride `pad` heads larger."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    alloc = torch.randn(n_sets, B, HV + pad, DIM, DIM, device="cuda", generator=g).mul_(0.01)
    pool = alloc[:, :, :HV]
    qkv = torch.randn(n_sets, B, 2 * H * DIM + HV * DIM, device="cuda", generator=g).bfloat16()
    ba = torch.randn(n_sets, B, 2 * HV, device="cuda", generator=g).bfloat16()
    z = torch.randn(n_sets, B, HV, DIM, device="cuda", generator=g).bfloat16()
    out = torch.empty(n_sets, B, HV, DIM, device="cuda", dtype=torch.bfloat16)
    idx = torch.randperm(B, device="cuda", generator=g).to(torch.int32).view(B, 1)
    cu = torch.arange(0, B + 1, device="cuda", dtype=torch.int32)
    acc = torch.ones(B, device="cuda", dtype=torch.int32)
    return [{"pool": pool[i], "mixed_qkv": qkv[i], "ba": ba[i], "z": z[i], "out": out[i],
             "idx": idx, "acc": acc, "cu": cu} for i in range(n_sets)]


def row(name, H, HV, B, med, nbytes, copy_tbps):
    tbps = nbytes / med / 1e12
    rec = dict(variant=name, H=H, HV=HV, B=B, heads=B * HV, us=med * 1e6, tbps=tbps,
               pct_copy=100 * tbps / copy_tbps)
    print(f"{name:10} H={H} HV={HV:3} B={B:4}: {rec['us']:9.2f} us {tbps:5.2f} TB/s "
          f"({rec['pct_copy']:5.1f} % copy)", flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="benchmarks/results/pool_stride_h200.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("probe_pool_stride: no CUDA device")
    env = bench.environment()
    env["copy_tbps"] = copy_tbps = bench.copy_bandwidth()
    prm_cache = {}
    rows = []
    for H, HV, B in CASES:
        prm = prm_cache.setdefault(HV, bench.make_params(HV, 7))
        set_bytes = B * HV * DIM * DIM * 4
        n_sets = bench.rotating_sets(set_bytes)
        n_calls = max(bench.MIN_CALLS, n_sets)
        nbytes = bench.gdn_bytes(H, HV, B, 1, torch.float32)
        for name, pad in (("contiguous", 0), ("padded", 1)):
            sets = make_sets(H, HV, B, pad, n_sets, 1000 + B)
            calls = [(lambda st=sets[i % n_sets]: bench.gdn_call(st, prm, HV))
                     for i in range(n_calls)]
            med, _, _ = bench.time_graph(calls)
            rows.append(row(name, H, HV, B, med, nbytes, copy_tbps))
            if pad == 0:  # torch's gather and copy of the same state bytes
                dst = torch.empty(n_sets, B, HV, DIM, DIM, device="cuda")
                idx = sets[0]["idx"].view(-1).long()
                calls = [(lambda i=i: torch.index_select(sets[i % n_sets]["pool"], 0, idx,
                                                         out=dst[i % n_sets]))
                         for i in range(n_calls)]
                med, _, _ = bench.time_graph(calls)
                rows.append(row("gather", H, HV, B, med, 2 * set_bytes, copy_tbps))
                calls = [(lambda i=i: dst[i % n_sets].copy_(sets[i % n_sets]["pool"]))
                         for i in range(n_calls)]
                med, _, _ = bench.time_graph(calls)
                rows.append(row("copy", H, HV, B, med, 2 * set_bytes, copy_tbps))
                dst = None
            sets = None
            torch.cuda.empty_cache()
    doc = {"environment": env, "method": __doc__, "gdn": gdn.__version__, "rows": rows}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=1)


if __name__ == "__main__":
    main()
