"""The Python tests' own float64 reference of decode_mtp, plus random cases and comparisons.

Written independently of ``gdn.reference``: torch float64, the state kept K-first (M = S^T, [K, V]
per head), the update in the paper's product form M <- alpha (I - beta k k^T) M + beta k v^T, and
the loop running over token positions with all requests that still have a token at that position
processed together. Math: docs gdn-math.md §1, §2.3-2.8, §7; slot rules: decode-mtp.md §3.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

F64 = torch.float64
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32

# Bars of decode-mtp.md §6.
FP32_BAR = 1e-5  # fp32 state and activations: outputs and every written state
OUT16_BAR = 4e-3  # 16-bit activations: the rounding of out only
STATE16_BAR = 1e-2  # 16-bit state after 3 chained steps


def out_bar(act) -> float:
    return FP32_BAR if act == FP32 else OUT16_BAR


def state_bar(state_dtype) -> float:
    return FP32_BAR if state_dtype == FP32 else STATE16_BAR


def _f64(x) -> Optional[torch.Tensor]:
    return None if x is None else torch.as_tensor(x).to(F64)


def _ints(x) -> List[int]:
    return [int(v) for v in torch.as_tensor(x).reshape(-1).tolist()]


@dataclasses.dataclass
class RefResult:
    out: torch.Tensor  # [L, HV, V] float64, NaN on rows no request covers
    pool: torch.Tensor  # the state pool after the call, float64, caller's layout
    written: Dict[int, Tuple[int, int]]  # slot -> (request, token) that wrote it last
    states: Dict[Tuple[int, int], torch.Tensor]  # (request, token) -> state after it


def decode_mtp_ref(
    mixed_qkv,
    a,
    b,
    A_log,
    dt_bias,
    state,
    state_indices,
    cu_seqlens,
    *,
    z=None,
    norm_weight=None,
    num_accepted_tokens=None,
    scale=None,
    l2_eps=1e-6,
    norm_eps=1e-6,
    gate="silu",
    state_layout="vk",
    first_valid_slot=0,
    round_core_output_to=None,
) -> RefResult:
    """float64 decode_mtp. Inputs are read exactly as stored (16-bit values upcast exactly) and
    left untouched. Expects valid input (the tests check validation against the library).
    ``round_core_output_to``: a torch dtype o is rounded to before the norm (vLLM's numerics)."""
    X = _f64(mixed_qkv)
    pool = _f64(state).clone()
    if state_layout == "vk":  # [slots, HV, V, K] -> K-first [slots, HV, K, V]
        pool = pool.transpose(-1, -2)
    elif state_layout != "kv":
        raise ValueError(state_layout)
    num_slots, HV, K, V = pool.shape
    H = (X.shape[1] - HV * V) // (2 * K)
    assert 2 * H * K + HV * V == X.shape[1] and HV % H == 0
    r = HV // H
    scale = K**-0.5 if scale is None else float(scale)
    idx = torch.as_tensor(state_indices).to(torch.int64)
    N, S = idx.shape
    cu = _ints(cu_seqlens)
    acc = [1] * N if num_accepted_tokens is None else _ints(num_accepted_tokens)
    Ts = [cu[i + 1] - cu[i] for i in range(N)]

    decay_rate = torch.exp(_f64(A_log))  # g = -exp(A_log) * softplus(a + dt_bias)
    dtb = _f64(dt_bias)
    A_, B_ = _f64(a), _f64(b)
    Z = _f64(z)
    w = _f64(norm_weight)

    def heads(x: torch.Tensor) -> torch.Tensor:  # [n, H, K] -> [n, HV, K], value head hv <- hv // r
        return x.unsqueeze(2).expand(x.shape[0], H, r, K).reshape(x.shape[0], HV, K)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + l2_eps)

    out = torch.full((X.shape[0], HV, V), float("nan"), dtype=F64)
    live = [i for i in range(N) if Ts[i] > 0]
    # Every request's initial state is gathered before any write.
    M = {i: pool[int(idx[i, acc[i] - 1])].clone() for i in live}
    written: Dict[int, Tuple[int, int]] = {}
    states: Dict[Tuple[int, int], torch.Tensor] = {}
    eye = torch.eye(K, dtype=F64)
    for t in range(max([Ts[i] for i in live], default=0)):
        reqs = [i for i in live if Ts[i] > t]
        rows = torch.tensor([cu[i] + t for i in reqs])
        x = X[rows]
        q = heads(unit(x[:, : H * K].reshape(-1, H, K))) * scale
        k = heads(unit(x[:, H * K : 2 * H * K].reshape(-1, H, K)))
        v = x[:, 2 * H * K :].reshape(-1, HV, V)
        alpha = torch.exp(-decay_rate * F.softplus(A_[rows] + dtb, beta=1.0, threshold=20.0))
        beta = torch.sigmoid(B_[rows])
        Mt = torch.stack([M[i] for i in reqs])  # [n, HV, K, V]
        P = eye - beta[..., None, None] * k[..., :, None] * k[..., None, :]  # I - beta k k^T
        write = beta[..., None, None] * k[..., :, None] * v[..., None, :]  # beta k v^T
        Mt = alpha[..., None, None] * (P @ Mt) + write
        o = (Mt * q[..., :, None]).sum(-2)  # o = M^T q, [n, HV, V]
        if round_core_output_to is not None:
            o = o.to(round_core_output_to).to(F64)
        if w is not None:
            o = o * torch.rsqrt((o * o).mean(-1, keepdim=True) + norm_eps) * w
            if Z is not None:
                zz = Z[rows]
                o = o * (F.silu(zz) if gate in ("silu", "swish") else torch.sigmoid(zz))
        out[rows] = o
        for n, i in enumerate(reqs):
            M[i] = Mt[n]
            snap = Mt[n] if state_layout == "kv" else Mt[n].transpose(-1, -2)
            states[(i, t)] = snap.clone()
            dest = int(idx[i, t])
            if dest >= first_valid_slot:
                pool[dest] = Mt[n]
                written[dest] = (i, t)
    if state_layout == "vk":
        pool = pool.transpose(-1, -2)
    return RefResult(out=out, pool=pool.contiguous(), written=written, states=states)


