"""gdn.compat.fla against a float64 recurrence written from FLA's documented formulas, and the
kernels' input options (a_is_log_decay, b_is_beta, qk_l2_norm) through gdn.decode_mtp,
gdn.decode_mtp_replay and gdn.prefill against gdn.reference.

Fresh random inputs per test (never zeros), outputs poisoned where the call takes them; varlen
and dense batches, with and without an initial state, both state layouts, head ratios 1..4,
float32 and 16-bit activations. CUDA cases skip with the reason on machines without a GPU; FLA
itself (fla-core) is compared when importable.
"""

from __future__ import annotations

import itertools
import math
from typing import List

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

import gdn  # noqa: E402
from gdn.compat import fla  # noqa: E402
from reference_torch import cuda_skip_reason  # noqa: E402

F64 = torch.float64
_CUDA_SKIP = cuda_skip_reason()
on_cuda = pytest.mark.skipif(_CUDA_SKIP is not None, reason=f"CUDA: {_CUDA_SKIP}")


# ---- the float64 recurrence of FLA's docstrings --------------------------------------------------


def naive_gated_delta_rule(
    q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None, l2norm=False, state_v_first=False
):
    """o [B, T, HV, V] and the final states [N, HV, K, V] (``[N, HV, V, K]`` with state_v_first),
    float64, of: per sequence and value head hv (q/k head hv // (HV // H)), from the initial state
    or zeros, per token: q, k optionally ``x / sqrt(sum(x^2) + 1e-6)``, q times scale; S (K x V)
    ``S = exp(g) S``; ``u = beta (v - k^T S)``; ``S += k u^T``; ``o = q^T S``. ``g`` and ``beta``
    [B, T, HV] are the effective log-decay and beta (gates already applied)."""
    q, k, v, g, beta = (x.to(F64) for x in (q, k, v, g, beta))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    r = HV // H
    scale = K**-0.5 if scale is None else scale
    L = B * T
    q, k = q.reshape(L, H, K).repeat_interleave(r, 1), k.reshape(L, H, K).repeat_interleave(r, 1)
    v, g, beta = v.reshape(L, HV, V), g.reshape(L, HV), beta.reshape(L, HV)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * scale
    cu = list(range(0, L + 1, T)) if cu_seqlens is None else [int(x) for x in cu_seqlens]
    N = len(cu) - 1
    h0 = None if initial_state is None else initial_state.to(F64)
    if h0 is not None and state_v_first:
        h0 = h0.transpose(-1, -2)
    o = torch.zeros(L, HV, V, dtype=F64)
    final = torch.zeros(N, HV, K, V, dtype=F64)
    for n in range(N):
        S = torch.zeros(HV, K, V, dtype=F64) if h0 is None else h0[n].clone()
        for t in range(cu[n], cu[n + 1]):
            S = S * torch.exp(g[t])[:, None, None]
            u = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], S))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", q[t], S)
        final[n] = S
    if state_v_first:
        final = final.transpose(-1, -2)
    return o.reshape(B, T, HV, V), final


def effective_gates(g, beta, *, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid, neg_eigval, shape):
    """FLA's gate conventions in float64: the log-decay and beta the recurrence uses."""
    if g is None:
        ge = torch.zeros(shape, dtype=F64)
    elif use_gate_in_kernel:
        x = g.to(F64) + (0.0 if dt_bias is None else dt_bias.to(F64))
        ge = -torch.exp(A_log.to(F64)) * F.softplus(x, beta=1.0, threshold=20.0)
    else:
        ge = g.to(F64)
    be = torch.ones(shape, dtype=F64) if beta is None else beta.to(F64)
    if use_beta_sigmoid:
        be = torch.sigmoid(be) * (2.0 if neg_eigval else 1.0)
    return ge, be


def rel_l2(got, want) -> float:
    got, want = got.detach().cpu().to(F64), want.detach().cpu().to(F64)
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want).clamp_min(1e-300))


# ---- inputs ----------------------------------------------------------------------------------------


def fla_inputs(gen, *, B, T, H, HV, K, V, dtype, log_g, raw_beta, normalized_qk, cu=None):
    """Random FLA-style inputs: q, k, v [B, T, heads, dim]; g [B, T, HV] a log-decay (logsigmoid of
    a random value, as FLA's examples draw it) or a raw gate input; beta in (0, 1) or its logit;
    A_log, dt_bias [HV]. Without the in-kernel L2 norm, k is normalised beforehand (FLA's examples
    pass F.normalize'd keys) and q is scaled to a comparable size."""

    def rnd(*shape, std=1.0):
        return std * torch.randn(*shape, generator=gen)

    q, k, v = rnd(B, T, H, K), rnd(B, T, H, K), rnd(B, T, HV, V)
    if normalized_qk:
        k = F.normalize(k, p=2, dim=-1) * (1.0 + 0.05 * rnd(B, T, H, 1))  # near, not at, unit norm
        q = q / math.sqrt(K)
    g = F.logsigmoid(rnd(B, T, HV) + 2.0) if log_g else rnd(B, T, HV)
    beta = rnd(B, T, HV) if raw_beta else torch.sigmoid(rnd(B, T, HV))
    A_log, dt_bias = rnd(HV, std=0.5), rnd(HV, std=0.1)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    return dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log, dt_bias=dt_bias)


