"""torch.ops.gdn.decode_mtp: same results as gdn.decode_mtp, a correct schema (opcheck), and usable
inside torch.compile(fullgraph=True). Every torch.ops.gdn op: callable with its optional mutated
arguments omitted under each autograd mode (CPU, and CUDA when present), and every tensor it may
write marked mutable in its schema. The per-layer ops run C++ kernels when the package was built
with them (else, or with GDN_TORCH_OP_KERNELS=python, the gdn function as a Python kernel), and
raise what the function raises."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
from typing import Any, Callable, Dict, FrozenSet

import pytest

import gdn
from gdn import metadata as M

torch = pytest.importorskip("torch")

from reference_torch import check_case, cuda_skip_reason, make_case  # noqa: E402 (needs torch)

BF16, FP32 = torch.bfloat16, torch.float32

# torch.compile imports torch.jit pieces that warn about their own deprecation.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

CONFIGS = {
    "fp32_vk_silu": dict(H=2, HV=4, act=FP32, layout="vk", gate="silu"),
    "bf16_kv_sigmoid_strided": dict(H=1, HV=3, act=BF16, layout="kv", gate="sigmoid", strided=True),
    "state_bf16_norm_only_vllm_nulls": dict(H=2, HV=8, act=BF16, state_dtype=BF16, norm="w", first_valid_slot=1),
    "no_norm_no_acc": dict(H=1, HV=5, act=FP32, norm="none", use_acc=False),
}


def _case(gen, cfg):
    return make_case(gen, K=32, V=32, S=4, T=(4, 0, 2, 3), **CONFIGS[cfg])


def _run_copy(case, fn, **kw):
    """Runs fn on copies of the pool and out of `case`; returns (out buffer, pool buffer)."""
    pool = case.pool_buffer.clone()
    out_buffer = torch.full_like(case.out_buffer, float("nan"))
    state = pool.as_strided(
        case.state.shape, case.state.stride(), case.state.storage_offset() - case.pool_buffer.storage_offset()
    )
    out = out_buffer.as_strided(
        case.out.shape, case.out.stride(), case.out.storage_offset() - case.out_buffer.storage_offset()
    )
    args = list(case.args())
    args[5], args[8] = state, out
    fn(*args, **case.kwargs(), **kw)
    assert torch.isfinite(out).all()  # every row is covered by a request
    return out_buffer, pool


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_op_matches_function(gen, cfg):
    case = _case(gen, cfg)
    o1, p1 = _run_copy(case, gdn.decode_mtp)
    o2, p2 = _run_copy(case, torch.ops.gdn.decode_mtp)
    o3, p3 = _run_copy(case, torch.ops.gdn.decode_mtp.default)
    for o, p in ((o2, p2), (o3, p3)):
        assert torch.equal(o1.view(torch.uint8), o.view(torch.uint8))
        assert torch.equal(p1.view(torch.uint8), p.view(torch.uint8))


def test_op_against_reference(gen):
    case = _case(gen, "bf16_kv_sigmoid_strided")
    check_case(case, out_tol=4e-3, fn=torch.ops.gdn.decode_mtp)


def test_positional_arguments_follow_the_schema(gen):
    """Positional up to ``out``, keyword-only after it, for the op as for the function."""
    case = _case(gen, "fp32_vk_silu")
    o1, p1 = _run_copy(case, gdn.decode_mtp)
    o2, p2 = _run_copy(case, lambda *a, **k: torch.ops.gdn.decode_mtp(*a, **k))
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
    extra = (case.z,)  # z, positionally
    for fn in (gdn.decode_mtp, torch.ops.gdn.decode_mtp):
        with pytest.raises((TypeError, RuntimeError), match="positional argument"):
            fn(*case.args(), *extra)


@pytest.mark.parametrize("cfg,counter", [("fp32_vk_silu", False), ("bf16_kv_sigmoid_strided", True)])
def test_opcheck(gen, cfg, counter):
    case = _case(gen, cfg)
    args, opts = case.args(), case.kwargs()
    if counter:  # the optional device error counter is part of the schema (mutated)
        opts["error_count"] = torch.zeros(1, dtype=torch.int32)
    assert _cpu_kernel("decode_mtp") == _expected_kernels()  # opcheck runs the build's kernels
    result = torch.library.opcheck(torch.ops.gdn.decode_mtp.default, args, opts)
    assert all(v == "SUCCESS" for v in result.values()), result


def _compiled_step(H, HV, K, V):
    """A model-like step: split the packed projections, call the op, nothing else."""

    def step(mixed_qkv, ba, A_log, dt_bias, z, norm_weight, state, state_indices, cu_seqlens, num_accepted_tokens, out):
        a, b = ba[:, :HV], ba[:, HV:]
        torch.ops.gdn.decode_mtp(
            mixed_qkv,
            a,
            b,
            A_log,
            dt_bias,
            state,
            state_indices,
            cu_seqlens,
            out,
            z=z,
            norm_weight=norm_weight,
            num_accepted_tokens=num_accepted_tokens,
            gate="silu",
            state_layout="vk",
        )

    return step


def _backends():
    have_cxx = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
    return [
        "eager",
        "aot_eager",
        pytest.param(
            "inductor",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(not have_cxx, reason="inductor on the CPU needs a C++ compiler"),
            ],
        ),
    ]


@pytest.mark.parametrize("backend", _backends())
def test_torch_compile_fullgraph(gen, backend):
    assert _cpu_kernel("decode_mtp") == _expected_kernels()  # the compiled graph calls them
    H, HV, K, V = 1, 2, 16, 16
    torch._dynamo.reset()
    step = _compiled_step(H, HV, K, V)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for T in [(3, 1, 2), (3, 1, 2), (2, 3, 0, 3)]:  # fresh data; then another token count
        case = make_case(gen, H=H, HV=HV, K=K, V=V, S=3, T=T, strided=True)
        ba = case.a.as_strided((case.a.shape[0], 2 * HV), case.a.stride())
        assert torch.equal(ba[:, HV:], case.b)
        inputs = (case.mixed_qkv, ba, case.A_log, case.dt_bias, case.z, case.norm_weight)
        idx = (case.state_indices, case.cu_seqlens, case.num_accepted_tokens)
        state_e, out_e = case.state.clone(), torch.full_like(case.out, float("nan"))
        step(*inputs, state_e, *idx, out_e)
        case.poison_out()
        compiled(*inputs, case.state, *idx, case.out)
        rows = case.token_rows()
        assert torch.isfinite(case.out[rows]).all()
        assert torch.equal(case.out[rows], out_e[rows])
        assert torch.equal(case.state, state_e)


@pytest.mark.parametrize("fn", [gdn.decode_mtp, torch.ops.gdn.decode_mtp], ids=["function", "torch_op"])
def test_model_parameters_are_accepted(gen, fn):
    """A_log, dt_bias and norm_weight are usually nn.Parameters (requires_grad) of a model."""
    case = _case(gen, "fp32_vk_silu")
    o1, p1 = _run_copy(case, fn)
    for name in ("A_log", "dt_bias", "norm_weight"):
        setattr(case, name, torch.nn.Parameter(getattr(case, name)))
    o2, p2 = _run_copy(case, fn)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)


# ---- every torch.ops.gdn op ----------------------------------------------------------------------


_CUDA_REASON = cuda_skip_reason()
_needs_cuda = pytest.mark.skipif(_CUDA_REASON is not None, reason=f"CUDA: {_CUDA_REASON}")

# The Tensor arguments each gdn function may write (its contract), by op name.
WRITES = {
    "decode_mtp": {"state", "out", "error_count"},
    "decode_mtp_replay": {"state", "out", "window_k", "window_v", "window_a", "window_b", "window_len", "error_count"},
    "causal_conv1d_update": {"conv_state", "out", "error_count"},
    "causal_conv1d_prefill": {"conv_state", "out", "error_count"},
    "prefill": {"state", "out", "error_count"},
    "metadata_plan": {"plan"},
    "metadata_state_rows": {
        "plan",
        "spec_state_indices",
        "non_spec_state_indices",
        "error_count",
        "non_spec_source_indices",
        "checkpoint_indices",
    },
}

GRAD_MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}

I32 = torch.int32


@dataclasses.dataclass
class OpCall:
    """Inputs `t` (keyed by schema argument name) and two calls on them: `op(t, **extra)` calls the
    torch op leaving out its trailing defaulted arguments (the optional mutated ones among them),
    `fn(t)` the gdn function with the same arguments."""

    t: Dict[str, Any]
    op: Callable[..., None]
    fn: Callable[[Dict[str, Any]], None]
    written: FrozenSet[str]  # what op(t) changes
    optional: tuple  # optional tensors in t that op(t) leaves out
    written_full: FrozenSet[str]  # what op(t, **optional) changes on the CPU


def _decode_mtp_call(gen, device):
    K = 128 if device == "cuda" else 32  # the CUDA kernel's head dim
    case = make_case(gen, H=1, HV=2, K=K, V=K, S=3, T=(3, 0, 2))
    names = ("mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens", "out")
    opt = ("z", "norm_weight", "num_accepted_tokens")
    t = {n: getattr(case, n).to(device) for n in names + opt}
    t["out"].fill_(float("nan"))
    t["error_count"] = torch.zeros(1, dtype=I32, device=device)
    for n in ("A_log", "dt_bias", "norm_weight"):  # model parameters
        t[n].requires_grad_()

    def call(f, t, **extra):
        f(*(t[n] for n in names), **{n: t[n] for n in opt}, **extra)

    # The CPU path raises on invalid rows and never writes error_count.
    return OpCall(
        t,
        lambda t, **e: call(torch.ops.gdn.decode_mtp, t, **e),
        lambda t: call(gdn.decode_mtp, t),
        frozenset({"state", "out"}),
        ("error_count",),
        frozenset({"state", "out"}),
    )


def _conv_call(gen, device):
    D, W, num_spec, slots = 16, 4, 2, 8
    names = ("x", "weight", "conv_state", "conv_state_indices", "cu_seqlens", "out")
    t = dict(
        x=torch.randn(5, D, generator=gen),
        weight=torch.randn(D, W, generator=gen),
        conv_state=torch.randn(slots, D, W - 1 + num_spec, generator=gen),
        conv_state_indices=torch.randperm(slots, generator=gen)[:3].to(I32),
        cu_seqlens=torch.tensor([0, 3, 3, 5], dtype=I32),
        out=torch.full((5, D), float("nan")),
        num_accepted_tokens=torch.tensor([2, 1, 3], dtype=I32),
        error_count=torch.zeros(1, dtype=I32),
    )
    t = {k: v.to(device) for k, v in t.items()}
    t["weight"].requires_grad_()

    def call(f, t, **extra):
        f(*(t[n] for n in names), num_accepted_tokens=t["num_accepted_tokens"], **extra)

    return OpCall(
        t,
        lambda t, **e: call(torch.ops.gdn.causal_conv1d_update, t, **e),
        lambda t: call(gdn.causal_conv1d_update, t),
        frozenset({"conv_state", "out"}),
        ("error_count",),
        frozenset({"conv_state", "out"}),
    )


def _conv_prefill_call(gen, device):
    D, W, num_spec, slots = 16, 4, 2, 8
    names = (
        "x",
        "weight",
        "conv_state",
        "initial_state_indices",
        "final_state_indices",
        "cu_seqlens",
        "out",
    )
    t = dict(
        x=torch.randn(70, D, generator=gen),
        weight=torch.randn(D, W, generator=gen),
        conv_state=torch.randn(slots, D, W - 1 + num_spec, generator=gen),
        initial_state_indices=torch.tensor([2, 5, 0], dtype=I32),
        final_state_indices=torch.tensor([3, 5, 7], dtype=I32),
        cu_seqlens=torch.tensor([0, 2, 2, 70], dtype=I32),
        out=torch.full((70, D), float("nan")),
        error_count=torch.zeros(1, dtype=I32),
    )
    t = {k: v.to(device) for k, v in t.items()}
    t["weight"].requires_grad_()

    def call(f, t, **extra):
        f(*(t[n] for n in names), **extra)

    return OpCall(
        t,
        lambda t, **e: call(torch.ops.gdn.causal_conv1d_prefill, t, **e),
        lambda t: call(gdn.causal_conv1d_prefill, t),
        frozenset({"conv_state", "out"}),
        ("error_count",),
        frozenset({"conv_state", "out"}),
    )


def _prefill_call(gen, device):
    K = 128 if device == "cuda" else 32  # the CUDA kernel's head dim
    case = make_case(gen, H=1, HV=2, K=K, V=K, S=3, T=(3, 0, 2))
    names = ("mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "initial_state_indices")
    names += ("final_state_indices", "cu_seqlens", "out")
    opt = ("z", "norm_weight")
    t = {n: getattr(case, n) for n in ("mixed_qkv", "a", "b", "A_log", "dt_bias", "cu_seqlens", "out") + opt}
    t["state"] = torch.randn(6, 2, K, K, generator=gen)
    t["initial_state_indices"] = torch.tensor([4, 1, -1], dtype=I32)
    t["final_state_indices"] = torch.tensor([2, 1, 3], dtype=I32)
    t["error_count"] = torch.zeros(1, dtype=I32)
    t = {n: x.to(device) for n, x in t.items()}
    t["out"].fill_(float("nan"))
    for n in ("A_log", "dt_bias", "norm_weight"):  # model parameters
        t[n].requires_grad_()

    def call(f, t, **extra):
        f(*(t[n] for n in names), **{n: t[n] for n in opt}, **extra)

    return OpCall(
        t,
        lambda t, **e: call(torch.ops.gdn.prefill, t, **e),
        lambda t: call(gdn.prefill, t),
        frozenset({"state", "out"}),
        ("error_count",),
        frozenset({"state", "out"}),
    )


def _replay_call(gen, device):
    K = 128 if device == "cuda" else 32
    H, HV, S, slots = 1, 2, 3, 6
    case = make_case(gen, H=H, HV=HV, K=K, V=K, S=S, T=(3, 0, 2))
    names = (
        "mixed_qkv",
        "a",
        "b",
        "A_log",
        "dt_bias",
        "state",
        "state_indices",
        "cu_seqlens",
        "out",
        "window_k",
        "window_v",
        "window_a",
        "window_b",
        "window_len",
        "num_accepted_tokens",
    )
    opt = ("z", "norm_weight")
    t = {n: getattr(case, n) for n in names[:9] + opt}
    t["state"] = torch.randn(slots, HV, K, K, generator=gen)
    t["state_indices"] = torch.tensor([4, 1, 2], dtype=I32)
    window = gdn.ReplayWindow.allocate(
        slots, S, H=H, HV=HV, K=K, V=K, dtype=case.mixed_qkv.dtype, ab_dtype=case.a.dtype
    )
    for x in (window.k, window.v, window.a, window.b):
        x.copy_(torch.randn(x.shape, generator=gen))
    window.len.copy_(torch.tensor([0, 1, 2, 3, 2, 0], dtype=I32))
    t.update(
        window_k=window.k,
        window_v=window.v,
        window_a=window.a,
        window_b=window.b,
        window_len=window.len,
        num_accepted_tokens=torch.tensor([2, 3, 1], dtype=I32),
        error_count=torch.zeros(1, dtype=I32),
    )
    t = {n: x.to(device) for n, x in t.items()}
    t["out"].fill_(float("nan"))

    def call(f, t, **extra):
        f(*(t[n] for n in names), **{n: t[n] for n in opt}, **extra)

    written = frozenset({"state", "out", "window_k", "window_v", "window_a", "window_b", "window_len"})
    return OpCall(
        t,
        lambda t, **e: call(torch.ops.gdn.decode_mtp_replay, t, **e),
        lambda t: call(gdn.decode_mtp_replay, t),
        written,
        ("error_count",),
        written,
    )


# A host plan of 3 requests (spec, decode, spec; num_spec 2) for R rows / T tokens.
R, T_MAX, NUM_SPEC = 6, 16, 2


def _plan_inputs():
    return dict(
        plan=torch.zeros(M.plan_words(R, T_MAX), dtype=I32),
        query_start_loc=torch.tensor([0, 3, 4, 6], dtype=I32),
        seq_lens=torch.tensor([8, 6, 7], dtype=I32),
        num_draft_tokens=torch.tensor([2, -1, 1], dtype=I32),
        num_accepted_tokens=torch.tensor([2, 1, 3], dtype=I32),
        num_computed_tokens=torch.tensor([5, 5, 5], dtype=I32),
    )


def _plan_fn(t):
    M.plan(
        t["plan"],
        t["query_start_loc"],
        t["seq_lens"],
        num_draft_tokens=t["num_draft_tokens"],
        num_accepted_tokens=t["num_accepted_tokens"],
        num_computed_tokens=t["num_computed_tokens"],
        num_spec=NUM_SPEC,
        max_rows=R,
        max_tokens=T_MAX,
    )


def _metadata_plan_call(gen, device):
    t = _plan_inputs()  # host tensors only: there is no CUDA form of the plan

    def op(t, **extra):
        torch.ops.gdn.metadata_plan(
            t["plan"],
            t["query_start_loc"],
            t["seq_lens"],
            num_draft_tokens=t["num_draft_tokens"],
            num_accepted_tokens=t["num_accepted_tokens"],
            num_computed_tokens=t["num_computed_tokens"],
            num_spec=NUM_SPEC,
            max_rows=R,
            max_tokens=T_MAX,
            **extra,
        )

    return OpCall(t, op, _plan_fn, frozenset({"plan"}), (), frozenset({"plan"}))


def _metadata_state_rows_call(gen, device):
    planned = _plan_inputs()
    _plan_fn(planned)
    G = 2
    # The second table is too narrow for S = 3 columns: its spec rows are padded and counted.
    tables = [torch.randint(1, 1 << 20, (3, cols), generator=gen, dtype=I32) for cols in (4, 2)]
    t = dict(
        plan=planned["plan"],
        block_tables=tables,
        spec_state_indices=torch.full((G, R, NUM_SPEC + 1), -9, dtype=I32),
        non_spec_state_indices=torch.full((G, R), -9, dtype=I32),
        num_accepted_tokens=torch.tensor([1, 1, 2], dtype=I32),  # differs from the plan's
        error_count=torch.zeros(1, dtype=I32),
        non_spec_source_indices=torch.full((G, R), -9, dtype=I32),
    )
    t = {k: [x.to(device) for x in v] if isinstance(v, list) else v.to(device) for k, v in t.items()}
    names = ("plan", "block_tables", "spec_state_indices", "non_spec_state_indices")

    def op(t, **extra):
        torch.ops.gdn.metadata_state_rows(
            *(t[n] for n in names), num_spec=NUM_SPEC, max_rows=R, max_tokens=T_MAX, **extra
        )

    def fn(t):
        M.state_rows(*(t[n] for n in names), num_spec=NUM_SPEC, max_rows=R, max_tokens=T_MAX)

    # checkpoint_indices is written in replay mode only (test_metadata_state_rows_op_in_replay_mode).
    return OpCall(
        t,
        op,
        fn,
        frozenset({"spec_state_indices", "non_spec_state_indices"}),
        ("num_accepted_tokens", "error_count", "non_spec_source_indices"),
        frozenset(WRITES["metadata_state_rows"] - {"checkpoint_indices"}),
    )


CALLS = {
    "decode_mtp": _decode_mtp_call,
    "decode_mtp_replay": _replay_call,
    "causal_conv1d_update": _conv_call,
    "causal_conv1d_prefill": _conv_prefill_call,
    "prefill": _prefill_call,
    "metadata_plan": _metadata_plan_call,
    "metadata_state_rows": _metadata_state_rows_call,
}


def _clone(t):
    def c(v):
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        return [c(x) for x in v] if isinstance(v, list) else v

    return {k: c(v) for k, v in t.items()}


def _same(a, b) -> bool:
    """Bit equality (NaN == NaN) of tensors or lists of tensors."""
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    bits = lambda x: x.detach().cpu().contiguous().view(torch.uint8)  # noqa: E731
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def _changed(before, after):
    return {k for k in after if not _same(before[k], after[k])}


def test_every_gdn_op_is_covered():
    names = {n.split("::", 1)[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith("gdn::")}
    assert names == set(WRITES) == set(CALLS)


_OP_DEVICES = [
    pytest.param(name, dev, id=f"{name}-{dev}", marks=[pytest.mark.gpu, _needs_cuda] if dev == "cuda" else [])
    for name in sorted(CALLS)
    for dev in ("cpu", "cuda")
    if (name, dev) != ("metadata_plan", "cuda")
]  # the plan is built on the host


@pytest.mark.parametrize("mode", list(GRAD_MODES))
@pytest.mark.parametrize("name,device", _OP_DEVICES)
def test_op_without_optional_mutated_args(gen, name, device, mode):
    """Trailing defaulted arguments (the optional mutated ones among them) are dropped by the
    dispatcher before the kernel runs; the op must work without them in every autograd mode."""
    call = CALLS[name](gen, device)
    before = _clone(call.t)
    expect = _clone(call.t)
    call.fn(expect)
    with GRAD_MODES[mode]():
        assert torch.is_grad_enabled() == (mode == "grad")
        call.op(call.t)
    for k in call.t:
        assert _same(call.t[k], expect[k]), f"{name}: {k} differs from the function's"
    assert _changed(before, call.t) == call.written


@pytest.mark.parametrize("name", sorted(CALLS))
def test_schema_marks_every_written_tensor_mutable(gen, name):
    schema = getattr(torch.ops.gdn, name).default._schema
    args = {a.name: a for a in schema.arguments}
    mutable = {n for n, a in args.items() if a.alias_info is not None and a.alias_info.is_write}
    assert mutable == WRITES[name]
    assert all(a.alias_info is None or a.alias_info.is_write for a in schema.arguments)
    assert len(schema.returns) == 0
    # What a CPU call with every optional tensor given changes is declared mutable.
    call = CALLS[name](gen, "cpu")
    assert set(call.t) <= set(args)
    before = _clone(call.t)
    call.op(call.t, **{n: call.t[n] for n in call.optional})
    changed = _changed(before, call.t)
    assert changed <= mutable
    assert changed == call.written_full


# ---- one signature: each op takes its function's arguments ---------------------------------------

# The gdn function behind each op, written out here (gdn.ops.FUNCTIONS must agree).
FUNCTIONS = {
    "decode_mtp": gdn.decode_mtp,
    "decode_mtp_replay": gdn.decode_mtp_replay,
    "causal_conv1d_update": gdn.causal_conv1d_update,
    "causal_conv1d_prefill": gdn.causal_conv1d_prefill,
    "prefill": gdn.prefill,
    "metadata_plan": M.plan,
    "metadata_state_rows": M.state_rows,
}
_NO_DEFAULT = "<required>"


def _from_function(fn):
    """(name, keyword-only, default) per argument the op must take: the function's arguments,
    minus the declared exclusions (renamed or left out)."""
    from gdn.ops import SCHEMA_EXCLUDED

    rows = []
    for p in inspect.signature(fn).parameters.values():
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY), (fn.__name__, p)
        name = p.name
        if name in SCHEMA_EXCLUDED:
            name = SCHEMA_EXCLUDED[name][0]
            if name is None:
                continue
        default = _NO_DEFAULT if p.default is p.empty else p.default
        rows.append((name, p.kind is p.KEYWORD_ONLY, type(default).__name__, default))
    return rows


def _from_schema(schema):
    rows = []
    for a in schema.arguments:
        default = a.default_value if a.has_default_value() else _NO_DEFAULT
        rows.append((a.name, a.kwarg_only, type(default).__name__, default))
    return rows


def test_every_op_has_its_function():
    from gdn import ops

    assert set(FUNCTIONS) == set(WRITES)
    assert ops.FUNCTIONS == FUNCTIONS
    used = {name for fn in FUNCTIONS.values() for name in inspect.signature(fn).parameters}
    for name, (op_name, why) in ops.SCHEMA_EXCLUDED.items():
        assert name in used and why, f"exclusion {name!r} is stale or unexplained"


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_op_schema_equals_function_signature(name):
    """Names, order, keyword-only split and defaults of torch.ops.gdn.<name> are exactly its
    function's, minus gdn.ops.SCHEMA_EXCLUDED."""
    schema = getattr(torch.ops.gdn, name).default._schema
    expected, got = _from_function(FUNCTIONS[name]), _from_schema(schema)
    diff = [(i, e, g) for i, (e, g) in enumerate(zip(expected, got)) if e != g]
    assert not diff and len(expected) == len(got), (
        f"{name}: schema {schema} differs from the function; first differences (position, "
        f"function, op): {diff[:3]}; lengths {len(expected)} vs {len(got)}"
    )


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function_docstring_names_every_argument(name):
    """The function is the one definition of an op's arguments; its docstring documents each of
    them by name (``name``)."""
    fn = FUNCTIONS[name]
    missing = [p for p in inspect.signature(fn).parameters if f"``{p}``" not in (fn.__doc__ or "")]
    assert not missing, f"{fn.__qualname__}: the docstring does not name {missing}"


