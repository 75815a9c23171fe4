"""gdn.decode_mtp on CUDA against the tests' float64 reference and against the CPU path.

Cases are built on the CPU (reference_torch.make_case), mapped to the GPU with every view, stride
and shared buffer preserved, run with `out` poisoned, and mapped back for the comparisons of
reference_torch (every written slot per token, every other byte of the pool untouched, nothing
outside `out` written). The indices live on the GPU, so invalid rows follow the device rules of
decode-mtp.md §4 (no state write, zero output rows, error counter). K = V = 128 (the CUDA kernel's
head dim); the grid covers every axis and the important pairs, not the cartesian product.
"""

from __future__ import annotations

import dataclasses
import functools
import random

import pytest
import torch

import gdn
from reference_torch import (
    BF16,
    F64,
    FP16,
    FP32,
    FP32_BAR,
    MIXED_DTYPE_IDS,
    MIXED_DTYPES,
    OUT16_BAR,
    STATE16_BAR,
    _compare,
    cuda_skip_reason,
    decode_mtp_ref,
    make_case,
    out_bar,
    rel_l2,
    state_bar,
)

I32, I64 = torch.int32, torch.int64


_REASON = cuda_skip_reason()
requires_cuda = pytest.mark.skipif(_REASON is not None, reason=f"CUDA decode_mtp: {_REASON}")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")


# ---- moving cases between devices, views and shared buffers intact ---------------------------------


