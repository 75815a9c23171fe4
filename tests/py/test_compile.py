"""The gdn functions inside torch.compile(fullgraph=True): gdn.decode_mtp, gdn.decode_mtp_replay,
gdn.prefill, gdn.causal_conv1d_update and gdn.causal_conv1d_prefill called from a compiled function
(backends eager, aot_eager, inductor) trace as their torch ops (gdn._common.traced_as_torch_op) and
give the eager call's outputs, states and windows bit for bit, on the CPU and on CUDA, where the
compiled function is also captured in a CUDA graph and replayed on new inputs. A stream argument
inside a traced call is refused, naming it; eager calls never go through the op."""

from __future__ import annotations

import shutil
from typing import Any, Callable, Dict, List, Tuple

import pytest

import gdn

torch = pytest.importorskip("torch")

from reference_torch import cuda_skip_reason, make_case  # noqa: E402 (needs torch)

# torch.compile imports torch.jit pieces that warn about their own deprecation.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")

_CUDA = cuda_skip_reason()
_ON_CUDA = [pytest.mark.gpu, pytest.mark.skipif(_CUDA is not None, reason=f"CUDA: {_CUDA}")]
_HAVE_CXX = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
BACKENDS = [
    "eager",
    "aot_eager",
    pytest.param(
        "inductor", marks=pytest.mark.skipif(not _HAVE_CXX, reason="inductor on the CPU needs a C++ compiler")
    ),
]
DEVICES = ["cpu", pytest.param("cuda", marks=_ON_CUDA)]

Tensors = Dict[str, torch.Tensor]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


def _assert_same(got: Tensors, want: Tensors) -> None:
    for name in want:
        assert torch.equal(_bits(got[name]), _bits(want[name])), f"{name} differs from the eager call"


# ---- the calls, as a model step would make them ----------------------------------------------
#
# Each `*_inputs` returns the call's tensors (written ones included) and the names it writes; each
# `*_step` is the function that gets compiled: it takes the tensors and passes the scalars itself.


def _head_dim(device: str) -> int:
    return 128 if device == "cuda" else 16  # the CUDA kernels take K = V = 128 only


def _decode_inputs(gen, device: str, T: List[int]) -> Tuple[Tensors, List[str]]:
    D = _head_dim(device)
    case = make_case(gen, H=1, HV=2, K=D, V=D, S=3, T=T, strided=True, first_valid_slot=1)
    names = ["mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens", "out"]
    tensors = dict(zip(names, case.args()))
    tensors.update(z=case.z, norm_weight=case.norm_weight, num_accepted_tokens=case.num_accepted_tokens)
    return {k: v.to(device) for k, v in tensors.items()}, ["state", "out"]


def _decode_step(t: Tensors) -> None:
    gdn.decode_mtp(
        t["mixed_qkv"],
        t["a"],
        t["b"],
        t["A_log"],
        t["dt_bias"],
        t["state"],
        t["state_indices"],
        t["cu_seqlens"],
        t["out"],
        z=t["z"],
        norm_weight=t["norm_weight"],
        num_accepted_tokens=t["num_accepted_tokens"],
        gate="silu",
        state_layout="vk",
        first_valid_slot=1,
    )


_H, _HV, _S = 1, 2, 3


def _replay_inputs(gen, device: str, T: List[int]) -> Tuple[Tensors, List[str]]:
    K = V = _head_dim(device)
    N, slots = len(T), len(T) + 2
    randn = lambda *shape, std=1.0: torch.randn(*shape, generator=gen) * std  # noqa: E731
    window = gdn.ReplayWindow.allocate(slots, _S, H=_H, HV=_HV, K=K, V=V, dtype=torch.float32)
    for x in (window.k, window.v, window.a, window.b):
        x.copy_(randn(*x.shape))
    window.len.copy_(torch.randint(0, _S + 1, (slots,), generator=gen))
    slot_of = torch.randperm(slots, generator=gen)[:N].to(torch.int32)
    accepted = [int(torch.randint(0, int(window.len[s]) + 1, (), generator=gen)) for s in slot_of.tolist()]
    L = sum(T)
    t = dict(
        mixed_qkv=randn(L, 2 * _H * K + _HV * V),
        a=randn(L, _HV),
        b=randn(L, _HV),
        A_log=randn(_HV, std=0.5),
        dt_bias=randn(_HV, std=0.1),
        state=randn(slots, _HV, V, K, std=0.3),
        state_indices=slot_of,
        cu_seqlens=torch.tensor([0] + [sum(T[: i + 1]) for i in range(N)], dtype=torch.int32),
        out=torch.full((L, _HV, V), float("nan")),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int64),
        z=randn(L, _HV, V),
        norm_weight=randn(V, std=0.2) + 1,
    )
    t.update(window.arrays())  # window_k and window_v share one buffer, as do window_a and window_b
    written = ["state", "out", "window_k", "window_v", "window_a", "window_b", "window_len"]
    return {k: v.to(device) for k, v in t.items()}, written


