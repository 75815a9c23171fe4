"""The bindings' fast import of torch tensors (the DLPack C exchange API of torch >= 2.10): taken
for torch tensors instead of a `__dlpack__()` call per array, and indistinguishable from nanobind's
import otherwise: same views, results, errors and launch stream (decode_mtp, causal_conv1d_update).

nanobind's import of the same memory is reached through `OwnExport`, a torch subclass with its own
`__dlpack__`, which the bindings honour by taking the generic path."""

from __future__ import annotations

import numpy as np
import pytest

import gdn

torch = pytest.importorskip("torch")

from reference_torch import (  # noqa: E402 (needs torch)
    BF16,
    FP16,
    FP32,
    OUT16_BAR,
    cuda_skip_reason,
    make_case,
    rel_l2,
)

HAS_API = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
needs_api = pytest.mark.skipif(not HAS_API, reason="this torch has no DLPack C exchange API")
_CUDA_REASON = cuda_skip_reason()
requires_cuda = pytest.mark.skipif(_CUDA_REASON is not None, reason=f"CUDA: {_CUDA_REASON}")


class Plain(torch.Tensor):
    """A subclass that changes nothing: imported like torch.Tensor."""


class OwnExport(torch.Tensor):
    """A subclass with its own export: the bindings call it (nanobind's import)."""

    def __dlpack__(self, *args, **kwargs):
        return super().__dlpack__(*args, **kwargs)


# nanobind tells torch tensors by their type's module (for torch's legacy export, which takes
# what `__dlpack__` refuses: tensors that require grad, conjugate views): import it as torch's.
OwnExport.__module__ = "torch.gdn_test"


def _seed(gen) -> int:
    return int(torch.randint(2**31, (1,), generator=gen))


def _convert(value, fn):
    return fn(value) if isinstance(value, torch.Tensor) else value


