"""gdn.decode_mtp on the CPU against the tests' own float64 reference (decode-mtp.md, gdn-math.md).

Every call runs on fresh random inputs with `out` poisoned with NaN; every written slot is compared
for every token, every other slot must stay bit for bit. The grid covers each axis fully and the
important pairs, not the full cartesian product (the whole file runs in seconds on 2 cores).
"""

from __future__ import annotations

import random

import pytest

import gdn

torch = pytest.importorskip("torch")

from reference_torch import (  # noqa: E402 (needs torch)
    BF16,
    F64,
    FP16,
    FP32,
    FP32_BAR,
    MIXED_DTYPE_IDS,
    MIXED_DTYPES,
    OUT16_BAR,
    check_case,
    decode_mtp_ref,
    make_case,
    out_bar,
    rel_l2,
    state_bar,
)

I32, I64 = torch.int32, torch.int64


# ---- the grid ------------------------------------------------------------------------------------

# (H, HV): ratios 1, 2, 3, 4, 8 (compiled in) and 5, 6 (run-time ratio).
RATIOS = [(2, 2), (2, 4), (2, 6), (1, 4), (1, 8), (2, 10), (1, 6)]


@pytest.mark.parametrize("state_dtype", [FP32, BF16, FP16], ids=["state_fp32", "state_bf16", "state_fp16"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("H,HV", RATIOS, ids=[f"r{hv // h}" for h, hv in RATIOS])
def test_head_ratios(gen, H, HV, layout, state_dtype):
    # Rotate the activation dtype so that every ratio meets every activation dtype and every
    # (state, activation) dtype pair occurs.
    dtypes = [FP32, BF16, FP16]
    act = dtypes[(HV // H + (layout == "kv") + dtypes.index(state_dtype)) % 3]
    case = make_case(
        gen, H=H, HV=HV, K=32, V=32, S=4, T=(1, 4, 0, 3, 2), layout=layout, act=act, state_dtype=state_dtype
    )
    ref = check_case(case, out_tol=out_bar(act), state_tol=state_bar(state_dtype))
    assert len(ref.written) >= 5  # a real workload: several slots written


def test_many_requests_and_heads(gen):
    """Enough (request, head) tasks to spread over every thread."""
    T = [int(t) for t in torch.randint(0, 5, (24,), generator=gen)]
    case = make_case(gen, H=4, HV=16, K=32, V=32, S=4, T=T, act=BF16)
    check_case(case, out_tol=OUT16_BAR)


@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_source_slot_is_also_token_0_destination(gen, layout):
    """The initial state is read completely before anything is written: with row [s, x, s, y] and
    acc = 3, token 0 overwrites the source slot s before token 2 needs the rest of the row."""
    case = make_case(gen, H=1, HV=2, K=32, V=32, S=4, T=(4, 2), acc=(3, 1), layout=layout, null_dests=False)
    case.state_indices[0, 0] = case.state_indices[0, 2]
    ref = check_case(case, out_tol=FP32_BAR)
    assert ref.written[int(case.state_indices[0, 2])] == (0, 2)


@pytest.mark.parametrize("act", [FP32, BF16, FP16], ids=["act_fp32", "act_bf16", "act_fp16"])
@pytest.mark.parametrize("state_dtype", [FP32, BF16, FP16], ids=["state_fp32", "state_bf16", "state_fp16"])
def test_state_and_activation_dtypes(gen, state_dtype, act):
    layout = "kv" if (state_dtype == BF16) == (act == FP16) else "vk"
    case = make_case(
        gen, H=2, HV=4, K=32, V=32, S=3, T=(3, 1, 2, 0, 3), act=act, state_dtype=state_dtype, layout=layout
    )
    # One call reads the (rounded) state exactly, so only the stored states see the state dtype.
    check_case(case, out_tol=out_bar(act), state_tol=state_bar(state_dtype))


@pytest.mark.parametrize("dtypes", MIXED_DTYPES, ids=MIXED_DTYPE_IDS)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_mixed_dtypes(gen, dtypes, strided):
    case = make_case(gen, H=1, HV=3, K=32, V=32, S=4, T=(2, 4, 1), dtypes=dtypes, strided=strided)
    check_case(case, out_tol=out_bar(dtypes["out"]))


@pytest.mark.parametrize("first_valid_slot", [0, 1])
@pytest.mark.parametrize("S", [1, 2, 5, 9])
def test_every_T_and_every_acc(gen, S, first_valid_slot):
    """One request per (T, acc) pair, T in 0..S, acc in 1..S."""
    pairs = [(t, n) for t in range(S + 1) for n in range(1, S + 1)]
    random.Random(S).shuffle(pairs)
    case = make_case(
        gen,
        H=1,
        HV=2,
        K=16,
        V=16,
        S=S,
        T=[t for t, _ in pairs],
        acc=[n for _, n in pairs],
        first_valid_slot=first_valid_slot,
        padded_ids="valid" if first_valid_slot else "null",
        layout="kv" if S % 2 else "vk",
    )
    check_case(case, out_tol=FP32_BAR)


@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm", ["zw", "w", "none"], ids=["z_and_norm_weight", "norm_weight_only", "no_norm"])
def test_norm_and_gate(gen, norm, gate):
    case = make_case(gen, H=2, HV=6, K=32, V=32, S=3, T=(3, 2, 1), norm=norm, gate=gate)
    check_case(case, out_tol=FP32_BAR)


def test_no_norm_means_out_is_o(gen):
    """Without norm_weight, out is the core output o: its scale follows the state, not 1."""
    case = make_case(gen, H=1, HV=2, K=32, V=32, S=2, T=(2, 1), norm="none", state_std=3.0)
    check_case(case, out_tol=FP32_BAR)
    rms = case.out.to(F64).pow(2).mean(-1).sqrt()
    assert not torch.allclose(rms, torch.ones_like(rms), rtol=0.2)


def _run_twice(case, change):
    """Runs `case`, restores the pool, applies change(case), runs again: both (out, pool) pairs."""
    pool0 = case.pool_buffer.clone()
    case.poison_out()
    case.run()
    first = (case.out.clone(), case.pool_buffer.clone())
    case.pool_buffer.copy_(pool0)
    case.poison_out()
    change(case)
    case.run()
    return first, (case.out.clone(), case.pool_buffer.clone())


def test_swish_is_silu(gen):
    case = make_case(gen, H=1, HV=2, K=16, V=16, S=2, T=(2, 2), gate="silu")
    (o1, p1), (o2, p2) = _run_twice(case, lambda c: c.opts.update(gate="swish"))
    assert torch.isfinite(o1).all() and torch.equal(o1, o2) and torch.equal(p1, p2)


@pytest.mark.parametrize(
    "index_dtypes",
    [(I32, I32, I32), (I64, I64, I64), (I64, I32, I64), (I32, I64, I32)],
    ids=["i32", "i64", "idx64_cu32_acc64", "idx32_cu64_acc32"],
)
def test_index_dtypes(gen, index_dtypes):
    case = make_case(gen, H=1, HV=2, K=16, V=32, S=4, T=(4, 0, 2, 3), index_dtypes=index_dtypes)
    check_case(case, out_tol=FP32_BAR)


def test_no_num_accepted_tokens_means_all_one(gen):
    case = make_case(gen, H=1, HV=4, K=32, V=32, S=3, T=(3, 1, 0, 2), use_acc=False)
    assert case.num_accepted_tokens is None
    check_case(case, out_tol=FP32_BAR)
    ones = torch.ones(4, dtype=I64)
    (o1, p1), (o2, p2) = _run_twice(case, lambda c: setattr(c, "num_accepted_tokens", ones))
    assert torch.equal(o1[:6], o2[:6]) and torch.equal(p1, p2)


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("first_valid_slot", [0, 1], ids=["null_is_-1", "vllm_null_is_0"])
def test_null_destinations_skipped(gen, first_valid_slot, layout):
    """Null destination ids (below first_valid_slot; with 1, slot 0 is null and is in the pool)
    skip the write, the output is still produced and the null slot's bytes are unchanged."""
    case = make_case(
        gen,
        H=1,
        HV=2,
        K=32,
        V=16,
        S=5,
        T=(5, 4, 5, 3),
        acc=(2, 1, 5, 3),
        first_valid_slot=first_valid_slot,
        layout=layout,
    )
    null = first_valid_slot - 1
    case.state_indices[0, 0] = null  # first token's state discarded, later ones kept
    case.state_indices[1, 3] = null  # last token's state discarded
    case.state_indices[3, 1] = -7
    ref = check_case(case, out_tol=FP32_BAR)
    assert (0, 0) in ref.states and all(w != (0, 0) for w in ref.written.values())
    if first_valid_slot == 1:
        assert 0 not in ref.written  # slot 0 exists in the pool and was compared bit for bit


@pytest.mark.parametrize("act", [FP32, BF16], ids=["act_fp32", "act_bf16"])
@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["state_fp32", "state_bf16"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_strided_views(gen, layout, state_dtype, act):
    """mixed_qkv a column slice of a wider tensor, a/b halves of one [L, 2HV] tensor, z with padded
    row and head strides, a slot-padded state pool, out an offset view between guard rows."""
    case = make_case(
        gen, H=2, HV=6, K=32, V=32, S=4, T=(4, 1, 0, 3), strided=True, act=act, state_dtype=state_dtype, layout=layout
    )
    assert not case.mixed_qkv.is_contiguous() and case.mixed_qkv.stride(1) == 1
    assert case.a.stride(0) == 2 * 6 and case.b.data_ptr() != case.a.data_ptr()
    assert case.z.stride(1) > 32 and case.state.stride(0) > 6 * 32 * 32
    check_case(case, out_tol=out_bar(act), state_tol=state_bar(state_dtype))


@pytest.mark.parametrize(
    "cfg",
    [
        dict(H=1, HV=3, act=BF16, state_dtype=FP32, layout="vk"),
        dict(H=2, HV=4, act=FP32, state_dtype=FP32, layout="kv"),
        dict(H=1, HV=2, act=BF16, state_dtype=BF16, layout="vk"),
    ],
    ids=["r3_act_bf16", "r2_fp32_kv", "r2_state_bf16"],
)
def test_head_dim_128(gen, cfg):
    act, sd = cfg["act"], cfg["state_dtype"]
    case = make_case(gen, K=128, V=128, S=4, T=(4, 2, 3), **cfg)
    check_case(case, out_tol=out_bar(act), state_tol=state_bar(sd))


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("K,V", [(32, 16), (16, 48)])
def test_key_and_value_dims_differ(gen, K, V, layout):
    case = make_case(gen, H=2, HV=4, K=K, V=V, S=3, T=(3, 2), layout=layout, strided=True)
    check_case(case, out_tol=FP32_BAR)


def test_explicit_scalars(gen):
    case = make_case(gen, H=1, HV=2, K=32, V=32, S=3, T=(3, 1), scale=0.3, l2_eps=1e-3, norm_eps=1e-2)
    check_case(case, out_tol=FP32_BAR)


def test_default_scale_is_inverse_sqrt_K(gen):
    case = make_case(gen, H=1, HV=2, K=64, V=16, S=2, T=(2,))
    (o1, p1), (o2, p2) = _run_twice(case, lambda c: c.opts.update(scale=64**-0.5))
    assert torch.equal(o1, o2) and torch.equal(p1, p2)


@pytest.mark.parametrize("kind", ["softplus_linear_branch", "decay_underflow", "tiny_qk"])
def test_extreme_inputs(gen, kind):
    """a + dt_bias > 20 (softplus threshold), exp(g) underflowing to 0 (state reset) and q/k norms
    comparable to l2_eps."""
    extra = {
        "softplus_linear_branch": dict(a_mean=24.0, A_log_range=(-6.0, -4.0)),
        "decay_underflow": dict(a_mean=6.0, A_log_range=(3.0, 5.0)),
        "tiny_qk": dict(qk_scale=2e-4),
    }[kind]
    case = make_case(gen, H=1, HV=4, K=32, V=32, S=3, T=(3, 2), **extra)
    check_case(case, out_tol=FP32_BAR)


def test_rows_beyond_the_requests(gen):
    """cu_seqlens may start after row 0 and end before L: the covered rows are computed."""
    case = make_case(gen, H=1, HV=2, K=16, V=16, S=3, T=(2, 0, 3), first_row=2, extra_rows=4)
    assert case.out.shape[0] == 2 + 5 + 4
    check_case(case, out_tol=FP32_BAR)


@pytest.mark.parametrize("padded_ids", ["null", "valid"])
def test_only_padded_rows_change_nothing(gen, padded_ids):
    case = make_case(gen, H=1, HV=2, K=16, V=16, S=3, T=(0, 0, 0), extra_rows=2, padded_ids=padded_ids)
    pool = case.pool_buffer.clone()
    case.poison_out()
    case.run()
    assert torch.equal(case.pool_buffer.view(torch.uint8), pool.view(torch.uint8))


def test_empty_call(gen):
    case = make_case(gen, H=1, HV=2, K=16, V=16, S=3, T=())
    assert case.mixed_qkv.shape[0] == 0 and case.state_indices.shape == (0, 3)
    pool = case.pool_buffer.clone()
    case.run()
    assert torch.equal(case.pool_buffer, pool)


def test_inputs_are_not_modified(gen):
    case = make_case(gen, H=2, HV=4, K=32, V=32, S=3, T=(3, 2), act=BF16, strided=True)
    names = (
        "mixed_qkv",
        "a",
        "b",
        "A_log",
        "dt_bias",
        "z",
        "norm_weight",
        "state_indices",
        "cu_seqlens",
        "num_accepted_tokens",
    )
    before = {n: getattr(case, n).clone() for n in names}
    case.run()
    for n in names:
        assert torch.equal(getattr(case, n), before[n]), n


def test_deterministic(gen):
    case = make_case(gen, H=2, HV=8, K=32, V=32, S=4, T=(4, 3, 4, 2))
    (o1, p1), (o2, p2) = _run_twice(case, lambda c: None)
    assert torch.equal(o1, o2) and torch.equal(p1, p2)


def _read_only(x):
    x = x.numpy().view()
    x.flags.writeable = False
    return x


def test_numpy_arrays(gen):
    """gdn.decode_mtp takes any DLPack / buffer arrays: NumPy fp32 and fp16, with the arrays it
    only reads marked read-only."""
    case = make_case(gen, H=1, HV=3, K=16, V=16, S=3, T=(3, 1, 2), strided=True, dtypes=dict(mixed_qkv=FP16, z=FP16))
    ref = case.reference()
    np_args = [_read_only(x) for x in case.args()]
    np_args[5], np_args[8] = case.state.numpy(), case.out.numpy()  # written: stay writable
    kw = {k: (_read_only(v) if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs().items()}
    gdn.decode_mtp(*np_args, **kw)  # NumPy views share memory with the torch tensors
    for row in case.token_rows():
        assert rel_l2(case.out[row], ref.out[row]) <= FP32_BAR
    for slot in ref.written:
        assert rel_l2(case.state[slot], ref.pool[slot]) <= FP32_BAR


# ---- speculative equivalence (decode-mtp.md §6, gdn-math.md §4) -------------------------------


def _one_token_at_a_time(case, i, start):
    """Request i's tokens, one call each (T = 1, S = 1), on a private one-slot pool that starts
    from `start`: [(out row, state after the token)] for every token."""
    pool = start[None].clone()
    cu = int(case.cu_seqlens[i])
    steps = []
    for t in range(case.T[i]):
        row = slice(cu + t, cu + t + 1)
        out = torch.full((1,) + tuple(case.out.shape[1:]), float("nan"), dtype=case.out.dtype)
        gdn.decode_mtp(
            case.mixed_qkv[row],
            case.a[row],
            case.b[row],
            case.A_log,
            case.dt_bias,
            pool,
            torch.zeros(1, 1, dtype=I32),
            torch.tensor([0, 1], dtype=I32),
            out,
            z=None if case.z is None else case.z[row],
            norm_weight=case.norm_weight,
            **case.opts,
        )
        steps.append((out[0].clone(), pool[0].clone()))
    return steps


@pytest.mark.parametrize("act", [FP32, BF16], ids=["act_fp32", "act_bf16"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_multi_token_call_equals_single_token_calls(gen, layout, act):
    """A T-token call equals T calls of one token, bit for bit (fp32 state), for every prefix: the
    state written after token t (the continuing state when t drafts are accepted) and the output."""
    case = make_case(
        gen,
        H=2,
        HV=6,
        K=32,
        V=32,
        S=6,
        T=(6, 3, 5, 1),
        acc=(1, 6, 3, 2),
        layout=layout,
        act=act,
        null_dests=False,
        strided=True,
    )
    starts = [case.state[int(case.state_indices[i, n - 1])].clone() for i, n in enumerate(case.acc)]
    case.run()
    for i in range(len(case.T)):
        for t, (out_row, state) in enumerate(_one_token_at_a_time(case, i, starts[i])):
            assert torch.equal(case.out[int(case.cu_seqlens[i]) + t], out_row), (i, t)
            assert torch.equal(case.state[int(case.state_indices[i, t])], state), (i, t)


def _step_inputs(gen, H, HV, K, V, Ts, act):
    L = sum(Ts)
    D = 2 * H * K + HV * V
    return dict(
        mixed_qkv=torch.randn(L, D, generator=gen).to(act),
        a=torch.randn(L, HV, generator=gen).to(act),
        b=torch.randn(L, HV, generator=gen).to(act),
        z=torch.randn(L, HV, V, generator=gen).to(act),
        cu=torch.tensor([0] + [sum(Ts[: i + 1]) for i in range(len(Ts))], dtype=I32),
    )


@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_chained_steps_with_random_acceptance_equal_sequential_decoding(gen, layout):
    """vLLM-style speculative decoding over several steps: each request owns S slots, verifies T
    tokens, accepts a random prefix, and continues from column n_acc - 1. The accepted stream
    decoded one token per call on a separate pool gives the same outputs and states, bit for bit."""
    H, HV, K, V, S, N, steps = 1, 3, 32, 32, 4, 3, 6
    rng = random.Random(int(torch.randint(0, 2**31, (), generator=gen)))
    spec = make_case(
        gen, H=H, HV=HV, K=K, V=V, S=S, T=(1,) * N + (0,), acc=(1,) * (N + 1), layout=layout, null_dests=False
    )
    idx = spec.state_indices
    # Sequential pool: request i keeps its state in one slot, starting equal to the spec start.
    seq_pool = torch.empty((N,) + tuple(spec.state.shape[1:]), dtype=spec.state.dtype)
    for i in range(N):
        seq_pool[i] = spec.state[int(idx[i, 0])]
    acc = [1] * (N + 1)
    common = dict(norm_weight=spec.norm_weight, gate="silu", state_layout=layout)
    for _ in range(steps):
        Ts = [rng.randint(1, S) for _ in range(N)] + [0]
        x = _step_inputs(gen, H, HV, K, V, Ts, FP32)
        out = torch.full((x["mixed_qkv"].shape[0], HV, V), float("nan"))
        gdn.decode_mtp(
            x["mixed_qkv"],
            x["a"],
            x["b"],
            spec.A_log,
            spec.dt_bias,
            spec.state,
            idx,
            x["cu"],
            out,
            z=x["z"],
            num_accepted_tokens=torch.tensor(acc, dtype=I32),
            **common,
        )
        for i in range(N):
            n_acc = rng.randint(1, Ts[i])  # tokens kept: the bonus token and n_acc - 1 drafts
            for t in range(n_acc):
                row = slice(int(x["cu"][i]) + t, int(x["cu"][i]) + t + 1)
                o1 = torch.full((1, HV, V), float("nan"))
                gdn.decode_mtp(
                    x["mixed_qkv"][row],
                    x["a"][row],
                    x["b"][row],
                    spec.A_log,
                    spec.dt_bias,
                    seq_pool,
                    torch.tensor([[i]], dtype=I32),
                    torch.tensor([0, 1], dtype=I32),
                    o1,
                    z=x["z"][row],
                    **common,
                )
                assert torch.equal(o1[0], out[row][0]), (i, t)
            assert torch.equal(spec.state[int(idx[i, n_acc - 1])], seq_pool[i]), i
            acc[i] = n_acc


@pytest.mark.parametrize(
    "state_dtype,layout,K",
    [
        (FP32, "vk", 32),
        (FP32, "kv", 32),
        (BF16, "vk", 32),
        (BF16, "kv", 32),
        (FP16, "vk", 32),
        (FP16, "kv", 32),
        (BF16, "vk", 128),
        (FP16, "kv", 128),
    ],
    ids=["fp32-vk", "fp32-kv", "bf16-vk", "bf16-kv", "fp16-vk", "fp16-kv", "bf16-vk-128", "fp16-kv-128"],
)
def test_three_chained_steps_against_float64(gen, state_dtype, layout, K):
    """Three verify steps with random acceptance, the library storing its state in `state_dtype`,
    the reference keeping float64 throughout: every state written in the last step within the
    bar."""
    H, HV, V, S, N = 1, 4 if K < 128 else 2, K, 4, 3
    rng = random.Random(int(torch.randint(0, 2**31, (), generator=gen)))
    case = make_case(
        gen,
        H=H,
        HV=HV,
        K=K,
        V=V,
        S=S,
        T=(1,) * N,
        acc=(1,) * N,
        state_dtype=state_dtype,
        layout=layout,
        null_dests=False,
    )
    ref_pool = case.state.to(F64)
    acc = [1] * N
    for step in range(3):
        Ts = [S] * N
        x = _step_inputs(gen, H, HV, K, V, Ts, FP32)
        out = torch.full((x["mixed_qkv"].shape[0], HV, V), float("nan"))
        kw = dict(
            z=x["z"],
            norm_weight=case.norm_weight,
            num_accepted_tokens=torch.tensor(acc, dtype=I32),
            state_layout=layout,
        )
        args = (x["mixed_qkv"], x["a"], x["b"], case.A_log, case.dt_bias)
        ref = decode_mtp_ref(*args, ref_pool, case.state_indices, x["cu"], **kw)
        gdn.decode_mtp(*args, case.state, case.state_indices, x["cu"], out, **kw)
        ref_pool = ref.pool
        acc = [rng.randint(1, S) for _ in range(N)]
    for slot in ref.written:
        err = rel_l2(case.state[slot], ref_pool[slot])
        assert err <= state_bar(state_dtype), f"slot {slot}: rel L2 {err:.3g}"
    assert rel_l2(out, ref.out) <= state_bar(state_dtype)


def test_long_decode_drift_fp32_state(gen):
    """256 chained plain-decode steps (T = 1) with slow decay: the fp32 state stays within ~1e-5
    of a float64 state carried through the same steps."""
    H, HV, K, V, N, steps = 1, 2, 16, 16, 2, 256
    case = make_case(
        gen, H=H, HV=HV, K=K, V=V, S=1, T=(1,) * N, acc=(1,) * N, norm="w", A_log_range=(-5.0, -3.0), null_dests=False
    )
    ref_pool = case.state.to(F64)
    worst = 0.0
    for step in range(steps):
        x = _step_inputs(gen, H, HV, K, V, [1] * N, FP32)
        out = torch.full((N, HV, V), float("nan"))
        args = (x["mixed_qkv"], x["a"], x["b"], case.A_log, case.dt_bias)
        ref = decode_mtp_ref(*args, ref_pool, case.state_indices, x["cu"], norm_weight=case.norm_weight)
        gdn.decode_mtp(*args, case.state, case.state_indices, x["cu"], out, norm_weight=case.norm_weight)
        ref_pool = ref.pool
        worst = max(worst, rel_l2(out, ref.out))
    for slot in ref.written:
        err = rel_l2(case.state[slot], ref_pool[slot])
        assert err <= FP32_BAR, f"slot {slot} after {steps} steps: rel L2 {err:.3g}"
    assert worst <= FP32_BAR