def lengths_to_cu(lengths: List[int]) -> torch.Tensor:
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int64)


# (gate in kernel, beta sigmoid in kernel, L2 norm in kernel): Qwen3-Next's in-kernel form, FLA's
# default (everything precomputed) and two mixes.
MODES = [(True, True, True), (False, False, False), (False, True, True), (True, False, False)]


def expected(inp, *, mode, neg_eigval=False, g_given=True, beta_given=True, **kw):
    gate_in, beta_sig, l2 = mode
    B, T, HV = inp["v"].shape[:3]
    ge, be = effective_gates(
        inp["g"] if g_given else None,
        inp["beta"] if beta_given else None,
        use_gate_in_kernel=gate_in,
        A_log=inp["A_log"],
        dt_bias=inp["dt_bias"],
        use_beta_sigmoid=beta_sig,
        neg_eigval=neg_eigval,
        shape=(B, T, HV),
    )
    return naive_gated_delta_rule(inp["q"], inp["k"], inp["v"], ge, be, l2norm=l2, **kw)


def fla_kwargs(inp, mode):
    gate_in, beta_sig, l2 = mode
    return dict(
        use_gate_in_kernel=gate_in,
        A_log=inp["A_log"] if gate_in else None,
        dt_bias=inp["dt_bias"] if gate_in else None,
        use_beta_sigmoid_in_kernel=beta_sig,
        use_qk_l2norm_in_kernel=l2,
    )


def tolerances(dtype):
    # 16-bit activations: the inputs are the same rounded values on both sides, so only the output
    # rounding (and, for the chunked CUDA path, bf16 operands) remains.
    return (1e-5, 1e-5) if dtype == torch.float32 else (4e-3, 1e-5)


# ---- fused_recurrent_gated_delta_rule --------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=["in-kernel", "precomputed", "log-g", "raw-g-beta"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_fused_recurrent_matches_float64(gen, mode, varlen, with_initial, state_v_first):
    H, HV, K, V = 2, 4, 16, 32
    lengths = [3, 1, 0, 5, 2] if varlen else [4, 4, 4]
    B, T = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    inp = fla_inputs(
        gen, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=torch.float32, log_g=not mode[0], raw_beta=mode[1],
        normalized_qk=not mode[2],
    )  # fmt: skip
    N = len(lengths)
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    h0 = 0.3 * torch.randn(*shape, generator=gen) if with_initial else None
    cu = lengths_to_cu(lengths) if varlen else None
    h0_before = None if h0 is None else h0.clone()
    o, ht = fla.fused_recurrent_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], beta=inp["beta"], initial_state=h0, output_final_state=True,
        state_v_first=state_v_first, cu_seqlens=cu, **fla_kwargs(inp, mode),
    )  # fmt: skip
    ref_o, ref_ht = expected(inp, mode=mode, initial_state=h0, cu_seqlens=cu, state_v_first=state_v_first)
    assert o.shape == inp["v"].shape and o.dtype == inp["v"].dtype
    assert ht.shape == shape and ht.dtype == torch.float32
    assert rel_l2(o, ref_o) <= 1e-5
    assert rel_l2(ht, ref_ht) <= 1e-5
    if with_initial:  # the initial state is only read
        assert torch.equal(h0, h0_before)


@pytest.mark.parametrize("ratio", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_fused_recurrent_ratios_and_dtypes(gen, ratio, dtype):
    H, K, V = 2, 32, 16
    HV = H * ratio
    inp = fla_inputs(gen, B=2, T=5, H=H, HV=HV, K=K, V=V, dtype=dtype, log_g=True, raw_beta=False, normalized_qk=False)
    h0 = 0.2 * torch.randn(2, HV, K, V, generator=gen)
    o, ht = fla.fused_recurrent_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], beta=inp["beta"], initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    ref_o, ref_ht = expected(inp, mode=(False, False, True), initial_state=h0)
    out_tol, state_tol = tolerances(dtype)
    assert o.dtype == dtype
    assert rel_l2(o, ref_o) <= out_tol
    assert rel_l2(ht, ref_ht) <= state_tol