def test_argument_kinds_come_from_the_annotations():
    """Each argument's kind (what the binding converts) is declared by its annotation; the
    metadata builder's step and prepare take the same step inputs."""
    from gdn._common import argument_kinds, arguments

    for fn in FUNCTIONS.values():
        kinds = argument_kinds(fn)
        assert list(kinds) == [p for p in inspect.signature(fn).parameters if p != "stream"]
        written = {a.name for a in arguments(fn) if a.written}
        assert all(kinds[n].rstrip("?") == "array" for n in written), fn.__qualname__
    assert argument_kinds(M.Builder.step) == argument_kinds(M.Builder.prepare)


def test_metadata_plan_op_takes_mode_as_cache_mode():
    """The one rename: the op's cache_mode is the function's mode (same value, same effect)."""
    t = _plan_inputs()
    expect = _clone(t)
    kw = dict(num_spec=NUM_SPEC, max_rows=R, max_tokens=T_MAX, block_size=2)
    M.plan(
        expect["plan"],
        expect["query_start_loc"],
        expect["seq_lens"],
        mode="align",
        num_draft_tokens=expect["num_draft_tokens"],
        **kw,
    )
    torch.ops.gdn.metadata_plan(
        t["plan"], t["query_start_loc"], t["seq_lens"], cache_mode="align", num_draft_tokens=t["num_draft_tokens"], **kw
    )
    assert torch.equal(t["plan"], expect["plan"])
    plain = _clone(t)
    M.plan(plain["plan"], plain["query_start_loc"], plain["seq_lens"], num_draft_tokens=plain["num_draft_tokens"], **kw)
    assert not torch.equal(plain["plan"], expect["plan"])  # "align" made a difference


