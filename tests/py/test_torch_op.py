"""torch.ops.gdn.decode_mtp: same results as gdn.decode_mtp, a correct schema (opcheck), and usable
inside torch.compile(fullgraph=True)."""

from __future__ import annotations

import shutil

import pytest

import gdn

torch = pytest.importorskip("torch")

from reference_torch import check_case, make_case  # noqa: E402 (needs torch)

BF16, FP32 = torch.bfloat16, torch.float32

# torch.compile imports torch.jit pieces that warn about their own deprecation.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

CONFIGS = {
    "fp32_vk_silu": dict(H=2, HV=4, act=FP32, layout="vk", gate="silu"),
    "bf16_kv_sigmoid_strided": dict(H=1, HV=3, act=BF16, layout="kv", gate="sigmoid", strided=True),
    "state_bf16_norm_only_vllm_nulls": dict(H=2, HV=8, act=BF16, state_dtype=BF16, norm="w",
                                            first_valid_slot=1),
    "no_norm_no_acc": dict(H=1, HV=5, act=FP32, norm="none", use_acc=False),
}


def _case(gen, cfg):
    return make_case(gen, K=32, V=32, S=4, T=(4, 0, 2, 3), **CONFIGS[cfg])


def _run_copy(case, fn, **kw):
    """Runs fn on copies of the pool and out of `case`; returns (out buffer, pool buffer)."""
    pool = case.pool_buffer.clone()
    out_buffer = torch.full_like(case.out_buffer, float("nan"))
    state = pool.as_strided(case.state.shape, case.state.stride(),
                            case.state.storage_offset() - case.pool_buffer.storage_offset())
    out = out_buffer.as_strided(case.out.shape, case.out.stride(),
                                case.out.storage_offset() - case.out_buffer.storage_offset())
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
    case = _case(gen, "fp32_vk_silu")
    o1, p1 = _run_copy(case, gdn.decode_mtp)
    order = ["z", "norm_weight", "num_accepted_tokens", "scale", "l2_eps", "norm_eps", "gate",
             "state_layout", "first_valid_slot"]
    o2, p2 = _run_copy(case, lambda *a, **k: torch.ops.gdn.decode_mtp(*a, *[k[n] for n in order]))
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
    assert [a.name for a in torch.ops.gdn.decode_mtp.default._schema.arguments][9:] == order + [
        "error_count"]


def test_schema_marks_state_out_and_error_count_mutated():
    schema = torch.ops.gdn.decode_mtp.default._schema
    written = {a.name for a in schema.arguments
               if a.alias_info is not None and a.alias_info.is_write}
    assert written == {"state", "out", "error_count"}
    assert len(schema.returns) == 0


@pytest.mark.parametrize("cfg,counter", [("fp32_vk_silu", False), ("bf16_kv_sigmoid_strided", True)])
def test_opcheck(gen, cfg, counter):
    case = _case(gen, cfg)
    kw = case.kwargs()
    args = case.args() + tuple(kw[n] for n in ("z", "norm_weight", "num_accepted_tokens"))
    opts = {n: kw[n] for n in ("scale", "l2_eps", "norm_eps", "gate", "state_layout",
                              "first_valid_slot")}
    if counter:  # the optional device error counter is part of the schema (mutated)
        opts["error_count"] = torch.zeros(1, dtype=torch.int32)
    result = torch.library.opcheck(torch.ops.gdn.decode_mtp.default, args, opts)
    assert all(v == "SUCCESS" for v in result.values()), result


def _compiled_step(H, HV, K, V):
    """A model-like step: split the packed projections, call the op, nothing else."""
    def step(mixed_qkv, ba, A_log, dt_bias, z, norm_weight, state, state_indices, cu_seqlens,
             num_accepted_tokens, out):
        a, b = ba[:, :HV], ba[:, HV:]
        torch.ops.gdn.decode_mtp(mixed_qkv, a, b, A_log, dt_bias, state, state_indices,
                                 cu_seqlens, out, z=z, norm_weight=norm_weight,
                                 num_accepted_tokens=num_accepted_tokens, gate="silu",
                                 state_layout="vk")
    return step


def _backends():
    have_cxx = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
    return ["eager", "aot_eager",
            pytest.param("inductor", marks=pytest.mark.skipif(
                not have_cxx, reason="inductor on the CPU needs a C++ compiler"))]


@pytest.mark.parametrize("backend", _backends())
def test_torch_compile_fullgraph(gen, backend):
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


@pytest.mark.parametrize("fn", [gdn.decode_mtp, torch.ops.gdn.decode_mtp],
                         ids=["function", "torch_op"])
def test_model_parameters_are_accepted(gen, fn):
    """A_log, dt_bias and norm_weight are usually nn.Parameters (requires_grad) of a model."""
    case = _case(gen, "fp32_vk_silu")
    o1, p1 = _run_copy(case, fn)
    for name in ("A_log", "dt_bias", "norm_weight"):
        setattr(case, name, torch.nn.Parameter(getattr(case, name)))
    o2, p2 = _run_copy(case, fn)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)