def test_fused_recurrent_defaults_and_optional_arguments(gen):
    """g None (no decay), beta None (ones), no final state requested, allow_neg_eigval, dt_bias None
    and FLA's deprecated transpose_state_layout."""
    H, HV, K, V = 1, 2, 16, 16
    inp = fla_inputs(
        gen, B=2, T=3, H=H, HV=HV, K=K, V=V, dtype=torch.float32, log_g=True, raw_beta=True, normalized_qk=True
    )
    o, ht = fla.fused_recurrent_gated_delta_rule(inp["q"], inp["k"], inp["v"])
    assert ht is None
    ref_o, _ = expected(inp, mode=(False, False, False), g_given=False, beta_given=False)
    assert rel_l2(o, ref_o) <= 1e-5

    o, ht = fla.fused_recurrent_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], beta=inp["beta"], output_final_state=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    ref_o, ref_ht = expected(inp, mode=(False, True, True), neg_eigval=True)
    assert rel_l2(o, ref_o) <= 1e-5 and rel_l2(ht, ref_ht) <= 1e-5

    inp["dt_bias"] = None
    o, ht = fla.fused_recurrent_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], beta=inp["beta"], output_final_state=True,
        use_gate_in_kernel=True, A_log=inp["A_log"], transpose_state_layout=True,
    )  # fmt: skip
    inp["dt_bias"] = torch.zeros(HV)
    ref_o, ref_ht = expected(inp, mode=(True, False, False), state_v_first=True)
    assert ht.shape == (2, HV, V, K)
    assert rel_l2(o, ref_o) <= 1e-5 and rel_l2(ht, ref_ht) <= 1e-5


def test_fused_recurrent_long_sequences(gen):
    """More tokens per sequence than the fused CUDA kernel takes per call (16): on the CPU the
    fused path still runs them in one call."""
    H, HV, K, V = 2, 4, 16, 16
    lengths = [40, 17, 3]
    inp = fla_inputs(
        gen,
        B=1,
        T=sum(lengths),
        H=H,
        HV=HV,
        K=K,
        V=V,
        dtype=torch.float32,
        log_g=False,
        raw_beta=True,
        normalized_qk=False,
    )
    cu = lengths_to_cu(lengths)
    h0 = 0.2 * torch.randn(3, HV, K, V, generator=gen)
    o, ht = fla.fused_recurrent_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], beta=inp["beta"], initial_state=h0, output_final_state=True,
        cu_seqlens=cu, **fla_kwargs(inp, MODES[0]),
    )  # fmt: skip
    ref_o, ref_ht = expected(inp, mode=MODES[0], initial_state=h0, cu_seqlens=cu)
    assert rel_l2(o, ref_o) <= 1e-5 and rel_l2(ht, ref_ht) <= 1e-5


@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_fused_recurrent_pool_slots(gen, state_v_first):
    """The serving extension: ssm_state_indices [N] (read and write one slot per sequence) and
    [N, S] with num_accepted_tokens (gdn.decode_mtp's verify form) on a pool updated in place."""
    H, HV, K, V, slots = 2, 4, 16, 16, 12
    shape = (slots, HV, V, K) if state_v_first else (slots, HV, K, V)
    layout = "vk" if state_v_first else "kv"
    pool = 0.2 * torch.randn(*shape, generator=gen)
    lengths = [2, 3, 1]
    cu = lengths_to_cu(lengths)
    inp = fla_inputs(
        gen, B=1, T=6, H=H, HV=HV, K=K, V=V, dtype=torch.float32, log_g=True, raw_beta=False, normalized_qk=False
    )
    mode = (False, False, True)

    # [N]: slots 7, 2, 9 are read and their final states written back.
    idx = torch.tensor([7, 2, 9])
    before = pool.clone()
    o, ht = fla.fused_recurrent_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], beta=inp["beta"], initial_state=pool, cu_seqlens=cu,
        state_v_first=state_v_first, ssm_state_indices=idx, **fla_kwargs(inp, mode),
    )  # fmt: skip
    assert ht is pool
    ref_o, ref_ht = expected(inp, mode=mode, initial_state=before[idx], cu_seqlens=cu, state_v_first=state_v_first)
    assert rel_l2(o, ref_o) <= 1e-5 and rel_l2(pool[idx], ref_ht) <= 1e-5
    untouched = [s for s in range(slots) if s not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])

    # [N, S]: the verify form matches gdn.reference.decode_mtp_reference.
    table = torch.tensor([[0, 1, 3], [4, 5, 6], [8, 10, 11]], dtype=torch.int32)
    acc = torch.tensor([2, 1, 3], dtype=torch.int32)
    before = pool.clone()
    o, ht = fla.fused_recurrent_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], beta=inp["beta"], initial_state=pool, cu_seqlens=cu,
        state_v_first=state_v_first, ssm_state_indices=table, num_accepted_tokens=acc, **fla_kwargs(inp, mode),
    )  # fmt: skip
    L = 6
    mixed = torch.cat([inp[x].reshape(L, -1) for x in ("q", "k", "v")], 1)
    ref_o, ref_pool = gdn.reference.decode_mtp_reference(
        mixed.numpy(), inp["g"].reshape(L, HV).numpy(), inp["beta"].reshape(L, HV).numpy(), None, None,
        before.numpy(), table.numpy(), cu.numpy(), num_accepted_tokens=acc.numpy(), state_layout=layout,
        a_is_log_decay=True, b_is_beta=True,
    )  # fmt: skip
    assert rel_l2(o.reshape(L, HV, V), torch.from_numpy(ref_o)) <= 1e-5
    assert rel_l2(pool, torch.from_numpy(ref_pool)) <= 1e-5