def _replay_step(t: Tensors) -> None:
    gdn.decode_mtp_replay(
        t["mixed_qkv"],
        t["a"],
        t["b"],
        t["A_log"],
        t["dt_bias"],
        t["state"],
        t["state_indices"],
        t["cu_seqlens"],
        t["out"],
        t["window_k"],
        t["window_v"],
        t["window_a"],
        t["window_b"],
        t["window_len"],
        t["num_accepted_tokens"],
        z=t["z"],
        norm_weight=t["norm_weight"],
        gate="sigmoid",
    )


def _offsets(T: List[int]) -> torch.Tensor:
    return torch.tensor([0] + [sum(T[: i + 1]) for i in range(len(T))], dtype=torch.int32)


def _slots(gen, N: int) -> Tuple[int, torch.Tensor, torch.Tensor]:
    """A pool of 2N + 2 slots, slot 0 null (first_valid_slot=1); N initial slots (the first null:
    a new request) and N distinct final slots, apart from them."""
    slots = 2 * N + 2
    perm = (torch.randperm(slots - 1, generator=gen) + 1).to(torch.int32)
    initial, final = perm[:N].clone(), perm[N : 2 * N].clone()
    initial[0] = 0
    return slots, initial, final


_D, _W, _NUM_SPEC = 16, 4, 2  # conv channels, width and speculative tokens
_PREFILL_SCALE = 3  # a prefill request has 3 times the tokens of a verify request of the same test


def _conv_inputs(gen, device: str, T: List[int]) -> Tuple[Tensors, List[str]]:
    N, slots, L = len(T), len(T) + 2, sum(T)
    randn = lambda *shape, std=1.0: torch.randn(*shape, generator=gen) * std  # noqa: E731
    t = dict(
        x=randn(L, _D),
        weight=randn(_D, _W, std=0.5),
        conv_state=randn(slots, _D, _W - 1 + _NUM_SPEC),
        conv_state_indices=torch.randperm(slots, generator=gen)[:N].to(torch.int32),
        cu_seqlens=_offsets(T),
        out=torch.full((L, _D), float("nan")),
        num_accepted_tokens=torch.randint(1, _NUM_SPEC + 2, (N,), generator=gen, dtype=torch.int32),
    )
    return {k: v.to(device) for k, v in t.items()}, ["conv_state", "out"]


def _conv_step(t: Tensors) -> None:
    gdn.causal_conv1d_update(
        t["x"],
        t["weight"],
        t["conv_state"],
        t["conv_state_indices"],
        t["cu_seqlens"],
        t["out"],
        num_accepted_tokens=t["num_accepted_tokens"],
        activation="silu",
        state_layout="channels_major",
    )


def _conv_prefill_inputs(gen, device: str, T: List[int]) -> Tuple[Tensors, List[str]]:
    T = [n * _PREFILL_SCALE for n in T]
    slots, initial, final = _slots(gen, len(T))
    L = sum(T)
    t = dict(
        x=torch.randn(L, _D, generator=gen),
        weight=torch.randn(_D, _W, generator=gen) * 0.5,
        conv_state=torch.randn(slots, _W - 1 + _NUM_SPEC, _D, generator=gen),  # tokens_major
        initial_state_indices=initial,
        final_state_indices=final,
        cu_seqlens=_offsets(T),
        out=torch.full((L, _D), float("nan")),
    )
    return {k: v.to(device) for k, v in t.items()}, ["conv_state", "out"]


def _conv_prefill_step(t: Tensors) -> None:
    gdn.causal_conv1d_prefill(
        t["x"],
        t["weight"],
        t["conv_state"],
        t["initial_state_indices"],
        t["final_state_indices"],
        t["cu_seqlens"],
        t["out"],
        activation="silu",
        state_layout="tokens_major",
        first_valid_slot=1,
    )