def test_metadata_state_rows_op_in_replay_mode(gen):
    """In replay mode the op also writes checkpoint_indices (declared mutable), exactly as the
    function does."""
    t = _plan_inputs()
    t["num_accepted_tokens"] = torch.tensor([0, 2, 3], dtype=I32)  # replay counts 0..S
    M.plan(
        t["plan"],
        t["query_start_loc"],
        t["seq_lens"],
        num_draft_tokens=t["num_draft_tokens"],
        num_accepted_tokens=t["num_accepted_tokens"],
        num_spec=NUM_SPEC,
        max_rows=R,
        max_tokens=T_MAX,
        replay=True,
    )
    G = 2
    tables = [torch.randint(1, 1 << 20, (3, cols), generator=gen, dtype=I32) for cols in (1, 4)]
    outputs = dict(
        spec_state_indices=torch.full((G, R, NUM_SPEC + 1), -9, dtype=I32),
        non_spec_state_indices=torch.full((G, R), -9, dtype=I32),
        checkpoint_indices=torch.full((G, R), -9, dtype=I32),
        non_spec_source_indices=torch.full((G, R), -9, dtype=I32),
    )
    expect = _clone(outputs)
    kw = dict(num_spec=NUM_SPEC, max_rows=R, max_tokens=T_MAX, replay=True)
    M.state_rows(
        t["plan"],
        tables,
        expect["spec_state_indices"],
        expect["non_spec_state_indices"],
        checkpoint_indices=expect["checkpoint_indices"],
        non_spec_source_indices=expect["non_spec_source_indices"],
        **kw,
    )
    before = _clone(outputs)
    torch.ops.gdn.metadata_state_rows(
        t["plan"],
        tables,
        outputs["spec_state_indices"],
        outputs["non_spec_state_indices"],
        checkpoint_indices=outputs["checkpoint_indices"],
        non_spec_source_indices=outputs["non_spec_source_indices"],
        **kw,
    )
    assert all(_same(outputs[k], expect[k]) for k in outputs)
    assert _changed(before, outputs) == set(outputs)
    torch.testing.assert_close(
        outputs["checkpoint_indices"][:, :2], torch.stack([tables[g][[0, 2], 0] for g in range(G)])
    )
    schema = torch.ops.gdn.metadata_state_rows.default._schema
    mutable = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert set(outputs) <= mutable