def map_case(case, device):
    """A copy of `case` on `device`: every tensor is a view of a copy of its own storage, so strides,
    offsets and buffers shared between arguments (a/b halves, state in its pool) are preserved."""
    storages = {}

    def move(x):
        if x is None:
            return None
        key = x.untyped_storage().data_ptr()
        if key not in storages:
            raw = torch.empty(0, dtype=torch.uint8, device=x.device).set_(x.untyped_storage())
            storages[key] = raw.to(device, copy=True)
        return torch.empty(0, dtype=x.dtype, device=device).set_(
            storages[key].untyped_storage(), x.storage_offset(), x.size(), x.stride()
        )

    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}
    moved = {k: move(v) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    moved["opts"] = dict(case.opts)
    return dataclasses.replace(case, **moved)


def run_cuda(case, fn=None, **extra):
    """Runs `case` on the GPU (out poisoned) and copies pool and out back into `case`."""
    dev = map_case(case, "cuda")
    dev.poison_out()
    dev.run(fn, **extra)
    torch.cuda.synchronize()
    case.pool_buffer.copy_(dev.pool_buffer.cpu())
    case.out_buffer.copy_(dev.out_buffer.cpu())
    return dev


def check_cuda(case, *, out_tol, state_tol=FP32_BAR, against_cpu=True, fn=None):
    """CUDA vs the float64 reference (reference_torch rules) and vs the CPU path."""
    cpu = map_case(case, "cpu") if against_cpu else None
    ref = case.reference()
    before = case.pool_buffer.clone()
    run_cuda(case, fn)
    _compare(case, ref, before, out_tol=out_tol, state_tol=state_tol)
    if cpu is not None:
        cpu.poison_out()
        cpu.run()
        rows = case.token_rows()
        if rows:
            err = rel_l2(case.out[rows], cpu.out[rows])
            assert err <= out_tol, f"CUDA vs CPU out: rel L2 {err:.3g}"
        for slot in ref.written:
            err = rel_l2(case.state[slot], cpu.state[slot])
            assert err <= state_tol, f"CUDA vs CPU state of slot {slot}: rel L2 {err:.3g}"
    return ref


def case128(gen, **kw):
    kw.setdefault("K", 128)
    kw.setdefault("V", 128)
    return make_case(gen, **kw)


# ---- the grid ------------------------------------------------------------------------------------

RATIOS = [(2, 2), (2, 4), (1, 3), (1, 4), (1, 8), (1, 5), (1, 6)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("state_dtype", [FP32, BF16, FP16], ids=["state_fp32", "state_bf16", "state_fp16"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("H,HV", RATIOS, ids=[f"r{hv // h}" for h, hv in RATIOS])
def test_head_ratios(gen, H, HV, layout, state_dtype):
    act = [FP32, BF16, FP16][(HV // H + (layout == "kv")) % 3]
    case = case128(gen, H=H, HV=HV, S=4, T=(1, 4, 0, 3, 2), layout=layout, act=act, state_dtype=state_dtype)
    ref = check_cuda(case, out_tol=out_bar(act), state_tol=state_bar(state_dtype))
    assert len(ref.written) >= 3  # a real workload: several slots written


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("act", [FP32, BF16, FP16], ids=["act_fp32", "act_bf16", "act_fp16"])
@pytest.mark.parametrize("state_dtype", [FP32, BF16, FP16], ids=["state_fp32", "state_bf16", "state_fp16"])
def test_state_and_activation_dtypes(gen, state_dtype, act):
    case = case128(gen, H=2, HV=4, S=3, T=(3, 1, 2, 0, 3), act=act, state_dtype=state_dtype)
    check_cuda(case, out_tol=out_bar(act), state_tol=state_bar(state_dtype))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtypes", MIXED_DTYPES, ids=MIXED_DTYPE_IDS)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_mixed_dtypes(gen, dtypes, strided):
    case = case128(gen, H=1, HV=3, S=4, T=(2, 4, 1), dtypes=dtypes, strided=strided)
    check_cuda(case, out_tol=out_bar(dtypes["out"]))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("first_valid_slot", [0, 1])
@pytest.mark.parametrize("S", [1, 2, 5, 9, 16])
def test_every_T_and_every_acc(gen, S, first_valid_slot):
    """One request per (T, acc) pair, T in 0..S, acc in 1..S (S = 16: a sample of the pairs)."""
    pairs = [(t, n) for t in range(S + 1) for n in range(1, S + 1)]
    random.Random(S).shuffle(pairs)
    if S > 9:
        pairs = pairs[:12] + [(S, S), (S, 1)]
    case = case128(
        gen,
        H=1,
        HV=1 if S > 5 else 2,
        S=S,
        T=[t for t, _ in pairs],
        acc=[n for _, n in pairs],
        first_valid_slot=first_valid_slot,
        padded_ids="valid" if first_valid_slot else "null",
        layout="kv" if S % 2 else "vk",
    )
    check_cuda(case, out_tol=FP32_BAR, against_cpu=S <= 5)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("gate", ["silu", "sigmoid"])
@pytest.mark.parametrize("norm", ["zw", "w", "none"], ids=["z_and_norm_weight", "norm_weight_only", "no_norm"])
def test_norm_and_gate(gen, norm, gate):
    case = case128(gen, H=2, HV=6, S=3, T=(3, 2, 1), norm=norm, gate=gate)
    check_cuda(case, out_tol=FP32_BAR)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_source_slot_is_also_token_0_destination(gen, layout):
    case = case128(gen, H=1, HV=2, S=4, T=(4, 2), acc=(3, 1), layout=layout, null_dests=False)
    case.state_indices[0, 0] = case.state_indices[0, 2]
    ref = check_cuda(case, out_tol=FP32_BAR)
    assert ref.written[int(case.state_indices[0, 2])] == (0, 2)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("first_valid_slot", [0, 1], ids=["null_is_-1", "vllm_null_is_0"])
def test_null_destinations_skipped(gen, first_valid_slot, layout):
    case = case128(
        gen, H=1, HV=2, S=5, T=(5, 4, 5, 3), acc=(2, 1, 5, 3), first_valid_slot=first_valid_slot, layout=layout
    )
    null = first_valid_slot - 1
    case.state_indices[0, 0] = null
    case.state_indices[1, 3] = null
    case.state_indices[3, 1] = -7
    ref = check_cuda(case, out_tol=FP32_BAR)
    assert all(w != (0, 0) for w in ref.written.values())


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("act", [FP32, BF16], ids=["act_fp32", "act_bf16"])
@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["state_fp32", "state_bf16"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_strided_views(gen, layout, state_dtype, act):
    """Column-sliced mixed_qkv (misaligned), a/b halves of one tensor, z with padded strides, a
    slot-padded pool (slot stride not a multiple of 4), out between guard rows."""
    case = case128(gen, H=2, HV=6, S=4, T=(4, 1, 0, 3), strided=True, act=act, state_dtype=state_dtype, layout=layout)
    assert case.state.stride(0) % 4 != 0
    check_cuda(case, out_tol=out_bar(act), state_tol=state_bar(state_dtype))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["state_fp32", "state_bf16"])
@pytest.mark.parametrize("layout", ["vk", "kv"])
def test_padded_but_aligned_pool(gen, layout, state_dtype):
    """A paged pool whose slot stride exceeds one slot but keeps 16-byte slots: the vector path
    of either layout (bulk copies and row stores for "vk", 16-byte loads and column stores for
    "kv")."""
    case = case128(gen, H=1, HV=4, S=3, T=(3, 2, 1), act=BF16, layout=layout, state_dtype=state_dtype)
    slots, elems = case.pool_buffer.shape
    bigger = torch.randn(slots, elems + 64, dtype=F64).to(case.pool_buffer.dtype)
    bigger[:, :elems] = case.pool_buffer
    case.pool_buffer = bigger
    case.state = bigger[:, :elems].view(case.state.shape)
    check_cuda(case, out_tol=OUT16_BAR, state_tol=state_bar(state_dtype))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize(
    "index_dtypes", [(I32, I32, I32), (I64, I64, I64), (I64, I32, I64)], ids=["i32", "i64", "idx64_cu32_acc64"]
)
def test_index_dtypes(gen, index_dtypes):
    case = case128(gen, H=1, HV=2, S=4, T=(4, 0, 2, 3), index_dtypes=index_dtypes)
    check_cuda(case, out_tol=FP32_BAR)


@pytest.mark.gpu
@requires_cuda
def test_no_num_accepted_tokens_means_all_one(gen):
    case = case128(gen, H=1, HV=4, S=3, T=(3, 1, 0, 2), use_acc=False)
    check_cuda(case, out_tol=FP32_BAR)


@pytest.mark.gpu
@requires_cuda
def test_many_requests_fill_the_gpu(gen):
    """More (request, head) pairs than SMs: the unsplit launch."""
    T = [int(t) for t in torch.randint(0, 4, (40,), generator=gen)]
    case = case128(gen, H=2, HV=8, S=3, T=T, act=BF16)
    check_cuda(case, out_tol=OUT16_BAR, against_cpu=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("split", [1, 2, 4, 8])
def test_every_split_gives_the_same_bits(gen, split):
    """Rows of a head spread over 1..8 CTAs (a cluster on sm_90): bit-identical results."""
    if split != 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("head splitting needs thread-block clusters (sm_90+)")
    case = case128(gen, H=1, HV=2, S=4, T=(4, 2, 3), state_dtype=FP32)
    base = map_case(case, "cpu")

    def pinned(n):
        stream = torch.cuda.current_stream().cuda_stream
        return functools.partial(gdn._C.decode_mtp, split=n, stream=stream)

    run_cuda(base, pinned(1))
    run_cuda(case, pinned(split))
    assert torch.equal(case.out_buffer.view(torch.uint8), base.out_buffer.view(torch.uint8))
    assert torch.equal(case.pool_buffer.view(torch.uint8), base.pool_buffer.view(torch.uint8))


# ---- speculative equivalence and chained steps ---------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["state_fp32", "state_bf16"])
def test_spec_equals_sequential(gen, state_dtype):
    """T tokens in one call, n accepted == the same n tokens one call each (T = 1): bit for bit
    with an fp32 state; with a 16-bit state the one-call path keeps fp32 between tokens, so it is
    compared to the rounding bar instead."""
    S, n_acc = 4, 3
    case = case128(gen, H=2, HV=4, S=S, T=(S, S), acc=(1, 1), null_dests=False, state_dtype=state_dtype, act=BF16)
    seq = map_case(case, "cpu")
    run_cuda(case)
    for i in range(2):
        src = int(seq.state_indices[i, 0])
        work = int(seq.state_indices[i, S - 1])  # a slot of this request nobody reads first
        seq.state[work].copy_(seq.state[src])
        for t in range(n_acc):
            row = int(seq.cu_seqlens[i]) + t
            one = dataclasses.replace(
                seq,
                mixed_qkv=seq.mixed_qkv[row : row + 1],
                a=seq.a[row : row + 1],
                b=seq.b[row : row + 1],
                z=seq.z[row : row + 1],
                out=seq.out[row : row + 1],
                out_buffer=seq.out[row : row + 1],
                state_indices=torch.tensor([[work]], dtype=seq.state_indices.dtype),
                cu_seqlens=torch.tensor([0, 1], dtype=seq.cu_seqlens.dtype),
                num_accepted_tokens=None,
            )
            run_cuda(one)
            got, want = case.out[row], seq.out[row]
            spec_state = case.state[int(case.state_indices[i, t])]
            if state_dtype == FP32:
                assert torch.equal(got, want), f"request {i} token {t}: outputs differ"
                assert torch.equal(spec_state, seq.state[work]), f"request {i} token {t}: states"
            else:
                assert rel_l2(got, want) <= OUT16_BAR
                assert rel_l2(spec_state, seq.state[work]) <= STATE16_BAR


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("state_dtype", [FP32, BF16, FP16], ids=["state_fp32", "state_bf16", "state_fp16"])
def test_chained_steps(gen, state_dtype):
    """Three verify steps, each reading the slot of the previous step's last accepted token; the
    reference carries its own float64 state (no rounding), the bars of decode-mtp.md §6."""
    S = 4
    case = case128(gen, H=1, HV=4, S=S, T=(S, 2, 3), acc=(1, 1, 1), null_dests=False, state_dtype=state_dtype, act=BF16)
    pool64 = case.state.to(F64).clone()
    dev = map_case(case, "cuda")
    for step, acc in enumerate([(1, 1, 1), (3, 2, 1), (4, 1, 3)]):
        dev.num_accepted_tokens.copy_(torch.tensor(acc, dtype=dev.num_accepted_tokens.dtype))
        fresh = case128(gen, H=1, HV=4, S=S, T=(S, 2, 3), acc=acc, act=BF16)
        for name in ("mixed_qkv", "a", "b", "z"):
            getattr(dev, name).copy_(getattr(fresh, name).to("cuda"))
        host = dataclasses.replace(map_case(dev, "cpu"), state=pool64)
        ref = decode_mtp_ref(*host.args()[:8], **host.kwargs())
        dev.poison_out()
        dev.run()
        torch.cuda.synchronize()
        rows = host.token_rows()
        assert rel_l2(dev.out.cpu()[rows], ref.out[rows]) <= OUT16_BAR, f"step {step}"
        bar = FP32_BAR if state_dtype == FP32 else STATE16_BAR
        for slot in ref.written:
            err = rel_l2(dev.state[slot].cpu(), ref.pool[slot])
            assert err <= bar * (step + 1 if state_dtype == FP32 else 1), (step, slot, err)
        pool64 = ref.pool


# ---- hostile indices on the device ---------------------------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("index_dtype", [I32, I64])
def test_hostile_indices_touch_nothing_else(gen, index_dtype):
    """Invalid rows: no state written, their output rows zero, one error count each; valid rows
    exact; the whole pool outside the valid rows' destination slots unchanged, bit for bit."""
    S, T = 3, 2
    N = 8
    case = case128(
        gen,
        H=1,
        HV=2,
        S=S,
        T=(T,) * N,
        acc=(1,) * N,
        null_dests=False,
        index_dtypes=(index_dtype,) * 3,
        spare_slots=4,
        act=BF16,
        extra_rows=2,
    )
    idx = case.state_indices.clone()
    acc = case.num_accepted_tokens.clone()
    cu = case.cu_seqlens.clone()
    L = case.mixed_qkv.shape[0]
    big = (1 << 40) if index_dtype == I64 else (1 << 31) - 1
    idx[1, 2] = big  # row 1: a slot id past the pool
    acc[2] = 0  # row 2: accepted count below 1
    acc[3] = S + 1  # row 3: ... and above S
    idx[4, 0] = -5  # row 4: null source
    cu[6] = cu[5] + S + 1  # row 5: T > S
    cu[7] = cu[6] - 1  # row 6: decreasing range
    cu[8] = L + 7  # row 7: runs past L
    valid = [0]
    case.state_indices, case.num_accepted_tokens, case.cu_seqlens = idx, acc, cu

    # Reference of the valid row alone (same tensors, that row's indices only).
    ref_case = dataclasses.replace(
        case, state_indices=idx[:1].clone(), cu_seqlens=cu[:2].clone(), num_accepted_tokens=acc[:1].clone(), T=[T]
    )
    ref = ref_case.reference()
    before = case.pool_buffer.clone()
    dev = map_case(case, "cuda")
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    dev.poison_out()
    dev.run(error_count=errors)
    torch.cuda.synchronize()
    assert int(errors) == N - len(valid)
    out = dev.out.cpu().to(F64)
    pool = dev.pool_buffer.cpu()
    # Valid row 0: its rows match the reference; its destination slots are the only changes.
    for row in range(int(cu[0]), int(cu[1])):
        assert rel_l2(out[row], ref.out[row]) <= OUT16_BAR
    changed = (pool.view(torch.uint8) != before.view(torch.uint8)).any(-1).nonzero().flatten()
    assert set(changed.tolist()) <= set(ref.written), changed.tolist()
    assert set(ref.written) <= set(changed.tolist())
    # Every token row an invalid request covers inside [0, L) is zero; others stay poisoned.
    covered = set()
    for i in range(1, N):
        lo, hi = max(int(cu[i]), 0), min(int(cu[i + 1]), L)
        covered.update(range(lo, hi))
    for row in sorted(covered):
        assert torch.all(out[row] == 0), f"token row {row} of an invalid request not zero"
    for row in range(L):
        if row not in covered and not int(cu[0]) <= row < int(cu[1]):
            assert torch.isnan(out[row]).all(), f"token row {row} written by nobody's request"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["state_fp32", "state_bf16"])
def test_invalid_rows_inside_a_large_batch(gen, state_dtype):
    """More heads than the grid holds at once: each cluster walks several heads, some of whose
    requests are invalid (accepted count 0). Valid requests are exact, invalid ones write no state
    and zero their rows, the counter counts them once."""
    N, S = 90, 3
    T = [int(t) for t in torch.randint(1, S + 1, (N,), generator=gen)]
    case = case128(gen, H=1, HV=2, S=S, T=T, act=BF16, state_dtype=state_dtype)
    check_invalid_rows(case, set(range(1, N, 3)), FP32_BAR if state_dtype == FP32 else STATE16_BAR)


def check_invalid_rows(case, bad, state_tol):
    """Runs `case` on the GPU with the requests in `bad` made invalid on the device (accepted count
    0): valid requests match the reference, invalid ones write no state and zero their rows, the
    error counter counts each once."""
    ref = case.reference()
    before = case.pool_buffer.clone()
    dev = map_case(case, "cuda")
    for i in bad:
        dev.num_accepted_tokens[i] = 0
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    dev.poison_out()
    dev.run(error_count=errors)
    torch.cuda.synchronize()
    assert int(errors) == len(bad)
    out, pool = dev.out.cpu(), dev.pool_buffer.cpu()
    cu = case.cu_seqlens.tolist()
    for i in range(len(cu) - 1):
        rows = list(range(cu[i], cu[i + 1]))
        if i in bad:
            assert torch.all(out[rows] == 0), f"request {i}"
        elif rows:
            assert rel_l2(out[rows], ref.out[rows]) <= OUT16_BAR, f"request {i}"
    changed = (pool.view(torch.uint8) != before.view(torch.uint8)).any(-1).nonzero().flatten()
    expected = {slot for slot, (i, _) in ref.written.items() if i not in bad}
    assert set(changed.tolist()) <= expected
    state = pool[:, : case.state[0].numel()].view(case.state.shape)
    for slot in expected:
        assert rel_l2(state[slot], ref.pool[slot]) <= state_tol, f"slot {slot}"


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("layout", ["vk", "kv"])
@pytest.mark.parametrize("state_dtype", [BF16, FP16], ids=["state_bf16", "state_fp16"])
def test_single_token_form(gen, state_dtype, layout):
    """Decode without drafts (S = 1) with a 16-bit state at seven heads per SM: on a device with an
    H100's or H200's shared memory the launcher takes the kernel's single-token form there (eight
    CTAs per SM, use_single_token in gdn/decode_mtp/cuda_launch_rules.hpp), with padded rows (null
    slot ids) and invalid rows."""
    HV = 8
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    N = (7 * sm_count + HV - 1) // HV
    assert 6 * sm_count < N * HV <= 8 * sm_count
    T = [0 if i % 17 == 5 else 1 for i in range(N)]
    case = case128(gen, H=1, HV=HV, S=1, T=T, act=BF16, state_dtype=state_dtype, layout=layout, first_valid_slot=1)
    check_invalid_rows(case, {i for i in range(3, N, 11) if T[i] == 1}, STATE16_BAR)


def batch_of(sm_count, HV, launch):
    """Requests for one of the launcher's split choices (choose_split in
    gdn/decode_mtp/cuda_launch_rules.hpp), or None when this GPU's SM count has no such batch."""
    if launch == "one_to_two_per_sm":
        N = sm_count // HV + 2
        return N if sm_count <= N * HV < 2 * sm_count else None
    if launch == "two_to_four_per_sm":
        N = 3 * sm_count // HV
        return N if 2 * sm_count <= N * HV < 4 * sm_count else None
    if launch == "sixteen_per_sm":  # fp32 write-all with drafts: 4 CTAs per head at S = 3..5
        return -(-16 * sm_count // HV)
    N = -(-15 * sm_count // (32 * HV))  # just below one per SM: 2 CTAs per head cover 15/16
    return N if 32 * N * HV >= 15 * sm_count and N * HV < sm_count else None


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("state_dtype", [FP32, BF16], ids=["state_fp32", "state_bf16"])
@pytest.mark.parametrize(
    "launch,S",
    [
        ("one_to_two_per_sm", 4),
        ("one_to_two_per_sm", 8),
        ("two_to_four_per_sm", 4),
        ("below_one_per_sm", 4),
        ("sixteen_per_sm", 2),
        ("sixteen_per_sm", 4),
    ],
)
def test_split_launch_choices(gen, state_dtype, launch, S):
    """Batches for which the launcher splits each head over 2 CTAs: between one and two heads per
    SM (any S; the CTAs spread evenly over the SMs), and with an fp32 state and drafts from two to
    four heads per SM and just below one (a 16-bit state takes 1 and 4 CTAs per head there); and
    with an fp32 state and drafts from sixteen heads per SM, over 2 (S = 2) or 4 (S = 4) CTAs (a
    16-bit state takes 1): padded rows, invalid rows and every T up to S."""
    HV = 8
    N = batch_of(torch.cuda.get_device_properties(0).multi_processor_count, HV, launch)
    if N is None:
        pytest.skip(f"no batch of {HV}-head requests takes this launch on this GPU")
    T = [0 if i % 13 == 4 else 1 + i % S for i in range(N)]
    case = case128(gen, H=2, HV=HV, S=S, T=T, act=BF16, state_dtype=state_dtype, first_valid_slot=1)
    bar = FP32_BAR if state_dtype == FP32 else STATE16_BAR
    check_invalid_rows(case, {i for i in range(2, N, 7) if T[i] > 0}, bar)


# ---- graphs, streams, compile, other array libraries ---------------------------------------------

# The function and the torch op (whose CUDA kernel is C++ when the package has the torch op
# kernels) each launch on torch's current stream.
CALLERS = {"function": gdn.decode_mtp, "torch_op": torch.ops.gdn.decode_mtp}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("caller", list(CALLERS))
def test_cuda_graph_capture_and_replay(gen, caller):
    case = case128(gen, H=2, HV=8, S=4, T=(4, 1, 3, 2), act=BF16, state_dtype=BF16)
    dev = map_case(case, "cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dev.run(CALLERS[caller])  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dev.run(CALLERS[caller])
    for _ in range(2):
        fresh = case128(gen, H=2, HV=8, S=4, T=(4, 1, 3, 2), act=BF16, state_dtype=BF16, acc=case.acc)
        fresh.state_indices = case.state_indices
        for name in ("mixed_qkv", "a", "b", "z", "state", "A_log", "dt_bias", "norm_weight"):
            getattr(dev, name).copy_(getattr(fresh, name).to("cuda"))
        fresh.pool_buffer.copy_(dev.pool_buffer.cpu())
        dev.poison_out()
        ref = fresh.reference()
        before = fresh.pool_buffer.clone()
        graph.replay()
        torch.cuda.synchronize()
        fresh.pool_buffer.copy_(dev.pool_buffer.cpu())
        fresh.out_buffer.copy_(dev.out_buffer.cpu())
        _compare(fresh, ref, before, out_tol=OUT16_BAR, state_tol=STATE16_BAR)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("caller", list(CALLERS))
def test_runs_on_torch_current_stream(gen, caller):
    case = case128(gen, H=1, HV=4, S=3, T=(3, 2), act=BF16)
    ref = case.reference()
    dev = map_case(case, "cuda")
    dev.poison_out()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(20_000_000)  # keep the stream busy: a launch elsewhere would race ahead
        dev.run(CALLERS[caller])
        out = dev.out.clone()  # ordered after the launch on this stream
    stream.synchronize()
    rows = case.token_rows()
    assert rel_l2(out.cpu()[rows], ref.out[rows]) <= OUT16_BAR


@pytest.mark.gpu
@requires_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("caller", list(CALLERS))
def test_runs_on_the_arrays_device(gen, caller):
    """Arrays on cuda:1 while cuda:0 is current: the call runs on cuda:1 (on its current stream)
    and leaves cuda:0 current."""
    case = case128(gen, H=1, HV=4, S=3, T=(3, 2), act=BF16)
    ref = case.reference()
    dev = map_case(case, "cuda:1")
    dev.poison_out()
    with torch.cuda.device(0):
        dev.run(CALLERS[caller])
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(1)
    rows = case.token_rows()
    assert rel_l2(dev.out.cpu()[rows], ref.out[rows]) <= OUT16_BAR


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_torch_compile_fullgraph(gen, backend):
    torch._dynamo.reset()

    def step(mixed_qkv, ba, A_log, dt_bias, z, norm_weight, state, state_indices, cu_seqlens, num_accepted_tokens, out):
        a, b = ba[:, :4], ba[:, 4:]
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
        )
        return out * 1.0

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for T in [(3, 1, 2), (2, 3, 0)]:
        case = case128(gen, H=1, HV=4, S=3, T=T, strided=True, act=BF16)
        ref = case.reference()
        dev = map_case(case, "cuda")
        ba = dev.a.as_strided((dev.a.shape[0], 8), dev.a.stride())
        dev.poison_out()
        result = compiled(
            dev.mixed_qkv,
            ba,
            dev.A_log,
            dev.dt_bias,
            dev.z,
            dev.norm_weight,
            dev.state,
            dev.state_indices,
            dev.cu_seqlens,
            dev.num_accepted_tokens,
            dev.out,
        )
        torch.cuda.synchronize()
        rows = case.token_rows()
        assert rel_l2(result.cpu()[rows], ref.out[rows]) <= OUT16_BAR
        for slot in ref.written:
            assert rel_l2(dev.state[slot].cpu(), ref.pool[slot]) <= FP32_BAR


@pytest.mark.gpu
@requires_cuda
def test_error_count_through_the_function(gen):
    case = case128(gen, H=1, HV=2, S=2, T=(2, 2), acc=(1, 1), act=BF16)
    case.num_accepted_tokens[1] = 3  # invalid
    dev = map_case(case, "cuda")
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    for _ in range(3):
        gdn.decode_mtp(*dev.args(), **dev.kwargs(), error_count=errors)
    torch.cuda.synchronize()
    assert int(errors) == 3
    assert torch.all(dev.out[2:4] == 0)


@pytest.mark.gpu
@requires_cuda
def test_cupy_arrays_with_explicit_stream(gen):
    cupy = pytest.importorskip("cupy")
    case = case128(gen, H=1, HV=4, S=3, T=(3, 2), act=FP16, state_dtype=FP32)  # CuPy: no bf16
    ref = case.reference()
    rows = case.token_rows()
    stream = cupy.cuda.Stream(non_blocking=True)
    for explicit in (True, False):
        dev = map_case(case, "cuda")
        dev.poison_out()
        torch.cuda.synchronize()
        arrays = [cupy.from_dlpack(x) for x in dev.args()]
        kw = {k: (cupy.from_dlpack(v) if isinstance(v, torch.Tensor) else v) for k, v in dev.kwargs().items()}
        if explicit:
            gdn.decode_mtp(*arrays, **kw, stream=stream.ptr)
        else:
            with stream:  # no stream given: CuPy's current stream
                gdn.decode_mtp(*arrays, **kw)
        stream.synchronize()
        assert rel_l2(dev.out.cpu()[rows], ref.out[rows]) <= OUT16_BAR
        for slot in ref.written:
            assert rel_l2(dev.state[slot].cpu(), ref.pool[slot]) <= FP32_BAR


# ---- vLLM-compatible entry point (runs on the CPU too) ---------------------------------------------


def _vllm_case(gen, K):
    return make_case(
        gen,
        H=1,
        HV=4,
        K=K,
        V=K,
        S=4,
        T=(4, 2, 0),
        acc=(2, 1, 1),
        act=BF16,
        state_dtype=FP32,
        first_valid_slot=1,
        norm_eps=1e-5,
    )


def _run_vllm(case, vllm_numerics=False):
    from gdn.compat.vllm import fused_gdn_decode_post_conv_mtp

    return fused_gdn_decode_post_conv_mtp(
        case.mixed_qkv,
        case.a,
        case.b,
        case.A_log,
        case.dt_bias,
        case.state_indices,
        case.cu_seqlens,
        case.num_accepted_tokens,
        case.state,
        case.z,
        case.norm_weight,
        case.out,
        case.state.shape[-1] ** -0.5,
        1e-5,
        "silu",
        vllm_numerics=vllm_numerics,
    )


def _bf16_mismatches(got, want64):
    """(fraction of bf16 outputs whose bits differ from the rounded float64 value, largest
    difference in units of the last place)."""
    g = got.view(torch.int16).to(torch.int32)
    w = want64.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    diff = (g - w).abs()
    return float((diff > 0).float().mean()), int(diff.max())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_vllm_numerics_match_vllms_rounding(gen, device):
    """vllm_numerics=True rounds o to bf16 before the norm as vLLM does: against a float64
    reference rounding at the same point, the bf16 outputs carry the same bits nearly everywhere
    (never more than 1 ulp apart), which is what vLLM's 5e-4 comparisons need; the exact default
    differs from that reference far more often."""
    if device == "cuda" and _REASON is not None:
        pytest.skip(f"CUDA decode_mtp: {_REASON}")
    K = 128 if device == "cuda" else 32
    rates = {}
    for numerics in (True, False):
        case = _vllm_case(gen, K)
        ref = decode_mtp_ref(*case.args()[:8], **case.kwargs(), round_core_output_to=torch.bfloat16)
        dev = map_case(case, device)
        dev.poison_out()
        _run_vllm(dev, vllm_numerics=numerics)
        if device == "cuda":
            torch.cuda.synchronize()
        rows = case.token_rows()
        rates[numerics] = _bf16_mismatches(dev.out.cpu()[rows], ref.out[rows])
    differ, worst = rates[True]
    assert worst <= 1 and differ <= 0.01, rates
    assert rates[False][0] > 5 * max(differ, 1e-3), rates


def test_vllm_compat_cpu(gen):
    case = _vllm_case(gen, 32)
    ref = case.reference()
    before = case.pool_buffer.clone()
    case.poison_out()
    returned = _run_vllm(case)
    assert returned.data_ptr() == case.out.data_ptr()
    _compare(case, ref, before, out_tol=OUT16_BAR, state_tol=FP32_BAR)
    assert 0 not in ref.written  # slot 0 is vLLM's null block


@pytest.mark.gpu
@requires_cuda
def test_vllm_compat_cuda(gen):
    case = _vllm_case(gen, 128)
    ref = case.reference()
    before = case.pool_buffer.clone()
    dev = map_case(case, "cuda")
    dev.poison_out()
    returned = _run_vllm(dev)
    torch.cuda.synchronize()
    assert returned.data_ptr() == dev.out.data_ptr()
    case.pool_buffer.copy_(dev.pool_buffer.cpu())
    case.out_buffer.copy_(dev.out_buffer.cpu())
    _compare(case, ref, before, out_tol=OUT16_BAR, state_tol=FP32_BAR)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("extra_inputs", [0, 3])
def test_vllm_compat_zeroes_padded_output_rows(gen, device, extra_inputs):
    """CUDA-graph padding as vLLM's kernel test passes it: `out` has more rows than tokens (and
    the inputs `extra_inputs` more rows than cu_seqlens covers). The live rows equal the unpadded
    call, every padded row is zero (poisoned before), and the state is the same."""
    if device == "cuda" and _REASON is not None:
        pytest.skip(f"CUDA decode_mtp: {_REASON}")
    from gdn.compat.vllm import fused_gdn_decode_post_conv_mtp

    case = map_case(_vllm_case(gen, 128 if device == "cuda" else 32), device)
    L = case.mixed_qkv.shape[0]
    pool = case.pool_buffer.clone()
    case.poison_out()
    _run_vllm(case)
    want_out, want_pool = case.out.clone(), case.pool_buffer.clone()
    case.pool_buffer.copy_(pool)

    def pad(x, rows):
        return torch.cat([x, torch.randn((rows,) + x.shape[1:], device=x.device).to(x.dtype)])

    Li = L + extra_inputs
    out = torch.full((Li + 5,) + case.out.shape[1:], float("nan"), dtype=case.out.dtype, device=device)
    got = fused_gdn_decode_post_conv_mtp(
        pad(case.mixed_qkv, extra_inputs),
        pad(case.a, extra_inputs),
        pad(case.b, extra_inputs),
        case.A_log,
        case.dt_bias,
        case.state_indices,
        case.cu_seqlens,
        case.num_accepted_tokens,
        case.state,
        pad(case.z, extra_inputs),
        case.norm_weight,
        out,
        case.state.shape[-1] ** -0.5,
        1e-5,
        "silu",
    )
    assert got.data_ptr() == out.data_ptr()
    live = int(case.cu_seqlens[-1])
    assert torch.equal(out[:live].cpu(), want_out[:live].cpu())
    assert torch.count_nonzero(out[live:]) == 0  # zeros, not NaN poison
    assert torch.equal(case.pool_buffer.cpu(), want_pool.cpu())
    with pytest.raises(ValueError, match="out must be"):
        fused_gdn_decode_post_conv_mtp(
            case.mixed_qkv,
            case.a,
            case.b,
            case.A_log,
            case.dt_bias,
            case.state_indices,
            case.cu_seqlens,
            case.num_accepted_tokens,
            case.state,
            case.z,
            case.norm_weight,
            out[: L - 1],
            case.state.shape[-1] ** -0.5,
        )


@pytest.mark.gpu
@requires_cuda
def test_guard_on_cuda():
    path, reason = gdn.can_use_decode_mtp("cuda", 16, 32, 128, 128, 4, "float32")
    assert path == "fast", reason
    path, reason = gdn.can_use_decode_mtp("cuda", 16, 80, 128, 128, 4, "float32")
    assert path == "generic", reason
    path, reason = gdn.can_use_decode_mtp("cuda", 16, 32, 64, 64, 4, "float32")
    assert path == "unsupported" and "128" in reason
    path, reason = gdn.can_use_decode_mtp("cuda", 16, 32, 128, 128, 17, "float32")
    assert path == "unsupported" and "S <=" in reason


@pytest.mark.gpu
@requires_cuda
def test_unsupported_head_dim_raises(gen):
    case = make_case(gen, H=1, HV=2, K=64, V=64, S=2, T=(2,))
    dev = map_case(case, "cuda")
    with pytest.raises(ValueError, match="128"):
        dev.run()
