"""Helpers shared by the operation modules: the argument kinds each function's signature declares,
the launch stream, argument errors that name the argument, the call into the binding, and the
routing that lets torch.compile trace the functions."""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, TypeVar, cast

from . import _C

# ---- argument kinds ------------------------------------------------------------------------------
#
# Each operation's Python function is the one definition of its arguments: names, order, the
# keyword-only split, defaults, and in the annotations what each array argument is. From it come
# the kinds its binding converts (`argument_kinds`, for `raise_argument_error`), its call into the
# binding (`calls_binding`), the torch op's schema (gdn.ops) and the docstring check
# (tests/py/test_torch_op.py).

#: An array the call only reads (the binding accepts read-only arrays).
Input = typing.Annotated[Any, "input"]
#: An array the binding takes as a writable array but the call only reads.
Buffer = typing.Annotated[Any, "array"]
#: An array the call writes (a torch op marks it mutated).
Output = typing.Annotated[Any, "array", "written"]
#: A list of arrays the binding takes as writable arrays, only read.
Buffers = typing.Annotated[Any, "arrays"]

_SCALAR_KINDS = {int: "int", float: "float", bool: "bool", str: "str"}


class Argument(typing.NamedTuple):
    """One argument of an operation's function, as its annotation declares it."""

    name: str
    kind: str  # "input", "array" (Buffer or Output), "arrays", "int", "float", "bool", "str"
    optional: bool  # None is accepted (absent)
    written: bool  # the call writes it


def arguments(function: Callable[..., Any]) -> List[Argument]:
    """The arguments of an operation's function from its annotations (``stream`` excluded: it is
    resolved before the binding, see :func:`_stream_of`)."""
    hints = typing.get_type_hints(function, include_extras=True)
    out = []
    for name in inspect.signature(function).parameters:
        if name in ("self", "stream"):
            continue
        hint, optional = hints[name], False
        if typing.get_origin(hint) is typing.Union:
            members = [h for h in typing.get_args(hint) if h is not type(None)]
            optional, hint = True, members[0]
        if typing.get_origin(hint) is typing.Annotated:
            meta = hint.__metadata__
            out.append(Argument(name, meta[0], optional, "written" in meta))
        elif hint in _SCALAR_KINDS:
            out.append(Argument(name, _SCALAR_KINDS[hint], optional, False))
        else:
            raise TypeError(f"{function.__qualname__}: argument {name} has no gdn kind ({hint!r})")
    return out


def argument_kinds(function: Callable[..., Any]) -> Dict[str, str]:
    """``{argument: kind}`` as :func:`raise_argument_error` takes it ("?" marks optional); a
    writable array the call only reads (:data:`Buffer`) is "buffer", so that its error does not
    call it written."""

    def kind(a: Argument) -> str:
        return "buffer" if a.kind == "array" and not a.written else a.kind

    return {a.name: kind(a) + ("?" if a.optional else "") for a in arguments(function)}


