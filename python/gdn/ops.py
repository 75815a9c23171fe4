"""torch custom ops ``torch.ops.gdn.*``: thin, destination-passing wrappers over the gdn functions.

They mutate their outputs and return nothing, so they need no fake kernels beyond a no-op and work
under ``torch.compile(fullgraph=True)`` and CUDA graphs (launches go to torch's current stream).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _api

_LIB = "gdn"


@torch.library.custom_op(f"{_LIB}::decode_mtp", mutates_args=("state", "out", "error_count"))
def decode_mtp(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    z: Optional[torch.Tensor] = None,
    norm_weight: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    l2_eps: float = 1e-6,
    norm_eps: float = 1e-6,
    gate: str = "silu",
    state_layout: str = "vk",
    first_valid_slot: int = 0,
    error_count: Optional[torch.Tensor] = None,
) -> None:
    """torch op form of :func:`gdn.decode_mtp` (same arguments, positional or keyword).

    ``error_count`` (int32 [1], optional) is incremented on the GPU for each invalid request row.
    """
    _api.decode_mtp(
        mixed_qkv, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, out,
        z=z, norm_weight=norm_weight, num_accepted_tokens=num_accepted_tokens, scale=scale,
        l2_eps=l2_eps, norm_eps=norm_eps, gate=gate, state_layout=state_layout,
        first_valid_slot=first_valid_slot, error_count=error_count,
    )


@decode_mtp.register_fake
def _(mixed_qkv, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, out, z=None,
      norm_weight=None, num_accepted_tokens=None, scale=None, l2_eps=1e-6, norm_eps=1e-6,
      gate="silu", state_layout="vk", first_valid_slot=0, error_count=None) -> None:
    return None


from . import _ops_conv  # noqa: E402,F401  (torch.ops.gdn.causal_conv1d_update)
from . import _ops_metadata  # noqa: E402,F401  (torch.ops.gdn.metadata_*)