# ---- comparisons ---------------------------------------------------------------------------------


def rel_l2(x, ref) -> float:
    x, ref = _f64(x), _f64(ref)
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref))


# 16-bit state: the stored value is the fp32 state rounded to nearest even. Against the float64
# state rounded the same way, at most one unit in the last place apart, nearly always equal.
_ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def assert_rounded_state(got: torch.Tensor, ref64: torch.Tensor, what: str) -> None:
    dtype = got.dtype
    want = ref64.to(dtype)
    g, wv = got.to(F64), want.to(F64)
    same = (g == wv).double().mean().item()
    # One ulp of the element, plus the fp32 arithmetic error (relative to the whole state) for
    # elements that are small through cancellation.
    allowed = _ULP[dtype] * ref64.abs() + 1e-5 * ref64.pow(2).mean().sqrt()
    worst = ((g - wv).abs() / allowed).max().item()
    assert same >= 0.99, f"{what}: only {same:.4f} of the stored {dtype} values equal RNE(reference)"
    assert worst <= 1.0, f"{what}: a stored {dtype} state element is more than one ulp off"


# ---- random cases --------------------------------------------------------------------------------

ACT = ("mixed_qkv", "a", "b", "z", "out")
PARAM = ("A_log", "dt_bias", "norm_weight")