def _stream_of(x: Any, stream: Any) -> Optional[int]:
    """The CUDA stream to launch on: the one given, else torch's current stream for torch tensors,
    else CuPy's current stream for CuPy arrays (None: the legacy default stream). The operation
    bindings call it for a state given without a stream that did not come through the DLPack C
    exchange API (whose producer names its stream in C)."""
    if stream is not None:
        try:
            return int(stream)
        except (TypeError, ValueError):
            raise TypeError(f"stream must be a CUDA stream handle (int) or None, got {describe(stream)}") from None
    device = getattr(x, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        return torch.cuda.current_stream(device).cuda_stream
    if type(x).__module__.split(".")[0] == "cupy":
        import cupy

        with x.device:
            return int(cupy.cuda.get_current_stream().ptr)
    return None


# ---- argument errors --------------------------------------------------------------------------
#
# A binding refuses an argument it cannot convert with nanobind's TypeError, which lists the whole
# signature. The wrappers catch it and call `raise_argument_error`, which probes each argument
# with the binding's own converter (so the verdict matches the call's) and names the first that
# fails. Only the error path pays for this.

# Argument kinds, as the bindings take them; a trailing "?" also allows None.
_PROBES: Dict[str, Callable[[Any], bool]] = {
    "array": _C._accepts_array,  # written
    "buffer": _C._accepts_array,  # only read, but taken as a writable array
    "input": _C._accepts_readonly_array,  # only read: read-only arrays are accepted
    "int": _C._accepts_int,
    "float": _C._accepts_float,
    "bool": _C._accepts_bool,
    "str": _C._accepts_str,
    "stream": _C._accepts_stream,
}
_ARRAY = "CPU or CUDA array (torch tensor, NumPy array, or any DLPack / buffer-protocol array)"
_EXPECTED = {
    "array": "a writable " + _ARRAY,
    "buffer": "a writable " + _ARRAY,
    "input": "a " + _ARRAY,
    "arrays": "a list of writable " + _ARRAY.replace("array (", "arrays (", 1),
    "int": "an int",
    "float": "a float",
    "bool": "a bool",
    "str": "a str",
    "stream": "a CUDA stream handle (int)",
}


def describe(x: Any) -> str:
    """What a value is, for error messages: its type and, for arrays, shape, dtype and device."""
    t = type(x)
    name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
    if isinstance(x, (str, bytes)):
        text = repr(x)
        return f"{name} {text if len(text) <= 40 else text[:37] + '...'}"
    if isinstance(x, (list, tuple)):
        return f"a {name} of {len(x)} item{'s' if len(x) != 1 else ''}"
    if isinstance(x, (bool, int, float, complex)):
        return f"{name} {x!r}"
    parts = []
    for attr in ("shape", "dtype", "device"):
        value = getattr(x, attr, None)
        if value is not None and not callable(value):
            parts.append(f"{attr} {tuple(value) if attr == 'shape' else value}")
    if getattr(getattr(x, "flags", None), "writeable", None) is False:
        parts.append("read-only")
    return name + (f" ({', '.join(parts)})" if parts else "")


def _hint(x: Any, kind: str) -> str:
    device = getattr(x, "device", None)
    device_type = getattr(device, "type", device if isinstance(device, str) else None)
    if device_type == "meta":
        return (
            "; meta tensors hold no data: the gdn functions need CPU or CUDA arrays "
            "(torch.ops.gdn.* accept meta and fake tensors for tracing)"
        )
    if device_type not in (None, "cpu", "cuda"):
        return f"; only CPU and CUDA arrays are supported, not device {device_type!r}"
    if kind in ("array", "buffer") and getattr(getattr(x, "flags", None), "writeable", None) is False:
        if kind == "buffer":
            return "; it is only read, but this function takes it as a writable array: pass a writable one (a .copy())"
        return "; this argument is written to: pass a writable array (e.g. a .copy())"
    if kind in ("array", "buffer", "input") and isinstance(x, (list, tuple, int, float, bool)):
        return "; wrap it in an array, e.g. numpy.asarray(...) or torch.tensor(...) with its dtype"
    return ""


def _accepted(kind: str, x: Any) -> bool:
    try:
        return bool(_PROBES[kind](x))
    except TypeError:
        return False


def raise_argument_error(function: str, kinds: Mapping[str, str], values: Dict[str, Any]) -> None:
    """Raises a TypeError naming the first argument of `function` (in `kinds` order) that its
    binding cannot convert, and what it got; returns when every argument converts."""
    for name, kind in kinds.items():
        value = values[name]
        base = kind.rstrip("?")
        if value is None and kind.endswith("?"):
            continue
        if base == "arrays":
            items = value if isinstance(value, (list, tuple)) else None
            if items is None:
                bad, got, hint = name, value, "; pass one array per KV-cache group, e.g. [table]"
            else:
                index = next((i for i, item in enumerate(items) if not _accepted("buffer", item)), None)
                if index is None:
                    continue
                got, hint = items[index], _hint(items[index], "buffer")
                bad = f"{name}[{index}]"
            expected = _EXPECTED["arrays" if bad == name else "array"]
        elif _accepted(base, value):
            continue
        else:
            bad, got, hint = name, value, _hint(value, base)
            expected = _EXPECTED[base] + (" or None" if kind.endswith("?") else "")
        raise TypeError(f"gdn.{function}: {bad} must be {expected}, got {describe(got)}{hint}") from None


# ---- the call into the binding ------------------------------------------------------------------
#
# An operation's function only declares its signature and docstring; `calls_binding` writes its
# body: pass every argument to the binding in signature order, and turn the binding's TypeError
# into one that names the argument. The body is generated source (as dataclasses does), so a call
# costs what the hand-written call would: arguments pass positionally, without a name match each.


def _refuse_one_array(function: str, name: str, value: Any) -> None:
    """Refuses one array where a list of arrays (one per KV-cache group) is expected: converted as
    a list, its rows would pass for the groups' tables."""
    if hasattr(value, "shape"):
        raise TypeError(
            f"gdn.{function}: {name} must be a list of arrays (one per KV-cache group), got one "
            f"array of shape {tuple(value.shape)}; pass [table]"
        )


def calls_binding(
    binding: str,
    *,
    name: Optional[str] = None,
    stream_of: Optional[str] = None,
    binding_finds_stream: bool = True,
    keywords: bool = False,
    refuse_one_array: bool = False,
) -> Callable[[_F], _F]:
    """Decorates an operation's function (signature and docstring only) with a body that calls
    ``_C.<binding>`` with its arguments, in signature order, and returns what it returns.

    - ``name``: the function as errors name it (default the function's name), e.g.
      ``"metadata.plan"``.
    - ``stream_of``: for a function with a ``stream`` argument, the array whose framework gives
      the default CUDA stream. With ``binding_finds_stream`` None passes as None (the binding
      asks the array's framework, in C for torch tensors); otherwise it is resolved here
      (:func:`_stream_of`).
    - ``keywords``: keyword-only arguments pass by name (for a binding that takes them as
      keywords only); else every argument passes positionally.

    A list-of-arrays argument (:data:`Buffers`) passes as a list; with ``refuse_one_array`` one
    array in its place is refused first (:func:`_refuse_one_array`)."""

    def decorate(function: _F) -> _F:
        label = name or function.__name__
        kinds = argument_kinds(function)
        params = list(inspect.signature(function).parameters.values())
        if any(p.name == "stream" for p in params) != (stream_of is not None):
            raise TypeError(f"calls_binding: {label} takes a stream exactly when stream_of names its array")
        declared, checks, passed, star = [], [], [], False
        for p in params:
            if p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                raise TypeError(f"calls_binding: {label} takes *args or **kwargs")
            if p.kind is p.KEYWORD_ONLY and not star:
                declared.append("*")
                star = True
            declared.append(p.name)
            if p.name == "stream":
                value = f"_stream_of({stream_of}, stream)"
                value = f"None if stream is None else {value}" if binding_finds_stream else value
            elif kinds[p.name] == "arrays":
                if refuse_one_array:
                    checks.append(f"    _refuse_one_array(_label, {p.name!r}, {p.name})\n")
                value = f"list({p.name})"
            else:
                value = p.name
            passed.append(f"{p.name}={value}" if keywords and p.kind is p.KEYWORD_ONLY else value)
        source = (
            f"def {function.__name__}({', '.join(declared)}):\n"
            + "".join(checks)
            + "    try:\n"
            + f"        return _binding({', '.join(passed)})\n"
            + "    except TypeError:\n"
            + "        raise_argument_error(_label, _kinds, locals())\n"
            + "        raise\n"
        )
        namespace: Dict[str, Any] = {
            "_binding": getattr(_C, binding),
            "_label": label,
            "_kinds": kinds,
            "_refuse_one_array": _refuse_one_array,
            "_stream_of": _stream_of,
            "raise_argument_error": raise_argument_error,
        }
        exec(compile(source, f"<gdn.{label} calls _C.{binding}>", "exec"), namespace)
        call = namespace[function.__name__]
        call.__defaults__ = function.__defaults__
        call.__kwdefaults__ = function.__kwdefaults__
        return cast(_F, functools.update_wrapper(call, function))

    return decorate


# ---- torch.compile ------------------------------------------------------------------------------
#
# Dynamo cannot trace into a nanobind function, so a gdn function called inside
# torch.compile(fullgraph=True) would break the graph. While torch traces (torch.compile, or
# torch.export), a function decorated with `traced_as_torch_op` calls its torch op instead, which
# torch records and functionalizes like any other op; eager calls go straight to the function.


def _never() -> bool:
    return False


#: ``torch.compiler.is_compiling`` once gdn has imported torch (gdn/__init__.py sets it), so that a
#: process without torch never imports it; constant-folded to True while Dynamo traces.
_is_compiling: Callable[[], bool] = _never

_F = TypeVar("_F", bound=Callable[..., Any])


def traced_as_torch_op(function: _F) -> _F:
    """Decorates an operation's function so that, while torch traces, it calls its torch op
    ``torch.ops.gdn.<function name>`` (gdn.ops registers one per function, from its signature)
    with the same arguments: ``stream`` is left out (the op launches on torch's current stream; a
    stream given while tracing raises, see :func:`_call_torch_op`) and ``mode`` becomes
    ``cache_mode`` (gdn.ops.SCHEMA_EXCLUDED). Outside tracing it calls ``function``; the wrapper
    keeps its signature, annotations and docstring."""
    name = function.__name__

    @functools.wraps(function)
    def routed(*args: Any, **kwargs: Any) -> Any:
        if _is_compiling():
            return _call_torch_op(name, args, kwargs)
        return function(*args, **kwargs)

    return cast(_F, routed)


def _call_torch_op(name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
    """Calls ``torch.ops.gdn.<name>`` with a gdn function's arguments. The renamed and excluded
    arguments are keyword-only in every function, so positional arguments pass as they are."""
    import torch

    from . import ops  # not at module import: gdn.ops imports the operation modules

    stream = kwargs.pop("stream", None)
    if stream is not None:
        # The traced op runs on torch's current stream whatever is passed here; running it on
        # another stream silently would race with the caller's work on that stream.
        raise ValueError(
            f"gdn.{name}: stream must be None inside torch.compile or torch.export (got {describe(stream)}): "
            f"the traced call runs as torch.ops.gdn.{name} on torch's current stream; select the stream "
            "with `with torch.cuda.stream(s):` around the compiled call"
        )
    for arg, (op_name, _) in ops.SCHEMA_EXCLUDED.items():
        if op_name is not None and arg in kwargs:
            kwargs[op_name] = kwargs.pop(arg)
    getattr(torch.ops.gdn, name)(*args, **kwargs)
