"""Replay verify: one checkpoint slot per request, one state read and one state write per step at
any MTP depth (docs replay.md).

:func:`decode_mtp_replay` runs a step on any DLPack arrays (CPU or CUDA); :class:`ReplayWindow`
allocates the per-slot window of raw k, v, a, b rows it keeps between steps.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Dict, Optional

from ._common import (
    Input,
    Output,
    describe,
    calls_binding,
    traced_as_torch_op,
)

__all__ = ["ReplayWindow", "decode_mtp_replay"]


@traced_as_torch_op
@calls_binding("decode_mtp_replay", stream_of="state")
def decode_mtp_replay(
    mixed_qkv: Input,
    a: Input,
    b: Input,
    A_log: Optional[Input],
    dt_bias: Optional[Input],
    state: Output,
    state_indices: Input,
    cu_seqlens: Input,
    out: Output,
    window_k: Output,
    window_v: Output,
    window_a: Output,
    window_b: Output,
    window_len: Output,
    num_accepted_tokens: Input,
    *,
    z: Optional[Input] = None,
    norm_weight: Optional[Input] = None,
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
    """Replay verify: GDN decode / MTP verify with one checkpoint slot per request.

    For request i (checkpoint slot s = ``state_indices[i]``, n = ``num_accepted_tokens[i]``,
    T_i new tokens): reads ``state[s]`` once, replays the first n tokens stored in slot s's window
    (the previous step's tokens, of which the previous step accepted n; state only), stores that
    state back to ``state[s]`` (the only state store; none when n = 0), runs the T_i new tokens
    from it and writes their outputs to ``out`` exactly as :func:`gdn.decode_mtp` does, then saves
    the new tokens' raw k, v, a, b rows as slot s's window and sets ``window_len[s] = T_i``. The
    pool needs one slot per request (not num_spec + 1), and every step moves one state in and one
    out whatever the MTP depth.

    Arguments shared with :func:`gdn.decode_mtp` (``mixed_qkv``, ``a``, ``b``, ``A_log``,
    ``dt_bias``, ``out``, ``cu_seqlens``, ``z``, ``norm_weight``, the scalars ``scale``, ``l2_eps``,
    ``norm_eps`` and ``gate``, ``state_layout``, ``first_valid_slot``, ``num_k_heads``,
    ``round_core_output``, ``a_is_log_decay``, ``b_is_beta``, ``qk_l2_norm``, ``error_count``,
    ``stream``) mean exactly what they mean there; the window holds raw inputs, read with the
    options of the call that replays them, so pass the same options on every step. The others:

    - ``state`` [slots, HV, V, K] (or [slots, HV, K, V] for ``"kv"``), f32/bf16/f16: the
      checkpoint pool, updated in place; any slot stride.
    - ``state_indices`` [N], int32/int64, any stride (e.g. column 0 of a block table): each
      request's checkpoint slot. A null id (below
      ``first_valid_slot``) or T_i = 0 makes the row padding: nothing is read or written for it.
    - ``window_k`` [slots, S, H*K] and ``window_v`` [slots, S, HV*V], in ``mixed_qkv``'s dtype;
      ``window_a``, ``window_b`` [slots, S, HV] in the dtypes of ``a`` and ``b``: the raw inputs
      of each slot's last step (unit column stride, any slot / token stride; :class:`ReplayWindow`
      allocates them). S, their dimension 1, is the window capacity: T_i <= S.
    - ``window_len`` [slots] int32: tokens stored in each slot's window; read, then written.
    - ``num_accepted_tokens`` [N] int32/int64: n, the window tokens to replay, 0..window_len[s]
      (0 on a request's first step after prefill; 1 after a plain decode step).

    Mutated: ``state`` (the live rows' checkpoint slots), ``out``, ``window_k``, ``window_v``,
    ``window_a``, ``window_b``, ``window_len`` (the live rows' slots) and ``error_count``.

    Errors: as :func:`gdn.decode_mtp`. A row is invalid when T_i > S, its slot id is >= the pool's
    slot count, n < 0, n > S or n > window_len[s]; two live rows may not share a checkpoint slot.
    With host-visible indices the call raises before anything is written; on the GPU an invalid
    row stores nothing (no checkpoint, window or window_len), zero-fills its ``out`` rows and
    increments ``error_count``.

    Accuracy: with an fp32 state, a chain of replay steps gives the outputs and checkpoints (= the
    states decode_mtp leaves at column acc - 1) of write-every-token :func:`gdn.decode_mtp` on the
    same inputs: bit for bit on the CPU; on CUDA to within 1e-5 relative L2 (the replay kernel
    keeps the state in a lane layout of fewer shuffles per token and its decay as a scalar beside
    it, so its sums add in another order; each mode is deterministic). With a 16-bit state the
    checkpoint is rounded once per step instead of once per token.

    ``torch.ops.gdn.decode_mtp_replay`` is the same call as a torch custom op (all but
    ``stream``).
    """


@dataclasses.dataclass
class ReplayWindow:
    """The window arrays of :func:`decode_mtp_replay` for a pool of ``slots`` checkpoint slots:
    ``k`` and ``v`` are the two column ranges of one [slots, S, H*K + HV*V] buffer, ``a`` and
    ``b`` the two halves of one [slots, S, 2*HV] buffer, ``len`` [slots] int32 (zero: no token
    stored). ``window.arrays()`` gives them as keyword arguments."""

    k: Any
    v: Any
    a: Any
    b: Any
    len: Any

    @classmethod
    def allocate(
        cls,
        slots: int,
        S: int,
        *,
        H: int,
        HV: int,
        K: int,
        V: int,
        dtype: Any = None,
        ab_dtype: Any = None,
        device: Any = "cpu",
    ) -> "ReplayWindow":
        """Zero-filled window for ``slots`` slots of S tokens of H key heads of dim K and HV value
        heads of dim V (the model's sizes, as in the state pool), as torch tensors on ``device``
        (``dtype`` = mixed_qkv's dtype, default bfloat16; ``ab_dtype`` = a and b's dtype, default
        ``dtype``)."""
        import torch

        sizes = {"slots": slots, "S": S, "H": H, "HV": HV, "K": K, "V": V}
        for name, value in sizes.items():
            if not hasattr(value, "__index__") or isinstance(value, bool) or operator.index(value) < 1:
                raise ValueError(f"ReplayWindow.allocate: {name} must be a positive int, got {describe(value)}")
        slots, S, H, HV, K, V = (operator.index(v) for v in sizes.values())
        dtype = torch.bfloat16 if dtype is None else dtype
        ab_dtype = dtype if ab_dtype is None else ab_dtype
        kv = torch.zeros(slots, S, H * K + HV * V, dtype=dtype, device=device)
        ab = torch.zeros(slots, S, 2 * HV, dtype=ab_dtype, device=device)
        length = torch.zeros(slots, dtype=torch.int32, device=device)
        return cls(kv[..., : H * K], kv[..., H * K :], ab[..., :HV], ab[..., HV:], length)

    def arrays(self) -> Dict[str, Any]:
        """The window as :func:`decode_mtp_replay`'s keyword arguments ``window_k``, ``window_v``,
        ``window_a``, ``window_b`` and ``window_len``: ``decode_mtp_replay(..., **window.arrays(),
        ...)``. Views of the window's buffers, not copies."""
        return {"window_k": self.k, "window_v": self.v, "window_a": self.a, "window_b": self.b, "window_len": self.len}

    def nbytes_per_slot(self) -> int:
        """Bytes one slot's window occupies (k, v, a, b and its length)."""
        return (
            sum(int(x[0].numel()) * x.element_size() for x in (self.k, self.v, self.a, self.b))
            + self.len.element_size()
        )

    def __repr__(self) -> str:
        # Shapes and dtypes only: the arrays hold a whole pool's tokens.
        def brief(x: Any) -> str:
            return f"{list(x.shape)} {str(x.dtype).replace('torch.', '')}"

        device = getattr(self.len, "device", "cpu")
        fields = ", ".join(f"{name}={brief(getattr(self, name))}" for name in ("k", "v", "a", "b", "len"))
        return f"ReplayWindow({fields}, device={device})"
