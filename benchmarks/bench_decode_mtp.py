"""decode_mtp on CUDA: time per call, effective bandwidth, and the FLA (fla-core) Triton baseline.

Method (docs performance.md §6): per configuration, distinct buffer sets (pool and activations; the
small index arrays are shared, like one step's metadata read by every layer) are rotated so that the
data one replay touches is far larger than L2 (>= 400 MB where a set is small; a set that is itself
larger than L2 is reused); one CUDA graph holds one call per set (at least 16 calls); after 2 warm
replays, >= 5 timed replays (CUDA events); the median per-call time is reported with min/max. Data
is random (state 0.01 N(0,1), activations N(0,1), A_log 0.5 N, dt_bias 0.1 N), slot ids are valid
and distinct, accepted counts random in 1..T. Before timing, the timed launch itself is checked
against the CPU path of gdn on two of its requests (outputs and every written state).

Bytes (libgdn): per request, one state read + T state writes + T x (packed mixed_qkv row, a, b, z,
out) in bf16. Replay verify (gdn.decode_mtp_replay, docs replay.md; the "fold, fused" scheme of
performance.md): per request one checkpoint read and one write, the n replayed window tokens (raw
k, v, a, b) read, the T new tokens' activations as above, and their k, v, a, b saved to the window;
its pool holds one slot per request, the window is full (window_len = T) and n is random in 1..T
(T > 1 rows only). FLA: one state read + T writes (T = 1: a fresh final state) + T x (q, k, v, out in
bf16, raw gate and beta in fp32; the KDA kernel's gate is per K channel). With --fla-job, FLA's
whole layer call of the same job (impl fla_job): its slot-gathered in-place kernel at every row
(fp32 T = 1 included) and its gated RMSNorm (o and z read, the bf16 output written), checked like
libgdn against the CPU path with the norm. Bandwidth is reported against a device-to-device copy
measured in the same process (read + write bytes) and the 4.8 TB/s datasheet value.

Usage: python benchmarks/bench_decode_mtp.py [--quick] [--sweep-split] [--no-fla] [--no-replay]
       [--no-write-all] [--tokens T ...] [--batches B ...] [--states fp32|bf16|fp16 ...] [--shapes NAME ...]
       [--json PATH] [--png PATH] [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

import torch

import gdn

SPEC_TBPS = 4.8
SHAPES = {"TP1": (16, 32), "TP4": (4, 8), "ratio3": (16, 48), "ratio8": (2, 16)}
# Shapes outside the default matrix, for --shapes: (H, HV) with HV = 64 (ratio 4), HV = H, and
# Qwen3-Next's TP2 shard (8, 16).
EXTRA_SHAPES = {"ratio4": (16, 64), "ratio1": (16, 16), "TP2": (8, 16)}
ALL_SHAPES = {**SHAPES, **EXTRA_SHAPES}
BATCHES = [1, 8, 32, 128, 512]
TOKENS = [1, 2, 4, 8]
DIM = 128
ROTATE_BYTES = 400e6
MAX_SETS = 256
MIN_CALLS = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_STATES = ("fp32", "bf16")


# ---- environment ---------------------------------------------------------------------------------


def _run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception:  # noqa: BLE001 - informational only
        return ""


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
        "gdn": gdn.__version__,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        from importlib.metadata import version

        env["fla"] = version("fla-core")
    except Exception:  # noqa: BLE001
        env["fla"] = None
    return env


def copy_bandwidth():
    """Device-to-device copy, read + write bytes, TB/s (median of 10)."""
    n = 1 << 30  # 1 GiB each way
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
    times.sort()
    return 2 * n / times[len(times) // 2] / 1e12


# ---- buffers -------------------------------------------------------------------------------------


def rotating_sets(set_bytes):
    """Buffer sets to rotate through so that one replay of the graph touches at least ROTATE_BYTES
    (one set when a set alone is that large), at most MAX_SETS."""
    return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / set_bytes)))


def make_sets(H, HV, B, T, state_dtype, n_sets, seed):
    """n_sets buffer sets of a configuration (CUDA), each a view into one allocation per array: a
    set is one layer's pool and activations; the slot ids, token offsets and accepted counts are
    shared, like one step's metadata read by every layer."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    L = B * T
    D = 2 * H * DIM + HV * DIM
    slots = B * T
    pool = torch.randn(n_sets, slots, HV, DIM, DIM, device="cuda", generator=g).mul_(0.01)
    pool = pool.to(state_dtype)
    qkv = torch.randn(n_sets, L, D, device="cuda", generator=g).to(torch.bfloat16)
    ba = torch.randn(n_sets, L, 2 * HV, device="cuda", generator=g).to(torch.bfloat16)
    z = torch.randn(n_sets, L, HV, DIM, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(n_sets, L, HV, DIM, device="cuda", dtype=torch.bfloat16)
    # One step's metadata serves every layer (set): small and L2-resident, as in a model step.
    idx = torch.randperm(slots, device="cuda", generator=g).to(torch.int32).view(B, T)
    acc = torch.randint(1, T + 1, (B,), device="cuda", generator=g).to(torch.int32)
    cu = torch.arange(0, L + 1, T, device="cuda", dtype=torch.int32)
    return [
        {"pool": pool[i], "mixed_qkv": qkv[i], "ba": ba[i], "z": z[i], "out": out[i], "idx": idx, "acc": acc, "cu": cu}
        for i in range(n_sets)
    ]


def make_params(HV, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {
        "A_log": torch.randn(HV, device="cuda", generator=g) * 0.5,
        "dt_bias": torch.randn(HV, device="cuda", generator=g) * 0.1,
        "norm_weight": 1.0 + 0.1 * torch.randn(DIM, device="cuda", generator=g),
    }


# --state-layout: how libgdn reads the pools ("vk" [slots, HV, V, K] or "kv" [slots, HV, K, V]).
# With K = V the pool tensors are the same; only the layout argument changes.
STATE_LAYOUT = "vk"


def gdn_call(st, prm, HV, split=None, error_count=None):
    if split is None:
        gdn.decode_mtp(
            st["mixed_qkv"],
            st["ba"][:, :HV],
            st["ba"][:, HV:],
            prm["A_log"],
            prm["dt_bias"],
            st["pool"],
            st["idx"],
            st["cu"],
            st["out"],
            z=st["z"],
            norm_weight=prm["norm_weight"],
            num_accepted_tokens=st["acc"],
            error_count=error_count,
            state_layout=STATE_LAYOUT,
        )
    else:  # the kernel's row split pinned (the binding's benchmark knob)
        gdn._C.decode_mtp(
            st["mixed_qkv"],
            st["ba"][:, :HV],
            st["ba"][:, HV:],
            prm["A_log"],
            prm["dt_bias"],
            st["pool"],
            st["idx"],
            st["cu"],
            st["out"],
            z=st["z"],
            norm_weight=prm["norm_weight"],
            num_accepted_tokens=st["acc"],
            state_layout=STATE_LAYOUT,
            stream=torch.cuda.current_stream().cuda_stream,
            split=split,
        )


def make_replay_sets(H, HV, B, T, state_dtype, n_sets, seed):
    """Replay-verify buffer sets: a pool of one checkpoint slot per request and full windows of T
    tokens per set (layer); slot ids, token offsets and replay counts shared."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    L = B * T
    D = 2 * H * DIM + HV * DIM
    pool = torch.randn(n_sets, B, HV, DIM, DIM, device="cuda", generator=g).mul_(0.01)
    pool = pool.to(state_dtype)
    qkv = torch.randn(n_sets, L, D, device="cuda", generator=g).to(torch.bfloat16)
    ba = torch.randn(n_sets, L, 2 * HV, device="cuda", generator=g).to(torch.bfloat16)
    z = torch.randn(n_sets, L, HV, DIM, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(n_sets, L, HV, DIM, device="cuda", dtype=torch.bfloat16)
    win_kv = torch.randn(n_sets, B, T, H * DIM + HV * DIM, device="cuda", generator=g)
    win_kv = win_kv.to(torch.bfloat16)
    win_ab = torch.randn(n_sets, B, T, 2 * HV, device="cuda", generator=g).to(torch.bfloat16)
    win_len = torch.full((n_sets, B), T, device="cuda", dtype=torch.int32)
    slots = torch.randperm(B, device="cuda", generator=g).to(torch.int32)
    acc = torch.randint(1, T + 1, (B,), device="cuda", generator=g).to(torch.int32)
    cu = torch.arange(0, L + 1, T, device="cuda", dtype=torch.int32)
    return [
        {
            "pool": pool[i],
            "mixed_qkv": qkv[i],
            "ba": ba[i],
            "z": z[i],
            "out": out[i],
            "wk": win_kv[i][..., : H * DIM],
            "wv": win_kv[i][..., H * DIM :],
            "wa": win_ab[i][..., :HV],
            "wb": win_ab[i][..., HV:],
            "wlen": win_len[i],
            "slots": slots,
            "acc": acc,
            "cu": cu,
        }
        for i in range(n_sets)
    ]


def replay_call(st, prm, HV, split=None, fn=None, error_count=None):
    args = (
        st["mixed_qkv"],
        st["ba"][:, :HV],
        st["ba"][:, HV:],
        prm["A_log"],
        prm["dt_bias"],
        st["pool"],
        st["slots"],
        st["cu"],
        st["out"],
        st["wk"],
        st["wv"],
        st["wa"],
        st["wb"],
        st["wlen"],
        st["acc"],
    )
    if fn is not None:  # another implementation of the same call (validation)
        return fn(*args, z=st["z"], norm_weight=prm["norm_weight"], state_layout=STATE_LAYOUT)
    if split is None:
        gdn.decode_mtp_replay(
            *args, z=st["z"], norm_weight=prm["norm_weight"], error_count=error_count, state_layout=STATE_LAYOUT
        )
    else:
        gdn._C.decode_mtp_replay(
            *args,
            z=st["z"],
            norm_weight=prm["norm_weight"],
            state_layout=STATE_LAYOUT,
            stream=torch.cuda.current_stream().cuda_stream,
            split=split,
        )


def replay_bytes(H, HV, B, T, state_dtype, replayed):
    """Bytes of one replay call; `replayed` = window tokens replayed over all requests."""
    state = HV * DIM * DIM * torch.finfo(state_dtype).bits // 8
    act = ((2 * H * DIM + HV * DIM) + 2 * HV + 2 * HV * DIM) * 2
    window = (H * DIM + HV * DIM + 2 * HV) * 2
    return B * (2 * state + T * (act + window)) + replayed * window


def validate_replay(st, prm, H, HV, B, T):
    """The timed launch once on set `st` against the CPU path on copies of requests 0 and B-1
    (their checkpoint slots, windows and tokens); returns the worst rel L2 of outputs and
    checkpoints."""
    reqs = sorted({0, B - 1})
    slots = [int(st["slots"][i]) for i in reqs]
    rows = torch.cat([torch.arange(i * T, i * T + T) for i in reqs]).cuda()
    cpu = {
        "pool": st["pool"][slots].cpu(),
        "mixed_qkv": st["mixed_qkv"][rows].cpu(),
        "ba": st["ba"][rows].cpu(),
        "z": st["z"][rows].cpu(),
        "out": torch.full((len(reqs) * T, HV, DIM), float("nan"), dtype=torch.bfloat16),
        "slots": torch.arange(len(reqs), dtype=torch.int32),
        "acc": st["acc"][reqs].cpu(),
        "cu": torch.arange(0, len(reqs) * T + 1, T, dtype=torch.int32),
    }
    kv = torch.cat([st["wk"][slots], st["wv"][slots]], -1).cpu()
    ab = torch.cat([st["wa"][slots], st["wb"][slots]], -1).cpu()
    cpu.update(
        wk=kv[..., : H * DIM], wv=kv[..., H * DIM :], wa=ab[..., :HV], wb=ab[..., HV:], wlen=st["wlen"][slots].cpu()
    )
    replay_call(cpu, {k: v.cpu() for k, v in prm.items()}, HV, fn=gdn.decode_mtp_replay)
    st["out"].fill_(float("nan"))
    replay_call(st, prm, HV)
    torch.cuda.synchronize()
    worst = _rel(st["out"][rows].cpu(), cpu["out"])
    for j, s in enumerate(slots):
        worst = max(worst, _rel(st["pool"][s].cpu(), cpu["pool"][j]))
    return worst


def gdn_bytes(H, HV, B, T, state_dtype):
    state = HV * DIM * DIM * torch.finfo(state_dtype).bits // 8
    act = ((2 * H * DIM + HV * DIM) + 2 * HV + 2 * HV * DIM) * 2
    return B * ((1 + T) * state + T * act)


# ---- FLA baseline --------------------------------------------------------------------------------


def fla_available():
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import fla.ops.kda.fused_recurrent  # noqa: F401

        return True
    except Exception as e:  # noqa: BLE001
        print(f"FLA baseline unavailable: {e!r}", file=sys.stderr)
        return False


def fla_inputs(st, prm, H, HV, B, T, dense_ok=True):
    """FLA's tensors for a set: q, k, v split from mixed_qkv (bf16), raw gate and beta (fp32).
    fp32 T = 1 takes FLA's dense kernel (a pre-gathered state, a fresh final state) unless
    `dense_ok` is False; every other row, and that one then, the slot-gathered in-place kernel."""
    L = B * T
    x = st["mixed_qkv"]
    q = x[:, : H * DIM].reshape(1, L, H, DIM).contiguous()
    k = x[:, H * DIM : 2 * H * DIM].reshape(1, L, H, DIM).contiguous()
    v = x[:, 2 * H * DIM :].reshape(1, L, HV, DIM).contiguous()
    a = st["ba"][:, :HV].float().reshape(1, L, HV).contiguous()
    beta = st["ba"][:, HV:].float().reshape(1, L, HV).contiguous()
    f = {"q": q, "k": k, "v": v, "beta": beta, "out": torch.empty_like(v)}
    use_dense = dense_ok and T == 1 and st["pool"].dtype == torch.float32
    if use_dense:  # fused_recurrent, [V, K] state, dense initial state of B rows
        f["q"], f["k"], f["v"] = q.view(B, 1, H, DIM), k.view(B, 1, H, DIM), v.view(B, 1, HV, DIM)
        f["beta"], f["g"] = beta.view(B, 1, HV), a.view(B, 1, HV)
        f["h0"] = st["pool"][st["idx"][:, 0].long()].contiguous()
    else:  # KDA kernel as GDN: per-K-channel gate equal across K, pool slots per token
        f["g"] = a.unsqueeze(-1).expand(1, L, HV, DIM).contiguous()
        f["dt_bias_k"] = prm["dt_bias"].unsqueeze(-1).expand(HV, DIM).reshape(-1).contiguous()
        f["cu64"] = st["cu"].long()
    f["dense"] = use_dense
    return f


def fla_call(f, st, prm, T):
    if f["dense"]:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

        o, _ = fused_recurrent_gated_delta_rule(
            f["q"],
            f["k"],
            f["v"],
            g=f["g"],
            beta=f["beta"],
            initial_state=f["h0"],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=prm["A_log"],
            dt_bias=prm["dt_bias"],
            use_beta_sigmoid_in_kernel=True,
            state_v_first=True,
        )
        return o
    else:
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        o, _ = fused_recurrent_kda_fwd(
            f["q"],
            f["k"],
            f["v"],
            f["g"],
            f["beta"],
            A_log=prm["A_log"],
            dt_bias=f["dt_bias_k"],
            initial_state=st["pool"],
            inplace_final_state=True,
            state_v_first=True,
            cu_seqlens=f["cu64"],
            ssm_state_indices=st["idx"],
            num_accepted_tokens=st["acc"],
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            out=f["out"],
        )
        return o


def fla_job_call(f, st, prm, T, HV):
    """What an engine built on FLA runs for one layer call of decode_mtp's job (--fla-job): the
    slot-gathered in-place recurrent kernel, then FLA's gated RMSNorm of its output (RMSNorm over V
    times the weight times silu(z), fla.modules.norm.fused_norm_gate, bf16 out). Returns the
    normed output [L, HV, V]."""
    from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd

    o = fla_call(f, st, prm, T)
    y = layer_norm_gated_fwd(
        o.reshape(-1, DIM),
        st["z"].reshape(-1, DIM),
        prm["norm_weight"],
        None,
        activation="swish",
        eps=1e-6,
        is_rms_norm=True,
    )[0]
    return y.view(-1, HV, DIM)


def fla_job_bytes(H, HV, B, T, state_dtype):
    """fla_bytes of the slot-gathered kernel plus the norm's o and z reads and its output."""
    return fla_bytes(H, HV, B, T, state_dtype, False) + B * T * 3 * HV * DIM * 2


def fla_bytes(H, HV, B, T, state_dtype, dense):
    state = HV * DIM * DIM * torch.finfo(state_dtype).bits // 8
    state_out = HV * DIM * DIM * 4 if dense else state
    gate = HV * 4 * (1 if dense else DIM)
    act = (2 * H * DIM + 2 * HV * DIM) * 2 + gate + HV * 4
    return B * (state + T * state_out + T * act)


# ---- validation ----------------------------------------------------------------------------------


def _rel(x, ref):
    x, ref = x.double(), ref.double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def validate(impl, st, prm, f, H, HV, B, T):
    """Runs the timed launch once and checks requests 0 and B-1 against the CPU path of gdn
    (for FLA: the CPU path without the gated norm, i.e. out = o). Returns the worst rel L2."""
    reqs = sorted({0, B - 1})
    idx, acc = st["idx"].cpu(), st["acc"].cpu()
    src = [int(idx[i, int(acc[i]) - 1]) for i in reqs]
    init = st["pool"][torch.tensor(src, device="cuda")].cpu()
    full = impl in ("gdn", "fla_job")  # the gated RMSNorm included
    if impl == "gdn":
        st["out"].fill_(float("nan"))
        gdn_call(st, prm, HV)
        out = st["out"]
    elif impl == "fla_job":
        f["out"].fill_(float("nan"))
        out = fla_job_call(f, st, prm, T, HV)
    else:
        f["out"].fill_(float("nan"))
        out = fla_call(f, st, prm, T).reshape(B * T, HV, DIM)
    torch.cuda.synchronize()
    # The same requests on the CPU: a small pool with their initial states at column acc - 1.
    n = len(reqs)
    cpu_pool = torch.zeros(n * T, HV, DIM, DIM, dtype=st["pool"].dtype)
    cpu_idx = torch.arange(n * T, dtype=torch.int32).view(n, T)
    for j, i in enumerate(reqs):
        cpu_pool[int(cpu_idx[j, int(acc[i]) - 1])] = init[j]
    rows = torch.cat([torch.arange(i * T, i * T + T) for i in reqs])
    x = st["mixed_qkv"][rows.cuda()].cpu()
    ba = st["ba"][rows.cuda()].cpu()
    z = st["z"][rows.cuda()].cpu()
    cpu_out = torch.full((n * T, HV, DIM), float("nan"), dtype=torch.float32)
    p = {k: v.cpu() for k, v in prm.items()}
    gdn.decode_mtp(
        x,
        ba[:, :HV],
        ba[:, HV:],
        p["A_log"],
        p["dt_bias"],
        cpu_pool,
        cpu_idx,
        torch.arange(0, n * T + 1, T, dtype=torch.int32),
        cpu_out,
        z=z if full else None,
        norm_weight=p["norm_weight"] if full else None,
        num_accepted_tokens=torch.tensor([int(acc[i]) for i in reqs], dtype=torch.int32),
        state_layout=STATE_LAYOUT if impl == "gdn" else "vk",
    )
    worst = _rel(out[rows.cuda()].cpu(), cpu_out)
    if impl == "gdn" or not f["dense"]:
        for j, i in enumerate(reqs):
            for t in range(T):
                got = st["pool"][int(idx[i, t])].cpu()
                worst = max(worst, _rel(got, cpu_pool[int(cpu_idx[j, t])]))
    return worst


# ---- timing --------------------------------------------------------------------------------------

# --isolated: a 4-byte device-to-device copy (a memcpy node of the graph, not a kernel) before every
# timed call, so that no call's CTAs start while the previous call runs; the graph of the copies
# alone is timed too and subtracted.
ISOLATED = False


def time_graph(calls, warm=2, reps=7):
    """Captures calls() (a list of thunks) in one graph; per-call time (s): median, min, max.
    With ISOLATED, each call follows a 4-byte memcpy and the copies' own time is subtracted."""
    if ISOLATED:
        src, dst = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")

        def spacer():
            dst.copy_(src)

        spaced = [c for call in calls for c in (spacer, call)]
        both = _time_graph(spaced, len(calls), warm, reps)
        alone = _time_graph([spacer] * len(calls), len(calls), warm, reps)
        return tuple(b - a for b, a in zip(both, alone))
    return _time_graph(calls, len(calls), warm, reps)


def _time_graph(calls, per, warm, reps):
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
        times.append(a.elapsed_time(b) * 1e-3 / per)
    del graph
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def bench_replay(shape, B, T, sdt, copy_tbps, split=None):
    H, HV = ALL_SHAPES[shape]
    state_dtype = DTYPES[sdt]
    set_bytes = B * HV * DIM * DIM * torch.finfo(state_dtype).bits // 8
    n_sets = rotating_sets(set_bytes)
    sets = make_replay_sets(H, HV, B, T, state_dtype, n_sets, 2000 + B + 10 * T)
    prm = make_params(HV, 7)
    n_calls = max(MIN_CALLS, n_sets)
    rec = dict(
        impl="replay",
        shape=shape,
        H=H,
        HV=HV,
        B=B,
        T=T,
        state=sdt,
        sets=n_sets,
        calls=n_calls,
        split=split,
        state_layout=STATE_LAYOUT,
    )
    try:
        rec["rel_err"] = validate_replay(sets[0], prm, H, HV, B, T)
        rec["valid"] = rec["rel_err"] <= 1e-2
        calls = [(lambda st=sets[i % n_sets]: replay_call(st, prm, HV, split)) for i in range(n_calls)]
        nbytes = replay_bytes(H, HV, B, T, state_dtype, int(sets[0]["acc"].sum()))
        med, lo, hi = time_graph(calls)
        tbps = nbytes / med / 1e12
        rec.update(
            us=med * 1e6,
            us_min=lo * 1e6,
            us_max=hi * 1e6,
            bytes=nbytes,
            tbps=tbps,
            pct_copy=100 * tbps / copy_tbps,
            pct_spec=100 * tbps / SPEC_TBPS,
            pool_bytes_per_request=HV * DIM * DIM * torch.finfo(state_dtype).bits // 8,
            window_bytes_per_request=T * (H * DIM + HV * DIM + 2 * HV) * 2 + 4,
        )
    except Exception as e:  # noqa: BLE001 - one failing config must not end the run
        rec["error"] = repr(e)[:300]
    sets = None
    torch.cuda.empty_cache()
    return [rec]


def bench_config(
    shape, B, T, sdt, with_fla, copy_tbps, split=None, with_replay=False, with_write_all=True, with_fla_job=False
):
    H, HV = ALL_SHAPES[shape]
    state_dtype = DTYPES[sdt]
    set_bytes = B * T * HV * DIM * DIM * torch.finfo(state_dtype).bits // 8
    n_sets = rotating_sets(set_bytes)
    sets = make_sets(H, HV, B, T, state_dtype, n_sets, 1000 + B + 10 * T)
    prm = make_params(HV, 7)
    n_calls = max(MIN_CALLS, n_sets)
    results = []
    impls = (
        (["gdn"] if with_write_all else [])
        + (["fla"] if with_fla else [])
        + (["fla_job"] if with_fla and with_fla_job else [])
    )
    for impl in impls:
        fl = (
            [fla_inputs(st, prm, H, HV, B, T, dense_ok=impl == "fla") for st in sets]
            if impl != "gdn"
            else [None] * n_sets
        )
        rec = dict(impl=impl, shape=shape, H=H, HV=HV, B=B, T=T, state=sdt, sets=n_sets, calls=n_calls, split=split)
        if impl == "gdn":
            rec["state_layout"] = STATE_LAYOUT
        try:
            rec["rel_err"] = validate(impl, sets[0], prm, fl[0], H, HV, B, T)
            bar = 2e-2 if impl != "gdn" and sdt == "fp32" else 1e-2
            rec["valid"] = rec["rel_err"] <= bar
            if impl == "gdn":
                calls = [(lambda st=sets[i % n_sets]: gdn_call(st, prm, HV, split)) for i in range(n_calls)]
                nbytes = gdn_bytes(H, HV, B, T, state_dtype)
            elif impl == "fla_job":
                calls = [
                    (lambda i=i: fla_job_call(fl[i % n_sets], sets[i % n_sets], prm, T, HV)) for i in range(n_calls)
                ]
                nbytes = fla_job_bytes(H, HV, B, T, state_dtype)
                rec["kernel"] = "fused_recurrent_kda + layer_norm_gated_fwd (rms)"
            else:
                calls = [(lambda i=i: fla_call(fl[i % n_sets], sets[i % n_sets], prm, T)) for i in range(n_calls)]
                nbytes = fla_bytes(H, HV, B, T, state_dtype, fl[0]["dense"])
                rec["kernel"] = "fused_recurrent_gdn" if fl[0]["dense"] else "fused_recurrent_kda"
            med, lo, hi = time_graph(calls)
            tbps = nbytes / med / 1e12
            rec.update(
                us=med * 1e6,
                us_min=lo * 1e6,
                us_max=hi * 1e6,
                bytes=nbytes,
                tbps=tbps,
                pct_copy=100 * tbps / copy_tbps,
                pct_spec=100 * tbps / SPEC_TBPS,
            )
        except Exception as e:  # noqa: BLE001 - one failing config must not end the run
            rec["error"] = repr(e)[:300]
        results.append(rec)
        fl = None  # frees the FLA inputs before the next implementation
    sets = None
    torch.cuda.empty_cache()
    if with_replay:
        results += bench_replay(shape, B, T, sdt, copy_tbps, split)
    return results


# ---- report --------------------------------------------------------------------------------------

LABELS = {"gdn": "libgdn", "fla": "FLA", "replay": "libgdn replay", "fla_job": "FLA + norm"}


def plot(results, env, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 9), sharey=True)
    for ax, shape in zip(axes.flat, SHAPES):
        for sdt, color in (("fp32", "tab:blue"), ("bf16", "tab:orange")):
            for T, marker in zip(TOKENS, "os^D"):
                for impl, style in (("gdn", "-"), ("fla", ":"), ("replay", "--")):
                    pts = sorted(
                        (r["B"], r["tbps"])
                        for r in results
                        if r.get("tbps")
                        and r["shape"] == shape
                        and r["state"] == sdt
                        and r["T"] == T
                        and r["impl"] == impl
                        and r.get("split") is None
                    )
                    if pts:
                        ax.plot(
                            [p[0] for p in pts],
                            [p[1] for p in pts],
                            style,
                            marker=marker,
                            color=color,
                            alpha=1.0 if impl == "gdn" else 0.6,
                            label=f"{LABELS[impl]} {sdt} T={T}",
                        )
        ax.axhline(env["copy_tbps"], color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{shape} (H={SHAPES[shape][0]}, HV={SHAPES[shape][1]})")
        ax.set_xlabel("batch (requests)")
        ax.set_ylabel("TB/s (state reads + T writes + activations)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=6, ncol=2)
    fig.suptitle(
        f"decode_mtp on {env['gpu']} (copy {env['copy_tbps']:.2f} TB/s, dashed gray); "
        f"libgdn solid, libgdn replay dashed, FLA dotted"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(results):
    lines = ["impl    shape   state  T    B      us      TB/s  %copy  valid"]
    for r in results:
        if r.get("split") is not None:
            continue
        if "us" in r:
            lines.append(
                f"{r['impl']:7} {r['shape']:7} {r['state']:5} {r['T']:2} {r['B']:4} "
                f"{r['us']:8.2f} {r['tbps']:7.2f} {r['pct_copy']:6.1f}  "
                f"{r['valid']} ({r['rel_err']:.1e})"
            )
        else:
            lines.append(f"{r['impl']:7} {r['shape']:7} {r['state']:5} {r['T']:2} {r['B']:4} ERROR {r.get('error')}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="TP1 only, T in {1, 4}")
    ap.add_argument(
        "--sweep-split",
        action="store_true",
        help="also time every head split (CTAs per value head) on TP1, write-all and replay",
    )
    ap.add_argument(
        "--splits", type=int, nargs="+", default=[1, 2, 4, 8], help="the splits --sweep-split times (default: 1 2 4 8)"
    )
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument(
        "--fla-job",
        action="store_true",
        help="also time FLA's whole layer call of the same job: its slot-gathered "
        "in-place kernel (fp32 T = 1 too) and its gated RMSNorm (impl fla_job)",
    )
    ap.add_argument(
        "--isolated", action="store_true", help="a 4-byte memcpy before every call: no overlap between calls"
    )
    ap.add_argument("--no-replay", action="store_true", help="skip replay verify (T > 1 rows)")
    ap.add_argument(
        "--no-write-all", action="store_true", help="skip write-every-token decode_mtp (replay and FLA rows only)"
    )
    ap.add_argument("--tokens", type=int, nargs="+", help="T values (default: 1 2 4 8; --quick: 1 4)")
    ap.add_argument("--batches", type=int, nargs="+", help=f"B values (default: {BATCHES})")
    ap.add_argument(
        "--states", nargs="+", choices=list(DTYPES), help=f"state dtypes (default: {' '.join(DEFAULT_STATES)})"
    )
    (
        ap.add_argument(
            "--shapes",
            nargs="+",
            choices=list(ALL_SHAPES),
            help=f"(H, HV) shapes by name (default: {' '.join(SHAPES)}; --quick: TP1); "
            f"also {', '.join(f'{k} {v}' for k, v in EXTRA_SHAPES.items())}",
        ),
    )
    ap.add_argument(
        "--state-layout",
        choices=["vk", "kv"],
        default="vk",
        help="libgdn's state layout argument (default vk; kv is the CUDA kernel's slow "
        "path; FLA rows keep their own [V, K] pools)",
    )
    ap.add_argument("--json", default="benchmarks/results/decode_mtp_h200.json")
    ap.add_argument("--png", default="benchmarks/results/decode_mtp_h200.png")
    ap.add_argument("--budget", type=float, default=220.0, help="stop starting configs after this")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_decode_mtp: no CUDA device")
    global ISOLATED, STATE_LAYOUT
    ISOLATED = args.isolated
    STATE_LAYOUT = args.state_layout
    t0 = time.time()
    env = environment()
    env["copy_tbps"] = copy_bandwidth()
    with_fla = not args.no_fla and fla_available()
    print(
        f"{env['gpu']}, {env['sm_count']} SMs, copy {env['copy_tbps']:.3f} TB/s, "
        f"fla {env['fla']}, triton {env['triton']}",
        flush=True,
    )
    shapes = args.shapes or (["TP1"] if args.quick else list(SHAPES))
    tokens = args.tokens or ([1, 4] if args.quick else TOKENS)
    batches = args.batches or BATCHES
    results, skipped = [], []
    states = args.states or list(DEFAULT_STATES)
    configs = [(sh, B, T, sdt) for sh in shapes for sdt in states for T in tokens for B in batches]
    if args.sweep_split:  # TP1 at T in {1, 4} (or --tokens), replay included where T > 1
        for sdt in states:
            for T in args.tokens or (1, 4):
                for B in batches:
                    for split in args.splits:
                        configs.append(("TP1", B, T, sdt, split))
    for cfg in configs:
        if time.time() - t0 > args.budget:
            skipped.append(cfg)
            continue
        shape, B, T, sdt = cfg[:4]
        split = cfg[4] if len(cfg) > 4 else None
        recs = bench_config(
            shape,
            B,
            T,
            sdt,
            with_fla and split is None,
            env["copy_tbps"],
            split,
            with_replay=not args.no_replay and T > 1,
            with_write_all=not args.no_write_all,
            with_fla_job=args.fla_job,
        )
        for r in recs:
            results.append(r)
            if "us" in r:
                print(
                    f"{r['impl']:7} {shape:6} {sdt} T={T} B={B:3}"
                    f"{'' if split is None else f' split={split}'}: {r['us']:9.2f} us "
                    f"{r['tbps']:5.2f} TB/s ({r['pct_copy']:5.1f}% copy) "
                    f"valid={r['valid']} err={r['rel_err']:.1e}",
                    flush=True,
                )
            else:
                print(f"{r['impl']:6} {shape:6} {sdt} T={T} B={B}: {r.get('error')}", flush=True)
    env["elapsed_s"] = time.time() - t0
    doc = {"environment": env, "method": __doc__, "results": results, "skipped_for_time": [list(c) for c in skipped]}
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as fh:
        json.dump(doc, fh, indent=1)
    try:
        plot(results, env, args.png)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {e!r}", file=sys.stderr)
    print(summary(results))
    if skipped:
        print(f"skipped {len(skipped)} configurations (time budget)")
    print(f"elapsed {env['elapsed_s']:.1f} s")


if __name__ == "__main__":
    main()
