"""gdn.decode_mtp_replay (docs replay.md) on the CPU and CUDA.

Chains of steps with random acceptance (n = 0 .. T, padded rows) are checked against the tests'
own float64 reference (reference_torch.decode_mtp_ref, one slot per request, its per-token states
giving the accepted state), against write-every-token gdn.decode_mtp (bit for bit on the CPU
with an fp32 state, within 1e-5 on CUDA) and for the saved window (the raw inputs, exactly).
Outputs are poisoned before each call.
Invalid rows: raised before anything is written on the CPU, isolated on the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List

import pytest
import torch

import gdn
from reference_torch import (
    BF16,
    F64,
    FP16,
    FP32,
    FP32_BAR,
    OUT16_BAR,
    STATE16_BAR,
    cuda_skip_reason,
    decode_mtp_ref,
    out_bar,
    rel_l2,
    state_bar,
)

_CUDA = cuda_skip_reason()
needs_cuda = pytest.mark.skipif(_CUDA is not None, reason=f"CUDA replay: {_CUDA}")
on_cuda = [pytest.mark.gpu, needs_cuda]  # the marks of a case that runs on CUDA
DEVICES = ["cpu", pytest.param("cuda", marks=on_cuda)]


@dataclasses.dataclass
class Pool:
    """A checkpoint pool of one slot per request (slots scattered, a null slot 0 when
    first_valid_slot = 1), its window and the float64 reference states of the requests."""

    state: torch.Tensor
    window: gdn.ReplayWindow
    slots: torch.Tensor  # [N] checkpoint slot of each request
    ref: torch.Tensor  # [N, HV, V, K] float64: the reference state of each request
    pending: List[int]  # n of each request for the next step


def make_pool(gen, device, *, N, H, HV, K, V, S, state_dtype, act, first_valid_slot, spare=3):
    slots_total = N + spare + first_valid_slot
    perm = torch.randperm(slots_total - first_valid_slot, generator=gen)[:N] + first_valid_slot
    init = torch.randn(slots_total, HV, V, K, generator=gen, dtype=F64) * 0.3
    state = init.to(state_dtype).to(device)
    ref = state[perm.to(device)].to("cpu", F64)  # the stored (rounded) values are the start
    window = gdn.ReplayWindow.allocate(slots_total, S, H=H, HV=HV, K=K, V=V, dtype=act, device=device)
    # Fill the windows with junk so a replay that reads past window_len would be seen.
    for x in (window.k, window.v, window.a, window.b):
        x.copy_(torch.randn(x.shape, generator=gen, dtype=F64).to(x.dtype))
    # The slot ids as a column of a wider table (a strided view), as a block table's column 0.
    table = torch.full((N, 3), -5, dtype=torch.int32, device=device)
    table[:, 1] = perm.to(device)
    return Pool(state, window, table[:, 1], ref, [0] * N)


def layer_params(gen, HV):
    """A_log and dt_bias: constants of a layer, the same for every step of a chain (replay
    recomputes the stored tokens' gates with them)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return (
        (torch.rand(HV, generator=g, dtype=F64) * 3.5 - 2.5).to(FP32),
        torch.randn(HV, generator=g, dtype=F64).to(FP32),
    )


def random_inputs(gen, T: List[int], *, H, HV, K, V, act, norm=True, params=None, aligned=False):
    """aligned: mixed_qkv contiguous (16-byte rows on CUDA) instead of a strided view at an odd
    element offset."""
    L = sum(T)
    width = 2 * H * K + HV * V
    first = 0 if aligned else 3
    qkv = torch.randn(L, width + 5, generator=gen, dtype=F64)[:, first : first + width].to(act)
    if aligned:
        qkv = qkv.contiguous()
    ba = torch.randn(L, 2 * HV, generator=gen, dtype=F64).to(act)
    z = torch.randn(L, HV, V, generator=gen, dtype=F64).to(act) if norm else None
    w = (torch.rand(V, generator=gen, dtype=F64) + 0.5).to(act) if norm else None
    A_log, dt_bias = params if params is not None else layer_params(gen, HV)
    cu = torch.tensor([0] + list(torch.tensor(T).cumsum(0)), dtype=torch.int32)
    return dict(
        mixed_qkv=qkv, a=ba[:, :HV], b=ba[:, HV:], A_log=A_log, dt_bias=dt_bias, cu_seqlens=cu, z=z, norm_weight=w
    )


def to(d, device):
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in d.items()}


