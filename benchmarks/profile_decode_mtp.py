"""Runs one decode_mtp configuration (its replay-verify form, or its FLA baseline) a few times,
for a profiler:

    ncu -k regex:"write_all_kernel|replay_tokens_kernel|replay_closed_form_kernel" \
        --launch-skip 2 --launch-count 1 \
        python3 benchmarks/profile_decode_mtp.py --shape TP1 --B 128 --T 1 --state fp32

(the regular expression names the three decode_mtp kernels; --impl replay also launches the
window save after it).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_mtp as bench  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="TP1", choices=list(bench.SHAPES))
    ap.add_argument("--B", type=int, default=128)
    ap.add_argument("--T", type=int, default=1)
    ap.add_argument("--state", default="fp32", choices=list(bench.DTYPES))
    ap.add_argument("--impl", default="gdn", choices=["gdn", "replay", "fla"])
    ap.add_argument("--calls", type=int, default=4)
    args = ap.parse_args()
    H, HV = bench.SHAPES[args.shape]
    prm = bench.make_params(HV, 7)
    if args.impl == "replay":
        st = bench.make_replay_sets(H, HV, args.B, args.T, bench.DTYPES[args.state], 1, 11)[0]
        for _ in range(args.calls):
            bench.replay_call(st, prm, HV)
        torch.cuda.synchronize()
        return
    st = bench.make_sets(H, HV, args.B, args.T, bench.DTYPES[args.state], 1, 11)[0]
    f = bench.fla_inputs(st, prm, H, HV, args.B, args.T) if args.impl == "fla" else None
    for _ in range(args.calls):
        if f is None:
            bench.gdn_call(st, prm, HV)
        else:
            bench.fla_call(f, st, prm, args.T)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