# ---- the kernels: C++ where the package has them, else the gdn function ---------------------------

PACKAGE = pathlib.Path(gdn.__file__).parent


def _expected_kernels() -> str:
    """ "c++" when the package holds torch op kernels built against this torch (torch_ops.json names
    its version) and GDN_TORCH_OP_KERNELS does not ask for Python ones, else "python"."""
    if os.environ.get("GDN_TORCH_OP_KERNELS", "").strip().lower() == "python":
        return "python"
    built = PACKAGE / "torch_ops.json"
    if not built.exists():
        return "python"
    return "c++" if json.loads(built.read_text())["torch"] == str(torch.__version__) else "python"


def _cpu_kernel(name: str, key: str = "CPU") -> str:
    """Whose kernel torch.ops.gdn.<name> has for a dispatch key, by the dispatcher's record: "c++"
    (an unboxed function of src/torch_ops/kernels.cpp) or "python" (the gdn function, from
    gdn/ops.py)."""
    dump = torch._C._dispatch_dump(f"gdn::{name}").splitlines()
    line = next(row for row in dump if row.startswith(key + ":"))
    if "torch_ops/kernels.cpp" in line and "unboxed" in line:
        return "c++"
    assert "ops.py" in line, line
    return "python"


def test_each_op_has_the_builds_kernels():
    from gdn import ops

    expected = _expected_kernels()
    assert ops.KERNELS == expected, ops.KERNELS_REASON
    assert ops.KERNELS_REASON
    assert set(ops.CPP_OPS) < set(WRITES)
    # A CPU torch has no CUDA tensors: the library gives only a CUDA torch CUDA kernels.
    expected_cuda = expected if torch.version.cuda is not None else "python"
    for name in sorted(WRITES):  # the metadata ops (once per step) always run the function
        assert _cpu_kernel(name) == (expected if name in ops.CPP_OPS else "python"), name
        assert _cpu_kernel(name, "CUDA") == (expected_cuda if name in ops.CPP_OPS else "python"), name