def replay_step(pool: Pool, inputs, T, *, device, state_layout="vk", first_valid_slot=0, error_count=None, fn=None):
    HV, V = pool.ref.shape[1], pool.ref.shape[2]
    L = inputs["mixed_qkv"].shape[0]
    out = torch.full((L, HV, V), float("nan"), dtype=inputs["mixed_qkv"].dtype, device=device)
    x = to(inputs, device)
    (fn or gdn.decode_mtp_replay)(
        x["mixed_qkv"],
        x["a"],
        x["b"],
        x["A_log"],
        x["dt_bias"],
        pool.state,
        pool.slots.to(device),
        x["cu_seqlens"],
        out,
        **pool.window.arrays(),
        num_accepted_tokens=torch.tensor(pool.pending, dtype=torch.int32, device=device),
        z=x["z"],
        norm_weight=x["norm_weight"],
        state_layout=state_layout,
        first_valid_slot=first_valid_slot,
        error_count=error_count,
    )
    return out


def reference_step(pool: Pool, inputs, T):
    """float64: outputs of the step from the reference states, and every post-token state."""
    N = len(T)
    S = max(max(T), 1)
    idx = torch.arange(N, dtype=torch.int64)[:, None].expand(N, S).contiguous()
    return decode_mtp_ref(
        inputs["mixed_qkv"],
        inputs["a"],
        inputs["b"],
        inputs["A_log"],
        inputs["dt_bias"],
        pool.ref,
        idx,
        inputs["cu_seqlens"],
        z=inputs["z"],
        norm_weight=inputs["norm_weight"],
    )


def accept(pool: Pool, ref, T, gen):
    """Random acceptance (0..T, both ends drawn often); the reference state advances by it."""
    for i, t in enumerate(T):
        if t == 0:
            continue  # padded row: nothing changed, its pending count stays
        n = int(torch.randint(0, t + 1, (1,), generator=gen))
        if n > 0:
            pool.ref[i] = ref.states[(i, n - 1)]
        pool.pending[i] = n


def check_window(pool: Pool, inputs, T, H, K):
    cu = inputs["cu_seqlens"].tolist()
    for i, t in enumerate(T):
        if t == 0:
            continue
        s = int(pool.slots[i])
        rows = slice(cu[i], cu[i + 1])
        assert int(pool.window.len[s]) == t
        assert torch.equal(pool.window.k[s, :t].cpu(), inputs["mixed_qkv"][rows, H * K : 2 * H * K])
        assert torch.equal(pool.window.v[s, :t].cpu(), inputs["mixed_qkv"][rows, 2 * H * K :])
        assert torch.equal(pool.window.a[s, :t].cpu(), inputs["a"][rows])
        assert torch.equal(pool.window.b[s, :t].cpu(), inputs["b"][rows])


def random_T(gen, N, S):
    T = torch.randint(0, S + 1, (N,), generator=gen).tolist()
    T[0] = S  # the full depth every step
    return T


def check_chain_against_reference(
    gen, device, *, H, HV, state_dtype, act, params, N=5, S=4, steps=6, z_dtype=None, fn=None, aligned=False
):
    """A replay chain of `steps` steps with random T and acceptance: every step's outputs and
    checkpoints against the float64 reference, and the saved windows. z_dtype: z in that dtype
    instead of the activations' (the same values). fn: the replay function (default
    gdn.decode_mtp_replay). aligned: as random_inputs."""
    K = V = 128 if device == "cuda" else 32
    pool = make_pool(gen, device, N=N, H=H, HV=HV, K=K, V=V, S=S, state_dtype=state_dtype, act=act, first_valid_slot=1)
    out_tol = FP32_BAR if (act == FP32 and state_dtype == FP32) else OUT16_BAR
    if state_dtype != FP32:
        out_tol = STATE16_BAR
    for step in range(steps):
        T = random_T(gen, N, S)
        inputs = random_inputs(gen, T, H=H, HV=HV, K=K, V=V, act=act, params=params, aligned=aligned)
        if z_dtype is not None:
            inputs["z"] = inputs["z"].to(z_dtype)
        # pool.ref holds each request's state after its pending tokens: the checkpoint the call
        # stores, and where the step's tokens start.
        want = pool.ref.clone()
        ref = reference_step(pool, inputs, T)
        out = replay_step(pool, inputs, T, device=device, first_valid_slot=1, fn=fn).cpu()
        for i, t in enumerate(T):
            if t == 0:
                continue
            rows = slice(int(inputs["cu_seqlens"][i]), int(inputs["cu_seqlens"][i + 1]))
            err = rel_l2(out[rows], ref.out[rows])
            assert err <= out_tol, f"step {step} request {i}: out rel L2 {err:.3g}"
            got = pool.state[int(pool.slots[i])].cpu()
            err = rel_l2(got, want[i])
            assert err <= (FP32_BAR if state_dtype == FP32 else STATE16_BAR), (
                f"step {step} request {i}: checkpoint rel L2 {err:.3g}"
            )
        check_window(pool, inputs, T, H, K)
        accept(pool, ref, T, gen)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "state_dtype,act",
    [(FP32, FP32), (FP32, BF16), (BF16, BF16), (FP16, FP16)],
    ids=["state_fp32_act_fp32", "state_fp32_act_bf16", "state_bf16", "state_fp16"],
)
@pytest.mark.parametrize("H,HV", [(1, 1), (2, 4), (1, 3), (1, 8)], ids=["r1", "r2", "r3", "r8"])
def test_chain_against_float64_reference(gen, device, H, HV, state_dtype, act):
    check_chain_against_reference(
        gen, device, H=H, HV=HV, state_dtype=state_dtype, act=act, params=layer_params(gen, HV)
    )


