"""decode_mtp: the fused GDN decode / MTP-verify step, its guard and its float64 reference.

:func:`decode_mtp` runs the step on any DLPack arrays (CPU or CUDA); :func:`can_use_decode_mtp`
says which kernel path a configuration takes; :func:`decode_mtp_reference` is a slow, obvious
float64 NumPy version of the same call, for self-checks and users' tests. The function
``gdn.decode_mtp`` shadows this module's name in the package, so reach the reference as
``gdn.reference.decode_mtp_reference`` (or ``from gdn.decode_mtp import decode_mtp_reference``).
"""

from __future__ import annotations

import re
from typing import Any, Optional, Tuple, Union

import numpy as np

from . import _C
from ._common import Input, Output, calls_binding, traced_as_torch_op

__all__ = ["can_use_decode_mtp", "decode_mtp", "decode_mtp_reference"]


@traced_as_torch_op
@calls_binding("decode_mtp", stream_of="state")
def decode_mtp(
    mixed_qkv: Input,
    a: Input,
    b: Input,
    A_log: Optional[Input],
    dt_bias: Optional[Input],
    state: Output,
    state_indices: Input,
    cu_seqlens: Input,
    out: Output,
    *,
    z: Optional[Input] = None,
    norm_weight: Optional[Input] = None,
    num_accepted_tokens: Optional[Input] = None,
    scale: Optional[float] = None,
    l2_eps: float = 1e-6,
    norm_eps: float = 1e-6,
    gate: str = "silu",
    state_layout: str = "vk",
    first_valid_slot: int = 0,
    num_k_heads: int = 0,
    round_core_output: bool = False,
    a_is_log_decay: bool = False,
    b_is_beta: bool = False,
    qk_l2_norm: bool = True,
    error_count: Optional[Output] = None,
    stream: Optional[int] = None,
) -> None:
    """Fused GDN decode / MTP verify: updates the ``state`` pool in place and writes ``out``.

    For each of N requests and each value head, runs the gated delta rule over the request's
    T verify tokens starting from a state read out of a slot pool, writes the state after every
    token to that token's slot and the gated-RMSNorm'd output of every token to ``out``. Per
    token: q, k L2-normalised (``x * rsqrt(sum(x^2) + l2_eps)``), q times ``scale``;
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; with M the head's [V, K]
    state: ``M = exp(g) M``, ``M += beta (v - M k) k^T``, ``o = M q``; then
    ``out = o * rsqrt(mean(o^2) + norm_eps) * norm_weight * act(z)``. The options
    ``a_is_log_decay`` (g = a), ``b_is_beta`` (beta = b) and ``qk_l2_norm=False`` (no L2 norm)
    change what ``a``, ``b``, q and k hold.

    Sizes: L token rows, N requests, S = columns of ``state_indices`` (num_spec + 1), H key heads,
    HV value heads (a multiple of H), K key / V value head dims. Arrays are any DLPack or
    buffer-protocol arrays (torch, NumPy, CuPy, JAX, ...), all on the device of ``state``.

    Arguments (dtypes: f32 = float32, bf16, f16; strides in elements):

    - ``mixed_qkv`` [L, 2*H*K + HV*V], f32/bf16/f16: post-conv q | k | v, head-major. Unit column
      stride, any row stride (a column slice of a wider projection is fine).
    - ``a``, ``b`` [L, HV], f32/bf16/f16: decay and beta pre-activations. Unit column stride, any
      row stride (e.g. the two halves of one ``ba`` tensor).
    - ``A_log``, ``dt_bias`` [HV], f32/bf16/f16, contiguous; None only with ``a_is_log_decay``.
    - ``state``: the slot pool, f32/bf16/f16, updated in place. ``state_layout="vk"`` (default):
      [slots, HV, V, K] (K contiguous, vLLM's layout); ``"kv"``: [slots, HV, K, V]. The inner three
      dims contiguous; the slot stride may be larger (paged pools). 16-bit states are stored with
      round-to-nearest-even; the math stays in float32.
    - ``state_indices`` [N, S], int32/int64, contiguous rows: the slot of each verify position.
    - ``cu_seqlens`` [N + 1], int32/int64, contiguous: request i owns token rows
      ``cu_seqlens[i]:cu_seqlens[i+1]`` (T_i = their count, 0 <= T_i <= S).
    - ``out`` [L, HV, V], f32/bf16/f16, contiguous: written, never read.
    - ``z`` [L, HV, V] or None, f32/bf16/f16, unit stride on V: the output gate input. Needs
      ``norm_weight``.
    - ``norm_weight`` [V] or None, f32/bf16/f16, contiguous: the RMSNorm weight (used as is, not
      1 + w). None: ``out = o`` (no norm, no gate).
    - ``num_accepted_tokens`` [N] or None (all 1), int32/int64, contiguous: the previous step's
      accepted count acc_i in [1, S].
    - ``scale``: q scale, None for K ** -0.5. ``l2_eps``, ``norm_eps``: the q/k L2-norm and
      RMSNorm epsilons (note vLLM's layer uses ``norm_eps`` 1e-5).
    - ``gate``: activation of ``z``, ``"silu"`` (or ``"swish"``) or ``"sigmoid"``.
    - ``state_layout``: ``"vk"`` or ``"kv"``, as above.
    - ``first_valid_slot``: slot ids below it are null (default 0, so negative ids are null;
      vLLM reserves block 0 and passes 1).
    - ``num_k_heads``: H, checked against the ``mixed_qkv`` width; 0 derives it from the width.
    - ``round_core_output``: round the core output o to ``out``'s dtype before the gated RMSNorm,
      as vLLM's kernels do (its tests compare at that rounding). Default False: o enters the norm
      in float32, which is more exact.
    - ``a_is_log_decay``, ``b_is_beta``, ``qk_l2_norm``: how ``a``, ``b``, q and k are read (the
      defaults are the model layer's; the others take inputs prepared as FLA's kernels take them,
      see ``gdn.compat.fla``). ``a_is_log_decay=True``: ``a`` holds the log-decay g itself
      (alpha = exp(a), computed in float32); ``A_log`` and ``dt_bias`` are not read and may be
      None. g <= 0 is expected (a decay), as the model's and FLA's gates give. ``b_is_beta=True``:
      ``b`` holds beta itself (no sigmoid). ``qk_l2_norm=False``: q and k are used as given, no
      L2 normalisation (q is still multiplied by ``scale``; ``l2_eps`` is unused).
    - ``error_count`` int32 [1] or None: on the GPU, incremented once per invalid request row.
    - ``stream``: CUDA stream handle for CUDA arrays; default torch's current stream for torch
      tensors, CuPy's for CuPy arrays, else the legacy default stream. Ignored on the CPU.

    Slots read and written, per request i with T_i > 0: the initial state is read completely
    from slot ``state_indices[i, acc_i - 1]`` before anything is written; the state after token
    t (t < T_i) is written to slot ``state_indices[i, t]`` unless that id is null (below
    ``first_valid_slot``: the write is skipped, the output still produced). No other slot
    changes. A row with T_i = 0 is padding (e.g. a CUDA-graph batch filler): no state is read or
    written for it.

    Mutated: ``state`` (the destination slots above), ``out`` (the requests' token rows) and, on
    the GPU, ``error_count``. The other arguments are only read; nothing is returned.

    Errors. Every shape, dtype, stride and device mismatch raises ``ValueError`` naming the
    argument before anything runs; a value the binding cannot take (a list, a read-only ``out``,
    a meta tensor, a string) raises ``TypeError`` naming the argument and what it got. A request
    row is invalid when T_i > S, acc_i is outside [1, S], its source slot is null, or a slot id is
    >= the pool's slot count. CPU (or host-visible index arrays): the whole call is validated
    first and an invalid row raises ``ValueError`` naming the row, before anything is written.
    GPU (indices in device memory, no host sync): an invalid row writes no state, its ``out``
    rows are zero-filled and ``error_count`` (when given) is incremented; check it when you
    synchronise. Duplicate destination slots across requests are the caller's bug.

    Accuracy: all math runs in float32 (q, k, g, beta and o never rounded to 16 bits). Against
    the float64 reference ``gdn.reference.decode_mtp_reference`` fed the same inputs, fp32 state
    and activations stay within 1e-5 relative L2 on ``out`` and every written state; 16-bit
    activations add only the rounding of ``out`` (<= 4e-3); a 16-bit state stays within 1e-2
    after 3 chained steps.
    Running T tokens in one call and accepting n of them gives the same state as n calls of
    one token (bit for bit on the CPU with an fp32 state).

    :func:`can_use_decode_mtp` says whether a configuration takes the fast, generic or no path;
    ``torch.ops.gdn.decode_mtp`` is the same call as a torch custom op (all but ``stream``).
    """