def test_fused_recurrent_refuses_what_it_cannot_match(gen):
    inp = fla_inputs(
        gen, B=1, T=2, H=1, HV=2, K=8, V=8, dtype=torch.float32, log_g=True, raw_beta=False, normalized_qk=True
    )
    q, k, v, g, beta = (inp[x] for x in ("q", "k", "v", "g", "beta"))
    f = fla.fused_recurrent_gated_delta_rule
    with pytest.raises(NotImplementedError, match="gk / gv"):
        f(q, k, v, gk=torch.zeros(1, 2, 2, 8))
    with pytest.raises(NotImplementedError, match="one value per value channel"):
        f(q, k, v, g, beta=torch.rand(1, 2, 2, 8))
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        f(q, k, v, g, beta=beta, allow_neg_eigval=True)
    with pytest.raises(ValueError, match="needs A_log"):
        f(q, k, v, g, beta=beta, use_gate_in_kernel=True)
    with pytest.raises(ValueError, match="batch size must be 1"):
        f(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), cu_seqlens=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="initial_state must be"):
        f(q, k, v, g, beta=beta, initial_state=torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match="num_accepted_tokens needs ssm_state_indices"):
        f(q, k, v, g, beta=beta, num_accepted_tokens=torch.ones(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="unexpected keyword"):
        f(q, k, v, g, beta=beta, use_qk_l2norm=True)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        f(q.double(), k.double(), v.double(), g, beta=beta)


# ---- chunk_gated_delta_rule ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES, ids=["in-kernel", "precomputed", "log-g", "raw-g-beta"])
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("with_initial", [False, True], ids=["zeros", "h0"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
def test_chunk_matches_float64(gen, mode, varlen, with_initial, state_v_first):
    H, HV, K, V = 2, 6, 16, 16
    lengths = [70, 1, 0, 65] if varlen else [66, 66]
    B, T = (1, sum(lengths)) if varlen else (len(lengths), lengths[0])
    inp = fla_inputs(
        gen, B=B, T=T, H=H, HV=HV, K=K, V=V, dtype=torch.float32, log_g=not mode[0], raw_beta=mode[1],
        normalized_qk=not mode[2],
    )  # fmt: skip
    N = len(lengths)
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    h0 = 0.3 * torch.randn(*shape, generator=gen) if with_initial else None
    cu = lengths_to_cu(lengths) if varlen else None
    kw = fla_kwargs(inp, mode)
    o, ht = fla.chunk_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=kw.pop("use_qk_l2norm_in_kernel"), state_v_first=state_v_first, cu_seqlens=cu,
        cu_seqlens_cpu=cu, **kw,
    )  # fmt: skip
    ref_o, ref_ht = expected(inp, mode=mode, initial_state=h0, cu_seqlens=cu, state_v_first=state_v_first)
    assert o.shape == inp["v"].shape and o.dtype == inp["q"].dtype
    assert ht.shape == shape and ht.dtype == torch.float32
    assert rel_l2(o, ref_o) <= 1e-4
    assert rel_l2(ht, ref_ht) <= 1e-4
    o2, none = fla.chunk_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], initial_state=h0, state_v_first=state_v_first,
        cu_seqlens=cu, **fla_kwargs(inp, mode),
    )  # fmt: skip
    assert none is None and torch.equal(o2, o)


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def test_chunk_sixteen_bit(gen, ratio, dtype):
    H, K, V = 2, 16, 16
    HV = H * ratio
    inp = fla_inputs(gen, B=2, T=40, H=H, HV=HV, K=K, V=V, dtype=dtype, log_g=False, raw_beta=True, normalized_qk=False)
    o, ht = fla.chunk_gated_delta_rule(
        inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], output_final_state=True,
        **fla_kwargs(inp, MODES[0]),
    )  # fmt: skip
    ref_o, ref_ht = expected(inp, mode=MODES[0])
    assert o.dtype == dtype
    assert rel_l2(o, ref_o) <= 4e-3 and rel_l2(ht, ref_ht) <= 1e-4