# Bad calls: a change to a valid call's tensors, and the argument the error must name.
BAD_CALLS = {
    "decode_mtp-dtype": (
        "decode_mtp",
        lambda t: t.update(state_indices=t["state_indices"].float()),
        "state_indices has dtype float32",
    ),
    "decode_mtp-shape": ("decode_mtp", lambda t: t.update(A_log=t["A_log"][:1]), "A_log dimension"),
    "decode_mtp-range": (
        "decode_mtp",
        lambda t: t["num_accepted_tokens"].add_(5),
        "num_accepted_tokens = 8 is outside",
    ),
    "decode_mtp-dlpack-dtype": (
        "decode_mtp",
        lambda t: t.update(cu_seqlens=t["cu_seqlens"].byte()),
        "cu_seqlens has dtype uint8; expected one of: int32, int64",
    ),
    "replay-dtype": (
        "decode_mtp_replay",
        lambda t: t.update(window_len=t["window_len"].float()),
        "window_len has dtype float32",
    ),
    "replay-shape": ("decode_mtp_replay", lambda t: t.update(window_k=t["window_k"][:, :2]), "window_v dimension 1"),
    "replay-range": (
        "decode_mtp_replay",
        lambda t: t["num_accepted_tokens"].add_(3),
        "num_accepted_tokens[0] = 5 is outside",
    ),
    "conv-dtype": (
        "causal_conv1d_update",
        lambda t: t.update(cu_seqlens=t["cu_seqlens"].float()),
        "cu_seqlens has dtype float32",
    ),
    "conv-shape": (
        "causal_conv1d_update",
        lambda t: t.update(conv_state=t["conv_state"][:, :, :2]),
        "conv_state holds",
    ),
    "conv-range": ("causal_conv1d_update", lambda t: t["conv_state_indices"].add_(100), "conv_state_indices[0] = "),
    "conv-prefill-shape": (
        "causal_conv1d_prefill",
        lambda t: t.update(final_state_indices=t["final_state_indices"][:2]),
        "final_state_indices dimension 0",
    ),
    "conv-prefill-range": (
        "causal_conv1d_prefill",
        lambda t: t["final_state_indices"].add_(100),
        "final_state_indices[0] = ",
    ),
}


