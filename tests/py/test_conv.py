"""gdn.causal_conv1d_update and torch.ops.gdn.causal_conv1d_update against a float64 reference of
the tests' own; speculative rollback == sequential updates bit for bit; invalid rows; CUDA (skips
without a GPU)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import gdn
from gdn.conv import causal_conv1d_prefill_reference, causal_conv1d_update_reference

torch = pytest.importorskip("torch")

from reference_torch import cuda_skip_reason  # noqa: E402 (needs torch)

# Why the CUDA tests cannot run here ("no GPU ...", a build without CUDA kernels, no kernel image
# for the device), or None.
_CUDA_REASON = cuda_skip_reason()
needs_cuda = pytest.mark.skipif(_CUDA_REASON is not None, reason=f"CUDA conv: {_CUDA_REASON}")


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


def test_cuda_tests_skip_saying_why():
    """The CUDA tests run exactly where reference_torch.cuda_skip_reason() finds nothing missing,
    and otherwise skip with its reason ("no GPU ..." on a machine without one)."""
    reason = cuda_skip_reason()
    assert needs_cuda.args == (reason is not None,)
    assert needs_cuda.kwargs["reason"] == f"CUDA conv: {reason}"


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


# ---- causal_conv1d_prefill -----------------------------------------------------------------------

ROUND = {
    torch.float32: None,
    torch.bfloat16: lambda v: torch.from_numpy(np.asarray(v)).to(torch.bfloat16).double().numpy(),
    torch.float16: lambda v: torch.from_numpy(np.asarray(v)).to(torch.float16).double().numpy(),
}


def token_by_token(case, layout="channels_major", first_valid_slot=0, activation="silu"):
    """The tests' reference of a prefill: the package's float64 causal_conv1d_update reference run
    one token at a time (accepted count 1) on a buffer that starts as the initial slot's (zeros for
    a null id) and ends in the final slot. Returns (out, pool) in float64."""
    x, w = case["x"].cpu().double(), case["w"].cpu().double()
    before = case["pool"].cpu()
    rnd = ROUND[before.dtype]
    pool = before.double().numpy().copy()
    out = np.full(x.shape, np.nan)
    cu = case["cu"].cpu().tolist()
    for i, (a, f) in enumerate(zip(case["initial"].cpu().tolist(), case["final"].cpu().tolist())):
        if cu[i + 1] == cu[i]:
            continue
        buf = before.double().numpy()[a] if a >= first_valid_slot else np.zeros(before.shape[1:])
        buf = buf[None].copy()
        for t in range(cu[i], cu[i + 1]):
            o, buf = causal_conv1d_update_reference(
                x[t : t + 1].numpy(),
                w.numpy(),
                buf,
                np.zeros(1, np.int32),
                np.array([0, 1], np.int32),
                activation=activation,
                state_layout=layout,
                state_dtype=rnd,
            )
            out[t] = o[0]
        if f >= first_valid_slot:
            pool[f] = buf[0]
    return out, pool


def make_prefill_case(
    *,
    D=20,
    W=4,
    num_spec=2,
    T=(3, 0, 1, 2, 4, 63, 64, 65, 150),
    slots=24,
    layout="channels_major",
    state_dtype=torch.float32,
    x_dtype=torch.float32,
    seed=0,
    device="cpu",
):
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0] + list(np.cumsum(T)), dtype=torch.int32)
    L = int(cu[-1])
    Lbuf = W - 1 + num_spec
    shape = (slots, D, Lbuf) if layout == "channels_major" else (slots, Lbuf, D)
    perm = torch.randperm(slots, generator=g).to(torch.int32)
    case = dict(
        x=torch.randn(L, D, generator=g).to(x_dtype),
        w=(0.5 * torch.randn(D, W, generator=g)),
        pool=torch.randn(*shape, generator=g).to(state_dtype),
        initial=perm[: len(T)].clone(),
        final=perm[len(T) : 2 * len(T)].clone(),
        cu=cu,
    )
    return {k: v.to(device) for k, v in case.items()}


def run_prefill(case, *, layout="channels_major", op=False, out=None, **kw):
    out = torch.full_like(case["x"], float("nan")) if out is None else out
    args = (case["x"], case["w"], case["pool"], case["initial"], case["final"], case["cu"], out)
    fn = torch.ops.gdn.causal_conv1d_prefill if op else gdn.causal_conv1d_prefill
    fn(*args, state_layout=layout, **kw)
    return out


def check_prefill(case, out, ref):
    ref_out, ref_pool = ref
    got = out.double().cpu()
    written = ~np.isnan(ref_out)
    unit = {torch.float32: 4e-7, torch.bfloat16: 2**-8, torch.float16: 2**-11}[out.dtype]
    want = torch.from_numpy(ref_out)
    err = (got[written] - want[written]).abs() - unit * want[written].abs()
    assert err.max().item() <= 2e-6, f"output error {err.max().item()}"
    assert torch.isnan(got[~torch.from_numpy(written)]).all(), "a row of no request was written"
    # The pool is bit-exact: final slots as the reference, every other slot unchanged.
    assert np.array_equal(case["pool"].double().cpu().numpy(), ref_pool)


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
@pytest.mark.parametrize("W,num_spec", [(4, 2), (2, 0), (3, 5)])
def test_prefill_matches_token_by_token_reference(layout, state_dtype, x_dtype, W, num_spec):
    case = make_prefill_case(
        W=W, num_spec=num_spec, layout=layout, state_dtype=state_dtype, x_dtype=x_dtype, seed=W + 7 * num_spec
    )
    ref = token_by_token(case, layout)
    out = run_prefill(case, layout=layout)
    check_prefill(case, out, ref)


def test_prefill_package_reference_agrees():
    case = make_prefill_case(seed=3, state_dtype=torch.bfloat16, layout="tokens_major")
    first = token_by_token(case, "tokens_major", first_valid_slot=2)
    second = causal_conv1d_prefill_reference(
        case["x"].double().numpy(),
        case["w"].double().numpy(),
        case["pool"].double().numpy(),
        case["initial"].numpy(),
        case["final"].numpy(),
        case["cu"].numpy(),
        state_layout="tokens_major",
        first_valid_slot=2,
        state_dtype=ROUND[torch.bfloat16],
    )
    np.testing.assert_allclose(second[0], first[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(second[1], first[1])


def test_prefill_null_and_in_place_slots():
    case = make_prefill_case(seed=4, T=(2, 65, 1, 4, 3, 0))
    # Null initial (zeros), in-place slot, null final (outputs only), negative ids, padded row.
    case["initial"] = torch.tensor([0, 5, -3, 7, 0, 9], dtype=torch.int32)
    case["final"] = torch.tensor([3, 5, 9, 0, -1, 0], dtype=torch.int32)
    ref = token_by_token(case, first_valid_slot=1)
    out = run_prefill(case, first_valid_slot=1)
    check_prefill(case, out, ref)


@pytest.mark.parametrize("layout", ["channels_major", "tokens_major"])
def test_prefill_in_place_output_and_strided_inputs(layout):
    case = make_prefill_case(seed=5, layout=layout, x_dtype=torch.bfloat16)
    # x is a column slice of a wider projection; indices are columns of [N, 2] tables.
    wide = torch.randn(case["x"].shape[0], 28).to(torch.bfloat16)
    wide[:, 4:24] = case["x"]
    x = wide[:, 4:24]
    case_in = dict(
        case,
        x=x,
        initial=torch.stack([case["initial"], case["final"]], 1)[:, 0],
        final=torch.stack([case["initial"], case["final"]], 1)[:, 1],
    )
    assert x.stride(0) == 28 and case_in["initial"].stride(0) == 2
    ref = token_by_token(dict(case_in, x=x.clone()), layout)
    out = run_prefill(case_in, layout=layout, out=x)
    assert out.data_ptr() == x.data_ptr()
    check_prefill(case_in, out, ref)


def test_prefill_then_update_equals_token_by_token():
    """The strongest check, on the library's own calls: a prefill, then verify steps, equal the
    same tokens going through causal_conv1d_update one at a time, bit for bit."""
    case = make_prefill_case(seed=6, state_dtype=torch.bfloat16, x_dtype=torch.bfloat16, num_spec=3)
    seq_pool = case["pool"].clone()
    cu = case["cu"].tolist()
    for i, (a, f) in enumerate(zip(case["initial"].tolist(), case["final"].tolist())):
        if cu[i + 1] > cu[i]:  # a padded row writes nothing
            seq_pool[f] = case["pool"][a]
    out = run_prefill(case)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for i, f in enumerate(case["final"].tolist()):
        for t in range(cu[i], cu[i + 1]):
            o1 = torch.full((1, 20), float("nan"), dtype=torch.bfloat16)
            gdn.causal_conv1d_update(
                case["x"][t : t + 1], case["w"], seq_pool, torch.tensor([f], dtype=torch.int32), one, o1
            )
            assert torch.equal(o1[0], out[t]), f"request {i} row {t}"
    assert torch.equal(seq_pool, case["pool"])
    g = torch.Generator().manual_seed(1)
    slots = case["final"][torch.tensor(cu[1:]) > torch.tensor(cu[:-1])]
    n, S = len(slots), 4
    acc = torch.ones(n, dtype=torch.int32)
    vcu = torch.arange(0, n * S + 1, S, dtype=torch.int32)
    for _ in range(3):
        x = torch.randn(n * S, 20, generator=g).to(torch.bfloat16)
        o_a, o_b = torch.empty_like(x), torch.empty_like(x)
        gdn.causal_conv1d_update(x, case["w"], case["pool"], slots, vcu, o_a, num_accepted_tokens=acc)
        gdn.causal_conv1d_update(x, case["w"], seq_pool, slots, vcu, o_b, num_accepted_tokens=acc)
        assert torch.equal(o_a, o_b) and torch.equal(case["pool"], seq_pool)
        acc = torch.randint(1, S + 1, (n,), generator=g, dtype=torch.int32)


def test_prefill_op_matches_function_and_opcheck():
    case = make_prefill_case(seed=8, T=(3, 70, 0, 2))
    pool0 = case["pool"].clone()
    out_f = run_prefill(case)
    pool_f = case["pool"].clone()
    case["pool"].copy_(pool0)
    out_o = run_prefill(case, op=True)
    assert torch.equal(out_f, out_o) and torch.equal(pool_f, case["pool"])
    out = torch.empty_like(case["x"])
    for kw in ({}, {"error_count": torch.zeros(1, dtype=torch.int32)}):
        result = torch.library.opcheck(
            torch.ops.gdn.causal_conv1d_prefill.default,
            (case["x"], case["w"], case["pool"], case["initial"], case["final"], case["cu"], out),
            kw,
        )
        assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda c: c["initial"].__setitem__(2, 24), r"request row 2: initial_state_indices\[2\] = 24 is >= the pool"),
        (lambda c: c["final"].__setitem__(0, 99), r"request row 0: final_state_indices\[0\] = 99"),
        (lambda c: c["cu"].__setitem__(2, 1), r"request row 1: cu_seqlens\[1..\] = \(3, 1\)"),
    ],
)
@pytest.mark.parametrize("op", [False, True], ids=["function", "op"])
def test_prefill_invalid_rows_raise_and_write_nothing(mutate, message, op):
    case = make_prefill_case(seed=9, T=(3, 70, 4))
    mutate(case)
    before = case["pool"].clone()
    out = torch.full_like(case["x"], float("nan"))
    with pytest.raises(ValueError, match=message):
        run_prefill(case, out=out, op=op)
    assert torch.equal(case["pool"], before)
    assert torch.isnan(out).all()


def test_prefill_argument_errors_name_the_argument():
    case = make_prefill_case(seed=10, T=(2, 3))
    with pytest.raises(ValueError, match="^final_state_indices dimension 0 must be N"):
        run_prefill(dict(case, final=case["final"][:1]))
    with pytest.raises(ValueError, match="^initial_state_indices has dtype float32"):
        run_prefill(dict(case, initial=case["initial"].float()))
    with pytest.raises(ValueError, match="^conv_state has 5 channels but weight has D = 20"):
        run_prefill(case, layout="tokens_major")
    with pytest.raises(TypeError, match=r"^gdn\.causal_conv1d_prefill: cu_seqlens must be"):
        run_prefill(dict(case, cu=case["cu"].tolist()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["channels_major", "tokens_major"])
@pytest.mark.parametrize("state_dtype,x_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
def test_cuda_prefill_matches_cpu_and_reference(layout, state_dtype, x_dtype, in_place):
    T = (3, 0, 1, 2, 4, 63, 64, 65, 700)
    cpu = make_prefill_case(D=260, T=T, layout=layout, state_dtype=state_dtype, x_dtype=x_dtype, seed=21)
    dev = {k: v.cuda() for k, v in cpu.items()}
    ref = token_by_token(cpu, layout)
    out_c = run_prefill(cpu, layout=layout)
    out_d = run_prefill(dev, layout=layout, out=dev["x"] if in_place else None)
    torch.cuda.synchronize()
    check_prefill({k: v.cpu() for k, v in dev.items()}, out_d, ref)
    assert torch.equal(dev["pool"].cpu(), cpu["pool"])
    torch.testing.assert_close(out_d.cpu(), out_c, rtol=2e-2 if x_dtype == torch.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_cuda_prefill_invalid_rows_zeroed_and_counted():
    case = make_prefill_case(D=64, seed=22, T=(2, 70, 4), device="cuda")
    case["initial"][1] = 1 << 30
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    before = case["pool"].clone()
    out = run_prefill(case, error_count=errors)
    torch.cuda.synchronize()
    assert int(errors) == 1
    assert torch.equal(out[2:72], torch.zeros_like(out[2:72]))
    assert not torch.isnan(out).any()
    others = [s for s in range(24) if s not in (int(case["final"][0]), int(case["final"][2]))]
    assert torch.equal(case["pool"][others], before[others])