# Per-array dtypes (make_case's `dtypes`) that mix every activation and parameter dtype, and the
# test ids of those sets.
MIXED_DTYPES = [
    dict(mixed_qkv=BF16, a=FP32, b=FP16, z=FP16, out=FP32, A_log=BF16, dt_bias=FP16, norm_weight=BF16),
    dict(mixed_qkv=FP16, a=BF16, b=BF16, z=FP32, out=BF16, A_log=FP32, dt_bias=BF16, norm_weight=FP16),
    dict(mixed_qkv=FP32, a=FP16, b=FP32, z=BF16, out=FP16, A_log=FP16, dt_bias=FP32, norm_weight=FP32),
]
MIXED_DTYPE_IDS = ["qkv_bf16_out_fp32", "qkv_fp16_out_bf16", "qkv_fp32_out_fp16"]


@dataclasses.dataclass
class Case:
    """One decode_mtp call: tensors (possibly strided views) and the buffers they live in."""

    mixed_qkv: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    state: torch.Tensor
    state_indices: torch.Tensor
    cu_seqlens: torch.Tensor
    out: torch.Tensor
    z: Optional[torch.Tensor]
    norm_weight: Optional[torch.Tensor]
    num_accepted_tokens: Optional[torch.Tensor]
    opts: Dict[str, Any]
    pool_buffer: torch.Tensor  # storage of `state` (a bigger tensor when slots are padded)
    out_buffer: torch.Tensor  # storage of `out` (guard rows around it when strided)
    H: int
    T: List[int]
    acc: List[int]

    def args(self) -> tuple:
        return (
            self.mixed_qkv,
            self.a,
            self.b,
            self.A_log,
            self.dt_bias,
            self.state,
            self.state_indices,
            self.cu_seqlens,
            self.out,
        )

    def kwargs(self) -> Dict[str, Any]:
        return dict(z=self.z, norm_weight=self.norm_weight, num_accepted_tokens=self.num_accepted_tokens, **self.opts)

    def run(self, fn: Optional[Callable] = None, **extra) -> None:
        if fn is None:
            import gdn

            fn = gdn.decode_mtp
        fn(*self.args(), **self.kwargs(), **extra)

    def reference(self) -> RefResult:
        return decode_mtp_ref(*self.args()[:8], **self.kwargs())

    def poison_out(self) -> None:
        self.out_buffer.fill_(float("nan"))

    def token_rows(self) -> List[int]:
        cu = _ints(self.cu_seqlens)
        return [row for i in range(len(self.T)) for row in range(cu[i], cu[i + 1])]


def _randn(gen, *shape, std=1.0, mean=0.0):
    return torch.randn(*shape, generator=gen, dtype=F64) * std + mean


