"""torch custom ops ``torch.ops.gdn.*``: thin, destination-passing wrappers over the gdn functions.

They mutate their outputs and return nothing, so they need no fake kernels beyond a no-op and work
under ``torch.compile(fullgraph=True)`` and CUDA graphs (launches go to torch's current stream).

Every op is registered by :func:`_op`: the schema is defined on one ``torch.library.Library`` and
the Python function is the CPU and CUDA kernel. ``torch.library.custom_op`` is not used: on
torch 2.11 its ADInplaceOrView kernel indexes the mutated arguments in the call's ``args`` /
``kwargs``, which the dispatcher has stripped of trailing defaults, so omitting an optional
mutated argument (``error_count=None``) raised ``IndexError``.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from . import _api
from . import conv as _conv
from . import metadata as _metadata

# Kept alive for the process: dropping a Library deregisters its ops.
_LIB = torch.library.Library("gdn", "DEF")


def _fake(*args, **kwargs) -> None:
    # The ops only mutate their (already allocated) arguments; there is no output to describe.
    return None


def _op(mutates_args: Sequence[str]) -> Callable[[Callable[..., None]], object]:
    """Registers ``fn`` as ``torch.ops.gdn.<fn.__name__>`` (schema inferred from its signature,
    ``mutates_args`` marked ``(a!)`` so torch.compile functionalizes them); returns the op."""

    def register(fn: Callable[..., None]) -> object:
        name = fn.__name__
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        _LIB.define(name + schema)
        # The kernel is called with the defaulted trailing arguments stripped; fn's own Python
        # defaults (the schema's, by construction) fill them back in.
        for key in ("CPU", "CUDA"):
            _LIB.impl(name, fn, key)
        torch.library.register_fake(f"gdn::{name}", _fake, lib=_LIB)
        return getattr(torch.ops.gdn, name)

    return register


@_op(mutates_args=("state", "out", "error_count"))
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


@_op(mutates_args=("conv_state", "out", "error_count"))
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
    :func:`gdn.causal_conv1d_update` directly for in-place use. ``error_count`` (int32 [1],
    optional) is incremented on the GPU for each invalid request row."""
    _conv.causal_conv1d_update(
        x, weight, conv_state, conv_state_indices, cu_seqlens, out,
        num_accepted_tokens=num_accepted_tokens, activation=activation,
        state_layout=state_layout, first_valid_slot=first_valid_slot, error_count=error_count,
    )


# The metadata builder: ``metadata_plan`` is the host plan over CPU tensors, for code that stays in
# torch; ``metadata_state_rows`` is the device part (one CUDA launch for every group's state rows,
# on torch's current stream; a CPU kernel backs it for CPU tensors).


@_op(mutates_args=("plan",))
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


@_op(mutates_args=("plan", "spec_state_indices", "non_spec_state_indices", "error_count"))
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
