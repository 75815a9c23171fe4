"""prefill on CUDA: time per call, tokens/s and TFLOPS, side by side with FLA's layer call.

Shapes: Qwen3-Next TP1 heads (H = 16, HV = 32, K = V = 128), bf16 activations, an fp32 state pool of
2N + 1 slots (slot 0 unused, initial slots a permutation of 1..N, final slots of N+1..2N), N requests
of T tokens per row. Data (docs performance.md §6): state 0.01 N(0,1), activations N(0,1), A_log
0.5 N, dt_bias 0.1 N, norm weight 1 + 0.1 N.

Implementations, one layer call each:
- libgdn: gdn.prefill(mixed_qkv, a, b, A_log, dt_bias, state, initial, final, cu_seqlens, out, z=z,
  norm_weight=w) (docs prefill.md §1): states read from and written to pool slots, gated RMSNorm fused.
- FLA (fla-core 0.6.0, Triton path; FLA_FLASH_QLA=0): q, k, v views of mixed_qkv [1, L, H|HV, 128];
  initial = state.index_select(0, initial) ([N, HV, V, K], state_v_first=True: FLA's V-first layout,
  the pool's); chunk_gated_delta_rule(use_gate_in_kernel=True with g = a raw, A_log, dt_bias;
  use_beta_sigmoid_in_kernel=True with beta = b raw; use_qk_l2norm_in_kernel=True;
  output_final_state=True; cu_seqlens int64 on the device, cu_seqlens_cpu and chunk_indices made
  outside the timed region, so the call needs no host sync); state.index_copy_(0, final, ht); then
  fla.modules.norm.fused_norm_gate.layer_norm_gated_fwd (RMS, swish gate, bf16 out). Captured in a
  CUDA graph; if capture fails, timed eagerly with CUDA events (the row says which).

Timing (performance.md §6): distinct buffer sets (pool and activations; the index arrays are shared)
rotated so one replay touches >= 400 MB (a set that is itself that large is reused); one CUDA graph of
max(16, sets) calls; 2 warm replays, 7 timed replays (CUDA events); median per call, with min/max.

Checks before timing, on the timed call itself: libgdn vs FLA on requests 0 and N-1 (outputs and
final states, relative L2; flagged above 3e-2, both are bf16-operand chunk kernels), and, where
those two requests have at most --cpu-check-tokens tokens, libgdn's CUDA result vs gdn.prefill on
CPU copies of their inputs (exact fp32; flagged above 1e-2).

FLOPs (the chunked form, docs prefill.md §3), per chunk of c <= 64 tokens and value head:
QK^T, KK^T and W = T (beta K) 3 x 2 c^2 K; U = T (beta V) and P V' 2 x 2 c^2 V; W S^T, Q S^T and the
state update 3 x 2 c K V; total 2c (3cK + 2cV + 3KV) = 11.53 MFLOP for c = 64, K = V = 128. The
c x c inverse, gates, norms and elementwise work are not counted; a request's last partial chunk
counts with its own c. % peak: against the dense bf16 tensor-core peak of the GPU (H100 SXM / H200:
989 TFLOPS). Bytes (libgdn, for TB/s): per request one state read + one write, per token the packed
mixed_qkv row, a, b, z and out in bf16 (32,896 B); against a device-to-device copy in the same process.

--conv: gdn.causal_conv1d_prefill (x [L, D] bf16, D = 2 H K + HV V = 8192, weight [D, 4] bf16,
conv_state [2N + 1, D, 3] bf16 channels_major) on 1 x 8192 and 64 x 128, against a graph-captured
device-to-device copy of its bytes (x read + out written + states read and written) over the same
rotation; target <= 1.25 x the copy. Checked against the CPU path first.

FLA: import fla from PYTHONPATH (e.g. python3 -m pip install --no-deps --target /tmp/gdn_site
.whl/*.whl; /tmp/gdn_site is also tried when fla is not importable).

Usage: python benchmarks/bench_prefill.py [--quick] [--rows NxT ...] [--conv] [--no-fla]
       [--cpu-check-tokens N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time

import torch

import gdn

H, HV, DIM, CHUNK, CONV_W = 16, 32, 128, 64, 4
D_QKV = 2 * H * DIM + HV * DIM
ROWS = [(1, 8192), (1, 32768), (8, 4096), (16, 512), (64, 128), (256, 16)]
QUICK_ROWS = [(1, 8192), (8, 4096), (64, 128), (256, 16)]
CONV_ROWS = [(1, 8192), (64, 128)]
# The targets: libgdn / FLA ratio at most, and an absolute bound in µs where there is one
TARGETS = {(1, 8192): (0.5, 260.0), (1, 32768): (0.5, None), (8, 4096): (0.5, None)}
TARGETS.update({(16, 512): (0.6, None), (64, 128): (0.6, None), (256, 16): (0.6, None)})
CONV_TARGET = 1.25
ROTATE_BYTES = 400e6
MAX_SETS = 64
MIN_CALLS = 16
FLA_BAR, CPU_BAR = 3e-2, 1e-2
# Dense bf16 tensor-core peak (TFLOPS) by device-name substring, first match wins.
PEAK_BF16 = [("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200", 989.0), ("H100", 989.0), ("A100", 312.0)]
PEAK_BF16 += [("B200", 2250.0)]
STATE_BYTES = HV * DIM * DIM * 4
ACT_BYTES = (D_QKV + 2 * HV + 2 * HV * DIM) * 2


# ---- environment ---------------------------------------------------------------------------------


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        return ""


def load_fla():
    """FLA's functions, or (None, why)."""
    os.environ.setdefault("FLA_FLASH_QLA", "0")  # the Triton path (FlashQLA refuses in-kernel gates anyway)
    for attempt in range(2):
        try:
            from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
            from fla.ops.utils.index import prepare_chunk_indices

            return {"chunk": chunk_gated_delta_rule, "norm": layer_norm_gated_fwd, "idx": prepare_chunk_indices}, None
        except Exception as e:  # noqa: BLE001
            if attempt == 0 and os.path.isdir("/tmp/gdn_site") and "/tmp/gdn_site" not in sys.path:
                sys.path.append("/tmp/gdn_site")
                continue
            return None, repr(e)[:300]