def heads_per_sm_batch(HV, heads_per_sm=2):
    """Requests enough for `heads_per_sm` heads per SM (and fewer than one more). On CUDA, S >= 8
    replays in closed form from two heads per SM (a 16-bit state from one; below two, an fp32 state
    token by token with each head split over 2 CTAs, as S <= 4); S = 6 and 7 take the closed form
    from four (use_closed_form, choose_split: gdn/decode_mtp/cuda_launch_rules.hpp)."""
    return heads_per_sm * torch.cuda.get_device_properties(0).multi_processor_count // HV + 2


_NEEDS_CUDA = pytest.mark.skipif(_CUDA is not None, reason=f"CUDA replay: {_CUDA}")
STRONG_DECAY_CASES = [
    pytest.param("cpu", "token", id="cpu"),
    pytest.param("cuda", "token", id="cuda-token-by-token", marks=on_cuda),
    pytest.param("cuda", "closed", id="cuda-closed-form", marks=on_cuda),
]


@pytest.mark.parametrize("device,form", STRONG_DECAY_CASES)
def test_chain_with_strong_decay(gen, device, form):
    """Heads whose state decays by up to e^-100 per token, some to exactly 0 in float32 (the CUDA
    replay kernel's token-by-token form keeps the decay as a scalar and folds it back into the
    state when it gets small; its closed form multiplies the alphas, never divides), next to
    ordinary heads, over deep windows, against the float64 reference."""
    HV = 8
    A_log = torch.tensor([4.5, 3.0, 2.0, 1.0, 0.0, -1.0, 4.0, 2.5], dtype=FP32)
    dt_bias = torch.tensor([3.0, 1.0, 0.5, 2.0, 0.0, 0.0, -1.0, 0.0], dtype=FP32)
    N = heads_per_sm_batch(HV) if form == "closed" else 4
    check_chain_against_reference(
        gen, device, H=2, HV=HV, state_dtype=FP32, act=FP32, params=(A_log, dt_bias), N=N, S=8, steps=5
    )


@pytest.mark.gpu
@_NEEDS_CUDA
@pytest.mark.parametrize(
    "state_dtype,act",
    [(FP32, FP32), (FP32, BF16), (BF16, BF16), (FP16, FP16)],
    ids=["state_fp32_act_fp32", "state_fp32_act_bf16", "state_bf16", "state_fp16"],
)
@pytest.mark.parametrize("H,HV", [(4, 8), (1, 8), (3, 9), (8, 8), (2, 8)], ids=["r2", "r8", "r3", "r1", "r4"])
@pytest.mark.parametrize(
    "S,heads_per_sm",
    [(8, 2), (8, 1), (6, 4), (4, 1), (4, 4), (5, 2), (4, 7), (3, 4), (2, 4)],
    ids=[
        "closed_form",
        "S8_one_head_per_sm",
        "closed_form_S6",
        "token_by_token_split2",
        "tensor_cores_four_per_sm",
        "tensor_cores_S5_two_per_sm",
        "tensor_cores_eight_ctas_per_sm",
        "token_by_token_S3_four_per_sm",
        "token_by_token_S2_four_per_sm",
    ],
)
def test_chain_at_a_head_per_sm(gen, H, HV, state_dtype, act, S, heads_per_sm):
    """Launch choices of the CUDA replay kernel that only batches of a few heads per SM take:
    from two, deep windows (S = 8) in closed form; between one and two, S = 8 in closed form with
    a 16-bit state and token by token with an fp32 one, and shallower windows (S = 4) token by
    token, each head split over 2 CTAs; from four, S = 6 in closed form. A 16-bit state takes the
    closed form on tensor cores from S = 6 at one head per SM and from S = 4 at two (S = 4, 5, 6
    and 8 here), at S <= 5 from seven heads per SM with eight CTAs per SM (its own kernel image);
    S = 2 and 3 stay token by token. From one to sixteen heads per SM, 16-bit token-by-token
    replay stages its tokens before the slice (its own kernel image: S = 4 at one head per SM,
    S = 2 and 3 at four). Chained with random T and acceptance (n = 0 .. T, padded rows), against
    the float64 reference."""
    check_chain_against_reference(
        gen,
        "cuda",
        H=H,
        HV=HV,
        state_dtype=state_dtype,
        act=act,
        params=layer_params(gen, HV),
        N=heads_per_sm_batch(HV, heads_per_sm),
        S=S,
        steps=4,
    )


