"""What a head split costs with and without its cross-CTA gated RMSNorm (write-all decode_mtp).

A split head (CTAs of 128 / split rows) is launched as a thread-block cluster so that its CTAs can
exchange their norm partials. This probe times write-all at a pinned split with the norm on (the
library's launch) and off (norm_weight and z absent: out = o, no exchange). The library's launcher
clusters a split head either way; run against a build whose launcher drops the cluster when there
is no norm (as for benchmarks/results/split_fp32_drafts_h200.json, run1), the norm-off rows show
what the one-group-per-warp mapping (split 4: each of a CTA's 4 warps holds one 8-row group) gains
before any cross-CTA norm is paid.

    PYTHONPATH=build/gpu/pkg python3 benchmarks/probe_split_norm.py --json out.json
"""
import argparse
import json

import torch

import bench_decode_mtp as bd


def time_variant(shape, B, T, sdt, split, norm):
    H, HV = bd.ALL_SHAPES[shape]
    state_dtype = bd.DTYPES[sdt]
    set_bytes = B * T * HV * bd.DIM * bd.DIM * torch.finfo(state_dtype).bits // 8
    n_sets = bd.rotating_sets(set_bytes)
    sets = bd.make_sets(H, HV, B, T, state_dtype, n_sets, 1000 + B + 10 * T)
    prm = bd.make_params(HV, 7)
    if not norm:  # no norm, no gate (z needs norm_weight)
        prm["norm_weight"] = None
        for st in sets:
            st["z"] = None
    n_calls = max(bd.MIN_CALLS, n_sets)
    calls = [(lambda st=sets[i % n_sets]: bd.gdn_call(st, prm, HV, split)) for i in range(n_calls)]
    med, lo, hi = bd.time_graph(calls)
    nbytes = bd.gdn_bytes(H, HV, B, T, state_dtype)
    sets = None
    torch.cuda.empty_cache()
    return dict(shape=shape, B=B, T=T, state=sdt, split=split, norm=norm, us=med * 1e6,
                us_min=lo * 1e6, us_max=hi * 1e6, tbps=nbytes / med / 1e12)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--batches", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--states", nargs="+", default=["fp32"])
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--json")
    args = ap.parse_args()
    env = bd.environment()
    copy = bd.copy_bandwidth()
    rows = []
    for sdt in args.states:
        for T in args.tokens:
            for B in args.batches:
                for norm in (True, False):
                    for split in args.splits:
                        r = time_variant("TP1", B, T, sdt, split, norm)
                        r["pct_copy"] = 100 * r["tbps"] / copy
                        rows.append(r)
                        print(f"{sdt} T={T} B={B:4d} norm={int(norm)} split={split}: "
                              f"{r['us']:9.2f} us ({r['pct_copy']:.1f} % of copy)", flush=True)
    if args.json:
        json.dump({"environment": env, "copy_tbps": copy, "rows": rows}, open(args.json, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