def environment():
    dev = torch.cuda.get_device_properties(0)
    env = {
        "git_sha": os.environ.get("GDN_GIT_SHA") or _run(["git", "rev-parse", "HEAD"]) or "unknown",
        "gpu": dev.name,
        "sm_count": dev.multi_processor_count,
        "l2_bytes": getattr(dev, "L2_cache_size", None),
        "driver": _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "gdn": getattr(gdn, "__version__", None),
        "peak_bf16_tflops": next((p for k, p in PEAK_BF16 if k.lower() in dev.name.lower()), None),
    }
    for key, mod in (("triton", "triton"), ("fla", "fla-core")):
        try:
            from importlib.metadata import version

            env[key] = version(mod)
        except Exception:  # noqa: BLE001
            env[key] = None
    return env


def gpu_tag(name):
    for tag in ("h200", "h100", "h20", "b200", "a100"):
        if tag in name.lower():
            return tag
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "gpu"


def copy_bandwidth():
    """Device-to-device copy, read + write bytes, TB/s (median of 10)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / sorted(times)[len(times) // 2] / 1e12


# ---- model: FLOPs and bytes ----------------------------------------------------------------------


def chunk_flops(c, K=DIM, V=DIM):
    """Tensor-core FLOPs of one chunk of c tokens for one value head (module docstring)."""
    return 2 * c * (3 * c * K + 2 * c * V + 3 * K * V)


def row_flops(N, T):
    full, rest = divmod(T, CHUNK)
    return N * HV * (full * chunk_flops(CHUNK) + (chunk_flops(rest) if rest else 0))


def prefill_bytes(N, T):
    return N * 2 * STATE_BYTES + N * T * ACT_BYTES


def rotating_sets(touched):
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / touched)))


# ---- buffers -------------------------------------------------------------------------------------


def make_indices(N, T, seed, fla):
    g = torch.Generator().manual_seed(seed)
    init = torch.randperm(N, generator=g) + 1
    final = torch.randperm(N, generator=g) + N + 1
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int64)
    ix = {"init": init.int().cuda(), "final": final.int().cuda(), "cu": cu.int().cuda()}
    ix.update(init64=init.cuda(), final64=final.cuda(), cu64=cu.cuda(), cu_cpu=cu)
    if fla is not None:  # outside the timed region: FLA then needs no host sync
        ix["chunk_indices"] = fla["idx"](ix["cu64"], CHUNK, cu_seqlens_cpu=cu)
    return ix


def make_sets(N, T, n_sets, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    L, slots = N * T, 2 * N + 1
    state = torch.randn(n_sets, slots, HV, DIM, DIM, device="cuda", generator=g).mul_(0.01)
    qkv = torch.randn(n_sets, L, D_QKV, device="cuda", generator=g).to(torch.bfloat16)
    ba = torch.randn(n_sets, L, 2 * HV, device="cuda", generator=g).to(torch.bfloat16)
    z = torch.randn(n_sets, L, HV, DIM, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(n_sets, L, HV, DIM, device="cuda", dtype=torch.bfloat16)
    return [{"state": state[i], "mixed_qkv": qkv[i], "ba": ba[i], "z": z[i], "out": out[i]} for i in range(n_sets)]


def make_params(seed=7):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "A_log": torch.randn(HV, device="cuda", generator=g) * 0.5,
        "dt_bias": torch.randn(HV, device="cuda", generator=g) * 0.1,
        "norm_weight": 1.0 + 0.1 * torch.randn(DIM, device="cuda", generator=g),
    }


# ---- the two layer calls -------------------------------------------------------------------------


def gdn_call(st, prm, ix, fn=None):
    (fn or gdn.prefill)(
        st["mixed_qkv"],
        st["ba"][:, :HV],
        st["ba"][:, HV:],
        prm["A_log"],
        prm["dt_bias"],
        st["state"],
        ix["init"],
        ix["final"],
        ix["cu"],
        st["out"],
        z=st["z"],
        norm_weight=prm["norm_weight"],
    )


def fla_call(st, prm, ix, fla):
    """FLA's layer call (module docstring); returns the normed bf16 output [L, HV, V]."""
    x, L = st["mixed_qkv"], st["mixed_qkv"].shape[0]
    q = x[:, : H * DIM].view(1, L, H, DIM)
    k = x[:, H * DIM : 2 * H * DIM].view(1, L, H, DIM)
    v = x[:, 2 * H * DIM :].view(1, L, HV, DIM)
    h0 = st["state"].index_select(0, ix["init64"])  # state[initial], [N, HV, V, K]
    o, ht = fla["chunk"](
        q,
        k,
        v,
        g=st["ba"][:, :HV].view(1, L, HV),
        beta=st["ba"][:, HV:].view(1, L, HV),
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True,
        state_v_first=True,
        cu_seqlens=ix["cu64"],
        cu_seqlens_cpu=ix["cu_cpu"],
        chunk_indices=ix["chunk_indices"],
        use_gate_in_kernel=True,
        A_log=prm["A_log"],
        dt_bias=prm["dt_bias"],
    )
    st["state"].index_copy_(0, ix["final64"], ht)  # state[final] = ht
    y = fla["norm"](
        o.reshape(-1, DIM),
        st["z"].reshape(-1, DIM),
        prm["norm_weight"],
        None,
        activation="swish",
        eps=1e-6,
        is_rms_norm=True,
    )[0]
    return y.view(L, HV, DIM)


