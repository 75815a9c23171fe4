"""torch custom ops ``torch.ops.gdn.*``: every gdn operation as a destination-passing torch op.

Each op takes exactly its gdn function's arguments (same names, order, keyword-only split,
defaults and None-for-absent), except those in :data:`SCHEMA_EXCLUDED`, which a torch op cannot
carry as they are; tests/py/test_torch_op.py checks this. The ops mutate their outputs and return
nothing, so they need no fake kernels beyond a no-op and work under
``torch.compile(fullgraph=True)`` and CUDA graphs (launches go to torch's current stream).

Every op is defined by :func:`_op` from its gdn function: the schema (the function's signature,
with torch types from the argument kinds its annotations declare, gdn._common) on one
``torch.library.Library``, a no-op fake kernel, and the gdn function as the op's Python kernel.
``torch.library.custom_op`` is not used: on torch 2.11 its ADInplaceOrView kernel indexes the
mutated arguments in the call's ``args`` / ``kwargs``, which the dispatcher has stripped of trailing
defaults, so omitting an optional mutated argument (``error_count=None``) raised ``IndexError``.

Kernels. The per-layer ops (:data:`CPP_OPS`: ``decode_mtp``, ``decode_mtp_replay``, ``prefill``,
``causal_conv1d_update``, ``causal_conv1d_prefill``) have C++ CPU and CUDA kernels in
``libgdn_torch_ops.so`` (src/torch_ops/kernels.cpp, built when torch is importable at build time):
an eager call goes from the dispatcher straight into the library, without converting its
arguments to Python objects and back. They raise the exception type and message the gdn function
raises. A C++ torch extension is tied to the torch it was compiled against, so the library is
loaded only when the running torch's version equals the one recorded next to it (``torch_ops.json``). Otherwise (not
built, another torch version, a failed load, or ``GDN_TORCH_OP_KERNELS=python`` set at import)
these ops keep the gdn function as their Python kernel; :data:`KERNELS` says which kernels they
use (``"c++"`` or ``"python"``) and :data:`KERNELS_REASON` why. The metadata ops
(``metadata_plan``, ``metadata_state_rows``) run once per step, not per layer, and always have
Python kernels.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ._common import arguments
from .conv import causal_conv1d_prefill as _causal_conv1d_prefill
from .conv import causal_conv1d_update as _causal_conv1d_update
from .decode_mtp import decode_mtp as _decode_mtp
from .metadata import plan as _metadata_plan
from .metadata import state_rows as _metadata_state_rows
from .prefill import prefill as _prefill
from .replay import decode_mtp_replay as _decode_mtp_replay

#: The one list of function arguments a torch op cannot take as they are: name -> (the op's name
#: for it, None when the op leaves it out; why).
SCHEMA_EXCLUDED: Dict[str, Tuple[Optional[str], str]] = {
    "stream": (None, "a raw CUDA stream handle: the op launches on torch's current stream"),
    "mode": (
        "cache_mode",
        "torch's higher-order-op dispatch (torch.compile, opcheck) passes its "
        "own positional `mode`, which a keyword of that name collides with",
    ),
}

#: The gdn function behind each op, by op name.
FUNCTIONS: Dict[str, Callable[..., object]] = {}

#: The ops libgdn_torch_ops.so has C++ kernels for (when it is loaded, see :data:`KERNELS`).
CPP_OPS = ("decode_mtp", "decode_mtp_replay", "prefill", "causal_conv1d_update", "causal_conv1d_prefill")

# The dispatch keys the ops have real kernels for.
_KEYS = ("CPU", "CUDA")

# Kept alive for the process: dropping a Library deregisters its ops.
_LIB = torch.library.Library("gdn", "DEF")

# The Python kernel of each op, registered (after the C++ library had its chance) for the keys
# that have no C++ kernel.
_PYTHON_KERNELS: Dict[str, Callable[..., None]] = {}


def _fake(*args, **kwargs) -> None:
    # The ops only mutate their (already allocated) arguments; there is no output to describe.
    return None


_TORCH_TYPES = {
    "input": torch.Tensor,
    "array": torch.Tensor,
    "arrays": List[torch.Tensor],
    "int": int,
    "float": float,
    "bool": bool,
    "str": str,
}


def _prototype(function: Callable[..., object]) -> Tuple[Callable[..., None], Tuple[str, ...]]:
    """A stand-in with the signature the op takes (``function``'s, minus or renamed per
    :data:`SCHEMA_EXCLUDED`, annotated with torch types from its argument kinds) and the op's
    mutated arguments (those the function writes)."""
    kinds = {a.name: a for a in arguments(function)}
    params: List[inspect.Parameter] = []
    mutated: List[str] = []
    for p in inspect.signature(function).parameters.values():
        name = SCHEMA_EXCLUDED[p.name][0] if p.name in SCHEMA_EXCLUDED else p.name
        if name is None:
            continue
        a = kinds[p.name]
        hint = _TORCH_TYPES[a.kind]
        params.append(p.replace(name=name, annotation=Optional[hint] if a.optional else hint))
        if a.written:
            mutated.append(name)

    def stand_in(*args, **kwargs) -> None:
        pass

    stand_in.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
    return stand_in, tuple(mutated)


def _op(name: str, function: Callable[..., object]):
    """Defines ``torch.ops.gdn.<name>`` from ``function``'s signature (:func:`_prototype`; the
    written arrays marked ``(a!)`` so torch.compile functionalizes them), its fake kernel and
    ``function`` as its Python kernel (registered by :func:`_register_kernels`); returns the op."""
    prototype, mutates_args = _prototype(function)
    schema = torch.library.infer_schema(prototype, mutates_args=mutates_args)
    _LIB.define(name + schema)
    params = inspect.signature(function).parameters
    renamed = {op_name: arg for arg, (op_name, _) in SCHEMA_EXCLUDED.items() if op_name is not None and arg in params}

    # The dispatcher passes keyword-only arguments as keywords and strips defaulted trailing
    # ones; the function's own defaults (the schema's, by construction) fill them back in.
    def kernel(*args, **kwargs) -> None:
        for op_name, arg in renamed.items():
            if op_name in kwargs:
                kwargs[arg] = kwargs.pop(op_name)
        function(*args, **kwargs)

    _PYTHON_KERNELS[name] = kernel
    torch.library.register_fake(f"gdn::{name}", _fake, lib=_LIB)
    FUNCTIONS[name] = function
    return getattr(torch.ops.gdn, name)


def _load_cpp_kernels() -> Tuple[str, str]:
    """Loads libgdn_torch_ops.so (its TORCH_LIBRARY_IMPL registrations implement :data:`CPP_OPS`)
    when it was built against this torch: ``("c++", what was loaded)``, else ``("python", why
    not)``."""
    choice = os.environ.get("GDN_TORCH_OP_KERNELS", "auto").strip().lower()
    if choice not in ("auto", "", "python"):
        raise ValueError(f"GDN_TORCH_OP_KERNELS must be 'auto' or 'python', got {choice!r}")
    if choice == "python":
        return "python", "GDN_TORCH_OP_KERNELS=python"
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        with open(os.path.join(here, "torch_ops.json")) as fh:
            built = json.load(fh)
    except FileNotFoundError:
        return "python", (
            "this gdn was built without the torch op kernels (torch was not "
            "importable at build time, or GDN_BUILD_TORCH_OPS=OFF)"
        )
    running = str(torch.__version__)
    if built["torch"] != running:
        return "python", (
            f"{built['library']} was built against torch {built['torch']}, this is "
            f"torch {running} (a C++ torch extension runs only in its own version)"
        )
    try:
        torch.ops.load_library(os.path.join(here, built["library"]))
    except OSError as e:
        return "python", f"{built['library']} failed to load: {e}"
    return "c++", f"{built['library']} (built against torch {built['torch']})"


def _register_kernels() -> Tuple[str, str]:
    """Loads the C++ kernels when it may, then registers each op's Python kernel for the keys left
    without one; returns (:data:`KERNELS`, :data:`KERNELS_REASON`)."""
    kernels, reason = _load_cpp_kernels()
    for name, kernel in _PYTHON_KERNELS.items():
        for key in _KEYS:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"gdn::{name}", key):
                _LIB.impl(name, kernel, key)
    return kernels, reason


# Each op takes its function's arguments. Notes on the op forms: ``decode_mtp_replay``'s window views
# may share buffers (k and v of one tensor, a and b of another): they are written, never aliased
# with an input. ``causal_conv1d_update``'s and ``causal_conv1d_prefill``'s ``out`` must not be
# ``x`` (a torch op may not alias a mutated argument with another input; call the function for
# in-place use). ``metadata_plan`` is the host plan over CPU tensors (``cache_mode`` is the
# function's ``mode``); ``metadata_state_rows`` is the device part (one CUDA launch for every
# group's state rows on torch's current stream; a CPU kernel backs it for CPU tensors), whose CPU
# count of padded rows is not returned.
decode_mtp = _op("decode_mtp", _decode_mtp)
decode_mtp_replay = _op("decode_mtp_replay", _decode_mtp_replay)
prefill = _op("prefill", _prefill)
causal_conv1d_update = _op("causal_conv1d_update", _causal_conv1d_update)
causal_conv1d_prefill = _op("causal_conv1d_prefill", _causal_conv1d_prefill)
metadata_plan = _op("metadata_plan", _metadata_plan)
metadata_state_rows = _op("metadata_state_rows", _metadata_state_rows)


#: ``"c++"`` when the ops of :data:`CPP_OPS` run libgdn_torch_ops.so's C++ kernels, ``"python"``
#: when they run their gdn function as a Python kernel; :data:`KERNELS_REASON` says why.
KERNELS, KERNELS_REASON = _register_kernels()
