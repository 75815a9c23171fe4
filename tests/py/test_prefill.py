"""gdn.prefill and torch.ops.gdn.prefill against the float64 token-by-token reference
(gdn.reference.prefill_reference) over block edges, head ratios, state dtypes and layouts, null and
in-place slots, checkpoints, padded rows and strided inputs; bit for bit against one-token
gdn.decode_mtp calls with an fp32 pool; refused rows and arguments writing nothing; the op equals
the function; CUDA against the CPU and the reference (skips without a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

import gdn
from gdn.reference import prefill_reference

torch = pytest.importorskip("torch")

from reference_torch import cuda_skip_reason  # noqa: E402 (needs torch)

# Why the CUDA tests cannot run here ("no GPU ...", a build without CUDA kernels, no kernel image
# for the device), or None.
_CUDA_REASON = cuda_skip_reason()
needs_cuda = pytest.mark.skipif(_CUDA_REASON is not None, reason=f"CUDA prefill: {_CUDA_REASON}")
I32 = torch.int32

EDGES = (1, 63, 0, 64, 65, 127, 128, 129)  # around the 64-token blocks; row 2 padded


def make_case(
    gen,
    *,
    H=1,
    ratio=2,
    K=16,
    V=32,
    T=EDGES,
    act=torch.float32,
    state_dtype=torch.float32,
    layout="vk",
    slots=24,
    null_initial=(0,),
    strided=False,
    device="cpu",
):
    """Inputs of one call: N = len(T) requests, distinct initial and final slots (requests listed in
    `null_initial` start from a null id, -1)."""
    HV = ratio * H
    N, L = len(T), int(sum(T))
    width = 2 * H * K + HV * V
    pad = 7 if strided else 0
    qkv = torch.randn(L, width + pad, generator=gen).to(act)[:, pad:]
    ba = torch.randn(L, 2 * HV, generator=gen).to(act)  # a and b: the two halves of one tensor
    shape = (slots, HV, V, K) if layout == "vk" else (slots, HV, K, V)
    perm = torch.randperm(slots, generator=gen).to(I32)
    initial = perm[:N].clone()
    for i in null_initial:
        initial[i] = -1
    final = perm[N : 2 * N].clone()
    if strided:  # columns of [N, 2] tables
        initial = torch.stack([initial, final], 1)[:, 0]
        final = torch.stack([initial.clone(), final], 1)[:, 1]
    c = dict(
        mixed_qkv=qkv,
        a=ba[:, :HV],
        b=ba[:, HV:],
        A_log=torch.empty(HV).uniform_(-2.0, 0.5, generator=gen),
        dt_bias=0.5 * torch.randn(HV, generator=gen),
        state=(0.3 * torch.randn(*shape, generator=gen)).to(state_dtype),
        initial_state_indices=initial,
        final_state_indices=final,
        cu_seqlens=torch.tensor([0] + list(np.cumsum(T)), dtype=I32),
        out=torch.full((L, HV, V), float("nan"), dtype=act),
        z=torch.randn(L, HV, V, generator=gen).to(act),
        norm_weight=1.0 + 0.1 * torch.randn(V, generator=gen),
    )
    return {k: v.to(device) for k, v in c.items()}


POSITIONAL = (
    "mixed_qkv",
    "a",
    "b",
    "A_log",
    "dt_bias",
    "state",
    "initial_state_indices",
    "final_state_indices",
    "cu_seqlens",
    "out",
)


def run(c, fn=None, **kw):
    fn = gdn.prefill if fn is None else fn
    fn(*(c[n] for n in POSITIONAL), z=c["z"], norm_weight=c["norm_weight"], **kw)


def reference(c, **kw):
    cpu = {k: (v.cpu().double() if v.is_floating_point() else v.cpu()).numpy() for k, v in c.items()}
    return prefill_reference(*(cpu[n] for n in POSITIONAL[:9]), z=cpu["z"], norm_weight=cpu["norm_weight"], **kw)


def rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-20)


def check(c, before, ref, *, out_tol, state_tol):
    """Outputs within `out_tol` relative L2 (rows of no request untouched, NaN); every slot the
    reference writes within `state_tol`; every other slot unchanged, bit for bit."""
    ref_out, ref_pool = ref
    got = c["out"].double().cpu().numpy()
    rows = ~np.isnan(ref_out).all(axis=(1, 2))
    assert np.isnan(got[~rows]).all(), "a row of no request was written"
    assert rel_l2(got[rows], ref_out[rows]) <= out_tol
    pool = c["state"].double().cpu().numpy()
    written = [s for s in range(pool.shape[0]) if not np.array_equal(ref_pool[s], before[s])]
    for s in range(pool.shape[0]):
        if s in written:
            assert rel_l2(pool[s], ref_pool[s]) <= state_tol, f"slot {s}"
        else:
            assert np.array_equal(pool[s], before[s]), f"slot {s} is not the call's to write but changed"
    return written


BARS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 4e-3}
# Relative L2 bar of the CUDA path (bf16 tensor-core operands, fp32 accumulation and state).
CUDA_BAR = 2e-2


@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_matches_reference_over_block_edges(gen, layout, state_dtype, ratio):
    act = torch.bfloat16 if state_dtype == torch.bfloat16 else torch.float32
    c = make_case(gen, ratio=ratio, act=act, state_dtype=state_dtype, layout=layout)
    before = c["state"].double().numpy().copy()
    ref = reference(c, state_layout=layout)
    run(c, state_layout=layout)
    written = check(c, before, ref, out_tol=max(BARS[act], BARS[state_dtype]), state_tol=BARS[state_dtype])
    assert len(written) == len(EDGES) - 1  # every final slot but the padded row's


def test_long_request(gen):
    c = make_case(gen, T=(1000, 3), null_initial=())
    before = c["state"].double().numpy().copy()
    ref = reference(c)
    run(c)
    check(c, before, ref, out_tol=1e-4, state_tol=1e-4)


def test_checkpoints(gen):
    c = make_case(gen, T=(130, 64, 20, 0))
    c["initial_state_indices"] = torch.tensor([0, -1, 1, 2], dtype=I32)
    c["final_state_indices"] = torch.tensor([3, 4, 5, 6], dtype=I32)
    ckpt = torch.tensor([[10, -1, 11], [12, 13, -1], [14, 15, 16], [17, 18, 19]], dtype=I32).t().contiguous().t()
    assert ckpt.stride() != (3, 1)  # column-major: any strides
    kw = dict(checkpoint_indices=ckpt, checkpoint_every=64)
    before = c["state"].double().numpy().copy()
    ref = reference(c, **kw)
    run(c, **kw)
    written = check(c, before, ref, out_tol=1e-5, state_tol=1e-5)
    # Request 0 crosses two boundaries (after tokens 63 and 127: slot 10, then a null id), request
    # 1 one (slot 12), request 2 none; the padded request 3 writes nothing.
    assert written == [3, 4, 5, 10, 12]


def test_in_place_slots_padded_rows_and_strided_inputs(gen):
    c = make_case(gen, T=(5, 0, 70, 2), strided=True, null_initial=(3,), act=torch.bfloat16)
    c["final_state_indices"][0] = c["initial_state_indices"][0]  # in place
    assert c["mixed_qkv"].stride(0) != c["mixed_qkv"].shape[1] and c["a"].stride(0) == 2 * c["a"].shape[1]
    before = c["state"].double().numpy().copy()
    ref = reference(c)
    run(c)
    check(c, before, ref, out_tol=4e-3, state_tol=1e-5)


def test_equals_token_by_token_decode_mtp_bit_for_bit(gen):
    """CPU, fp32 pool: a prefill equals one-token decode_mtp calls (outputs, checkpoints, final)."""
    c = make_case(gen, T=(3, 130, 0, 65), null_initial=())
    ckpt = torch.tensor([[-1, -1], [20, 21], [-1, -1], [22, -1]], dtype=I32)
    pool = c["state"].clone()
    run(c, checkpoint_indices=ckpt, checkpoint_every=64)
    cu = c["cu_seqlens"].tolist()
    one = torch.tensor([0, 1], dtype=I32)
    for i in range(len(cu) - 1):
        if cu[i + 1] == cu[i]:
            continue
        slot = int(c["final_state_indices"][i])
        pool[slot] = pool[int(c["initial_state_indices"][i])]
        for t in range(cu[i], cu[i + 1]):
            o = torch.full((1,) + c["out"].shape[1:], float("nan"))
            rows = {n: c[n][t : t + 1] for n in ("mixed_qkv", "a", "b", "z")}
            gdn.decode_mtp(
                rows["mixed_qkv"], rows["a"], rows["b"], c["A_log"], c["dt_bias"], pool,
                torch.tensor([[slot]], dtype=I32), one, o, z=rows["z"], norm_weight=c["norm_weight"],
            )  # fmt: skip
            assert torch.equal(o[0], c["out"][t]), f"request {i} token {t - cu[i]}"
            done = t - cu[i] + 1
            if done % 64 == 0 and int(ckpt[i, done // 64 - 1]) >= 0:
                assert torch.equal(c["state"][int(ckpt[i, done // 64 - 1])], pool[slot])
        assert torch.equal(c["state"][slot], pool[slot]), f"request {i} final state"


def test_op_equals_function_and_opcheck(gen):
    c = make_case(gen, T=(3, 70, 0), ratio=2)
    d = {k: v.clone() for k, v in c.items()}
    run(c)
    run(d, fn=torch.ops.gdn.prefill)
    assert torch.equal(c["out"], d["out"]) and torch.equal(c["state"], d["state"])
    for kw in ({}, {"error_count": torch.zeros(1, dtype=I32)}):
        result = torch.library.opcheck(
            torch.ops.gdn.prefill.default,
            tuple(c[n] for n in POSITIONAL),
            dict(z=c["z"], norm_weight=c["norm_weight"], **kw),
        )
        assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize(
    "spoil,kw,message",
    [
        (lambda c: c["final_state_indices"].__setitem__(1, 24), {}, r"request row 1: final_state_indices\[1\] = 24"),
        (
            lambda c: c["initial_state_indices"].__setitem__(2, 50),
            {},
            r"request row 2: initial_state_indices\[2\] = 50",
        ),
        (lambda c: c["cu_seqlens"].__setitem__(2, 1), {}, r"request row 1: cu_seqlens\[1..\]"),
        (
            None,
            dict(checkpoint_indices=torch.full((3, 1), 5, dtype=I32), checkpoint_every=64),
            "request row 1: its 130",
        ),
        (
            None,
            dict(checkpoint_indices=torch.full((3, 2), 5, dtype=I32), checkpoint_every=32),
            "^checkpoint_every = 32",
        ),
        (None, dict(checkpoint_every=64), "^checkpoint_every = 64 needs checkpoint_indices"),
        (lambda c: c.update(final_state_indices=c["final_state_indices"][:2]), {}, "^final_state_indices dimension 0"),
        (lambda c: c.update(A_log=c["A_log"][:1]), {}, "^A_log dimension 0"),
    ],
    ids=["final", "initial", "cu", "checkpoints", "every", "every-alone", "shape", "A_log"],
)
@pytest.mark.parametrize("op", [False, True], ids=["function", "op"])
def test_errors_name_row_or_argument_before_writing(gen, spoil, kw, message, op):
    c = make_case(gen, T=(3, 130, 4))
    if spoil:
        spoil(c)
    before, out_before = c["state"].clone(), c["out"].clone()
    with pytest.raises(ValueError, match=message):
        run(c, fn=torch.ops.gdn.prefill if op else None, **kw)
    assert torch.equal(c["state"], before) and torch.equal(c["out"].isnan(), out_before.isnan())


def test_wrong_python_type_names_the_argument(gen):
    c = make_case(gen, T=(3, 2))
    c["cu_seqlens"] = c["cu_seqlens"].tolist()
    with pytest.raises(TypeError, match=r"^gdn\.prefill: cu_seqlens must be .*a list of 3 items"):
        run(c)


# ---- CUDA ----------------------------------------------------------------------------------------


def test_cuda_tests_skip_saying_why():
    """The CUDA tests run exactly where reference_torch.cuda_skip_reason() finds nothing missing,
    and otherwise skip with its reason ("no GPU ..." on a machine without one)."""
    reason = cuda_skip_reason()
    assert needs_cuda.args == (reason is not None,)
    assert needs_cuda.kwargs["reason"] == f"CUDA prefill: {reason}"


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_cuda_matches_cpu_and_reference(gen, layout, state_dtype, ratio):
    """The CUDA head dim (K = V = 128), block edges and a long request, with checkpoints."""
    T = EDGES + (700,)
    slots = 128
    c = make_case(gen, H=2, ratio=ratio, K=128, V=128, T=T, state_dtype=state_dtype, layout=layout, slots=slots)
    d = {k: v.cuda() for k, v in c.items()}
    # Checkpoint slots distinct from each other and from every initial and final slot: two requests
    # writing one slot in the same call would leave it to whichever CTA stores last.
    free = sorted(set(range(slots)) - set(c["initial_state_indices"].tolist()) - set(c["final_state_indices"].tolist()))
    ckpt = torch.tensor(free[: len(T) * 11], dtype=I32).reshape(len(T), 11)
    ckpt[:, ::3] = -1
    kw = dict(state_layout=layout, checkpoint_indices=ckpt, checkpoint_every=64)
    before = c["state"].double().numpy().copy()
    ref = reference(c, **kw)
    run(c, **kw)
    run(d, **dict(kw, checkpoint_indices=ckpt.cuda()))
    torch.cuda.synchronize()
    # The CUDA chunk engine multiplies bf16 operands with fp32 accumulation: held to CUDA_BAR.
    tol = max(BARS[state_dtype], CUDA_BAR)
    assert rel_l2(d["out"].double().cpu(), c["out"].double()) <= tol
    assert rel_l2(d["state"].double().cpu(), c["state"].double()) <= tol
    check({k: v.cpu() for k, v in d.items()}, before, ref, out_tol=tol, state_tol=tol)


@pytest.mark.gpu
@needs_cuda
def test_cuda_invalid_rows_zeroed_and_counted(gen):
    c = make_case(gen, H=1, ratio=2, K=128, V=128, T=(3, 70, 4), device="cuda")
    c["final_state_indices"][1] = 1 << 30
    errors = torch.zeros(1, dtype=I32, device="cuda")
    before = c["state"].clone()
    run(c, error_count=errors)
    torch.cuda.synchronize()
    assert int(errors) == 1
    assert torch.equal(c["out"][3:73], torch.zeros_like(c["out"][3:73]))
    assert not torch.isnan(c["out"]).any()
    keep = [s for s in range(24) if s not in (int(c["final_state_indices"][0]), int(c["final_state_indices"][2]))]
    assert torch.equal(c["state"][keep], before[keep])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("form", ["recurrence", "fused"])
def test_cuda_op_equals_function_eager_and_in_a_graph(gen, form):
    """torch.ops.gdn.prefill, eager and replayed from a CUDA graph, equals gdn.prefill bit for bit
    in both kinds of launch: few heads (the chunk kernel's forms: the op allocates their workspace
    from torch's allocator, inside the graph's pool when captured) and more than half the SMs' worth
    of heads in requests of 512 tokens or more (the fused kernel: no workspace at all); both near
    the CPU path."""
    props = torch.cuda.get_device_properties(0)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # not in every torch
    fits = optin >= 171 * 1024 if optin is not None else props.major in (9, 10)
    if form == "fused" and not fits:
        pytest.skip("the fused form needs about 171 KB of shared memory per CTA (Hopper)")
    sms = props.multi_processor_count
    HV = 8
    N = 1 if form == "recurrence" else sms // (2 * HV) + 1  # 2 N HV <= SMs takes the recurrence
    T = 70 if form == "recurrence" else 520
    c = make_case(gen, H=2, ratio=4, K=128, V=128, T=(T,) * N, act=torch.bfloat16, slots=2 * N + 2)
    cpu = {k: v.clone() for k, v in c.items()}
    fn, op, warm, graphed = ({k: v.cuda() for k, v in c.items()} for _ in range(4))
    run(fn)
    run(op, fn=torch.ops.gdn.prefill)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(warm, fn=torch.ops.gdn.prefill)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(graphed, fn=torch.ops.gdn.prefill)
    graph.replay()
    torch.cuda.synchronize()
    for other in (op, graphed):
        assert torch.equal(other["out"], fn["out"]) and torch.equal(other["state"], fn["state"])
    run(cpu)
    assert rel_l2(fn["out"].double().cpu(), cpu["out"].double()) <= CUDA_BAR
    assert rel_l2(fn["state"].double().cpu(), cpu["state"].double()) <= CUDA_BAR