# ---- checks --------------------------------------------------------------------------------------


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def validate(st, prm, ix, N, T, fla, cpu_tokens):
    """libgdn's timed call once on `st`; requests 0 and N-1 against the CPU path (when short enough)
    and FLA. Returns ({name: relative L2}, FLA's error or None)."""
    reqs = sorted({0, N - 1})
    n = len(reqs)
    rows = torch.cat([torch.arange(i * T, i * T + T) for i in reqs]).cuda()
    sel = torch.tensor(reqs, device="cuda")
    res = {}
    init = st["state"].index_select(0, ix["init64"][sel]).cpu()
    st["out"].fill_(float("nan"))
    gdn_call(st, prm, ix)
    torch.cuda.synchronize()
    g_out, g_fin = st["out"][rows].clone(), st["state"].index_select(0, ix["final64"][sel]).clone()
    if n * T <= cpu_tokens:
        pool = torch.zeros(2 * n + 1, HV, DIM, DIM)
        pool[1 : n + 1] = init
        c = {"state": pool, "mixed_qkv": st["mixed_qkv"][rows].cpu(), "ba": st["ba"][rows].cpu()}
        c.update(z=st["z"][rows].cpu(), out=torch.full((n * T, HV, DIM), float("nan")))
        cix = {"init": torch.arange(1, n + 1, dtype=torch.int32), "final": torch.arange(n + 1, 2 * n + 1).int()}
        cix["cu"] = torch.arange(0, n * T + 1, T, dtype=torch.int32)
        gdn_call(c, {k: v.cpu() for k, v in prm.items()}, cix)
        res["cpu_out"] = _rel(g_out.cpu(), c["out"])
        res["cpu_state"] = _rel(g_fin.cpu(), pool[n + 1 :])
    if fla is None:
        return res, None
    try:
        y = fla_call(st, prm, ix, fla)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - libgdn is still timed
        return res, repr(e)[:300]
    res["fla_out"] = _rel(g_out, y[rows])
    res["fla_state"] = _rel(g_fin, st["state"].index_select(0, ix["final64"][sel]))
    if "cpu_out" in res:
        res["fla_vs_cpu_out"] = _rel(y[rows].cpu(), c["out"])
    return res, None


