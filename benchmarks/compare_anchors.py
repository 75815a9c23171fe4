"""Verdict table for decode_mtp: libgdn and FLA from one bench_decode_mtp.py run, next to vLLM's CUDA
kernel as measured on the same kind of GPU (docs performance.md §5; vLLM cannot be run here), the
byte-model floor at the measured copy bandwidth of the H200 (4.26 TB/s), and the target: at least
5 % faster than the best anchor, or within 3 % of the floor. A second table sets the replay-verify
rows of the same run against write-every-token libgdn, the best anchor, the floor of the "fold,
fused" byte model and the replay targets (docs/performance.md §5). With --ceiling, the first
table also shows the stream ceiling of each row that probe_write_stream.py measured: the fastest
no-math kernel moving the same state bytes (one read, T in-place writes of random slots; no
activations), from its own run on the same kind of GPU. Where the run timed FLA's whole layer call
(--fla-job), a table sets libgdn against it. A further table sets every TP-shard shape's
write-all rows against TP1 at the same number of (request, value head) pairs, per byte (effective
TB/s): the rule that a shard is no slower per byte than the TP1 shape.

Usage: python benchmarks/compare_anchors.py benchmarks/results/decode_mtp_h200.json \
           [--ceiling benchmarks/results/probe_write_stream_h200.json]
"""

from __future__ import annotations

import argparse
import json
import math

COPY_TBPS = 4.26
DIM = 128
# vLLM's fused MTP CUDA kernel, TP1 shape, µs per call (performance.md §5, same method).
VLLM_US = {
    ("fp32", 1, 1): 8.29,
    ("fp32", 1, 8): 14.2,
    ("fp32", 1, 32): 40.1,
    ("fp32", 1, 128): 146.9,
    ("fp32", 1, 512): 571.3,
    ("fp32", 2, 128): 224.5,
    ("fp32", 4, 1): 14.97,
    ("fp32", 4, 8): 28.6,
    ("fp32", 4, 32): 101.9,
    ("fp32", 4, 128): 381.7,
    ("fp32", 4, 512): 1502.0,
    ("fp32", 8, 128): 700.6,
    ("bf16", 1, 1): 7.81,
    ("bf16", 1, 8): 10.4,
    ("bf16", 1, 32): 24.8,
    ("bf16", 1, 128): 86.1,
    ("bf16", 1, 512): 328.0,
    ("bf16", 2, 128): 123.8,
    ("bf16", 4, 8): 18.7,
    ("bf16", 4, 128): 202.9,
    ("bf16", 4, 512): 793.5,
    ("bf16", 8, 128): 380.1,
}


def floor_us(r):
    """Byte-model floor of one call: 1 state read + T writes + T x activations (bf16)."""
    H, HV, B, T = r["H"], r["HV"], r["B"], r["T"]
    state = HV * DIM * DIM * (4 if r["state"] == "fp32" else 2)
    act = ((2 * H * DIM + HV * DIM) + 2 * HV + 2 * HV * DIM) * 2
    return B * ((1 + T) * state + T * act) / (COPY_TBPS * 1e12) * 1e6


def stream_ceilings(path):
    """(state, T, B) -> the fastest time of probe_write_stream.py's kernels for that row, in us."""
    if not path:
        return {}
    best = {}
    for r in json.load(open(path))["results"]:
        key = (r["state"], r["T"], r["B"])
        best[key] = min(best.get(key, float("inf")), r["us"])
    return best


def timed_rows(doc, shape):
    """The timed rows of `shape` at the launcher's own split, by (impl, state, T, B)."""
    return {
        (r["impl"], r["state"], r["T"], r["B"]): r
        for r in doc["results"]
        if r.get("shape") == shape and r.get("split") is None and "us" in r
    }


def rows(doc, shape="TP1"):
    by = timed_rows(doc, shape)
    out = []
    for (impl, state, T, B), r in sorted(by.items(), key=lambda kv: (kv[0][1] != "fp32", kv[0][2], kv[0][3])):
        if impl != "gdn":
            continue
        fla = by.get(("fla", state, T, B))
        vllm = VLLM_US.get((state, T, B))
        anchors = [x for x in (fla["us"] if fla else None, vllm) if x is not None]
        best = min(anchors) if anchors else None
        fl = floor_us(r)
        # The target: at most the larger of the two bounds.
        needed = max(1.03 * fl, 0.95 * best if best is not None else 0.0)
        out.append(
            dict(
                state=state,
                T=T,
                B=B,
                floor=fl,
                needed=needed,
                gdn=r["us"],
                pct=r["pct_copy"],
                fla=fla["us"] if fla else None,
                vllm=vllm,
                best=best,
                vs_best=(best / r["us"]) if best else None,
                verdict="met" if r["us"] <= needed else "not met",
            )
        )
    return out