# ---- the guard ----------------------------------------------------------------------------------

_DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "f32": "float32",
    "float": "float32",
    "single": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
}


def _dtype_name(dtype: Any) -> str:
    """'float32', 'bfloat16' or 'float16' for a name, alias, torch dtype or NumPy dtype."""
    if isinstance(dtype, str):
        key = dtype
    elif type(dtype).__module__.split(".")[0] == "torch":
        key = str(dtype)  # torch.bfloat16 -> "torch.bfloat16"
    else:
        try:
            key = np.dtype(dtype).name  # NumPy dtypes and scalar types, ml_dtypes.bfloat16
        except TypeError:
            key = str(dtype)
    key = key.strip().lower()
    for prefix in ("torch.", "numpy.", "np."):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    if key not in _DTYPE_NAMES:
        raise ValueError(
            f"state_dtype must be float32, bfloat16 or float16 (also 'fp32', 'bf16', "
            f"'fp16', or a torch / NumPy dtype), got {dtype!r}"
        )
    return _DTYPE_NAMES[key]


def _parse_device(device: Any, device_index: Optional[int]) -> Tuple[str, int]:
    """('cpu' | 'cuda', index) from 'cpu', 'cuda', 'cuda:1' or a torch.device."""
    text = str(device).strip().lower()
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if index and device_index is not None and int(index) != device_index:
        raise ValueError(f"device {device!r} and device_index={device_index} disagree")
    return kind, int(index) if index else (device_index or 0)


