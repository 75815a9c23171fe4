"""Probe: is it the pattern of state accesses, rather than the kernel, that holds fp32 T = 1
decode below FLA's dense kernel (90-94 % of copy bandwidth against 97-101 %)? Times
gdn.decode_mtp at T = 1 with an fp32 state on the same requests three ways:

  random    slots a random permutation of the pool, state updated in place (bench_decode_mtp.py)
  ordered   request i in slot i, in place (the layout of FLA's dense initial state)
  copy-out  two columns per request (S = 2, accepted count 2): the state is read from column 1
            and written to column 0, so the bytes read and the bytes written are different
            memory, as with FLA's dense kernel, which writes a new final state

All three move the same bytes and must give bit-identical outputs (checked before timing). Same
timing method as bench_decode_mtp.py (rotating buffer sets, one CUDA graph, median per call).

    python benchmarks/probe_state_access.py [--batches 128 512] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_mtp as bench  # noqa: E402

H, HV = bench.SHAPES["TP1"]
D = bench.DIM
MODES = ("random", "ordered", "copy-out")


def make_set(B, mode, logical, g):
    """One layer's buffers: the pool holding `logical` (B initial states) where `mode` reads them."""
    cols = 2 if mode == "copy-out" else 1
    slots = B * cols
    pool = torch.randn(slots, HV, D, D, device="cuda", generator=g).mul_(0.01)
    if mode == "ordered":
        idx = torch.arange(B, device="cuda", dtype=torch.int32).view(B, 1)
    else:
        idx = torch.randperm(slots, device="cuda", generator=g).to(torch.int32).view(B, cols)
    pool[idx[:, -1].long()] = logical
    acc = torch.full((B,), cols, device="cuda", dtype=torch.int32)
    return {"pool": pool, "idx": idx, "acc": acc}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--json", default="probe_state_access_h200.json")
    args = ap.parse_args()
    env = bench.environment()
    env["copy_tbps"] = copy_tbps = bench.copy_bandwidth()
    prm = bench.make_params(HV, 7)
    rows = []
    for B in args.batches:
        g = torch.Generator(device="cuda").manual_seed(3000 + B)
        set_bytes = B * HV * D * D * 4
        n_sets = bench.rotating_sets(set_bytes)
        # The benchmark's own buffer sets (T = 1) give the activations and, in their pools, the
        # states the requests start from; each mode moves those states to its own slots.
        base = bench.make_sets(H, HV, B, 1, torch.float32, n_sets, 3000 + B)
        logical = [st["pool"][st["idx"][:, 0].long()] for st in base]
        nbytes = bench.gdn_bytes(H, HV, B, 1, torch.float32)
        ref_out = None
        for mode in MODES:
            sets = [dict(base[i], **make_set(B, mode, logical[i], g)) for i in range(n_sets)]
            sets[0]["out"].fill_(float("nan"))
            bench.gdn_call(sets[0], prm, HV)
            torch.cuda.synchronize()
            out = sets[0]["out"].clone()
            if ref_out is None:
                ref_out = out
            same = bool(torch.equal(out, ref_out))
            written = sets[0]["pool"][sets[0]["idx"][:, 0].long()]
            n_calls = max(bench.MIN_CALLS, n_sets)
            med, lo, hi = bench.time_graph(
                [(lambda i=i: bench.gdn_call(sets[i % n_sets], prm, HV)) for i in range(n_calls)])
            tbps = nbytes / med / 1e12
            rows.append({"mode": mode, "state": "fp32", "T": 1, "B": B, "sets": n_sets,
                         "us": med * 1e6, "us_min": lo * 1e6, "us_max": hi * 1e6, "tbps": tbps,
                         "pct_copy": 100 * tbps / copy_tbps, "outputs_identical": same,
                         "state_written_finite": bool(torch.isfinite(written).all())})
            print(f"fp32 T=1 B={B:4d} {mode:9s} {med * 1e6:9.2f} us {tbps:5.2f} TB/s "
                  f"({100 * tbps / copy_tbps:5.1f}% copy) outputs identical: {same}", flush=True)
            sets = None
            torch.cuda.empty_cache()
    with open(args.json, "w") as fh:
        json.dump({"environment": env, "method": __doc__, "results": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