@pytest.mark.gpu
@_NEEDS_CUDA
@pytest.mark.parametrize("state_dtype", [FP32, BF16, FP16], ids=["state_fp32", "state_bf16", "state_fp16"])
@pytest.mark.parametrize("act", [FP32, BF16], ids=["act_fp32", "act_bf16"])
@pytest.mark.parametrize("H,HV", [(4, 8), (1, 8), (3, 9)], ids=["r2", "r8", "r3"])
def test_token_by_token_with_four_rows_per_lane(gen, H, HV, act, state_dtype):
    """From sixteen heads per SM, token-by-token replay holds four rows per lane instead of two
    (its own kernel image, use_replay_four_rows), with the run-time and the bf16 activation
    dtypes; S = 3 keeps a 16-bit state out of the closed form. Chained with random T and
    acceptance, against the float64 reference."""
    check_chain_against_reference(
        gen,
        "cuda",
        H=H,
        HV=HV,
        state_dtype=state_dtype,
        act=act,
        params=layer_params(gen, HV),
        N=heads_per_sm_batch(HV, 16),
        S=4 if state_dtype == FP32 else 3,
        steps=3,
    )


@pytest.mark.gpu
@_NEEDS_CUDA
@pytest.mark.parametrize(
    "state_dtype,act",
    [(FP32, BF16), (BF16, BF16), (FP32, FP32)],
    ids=["state_fp32", "state_bf16", "state_fp32_act_fp32"],
)
@pytest.mark.parametrize("split", [1, 2, 8], ids=["split1", "split2", "split8"])
@pytest.mark.parametrize("aligned", [False, True], ids=["strided_qkv", "aligned_qkv"])
def test_window_save_with_many_ctas_per_request(gen, state_dtype, act, split, aligned):
    """The window save after many CTAs per request have replayed the old window: 64 value heads
    over 8 key heads (each stored k read by 8 value heads) with the split pinned, up to 512 CTAs
    per request. mixed_qkv strided (the save copies elements) and 16-byte aligned (it copies
    16-byte units; the other window checks all use strided rows). Chained with random T and
    acceptance against the float64 reference, the windows compared exactly."""
    if split > 1 and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("pinning a head split needs thread-block clusters (sm_90+)")
    fn = functools.partial(gdn._C.decode_mtp_replay, split=split, stream=torch.cuda.current_stream().cuda_stream)
    check_chain_against_reference(
        gen,
        "cuda",
        H=8,
        HV=64,
        state_dtype=state_dtype,
        act=act,
        params=layer_params(gen, 64),
        N=6,
        S=4,
        steps=4,
        fn=fn,
        aligned=aligned,
    )