def _parse_arch(arch: Any) -> Tuple[int, int]:
    """(major, minor) from "sm_90", "sm_90a", "compute_90", "90", "9.0", 90 or (9, 0)."""
    if isinstance(arch, (tuple, list)) and len(arch) == 2:
        return int(arch[0]), int(arch[1])
    if isinstance(arch, int) and not isinstance(arch, bool):
        return divmod(arch, 10)
    if isinstance(arch, str):
        m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+)(?:\.(\d+))?[af]?", arch.strip().lower())
        if m and m.group(2) is not None:
            return int(m.group(1)), int(m.group(2))
        if m:
            return divmod(int(m.group(1)), 10)
    raise ValueError(f"arch must name a CUDA architecture like 'sm_90', 90 or (9, 0), got {arch!r}")


def _arch_support(major: int, minor: int) -> Tuple[bool, str]:
    """Whether this build holds a kernel image that runs on sm_<major><minor>, and why (from the
    compiled architecture list, as CMake's CUDA_ARCHITECTURES entries)."""
    target = f"sm_{major}{minor}"
    if not _C.built_with_cuda:
        return False, "this build of gdn has no CUDA kernels"
    entries = [e.strip() for e in str(_C.cuda_architectures).replace(";", ",").split(",") if e.strip()]
    unknown = []
    for entry in entries:
        if entry in ("all", "all-major"):
            return True, f"this build compiled every architecture ({entry})"
        m = re.fullmatch(r"(\d+)([af]?)(?:-(real|virtual))?", entry)
        if not m:
            unknown.append(entry)
            continue
        emajor, eminor = divmod(int(m.group(1)), 10)
        suffix, part = m.group(2), m.group(3)
        same_family = emajor == major and (minor == eminor if suffix == "a" else minor >= eminor)
        if part != "virtual" and same_family:
            return True, f"this build has sm_{m.group(1)}{suffix} code for {target}"
        later = (major, minor) >= (emajor, eminor) if not suffix else same_family
        if part != "real" and later:
            return True, (f"this build's compute_{m.group(1)}{suffix} PTX is compiled for {target} when first loaded")
    listed = ", ".join(entries) or "none"
    if unknown:
        return False, (
            f"cannot tell whether this build runs on {target}: its architecture list "
            f"({listed}) names {', '.join(unknown)}"
        )
    return False, f"this build has no kernel image for {target} (compiled architectures: {listed})"


def can_use_decode_mtp(
    device: Any,
    H: int,
    HV: int,
    K: int = 128,
    V: int = 128,
    S: int = 1,
    state_dtype: Any = "float32",
    device_index: Optional[int] = None,
    state_layout: str = "vk",
    *,
    arch: Union[str, int, Tuple[int, int], None] = None,
) -> Tuple[str, str]:
    """Which path :func:`decode_mtp` takes for a configuration: ``(path, reason)``, path
    ``"fast"`` (a kernel specialised for the head ratio HV / H), ``"generic"`` (a run-time-ratio
    or slow-layout kernel) or ``"unsupported"``, and a one-sentence reason.

    - ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device``; ``device_index``
      names the GPU otherwise (default 0).
    - ``H``, ``HV``, ``K``, ``V``: key / value heads and head dims; ``S``: columns of
      ``state_indices`` (num_spec + 1).
    - ``state_dtype``: ``"float32"``, ``"bfloat16"``, ``"float16"``, an alias (``"fp32"``,
      ``"bf16"``, ``"fp16"``, ``"half"``, ...), a torch dtype or a NumPy dtype.
    - ``state_layout``: ``"vk"`` or ``"kv"`` (the CUDA kernel's slow path).
    - ``arch``: answer for a CUDA architecture (``"sm_90"``, ``90``, ``(9, 0)``) from this build's
      compiled architecture list instead of probing a device, so no GPU is needed.

    The supported set is the library's (C++) list; the CPU path runs every integral ratio.
    """
    kind, index = _parse_device(device, device_index)
    dtype = _dtype_name(state_dtype)
    extra: dict[str, Any] = {}
    if arch is not None:
        if kind != "cuda":
            raise ValueError(f"arch= names a CUDA architecture; device must be 'cuda', got {device!r}")
        ok, why = _arch_support(*_parse_arch(arch))
        extra = dict(cuda_available=ok, cuda_reason=why)
    path, reason = _C.can_use_decode_mtp(kind, H, HV, K, V, S, dtype, index, state_layout, **extra)
    if extra.get("cuda_available") and path != "unsupported":
        reason += "; " + extra["cuda_reason"]  # which image runs it
    return path, reason