def _raised(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_op_raises_what_the_function_raises(gen, case):
    """Same exception type and message, naming the argument, and nothing written."""
    name, spoil, names = BAD_CALLS[case]
    call = CALLS[name](gen, "cpu")
    spoil(call.t)
    raised = _raised(call.fn, _clone(call.t))
    assert raised[0] is ValueError and names in raised[1], raised
    before = _clone(call.t)
    assert _raised(call.op, call.t) == raised
    assert not _changed(before, call.t)


# Element types gdn has no dtype for, by their DLPack names (the names errors give them).
FOREIGN_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "int8",
        "int16",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
    )
    if hasattr(torch, name)
}


@pytest.mark.parametrize(
    "name", ["decode_mtp", "decode_mtp_replay", "prefill", "causal_conv1d_update", "causal_conv1d_prefill"]
)
def test_foreign_dtype_errors_name_the_dtype_and_the_accepted_ones(gen, name):
    """An array of a dtype gdn has no type for is refused as one of a dtype the argument does not take
    (float64, which no argument takes): the argument, its dtype by name, the dtypes it accepts. The
    function and the op raise the same, and nothing is written."""
    call = CALLS[name](gen, "cpu")
    arrays = [k for k, v in call.t.items() if isinstance(v, torch.Tensor) and k not in call.optional]
    assert "cu_seqlens" in arrays
    for arg in arrays:
        as_float64 = _clone(call.t)
        as_float64[arg] = torch.zeros(call.t[arg].shape, dtype=torch.float64)
        kind, message = _raised(call.fn, as_float64)
        assert kind is ValueError and message.startswith(f"{arg} has dtype float64"), (arg, message)
        for dtype_name, dtype in FOREIGN_DTYPES.items():
            t = _clone(call.t)
            t[arg] = torch.zeros(call.t[arg].shape, dtype=dtype)
            expected = (ValueError, message.replace("has dtype float64", f"has dtype {dtype_name}", 1))
            before = _clone(t)
            assert _raised(call.fn, t) == expected, (arg, dtype_name)
            assert _raised(call.op, t) == expected, (arg, dtype_name)
            assert not _changed(before, t), (arg, dtype_name)


