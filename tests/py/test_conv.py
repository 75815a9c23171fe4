"""gdn.causal_conv1d_update and torch.ops.gdn.causal_conv1d_update against a float64 reference of
the tests' own; speculative rollback == sequential updates bit for bit; invalid rows; CUDA (skips
without a GPU)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import gdn
from gdn.conv import causal_conv1d_update_reference

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available() and gdn.cuda_device_count() > 0 and gdn._C.built_with_cuda
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of gdn")


def reference(x, w, pool, slots, cu, acc, layout="channels_major", activation="silu", first_valid_slot=0):
    """Per-channel loop over the rule of gdn-math.md §3.3, in float64 on the stored values.

    `pool` is a torch tensor (its dtype models storage rounding). Returns (out, pool_after)."""
    store = pool.dtype
    P = pool.double().clone()
    if layout == "tokens_major":
        P = P.transpose(1, 2).clone()
    X = x.double()
    W = w.shape[1]
    out = torch.full(x.shape, float("nan"), dtype=torch.float64)
    for i in range(len(slots)):
        b, e = int(cu[i]), int(cu[i + 1])
        s = int(slots[i])
        if e == b or s < first_valid_slot:
            continue
        off = int(acc[i]) - 1
        for c in range(w.shape[0]):
            hist = [P[s, c, off + j].item() for j in range(W - 1)]
            stored = [x[t, c].to(store).double().item() for t in range(b, e)]
            frame = hist + stored
            for t in range(e - b):
                v = sum(w[c, j].double().item() * frame[t + j] for j in range(W - 1))
                v += w[c, W - 1].double().item() * X[b + t, c].item()
                out[b + t, c] = v / (1 + np.exp(-v)) if activation == "silu" else v
            for p in range(W - 2 + e - b):
                P[s, c, p] = frame[p + 1]
    if layout == "tokens_major":
        P = P.transpose(1, 2)
    return out, P


def make_case(
    *,
    D=20,
    W=4,
    num_spec=3,
    T=(4, 0, 2, 3),
    slots=10,
    layout="channels_major",
    state_dtype=torch.float32,
    x_dtype=torch.float32,
    seed=0,
    device="cpu",
):
    g = torch.Generator().manual_seed(seed)
    S = num_spec + 1
    T = [min(t, S) for t in T]
    cu = torch.tensor([0] + list(np.cumsum(T)), dtype=torch.int32)
    L = int(cu[-1])
    Lbuf = W - 1 + num_spec
    shape = (slots, D, Lbuf) if layout == "channels_major" else (slots, Lbuf, D)
    case = dict(
        x=torch.randn(L, D, generator=g).to(x_dtype),
        w=(0.5 * torch.randn(D, W, generator=g)),
        pool=torch.randn(*shape, generator=g).to(state_dtype),
        slots=torch.randperm(slots, generator=g)[: len(T)].to(torch.int32),
        cu=cu,
        acc=torch.randint(1, S + 1, (len(T),), generator=g, dtype=torch.int32),
    )
    return {k: v.to(device) for k, v in case.items()}


def run(case, *, layout="channels_major", op=False, out=None, **kw):
    out = torch.full_like(case["x"], float("nan")) if out is None else out
    args = (case["x"], case["w"], case["pool"], case["slots"], case["cu"], out)
    if op:
        torch.ops.gdn.causal_conv1d_update(*args, num_accepted_tokens=case["acc"], state_layout=layout, **kw)
    else:
        gdn.causal_conv1d_update(*args, num_accepted_tokens=case["acc"], state_layout=layout, **kw)
    return out


def check(case, out, pool_before, layout, **kw):
    ref_out, ref_pool = reference(
        case["x"].cpu(),
        case["w"].cpu(),
        pool_before.cpu(),
        case["slots"].cpu(),
        case["cu"].cpu(),
        case["acc"].cpu(),
        layout=layout,
        **kw,
    )
    got = out.double().cpu()
    written = ~torch.isnan(ref_out)
    unit = {torch.float32: 4e-7, torch.bfloat16: 2**-8, torch.float16: 2**-11}[out.dtype]
    err = (got[written] - ref_out[written]).abs() - unit * ref_out[written].abs()
    assert err.max().item() <= 2e-6, f"output error {err.max().item()}"
    assert torch.isnan(got[~written]).all(), "a skipped row's output was written"
    # The pool is bit-exact (every element: written ones equal the reference, others unchanged).
    assert torch.equal(case["pool"].double().cpu(), ref_pool)


@pytest.mark.parametrize("layout", ["channels_major", "tokens_major"])
@pytest.mark.parametrize(
    "state_dtype,x_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("W,num_spec", [(4, 3), (4, 0), (2, 1), (3, 7)])
def test_matches_float64_reference(layout, state_dtype, x_dtype, W, num_spec):
    case = make_case(
        W=W,
        num_spec=num_spec,
        layout=layout,
        state_dtype=state_dtype,
        x_dtype=x_dtype,
        seed=W * 10 + num_spec,
        T=(num_spec + 1, 0, 2, 1, 3),
    )
    before = case["pool"].clone()
    out = run(case, layout=layout)
    check(case, out, before, layout)


def test_package_reference_agrees():
    case = make_case(seed=3, T=(4, 1, 3))
    ref_a = reference(case["x"], case["w"], case["pool"], case["slots"], case["cu"], case["acc"])
    ref_b = causal_conv1d_update_reference(
        case["x"].numpy(),
        case["w"].numpy(),
        case["pool"].numpy(),
        case["slots"].numpy(),
        case["cu"].numpy(),
        num_accepted_tokens=case["acc"].numpy(),
    )
    np.testing.assert_allclose(ref_b[0], ref_a[0].numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(ref_b[1], ref_a[1].numpy())


def test_torch_op_in_place_and_column_indices():
    case = make_case(seed=5, T=(4, 2, 3))
    before = case["pool"].clone()
    x0 = case["x"].clone()
    # Indices as column 0 of an [N, S] table (strided), output written over x itself.
    table = torch.stack([case["slots"], case["slots"] + 100], dim=1)
    case_view = dict(case, slots=table[:, 0])
    out = run(case_view, out=case["x"])
    assert out.data_ptr() == case["x"].data_ptr()
    check(dict(case, x=x0), out, before, "channels_major")
    # The torch op (distinct out) gives the same bits.
    case2 = dict(case, x=x0, pool=before.clone())
    out2 = run(case2, op=True)
    assert torch.equal(out2, out)
    assert torch.equal(case2["pool"], case["pool"])


@pytest.mark.parametrize("counter", [False, True], ids=["no_error_count", "error_count"])
def test_opcheck(counter):
    case = make_case(seed=6, T=(2, 3))
    out = torch.empty_like(case["x"])
    kw = {"num_accepted_tokens": case["acc"]}
    if counter:
        kw["error_count"] = torch.zeros(1, dtype=torch.int32)
    result = torch.library.opcheck(
        torch.ops.gdn.causal_conv1d_update.default,
        (case["x"], case["w"], case["pool"], case["slots"], case["cu"], out),
        kw,
    )
    assert all(v == "SUCCESS" for v in result.values()), result


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


def conv_step(x, weight, conv_state, conv_state_indices, cu_seqlens, out, acc, error_count):
    """The op inside a compiled graph; returns what the call added to error_count, read in the
    graph (right only if the schema declares error_count mutated)."""
    before = error_count.clone()
    torch.ops.gdn.causal_conv1d_update(
        x, weight, conv_state, conv_state_indices, cu_seqlens, out, num_accepted_tokens=acc, error_count=error_count
    )
    return error_count - before


def compiled_conv_case(case, out, errors, compiled):
    return compiled(case["x"], case["w"], case["pool"], case["slots"], case["cu"], out, case["acc"], errors)


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
@pytest.mark.parametrize("backend", _backends())
def test_torch_compile_with_error_count(backend):
    """CPU: valid input gives the eager bits and leaves error_count alone; an invalid row raises
    before anything is written (the host path reports by raising, not by counting)."""
    torch._dynamo.reset()
    compiled = torch.compile(conv_step, fullgraph=True, backend=backend)
    case = make_case(seed=31, T=(4, 2, 3))
    pool_e, out_e = case["pool"].clone(), torch.full_like(case["x"], float("nan"))
    gdn.causal_conv1d_update(
        case["x"], case["w"], pool_e, case["slots"], case["cu"], out_e, num_accepted_tokens=case["acc"]
    )
    errors = torch.full((1,), 5, dtype=torch.int32)
    out = torch.full_like(case["x"], float("nan"))
    delta = compiled_conv_case(case, out, errors, compiled)
    assert int(delta) == 0 and int(errors) == 5
    assert torch.equal(out, out_e) and torch.equal(case["pool"], pool_e)

    case["acc"][1] = 0
    before = case["pool"].clone()
    out = torch.full_like(case["x"], float("nan"))
    with pytest.raises(ValueError, match="request row 1: num_accepted_tokens = 0"):
        compiled_conv_case(case, out, errors, compiled)
    assert int(errors) == 5
    assert torch.equal(case["pool"], before) and torch.isnan(out).all()


def test_null_slot_and_padded_rows_are_skipped():
    case = make_case(seed=7, T=(3, 0, 2))
    case["slots"] = torch.tensor([4, 0, 0], dtype=torch.int32)  # rows 1, 2: slot 0 is null
    before = case["pool"].clone()
    out = run(case, first_valid_slot=1)
    check(case, out, before, "channels_major", first_valid_slot=1)
    assert torch.isnan(out[3:]).all()
    assert torch.equal(case["pool"][0], before[0])


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda c: c["acc"].__setitem__(1, 0), "request row 1: num_accepted_tokens = 0"),
        (lambda c: c["acc"].__setitem__(2, 5), "request row 2: num_accepted_tokens = 5"),
        (lambda c: c["slots"].__setitem__(0, 10), r"request row 0: conv_state_indices\[0\] = 10 is >= the pool"),
        (lambda c: c["cu"].__setitem__(2, 1), "request row 1: cu_seqlens"),
    ],
)
def test_invalid_rows_raise_and_write_nothing(mutate, message):
    case = make_case(seed=8, T=(2, 3, 4))
    mutate(case)
    before = case["pool"].clone()
    out = torch.full_like(case["x"], float("nan"))
    with pytest.raises(ValueError, match=message):
        run(case, out=out)
    assert torch.equal(case["pool"], before)
    assert torch.isnan(out).all()


def test_too_many_tokens_names_the_row():
    case = make_case(seed=9, num_spec=1, T=(2, 2))
    case["cu"] = torch.tensor([0, 1, 4], dtype=torch.int32)
    case["x"] = torch.randn(4, 20)
    with pytest.raises(ValueError, match="request row 1: has T = 3 tokens"):
        run(case)


def test_argument_errors_name_the_argument():
    case = make_case(seed=10)
    with pytest.raises(ValueError, match="^weight width W = 1"):
        gdn.causal_conv1d_update(
            case["x"], case["w"][:, :1], case["pool"], case["slots"], case["cu"], torch.empty_like(case["x"])
        )
    with pytest.raises(ValueError, match="^conv_state has 6 channels but weight has D = 20"):
        run(case, layout="tokens_major")
    with pytest.raises(ValueError, match="state_layout must be"):
        run(case, layout="sd")


def spec_vs_sequential(device, state_dtype, layout, W=4, num_spec=3, steps=10, seed=0):
    """Verify steps with random acceptance vs T = 1 steps over the accepted stream (bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    D, N, S = 24, 3, num_spec + 1
    w = (0.5 * torch.randn(D, W, generator=g)).to(device)
    hist = torch.randn(N, D, W - 1, generator=g).to(state_dtype)
    spec_pool = torch.randn(N + 1, D, W - 1 + num_spec, generator=g).to(state_dtype)
    spec_pool[1:, :, : W - 1] = hist
    plain_pool = hist.clone()
    if layout == "tokens_major":
        spec_pool = spec_pool.transpose(1, 2).contiguous()
        plain_pool = plain_pool.transpose(1, 2).contiguous()
    spec_pool, plain_pool = spec_pool.to(device), plain_pool.to(device)
    slots = torch.arange(1, N + 1, dtype=torch.int32, device=device)
    cu = torch.arange(0, N * S + 1, S, dtype=torch.int32, device=device)
    acc = torch.ones(N, dtype=torch.int32, device=device)
    one = torch.tensor([0, 1], dtype=torch.int32, device=device)
    for _ in range(steps):
        x = torch.randn(N * S, D, generator=g).to(device)
        out = torch.full_like(x, float("nan"))
        gdn.causal_conv1d_update(x, w, spec_pool, slots, cu, out, num_accepted_tokens=acc, state_layout=layout)
        n_acc = torch.randint(1, S + 1, (N,), generator=g, dtype=torch.int32)
        for i in range(N):
            for t in range(int(n_acc[i])):
                o1 = torch.full((1, D), float("nan"), device=device)
                gdn.causal_conv1d_update(
                    x[i * S + t : i * S + t + 1],
                    w,
                    plain_pool,
                    torch.tensor([i], dtype=torch.int32, device=device),
                    one,
                    o1,
                    state_layout=layout,
                )
                assert torch.equal(o1[0], out[i * S + t]), "spec output != plain output"
            a = int(n_acc[i])
            window = (
                spec_pool[i + 1, :, a - 1 : a + W - 2]
                if layout == "channels_major"
                else spec_pool[i + 1, a - 1 : a + W - 2, :]
            )
            assert torch.equal(window, plain_pool[i]), "next window != plain history"
        acc = n_acc.to(device)


@pytest.mark.parametrize("layout", ["channels_major", "tokens_major"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_spec_equals_sequential_cpu(layout, state_dtype):
    spec_vs_sequential("cpu", state_dtype, layout)


# ---- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["channels_major", "tokens_major"])
@pytest.mark.parametrize("state_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_cuda_matches_reference(layout, state_dtype, x_dtype):
    case = make_case(
        D=260, layout=layout, state_dtype=state_dtype, x_dtype=x_dtype, seed=21, T=(4, 0, 2, 1, 3), device="cuda"
    )
    before = case["pool"].clone()
    out = run(case, layout=layout)
    torch.cuda.synchronize()
    check({k: v.cpu() for k, v in case.items()}, out, before, layout)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["channels_major", "tokens_major"])
def test_cuda_spec_equals_sequential(layout):
    spec_vs_sequential("cuda", torch.bfloat16, layout)


@pytest.mark.gpu
@needs_cuda
def test_cuda_invalid_rows_zeroed_and_counted():
    case = make_case(D=64, seed=22, T=(2, 3, 4), device="cuda")
    case["acc"][1] = 0
    case["slots"][2] = 1 << 30
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    before = case["pool"].clone()
    out = run(case, error_count=errors)
    torch.cuda.synchronize()
    assert int(errors) == 2
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert not torch.isnan(out[:2]).any()
    others = [s for s in range(10) if s != int(case["slots"][0])]
    assert torch.equal(case["pool"][others], before[others])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_cuda_torch_compile_counts_invalid_rows(backend):
    torch._dynamo.reset()
    compiled = torch.compile(conv_step, fullgraph=True, backend=backend)
    case = make_case(D=64, seed=32, T=(2, 3, 4), device="cuda")
    case["slots"][2] = 1 << 30  # past the pool: invalid, rows 5..8 (cu = 0, 2, 5, 9)
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    pool_e, out_e = case["pool"].clone(), torch.full_like(case["x"], float("nan"))
    gdn.causal_conv1d_update(
        case["x"], case["w"], pool_e, case["slots"], case["cu"], out_e, num_accepted_tokens=case["acc"]
    )
    for calls in (1, 2):
        out = torch.full_like(case["x"], float("nan"))
        delta = compiled_conv_case(case, out, errors, compiled)
        torch.cuda.synchronize()
        assert int(delta) == 1, f"call {calls}: the compiled graph saw {int(delta)} new errors"
        assert int(errors) == calls
        assert torch.equal(out[5:], torch.zeros_like(out[5:]))
        if calls == 1:
            assert torch.equal(out, out_e) and torch.equal(case["pool"], pool_e)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay():
    case = make_case(D=128, seed=23, T=(4, 4, 4), device="cuda")
    out = torch.empty_like(case["x"])
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run(case, out=out, op=True)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(case, out=out, op=True)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        case["x"].copy_(torch.randn(case["x"].shape, generator=g))
        case["acc"].copy_(torch.randint(1, 5, (3,), generator=g, dtype=torch.int32))
        before = case["pool"].clone()
        graph.replay()
        torch.cuda.synchronize()
        check({k: v.cpu() for k, v in case.items()}, out, before, "channels_major")


@pytest.mark.parametrize(
    "name,bad,words",
    [
        ("cu_seqlens", lambda c: c["cu"].tolist(), "a list of 5 items"),
        ("conv_state", lambda c: torch.empty(c["pool"].shape, device="meta"), "device meta"),
        ("activation", lambda c: None, "NoneType"),
    ],
)
def test_wrong_python_type_names_the_argument(name, bad, words):
    case = make_case(seed=5)
    args = dict(
        x=case["x"],
        weight=case["w"],
        conv_state=case["pool"],
        conv_state_indices=case["slots"],
        cu_seqlens=case["cu"],
        out=torch.full_like(case["x"], float("nan")),
    )
    args[name] = bad(case)
    before = case["pool"].clone()
    with pytest.raises(
        TypeError,
        match=rf"^gdn\.causal_conv1d_update: {name} must be .*, got .*"
        rf"{words}",
    ) as info:
        gdn.causal_conv1d_update(**args)
    assert "incompatible function arguments" not in str(info.value)
    assert torch.equal(case["pool"], before)
