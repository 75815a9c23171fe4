"""Per-step GDN metadata for speculative decoding, shared by every KV-cache group (docs metadata.md).

A step is built in two parts:

1. the **plan** (host, once per step, never touches a device): classification (spec rows, decodes,
   prefills, zero-length rows; 1-token decodes become prefills when spec rows exist) and every
   field the groups share, written into one int32 *plan buffer* whose layout depends only on the
   capacity (``max_rows``, ``max_tokens``);
2. the **state rows** of all G groups in one pass: a CPU loop, or one CUDA launch reading the
   device copy of the plan buffer and every group's block table.

Free functions (:func:`plan`, :func:`state_rows`, :func:`shadow_check`) take any DLPack arrays.
:class:`Builder` owns persistent, zero-initialised buffers allocated once for the largest batch
(NumPy or torch, CPU or CUDA) and returns :class:`StepMetadata`, whose fields are views of those
buffers; ``StepMetadata.decode_mtp_args(g)`` are the arrays :func:`gdn.decode_mtp` takes.
The device part is also registered as the torch op ``torch.ops.gdn.metadata_state_rows``.

Debug: ``Builder(..., shadow=True)`` or ``GDN_METADATA_SHADOW=1`` rebuilds every group the legacy
way after each step (synchronising) and raises ``RuntimeError`` naming the first difference.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _C
from ._api import _stream_of

__all__ = [
    "HEADER_FIELDS",
    "MAX_GROUPS",
    "Builder",
    "PlanView",
    "StepMetadata",
    "layout",
    "plan",
    "plan_words",
    "shadow_check",
    "state_rows",
]

#: Names of the int32 counts at the start of the plan buffer, in order.
HEADER_FIELDS: Tuple[str, ...] = tuple(_C.metadata_header_fields())
#: Most KV-cache groups one pass fills.
MAX_GROUPS: int = int(_C.metadata_max_groups)
_H = {name: i for i, name in enumerate(HEADER_FIELDS)}


def layout(max_rows: int, max_tokens: int) -> Dict[str, Any]:
    """``{field: (word offset, length, dtype)}`` of a plan buffer, plus ``"total_words"``."""
    return _C.metadata_layout(max_rows, max_tokens)


def plan_words(max_rows: int, max_tokens: int) -> int:
    """Size in int32 words of a plan buffer for up to ``max_rows`` requests / ``max_tokens`` tokens."""
    return int(_C.metadata_layout(max_rows, max_tokens)["total_words"])


def plan(
    plan: Any,
    query_start_loc: Any,
    seq_lens: Any,
    *,
    num_draft_tokens: Any = None,
    num_accepted_tokens: Any = None,
    num_computed_tokens: Any = None,
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    mode: str = "none",
    block_size: int = 0,
    padded_rows: Optional[int] = None,
    pad_id: int = 0,
) -> None:
    """Plans one step into the host int32 buffer ``plan`` (``plan_words(max_rows, max_tokens)``).

    Inputs are host int32 arrays: ``query_start_loc`` [N+1] (starts at 0), ``seq_lens`` [N]
    (tokens after this step, drafts included), ``num_draft_tokens`` [N] (-1: not a spec row;
    absent: no spec rows), ``num_accepted_tokens`` [N] (previous step's accepted counts 1..S; a
    device array is left for the state-row pass to gather; absent: 1), ``num_computed_tokens``
    [N] (absent: ``seq_lens`` - query length). ``mode`` "none" or "align" (with ``block_size``).
    ``padded_rows`` (>= N) pads every row vector to a CUDA-graph batch size. Invalid input raises
    ``ValueError`` naming the argument and row, before anything is written.
    """
    _C.metadata_plan(
        plan, query_start_loc, seq_lens, num_draft_tokens=num_draft_tokens,
        num_accepted_tokens=num_accepted_tokens, num_computed_tokens=num_computed_tokens,
        num_spec=num_spec, max_rows=max_rows, max_tokens=max_tokens, mode=mode,
        block_size=block_size, padded_rows=padded_rows, pad_id=pad_id,
    )


def state_rows(
    plan: Any,
    block_tables: Sequence[Any],
    spec_state_indices: Any,
    non_spec_state_indices: Any,
    *,
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    pad_id: int = 0,
    launch_rows: int = 0,
    num_accepted_tokens: Any = None,
    error_count: Any = None,
    stream: Optional[int] = None,
) -> Optional[int]:
    """Fills every group's state rows in one pass from a planned buffer on the same device.

    ``block_tables``: one int32 [rows_g, cols_g] array per group (unit column stride, any row
    stride). Writes ``spec_state_indices`` [G, R, S] and ``non_spec_state_indices`` [G, R]
    (int32, contiguous, R >= ``launch_rows``). On CUDA this is one kernel launch on ``stream``
    (capturable in a CUDA graph; it reads its counts from the device plan buffer), covering
    ``launch_rows`` rows (0: ``max_rows``). Rows whose columns fall outside their table get
    ``pad_id`` and are counted: returned on the CPU, added to ``error_count`` (int32 [1]) when
    given. ``num_accepted_tokens`` on the pass's device is gathered into the plan buffer.
    """
    return _C.metadata_state_rows(
        plan, list(block_tables), spec_state_indices, non_spec_state_indices, num_spec=num_spec,
        max_rows=max_rows, max_tokens=max_tokens, pad_id=pad_id, launch_rows=launch_rows,
        num_accepted_tokens=num_accepted_tokens, error_count=error_count,
        stream=_stream_of(plan, stream),
    )


def shadow_check(
    plan: Any,
    block_tables: Sequence[Any],
    spec_state_indices: Any,
    non_spec_state_indices: Any,
    query_start_loc: Any,
    seq_lens: Any,
    *,
    num_draft_tokens: Any = None,
    num_accepted_tokens: Any = None,
    num_computed_tokens: Any = None,
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    mode: str = "none",
    block_size: int = 0,
    padded_rows: Optional[int] = None,
    pad_id: int = 0,
) -> str:
    """Compares a step's plan and state rows (host arrays) against per-group builds, exactly, on
    the rows the step writes. Returns ``""`` when they agree, else a message naming the group,
    field, row and both values. Rows outside the written range are never read."""
    return _C.metadata_shadow_check(
        plan, list(block_tables), spec_state_indices, non_spec_state_indices, query_start_loc,
        seq_lens, num_draft_tokens=num_draft_tokens, num_accepted_tokens=num_accepted_tokens,
        num_computed_tokens=num_computed_tokens, num_spec=num_spec, max_rows=max_rows,
        max_tokens=max_tokens, mode=mode, block_size=block_size, padded_rows=padded_rows,
        pad_id=pad_id,
    )


# ---- views ----------------------------------------------------------------------------------------


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch"


def _field_views(buffer: Any, max_rows: int, max_tokens: int) -> Dict[str, Any]:
    """Full-capacity views of every field of a 1-D int32 plan buffer (NumPy or torch)."""
    if _is_torch(buffer):
        import torch

        as_bool = lambda a: a.view(torch.bool)  # noqa: E731
    else:
        as_bool = lambda a: a.view(np.bool_)  # noqa: E731
    views = {}
    for name, spec in layout(max_rows, max_tokens).items():
        if name == "total_words":
            continue
        offset, length, dtype = spec
        if dtype == "bool":
            views[name] = as_bool(buffer[offset : offset + (length + 3) // 4])[:length]
        else:
            views[name] = buffer[offset : offset + length]
    return views


class PlanView:
    """Named views of one plan buffer (host or device), sized by a step's counts.

    ``counts`` is a host int32 array holding the step's header (the host plan's first words).
    """

    __slots__ = ("_v", "_c")

    def __init__(self, views: Dict[str, Any], counts: np.ndarray):
        self._v = views
        self._c = counts

    def __getattr__(self, name: str) -> Any:
        if name in _H:
            return int(self._c[_H[name]])
        raise AttributeError(name)

    @property
    def spec_rows(self) -> int:
        """Spec rows written (padded_rows when padded)."""
        return int(self._c[_H["spec_rows_written"]])

    @property
    def non_spec_rows(self) -> int:
        return int(self._c[_H["non_spec_rows_written"]])

    @property
    def num_non_spec_tokens(self) -> int:
        return int(self._c[_H["num_actual_tokens"]] - self._c[_H["num_spec_decode_tokens"]])

    @property
    def spec_sequence_masks(self) -> Any:
        return self._v["spec_sequence_masks"][: int(self._c[_H["mask_rows_written"]])]

    @property
    def spec_query_start_loc(self) -> Any:
        return self._v["spec_query_start_loc"][: self.spec_rows + 1]

    @property
    def non_spec_query_start_loc(self) -> Any:
        return self._v["non_spec_query_start_loc"][: self.non_spec_rows + 1]

    @property
    def spec_num_accepted(self) -> Any:
        return self._v["spec_num_accepted"][: self.spec_rows]

    @property
    def spec_source_column(self) -> Any:
        return self._v["spec_source_column"][: self.spec_rows]

    @property
    def has_initial_state(self) -> Any:
        return self._v["has_initial_state"][: self.non_spec_rows]

    @property
    def non_spec_token_indx(self) -> Any:
        return self._v["token_split"][: self.num_non_spec_tokens]

    @property
    def spec_token_indx(self) -> Any:
        return self._v["token_split"][
            self.num_non_spec_tokens : int(self._c[_H["num_actual_tokens"]])
        ]

    @property
    def spec_request_index(self) -> Any:
        """Request index of each spec row (-1 for padded rows)."""
        return self._v["spec_request"][: self.spec_rows]

    @property
    def non_spec_request_index(self) -> Any:
        return self._v["non_spec_request"][: self.non_spec_rows]

    def counts(self) -> Dict[str, int]:
        """Every header count by name."""
        return {name: int(self._c[i]) for i, name in enumerate(HEADER_FIELDS)}


class StepMetadata(PlanView):
    """One step's metadata: views of the builder's persistent buffers (valid until the next step).

    Shared fields (on the builder's device): ``spec_sequence_masks``, ``spec_token_indx``,
    ``non_spec_token_indx``, ``spec_query_start_loc``, ``non_spec_query_start_loc``,
    ``spec_num_accepted``, ``spec_source_column``, ``has_initial_state``; counts as attributes
    (``num_prefills``, ``num_spec_decodes``, ...). Per group: ``spec_state_indices`` [G, rows, S],
    ``non_spec_state_indices`` [G, rows]. ``host`` views the host plan of the step (accepted
    counts gathered on the device read 1 there).
    """

    __slots__ = ("_b", "host")

    def __init__(self, builder: "Builder", host: PlanView):
        super().__init__(builder._views, host._c)
        self._b = builder
        self.host = host

    @property
    def spec_state_indices(self) -> Any:
        return self._b.spec_state_indices[:, : self.spec_rows]

    @property
    def non_spec_state_indices(self) -> Any:
        return self._b.non_spec_state_indices[:, : self.non_spec_rows]

    def decode_mtp_args(self, group: int) -> Dict[str, Any]:
        """``state_indices``, ``cu_seqlens`` and ``num_accepted_tokens`` of group ``group``'s spec
        rows, ready for :func:`gdn.decode_mtp` (its mixed_qkv rows are ``spec_token_indx``)."""
        return {
            "state_indices": self._b.spec_state_indices[group, : self.spec_rows],
            "cu_seqlens": self.spec_query_start_loc,
            "num_accepted_tokens": self.spec_num_accepted,
        }


class Builder:
    """Persistent metadata buffers for an engine's G KV-cache groups, filled in place each step.

    ``block_tables``: one int32 [rows_g, cols_g] array per group (the engine's persistent block
    tables; their addresses are imported once). NumPy arrays or torch CPU tensors give a CPU
    builder; torch CUDA tensors a CUDA builder, which plans into a host staging buffer, copies it
    to the device plan buffer with one ``cudaMemcpyAsync`` and fills all groups' state rows with
    one launch, all on ``stream`` (default: torch's current stream). Buffers are
    zero-initialised and sized for ``max_rows`` requests and ``max_tokens`` tokens.

    ``staging``: ``"pinned"`` (default) plans into page-locked buffers (``staging_slots`` of
    them, used in turn; before a slot is reused the builder waits on an event recorded after the
    copy issued from it, which has normally long finished), so the copy is truly asynchronous;
    ``"pageable"`` plans into one ordinary host buffer, which the driver stages before the copy
    call returns (no events, no ring; the copy may wait for a free staging buffer).

    The block tables, ``num_spec``, ``pad_id`` and the capacity are fixed for the builder's
    life: a CUDA graph that captured :meth:`launch` bakes them in.
    """

    def __init__(
        self,
        block_tables: Sequence[Any],
        *,
        num_spec: int,
        max_rows: int,
        max_tokens: int,
        mode: str = "none",
        block_size: int = 0,
        pad_id: int = 0,
        staging: str = "pinned",
        staging_slots: int = 2,
        shadow: Optional[bool] = None,
    ):
        tables = list(block_tables)
        if not tables or len(tables) > MAX_GROUPS:
            raise ValueError(f"block_tables must hold 1..{MAX_GROUPS} arrays, got {len(tables)}")
        self.num_groups = len(tables)
        self.num_spec = int(num_spec)
        self.max_rows = int(max_rows)
        self.max_tokens = int(max_tokens)
        self.mode = mode
        self.block_size = int(block_size)
        self.pad_id = int(pad_id)
        self.shadow = (
            os.environ.get("GDN_METADATA_SHADOW", "0") not in ("", "0") if shadow is None else shadow
        )
        self.block_tables = tables
        S = self.num_spec + 1
        G, R = self.num_groups, self.max_rows
        words = plan_words(self.max_rows, self.max_tokens)
        self._events: List[Any] = []  # pinned CUDA staging: one event per slot
        self._torch = _is_torch(tables[0])
        self._cuda = self._torch and tables[0].device.type == "cuda"
        if self._torch:
            import torch

            dev = tables[0].device
            self.device = dev
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=dev)  # noqa: E731
            self.spec_state_indices = zeros(G, R, S)
            self.non_spec_state_indices = zeros(G, R)
            self.error_count = zeros(1)
            if self._cuda:
                if staging not in ("pinned", "pageable"):
                    raise ValueError(f"staging must be 'pinned' or 'pageable', got {staging!r}")
                pinned = staging == "pinned"
                self.device_plan = zeros(words)
                self.host_plans = [
                    torch.zeros(words, dtype=torch.int32, pin_memory=pinned)
                    for _ in range(max(1, staging_slots) if pinned else 1)
                ]
                self._events = [torch.cuda.Event() for _ in self.host_plans] if pinned else []
                self._recorded = [False] * len(self.host_plans)
                raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
                index = dev.index if dev.index is not None else torch.cuda.current_device()
                self._current_stream = (
                    (lambda: raw(index)) if raw is not None
                    else (lambda: torch.cuda.current_stream(dev).cuda_stream)
                )
            else:
                self.device_plan = None
                self.host_plans = [torch.zeros(words, dtype=torch.int32)]
        else:
            self.device = "cpu"
            self.spec_state_indices = np.zeros((G, R, S), np.int32)
            self.non_spec_state_indices = np.zeros((G, R), np.int32)
            self.error_count = np.zeros(1, np.int32)
            self.device_plan = None
            self.host_plans = [np.zeros(words, np.int32)]
        self._native = _C.MetadataBuilder(
            tables, self.spec_state_indices, self.non_spec_state_indices, self.host_plans,
            self.device_plan, self.error_count, self.num_spec, self.max_rows, self.max_tokens,
            mode, self.block_size, self.pad_id,
        )
        plan_buffer = self.device_plan if self._cuda else self.host_plans[0]
        self._views = _field_views(plan_buffer, self.max_rows, self.max_tokens)
        self._host_views = [_field_views(h, self.max_rows, self.max_tokens) for h in self.host_plans]
        self._host_counts = [
            (h.numpy() if self._torch else h)[: len(HEADER_FIELDS)] for h in self.host_plans
        ]
        self._slot = 0

    # -- the step ---------------------------------------------------------------------------------

    def _next_slot(self) -> int:
        k = self._slot
        self._slot = (k + 1) % len(self.host_plans)
        if self._events and self._recorded[k]:
            self._events[k].synchronize()  # the copy from this slot has executed (normally long ago)
        return k

    def _stream(self, stream: Optional[int]) -> Optional[int]:
        if stream is not None:
            return int(stream)
        return self._current_stream() if self._cuda else None

    def _record(self, k: int, stream: Optional[int]) -> None:
        if self._events:
            import torch

            if stream is None:
                self._events[k].record()  # torch's current stream
            else:
                self._events[k].record(torch.cuda.ExternalStream(int(stream), device=self.device))
            self._recorded[k] = True

    def step(
        self,
        query_start_loc: Any,
        seq_lens: Any,
        *,
        num_draft_tokens: Any = None,
        num_accepted_tokens: Any = None,
        num_computed_tokens: Any = None,
        padded_rows: Optional[int] = None,
        stream: Optional[int] = None,
    ) -> StepMetadata:
        """Plans the step (host arrays, see :func:`plan`; ``num_accepted_tokens`` may live on the
        device, then the launch gathers it) and fills every group's state rows in one pass."""
        k = self._next_slot()
        self._native.step(
            k, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
            num_computed_tokens, padded_rows, self._stream(stream),
        )
        self._record(k, stream)
        md = StepMetadata(self, PlanView(self._host_views[k], self._host_counts[k]))
        if self.shadow:
            self._shadow(md, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
                         num_computed_tokens, padded_rows)
        return md

    def prepare(
        self,
        query_start_loc: Any,
        seq_lens: Any,
        *,
        num_draft_tokens: Any = None,
        num_accepted_tokens: Any = None,
        num_computed_tokens: Any = None,
        padded_rows: Optional[int] = None,
        stream: Optional[int] = None,
    ) -> StepMetadata:
        """Plans the step and copies the plan to the device buffer, without the state-row launch:
        what precedes the replay of a CUDA graph that captured :meth:`launch`."""
        k = self._next_slot()
        self._native.prepare(
            k, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
            num_computed_tokens, padded_rows, self._stream(stream),
        )
        self._record(k, stream)
        return StepMetadata(self, PlanView(self._host_views[k], self._host_counts[k]))

    def launch(
        self,
        launch_rows: int,
        *,
        num_accepted_tokens: Any = None,
        stream: Optional[int] = None,
    ) -> Optional[int]:
        """The state-row pass alone (one CUDA launch over ``launch_rows`` rows) reading the device
        plan buffer: capture it in a CUDA graph, then :meth:`prepare` + replay each step."""
        return self._native.launch(launch_rows, num_accepted_tokens, self._stream(stream))

    # -- debug ------------------------------------------------------------------------------------

    def _shadow(self, md, qsl, seq_lens, drafts, accepted, computed, padded_rows) -> None:
        def host(x):
            if x is None:
                return None
            if _is_torch(x):
                return x.detach().cpu().numpy()
            return np.asarray(x)

        if self._cuda:
            import torch

            torch.cuda.synchronize(self.device)
        plan_buffer = self.device_plan if self._cuda else self.host_plans[0]
        message = shadow_check(
            host(plan_buffer), [host(t) for t in self.block_tables],
            host(self.spec_state_indices), host(self.non_spec_state_indices), host(qsl),
            host(seq_lens), num_draft_tokens=host(drafts), num_accepted_tokens=host(accepted),
            num_computed_tokens=host(computed), num_spec=self.num_spec, max_rows=self.max_rows,
            max_tokens=self.max_tokens, mode=self.mode, block_size=self.block_size,
            padded_rows=padded_rows, pad_id=self.pad_id,
        )
        if message:
            raise RuntimeError(message)

    # -- benchmarks -------------------------------------------------------------------------------

    def time_step(
        self,
        path: str,
        iters: int,
        query_start_loc: Any,
        seq_lens: Any,
        *,
        num_draft_tokens: Any = None,
        num_accepted_tokens: Any = None,
        num_computed_tokens: Any = None,
        padded_rows: Optional[int] = None,
        stream: Optional[int] = None,
    ) -> float:
        """Host seconds per step measured in C++: ``path`` "fused" (one plan, one pass for all
        groups), "per_group" (plan + pass per group) or "per_group_reference" (the shadow check's
        per-group build; CPU builders only)."""
        return self._native.time_step(
            path, iters, 0, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens,
            num_computed_tokens, padded_rows, self._stream(stream),
        )
