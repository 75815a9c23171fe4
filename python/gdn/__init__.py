"""libgdn: Gated DeltaNet decode / MTP-verify kernels and metadata builders.

Functions take DLPack arrays (torch, NumPy, CuPy, JAX, ...). With torch installed they are also
registered as torch custom ops under ``torch.ops.gdn``.
"""

from __future__ import annotations

import os as _os

from . import _C
from ._C import (
    can_use_decode_mtp,
    cuda_device_count,
    cuda_kernels_available,
    supported_head_ratios,
    supported_state_dtypes,
)
from ._api import decode_mtp
from .conv import causal_conv1d_update
from . import metadata

__version__ = _C.__version__

__all__ = [
    "__version__",
    "can_use_decode_mtp",
    "causal_conv1d_update",
    "cmake_dir",
    "cuda_device_count",
    "cuda_kernels_available",
    "decode_mtp",
    "include_dir",
    "metadata",
    "supported_head_ratios",
    "supported_state_dtypes",
]


def include_dir() -> str:
    """Directory of the C++ headers shipped with this package (``#include <gdn/...>``)."""
    return _os.path.join(_os.path.dirname(__file__), "include")


def cmake_dir() -> str:
    """Directory holding ``gdnConfig.cmake``, for ``-Dgdn_DIR=...`` / ``CMAKE_PREFIX_PATH``."""
    return _os.path.join(_os.path.dirname(__file__), "share", "cmake", "gdn")


try:  # torch is optional: the package works on any DLPack arrays without it
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - exercised in torch-less environments
    pass
else:
    from . import ops  # noqa: F401  (registers torch.ops.gdn.*)