# ---- float64 reference --------------------------------------------------------------------------


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def decode_mtp_reference(
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
    scale: Optional[float] = None,
    l2_eps=1e-6,
    norm_eps=1e-6,
    gate="silu",
    state_layout="vk",
    first_valid_slot=0,
    a_is_log_decay=False,
    b_is_beta=False,
    qk_l2_norm=True,
):
    """Float64 reference of :func:`decode_mtp` (docs gdn-math.md §7): slow and obvious on purpose,
    looping over requests and tokens, vectorised over value heads. Takes NumPy-convertible host
    arrays and valid input; leaves the inputs untouched. ``a_is_log_decay``, ``b_is_beta`` and
    ``qk_l2_norm`` are :func:`decode_mtp`'s (``A_log``, ``dt_bias`` may then be None).

    Returns ``(out [L, HV, V], new_state)`` as float64: ``new_state`` in the layout of ``state``
    ("vk": [slots, HV, V, K]; "kv": [slots, HV, K, V]); rows of ``out`` no request covers are NaN.
    """
    x = _f64(mixed_qkv)
    pool = _f64(state).copy()
    if state_layout == "kv":
        pool = pool.transpose(0, 1, 3, 2).copy()  # work in [slots, HV, V, K]
    _, HV, V, K = pool.shape
    H = (x.shape[1] - HV * V) // (2 * K)
    r = HV // H
    scale = K**-0.5 if scale is None else scale
    idx = np.asarray(state_indices, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    N, S = idx.shape
    acc = np.ones(N, np.int64) if num_accepted_tokens is None else np.asarray(num_accepted_tokens, np.int64)
    A = None if a_is_log_decay else -np.exp(_f64(A_log))
    dtb = None if a_is_log_decay else _f64(dt_bias)
    out = np.full((x.shape[0], HV, V), np.nan)
    kh = np.arange(HV) // r
    for i in range(N):
        T = int(cu[i + 1] - cu[i])
        if T == 0:
            continue
        M = pool[idx[i, acc[i] - 1]].copy()  # [HV, V, K], read before any write
        for t in range(T):
            row = x[cu[i] + t]
            q = row[: H * K].reshape(H, K)[kh]
            k = row[H * K : 2 * H * K].reshape(H, K)[kh]
            v = row[2 * H * K :].reshape(HV, V)
            if qk_l2_norm:
                q = q / np.sqrt((q * q).sum(-1, keepdims=True) + l2_eps)
                k = k / np.sqrt((k * k).sum(-1, keepdims=True) + l2_eps)
            q = q * scale
            if a_is_log_decay:
                alpha = np.exp(_f64(a)[cu[i] + t])
            else:
                xa = _f64(a)[cu[i] + t] + dtb
                sp = np.where(xa > 20, xa, np.log1p(np.exp(np.minimum(xa, 20))))
                alpha = np.exp(A * sp)
            bb = _f64(b)[cu[i] + t]
            beta = bb if b_is_beta else 1.0 / (1.0 + np.exp(-bb))
            M = M * alpha[:, None, None]
            u = np.einsum("hvk,hk->hv", M, k)
            delta = beta[:, None] * (v - u)
            M = M + delta[:, :, None] * k[:, None, :]
            o = np.einsum("hvk,hk->hv", M, q)
            if norm_weight is not None:
                o = o / np.sqrt((o * o).mean(-1, keepdims=True) + norm_eps) * _f64(norm_weight)
                if z is not None:
                    zz = _f64(z)[cu[i] + t]
                    o = o * (zz / (1 + np.exp(-zz)) if gate in ("silu", "swish") else 1 / (1 + np.exp(-zz)))
            out[cu[i] + t] = o
            if idx[i, t] >= first_valid_slot:
                pool[idx[i, t]] = M
    if state_layout == "kv":
        pool = pool.transpose(0, 1, 3, 2)
    return out, pool