# ---- timing --------------------------------------------------------------------------------------


def time_graph(calls, warm=2, reps=7):
    """calls (thunks) captured in one CUDA graph; per-call seconds (median, min, max)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    for _ in range(warm):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(calls))
    del graph
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def time_eager(calls, warm=2, reps=7):
    """The same calls launched eagerly, CUDA events around the whole sequence (host gaps included)."""
    for c in calls[:warm]:
        c()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for c in calls:
            c()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3 / len(calls))
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def timed(calls, allow_eager):
    try:
        return time_graph(calls), "graph", None
    except Exception as e:  # noqa: BLE001
        if not allow_eager:
            raise
        torch.cuda.synchronize()
        return time_eager(calls), "eager", repr(e)[:300]


def _us(t):
    return {"us": t[0] * 1e6, "us_min": t[1] * 1e6, "us_max": t[2] * 1e6}


# ---- rows ----------------------------------------------------------------------------------------


def bench_row(N, T, fla, env, cpu_tokens):
    L = N * T
    touched = prefill_bytes(N, T)
    n_sets = rotating_sets(touched)
    rec = {"N": N, "T": T, "L": L, "sets": n_sets, "calls": max(MIN_CALLS, n_sets), "flops": row_flops(N, T)}
    rec["bytes"] = touched
    try:
        sets = make_sets(N, T, n_sets, 1000 + N + T)
        prm, ix = make_params(), make_indices(N, T, 17 + N, fla)
        rec["rel_err"], fla_error = validate(sets[0], prm, ix, N, T, fla, cpu_tokens)
        if fla_error:
            rec["fla_error"], fla = fla_error, None
        err = rec["rel_err"]
        rec["flags"] = [k for k, v in err.items() if not v <= (FLA_BAR if k.startswith("fla") else CPU_BAR)]
        seq = [sets[i % n_sets] for i in range(rec["calls"])]
        t, _, _ = timed([(lambda st=st: gdn_call(st, prm, ix)) for st in seq], allow_eager=False)
        lib = rec["libgdn"] = _us(t)
        lib.update(timing="graph", tokens_per_s=L / t[0], tflops=rec["flops"] / t[0] / 1e12)
        lib.update(tbps=touched / t[0] / 1e12, pct_copy=100 * touched / t[0] / 1e12 / env["copy_tbps"])
        if env["peak_bf16_tflops"]:
            lib["pct_peak"] = 100 * lib["tflops"] / env["peak_bf16_tflops"]
        if fla is not None:
            t, how, why = timed([(lambda st=st: fla_call(st, prm, ix, fla)) for st in seq], allow_eager=True)
            rec["fla"] = dict(_us(t), timing=how, tokens_per_s=L / t[0], tflops=rec["flops"] / t[0] / 1e12)
            if why:
                rec["fla"]["capture_error"] = why
            rec["ratio"] = lib["us"] / rec["fla"]["us"]
        target = TARGETS.get((N, T))
        if target:
            rec["target"] = {"ratio_max": target[0], "us_max": target[1]}
            ok = "ratio" in rec and rec["ratio"] <= target[0]
            rec["target"]["met"] = ok and (target[1] is None or lib["us"] <= target[1])
    except Exception as e:  # noqa: BLE001 - one failing row must not end the run
        rec["error"] = repr(e)[:400]
    sets = None
    torch.cuda.empty_cache()
    return rec


def bench_conv(N, T, env):
    L, D, slots = N * T, D_QKV, 2 * N + 1
    nbytes = 2 * L * D * 2 + 2 * N * D * (CONV_W - 1) * 2
    n_sets = rotating_sets(nbytes)
    rec = {"N": N, "T": T, "L": L, "D": D, "sets": n_sets, "calls": max(MIN_CALLS, n_sets), "bytes": nbytes}
    try:
        g = torch.Generator(device="cuda").manual_seed(99 + N)
        x = torch.randn(n_sets, L, D, device="cuda", generator=g).to(torch.bfloat16)
        cs = torch.randn(n_sets, slots, D, CONV_W - 1, device="cuda", generator=g).to(torch.bfloat16)
        w = (0.3 * torch.randn(D, CONV_W, device="cuda", generator=g)).to(torch.bfloat16)
        out = torch.empty_like(x)
        ix = make_indices(N, T, 5 + N, None)

        def call(i):
            gdn.causal_conv1d_prefill(x[i], w, cs[i], ix["init"], ix["final"], ix["cu"], out[i])

        # check: the whole call on the CPU
        cpu = [t.cpu() for t in (x[0], w, cs[0], ix["init"], ix["final"], ix["cu"])]
        cpu_out = torch.empty_like(cpu[0])
        gdn.causal_conv1d_prefill(*cpu, cpu_out)
        call(0)
        torch.cuda.synchronize()
        rec["rel_err"] = {"cpu_out": _rel(out[0].cpu(), cpu_out), "cpu_state": _rel(cs[0].cpu(), cpu[2])}
        rec["flags"] = [k for k, v in rec["rel_err"].items() if not v <= CPU_BAR]
        idx = [i % n_sets for i in range(rec["calls"])]
        t, _, _ = timed([(lambda i=i: call(i)) for i in idx], allow_eager=False)
        rec["conv"] = dict(_us(t), tbps=nbytes / t[0] / 1e12)
        x = cs = out = None
        torch.cuda.empty_cache()
        src = torch.empty(n_sets, nbytes // 2, dtype=torch.uint8, device="cuda").random_()
        dst = torch.empty_like(src)
        t, _, _ = timed([(lambda i=i: dst[i].copy_(src[i])) for i in idx], allow_eager=False)
        rec["copy"] = dict(_us(t), tbps=nbytes / t[0] / 1e12)
        rec["ratio_to_copy"] = rec["conv"]["us"] / rec["copy"]["us"]
        rec["target"] = {"ratio_max": CONV_TARGET, "met": rec["ratio_to_copy"] <= CONV_TARGET}
    except Exception as e:  # noqa: BLE001
        rec["error"] = repr(e)[:400]
    torch.cuda.empty_cache()
    return rec


# ---- report --------------------------------------------------------------------------------------


def table(rows, convs):
    lines = [
        f"{'row':>9} {'libgdn us':>10} {'FLA us':>10} {'ratio':>6} {'target':>7} {'Mtok/s':>7} "
        f"{'TFLOPS':>7} {'%peak':>6} {'TB/s':>5}  checks (rel L2)"
    ]
    for r in rows:
        name = f"{r['N']}x{r['T']}"
        if "libgdn" not in r:
            lines.append(f"{name:>9} ERROR {r.get('error')}")
            continue
        lib, fla = r["libgdn"], r.get("fla", {})
        fla_s = f"{fla['us']:9.1f}{'e' if fla.get('timing') == 'eager' else ' '}" if fla else f"{'-':>10}"
        ratio = f"{r['ratio']:6.2f}" if "ratio" in r else f"{'-':>6}"
        tgt = r.get("target")
        tgt_s = f"{'ok' if tgt['met'] else 'MISS'}<={tgt['ratio_max']}" if tgt else "-"
        pct = f"{lib['pct_peak']:6.1f}" if "pct_peak" in lib else f"{'-':>6}"
        errs = " ".join(f"{k}={v:.1e}" for k, v in r["rel_err"].items())
        flag = f" FLAGGED {r['flags']}" if r["flags"] else ""
        flag += "".join(f" {k.upper()} {r[k]}" for k in ("fla_error", "error") if k in r)
        lines.append(
            f"{name:>9} {lib['us']:10.1f} {fla_s} {ratio} {tgt_s:>7} {lib['tokens_per_s'] / 1e6:7.2f} "
            f"{lib['tflops']:7.1f} {pct} {lib['tbps']:5.2f}  {errs}{flag}"
        )
    lines.append("(FLA 'e': timed eagerly, graph capture failed)")
    for r in convs:
        name = f"conv {r['N']}x{r['T']}"
        if "conv" not in r:
            lines.append(f"{name}: ERROR {r.get('error')}")
            continue
        lines.append(
            f"{name}: {r['conv']['us']:.1f} us {r['conv']['tbps']:.2f} TB/s, copy {r['copy']['us']:.1f} us "
            f"{r['copy']['tbps']:.2f} TB/s, ratio {r['ratio_to_copy']:.2f} "
            f"({'ok' if r['target']['met'] else 'MISS'} <= {CONV_TARGET}); "
            + " ".join(f"{k}={v:.1e}" for k, v in r["rel_err"].items())
            + (f" FLAGGED {r['flags']}" if r["flags"] else "")
        )
    return "\n".join(lines)


def parse_row(text):
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"a row is REQUESTSxTOKENS, e.g. 8x4096; got {text!r}")
    return int(m.group(1)), int(m.group(2))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="rows 1x8192 8x4096 64x128 256x16")
    ap.add_argument("--rows", type=parse_row, nargs="+", help="custom rows, e.g. 1x8192 8x4096 (requests x tokens)")
    ap.add_argument("--conv", action="store_true", help="also time causal_conv1d_prefill on 1x8192 and 64x128")
    ap.add_argument("--no-fla", action="store_true", help="skip the FLA baseline")
    ap.add_argument(
        "--cpu-check-tokens",
        type=int,
        default=2048,
        help="check against the CPU path where the two checked requests have at most this many tokens",
    )
    ap.add_argument("--json", help="default benchmarks/results/prefill_<gpu>.json (gpu: h100, h200, ...)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_prefill: no CUDA device")
    if not hasattr(gdn, "prefill") or not hasattr(gdn, "causal_conv1d_prefill"):
        sys.exit(
            f"bench_prefill: this gdn ({gdn.__file__}) has no gdn.prefill / gdn.causal_conv1d_prefill "
            "(python/gdn/prefill.py, docs prefill.md); build and put the tree that has them on PYTHONPATH"
        )
    t0 = time.time()
    env = environment()
    env["copy_tbps"] = copy_bandwidth()
    fla, why = (None, "--no-fla") if args.no_fla else load_fla()
    if fla is None:
        env["fla_unavailable"] = why
        print(f"FLA baseline unavailable: {why}", file=sys.stderr)
    else:
        env["fla_backend"] = f"triton (FLA_FLASH_QLA={os.environ.get('FLA_FLASH_QLA')})"
    print(
        f"{env['gpu']}, {env['sm_count']} SMs, copy {env['copy_tbps']:.3f} TB/s, peak bf16 "
        f"{env['peak_bf16_tflops']} TFLOPS, torch {env['torch']}, triton {env['triton']}, fla {env['fla']}",
        flush=True,
    )
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    results, convs = [], []
    with torch.no_grad():
        for N, T in rows:
            r = bench_row(N, T, fla, env, args.cpu_check_tokens)
            results.append(r)
            print(table([r], []).splitlines()[1], flush=True)
        if args.conv:
            for N, T in CONV_ROWS:
                convs.append(bench_conv(N, T, env))
    env["elapsed_s"] = time.time() - t0
    doc = {
        "environment": env,
        "method": __doc__,
        "shapes": {"H": H, "HV": HV, "K": DIM, "V": DIM, "chunk": CHUNK, "state": "fp32 vk", "activations": "bf16"},
        "flops_per_chunk_head": "2c(3cK + 2cV + 3KV), c = tokens in the chunk (<= 64)",
        "rows": results,
        "conv": convs,
    }
    path = args.json or f"benchmarks/results/prefill_{gpu_tag(env['gpu'])}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    print(table(results, convs))
    print(f"wrote {path}; elapsed {env['elapsed_s']:.1f} s")


if __name__ == "__main__":
    main()
