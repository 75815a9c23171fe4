"""Where a decode_mtp CTA's time goes: per-phase durations over every CTA of one call.

Needs a build of the module with the kernel's phase probe compiled in (GDN_PHASE in
gdn/decode_mtp/cuda_kernel.cuh), for example

    scripts/dev_build.sh build/probe -DGDN_ENABLE_CUDA=ON -DGDN_BUILD_TESTS=OFF \
        -DGDN_CUDA_ARCHITECTURES=90a -DCMAKE_CUDA_ARCHITECTURES=90a \
        -DCMAKE_CUDA_FLAGS=-DGDN_PHASE_PROBE
    PYTHONPATH=build/probe/pkg python3 benchmarks/probe_phases.py [--json PATH]

Method: the buffer sets and calls of bench_decode_mtp.py (rotating sets, one CUDA graph of
back-to-back calls; then isolated as its --isolated, a 4-byte memcpy before every call). Every
call passes one probe buffer as its error counter; thread 0 of each CTA writes its SM clock at
each phase there, so after the graph the buffer holds the last call's stamps. Phases: wait = entry to the end of
griddepcontrol.wait (time spent waiting for the previous launch), meta = slot ids and token range
loaded, stage = tokens, gates and act(z) staged (the first chunks of the state are in flight
meanwhile), cluster = peers' arrival, chunk0 = first chunk landed, rows = every chunk's rows and
stores, drain = the CTA barrier after the rows, norm = the gated RMSNorm's partials and exchange,
out = outputs stored, exit = the peers' exit barrier; life = after the wait to the exit. Each
phase: 10th, 50th and 90th percentile over the CTAs, in us (SM clocks converted with the clock
rate measured against %globaltimer over each CTA's life).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_decode_mtp as bench  # noqa: E402


PHASES = ["wait", "meta", "stage", "cluster", "chunk0", "rows", "drain", "norm", "out", "exit"]
# The closed form's "cluster" phase in parts (words 11 and 12, stamped by prepare_replay): the pair
# products, the triangular solve, then the tensor-core fragments and the cluster wait.
SOLVE_PARTS = [("pairs", 3, 11), ("solve", 11, 12), ("frags", 12, 4)]
WORDS = 16  # 64-bit words per CTA


def probe_buffer(ctas):
    """An int32 counter followed by WORDS 64-bit words per CTA (8-byte aligned after 2 ints)."""
    return torch.zeros(2 + 2 * WORDS * ctas, dtype=torch.int32, device="cuda")


def run(mode, state, T, B, isolated, H=16, HV=32):
    sdt = bench.DTYPES[state]
    prm = bench.make_params(HV, 7)
    n_sets = 8
    if mode == "replay":
        sets = bench.make_replay_sets(H, HV, B, T, sdt, n_sets, 3000 + B + 10 * T)
    else:
        sets = bench.make_sets(H, HV, B, T, sdt, n_sets, 1000 + B + 10 * T)
    ctas = B * HV * 8  # at most 8 CTAs per head
    buf = probe_buffer(ctas)
    counter = buf[:1]

    call = bench.replay_call if mode == "replay" else bench.gdn_call
    calls = [(lambda st=sets[i % n_sets]: call(st, prm, HV, error_count=counter))
             for i in range(16)]
    bench.ISOLATED = isolated
    med, _, _ = bench.time_graph(calls)
    torch.cuda.synchronize()
    words = buf[2:].view(torch.int64).view(ctas, WORDS).cpu()
    used = words[:, 1] != 0
    w = words[used].tolist()
    if not w:
        raise RuntimeError("no stamps: is the module built with -DGDN_PHASE_PROBE?")
    ghz = statistics.median((r[10] - r[0]) / max(1, r[15] - r[14]) for r in w if r[15] > r[14])

    def pct(xs):
        xs = sorted(xs)
        return [round(xs[int(q * (len(xs) - 1))], 3) for q in (0.1, 0.5, 0.9)]

    row = {"mode": mode, "state": state, "T": T, "B": B, "isolated": isolated,
           "us_graph": round(med * 1e6, 2), "ctas": len(w), "sm_ghz": round(ghz, 3)}
    for k, name in enumerate(PHASES):
        d = [(r[k + 1] - r[k]) / ghz / 1e3 for r in w if r[k + 1] >= r[k] > 0]
        if d:
            row[name] = pct(d)
    for name, a, b in SOLVE_PARTS:
        d = [(r[b] - r[a]) / ghz / 1e3 for r in w if r[11] > 0 and r[b] >= r[a] > 0]
        if d:
            row[name] = pct(d)
    row["life"] = pct([(r[10] - r[1]) / ghz / 1e3 for r in w])
    t0 = min(r[14] for r in w)
    row["start_spread_us"] = round((sorted(r[14] for r in w)[int(0.9 * (len(w) - 1))] - t0) / 1e3,
                                   3)
    row["span_us"] = round((max(r[15] for r in w) - t0) / 1e3, 3)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--configs", nargs="+", metavar="MODE:STATE:T:B",
                    help="configurations to probe, e.g. replay:bf16:4:128 (default: a fixed set of "
                         "small-batch ones)")
    ap.add_argument("--b2b-only", action="store_true", help="back-to-back calls only")
    args = ap.parse_args()
    configs = [("write-all", s, 1, B) for s in ("fp32", "bf16") for B in (1, 8, 32, 128)]
    configs += [("write-all", "fp32", 4, 8), ("replay", "fp32", 4, 8), ("replay", "bf16", 4, 8)]
    if args.configs:
        configs = [(m, st, int(t), int(b)) for m, st, t, b in (c.split(":") for c in args.configs)]
    rows = []
    for isolated in (False,) if args.b2b_only else (False, True):
        for mode, state, T, B in configs:
            r = run(mode, state, T, B, isolated)
            rows.append(r)
            names = PHASES + [name for name, _, _ in SOLVE_PARTS]
            cells = " ".join(f"{p}={r[p][1]:.2f}" for p in names if p in r)
            print(f"{mode:9} {state} T={T} B={B:3} {'iso' if isolated else 'b2b'} "
                  f"{r['us_graph']:6.2f} us ctas={r['ctas']} life={r['life'][1]:.2f} "
                  f"span={r['span_us']:.2f} | {cells}", flush=True)
    if args.json:
        env = bench.environment()
        with open(args.json, "w") as fh:
            json.dump({"environment": env, "method": __doc__, "phases": PHASES,
                       "solve_parts": [name for name, _, _ in SOLVE_PARTS], "rows": rows}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
