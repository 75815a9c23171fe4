"""Python signatures of the operations, over any DLPack arrays."""

from __future__ import annotations

from typing import Any, Optional

from . import _C


def _stream_of(x: Any, stream: Optional[int]) -> Optional[int]:
    """The CUDA stream to launch on: the one given, else torch's current stream for torch tensors,
    else CuPy's current stream for CuPy arrays (None: the legacy default stream)."""
    if stream is not None:
        return int(stream)
    device = getattr(x, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        return torch.cuda.current_stream(device).cuda_stream
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        with x.device:
            return int(cupy.cuda.get_current_stream().ptr)
    return None


def decode_mtp(
    mixed_qkv: Any,
    a: Any,
    b: Any,
    A_log: Any,
    dt_bias: Any,
    state: Any,
    state_indices: Any,
    cu_seqlens: Any,
    out: Any,
    *,
    z: Any = None,
    norm_weight: Any = None,
    num_accepted_tokens: Any = None,
    scale: Optional[float] = None,
    l2_eps: float = 1e-6,
    norm_eps: float = 1e-6,
    gate: str = "silu",
    state_layout: str = "vk",
    first_valid_slot: int = 0,
    num_k_heads: int = 0,
    error_count: Any = None,
    stream: Optional[int] = None,
) -> None:
    """Fused GDN decode / MTP verify (contract: docs decode-mtp.md).

    For each request i (rows ``cu_seqlens[i]:cu_seqlens[i+1]`` of ``mixed_qkv``) and value head,
    reads the state from slot ``state_indices[i, num_accepted_tokens[i] - 1]``, runs the gated
    delta rule over the request's T tokens, writes the state after token t to slot
    ``state_indices[i, t]`` and the gated-RMSNorm'd output to ``out``. Slot ids below
    ``first_valid_slot`` are null (no write). Host-visible invalid input raises ``ValueError``
    before anything is written. CUDA arrays run on ``stream`` (default: torch's current stream for
    torch tensors, else the legacy default stream).
    """
    _C.decode_mtp(
        mixed_qkv, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, out,
        z=z, norm_weight=norm_weight, num_accepted_tokens=num_accepted_tokens, scale=scale,
        l2_eps=l2_eps, norm_eps=norm_eps, gate=gate, state_layout=state_layout,
        first_valid_slot=first_valid_slot, num_k_heads=num_k_heads, error_count=error_count,
        stream=_stream_of(state, stream),
    )
