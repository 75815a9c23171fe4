"""libgdn: Gated DeltaNet decode / MTP-verify kernels and metadata builders.

Functions take DLPack arrays (torch, NumPy, CuPy, JAX, ...). With torch installed they are also
registered as torch custom ops under ``torch.ops.gdn``.
"""

from __future__ import annotations

import os as _os
import sys as _sys

from . import _C
from ._C import (
    cuda_device_count,
    cuda_kernels_available,
    supported_head_ratios,
    supported_state_dtypes,
)

# One module per operation (its function, contract and float64 reference). The function
# gdn.decode_mtp shadows its module of the same name (`import gdn.decode_mtp as m` gives the
# function too); reach the module with importlib.import_module("gdn.decode_mtp"), and the float64
# references as gdn.reference.* (docstrings name them so).
from .decode_mtp import can_use_decode_mtp, decode_mtp
from .conv import causal_conv1d_prefill, causal_conv1d_update
from .prefill import prefill
from .replay import ReplayWindow, decode_mtp_replay
from . import metadata
from . import reference

__version__ = _C.__version__

__all__ = [
    "__version__",
    "can_use_decode_mtp",
    "causal_conv1d_prefill",
    "causal_conv1d_update",
    "cmake_dir",
    "cuda_device_count",
    "cuda_kernels_available",
    "decode_mtp",
    "decode_mtp_replay",
    "ReplayWindow",
    "include_dir",
    "metadata",
    "prefill",
    "reference",
    "supported_head_ratios",
    "supported_state_dtypes",
]


def include_dir() -> str:
    """Directory of the C++ headers shipped with this package (``#include <gdn/...>``)."""
    return _os.path.join(_os.path.dirname(__file__), "include")


def cmake_dir() -> str:
    """Directory holding ``gdnConfig.cmake``, for ``-Dgdn_DIR=...`` / ``CMAKE_PREFIX_PATH``."""
    return _os.path.join(_os.path.dirname(__file__), "share", "cmake", "gdn")


def _path_query() -> bool:
    """True for `python -m gdn --cmake-dir` / `--include-dir` / `--version` / `--help` / `help`:
    build systems and first-time users call them, so they skip importing torch (seconds)."""
    argv = list(getattr(_sys, "orig_argv", ()))
    if "-m" not in argv:
        return False
    i = argv.index("-m")
    return (
        argv[i + 1 : i + 2] == ["gdn"]
        and len(argv) == i + 3
        and argv[i + 2] in ("--cmake-dir", "--include-dir", "--version", "--help", "-h", "help")
    )


if not _path_query():
    try:  # torch is optional: the package works on any DLPack arrays without it
        import torch as _torch
    except ImportError:  # pragma: no cover - exercised in torch-less environments
        pass
    else:
        from . import ops  # noqa: F401  (registers torch.ops.gdn.*)
        from . import _common

        # While torch traces, the functions call their torch ops (_common.traced_as_torch_op).
        _common._is_compiling = _torch.compiler.is_compiling