def test_chunk_refuses_what_it_cannot_match(gen):
    inp = fla_inputs(
        gen, B=1, T=2, H=1, HV=2, K=8, V=8, dtype=torch.float32, log_g=True, raw_beta=False, normalized_qk=True
    )
    args = [inp[x] for x in ("q", "k", "v", "g", "beta")]
    with pytest.raises(NotImplementedError, match="cp_context"):
        fla.chunk_gated_delta_rule(*args, cp_context=object())
    with pytest.raises(ValueError, match="chunk_size"):
        fla.chunk_gated_delta_rule(*args, chunk_size=128)
    with pytest.raises(ValueError, match="head_first"):
        fla.chunk_gated_delta_rule(*args, head_first=True)


def test_signatures_follow_fla():
    """FLA 0.6.0's parameter names and order (positional callers keep working)."""
    import inspect

    fused = list(inspect.signature(fla.fused_recurrent_gated_delta_rule).parameters)
    assert fused[:18] == [
        "q", "k", "v", "g", "gk", "gv", "beta", "scale", "initial_state", "output_final_state",
        "use_qk_l2norm_in_kernel", "use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel",
        "allow_neg_eigval", "state_v_first", "cu_seqlens",
    ]  # fmt: skip
    chunk = list(inspect.signature(fla.chunk_gated_delta_rule).parameters)
    assert chunk[:16] == [
        "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "use_qk_l2norm_in_kernel",
        "use_beta_sigmoid_in_kernel", "allow_neg_eigval", "state_v_first", "cu_seqlens", "cu_seqlens_cpu",
        "chunk_indices", "cp_context",
    ]  # fmt: skip


# ---- CUDA --------------------------------------------------------------------------------------------


def _cuda(inp):
    return {n: (x.cuda() if isinstance(x, torch.Tensor) else x) for n, x in inp.items()}


