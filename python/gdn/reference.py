"""Float64 NumPy references of the gdn operations, re-exported from their modules (each operation's
module holds its function, contract and reference)."""

from __future__ import annotations

from .conv import causal_conv1d_prefill_reference, causal_conv1d_update_reference
from .decode_mtp import decode_mtp_reference
from .metadata import step_reference
from .prefill import prefill_reference

__all__ = [
    "causal_conv1d_prefill_reference",
    "causal_conv1d_update_reference",
    "decode_mtp_reference",
    "prefill_reference",
    "step_reference",
]