@pytest.mark.gpu
@_NEEDS_CUDA
@pytest.mark.parametrize("state_dtype", [FP32, BF16, FP16], ids=["state_fp32", "state_bf16", "state_fp16"])
@pytest.mark.parametrize(
    "S,heads_per_sm", [(4, 7), (4, 4), (3, 4)], ids=["tensor_cores_eight_ctas_per_sm", "tensor_cores", "token_by_token"]
)
def test_bf16_activations_but_z_fp32(gen, state_dtype, S, heads_per_sm):
    """Replay with every activation array bf16 takes kernel images that know those dtypes at
    compile time; a z of another dtype among them (fp32 here) must take the images that read the
    dtypes at run time, in every kernel form, and match the reference as well."""
    check_chain_against_reference(
        gen,
        "cuda",
        H=16,
        HV=32,
        state_dtype=state_dtype,
        act=BF16,
        params=layer_params(gen, 32),
        N=heads_per_sm_batch(32, heads_per_sm),
        S=S,
        steps=3,
        z_dtype=FP32,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("H,HV", [(2, 4), (1, 8)], ids=["r2", "r8"])
def test_chain_equals_write_every_token(gen, device, H, HV):
    """fp32 state: replay's outputs and checkpoints are decode_mtp's outputs and its states at
    column acc - 1 over a chain with acceptance 1..T and padded rows: bit for bit on the CPU; on
    CUDA within 1e-5 relative L2 (the replay kernel holds the state in another lane layout, so its
    dot products add in another order) and the outputs within one bf16 rounding."""

    def same(x, y, bar):
        return torch.equal(x, y) if device == "cpu" else rel_l2(x.cpu(), y.cpu()) <= bar

    K = V = 128 if device == "cuda" else 32
    N, S, steps = 6, 5, 12
    pool = make_pool(gen, device, N=N, H=H, HV=HV, K=K, V=V, S=S, state_dtype=FP32, act=BF16, first_valid_slot=0)
    # decode_mtp's pool: S columns per request, starting from the same states in column 0.
    wa_slots = torch.arange(N * S, dtype=torch.int32).reshape(N, S)
    wa = torch.empty(N * S, HV, V, K, dtype=FP32, device=device)
    wa[wa_slots[:, 0].long().to(device)] = pool.state[pool.slots.long().to(device)]
    acc = [1] * N
    params = layer_params(gen, HV)
    wa_before, acc_before = wa.clone(), list(acc)  # decode_mtp's pool after the previous step
    for step in range(steps):
        T = random_T(gen, N, S)
        inputs = random_inputs(gen, T, H=H, HV=HV, K=K, V=V, act=BF16, params=params)
        out_rp = replay_step(pool, inputs, T, device=device)
        x = to(inputs, device)
        out_wa = torch.full_like(out_rp, float("nan"))
        gdn.decode_mtp(
            x["mixed_qkv"],
            x["a"],
            x["b"],
            x["A_log"],
            x["dt_bias"],
            wa,
            wa_slots.to(device),
            x["cu_seqlens"],
            out_wa,
            z=x["z"],
            norm_weight=x["norm_weight"],
            num_accepted_tokens=torch.tensor(acc, dtype=torch.int32, device=device),
        )
        assert same(out_rp, out_wa, 4e-3), f"step {step}: outputs differ"
        for i, t in enumerate(T):
            if step > 0 and t > 0:  # this call stored the previous step's accepted state
                assert same(pool.state[int(pool.slots[i])], wa_before[int(wa_slots[i, acc_before[i] - 1])], 1e-5), (
                    f"step {step} request {i}: checkpoint != decode_mtp's column acc - 1"
                )
            if t > 0:
                n = int(torch.randint(1, t + 1, (1,), generator=gen))
                acc[i] = pool.pending[i] = n
        wa_before, acc_before = wa.clone(), list(acc)


# The "kv" layout takes plain loads into the chunk buffers; on CUDA, 20 requests x 32 heads give
# every SM 4 or more heads, where an fp32 replay with bulk copies streams through one buffer and
# plain loads must keep two (benchmarks/gpu_check.sh runs this case under racecheck), and where a
# 16-bit state replays in closed form on tensor cores (S = 4), which stores "kv" rows element by
# element; token by token (S = 3) it stores each column of a lane's 2 rows (4 with an fp32 state
# from 16 heads per SM: 68 requests) as one vector.
@pytest.mark.parametrize(
    "device,H,HV,N,state_dtype,S",
    [
        ("cpu", 1, 2, 3, FP32, 3),
        pytest.param("cuda", 1, 2, 3, FP32, 3, marks=on_cuda),
        pytest.param("cuda", 16, 32, 20, FP32, 3, marks=on_cuda),
        pytest.param("cuda", 16, 32, 68, FP32, 3, marks=on_cuda, id="cuda-four-rows"),
        pytest.param("cuda", 16, 32, 20, BF16, 3, marks=on_cuda, id="cuda-bf16-token-by-token"),
        pytest.param("cuda", 16, 32, 20, BF16, 4, marks=on_cuda, id="cuda-tensor-cores"),
        pytest.param("cuda", 16, 32, 20, FP16, 4, marks=on_cuda, id="cuda-tensor-cores-fp16"),
    ],
)
def test_kv_layout_and_first_pass(gen, device, H, HV, N, state_dtype, S):
    """The "kv" state layout, and a request's first step (n = 0: nothing replayed or stored)."""
    K = V = 128 if device == "cuda" else 16
    act = state_dtype
    out_tol, state_tol = out_bar(act), state_bar(state_dtype)
    pool = make_pool(gen, device, N=N, H=H, HV=HV, K=K, V=V, S=S, state_dtype=state_dtype, act=act, first_valid_slot=0)
    kv_state = pool.state.transpose(-1, -2).contiguous()
    before = kv_state.clone()
    T = [3, 1, 2] * (N // 3) + [2] * (N % 3)
    params = layer_params(gen, HV)
    inputs = random_inputs(gen, T, H=H, HV=HV, K=K, V=V, act=act, params=params)
    ref = reference_step(pool, inputs, T)
    pool.state = kv_state
    out = replay_step(pool, inputs, T, device=device, state_layout="kv")
    assert rel_l2(out.cpu(), ref.out) <= out_tol
    assert torch.equal(kv_state, before)  # n = 0 everywhere: no checkpoint store
    accept(pool, ref, T, gen)
    T2 = [2, 3, 1] * (N // 3) + [3] * (N % 3)
    inputs2 = random_inputs(gen, T2, H=H, HV=HV, K=K, V=V, act=act, params=params)
    ref2 = reference_step(pool, inputs2, T2)
    out2 = replay_step(pool, inputs2, T2, device=device, state_layout="kv")
    assert rel_l2(out2.cpu(), ref2.out) <= out_tol
    for i in range(N):
        got = kv_state[int(pool.slots[i])].transpose(-1, -2).cpu()
        assert rel_l2(got, pool.ref[i]) <= state_tol


# ---- invalid rows ------------------------------------------------------------------------------


def _invalid_setup(gen, device):
    K = V = 128 if device == "cuda" else 16
    H, HV, N, S = 1, 2, 4, 3
    pool = make_pool(gen, device, N=N, H=H, HV=HV, K=K, V=V, S=S, state_dtype=FP32, act=FP32, first_valid_slot=0)
    pool.window.len.fill_(2)
    pool.pending = [2, 1, 0, 2]
    T = [2, 3, 1, 2]
    inputs = random_inputs(gen, T, H=H, HV=HV, K=K, V=V, act=FP32)
    return pool, inputs, T


BAD_ROWS = {
    "n_beyond_window": lambda p, T: p.pending.__setitem__(1, 3),
    "n_negative": lambda p, T: p.pending.__setitem__(1, -1),
    "slot_out_of_range": lambda p, T: p.slots.__setitem__(1, p.state.shape[0]),
}


@pytest.mark.parametrize("bad", sorted(BAD_ROWS))
def test_invalid_row_raises_before_writing_on_cpu(gen, bad):
    pool, inputs, T = _invalid_setup(gen, "cpu")
    BAD_ROWS[bad](pool, T)
    snapshot = [x.clone() for x in (pool.state, *pool.window.arrays().values())]
    with pytest.raises(ValueError, match="row 1"):
        replay_step(pool, inputs, T, device="cpu")
    for x, y in zip(snapshot, (pool.state, *pool.window.arrays().values())):
        assert torch.equal(x, y)


def test_shared_checkpoint_slot_raises(gen):
    pool, inputs, T = _invalid_setup(gen, "cpu")
    pool.slots[3] = pool.slots[0]
    with pytest.raises(ValueError, match="also the checkpoint slot of request row 0"):
        replay_step(pool, inputs, T, device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(_CUDA is not None, reason=f"CUDA replay: {_CUDA}")
@pytest.mark.parametrize("bad", sorted(BAD_ROWS) + ["T_beyond_window"])
def test_invalid_row_isolated_on_gpu(gen, bad):
    """Device-side indices: the bad row stores nothing (checkpoint, window, window_len), its out
    rows are zero, error_count counts it; the other rows run normally."""
    pool, inputs, T = _invalid_setup(gen, "cuda")
    if bad == "T_beyond_window":
        T = [2, 4, 1, 2]
        inputs = random_inputs(gen, T, H=1, HV=2, K=128, V=128, act=FP32)
    else:
        BAD_ROWS[bad](pool, T)
    good = [0, 2, 3]
    state_before = pool.state.clone()
    windows_before = {k: v.clone() for k, v in pool.window.arrays().items()}
    errors = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = replay_step(pool, inputs, T, device="cuda", error_count=errors).cpu()
    torch.cuda.synchronize()
    assert int(errors) == 1
    cu = inputs["cu_seqlens"].tolist()
    assert torch.equal(out[cu[1] : cu[2]], torch.zeros_like(out[cu[1] : cu[2]]))
    bad_slot = int(pool.slots[1])
    if 0 <= bad_slot < pool.state.shape[0]:
        assert torch.equal(pool.state[bad_slot], state_before[bad_slot])
        for name, x in pool.window.arrays().items():
            assert torch.equal(x[bad_slot], windows_before[name][bad_slot]), name
    for i in good:
        rows = slice(cu[i], cu[i + 1])
        assert not torch.isnan(out[rows]).any()
        assert int(pool.window.len[int(pool.slots[i])]) == T[i]


@pytest.mark.parametrize("device", DEVICES)
def test_padded_rows_touch_nothing(gen, device):
    """T = 0 and null checkpoint slots (any replay count) read and write nothing, out included."""
    K = V = 128 if device == "cuda" else 16
    pool = make_pool(gen, device, N=4, H=1, HV=2, K=K, V=V, S=3, state_dtype=FP32, act=FP32, first_valid_slot=1)
    pool.pending = [0, 3, 0, 2]  # rows 1 and 3 would be invalid if they were live
    pool.slots[1] = 0  # null slot
    T = [2, 0, 1, 2]
    inputs = random_inputs(gen, T, H=1, HV=2, K=K, V=V, act=FP32)
    T[3] = 0
    inputs["cu_seqlens"][4] = inputs["cu_seqlens"][3]  # row 3: T = 0, its token row left alone
    state_before = pool.state.clone()
    out = replay_step(pool, inputs, T, device=device, first_valid_slot=1).cpu()
    cu = inputs["cu_seqlens"].tolist()
    assert torch.isnan(out[cu[3] :]).all()  # the row no request covers is untouched
    for i in (1, 3):
        s = int(pool.slots[i])
        assert torch.equal(pool.state[s], state_before[s])


# ---- the torch op ------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_torch_op_matches_function(gen, device):
    K = V = 128 if device == "cuda" else 16
    pools = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        pools.append(
            make_pool(g, device, N=3, H=1, HV=2, K=K, V=V, S=2, state_dtype=FP32, act=BF16, first_valid_slot=0)
        )
    T = [2, 1, 2]
    inputs = random_inputs(gen, T, H=1, HV=2, K=K, V=V, act=BF16)
    outs = [
        replay_step(p, inputs, T, device=device, fn=fn)
        for p, fn in zip(pools, (gdn.decode_mtp_replay, torch.ops.gdn.decode_mtp_replay))
    ]
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(pools[0].state, pools[1].state)
    for name in ("window_k", "window_v", "window_a", "window_b", "window_len"):
        assert torch.equal(pools[0].window.arrays()[name], pools[1].window.arrays()[name]), name


def test_window_allocation():
    w = gdn.ReplayWindow.allocate(5, 4, H=16, HV=32, K=128, V=128, dtype=BF16)
    assert w.k.shape == (5, 4, 16 * 128) and w.v.shape == (5, 4, 32 * 128)
    assert w.a.shape == (5, 4, 32) and w.len.dtype == torch.int32
    assert w.k.untyped_storage().data_ptr() == w.v.untyped_storage().data_ptr()
    # Qwen3-Next TP1: about 12 KB of window per stored token (vs 2 MiB of fp32 state).
    assert w.nbytes_per_slot() == 4 * (16 * 128 + 32 * 128 + 2 * 32) * 2 + 4


def test_window_allocation_needs_every_size():
    """K and V have no default (a window sized for other heads would only fail at the first
    call); a size that is not a positive int is refused naming it; the repr is shapes and
    dtypes, not tensors; arrays() documents what it gives."""
    with pytest.raises(TypeError, match="'K' and 'V'"):
        gdn.ReplayWindow.allocate(5, 4, H=1, HV=2)
    for name, value in [("K", 0), ("V", -1), ("S", 2.0), ("HV", True)]:
        sizes = dict(slots=5, S=4, H=1, HV=2, K=32, V=32)
        sizes[name] = value
        with pytest.raises(ValueError, match=rf"ReplayWindow.allocate: {name} must be a positive int, got"):
            gdn.ReplayWindow.allocate(**sizes)
    w = gdn.ReplayWindow.allocate(5, 4, H=1, HV=2, K=32, V=16)
    assert w.k.shape == (5, 4, 32) and w.v.shape == (5, 4, 32) and w.a.shape == (5, 4, 2)
    assert repr(w) == (
        "ReplayWindow(k=[5, 4, 32] bfloat16, v=[5, 4, 32] bfloat16, a=[5, 4, 2] bfloat16, "
        "b=[5, 4, 2] bfloat16, len=[5] int32, device=cpu)"
    )
    assert "window_len" in (gdn.ReplayWindow.arrays.__doc__ or "")


def _op_inputs(gen, device="cpu"):
    K = V = 16
    H, HV, S, N = 1, 2, 3, 3
    pool = make_pool(gen, device, N=N, H=H, HV=HV, K=K, V=V, S=S, state_dtype=FP32, act=FP32, first_valid_slot=0)
    pool.window.len.fill_(S)
    pool.pending = [2, 0, 3]
    T = [3, 1, 2]
    inputs = random_inputs(gen, T, H=H, HV=HV, K=K, V=V, act=FP32)
    return pool, inputs, T


def test_opcheck(gen):
    """torch.library.opcheck: schema, fake kernel, mutation and aliasing annotations (the window
    views of one buffer included)."""
    pool, x, T = _op_inputs(gen)
    out = torch.full((sum(T), 2, 16), float("nan"))
    args = (
        x["mixed_qkv"],
        x["a"],
        x["b"],
        x["A_log"],
        x["dt_bias"],
        pool.state,
        pool.slots,
        x["cu_seqlens"],
        out,
        pool.window.k,
        pool.window.v,
        pool.window.a,
        pool.window.b,
        pool.window.len,
        torch.tensor(pool.pending, dtype=torch.int32),
    )
    result = torch.library.opcheck(
        torch.ops.gdn.decode_mtp_replay.default, args, dict(z=x["z"], norm_weight=x["norm_weight"])
    )
    assert all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.filterwarnings("ignore::DeprecationWarning:torch.jit._script")
def test_torch_compile_fullgraph(gen):
    """A compiled step that slices the window views out of their buffers, as a model would."""
    torch._dynamo.reset()
    HV, HK = 2, 16

    def step(qkv, ba, A_log, dt_bias, z, w, state, slots, cu, out, window_kv, window_ab, length, accepted):
        torch.ops.gdn.decode_mtp_replay(
            qkv,
            ba[:, :HV],
            ba[:, HV:],
            A_log,
            dt_bias,
            state,
            slots,
            cu,
            out,
            window_kv[..., :HK],
            window_kv[..., HK:],
            window_ab[..., :HV],
            window_ab[..., HV:],
            length,
            accepted,
            z=z,
            norm_weight=w,
        )

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (step, compiled):
        pool, x, T = _op_inputs(torch.Generator().manual_seed(11))
        out = torch.full((sum(T), 2, 16), float("nan"))
        ba = torch.cat([x["a"], x["b"]], 1)
        kv = pool.window.k.untyped_storage()
        window_kv = torch.empty(0).set_(kv, 0, (pool.state.shape[0], 3, HK + 2 * 16), pool.window.k.stride())
        ab = pool.window.a.untyped_storage()
        window_ab = torch.empty(0).set_(ab, 0, (pool.state.shape[0], 3, 2 * HV), pool.window.a.stride())
        fn(
            x["mixed_qkv"],
            ba,
            x["A_log"],
            x["dt_bias"],
            x["z"],
            x["norm_weight"],
            pool.state,
            pool.slots,
            x["cu_seqlens"],
            out,
            window_kv,
            window_ab,
            pool.window.len,
            torch.tensor(pool.pending, dtype=torch.int32),
        )
        results.append((out, pool.state, window_kv, window_ab, pool.window.len))
    for eager, comp in zip(*results):
        assert torch.equal(eager, comp)


@pytest.mark.gpu
@pytest.mark.skipif(_CUDA is not None, reason=f"CUDA replay: {_CUDA}")
def test_cuda_graph_capture_and_replay(gen):
    """One captured call replayed over a chain (new tokens and counts copied into the captured
    buffers each step) gives the bits of the same chain run eagerly."""
    H, HV, K, V, N, S = 1, 2, 128, 128, 3, 3
    T = [3, 2, 3]
    params = layer_params(gen, HV)
    steps = [random_inputs(gen, T, H=H, HV=HV, K=K, V=V, act=BF16, params=params) for _ in range(4)]
    counts = [[0, 0, 0]] + [torch.randint(0, 3, (N,), generator=gen).tolist() for _ in range(3)]
    pools = [
        make_pool(
            torch.Generator().manual_seed(5),
            "cuda",
            N=N,
            H=H,
            HV=HV,
            K=K,
            V=V,
            S=S,
            state_dtype=FP32,
            act=BF16,
            first_valid_slot=0,
        )
        for _ in range(2)
    ]
    eager_outs = []
    for x, n in zip(steps, counts):
        pools[0].pending = n
        eager_outs.append(replay_step(pools[0], x, T, device="cuda"))

    static = to(steps[0], "cuda")
    accepted = torch.zeros(N, dtype=torch.int32, device="cuda")
    out = torch.empty(sum(T), HV, V, dtype=BF16, device="cuda")
    pool = pools[1]

    def call():
        gdn.decode_mtp_replay(
            static["mixed_qkv"],
            static["a"],
            static["b"],
            static["A_log"],
            static["dt_bias"],
            pool.state,
            pool.slots.cuda(),
            static["cu_seqlens"],
            out,
            **pool.window.arrays(),
            num_accepted_tokens=accepted,
            z=static["z"],
            norm_weight=static["norm_weight"],
        )

    slots = pool.slots.cuda()
    pool.slots = slots  # the captured call reads this device tensor
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture, on the same state as step 0
        snapshot = [t.clone() for t in (pool.state, *pool.window.arrays().values())]
        call()
        for t, s in zip((pool.state, *pool.window.arrays().values()), snapshot):
            t.copy_(s)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for step, (x, n) in enumerate(zip(steps, counts)):
        for name, t in static.items():
            if isinstance(t, torch.Tensor):
                t.copy_(x[name])
        accepted.copy_(torch.tensor(n, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager_outs[step]), f"step {step}"
    assert torch.equal(pool.state, pools[0].state)
    for name, t in pool.window.arrays().items():
        assert torch.equal(t, pools[0].window.arrays()[name]), name
