"""torch custom op ``torch.ops.gdn.causal_conv1d_update`` (destination-passing, returns nothing)."""

from __future__ import annotations

from typing import Optional

import torch

from . import conv as _conv


@torch.library.custom_op("gdn::causal_conv1d_update", mutates_args=("conv_state", "out"))
def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    conv_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    activation: str = "silu",
    state_layout: str = "channels_major",
    first_valid_slot: int = 0,
    error_count: Optional[torch.Tensor] = None,
) -> None:
    """torch op form of :func:`gdn.causal_conv1d_update` (same arguments). ``out`` must not be
    ``x`` here (torch ops may not alias a mutated argument with another input); call
    :func:`gdn.causal_conv1d_update` directly for in-place use."""
    _conv.causal_conv1d_update(
        x, weight, conv_state, conv_state_indices, cu_seqlens, out,
        num_accepted_tokens=num_accepted_tokens, activation=activation,
        state_layout=state_layout, first_valid_slot=first_valid_slot, error_count=error_count,
    )


@causal_conv1d_update.register_fake
def _(x, weight, conv_state, conv_state_indices, cu_seqlens, out, num_accepted_tokens=None,
      activation="silu", state_layout="channels_major", first_valid_slot=0,
      error_count=None) -> None:
    return None
