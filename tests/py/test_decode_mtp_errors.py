"""Invalid input to gdn.decode_mtp (decode-mtp.md §2, §4): a ValueError that names the argument or
the request row, raised before anything is written (pool and out bytes are compared before/after).

Every case starts from a valid call of three requests and breaks one thing; invalid rows are the
last row, so an implementation that validated row by row while writing would have written rows 0-1.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import gdn

torch = pytest.importorskip("torch")

from reference_torch import Case, make_case  # noqa: E402 (needs torch)

H, HV, K, V, S = 2, 4, 16, 16, 3
L = 3 + 2 + 1


def base_case(gen, **kw) -> Case:
    kw.setdefault("T", (3, 2, 1))
    kw.setdefault("acc", (1, 3, 2))
    return make_case(gen, H=H, HV=HV, K=K, V=V, S=S, null_dests=False, **kw)


def expect_error(case: Case, match: str, call=None) -> None:
    case.poison_out()
    pool = case.pool_buffer.clone()
    out = case.out_buffer.clone()
    with pytest.raises(ValueError, match=match):
        (call or case.run)()
    assert torch.equal(case.pool_buffer.view(torch.uint8), pool.view(torch.uint8)), (
        "the state pool changed although the call was rejected"
    )
    assert torch.equal(case.out_buffer.view(torch.uint8), out.view(torch.uint8)), (
        "out was written although the call was rejected"
    )


def test_valid_base_case_runs(gen):
    """The starting point of every case below is accepted (so each error comes from its change)."""
    case = base_case(gen)
    case.poison_out()
    case.run()
    assert torch.isfinite(case.out).all()


def _set(name, value_fn):
    def change(c):
        setattr(c, name, value_fn(c))

    return change


def _idx(i, col, value_fn):
    def change(c):
        c.state_indices[i, col] = value_fn(c)

    return change


def _cu(values):
    return _set("cu_seqlens", lambda c: torch.tensor(values, dtype=c.cu_seqlens.dtype))


def _acc(values):
    return _set("num_accepted_tokens", lambda c: torch.tensor(values, dtype=torch.int32))


def _new_out(value_fn):
    """Replaces out; the tensor it views becomes the buffer checked for writes."""

    def change(c):
        c.out = value_fn(c)
        c.out_buffer = c.out if c.out._base is None else c.out._base

    return change


def _opt(**kw):
    def change(c):
        c.opts.update(kw)

    return change


def _wide(x):
    """x copied into a buffer twice as wide, returned as a view with column stride 2."""
    buf = torch.empty(x.shape[:-1] + (2 * x.shape[-1],), dtype=x.dtype)
    buf[..., ::2] = x
    return buf[..., ::2]


def _overlapping_state(c):
    n = c.state.shape[0]
    return c.pool_buffer.as_strided((n,) + tuple(c.state.shape[1:]), (HV * K * V - 1,) + tuple(c.state.stride()[1:]))


def _qkv_width(width):
    return _set("mixed_qkv", lambda c: torch.randn(L, width))


def _error(name, change, match):
    return pytest.param(change, match, id=name)


ROW_ERRORS = [
    _error("T_greater_than_S", _cu([0, 3, 5, 9]), r"request row 2: has T = 4 tokens .* S = 3"),
    _error("acc_zero", _acc([1, 3, 0]), r"request row 2: num_accepted_tokens = 0 is outside \[1, S = 3\]"),
    _error("acc_negative", _acc([1, 3, -1]), r"request row 2: num_accepted_tokens = -1"),
    _error("acc_greater_than_S", _acc([1, 3, 4]), r"request row 2: num_accepted_tokens = 4"),
    _error(
        "source_slot_null", _idx(2, 1, lambda c: -1), r"request row 2: source slot state_indices\[2, 1\] = -1 is null"
    ),
    _error(
        "source_slot_below_first_valid",
        _idx(2, 1, lambda c: 0),  # first_valid_slot = 1
        r"request row 2: source slot state_indices\[2, 1\] = 0 is null "
        r"\(below first_valid_slot = 1\)",
    ),
    _error(
        "dest_slot_past_pool",
        _idx(2, 0, lambda c: c.state.shape[0]),
        r"request row 2: state_indices\[2, 0\] = \d+ is >= the pool's slot count",
    ),
    _error(
        "unused_column_past_pool", _idx(2, 2, lambda c: 10**6), r"request row 2: state_indices\[2, 2\] = 1000000 is >="
    ),
    _error("cu_seqlens_not_monotone", _cu([0, 3, 2, 6]), r"request row 1: cu_seqlens\[1\.\.\] = \(3, 2\)"),
    _error("cu_seqlens_negative", _cu([-1, 3, 5, 6]), r"request row 0: cu_seqlens"),
    _error("cu_seqlens_past_L", _cu([0, 3, 5, 7]), r"cu_seqlens\[N\] = 7 exceeds L = 6"),
    _error("cu_seqlens_middle_past_L", _cu([0, 3, 8, 6]), r"request row 1: cu_seqlens\[1\.\.\] = \(3, 8\)"),
]


@pytest.mark.parametrize("change,match", ROW_ERRORS)
def test_invalid_row(gen, request, change, match):
    name = request.node.callspec.id
    case = base_case(
        gen,
        extra_rows=3 if name == "T_greater_than_S" else 0,
        first_valid_slot=1 if name == "source_slot_below_first_valid" else 0,
    )
    change(case)
    expect_error(case, match)


ARGUMENT_ERRORS = [
    # dtypes
    _error(
        "state_indices_int16",
        _set("state_indices", lambda c: c.state_indices.short()),
        r"^state_indices has dtype int16; expected one of: int32, int64$",
    ),
    _error("cu_seqlens_float", _set("cu_seqlens", lambda c: c.cu_seqlens.float()), r"cu_seqlens has dtype float32"),
    _error(
        "num_accepted_tokens_bool",
        _set("num_accepted_tokens", lambda c: torch.ones(3, dtype=torch.bool)),
        r"num_accepted_tokens has dtype bool",
    ),
    _error("state_float64", _set("state", lambda c: c.state.double()), r"state has dtype float64"),
    _error(
        "state_uint8",
        _set("state", lambda c: c.state.view(torch.uint8)),
        r"^state has dtype uint8; expected one of: float32, bfloat16, float16$",
    ),
    _error("mixed_qkv_float64", _set("mixed_qkv", lambda c: c.mixed_qkv.double()), r"mixed_qkv has dtype float64"),
    _error("a_int32", _set("a", lambda c: c.a.int()), r"^a has dtype int32"),
    _error("b_float64", _set("b", lambda c: c.b.double()), r"^b has dtype float64"),
    _error("z_float64", _set("z", lambda c: c.z.double()), r"^z has dtype float64"),
    _error("out_float64", _new_out(lambda c: torch.empty(L, HV, V, dtype=torch.float64)), r"^out has dtype float64"),
    _error("A_log_float64", _set("A_log", lambda c: c.A_log.double()), r"A_log has dtype float64"),
    _error("dt_bias_int64", _set("dt_bias", lambda c: c.dt_bias.long()), r"dt_bias has dtype int64"),
    _error(
        "norm_weight_float64", _set("norm_weight", lambda c: c.norm_weight.double()), r"norm_weight has dtype float64"
    ),
    # shapes
    _error("a_HV_plus_1_columns", _set("a", lambda c: torch.randn(L, HV + 1)), r"^a dimension 1 must be HV = 4"),
    _error("b_extra_row", _set("b", lambda c: torch.randn(L + 1, HV)), r"^b dimension 0 must be L"),
    _error("out_wrong_V", _new_out(lambda c: torch.empty(L, HV, V + 1)), r"^out dimension 2 must be V = 16"),
    _error("out_wrong_HV", _new_out(lambda c: torch.empty(L, HV - 1, V)), r"^out dimension 1 must be HV"),
    _error("out_wrong_L", _new_out(lambda c: torch.empty(L - 1, HV, V)), r"^out dimension 0 must be L"),
    _error(
        "state_indices_1d",
        _set("state_indices", lambda c: c.state_indices.reshape(-1)),
        r"state_indices must have 2 dimensions",
    ),
    _error(
        "state_indices_no_columns",
        _set("state_indices", lambda c: c.state_indices[:, :0].contiguous()),
        r"state_indices must have at least one column",
    ),
    _error("state_3d", _set("state", lambda c: c.state[0]), r"state must have 4 dimensions"),
    _error("state_5d", _set("state", lambda c: c.state[None]), r"state has 5 dimensions; at most 4"),
    _error("z_wrong_V", _set("z", lambda c: torch.randn(L, HV, V + 1)), r"^z dimension 2 must be V"),
    _error("z_2d", _set("z", lambda c: torch.randn(L, HV * V)), r"^z must have 3 dimensions"),
    _error("A_log_wrong_length", _set("A_log", lambda c: torch.randn(HV + 1)), r"A_log dimension 0 must be HV"),
    _error("dt_bias_2d", _set("dt_bias", lambda c: c.dt_bias[None]), r"dt_bias must have 1 dimensions"),
    _error(
        "norm_weight_wrong_length",
        _set("norm_weight", lambda c: torch.randn(V - 1)),
        r"norm_weight dimension 0 must be V",
    ),
    _error(
        "cu_seqlens_wrong_length",
        _set("cu_seqlens", lambda c: c.cu_seqlens[:-1].clone()),
        r"cu_seqlens dimension 0 must be N \+ 1",
    ),
    _error("num_accepted_tokens_wrong_length", _acc([1, 1]), r"num_accepted_tokens dimension 0 must be N"),
    _error(
        "mixed_qkv_width",
        _qkv_width(2 * H * K + HV * V - 1),
        r"^mixed_qkv width 127 = 2\*H\*K \+ HV\*V leaves 127 - 4\*16 = 63 columns for q\|k, not a "
        r"multiple of 2\*K = 32 for any key head count H dividing HV \(HV = 4, V = 16, K = 16 from dims "
        r"1, 2 and 3 of state \[\d+, 4, 16, 16\], layout \"vk\"\): check mixed_qkv's width",
    ),
    _error(
        "state_wrong_K",
        _set("state", lambda c: torch.zeros(c.state.shape[0], HV, V, K + 1)),
        r"^state's key head dim K = 17 \(dim 3 of state \[\d+, 4, 16, 17\], layout \"vk\"\) does not fit "
        r"mixed_qkv: .* that width fits K = 32 with H = 1, K = 16 with H = 2, K = 8 with H = 4$",
    ),
    _error(
        "state_wrong_K_kv",
        lambda c: (
            _set("state", lambda c: torch.zeros(c.state.shape[0], HV, K - 1, V))(c),
            c.opts.update(state_layout="kv"),
        ),
        r"^state's key head dim K = 15 \(dim 2 of state \[\d+, 4, 15, 16\], layout \"kv\"\) does not fit",
    ),
    _error(
        "mixed_qkv_width_too_small",
        _qkv_width(HV * V),
        r"mixed_qkv width 64 = 2\*H\*K \+ HV\*V leaves 64 - 4\*16 = 0 columns",
    ),
    _error(
        "head_ratio_not_integral",
        _qkv_width(2 * 3 * K + HV * V),  # H = 3: 4 // 3 is listed
        r"value heads HV = 4 are not a multiple of key heads H = 3",
    ),
    _error("num_k_heads_mismatch", None, r"num_k_heads = 1 disagrees with the mixed_qkv width, which gives H = 2"),
    # strides
    _error(
        "mixed_qkv_column_stride",
        _set("mixed_qkv", lambda c: _wide(c.mixed_qkv)),
        r"mixed_qkv must have unit stride on dimension 1, got stride 2",
    ),
    _error(
        "mixed_qkv_overlapping_rows",
        _set("mixed_qkv", lambda c: c.mixed_qkv.as_strided(c.mixed_qkv.shape, (10, 1))),
        r"mixed_qkv row stride 10 is smaller than the row size",
    ),
    _error("a_column_stride", _set("a", lambda c: _wide(c.a)), r"^a must have unit stride on dimension 1"),
    _error("z_V_stride", _set("z", lambda c: _wide(c.z)), r"^z must have unit stride on dimension 2"),
    _error(
        "out_not_contiguous",
        _new_out(lambda c: c.out.transpose(1, 2).contiguous().transpose(1, 2)),
        r"^out must be contiguous",
    ),
    _error(
        "state_inner_not_contiguous",
        _set("state", lambda c: c.state.transpose(2, 3)),
        r"state must be contiguous in dimensions 1\.\.3",
    ),
    _error(
        "state_overlapping_slots",
        _set("state", _overlapping_state),
        r"state slot stride 1023 is smaller than one slot \(HV\*K\*V = 1024\)",
    ),
    _error(
        "state_indices_not_contiguous",
        _set("state_indices", lambda c: _wide(c.state_indices)),
        r"state_indices must be contiguous",
    ),
    _error(
        "cu_seqlens_not_contiguous", _set("cu_seqlens", lambda c: _wide(c.cu_seqlens)), r"cu_seqlens must be contiguous"
    ),
    _error("A_log_not_contiguous", _set("A_log", lambda c: _wide(c.A_log)), r"A_log must be contiguous"),
    # options
    _error(
        "z_without_norm_weight",
        _set("norm_weight", lambda c: None),
        r"z \(the output gate\) was given without norm_weight",
    ),
    _error("bad_gate", _opt(gate="relu"), r"gate must be 'silu' or 'sigmoid', got 'relu'"),
    _error("bad_state_layout", _opt(state_layout="VK"), r"state_layout must be 'vk' or 'kv', got 'VK'"),
    _error("negative_first_valid_slot", _opt(first_valid_slot=-1), r"first_valid_slot = -1 must be >= 0"),
    _error("negative_l2_eps", _opt(l2_eps=-1e-6), r"l2_eps and norm_eps must be finite and >= 0"),
    _error("nan_norm_eps", _opt(norm_eps=float("nan")), r"l2_eps and norm_eps"),
    _error("infinite_scale", _opt(scale=float("inf")), r"scale must be finite"),
    _error(
        "error_count_two_elements",
        _opt(error_count=torch.zeros(2, dtype=torch.int32)),
        r"error_count must hold exactly one int32 element",
    ),
    _error("error_count_int64", _opt(error_count=torch.zeros(1, dtype=torch.int64)), r"error_count has dtype int64"),
]


@pytest.mark.parametrize("change,match", ARGUMENT_ERRORS)
def test_invalid_argument(gen, change, match):
    case = base_case(gen)
    if change is None:  # num_k_heads is a keyword of gdn.decode_mtp only
        expect_error(case, match, call=lambda: case.run(num_k_heads=1))
        case.poison_out()
        case.run(num_k_heads=H)  # the right value is accepted
        assert torch.isfinite(case.out).all()
        return
    change(case)
    expect_error(case, match)


def test_negative_strides_from_numpy(gen):
    case = base_case(gen)
    args = [x.numpy() for x in case.args()]
    args[1] = np.ascontiguousarray(args[1][::-1])[::-1]  # same values, negative row stride
    kw = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in case.kwargs().items()}
    expect_error(case, r"^a has a negative stride on dimension 0", call=lambda: gdn.decode_mtp(*args, **kw))


# ---- devices -------------------------------------------------------------------------------------
# A CPU-only machine has no second device; a DLPack capsule that claims its (host) memory lives on
# CUDA device 0 exercises the device checks. Its data is never touched: validation stops first.


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


_DL_CUDA = 2
_DL_CODES = {
    torch.float32: (2, 32),
    torch.bfloat16: (4, 16),
    torch.float16: (2, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
}


class _FakeCudaArray:
    """A DLPack capsule describing `t`'s memory as if it were on cuda:0 (keeps `t` alive)."""

    def __init__(self, t: torch.Tensor):
        self.t = t
        self.shape = (ctypes.c_int64 * t.dim())(*t.shape)
        self.strides = (ctypes.c_int64 * t.dim())(*t.stride())
        self.mt = _DLManagedTensor()
        self.mt.dl_tensor = _DLTensor(
            t.data_ptr(),
            _DLDevice(_DL_CUDA, 0),
            t.dim(),
            _DLDataType(*_DL_CODES[t.dtype], 1),
            self.shape,
            self.strides,
            0,
        )
        new = ctypes.pythonapi.PyCapsule_New
        new.restype = ctypes.py_object
        new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self.capsule = new(ctypes.addressof(self.mt), b"dltensor", None)