# Replay-verify targets (µs, TP1): (state, T, B) -> target.
REPLAY_TARGETS = {("fp32", 4, 128): 150.0, ("fp32", 8, 128): 160.0, ("bf16", 4, 128): 80.0, ("fp32", 4, 8): 12.0}


def replay_table(doc, shape):
    by = timed_rows(doc, shape)
    print(
        "\n| state | T | B | replay µs | floor µs (fold, fused) | write-all libgdn µs | best anchor µs "
        "| anchor / replay | target |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for (impl, state, T, B), r in sorted(by.items(), key=lambda kv: (kv[0][1] != "fp32", kv[0][2], kv[0][3])):
        if impl != "replay":
            continue
        gdn = by.get(("gdn", state, T, B))
        fla = by.get(("fla", state, T, B))
        anchors = [x for x in (fla["us"] if fla else None, VLLM_US.get((state, T, B))) if x is not None]
        best = min(anchors) if anchors else None
        floor = r["bytes"] / (COPY_TBPS * 1e12) * 1e6
        target = REPLAY_TARGETS.get((state, T, B))
        verdict = "—" if target is None else ("met" if r["us"] <= target else f"not met (≤ {target:g})")
        us = r["us"]
        best_s = "—" if best is None else f"{best:.2f}"
        ratio = "—" if best is None else f"{best / us:.2f}x"
        print(f"| {state} | {T} | {B} | {us:.2f} | {floor:.1f} | {gdn['us']:.2f} | {best_s} | {ratio} | {verdict} |")


def fla_job_table(doc, shape):
    """libgdn against FLA's whole layer call of the same job (bench_decode_mtp.py --fla-job: the
    slot-gathered in-place kernel, fp32 T = 1 included, then FLA's gated RMSNorm), next to the
    FLA anchor of the verdict table (which at fp32 T = 1 is the dense kernel without slot indirection)."""
    by = timed_rows(doc, shape)
    keys = sorted(
        (k[1:] for k in by if k[0] == "fla_job" and ("gdn",) + k[1:] in by), key=lambda k: (k[0] != "fp32", k[1], k[2])
    )
    if not keys:
        return
    print("\n| state | T | B | libgdn µs | FLA anchor µs | FLA slot pool + gated RMSNorm µs | that / libgdn |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for state, T, B in keys:
        gdn, job = by[("gdn", state, T, B)]["us"], by[("fla_job", state, T, B)]["us"]
        fla = by.get(("fla", state, T, B))
        fla_s = "—" if fla is None else f"{fla['us']:.2f}"
        print(f"| {state} | {T} | {B} | {gdn:.2f} | {fla_s} | {job:.2f} | {job / gdn:.2f}x |")


def tp1_tbps_at(tp1, state, T, heads):
    """TP1's effective TB/s for (state, T) at `heads` (request, value head) pairs: measured when TP1
    has that many heads, else interpolated linearly in log(heads) between its two nearest head
    counts (None outside TP1's range). Returns (TB/s, "exact" | "interpolated")."""
    pts = sorted((h, r["tbps"]) for (st, t, h), r in tp1.items() if st == state and t == T)
    if heads in dict(pts):
        return dict(pts)[heads], "exact"
    for (h0, y0), (h1, y1) in zip(pts, pts[1:]):
        if h0 < heads < h1:
            f = math.log(heads / h0) / math.log(h1 / h0)
            return y0 + f * (y1 - y0), "interpolated"
    return None, None


def write_all_rows(doc):
    """The timed write-all rows of a result file at the launcher's own split."""
    return [r for r in doc["results"] if r.get("split") is None and r.get("impl") == "gdn" and "us" in r]


def tp1_by_heads(rows):
    """TP1's rows among `rows` by (state, T, heads)."""
    return {(r["state"], r["T"], r["B"] * r["HV"]): r for r in rows if r["shape"] == "TP1"}


def shard_table(doc, other=None):
    """The per-byte rule: each TP-shard shape's write-all rows against TP1 at the same number
    of (request, value head) pairs, in effective TB/s (bytes of the byte model per µs). `other`: a
    second result file whose TP1 rows stand in at head counts this run's TP1 lacks."""
    res = write_all_rows(doc)
    tp1 = tp1_by_heads(res)
    other_tp1 = tp1_by_heads(write_all_rows(other)) if other else {}
    shards = sorted({r["shape"] for r in res} - {"TP1"})
    if not shards:
        return
    print("\n| shape (H, HV) | state | T | B | heads | TB/s | TP1 TB/s at those heads | shard / TP1 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for r in sorted(
        (r for r in res if r["shape"] in shards), key=lambda r: (r["shape"], r["state"] != "fp32", r["T"], r["B"])
    ):
        heads = r["B"] * r["HV"]
        key = (r["state"], r["T"], heads)
        if key not in tp1 and key in other_tp1:
            ref, how = other_tp1[key]["tbps"], "other run"
        else:
            ref, how = tp1_tbps_at(tp1, r["state"], r["T"], heads)
        if ref is None:
            continue
        ratios.append((r["tbps"] / ref, how))
        mark = {"exact": "", "other run": " (other run)", "interpolated": " (interp.)"}[how]
        print(
            f"| {r['shape']} ({r['H']}, {r['HV']}) | {r['state']} | {r['T']} | {r['B']} | {heads} | "
            f"{r['tbps']:.2f} | {ref:.2f}{mark} | {r['tbps'] / ref:.3f} |"
        )
    for how in ("exact", "other run", "interpolated"):
        sel = [x for x, h in ratios if h == how]
        if sel:
            print(
                f"\n{how}: {len(sel)} rows, shard / TP1 median {sorted(sel)[len(sel) // 2]:.3f}, "
                f"min {min(sel):.3f}; below 0.97: {sum(x < 0.97 for x in sel)}"
            )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", help="a bench_decode_mtp.py result file")
    ap.add_argument("--shape", default="TP1")
    ap.add_argument("--ceiling", help="a probe_write_stream.py result file (adds its stream ceilings)")
    ap.add_argument(
        "--tp1-other",
        help="a bench_decode_mtp.py result file whose TP1 write-all rows "
        "stand in at head counts the main file's TP1 lacks",
    )
    args = ap.parse_args()
    doc = json.load(open(args.json))
    env = doc["environment"]
    print(
        f"{env['gpu']} · libgdn {env['git_sha'][:10]} · torch {env['torch']} · CUDA {env['cuda']} · "
        f"fla {env.get('fla')} · copy {env['copy_tbps']:.2f} TB/s\n"
    )
    ceil = stream_ceilings(args.ceiling)
    extra_head = " stream ceiling µs | libgdn / ceiling |" if ceil else ""
    print(
        "| state | T | B | floor µs | libgdn µs (% copy) | FLA µs | vLLM µs (§5) | best anchor / libgdn "
        "| target µs | verdict |" + extra_head
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|" + ("---:|---:|" if ceil else ""))
    fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
    met = 0
    rs = rows(doc, args.shape)
    for r in rs:
        met += r["verdict"] == "met"
        ratio = "—" if r["vs_best"] is None else f"{r['vs_best']:.2f}x"
        extra = ""
        if ceil:
            c = ceil.get((r["state"], r["T"], r["B"]))
            extra = " — | — |" if c is None else f" {c:.2f} | {r['gdn'] / c:.3f} |"
        print(
            f"| {r['state']} | {r['T']} | {r['B']} | {r['floor']:.1f} | {r['gdn']:.2f} ({r['pct']:.0f} %) | "
            f"{fmt(r['fla'])} | {fmt(r['vllm'])} | {ratio} | ≤ {r['needed']:.1f} | {r['verdict']} |" + extra
        )
    print(f"\ntarget met in {met} of {len(rs)} rows")
    fla_job_table(doc, args.shape)
    if any(r.get("impl") == "replay" for r in doc["results"]):
        replay_table(doc, args.shape)
    shard_table(doc, json.load(open(args.tp1_other)) if args.tp1_other else None)


if __name__ == "__main__":
    main()