def _run(case, fn, call=gdn.decode_mtp):
    """Runs `case` with every tensor argument mapped through `fn` (views of the same memory)."""
    call(*[_convert(x, fn) for x in case.args()], **{k: _convert(v, fn) for k, v in case.kwargs().items()})


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def _error_of(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    return None


# ---- which import a tensor takes ------------------------------------------------------------------


@needs_api
def test_torch_tensors_take_the_fast_import():
    fast = gdn._C._fast_import_available
    t = torch.zeros(3, 4)
    assert fast(t) and fast(t, readonly=True)
    assert fast(t[:, 1:3]) and fast(t.t()) and fast(t[1])
    assert fast(torch.zeros(2, 3, dtype=torch.bfloat16)) and fast(torch.zeros(5, dtype=torch.int64))
    assert fast(t.as_subclass(Plain))
    assert fast(torch.nn.Parameter(torch.zeros(3)))  # requires grad: imported, as nanobind did
    # nanobind's import decides (and words any error) for everything else:
    assert not fast(t.as_subclass(OwnExport))
    assert not fast(t.numpy()) and not fast([1.0, 2.0]) and not fast(None)
    assert not fast(torch.zeros(3, device="meta"))
    assert not fast(torch.zeros(1, 1, 1, 1, 1))  # beyond the 4 dimensions a view holds


# Tensors whose import could go wrong: offsets, strides (zero, transposed), 16-bit and 8-bit
# dtypes, requires-grad, inference-mode, empty and 0-d tensors, bit-flagged views, meta.
def _odd_tensors():
    base = torch.arange(60, dtype=torch.float32).reshape(3, 4, 5)
    with torch.inference_mode():
        inference = torch.ones(4, 2)
    complex_ = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
    return {
        "contiguous": base,
        "offset_view": base[1:, 2:, 1:4],
        "transposed": base.transpose(0, 2),
        "expanded": torch.ones(1, 4).expand(3, 4),
        "bf16_columns": base.bfloat16()[:, :, ::2],
        "fp16": base.half(),
        "int32_rows": torch.arange(10, dtype=torch.int32)[2:7],
        "bool": torch.ones(3, dtype=torch.bool),
        "fp8": torch.zeros(4, dtype=torch.float8_e4m3fn),
        "requires_grad": torch.ones(3, requires_grad=True),
        "inference": inference,
        "empty": torch.zeros(0, 5),
        "scalar": torch.tensor(2.0),
        "four_dims": torch.zeros(2, 3, 4, 5)[:, :, 1:3],
        "five_dims": torch.zeros(1, 2, 1, 2, 1),
        "conj": complex_.conj(),
        "neg_bit": complex_.conj().imag,
        "meta": torch.zeros(3, device="meta"),
    }


@pytest.mark.parametrize("name", list(_odd_tensors()))
def test_fast_import_reads_what_nanobinds_import_reads(name):
    """Same verdict and, when accepted, the same pointer, dtype, device, shape and strides as
    nanobind's import of the same memory; only the path differs."""
    t = _odd_tensors()[name]
    fast = _error_of(lambda: gdn._C._array_view(t)) or gdn._C._array_view(t)
    generic = _error_of(lambda: gdn._C._array_view(t.as_subclass(OwnExport))) or gdn._C._array_view(
        t.as_subclass(OwnExport)
    )
    if isinstance(generic[0], type):
        assert fast[0] is generic[0], (fast, generic)
        return
    assert generic[0] is False
    assert fast[0] is (HAS_API and t.dim() <= 4 and not t.is_meta)
    assert fast[1:] == generic[1:]
    if t.dim() <= 4:
        assert fast[1] == t.data_ptr() and fast[5] == tuple(t.shape) and fast[6] == t.stride()


@needs_api
def test_calls_make_no_dlpack_call_for_torch_tensors(gen, monkeypatch):
    """A call on torch tensors never calls `Tensor.__dlpack__` (the cost the fast import removes);
    the counter does see nanobind's import."""
    calls = []
    export = torch.Tensor.__dlpack__

    def counting(self, *args, **kwargs):
        calls.append(type(self).__name__)
        return export(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "__dlpack__", counting)
    case = make_case(gen, strided=True)
    case.run()
    torch.ops.gdn.decode_mtp(*case.args(), **case.kwargs())
    conv = _conv_case(gen)
    gdn.causal_conv1d_update(*conv[:6], num_accepted_tokens=conv[6])
    assert calls == []
    assert gdn._C._accepts_array(torch.zeros(3).as_subclass(OwnExport))
    assert calls


# ---- same results --------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "strided"])
@pytest.mark.parametrize(
    "act,state_dtype", [(FP32, FP32), (FP16, FP16), (FP16, FP32)], ids=["fp32", "fp16", "fp16_fp32state"]
)
def test_decode_mtp_torch_equals_numpy(gen, act, state_dtype, strided, layout):
    """torch tensors (fast import) and NumPy views of the same data give the same bits."""
    seed = _seed(gen)
    kw = dict(act=act, state_dtype=state_dtype, strided=strided, layout=layout)
    a = make_case(torch.Generator().manual_seed(seed), **kw)
    b = make_case(torch.Generator().manual_seed(seed), **kw)
    for c in (a, b):
        c.poison_out()
    a.run()
    _run(b, lambda t: t.numpy())
    assert torch.isfinite(a.out[a.token_rows()]).all()
    assert _same_bits(a.pool_buffer, b.pool_buffer) and _same_bits(a.out_buffer, b.out_buffer)


@pytest.mark.parametrize("wrap", ["plain_subclass", "op"])
@pytest.mark.parametrize(
    "act,state_dtype", [(BF16, BF16), (BF16, FP32), (FP32, FP32)], ids=["bf16", "bf16_fp32state", "fp32"]
)
def test_decode_mtp_fast_equals_nanobind_import(gen, act, state_dtype, wrap):
    """Strided torch views through the fast import (as torch.Tensor, a plain subclass, or the torch
    op) and through nanobind's import give the same bits, 16-bit dtypes included."""
    seed = _seed(gen)
    kw = dict(act=act, state_dtype=state_dtype, strided=True)
    a = make_case(torch.Generator().manual_seed(seed), **kw)
    b = make_case(torch.Generator().manual_seed(seed), **kw)
    for c in (a, b):
        c.poison_out()
    if wrap == "op":
        a.run(torch.ops.gdn.decode_mtp)
    else:
        _run(a, lambda t: t.as_subclass(Plain))
    _run(b, lambda t: t.as_subclass(OwnExport))
    assert torch.isfinite(a.out[a.token_rows()].float()).all()
    assert _same_bits(a.pool_buffer, b.pool_buffer) and _same_bits(a.out_buffer, b.out_buffer)


def _conv_case(gen):
    """A valid causal_conv1d_update call (positional arguments, then num_accepted_tokens)."""
    D, W, S = 12, 4, 3
    T = [3, 0, 2, 1]
    cu = torch.tensor([0, *np.cumsum(T)], dtype=torch.int32)
    L = int(cu[-1])
    x = torch.randn(L, 2 * D, generator=gen)[:, :D]  # a row-strided view
    w = torch.randn(D, W, generator=gen)
    pool = torch.randn(8, D, W - 1 + S - 1, generator=gen)
    slots = torch.tensor([5, 0, 2, 7], dtype=torch.int32)
    acc = torch.tensor([1, 2, 3, 1], dtype=torch.int32)
    out = torch.full((L, D), float("nan"))
    return x, w, pool, slots, cu, out, acc


def test_conv_torch_equals_numpy(gen):
    seed = _seed(gen)
    a = _conv_case(torch.Generator().manual_seed(seed))
    b = _conv_case(torch.Generator().manual_seed(seed))
    gdn.causal_conv1d_update(*a[:6], num_accepted_tokens=a[6])
    gdn.causal_conv1d_update(*[t.numpy() for t in b[:6]], num_accepted_tokens=b[6].numpy())
    assert torch.isfinite(a[5][:3]).all()
    assert _same_bits(a[2], b[2]) and _same_bits(a[5], b[5])


# ---- same errors ---------------------------------------------------------------------------------


def _breaks():
    """(argument, change) pairs that make a valid call invalid; each change maps a case tensor."""
    return {
        "out_float64": ("out", lambda t: t.double()),
        "a_column_stride": ("a", lambda t: torch.stack([t, t], -1).flatten(-2)[:, ::2]),
        "state_five_dims": ("state", lambda t: t[None]),
        "mixed_qkv_int32": ("mixed_qkv", lambda t: t.int()),
        "z_complex": ("z", lambda t: t.to(torch.complex64)),
        "cu_seqlens_float": ("cu_seqlens", lambda t: t.float()),
        "norm_weight_2d": ("norm_weight", lambda t: t[None]),
    }


@pytest.mark.parametrize("name", list(_breaks()))
def test_errors_are_those_of_nanobinds_import(gen, name):
    """The same exception and message from torch tensors (fast import), the same tensors through
    nanobind's import and (where NumPy holds the dtype) NumPy arrays; nothing written."""
    arg, change = _breaks()[name]
    seed = _seed(gen)
    errors = []
    for wrap in ("torch", "nanobind", "numpy"):
        case = make_case(torch.Generator().manual_seed(seed), strided=True, null_dests=False)
        setattr(case, arg, change(getattr(case, arg)))
        if wrap == "numpy" and not all(x.dtype != torch.bfloat16 for x in case.args()):
            continue
        fn = {"torch": lambda t: t, "nanobind": lambda t: t.as_subclass(OwnExport), "numpy": lambda t: t.numpy()}[wrap]
        case.poison_out()
        pool, out = case.pool_buffer.clone(), case.out_buffer.clone()
        errors.append(_error_of(lambda: _run(case, fn)))  # noqa: B023 (called right away)
        assert _same_bits(case.pool_buffer, pool) and _same_bits(case.out_buffer, out)
    assert errors[0] is not None and errors[0][0] is ValueError, errors[0]
    assert arg in errors[0][1]
    assert all(e == errors[0] for e in errors), errors


def test_meta_tensor_is_still_refused_naming_the_argument(gen):
    case = make_case(gen)
    case.out = torch.empty(case.out.shape, device="meta")
    with pytest.raises(TypeError, match=r"^gdn\.decode_mtp: out must be a writable .*meta"):
        case.run()


# ---- CUDA: the fast import and the launch stream ---------------------------------------------------


def _cuda_case(gen):
    """A small CUDA call (tensors moved one by one) and its reference, computed on the host."""
    case = make_case(gen, H=1, HV=4, K=128, V=128, S=3, T=(3, 2), act=BF16)
    ref = case.reference()
    for name in (
        "mixed_qkv",
        "a",
        "b",
        "A_log",
        "dt_bias",
        "state",
        "state_indices",
        "cu_seqlens",
        "out",
        "z",
        "norm_weight",
        "num_accepted_tokens",
    ):
        setattr(case, name, getattr(case, name).cuda())
    case.pool_buffer, case.out_buffer = case.state, case.out
    return case, ref


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("path", ["fast", "nanobind", "binding"])
def test_cuda_call_runs_on_torch_current_stream(gen, path):
    """With no stream given, the kernel is ordered after earlier work on torch's current stream:
    through the exchange API (torch tensors, and the raw binding with stream=None) and through
    gdn._common._stream_of (nanobind's import)."""
    case, ref = _cuda_case(gen)
    fresh = case.mixed_qkv.clone()
    case.mixed_qkv.zero_()  # the kernel must see `fresh`, written on the side stream below
    torch.cuda.synchronize()
    fn = (lambda t: t.as_subclass(OwnExport)) if path == "nanobind" else (lambda t: t)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # a launch on another stream would run before the copy
        case.mixed_qkv.copy_(fresh)
        case.out.fill_(float("nan"))
        if path == "binding":
            gdn._C.decode_mtp(*case.args(), case.z, case.norm_weight, case.num_accepted_tokens)
        else:
            _run(case, fn)
        out = case.out.clone()
    stream.synchronize()
    rows = case.token_rows()
    assert rel_l2(out.cpu()[rows], ref.out[rows]) <= OUT16_BAR


@pytest.mark.gpu
@requires_cuda
def test_cuda_tensors_take_the_fast_import_and_name_a_host_argument(gen):
    if HAS_API:
        assert gdn._C._fast_import_available(torch.zeros(3, device="cuda"))
    case, _ = _cuda_case(gen)
    case.a = case.a.cpu()
    with pytest.raises(ValueError, match=r"^a is on cpu but the call runs on cuda:0"):
        case.run()
