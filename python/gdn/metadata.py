"""Per-step GDN metadata for speculative decoding, shared by every KV-cache group
(docs metadata.md).

A step is built in two parts:

1. the **plan** (host, once per step, never touches a device): classification and every field
   the groups share, written into one int32 *plan buffer* whose layout depends only on the
   capacity (``max_rows``, ``max_tokens``);
2. the **state rows** of all G groups in one pass: a CPU loop, or one CUDA launch reading the
   device copy of the plan buffer and every group's block table.

Semantics are vLLM's GDN builder's (docs metadata.md §2.1, §2.2):

- spec rows: every row with ``num_draft_tokens >= 0``, zero drafts included;
- a *fresh* row (tokens and no computed prefix: ``num_computed_tokens == 0``) is never a decode:
  its slot may still hold a finished request's state, so it gets ``has_initial_state = False``
  and ``non_spec_source_indices = pad_id`` (no slot to read);
- decodes and prefills: without spec rows the decodes are the *leading run* of rows with at most
  one token that are not fresh (zero-length rows in it included), and the prefills run from
  there to the last row with a token (trailing zero-length rows are in neither count); with spec
  rows the 1-token rows are decodes reclassified as prefills and zero-length rows are in neither
  count;
- every row reads its state where the previous step left it: spec rows keep their S-column rows
  (``decode_mtp`` reads column acc - 1), non-spec rows get ``non_spec_state_indices`` (the
  destination, column ``start``) and ``non_spec_source_indices`` (column ``start + acc - 1``),
  with ``acc`` from ``num_accepted_tokens`` (every row; 1 when absent).

Replay mode (``replay=True``, for :func:`gdn.decode_mtp_replay`, docs replay.md §3): a request
owns one state slot per group, its checkpoint, at block table column ``start``;
``num_accepted_tokens`` are the replay counts n (0..S, 0 when the row's window is empty, e.g. on
its first step after prefill; absent: all 0) and the accepted counts become max(n, 1). The same
plan and pass then also give every group's spec-row checkpoints (``checkpoint_indices``) and the
rows' replay counts (``replay_counts``, ``non_spec_replay_counts``); non-spec rows read and write
their checkpoint. Prefix caching (mode ``"align"``) with replay is refused.

Free functions (:func:`plan`, :func:`state_rows`, :func:`shadow_check`) take any DLPack arrays;
:func:`step_reference` is a NumPy reference of one group's metadata, for tests.
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
from ._common import Buffer, Buffers, Input, Output, _stream_of, argument_kinds, calls_binding, raise_argument_error

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
    "step_reference",
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
    """Size in int32 words of a plan buffer for up to ``max_rows`` requests / ``max_tokens``
    tokens."""
    return int(_C.metadata_layout(max_rows, max_tokens)["total_words"])


@calls_binding("metadata_plan", name="metadata.plan", keywords=True)
def plan(
    plan: Output,
    query_start_loc: Buffer,
    seq_lens: Buffer,
    *,
    num_draft_tokens: Optional[Buffer] = None,
    num_accepted_tokens: Optional[Buffer] = None,
    num_computed_tokens: Optional[Buffer] = None,
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    mode: str = "none",
    block_size: int = 0,
    padded_rows: Optional[int] = None,
    pad_id: int = 0,
    replay: bool = False,
) -> None:
    """Plans one step of N requests into the host int32 buffer ``plan``
    (``plan_words(max_rows, max_tokens)`` words, written; never touches a device).

    Inputs are writable host int32 arrays (S = ``num_spec`` + 1):

    - ``query_start_loc`` [N+1]: token offsets of the requests (starts at 0).
    - ``seq_lens`` [N]: tokens after this step, drafts included.
    - ``num_draft_tokens`` [N] or None: drafts of a spec row, -1 for a non-spec row; None: no
      spec rows.
    - ``num_accepted_tokens`` [N] or None (all 1): the previous step's accepted counts 1..S of
      every row (a non-spec row reads its state from column ``start + acc - 1``); a device array
      is left for the state-row pass to gather.
    - ``num_computed_tokens`` [N] or None (``seq_lens`` - query length): tokens already cached.
    - ``num_spec``: draft tokens per spec row; ``max_rows``, ``max_tokens``: the buffer's
      capacity in requests and tokens.
    - ``mode``: ``"none"`` (state rows from column 0) or ``"align"`` (prefix caching: from block
      ``(seq_lens - 1) // block_size``, with ``block_size``).
    - ``padded_rows`` (>= N) or None: pads every row vector to a CUDA-graph batch size; padded
      rows get ``pad_id`` slots and zero tokens.
    - ``pad_id``: the slot id of padded and unreadable rows.
    - ``replay``: replay mode (module docstring): ``num_accepted_tokens`` are the replay counts
      n in 0..S (absent: all 0); the plan keeps them (``replay_counts``,
      ``non_spec_replay_counts``; padded rows 0) and accepts max(n, 1). Refused with mode
      ``"align"``.

    Classification as vLLM's builder (module docstring): spec rows (drafts >= 0); without them
    decodes are the leading run of rows with <= 1 token and a computed prefix, prefills the rest
    up to the last row with a token; with them 1-token rows are prefills and zero-length rows in
    neither count. :func:`step_reference` builds the same fields with
    NumPy.
    Invalid input raises ``ValueError`` naming the argument and row, a value the binding cannot
    take raises ``TypeError`` naming the argument; in both cases nothing is written.
    """


@calls_binding(
    "metadata_state_rows",
    name="metadata.state_rows",
    stream_of="plan",
    binding_finds_stream=False,
    keywords=True,
    refuse_one_array=True,
)
def state_rows(
    plan: Output,
    block_tables: Buffers,
    spec_state_indices: Output,
    non_spec_state_indices: Output,
    *,
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    pad_id: int = 0,
    launch_rows: int = 0,
    num_accepted_tokens: Optional[Buffer] = None,
    error_count: Optional[Output] = None,
    non_spec_source_indices: Optional[Output] = None,
    replay: bool = False,
    checkpoint_indices: Optional[Output] = None,
    stream: Optional[int] = None,
) -> Optional[int]:
    """Fills every group's state rows in one pass from a planned buffer on the same device.

    - ``plan``: the int32 buffer :func:`plan` filled (its device copy for a CUDA pass); read,
      and written only where ``num_accepted_tokens`` is gathered into it.
    - ``block_tables``: a list of one int32 [rows_g, cols_g] array per KV-cache group (unit
      column stride, any row stride), G <= ``MAX_GROUPS``.
    - ``spec_state_indices`` [G, R, S] and ``non_spec_state_indices`` [G, R] (int32, contiguous,
      R >= ``launch_rows``): written, rows past the step's untouched. ``non_spec_state_indices``
      is each non-spec row's destination (column ``start``).
    - ``num_spec``, ``max_rows``, ``max_tokens``: as given to :func:`plan`.
    - ``pad_id``: the slot id of rows whose columns fall outside their table.
    - ``launch_rows``: rows a CUDA launch covers (0: ``max_rows``); fix it for a CUDA graph.
    - ``num_accepted_tokens`` [N] or None: accepted counts on the pass's device, gathered into
      the plan buffer (so a device tensor needs no host copy).
    - ``error_count`` int32 [1] or None: the count of padded-for-bounds rows is added to it.
    - ``non_spec_source_indices`` [G, R] or None: written like ``non_spec_state_indices`` with
      each non-spec row's source (column ``start + acc - 1``, where the previous step left the
      state). A non-spec row whose columns ``start .. start + acc - 1`` are not all in its table
      gets ``pad_id`` in both and is counted.
    - ``replay``: replay mode, as given to :func:`plan` (a plan of the other mode is refused on
      the CPU; on CUDA its rows get ``pad_id`` and it is counted in ``error_count``). Every row
      then reads one column of its table, ``start``: ``checkpoint_indices`` [G, R] (int32,
      contiguous, required in replay mode and refused otherwise) gets each spec row's checkpoint
      slot, which is also column 0 of its ``spec_state_indices`` row (the other columns get
      ``pad_id``); non-spec rows write and read their checkpoint (``non_spec_state_indices`` =
      ``non_spec_source_indices``). A row whose column ``start`` is outside its table, or whose
      gathered replay count is outside 0..S, is padded and counted as above.
    - ``stream``: CUDA stream handle; default torch's current stream for torch tensors.

    On CUDA this is one kernel launch on ``stream`` (capturable in a CUDA graph; it reads its
    counts from the device plan buffer) and returns None; on the CPU it returns the number of
    rows padded because their columns fall outside their table.
    """


@calls_binding("metadata_shadow_check", name="metadata.shadow_check", keywords=True)
def shadow_check(
    plan: Buffer,
    block_tables: Buffers,
    spec_state_indices: Buffer,
    non_spec_state_indices: Buffer,
    query_start_loc: Buffer,
    seq_lens: Buffer,
    *,
    num_draft_tokens: Optional[Buffer] = None,
    num_accepted_tokens: Optional[Buffer] = None,
    num_computed_tokens: Optional[Buffer] = None,
    num_spec: int,
    max_rows: int,
    max_tokens: int,
    mode: str = "none",
    block_size: int = 0,
    padded_rows: Optional[int] = None,
    pad_id: int = 0,
    non_spec_source_indices: Optional[Buffer] = None,
    replay: bool = False,
    checkpoint_indices: Optional[Buffer] = None,
) -> str:
    """Compares a step's ``plan`` and state rows (``spec_state_indices``,
    ``non_spec_state_indices``, ``non_spec_source_indices`` when given, and in replay mode
    ``checkpoint_indices``; host arrays) against per-group builds from ``block_tables`` and the
    step's inputs (``query_start_loc``, ``seq_lens``, ``num_draft_tokens``,
    ``num_accepted_tokens``, ``num_computed_tokens``, ``num_spec``, ``max_rows``,
    ``max_tokens``, ``mode``, ``block_size``, ``padded_rows``, ``pad_id``, ``replay``: as given
    to :func:`plan`), exactly, on the rows the step writes. Returns ``""`` when they agree, else
    a message naming the group, field, row and both values. Rows outside the written range are
    never read."""
    raise NotImplementedError  # calls_binding gives it its body


def step_reference(
    query_start_loc: Any,
    seq_lens: Any,
    block_table: Any,
    *,
    num_draft_tokens: Any = None,
    num_accepted_tokens: Any = None,
    num_computed_tokens: Any = None,
    num_spec: int,
    mode: str = "none",
    block_size: int = 0,
    padded_rows: Optional[int] = None,
    pad_id: int = 0,
    replay: bool = False,
) -> Dict[str, Any]:
    """NumPy reference of one group's step metadata (integers, so exact), built the way a
    per-group builder does it: boolean masks, repeat + stable argsort for the token split,
    cumulative sums, fancy-index gathers. Arguments as for :func:`plan`, with one group's
    ``block_table`` [rows, cols]; valid input expected.

    Returns ``{"counts": {header field: int}, "unreadable": rows padded for bounds, field: array}``
    with the fields of :class:`StepMetadata` (``spec_sequence_masks``, ``spec_token_indx``,
    ``non_spec_token_indx``, ``spec_query_start_loc``, ``non_spec_query_start_loc``,
    ``spec_num_accepted``, ``spec_source_column``, ``non_spec_source_column``,
    ``has_initial_state``) and this group's ``spec_state_indices`` [rows, S],
    ``non_spec_state_indices`` [rows] and ``non_spec_source_indices`` [rows]; with ``replay``
    also ``replay_counts``, ``non_spec_replay_counts`` and this group's ``checkpoint_indices``
    [rows].
    """
    i32 = np.int32
    qsl = np.asarray(query_start_loc, np.int64)
    lens = np.asarray(seq_lens, np.int64)
    table = np.asarray(block_table)
    drafts = None if num_draft_tokens is None else np.asarray(num_draft_tokens, np.int64)
    S = int(num_spec) + 1
    N = len(qsl) - 1
    qlen = np.diff(qsl)
    mask = np.zeros(N, bool) if drafts is None else drafts >= 0
    ns_len = qlen[~mask]
    zero = int((ns_len == 0).sum())
    n_ns_tok = int(ns_len.sum())
    context = lens - qlen if num_computed_tokens is None else np.asarray(num_computed_tokens, np.int64)
    if mask.any():  # 1-token rows run as prefills, zero-length rows in neither count
        decodes = decode_tokens = 0
        prefills = int((~mask).sum()) - zero
    else:  # vLLM's split_decodes_and_prefills, short extends (fresh rows) as prefills
        prefill = (qlen > 1) | ((qlen > 0) & (context <= 0))
        first = np.flatnonzero(prefill)
        decodes = int(first[0]) if len(first) else N
        decode_tokens = int(qsl[decodes])
        live = np.flatnonzero(qlen > 0)
        prefills = int(live[-1]) + 1 - decodes if len(first) else 0
    order = np.argsort(np.repeat(mask, qlen), kind="stable")
    if mode == "align":
        start = np.maximum((lens - 1) // block_size, 0)
    else:
        start = np.zeros(N, np.int64)

    def pad_to(a, n, value):
        return np.concatenate([a, np.full(n - len(a), value, a.dtype)]) if n > len(a) else a

    spec_idx, ns_idx = np.flatnonzero(mask), np.flatnonzero(~mask)
    n_spec_rows = len(spec_idx) if padded_rows is None else padded_rows
    n_ns_rows = len(ns_idx) if padded_rows is None else padded_rows
    n_mask = N if padded_rows is None else padded_rows

    # State rows: columns [start, start + S) / start; a row outside the table gets pad_id.
    # Replay mode: one column, start (the checkpoint), in column 0 of the spec row.
    rows, cols = table.shape
    width = 1 if replay else S
    spec_cols = start[spec_idx, None] + np.arange(width)
    ok = (spec_idx < rows) & (spec_cols[:, -1] < cols) if len(spec_idx) else np.zeros(0, bool)
    spec_state = np.full((len(spec_idx), S), pad_id, i32)
    spec_state[ok, :width] = table[spec_idx[ok, None], spec_cols[ok]]
    # Replay mode: the given counts are the replay counts n (absent: 0); acc = max(n, 1).
    given = (
        np.asarray(num_accepted_tokens, np.int64)
        if num_accepted_tokens is not None
        else np.full(N, 0 if replay else 1, np.int64)
    )
    acc = np.maximum(given, 1)
    # Non-spec rows: destination column start, source column start + acc - 1 (both or neither);
    # replay mode: both the checkpoint, column start. Without an initial state: no source.
    initial = context[ns_idx] > 0
    ns_src_col = start[ns_idx] + np.where(initial, 0 if replay else acc[ns_idx] - 1, 0)
    ns_ok = (ns_idx < rows) & (ns_src_col < cols)
    ns_state = np.full(len(ns_idx), pad_id, i32)
    ns_state[ns_ok] = table[ns_idx[ns_ok], start[ns_idx][ns_ok]]
    ns_source = np.full(len(ns_idx), pad_id, i32)
    reads = ns_ok & initial
    ns_source[reads] = table[ns_idx[reads], ns_src_col[reads]]
    spec_acc = acc[mask].astype(i32)
    return dict(
        counts=dict(
            num_requests=N,
            num_prefills=prefills,
            num_prefill_tokens=n_ns_tok - decode_tokens,
            num_decodes=decodes,
            num_decode_tokens=decode_tokens,
            num_spec_decodes=len(spec_idx),
            num_spec_decode_tokens=int(qlen[mask].sum()),
            num_actual_tokens=int(qsl[-1]),
            num_non_spec_rows=len(ns_idx),
            num_zero_length_rows=zero,
            spec_rows_written=n_spec_rows,
            non_spec_rows_written=n_ns_rows,
            mask_rows_written=n_mask,
            max_column_end=int((start + S).max()) if N else 0,
            num_spec_columns=S,
            padded_rows=-1 if padded_rows is None else padded_rows,
            replay=int(bool(replay)),
        ),
        unreadable=int((~ok).sum() + (~ns_ok).sum()),
        spec_sequence_masks=pad_to(mask, n_mask, False),
        non_spec_token_indx=order[:n_ns_tok].astype(i32),
        spec_token_indx=order[n_ns_tok:].astype(i32),
        spec_query_start_loc=pad_to(
            np.concatenate([[0], np.cumsum(qlen[mask])]).astype(i32), n_spec_rows + 1, int(qlen[mask].sum())
        ),
        non_spec_query_start_loc=pad_to(np.concatenate([[0], np.cumsum(ns_len)]).astype(i32), n_ns_rows + 1, n_ns_tok),
        spec_num_accepted=pad_to(spec_acc, n_spec_rows, 1),
        spec_source_column=pad_to(spec_acc - 1, n_spec_rows, 0),
        non_spec_source_column=pad_to((acc[ns_idx] - 1).astype(i32), n_ns_rows, 0),
        has_initial_state=pad_to(context[~mask] > 0, n_ns_rows, False),
        spec_state_indices=pad_to(spec_state.reshape(-1), n_spec_rows * S, pad_id).reshape(-1, S),
        non_spec_state_indices=pad_to(ns_state, n_ns_rows, pad_id),
        non_spec_source_indices=pad_to(ns_source, n_ns_rows, pad_id),
        **(
            dict(
                replay_counts=pad_to(given[mask].astype(i32), n_spec_rows, 0),
                non_spec_replay_counts=pad_to(given[~mask].astype(i32), n_ns_rows, 0),
                checkpoint_indices=pad_to(spec_state[:, 0], n_spec_rows, pad_id),
            )
            if replay
            else {}
        ),
    )


# ---- views ---------------------------------------------------------------------------------------


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
    def non_spec_source_column(self) -> Any:
        """acc - 1 of each non-spec row: its source column, counted from the row's start."""
        return self._v["non_spec_source_column"][: self.non_spec_rows]

    @property
    def has_initial_state(self) -> Any:
        return self._v["has_initial_state"][: self.non_spec_rows]

    @property
    def replay_counts(self) -> Any:
        """Replay mode: n of each spec row, the window tokens it replays (padded rows 0), as
        :func:`gdn.decode_mtp_replay` takes them; None for a plan made without replay."""
        return self._v["replay_counts"][: self.spec_rows] if self.replay else None

    @property
    def non_spec_replay_counts(self) -> Any:
        """Replay mode: n of each non-spec row (padded rows 0); None without replay."""
        return self._v["non_spec_replay_counts"][: self.non_spec_rows] if self.replay else None

    @property
    def non_spec_token_indx(self) -> Any:
        return self._v["token_split"][: self.num_non_spec_tokens]

    @property
    def spec_token_indx(self) -> Any:
        return self._v["token_split"][self.num_non_spec_tokens : int(self._c[_H["num_actual_tokens"]])]

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
    """One step's metadata: views of the builder's persistent buffers (valid until the next step;
    the builder hands out one such object per host plan buffer).

    Shared fields (on the builder's device): ``spec_sequence_masks``, ``spec_token_indx``,
    ``non_spec_token_indx``, ``spec_query_start_loc``, ``non_spec_query_start_loc``,
    ``spec_num_accepted``, ``spec_source_column``, ``has_initial_state``; counts as attributes
    (``num_prefills``, ``num_spec_decodes``, ...). Per group: ``spec_state_indices`` [G, rows, S],
    ``non_spec_state_indices`` [G, rows] (where each non-spec row writes its state) and
    ``non_spec_source_indices`` [G, rows] (where it reads it: the slot the previous step left
    it in). ``host`` views the host plan of the step (accepted counts gathered on the device
    read 1 there, replay counts 0).

    Replay mode (``Builder(..., replay=True)``): ``checkpoint_indices`` [G, rows] (int32, each
    spec row's checkpoint slot, block table column ``start``; padded rows ``pad_id``),
    ``replay_counts`` [rows] and ``non_spec_replay_counts`` [rows] (int32, shared; padded rows
    0); ``replay_args(g)`` are the arrays :func:`gdn.decode_mtp_replay` takes. Without replay
    these are None.
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

    @property
    def non_spec_source_indices(self) -> Any:
        return self._b.non_spec_source_indices[:, : self.non_spec_rows]

    @property
    def checkpoint_indices(self) -> Any:
        """Replay mode: [G, rows] checkpoint slot of each spec row per group; None without."""
        ck = self._b.checkpoint_indices
        return None if ck is None else ck[:, : self.spec_rows]

    def decode_mtp_args(self, group: int) -> Dict[str, Any]:
        """``state_indices``, ``cu_seqlens`` and ``num_accepted_tokens`` of group ``group``'s spec
        rows, ready for :func:`gdn.decode_mtp` (its mixed_qkv rows are ``spec_token_indx``)."""
        return {
            "state_indices": self._b.spec_state_indices[group, : self.spec_rows],
            "cu_seqlens": self.spec_query_start_loc,
            "num_accepted_tokens": self.spec_num_accepted,
        }

    def replay_args(self, group: int) -> Dict[str, Any]:
        """Replay mode: ``state_indices`` (group ``group``'s checkpoints), ``cu_seqlens`` and
        ``num_accepted_tokens`` (the replay counts) of the spec rows, ready for
        :func:`gdn.decode_mtp_replay` (its mixed_qkv rows are ``spec_token_indx``)."""
        if self._b.checkpoint_indices is None:
            raise ValueError("replay_args needs a builder made with replay=True")
        return {
            "state_indices": self._b.checkpoint_indices[group, : self.spec_rows],
            "cu_seqlens": self.spec_query_start_loc,
            "num_accepted_tokens": self.replay_counts,
        }


class Builder:
    """Persistent metadata buffers for an engine's G KV-cache groups, filled in place each step.

    A thin owner of the buffers (NumPy or torch, CPU or CUDA) around the C++ builder
    ``gdn::metadata::Builder`` (``include/gdn/metadata/builder.hpp``), which does the work: the
    plan, the staging ring, the one launch, graph-safe prepare/launch and the shadow check.

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

    ``replay``: replay mode (module docstring) for :func:`gdn.decode_mtp_replay`: one
    checkpoint slot per request and group (column ``start``); each step's
    ``num_accepted_tokens`` are the replay counts n (0..S) and the step also fills
    ``checkpoint_indices`` [G, max_rows] and the replay counts. Refused with mode ``"align"``.

    The block tables, ``num_spec``, ``pad_id``, ``replay`` and the capacity are fixed for the
    builder's life: a CUDA graph that captured :meth:`launch` bakes them in.
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
        replay: bool = False,
    ):
        tables = list(block_tables)
        if not tables or len(tables) > MAX_GROUPS:
            raise ValueError(f"block_tables must hold 1..{MAX_GROUPS} arrays, got {len(tables)}")
        if staging not in ("pinned", "pageable"):
            raise ValueError(f"staging must be 'pinned' or 'pageable', got {staging!r}")
        self.num_groups = len(tables)
        self.num_spec = int(num_spec)
        self.max_rows = int(max_rows)
        self.max_tokens = int(max_tokens)
        self.mode = mode
        self.block_size = int(block_size)
        self.pad_id = int(pad_id)
        self.replay = bool(replay)
        self.shadow = os.environ.get("GDN_METADATA_SHADOW", "0") not in ("", "0") if shadow is None else shadow
        self.block_tables = tables
        S = self.num_spec + 1
        G, R = self.num_groups, self.max_rows
        words = plan_words(self.max_rows, self.max_tokens)
        self._torch = _is_torch(tables[0])
        self._cuda = self._torch and tables[0].device.type == "cuda"
        pinned = self._cuda and staging == "pinned"
        # The buffers are torch tensors or NumPy arrays, as the block tables are (the binding takes
        # either).
        self.spec_state_indices: Any
        self.non_spec_state_indices: Any
        self.non_spec_source_indices: Any
        self.checkpoint_indices: Any
        self.error_count: Any
        self.device_plan: Any
        self.host_plans: Any
        if self._torch:
            import torch

            dev = tables[0].device
            self.device = dev
            zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int32, device=dev)  # noqa: E731
            self.spec_state_indices = zeros(G, R, S)
            self.non_spec_state_indices = zeros(G, R)
            self.non_spec_source_indices = zeros(G, R)
            self.checkpoint_indices = zeros(G, R) if self.replay else None
            self.error_count = zeros(1)
            self.device_plan = zeros(words) if self._cuda else None
            self.host_plans = [
                torch.zeros(words, dtype=torch.int32, pin_memory=pinned)
                for _ in range(max(1, int(staging_slots)) if pinned else 1)
            ]
            if self._cuda:
                raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
                index = dev.index if dev.index is not None else torch.cuda.current_device()
                self._current_stream = (
                    (lambda: raw(index)) if raw is not None else (lambda: torch.cuda.current_stream(dev).cuda_stream)
                )
        else:
            self.device = "cpu"
            self.spec_state_indices = np.zeros((G, R, S), np.int32)
            self.non_spec_state_indices = np.zeros((G, R), np.int32)
            self.non_spec_source_indices = np.zeros((G, R), np.int32)
            self.checkpoint_indices = np.zeros((G, R), np.int32) if self.replay else None
            self.error_count = np.zeros(1, np.int32)
            self.device_plan = None
            self.host_plans = [np.zeros(words, np.int32)]
        try:
            self._native = _C.MetadataBuilder(
                tables,
                self.spec_state_indices,
                self.non_spec_state_indices,
                self.non_spec_source_indices,
                self.checkpoint_indices,
                self.host_plans,
                self.device_plan,
                self.error_count,
                self.num_spec,
                self.max_rows,
                self.max_tokens,
                mode,
                self.block_size,
                self.pad_id,
                self.replay,
                pinned,
                False,
            )
        except TypeError:
            raise_argument_error(
                "metadata.Builder", {"block_tables": "arrays", "mode": "str"}, {"block_tables": tables, "mode": mode}
            )
            raise
        plan_buffer = self.device_plan if self._cuda else self.host_plans[0]
        self._views = _field_views(plan_buffer, self.max_rows, self.max_tokens)
        self._host_views = [_field_views(h, self.max_rows, self.max_tokens) for h in self.host_plans]
        self._host_counts = [(h.numpy() if self._torch else h)[: len(HEADER_FIELDS)] for h in self.host_plans]
        # A step's metadata is views of the buffers: one object per host plan buffer serves
        # every step that plans into it.
        self._metadata = [StepMetadata(self, PlanView(v, c)) for v, c in zip(self._host_views, self._host_counts)]

    # -- the step ---------------------------------------------------------------------------------

    def _stream(self, stream: Optional[int]) -> Optional[int]:
        if stream is not None:
            return _stream_of(None, stream)
        return self._current_stream() if self._cuda else None

    def step(
        self,
        query_start_loc: Input,
        seq_lens: Input,
        *,
        num_draft_tokens: Optional[Input] = None,
        num_accepted_tokens: Optional[Input] = None,
        num_computed_tokens: Optional[Input] = None,
        padded_rows: Optional[int] = None,
        stream: Optional[int] = None,
    ) -> StepMetadata:
        """Plans the step (host arrays, see :func:`plan`; ``num_accepted_tokens`` may live on the
        device, then the launch gathers it; in replay mode they are the replay counts) and fills
        every group's state rows in one pass. The inputs are only read (read-only arrays are
        fine); host arrays may be int32 or int64 (NumPy's default integer; converted to an int32
        copy each step, so pass int32 to save it), a device ``num_accepted_tokens`` int32."""
        query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens, num_computed_tokens = _int32_host(
            "step", query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens, num_computed_tokens
        )
        s = self._stream(stream)
        try:
            k = self._native.step(
                query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens, num_computed_tokens, padded_rows, s
            )
        except TypeError:
            raise_argument_error("metadata.Builder.step", _BUILDER_STEP_KINDS, locals())
            raise
        if self.shadow:
            self._check(
                s, query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens, num_computed_tokens, padded_rows
            )
        return self._metadata[k]

    def prepare(
        self,
        query_start_loc: Input,
        seq_lens: Input,
        *,
        num_draft_tokens: Optional[Input] = None,
        num_accepted_tokens: Optional[Input] = None,
        num_computed_tokens: Optional[Input] = None,
        padded_rows: Optional[int] = None,
        stream: Optional[int] = None,
    ) -> StepMetadata:
        """Plans the step and copies the plan to the device buffer, without the state-row launch:
        what precedes the replay of a CUDA graph that captured :meth:`launch`. Inputs as
        :meth:`step`'s."""
        query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens, num_computed_tokens = _int32_host(
            "prepare", query_start_loc, seq_lens, num_draft_tokens, num_accepted_tokens, num_computed_tokens
        )
        try:
            k = self._native.prepare(
                query_start_loc,
                seq_lens,
                num_draft_tokens,
                num_accepted_tokens,
                num_computed_tokens,
                padded_rows,
                self._stream(stream),
            )
        except TypeError:
            raise_argument_error("metadata.Builder.prepare", _BUILDER_STEP_KINDS, locals())
            raise
        return self._metadata[k]

    def launch(
        self,
        launch_rows: int,
        *,
        num_accepted_tokens: Any = None,
        stream: Optional[int] = None,
    ) -> Optional[int]:
        """The state-row pass alone (one CUDA launch over ``launch_rows`` rows) reading the device
        plan buffer: capture it in a CUDA graph, then :meth:`prepare` + replay each step."""
        try:
            return self._native.launch(launch_rows, num_accepted_tokens, self._stream(stream))
        except TypeError:
            raise_argument_error(
                "metadata.Builder.launch", {"launch_rows": "int", "num_accepted_tokens": "buffer?"}, locals()
            )
            raise

    # -- debug ------------------------------------------------------------------------------------

    def _check(self, stream, qsl, seq_lens, drafts, accepted, computed, padded_rows) -> None:
        """The shadow check (C++): every group rebuilt on its own from the step's inputs and
        compared with the buffers; synchronises the stream on CUDA."""
        message = self._native.check(qsl, seq_lens, drafts, accepted, computed, padded_rows, stream)
        if message:
            raise RuntimeError(message)