def _prefill_inputs(gen, device: str, T: List[int]) -> Tuple[Tensors, List[str]]:
    K = V = _head_dim(device)
    T = [n * _PREFILL_SCALE for n in T]
    slots, initial, final = _slots(gen, len(T))
    L = sum(T)
    randn = lambda *shape, std=1.0: torch.randn(*shape, generator=gen) * std  # noqa: E731
    t = dict(
        mixed_qkv=randn(L, 2 * _H * K + _HV * V),
        a=randn(L, _HV),
        b=randn(L, _HV),
        A_log=randn(_HV, std=0.5),
        dt_bias=randn(_HV, std=0.1),
        state=randn(slots, _HV, V, K, std=0.3),
        initial_state_indices=initial,
        final_state_indices=final,
        cu_seqlens=_offsets(T),
        out=torch.full((L, _HV, V), float("nan")),
        z=randn(L, _HV, V),
        norm_weight=randn(V, std=0.2) + 1,
    )
    return {k: v.to(device) for k, v in t.items()}, ["state", "out"]


def _prefill_step(t: Tensors) -> None:
    gdn.prefill(
        t["mixed_qkv"],
        t["a"],
        t["b"],
        t["A_log"],
        t["dt_bias"],
        t["state"],
        t["initial_state_indices"],
        t["final_state_indices"],
        t["cu_seqlens"],
        t["out"],
        z=t["z"],
        norm_weight=t["norm_weight"],
        gate="silu",
        first_valid_slot=1,
    )


CALLS: Dict[str, Tuple[Callable[..., Tuple[Tensors, List[str]]], Callable[[Tensors], None]]] = {
    "decode_mtp": (_decode_inputs, _decode_step),
    "decode_mtp_replay": (_replay_inputs, _replay_step),
    "prefill": (_prefill_inputs, _prefill_step),
    "causal_conv1d_update": (_conv_inputs, _conv_step),
    "causal_conv1d_prefill": (_conv_prefill_inputs, _conv_prefill_step),
}


def _eager_copy(step: Callable[[Tensors], None], t: Tensors, written: List[str]) -> Tensors:
    """The eager call's results on copies of the written tensors (the views' buffers included)."""
    mine = dict(t)
    for name in written:
        mine[name] = t[name].clone()
    step(mine)
    return {name: mine[name] for name in written}


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("call", list(CALLS))
def test_fullgraph_equals_eager(gen, call, backend, device):
    inputs, step = CALLS[call]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    # Fresh data, then other token counts of the same shapes (a padded row): the graph is reused.
    for T in ([3, 1, 2], [3, 0, 3]):
        t, written = inputs(gen, device, T)
        want = _eager_copy(step, t, written)
        compiled(t)
        _assert_same({name: t[name] for name in written}, want)
        assert torch.isfinite(t["out"]).all(), "a token row of out was not written"


@pytest.mark.parametrize("call", list(CALLS))
def test_eager_call_does_not_go_through_the_op(gen, call, monkeypatch):
    """Outside tracing the function calls its binding, not the op; the traced call calls the op
    (here a stand-in that records the call)."""
    inputs, step = CALLS[call]
    t, written = inputs(gen, "cpu", [2, 1])
    calls: List[str] = []

    def spy(*args: Any, **kwargs: Any) -> None:
        calls.append(call)

    monkeypatch.setattr(torch.ops.gdn, call, spy)
    step(t)
    assert calls == []
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="eager")(t)
    assert calls == [call]


def test_stream_inside_compile_is_refused(gen):
    t, _ = _decode_inputs(gen, "cpu", [1, 2])

    def step(t: Tensors) -> None:
        gdn.decode_mtp(*[t[k] for k in list(t)[:9]], stream=7)

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"gdn\.decode_mtp: stream must be None inside torch\.compile"):
        torch.compile(step, fullgraph=True, backend="eager")(t)


@pytest.mark.gpu
@pytest.mark.skipif(_CUDA is not None, reason=f"CUDA: {_CUDA}")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("call", list(CALLS))
def test_fullgraph_in_cuda_graph(gen, call, backend):
    """Compiled, captured in a CUDA graph, replayed on new inputs copied into the captured tensors:
    the eager call's results, bit for bit."""
    inputs, step = CALLS[call]
    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    static, written = inputs(gen, "cuda", [3, 2, 0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        compiled(_clones(static))
        compiled(_clones(static))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(static)
    for T in ([1, 3, 1], [0, 3, 2]):  # same shapes, other token counts
        fresh, _ = inputs(gen, "cuda", T)
        want = _eager_copy(step, fresh, written)
        for name, x in fresh.items():
            static[name].copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        _assert_same({name: static[name] for name in written}, want)


def _clones(t: Tensors) -> Tensors:
    return {k: v.clone() for k, v in t.items()}