@on_cuda
@pytest.mark.parametrize("mode", MODES, ids=["in-kernel", "precomputed", "log-g", "raw-g-beta"])
@pytest.mark.parametrize("state_v_first", [False, True], ids=["kv", "vk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("long", [False, True], ids=["fused", "long"])
def test_cuda_fused_recurrent(gen, mode, state_v_first, dtype, long):
    """Up to 16 tokens per sequence: gdn.decode_mtp's kernel (float32 rounding); longer: gdn.prefill's
    chunked kernel (bf16 operands), which refuses modes other than FLA's in-kernel one until it reads
    the input options (the case then skips)."""
    H, HV, K, V = 2, 6, 128, 128
    lengths = [40, 3] if long else [4, 1, 0, 3]
    inp = fla_inputs(
        gen, B=1, T=sum(lengths), H=H, HV=HV, K=K, V=V, dtype=dtype, log_g=not mode[0], raw_beta=mode[1],
        normalized_qk=not mode[2],
    )  # fmt: skip
    N = len(lengths)
    shape = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    h0 = 0.3 * torch.randn(*shape, generator=gen)
    cu = lengths_to_cu(lengths)
    ref_o, ref_ht = expected(inp, mode=mode, initial_state=h0, cu_seqlens=cu, state_v_first=state_v_first)
    d = _cuda(inp)
    o, ht = fla.fused_recurrent_gated_delta_rule(
        d["q"], d["k"], d["v"], d["g"], beta=d["beta"], initial_state=h0.cuda(), output_final_state=True,
        state_v_first=state_v_first, cu_seqlens=cu.cuda(), **fla_kwargs(d, mode),
    )  # fmt: skip
    out_tol, state_tol = (2e-2, 2e-2) if long else tolerances(dtype)
    assert o.is_cuda and ht.is_cuda
    assert rel_l2(o, ref_o) <= out_tol and rel_l2(ht, ref_ht) <= state_tol


@on_cuda
@pytest.mark.parametrize("mode", MODES, ids=["in-kernel", "precomputed", "log-g", "raw-g-beta"])
def test_cuda_chunk(gen, mode):
    """gdn.prefill's CUDA kernels (bf16 operands), in every input mode."""
    H, HV, K, V = 2, 4, 128, 128
    lengths = [130, 1, 64]
    inp = fla_inputs(
        gen, B=1, T=sum(lengths), H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, log_g=not mode[0],
        raw_beta=mode[1], normalized_qk=not mode[2],
    )  # fmt: skip
    h0 = 0.3 * torch.randn(3, HV, V, K, generator=gen)
    cu = lengths_to_cu(lengths)
    ref_o, ref_ht = expected(inp, mode=mode, initial_state=h0, cu_seqlens=cu, state_v_first=True)
    d = _cuda(inp)
    kw = fla_kwargs(d, mode)
    o, ht = fla.chunk_gated_delta_rule(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=h0.cuda(), output_final_state=True,
        use_qk_l2norm_in_kernel=kw.pop("use_qk_l2norm_in_kernel"), state_v_first=True, cu_seqlens=cu.cuda(),
        **kw,
    )  # fmt: skip
    assert rel_l2(o, ref_o) <= 2e-2 and rel_l2(ht, ref_ht) <= 2e-2


@on_cuda
def test_cuda_against_fla_if_installed(gen):
    """FLA's own kernels on the same inputs, where fla-core is importable."""
    fla_ops = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core is not installed")
    H, HV, K, V = 2, 4, 128, 128
    inp = _cuda(
        fla_inputs(
            gen, B=2, T=4, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, log_g=False, raw_beta=True, normalized_qk=False
        )
    )
    kw = dict(fla_kwargs(inp, MODES[0]), output_final_state=True)
    args = (inp["q"], inp["k"], inp["v"], inp["g"])
    o, ht = fla.fused_recurrent_gated_delta_rule(*args, beta=inp["beta"], **kw)
    o_ref, ht_ref = fla_ops.fused_recurrent_gated_delta_rule(*args, beta=inp["beta"], **kw)
    assert rel_l2(o, o_ref) <= 1e-2 and rel_l2(ht, ht_ref) <= 1e-2


# ---- the input options through gdn.decode_mtp, gdn.decode_mtp_replay and gdn.prefill ----------------

OPTIONS = [
    dict(a_is_log_decay=a, b_is_beta=b, qk_l2_norm=n)
    for a in (False, True)
    for b in (False, True)
    for n in (True, False)
]


def _option_id(o):
    return (
        "-".join(
            k
            for k, v in (("logdecay", o["a_is_log_decay"]), ("beta", o["b_is_beta"]), ("nonorm", not o["qk_l2_norm"]))
            if v
        )
        or "default"
    )


def step_inputs(gen, *, L, H, HV, K, V, options, act=torch.float32):
    """mixed_qkv, a, b, A_log, dt_bias for the options: a log-decay <= 0 with a_is_log_decay (and no
    A_log, dt_bias), a beta in (0, 1) with b_is_beta, q and k rows near unit norm without the L2
    norm."""
    x = torch.randn(L, 2 * H * K + HV * V, generator=gen)
    if not options["qk_l2_norm"]:
        x[:, : 2 * H * K] /= math.sqrt(K)
    a, b = torch.randn(L, HV, generator=gen), torch.randn(L, HV, generator=gen)
    if options["a_is_log_decay"]:
        a = F.logsigmoid(a + 2.0)
    if options["b_is_beta"]:
        b = torch.sigmoid(b)
    A_log, dt_bias = 0.5 * torch.randn(HV, generator=gen), 0.1 * torch.randn(HV, generator=gen)
    if options["a_is_log_decay"]:
        A_log = dt_bias = None
    return x.to(act), a.to(act), b.to(act), A_log, dt_bias


@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("op", ["function", "torch_op"])
def test_decode_mtp_options_match_reference(gen, options, layout, op):
    H, HV, K, V, S, slots = 2, 6, 16, 16, 3, 14
    T = [2, 0, 3, 1]
    cu = lengths_to_cu(T).to(torch.int32)
    L = int(cu[-1])
    x, a, b, A_log, dt_bias = step_inputs(gen, L=L, H=H, HV=HV, K=K, V=V, options=options)
    state = 0.2 * torch.randn(slots, HV, K, V, generator=gen)
    table = torch.randperm(slots, generator=gen)[: 4 * S].reshape(4, S).to(torch.int32)
    acc = torch.tensor([2, 1, 1, 3], dtype=torch.int32)
    z, w = torch.randn(L, HV, V, generator=gen), 1.0 + 0.1 * torch.randn(V, generator=gen)
    before = state.clone()
    out = torch.full((L, HV, V), float("nan"))
    call = gdn.decode_mtp if op == "function" else torch.ops.gdn.decode_mtp
    call(
        x, a, b, A_log, dt_bias, state, table, cu, out, z=z, norm_weight=w, num_accepted_tokens=acc,
        state_layout=layout, **options,
    )  # fmt: skip
    ref_out, ref_state = gdn.reference.decode_mtp_reference(
        x.numpy(), a.numpy(), b.numpy(), None if A_log is None else A_log.numpy(),
        None if dt_bias is None else dt_bias.numpy(), before.numpy(), table.numpy(), cu.numpy(), z=z.numpy(),
        norm_weight=w.numpy(), num_accepted_tokens=acc.numpy(), state_layout=layout, **options,
    )  # fmt: skip
    assert rel_l2(out, torch.from_numpy(ref_out)) <= 1e-5
    assert rel_l2(state, torch.from_numpy(ref_state)) <= 1e-5
    if options != OPTIONS[0]:  # the options change the result
        default_out = torch.full_like(out, float("nan"))
        params = (A_log, dt_bias) if A_log is not None else (torch.zeros(HV), torch.zeros(HV))
        gdn.decode_mtp(x, a, b, *params, before.clone(), table, cu, default_out, z=z, norm_weight=w,
                       num_accepted_tokens=acc, state_layout=layout)  # fmt: skip
        assert not torch.allclose(out, default_out)


@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("op", ["function", "torch_op"])
def test_prefill_options_match_reference(gen, options, op):
    H, HV, K, V, slots = 1, 3, 16, 16, 8
    T = [70, 0, 5]
    cu = lengths_to_cu(T)
    L = int(cu[-1])
    x, a, b, A_log, dt_bias = step_inputs(gen, L=L, H=H, HV=HV, K=K, V=V, options=options, act=torch.bfloat16)
    state = 0.2 * torch.randn(slots, HV, V, K, generator=gen)
    initial, final = torch.tensor([3, 1, -1]), torch.tensor([3, 5, 6])
    before = state.clone()
    out = torch.full((L, HV, V), float("nan"), dtype=torch.bfloat16)
    call = gdn.prefill if op == "function" else torch.ops.gdn.prefill
    call(x, a, b, A_log, dt_bias, state, initial, final, cu, out, **options)
    ref_out, ref_state = gdn.reference.prefill_reference(
        x.float().numpy(), a.float().numpy(), b.float().numpy(), None if A_log is None else A_log.numpy(),
        None if dt_bias is None else dt_bias.numpy(), before.numpy(), initial.numpy(), final.numpy(), cu.numpy(),
        **options,
    )  # fmt: skip
    assert rel_l2(out, torch.from_numpy(ref_out)) <= 4e-3
    assert rel_l2(state, torch.from_numpy(ref_state)) <= 1e-4


@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
def test_replay_options_equal_write_every_token(gen, options):
    """A replay chain with the input options gives decode_mtp's outputs and, as its checkpoint,
    decode_mtp's state at column acc - 1, bit for bit on the CPU."""
    H, HV, K, V, S, N = 1, 2, 16, 16, 4, 3
    window = gdn.ReplayWindow.allocate(N, S, H=H, HV=HV, K=K, V=V, dtype=torch.float32)
    start = 0.2 * torch.randn(N, HV, V, K, generator=gen)
    ckpt = start.clone()  # replay: one checkpoint slot per request
    wa = torch.zeros(N * S, HV, V, K)  # write-all: S slots per request, starting in column 0
    wa_table = torch.arange(N * S, dtype=torch.int32).reshape(N, S)
    wa[wa_table[:, 0].long()] = start
    accepted = torch.zeros(N, dtype=torch.int32)  # replay's n (0 after prefill)
    acc = torch.ones(N, dtype=torch.int32)  # write-all's column + 1
    A_log, dt_bias = step_inputs(gen, L=1, H=H, HV=HV, K=K, V=V, options=options)[3:]  # the layer's
    for step in range(3):
        T = [int(t) for t in torch.randint(1, S + 1, (N,), generator=gen)]
        cu = lengths_to_cu(T).to(torch.int32)
        L = int(cu[-1])
        x, a, b = step_inputs(gen, L=L, H=H, HV=HV, K=K, V=V, options=options)[:3]
        out_rp, out_wa = (torch.full((L, HV, V), float("nan")) for _ in range(2))
        gdn.decode_mtp_replay(
            x, a, b, A_log, dt_bias, ckpt, torch.arange(N, dtype=torch.int32), cu, out_rp, **window.arrays(),
            num_accepted_tokens=accepted, **options,
        )  # fmt: skip
        wa_before = wa.clone()
        gdn.decode_mtp(x, a, b, A_log, dt_bias, wa, wa_table, cu, out_wa, num_accepted_tokens=acc, **options)
        assert torch.equal(out_rp, out_wa), f"step {step}"
        if step > 0:
            for i in range(N):
                assert torch.equal(ckpt[i], wa_before[int(wa_table[i, int(acc[i]) - 1])]), f"step {step} row {i}"
        n = torch.tensor([int(torch.randint(1, t + 1, (1,), generator=gen)) for t in T], dtype=torch.int32)
        accepted, acc = n, n.clone()


def test_gate_parameters_required_unless_log_decay(gen):
    x, a, b, A_log, dt_bias = step_inputs(gen, L=2, H=1, HV=2, K=8, V=8, options=OPTIONS[0])
    state = torch.zeros(2, 2, 8, 8)
    args = (torch.tensor([[0]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.empty(2, 2, 8))
    with pytest.raises(ValueError, match="A_log is required unless a_is_log_decay"):
        gdn.decode_mtp(x, a, b, None, dt_bias, state, *args)
    with pytest.raises(ValueError, match="dt_bias is required unless a_is_log_decay"):
        torch.ops.gdn.decode_mtp(x, a, b, A_log, None, state, *args)
    gdn.decode_mtp(x, a, b, None, None, state, *args, a_is_log_decay=True)


@on_cuda
@pytest.mark.parametrize("options", OPTIONS, ids=_option_id)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_decode_mtp_and_replay_options(gen, options, state_dtype):
    """The CUDA decode_mtp and replay kernels with the input options against the CPU path."""
    H, HV, K, V, S, N = 2, 4, 128, 128, 4, 5
    T = [4, 1, 0, 3, 2]
    cu = lengths_to_cu(T).to(torch.int32)
    L = int(cu[-1])
    x, a, b, A_log, dt_bias = step_inputs(gen, L=L, H=H, HV=HV, K=K, V=V, options=options, act=torch.bfloat16)
    table = torch.randperm(N * S + 2, generator=gen)[: N * S].reshape(N, S).to(torch.int32)
    acc = torch.tensor([2, 1, 1, 4, 1], dtype=torch.int32)
    state = (0.2 * torch.randn(N * S + 2, HV, V, K, generator=gen)).to(state_dtype)
    outs, states = [], []
    for dev in ("cpu", "cuda"):
        args = [t if t is None else t.to(dev) for t in (x, a, b, A_log, dt_bias)]
        st = state.clone().to(dev)
        out = torch.full((L, HV, V), float("nan"), dtype=torch.bfloat16, device=dev)
        gdn.decode_mtp(*args, st, table.to(dev), cu.to(dev), out, num_accepted_tokens=acc.to(dev), **options)
        outs.append(out.cpu())
        states.append(st.cpu())
    bar = 1e-5 if state_dtype == torch.float32 else 1e-2
    assert rel_l2(outs[1], outs[0]) <= 4e-3 and rel_l2(states[1], states[0]) <= bar
    # Replay: a two-step chain on both devices.
    results = []
    for dev in ("cpu", "cuda"):
        window = gdn.ReplayWindow.allocate(N, S, H=H, HV=HV, K=K, V=V, dtype=torch.bfloat16, device=dev)
        ckpt = state[:N].clone().to(dev)
        got = []
        for n in ([0] * N, [1, 1, 0, 2, 1]):
            args = [t if t is None else t.to(dev) for t in (x, a, b, A_log, dt_bias)]
            out = torch.full((L, HV, V), float("nan"), dtype=torch.bfloat16, device=dev)
            gdn.decode_mtp_replay(
                *args, ckpt, torch.arange(N, dtype=torch.int32, device=dev), cu.to(dev), out, **window.arrays(),
                num_accepted_tokens=torch.tensor(n, dtype=torch.int32, device=dev), **options,
            )  # fmt: skip
            got.append(out.cpu())
        results.append((got, ckpt.cpu()))
    for o_cpu, o_gpu in zip(results[0][0], results[1][0]):
        assert rel_l2(o_gpu, o_cpu) <= 4e-3
    assert rel_l2(results[1][1], results[0][1]) <= bar


@on_cuda
@pytest.mark.parametrize("options", OPTIONS[1:], ids=_option_id)
def test_cuda_prefill_input_options_equal_to_cpu(gen, options):
    """gdn's CUDA prefill reads every input option: it matches the CPU path within its bf16-operand
    accuracy."""
    H, HV, K, V = 1, 2, 128, 128
    T = [70, 3]
    cu = lengths_to_cu(T)
    L = int(cu[-1])
    x, a, b, A_log, dt_bias = step_inputs(gen, L=L, H=H, HV=HV, K=K, V=V, options=options, act=torch.bfloat16)
    state = 0.2 * torch.randn(3, HV, V, K, generator=gen)
    initial, final = torch.tensor([0, -1]), torch.tensor([1, 2])
    results = []
    for dev in ("cpu", "cuda"):
        st = state.clone().to(dev)
        out = torch.full((L, HV, V), float("nan"), dtype=torch.bfloat16, device=dev)
        args = [t if t is None else t.to(dev) for t in (x, a, b, A_log, dt_bias)]
        gdn.prefill(*args, st, initial.to(dev), final.to(dev), cu.to(dev), out, **options)
        results.append((out.cpu(), st.cpu()))
    assert rel_l2(results[1][0], results[0][0]) <= 2e-2
    assert rel_l2(results[1][1], results[0][1]) <= 2e-2


def test_cuda_tests_skip_saying_why():
    if _CUDA_SKIP is not None:
        assert _CUDA_SKIP.startswith("no GPU") or "CUDA" in _CUDA_SKIP or "kernel" in _CUDA_SKIP