# Builder.step and Builder.prepare take the same step inputs (tests/py/test_metadata.py).
_BUILDER_STEP_KINDS = argument_kinds(Builder.step)
_STEP_INPUTS = [name for name in _BUILDER_STEP_KINDS if name not in ("padded_rows",)]
_INT32 = np.iinfo(np.int32)


def _int32_host(method: str, *arrays: Any) -> List[Any]:
    """The builder's step inputs with each int64 host array (NumPy's default integer, or a torch
    CPU tensor) replaced by an int32 copy: the C++ plan reads int32. Other arrays pass as they
    are, for the binding to accept or refuse by name."""
    out = list(arrays)
    for i, x in enumerate(arrays):
        if x is None or str(getattr(x, "dtype", "")) not in ("int64", "torch.int64"):
            continue
        device = getattr(x, "device", "cpu")
        if getattr(device, "type", device) != "cpu":
            continue
        values = np.asarray(x)
        if values.size and (values.min() < _INT32.min or values.max() > _INT32.max):
            raise ValueError(
                f"gdn.metadata.Builder.{method}: {_STEP_INPUTS[i]} holds a value outside int32 "
                f"(min {values.min()}, max {values.max()}); the metadata plan reads int32"
            )
        out[i] = values.astype(np.int32)
    return out
