"""CPU prefill throughput against the token-by-token path, on the machine's cores.

Qwen3-Next TP4 heads (H = 4, HV = 8, K = V = 128), bf16 activations, fp32 state pool. For each row
(requests x tokens), `gdn.prefill` runs the whole batch in one call; the token-by-token path runs
the same tokens as one `gdn.decode_mtp` call per token position (every request's next token, T = 1,
the state read from and written to the request's slot), as an engine without prefill does. Both
start from the same pool; before timing, their outputs and final states are checked to be equal
bit for bit (the CPU prefill keeps the state in fp32 and applies decode_mtp's per-token math).
Reported: median seconds per batch over 3 runs, tokens/s, and the speed-up.

    python benchmarks/bench_prefill_cpu.py [--rows 1x1024 8x256 64x16] [--json PATH]
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

H, HV, K, V = 4, 8, 128, 128


def make_case(N: int, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    L = N * T
    c = dict(
        mixed_qkv=torch.randn(L, 2 * H * K + HV * V, generator=g).bfloat16(),
        ba=torch.randn(L, 2 * HV, generator=g).bfloat16(),
        A_log=0.5 * torch.randn(HV, generator=g),
        dt_bias=0.1 * torch.randn(HV, generator=g),
        z=torch.randn(L, HV, V, generator=g).bfloat16(),
        w=1.0 + 0.1 * torch.randn(V, generator=g),
        state=0.01 * torch.randn(2 * N, HV, V, K, generator=g),
    )
    return c


def run_prefill(c, N: int, T: int):
    state = c["state"].clone()
    out = torch.empty(N * T, HV, V, dtype=torch.bfloat16)
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
    initial = torch.arange(N, dtype=torch.int32)
    final = torch.arange(N, 2 * N, dtype=torch.int32)
    ba = c["ba"]
    t0 = time.perf_counter()
    gdn.prefill(
        c["mixed_qkv"], ba[:, :HV], ba[:, HV:], c["A_log"], c["dt_bias"], state, initial, final, cu, out,
        z=c["z"], norm_weight=c["w"],
    )  # fmt: skip
    return time.perf_counter() - t0, out, state[N:]


def run_token_by_token(c, N: int, T: int):
    state = c["state"].clone()
    state[N:] = state[:N]  # each request's slot starts as its initial state
    out = torch.empty(N * T, HV, V, dtype=torch.bfloat16)
    rows = torch.arange(N) * T  # row of request i's token t: i * T + t
    slots = torch.arange(N, 2 * N, dtype=torch.int32).view(N, 1)
    cu = torch.arange(N + 1, dtype=torch.int32)
    step_out = torch.empty(N, HV, V, dtype=torch.bfloat16)
    ba = c["ba"]
    t0 = time.perf_counter()
    for t in range(T):
        idx = rows + t
        qkv, ba_t, z = c["mixed_qkv"][idx], ba[idx], c["z"][idx]
        gdn.decode_mtp(
            qkv, ba_t[:, :HV], ba_t[:, HV:], c["A_log"], c["dt_bias"], state, slots, cu, step_out,
            z=z, norm_weight=c["w"],
        )  # fmt: skip
        out[idx] = step_out
    return time.perf_counter() - t0, out, state[N:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", default=["1x1024", "8x256", "64x16"])
    p.add_argument("--json", help="write results here")
    args = p.parse_args()
    results = []
    print(f"{'row':>8} {'prefill s':>10} {'tok/s':>10} {'token-by-token s':>17} {'tok/s':>10} {'speed-up':>9}")
    for i, spec in enumerate(args.rows):
        N, T = (int(x) for x in spec.split("x"))
        c = make_case(N, T, seed=i + 1)
        _, out_p, state_p = run_prefill(c, N, T)  # check, and warm up
        _, out_t, state_t = run_token_by_token(c, N, T)
        assert torch.equal(out_p, out_t) and torch.equal(state_p, state_t), f"{spec}: prefill != token by token"
        tp = statistics.median(run_prefill(c, N, T)[0] for _ in range(3))
        tt = statistics.median(run_token_by_token(c, N, T)[0] for _ in range(3))
        r = dict(N=N, T=T, prefill_s=tp, token_by_token_s=tt, prefill_tokens_per_s=N * T / tp)
        r.update(token_by_token_tokens_per_s=N * T / tt, speedup=tt / tp, bit_equal=True)
        results.append(r)
        print(f"{spec:>8} {tp:10.3f} {N * T / tp:10.0f} {tt:17.3f} {N * T / tt:10.0f} {tt / tp:8.2f}x")
    if args.json:
        here = os.path.dirname(os.path.abspath(__file__))
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
        meta = dict(git_sha=sha, gdn_version=gdn.__version__, torch=torch.__version__, cores=os.cpu_count())
        meta.update(threads=torch.get_num_threads(), cpu=platform.processor() or platform.machine())
        meta.update(shape=dict(H=H, HV=HV, K=K, V=V, state="float32", activations="bfloat16"))
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