@pytest.mark.parametrize("name", ["a", "z", "state_indices", "out"])
def test_argument_on_another_device(gen, name):
    case = base_case(gen)
    fake = _FakeCudaArray(getattr(case, name))
    args, kw = list(case.args()), case.kwargs()
    names = ["mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens", "out"]
    if name in names:
        args[names.index(name)] = fake.capsule
    else:
        kw[name] = fake.capsule
    expect_error(case, rf"^{name} is on cuda:0 but the call runs on cpu", call=lambda: gdn.decode_mtp(*args, **kw))


@pytest.mark.skipif(
    gdn._C.built_with_cuda, reason="with CUDA kernels built, a fake device pointer must not reach a launch"
)
def test_cuda_state_without_cuda_build(gen):
    case = base_case(gen)
    fake = _FakeCudaArray(case.state)
    args = list(case.args())
    args[5] = fake.capsule
    expect_error(
        case,
        r"state is a CUDA array but this build of gdn has no CUDA kernels",
        call=lambda: gdn.decode_mtp(*args, **case.kwargs()),
    )


def test_error_through_torch_op(gen):
    case = base_case(gen)
    case.num_accepted_tokens[2] = 0
    expect_error(case, r"request row 2: num_accepted_tokens = 0", call=lambda: case.run(torch.ops.gdn.decode_mtp))


