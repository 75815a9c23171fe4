"""Drop-in entry points with the argument order and conventions of other serving engines.

``gdn.compat.vllm``: vLLM's fused GDN decode / MTP-verify op.
"""

from __future__ import annotations

from . import vllm

__all__ = ["vllm"]