def test_cu_seqlens_int16_error(gen):
    """The reported case: a NumPy int16 cu_seqlens."""
    case = _case(gen, "fp32_vk_silu")
    args = list(case.args())
    args[7] = args[7].numpy().astype("int16")
    message = "cu_seqlens has dtype int16; expected one of: int32, int64"
    assert _raised(gdn.decode_mtp, *(a.numpy() if isinstance(a, torch.Tensor) else a for a in args)) == (
        ValueError,
        message,
    )
    args[7] = torch.from_numpy(args[7])
    assert _raised(torch.ops.gdn.decode_mtp, *args, **case.kwargs()) == (ValueError, message)


@pytest.mark.parametrize("options", [dict(gate="relu"), dict(state_layout="kvv"), dict(first_valid_slot=-1)], ids=str)
def test_op_raises_what_the_function_raises_for_scalars(gen, options):
    case = _case(gen, "fp32_vk_silu")
    kwargs = {**case.kwargs(), **options}
    raised = _raised(gdn.decode_mtp, *case.args(), **kwargs)
    assert raised[0] is ValueError and next(iter(options)) in raised[1], raised
    assert _raised(torch.ops.gdn.decode_mtp, *case.args(), **kwargs) == raised


@pytest.mark.slow
def test_python_kernels_on_request(tmp_path):
    """GDN_TORCH_OP_KERNELS=python (read at import): every op runs the gdn function, with the same
    results as the function and as this process's kernels."""
    case = _case(torch.Generator().manual_seed(7), "bf16_kv_sigmoid_strided")
    here = list(_run_copy(case, torch.ops.gdn.decode_mtp))
    assert _same(here, list(_run_copy(case, gdn.decode_mtp)))
    source = textwrap.dedent("""
        import sys
        import torch
        sys.path.insert(0, sys.argv[1])  # this test module and its reference
        import gdn
        import test_torch_op as t
        assert gdn.ops.KERNELS == "python", gdn.ops.KERNELS
        assert "GDN_TORCH_OP_KERNELS" in gdn.ops.KERNELS_REASON, gdn.ops.KERNELS_REASON
        assert all(t._cpu_kernel(name) == "python" for name in t.WRITES)
        case = t._case(torch.Generator().manual_seed(7), "bf16_kv_sigmoid_strided")
        torch.save(list(t._run_copy(case, torch.ops.gdn.decode_mtp)), sys.argv[2])
    """)
    saved = tmp_path / "python_kernels.pt"
    result = subprocess.run(
        [sys.executable, "-c", source, str(pathlib.Path(__file__).parent), str(saved)],
        env=dict(os.environ, GDN_TORCH_OP_KERNELS="python"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert _same(torch.load(saved), here)


@pytest.mark.slow
def test_unknown_kernel_choice_is_refused():
    source = "import gdn"
    env = dict(os.environ, GDN_TORCH_OP_KERNELS="fortran")
    result = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and "GDN_TORCH_OP_KERNELS must be" in result.stderr