def make_case(
    gen: torch.Generator,
    *,
    H: int = 1,
    HV: int = 2,
    K: int = 32,
    V: int = 32,
    S: int = 4,
    T: Sequence[int] = (1, 4, 0, 3),
    acc: Optional[Sequence[int]] = None,
    act=torch.float32,
    dtypes: Optional[Dict[str, torch.dtype]] = None,
    state_dtype=torch.float32,
    layout: str = "vk",
    gate: str = "silu",
    norm: str = "zw",
    index_dtypes=(torch.int32, torch.int32, torch.int32),
    first_valid_slot: int = 0,
    strided: bool = False,
    null_dests: bool = True,
    extra_rows: int = 0,
    first_row: int = 0,
    spare_slots: int = 3,
    use_acc: bool = True,
    padded_ids: str = "null",
    scale=None,
    l2_eps: float = 1e-6,
    norm_eps: float = 1e-6,
    state_std: float = 0.3,
    A_log_range=(-2.5, 1.0),
    a_mean: float = 0.0,
    qk_scale: float = 1.0,
) -> Case:
    """A random, valid call. `T` lists the tokens of every request (0 = padded row); `acc` its
    num_accepted_tokens (random in 1..S when None); padded rows get null slot ids, or with
    `padded_ids="valid"` slots of their own that must stay untouched. `norm`: "zw" (z and norm
    weight), "w" (norm weight only) or "none". `strided` builds every argument that may be strided
    as a view: mixed_qkv a column slice of a wider tensor, a and b halves of one [L, 2HV] tensor,
    z with padded row and head strides, the state a slot-padded view of a bigger pool, out an
    offset view with guard rows."""
    dt = {name: act for name in ACT}
    dt.update({name: torch.float32 for name in PARAM})
    dt.update(dtypes or {})
    N = len(T)
    assert all(0 <= t <= S for t in T)
    if acc is None:
        acc = [int(v) for v in torch.randint(1, S + 1, (N,), generator=gen)] if use_acc else [1] * N
    acc = list(acc)
    assert use_acc or all(x == 1 for x in acc)
    D = 2 * H * K + HV * V
    cu = [first_row]
    for t in T:
        cu.append(cu[-1] + t)
    L = cu[-1] + extra_rows

    # Slots: every request owns S distinct valid slots; some destinations are nulled out.
    num_slots = first_valid_slot + N * S + spare_slots
    perm = torch.randperm(num_slots - first_valid_slot, generator=gen) + first_valid_slot
    idx = perm[: N * S].reshape(N, S).clone()
    nulls = [first_valid_slot - 1, first_valid_slot - 2, -7]
    for i in range(N):
        if T[i] == 0:
            if padded_ids == "null":
                idx[i] = first_valid_slot - 1
                acc[i] = 1
            continue  # a padded row is never read nor written
        if null_dests:
            for c in range(S):
                if c != acc[i] - 1 and bool(torch.rand((), generator=gen) < 0.3):
                    idx[i, c] = nulls[(i + c) % len(nulls)]

    def cast(x, name):
        return x.to(dt[name])

    qkv = _randn(gen, L, D)
    qkv[:, : 2 * H * K] *= qk_scale
    lo, hi = A_log_range
    A_log = cast(torch.rand(HV, generator=gen, dtype=F64) * (hi - lo) + lo, "A_log")
    dt_bias = cast(_randn(gen, HV, std=0.5), "dt_bias")
    nw = cast(_randn(gen, V, std=0.2, mean=1.0), "norm_weight") if norm in ("zw", "w") else None
    inner = (HV, V, K) if layout == "vk" else (HV, K, V)
    slot_elems = HV * K * V
    pad = 5 if strided else 0
    pool_buffer = _randn(gen, num_slots, slot_elems + pad, std=state_std).to(state_dtype)
    state = pool_buffer[:, :slot_elems].view(num_slots, *inner)

    if strided:
        wide = _randn(gen, L, D + 11)
        wide[:, 3 : 3 + D] = qkv
        mixed_qkv = cast(wide, "mixed_qkv")[:, 3 : 3 + D]
        if dt["a"] == dt["b"]:
            ba = cast(_randn(gen, L, 2 * HV, std=1.0), "a")
            ba[:, :HV] += a_mean
            a, b = ba[:, :HV], ba[:, HV:]
        else:
            a = cast(_randn(gen, L, HV + 3, mean=a_mean), "a")[:, 2 : 2 + HV]
            b = cast(_randn(gen, L, HV + 2), "b")[:, :HV]
        z = cast(_randn(gen, L, HV + 1, V + 3), "z")[:, 1:, :V] if norm == "zw" else None
        out_buffer = torch.empty(L + 3, HV, V, dtype=dt["out"])
        out = out_buffer[1 : 1 + L]
    else:
        mixed_qkv = cast(qkv, "mixed_qkv")
        a = cast(_randn(gen, L, HV, mean=a_mean), "a")
        b = cast(_randn(gen, L, HV), "b")
        z = cast(_randn(gen, L, HV, V), "z") if norm == "zw" else None
        out_buffer = torch.empty(L, HV, V, dtype=dt["out"])
        out = out_buffer
    out_buffer.fill_(float("nan"))

    idt, cdt, adt = index_dtypes
    return Case(
        mixed_qkv=mixed_qkv,
        a=a,
        b=b,
        A_log=A_log,
        dt_bias=dt_bias,
        state=state,
        state_indices=idx.to(idt),
        cu_seqlens=torch.tensor(cu, dtype=cdt),
        out=out,
        z=z,
        norm_weight=nw,
        num_accepted_tokens=torch.tensor(acc, dtype=adt) if use_acc else None,
        opts=dict(
            scale=scale,
            l2_eps=l2_eps,
            norm_eps=norm_eps,
            gate=gate,
            state_layout=layout,
            first_valid_slot=first_valid_slot,
        ),
        pool_buffer=pool_buffer,
        out_buffer=out_buffer,
        H=H,
        T=list(T),
        acc=acc,
    )


