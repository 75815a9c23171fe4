"""Drop-in entry points with the argument order and conventions of other serving engines.

``gdn.compat.vllm``: vLLM's fused GDN decode / MTP-verify op.
``gdn.compat.fla``: flash-linear-attention's ``fused_recurrent_gated_delta_rule`` and
``chunk_gated_delta_rule``.
"""

from __future__ import annotations

from . import fla, vllm

__all__ = ["fla", "vllm"]