# ---- errors a user can act on ------------------------------------------------------------------


def test_wrong_state_head_count_says_where_HV_came_from(gen):
    """A pool with the wrong number of value heads: the message starts from the state's dim 1,
    not from a mixed_qkv width that is in fact right."""
    case = base_case(gen)
    case.state = torch.zeros(case.state.shape[0], 2 * HV, V, K)
    case.pool_buffer = case.state
    expect_error(
        case,
        rf"^state has HV = {2 * HV} value heads \(dim 1 of state "
        rf"\[\d+, {2 * HV}, {V}, {K}\]; .*\), but mixed_qkv width "
        rf"{2 * H * K + HV * V} = 2\*H\*K \+ HV\*V leaves .* "
        r"check state's head count \(dim 1\)",
    )


def _read_only(x):
    x = x.numpy().copy()
    x.flags.writeable = False
    return x


# (argument, bad value from the case, words the message must hold after "got")
WRONG_TYPES = [
    ("cu_seqlens", lambda c: c.cu_seqlens.tolist(), "a list of 4 items; wrap it in an array"),
    ("out", lambda c: _read_only(c.out), "numpy.ndarray (shape (6, 4, 16), dtype float32"),
    ("state", lambda c: torch.empty(c.state.shape, device="meta"), "device meta); meta tensors"),
    ("a", lambda c: "a", "str 'a'"),
    ("z", lambda c: [0.0], "a list of 1 item"),
    ("gate", lambda c: 1, "int 1"),
    ("scale", lambda c: "0.1", "str '0.1'"),
    ("first_valid_slot", lambda c: 1.5, "float 1.5"),
    ("error_count", lambda c: (0,), "a tuple of 1 item"),
    ("stream", lambda c: "default", "str 'default'"),
]


@pytest.mark.parametrize("name,bad,words", WRONG_TYPES, ids=[w[0] for w in WRONG_TYPES])
def test_wrong_python_type_names_the_argument(gen, name, bad, words):
    """A value the binding cannot take raises TypeError naming the argument and what it got (not
    nanobind's dump of the whole signature), and nothing is written."""
    case = base_case(gen)
    args = dict(
        zip(["mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens", "out"], case.args()),
        **case.kwargs(),
    )
    args[name] = bad(case)
    case.poison_out()
    pool, out = case.pool_buffer.clone(), case.out_buffer.clone()
    with pytest.raises(TypeError) as info:
        gdn.decode_mtp(**args)
    message = str(info.value)
    assert message.startswith(f"gdn.decode_mtp: {name} must be ") or message.startswith(f"{name} must be "), message
    assert words in message.split(", got ", 1)[-1], message
    assert "incompatible function arguments" not in message
    assert info.value.__suppress_context__ or info.value.__context__ is None
    assert torch.equal(case.pool_buffer.view(torch.uint8), pool.view(torch.uint8))
    assert torch.equal(case.out_buffer.view(torch.uint8), out.view(torch.uint8))