def check_case(case: Case, *, out_tol: float, state_tol: float = 1e-5, fn=None) -> RefResult:
    """Runs `fn` (default gdn.decode_mtp) on `case`, out poisoned first, and checks it against the
    reference:
    every covered output row within `out_tol` rel L2; every written slot within `state_tol` rel L2
    (fp32 state) or one RNE rounding of the reference (16-bit state); every other byte of the pool
    buffer unchanged; nothing outside `out` written."""
    ref = case.reference()
    before = case.pool_buffer.clone()
    case.poison_out()
    case.run(fn)
    _compare(case, ref, before, out_tol=out_tol, state_tol=state_tol)
    return ref


def _compare(case: Case, ref: RefResult, before: torch.Tensor, *, out_tol: float, state_tol: float) -> None:
    rows = case.token_rows()
    got = case.out.to(F64)
    for row in rows:
        assert torch.isfinite(got[row]).all(), f"out row {row} not written (NaN left)"
        err = rel_l2(got[row], ref.out[row])
        assert err <= out_tol, f"out row {row}: rel L2 {err:.3g} > {out_tol:g}"
    # Guard rows around an offset `out` view stay poisoned.
    if case.out_buffer.data_ptr() != case.out.data_ptr() or case.out_buffer.shape != case.out.shape:
        lead = (case.out.data_ptr() - case.out_buffer.data_ptr()) // case.out.element_size()
        flat = case.out_buffer.reshape(-1)
        n = case.out.numel()
        assert torch.isnan(flat[:lead]).all() and torch.isnan(flat[lead + n :]).all(), "bytes outside out were written"
    sixteen = case.state.dtype != torch.float32
    touched = set(ref.written)
    for slot in range(case.state.shape[0]):
        if slot in touched:
            i, t = ref.written[slot]
            what = f"slot {slot} (request {i}, token {t})"
            if sixteen:
                assert_rounded_state(case.state[slot], ref.pool[slot], what)
            err = rel_l2(case.state[slot], ref.pool[slot])
            assert err <= state_tol, f"{what}: state rel L2 {err:.3g} > {state_tol:g}"
    # Untouched slots and the padding between slots: bit for bit.
    changed = (case.pool_buffer.view(torch.uint8) != before.view(torch.uint8)).any(-1)
    unexpected = [s for s in changed.nonzero().flatten().tolist() if s not in touched]
    assert not unexpected, f"slots {unexpected} changed but no token writes them"
    if before.shape[1] * before.element_size() > case.state[0].numel() * case.state.element_size():
        slot_bytes = case.state[0].numel() * case.state.element_size()
        pad_now = case.pool_buffer.view(torch.uint8).reshape(before.shape[0], -1)[:, slot_bytes:]
        pad_before = before.view(torch.uint8).reshape(before.shape[0], -1)[:, slot_bytes:]
        assert torch.equal(pad_now, pad_before), "padding between slots was written"


# ---- CUDA availability ---------------------------------------------------------------------------


def cuda_skip_reason() -> Optional[str]:
    """Why CUDA tests cannot run here (None when they can): no GPU (none visible to torch), a
    build of gdn without CUDA kernels, or no kernel image for the device."""
    import gdn

    if not torch.cuda.is_available():
        return "no GPU (torch sees no CUDA device)"
    if not gdn._C.built_with_cuda:
        return "this build of gdn has no CUDA kernels"
    ok, why = gdn.cuda_kernels_available(torch.cuda.current_device())
    return None if ok else why
