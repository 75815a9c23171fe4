"""torch custom ops of the metadata builder (destination-passing, return nothing).

``torch.ops.gdn.metadata_state_rows`` is the device part (one CUDA launch for every group's state
rows, on torch's current stream; a CPU kernel backs it for CPU tensors).
``torch.ops.gdn.metadata_plan`` is the host plan over CPU tensors, for code that stays in torch.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from . import metadata as _metadata


@torch.library.custom_op("gdn::metadata_plan", mutates_args=("plan",))
def metadata_plan(
    plan: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_draft_tokens: Optional[torch.Tensor],
    num_accepted_tokens: Optional[torch.Tensor],
    num_computed_tokens: Optional[torch.Tensor],
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    cache_mode: str = "none",
    block_size: int = 0,
    padded_rows: int = -1,
    pad_id: int = 0,
) -> None:
    """torch op form of :func:`gdn.metadata.plan` (host tensors; ``cache_mode`` is its ``mode``;
    ``padded_rows`` -1: none)."""
    _metadata.plan(
        plan, query_start_loc, seq_lens, num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=num_accepted_tokens, num_computed_tokens=num_computed_tokens,
        num_spec=num_spec, max_rows=max_rows, max_tokens=max_tokens, mode=cache_mode,
        block_size=block_size, padded_rows=None if padded_rows < 0 else padded_rows,
        pad_id=pad_id,
    )


@metadata_plan.register_fake
def _(plan, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens, num_computed_tokens,
      num_spec, max_rows, max_tokens, cache_mode="none", block_size=0, padded_rows=-1,
      pad_id=0) -> None:
    return None


@torch.library.custom_op(
    "gdn::metadata_state_rows",
    mutates_args=("plan", "spec_state_indices", "non_spec_state_indices", "error_count"),
)
def metadata_state_rows(
    plan: torch.Tensor,
    block_tables: List[torch.Tensor],
    spec_state_indices: torch.Tensor,
    non_spec_state_indices: torch.Tensor,
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    pad_id: int = 0,
    launch_rows: int = 0,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    error_count: Optional[torch.Tensor] = None,
) -> None:
    """torch op form of :func:`gdn.metadata.state_rows` (``plan`` is written only when
    ``num_accepted_tokens`` is gathered)."""
    _metadata.state_rows(
        plan, block_tables, spec_state_indices, non_spec_state_indices, num_spec=num_spec,
        max_rows=max_rows, max_tokens=max_tokens, pad_id=pad_id, launch_rows=launch_rows,
        num_accepted_tokens=num_accepted_tokens, error_count=error_count,
    )


@metadata_state_rows.register_fake
def _(plan, block_tables, spec_state_indices, non_spec_state_indices, num_spec, max_rows,
      max_tokens, pad_id=0, launch_rows=0, num_accepted_tokens=None, error_count=None) -> None:
    return None
