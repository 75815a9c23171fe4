"""gdn.metadata: the classification cases of vLLM's GDN builder tests, the shared plan + one-pass
state rows against the tests' own per-group builder (NumPy, written independently of the C++
code) on random steps (hypothesis), graph padding, bounds, errors, the shadow check, the torch
ops, decode_mtp fed straight from the builder, and replay mode (checkpoints and replay counts,
decode_mtp_replay fed from the builder). CUDA tests skip without a GPU."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import pytest

import gdn
from gdn import metadata as M

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reference_torch import cuda_skip_reason  # noqa: E402 (needs torch)

_CUDA_REASON = cuda_skip_reason()
CUDA = _CUDA_REASON is None
needs_cuda = pytest.mark.skipif(not CUDA, reason=f"CUDA: {_CUDA_REASON}")

I32 = np.int32


# ---- the tests' own per-group builder ------------------------------------------------------------


def per_group_reference(step: Dict[str, Any], table: np.ndarray) -> Dict[str, Any]:
    """One group's metadata built the way a per-group builder does it: boolean masks,
    repeat + stable argsort for the token split, cumulative sums, fancy-index gathers."""
    qsl, seq_lens = step["qsl"], step["seq_lens"]
    drafts, acc, computed = step["drafts"], step["acc"], step["computed"]
    replay = step.get("replay", False)
    S = step["num_spec"] + 1
    pad, padded = step["pad_id"], step["padded_rows"]
    N = len(qsl) - 1
    qlen = np.diff(qsl)
    # Spec rows: every row with drafts >= 0, zero drafts included (vLLM keeps them on the spec
    # path, the only one that reads column acc - 1).
    mask = np.zeros(N, bool) if drafts is None else drafts >= 0
    ns_len = qlen[~mask]
    zero = int((ns_len == 0).sum())
    n_ns_tok = int(ns_len.sum())
    context = computed if computed is not None else seq_lens - qlen
    if not mask.any():
        # vLLM's split_decodes_and_prefills(threshold=1, treat_short_extends_as_decodes=False),
        # as it is written there, with is_prefilling = a row with tokens and no context; then
        # the trailing zero-length (padding) rows leave the prefill count.
        is_prefill = (qlen > 1) | ((qlen > 0) & (context == 0))
        if N == 0 or not is_prefill.any():
            decodes, prefills, decode_tokens = N, 0, int(qsl[-1])
        elif is_prefill[0]:
            decodes, prefills, decode_tokens = 0, N, 0
        else:
            first_prefill = int(np.argmax(is_prefill))
            decodes, prefills, decode_tokens = first_prefill, N - first_prefill, int(qsl[first_prefill])
        if prefills:
            trailing = N - 1 - int(np.flatnonzero(qlen > 0)[-1])
            prefills -= trailing
    else:
        # With spec rows: 1-token rows are decodes reclassified as prefills, zero-length neither.
        decodes, decode_tokens = 0, 0
        prefills = int((ns_len >= 1).sum())
    order = np.argsort(np.repeat(mask, qlen), kind="stable")
    if step["mode"] == "align":
        start = np.maximum((seq_lens.astype(np.int64) - 1) // step["block_size"], 0)
    else:
        start = np.zeros(N, np.int64)

    def pad_to(a, n, value):
        return np.concatenate([a, np.full(n - len(a), value, a.dtype)]) if n > len(a) else a

    spec_idx, ns_idx = np.flatnonzero(mask), np.flatnonzero(~mask)
    n_spec_rows = len(spec_idx) if padded is None else padded
    n_ns_rows = len(ns_idx) if padded is None else padded
    n_mask = N if padded is None else padded

    rows, cols = table.shape
    # Replay mode (replay.md §3): the given counts are the window tokens to replay, n in 0..S
    # (absent: 0); a row then accepts max(n, 1).
    given = acc if acc is not None else np.full(N, 0 if replay else 1, I32)
    acc_all = np.maximum(given, 1)
    if replay:
        # One slot per request and group: column start, the checkpoint. Spec rows hold it in
        # column 0 (no other column names a slot); non-spec rows read and write it.
        spec_state = np.full((len(spec_idx), S), pad, I32)
        ok = np.zeros(len(spec_idx), bool)
        for j, i in enumerate(spec_idx):
            if i < rows and start[i] < cols:
                ok[j] = True
                spec_state[j, 0] = table[i, start[i]]
        src_col = start[ns_idx]
    else:
        # State rows: columns [start, start + S) / start; a row outside the table is padded.
        spec_cols = start[spec_idx, None] + np.arange(S)
        ok = (spec_idx < rows) & (spec_cols[:, -1] < cols) if len(spec_idx) else np.zeros(0, bool)
        spec_state = np.full((len(spec_idx), S), pad, I32)
        spec_state[ok] = table[spec_idx[ok, None], spec_cols[ok]]
        # Non-spec rows: write column start, read column start + acc - 1 (vLLM's
        # spec_decode_src_indices); a row with either outside its table is padded.
        src_col = start[ns_idx] + acc_all[ns_idx].astype(np.int64) - 1
    # A row without context (a fresh request) reads no slot: only its destination must exist,
    # and its source is the pad id.
    initial = context[ns_idx] > 0
    src_col = np.where(initial, src_col, start[ns_idx])
    ns_state = np.full(len(ns_idx), pad, I32)
    ns_source = np.full(len(ns_idx), pad, I32)
    ns_ok = np.zeros(len(ns_idx), bool)
    for j, i in enumerate(ns_idx):
        if i < rows and src_col[j] < cols:
            ns_ok[j] = True
            ns_state[j] = table[i, start[i]]
            ns_source[j] = table[i, src_col[j]] if initial[j] else pad
    spec_acc = acc_all[mask]
    extra = {}
    if replay:
        extra = dict(
            replay_counts=pad_to(given[mask].astype(I32), n_spec_rows, 0),
            non_spec_replay_counts=pad_to(given[~mask].astype(I32), n_ns_rows, 0),
            checkpoint_indices=pad_to(spec_state[:, 0].copy(), n_spec_rows, pad),
        )
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
            max_column_end=max([int(c) + S for c in start], default=0),
            num_spec_columns=S,
            padded_rows=-1 if padded is None else padded,
            replay=int(replay),
        ),
        unreadable=int((~ok).sum() + (~ns_ok).sum()),
        spec_sequence_masks=pad_to(mask, n_mask, False),
        non_spec_token_indx=order[:n_ns_tok].astype(I32),
        spec_token_indx=order[n_ns_tok:].astype(I32),
        spec_query_start_loc=pad_to(
            np.concatenate([[0], np.cumsum(qlen[mask])]).astype(I32), n_spec_rows + 1, int(qlen[mask].sum())
        ),
        non_spec_query_start_loc=pad_to(np.concatenate([[0], np.cumsum(ns_len)]).astype(I32), n_ns_rows + 1, n_ns_tok),
        spec_num_accepted=pad_to(spec_acc.astype(I32), n_spec_rows, 1),
        spec_source_column=pad_to(spec_acc.astype(I32) - 1, n_spec_rows, 0),
        non_spec_source_column=pad_to(acc_all[ns_idx].astype(I32) - 1, n_ns_rows, 0),
        has_initial_state=pad_to(context[~mask] > 0, n_ns_rows, False),
        spec_state_indices=pad_to(spec_state.reshape(-1), n_spec_rows * S, pad).reshape(-1, S),
        non_spec_state_indices=pad_to(ns_state, n_ns_rows, pad),
        non_spec_source_indices=pad_to(ns_source, n_ns_rows, pad),
        **extra,
    )


SHARED_FIELDS = (
    "spec_sequence_masks",
    "non_spec_token_indx",
    "spec_token_indx",
    "spec_query_start_loc",
    "non_spec_query_start_loc",
    "spec_num_accepted",
    "spec_source_column",
    "non_spec_source_column",
    "has_initial_state",
)


def as_np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def expect_matches_reference(md: M.StepMetadata, step: Dict[str, Any], tables) -> None:
    G = len(tables)
    for g in range(G):
        ref = per_group_reference(step, as_np(tables[g]))
        counts = md.counts()
        for name, value in ref["counts"].items():
            assert counts[name] == value, (g, name, counts[name], value)
        for name in SHARED_FIELDS:
            np.testing.assert_array_equal(as_np(getattr(md, name)), ref[name], err_msg=name)
        np.testing.assert_array_equal(
            as_np(md.spec_state_indices[g]), ref["spec_state_indices"], err_msg=f"group {g} spec_state_indices"
        )
        np.testing.assert_array_equal(
            as_np(md.non_spec_state_indices[g]),
            ref["non_spec_state_indices"],
            err_msg=f"group {g} non_spec_state_indices",
        )
        np.testing.assert_array_equal(
            as_np(md.non_spec_source_indices[g]),
            ref["non_spec_source_indices"],
            err_msg=f"group {g} non_spec_source_indices",
        )
        if not step.get("replay", False):
            assert md.checkpoint_indices is None and md.replay_counts is None
            continue
        for name in ("replay_counts", "non_spec_replay_counts"):
            np.testing.assert_array_equal(as_np(getattr(md, name)), ref[name], err_msg=name)
        np.testing.assert_array_equal(
            as_np(md.checkpoint_indices[g]), ref["checkpoint_indices"], err_msg=f"group {g} checkpoint_indices"
        )


def make_step(
    rows: List[Tuple[int, int]],
    num_spec: int,
    *,
    context: Any = 5,
    acc: Optional[List[int]] = None,
    mode: str = "none",
    block_size: int = 16,
    padded_rows: Optional[int] = None,
    pad_id: int = 0,
    replay: bool = False,
) -> Dict[str, Any]:
    T = np.array([t for t, _ in rows], I32)
    return dict(
        qsl=np.concatenate([[0], np.cumsum(T)]).astype(I32),
        seq_lens=(T + np.asarray(context)).astype(I32),
        drafts=np.array([d for _, d in rows], I32),
        acc=np.array(acc if acc is not None else [1] * len(rows), I32),
        computed=np.broadcast_to(np.asarray(context, I32), (len(rows),)).copy(),
        num_spec=num_spec,
        mode=mode,
        block_size=block_size,
        padded_rows=padded_rows,
        pad_id=pad_id,
        replay=replay,
    )


def make_tables(G: int, rows: int, cols: int, *, lib=np, rng=None) -> List[Any]:
    rng = rng or np.random.default_rng(0)
    tabs = [rng.integers(1, 1 << 20, size=(rows, cols)).astype(I32) for _ in range(G)]
    return tabs if lib is np else [torch.from_numpy(t) for t in tabs]


def step_args(step: Dict[str, Any], convert=lambda a: a) -> Dict[str, Any]:
    c = lambda a: None if a is None else convert(a)  # noqa: E731
    return dict(
        num_draft_tokens=c(step["drafts"]),
        num_accepted_tokens=c(step["acc"]),
        num_computed_tokens=c(step["computed"]),
        padded_rows=step["padded_rows"],
    )


def run_builder(step, tables, *, max_rows=None, max_tokens=None, shadow=True, **kw):
    N = len(step["qsl"]) - 1
    rows = max(N, step["padded_rows"] or 0, 1) + 2
    b = M.Builder(
        tables,
        num_spec=step["num_spec"],
        max_rows=max_rows or rows,
        max_tokens=max_tokens or int(step["qsl"][-1]) + 3,
        mode=step["mode"],
        block_size=step["block_size"],
        pad_id=step["pad_id"],
        shadow=shadow,
        replay=step.get("replay", False),
        **kw,
    )
    md = b.step(step["qsl"], step["seq_lens"], **step_args(step))
    return b, md


# ---- classification (the cases of vLLM's builder tests) ------------------------------------------

CASES = {
    # name: (rows (tokens, drafts), num_spec, expected counts)
    "mixed decode + spec -> decode reclassified": (
        [(3, 2), (1, -1), (3, 2)],
        2,
        dict(num_prefills=1, num_prefill_tokens=1, num_decodes=0, num_spec_decodes=2, num_spec_decode_tokens=6),
    ),
    "pure spec": (
        [(3, 2), (2, 1), (3, 2)],
        2,
        dict(num_prefills=0, num_decodes=0, num_spec_decodes=3, num_spec_decode_tokens=8),
    ),
    "pure decode": ([(1, -1)] * 4, 3, dict(num_prefills=0, num_decodes=4, num_decode_tokens=4, num_spec_decodes=0)),
    "spec + prefill": (
        [(2, 1), (7, -1), (2, 1)],
        1,
        dict(num_prefills=1, num_prefill_tokens=7, num_decodes=0, num_spec_decodes=2, num_spec_decode_tokens=4),
    ),
    "prefill + decode + spec": (
        [(5, -1), (1, -1), (4, 3), (2, 1)],
        3,
        dict(num_prefills=2, num_prefill_tokens=6, num_decodes=0, num_spec_decodes=2),
    ),
    "several decodes reclassified": (
        [(1, -1), (2, 1), (1, -1), (1, -1), (2, 1)],
        1,
        dict(num_prefills=3, num_prefill_tokens=3, num_decodes=0, num_spec_decodes=2),
    ),
    "zero-length padding excluded (with spec)": (
        [(3, 2), (0, -1), (3, 2), (0, -1)],
        2,
        dict(num_prefills=0, num_decodes=0, num_spec_decodes=2, num_zero_length_rows=2, num_non_spec_rows=2),
    ),
    # Without spec rows vLLM's decodes are the leading run of rows with <= 1 token; the prefills
    # end at the last row with a token (trailing zero-length rows are padding, in neither count).
    "no spec: decodes are the leading run": (
        [(1, -1), (4, -1), (0, -1), (1, -1), (0, -1)],
        2,
        dict(num_prefills=3, num_prefill_tokens=5, num_decodes=1, num_decode_tokens=1, num_zero_length_rows=2),
    ),
    "no spec: a 1-token row after a 2-token row is a prefill": (
        [(2, -1), (1, -1)],
        2,
        dict(num_prefills=2, num_prefill_tokens=3, num_decodes=0, num_decode_tokens=0),
    ),
    "no spec: zero-length rows in the leading run are decodes": (
        [(0, -1), (1, -1), (0, -1), (3, -1), (0, -1)],
        2,
        dict(num_prefills=1, num_prefill_tokens=3, num_decodes=3, num_decode_tokens=1),
    ),
    "no spec: only rows of <= 1 token": (
        [(1, -1), (0, -1), (1, -1)],
        1,
        dict(num_prefills=0, num_decodes=3, num_decode_tokens=2, num_zero_length_rows=1),
    ),
    "all-zero drafts keep their spec rows": (
        [(1, 0), (1, 0), (1, -1)],
        2,
        dict(num_prefills=1, num_prefill_tokens=1, num_decodes=0, num_spec_decodes=2, num_spec_decode_tokens=2),
    ),
    "all-zero drafts with a prefill": (
        [(1, 0), (5, -1), (1, 0)],
        2,
        dict(num_prefills=1, num_prefill_tokens=5, num_decodes=0, num_spec_decodes=2),
    ),
}


# ---- vLLM 0.33.0's rules: fresh rows, trailing padding, zero-draft steps ---------------------------


def issue_builder(step, tables, device):
    """A builder over `tables` on `device` ("cpu" or "cuda"), its step and a host copy of md."""
    if device == "cuda":
        tables = [torch.from_numpy(t).cuda() for t in tables]
    b, md = run_builder(step, tables)
    if device == "cuda":
        torch.cuda.synchronize()
    return b, md


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("padding", [0, 2])
def test_a_fresh_one_token_prompt_is_a_prefill_and_reads_no_slot(device, padding):
    """seq_lens [100, 1], query lengths [1, 1], request 1 new (no computed tokens): 1 decode and
    1 prefill, has_initial_state [True, False], and request 1's source is the pad id, never the
    slot a finished request may have left full. The same with trailing padding rows."""
    rows = [(1, -1), (1, -1)] + [(0, -1)] * padding
    step = make_step(rows, 2, context=[99, 0] + [0] * padding, acc=[2, 3] + [1] * padding, pad_id=-1)
    tables = make_tables(2, len(rows), 4, rng=np.random.default_rng(3))
    _, md = issue_builder(step, tables, device)
    assert (md.num_decodes, md.num_decode_tokens) == (1, 1)
    assert (md.num_prefills, md.num_prefill_tokens) == (1, 1)
    assert as_np(md.has_initial_state)[:2].tolist() == [True, False]
    for g in range(2):
        src, dst = as_np(md.non_spec_source_indices[g]), as_np(md.non_spec_state_indices[g])
        assert src[0] == tables[g][0, 1] and dst[0] == tables[g][0, 0]
        assert src[1] == -1 and dst[1] == tables[g][1, 0]  # writes its slot, reads none
    expect_matches_reference(md, step, tables)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("replay", [False, True])
def test_a_fresh_row_among_spec_rows_reads_no_slot(device, replay):
    """With spec rows every non-spec row is a prefill; a fresh one still gets a null source, in
    both state modes (replay: its checkpoint is its destination, never its source)."""
    step = make_step(
        [(3, 2), (1, -1), (2, -1)], 2, context=[9, 0, 4], acc=[2, 0, 1] if replay else [2, 1, 1], replay=replay
    )
    tables = make_tables(2, 3, 3, rng=np.random.default_rng(4))
    _, md = issue_builder(step, tables, device)
    assert md.num_spec_decodes == 1 and md.num_prefills == 2 and md.num_decodes == 0
    assert as_np(md.has_initial_state)[:2].tolist() == [False, True]
    for g in range(2):
        src = as_np(md.non_spec_source_indices[g])
        assert src[0] == 0 and as_np(md.non_spec_state_indices[g])[0] == tables[g][1, 0]
        assert src[1] == tables[g][2, 0]
    expect_matches_reference(md, step, tables)


@pytest.mark.parametrize("device", DEVICES)
def test_trailing_padding_rows_are_in_neither_count(device):
    """seq_lens [10, 20, 0, 16], query lengths [1, 5, 0, 0], no spec rows: 1 decode, 1 prefill
    (the two trailing zero-length rows are padding); token counts unchanged."""
    step = dict(
        make_step([(1, -1), (5, -1), (0, -1), (0, -1)], 2), computed=None, seq_lens=np.array([10, 20, 0, 16], I32)
    )
    tables = make_tables(1, 4, 3)
    _, md = issue_builder(step, tables, device)
    assert (md.num_decodes, md.num_decode_tokens) == (1, 1)
    assert (md.num_prefills, md.num_prefill_tokens) == (1, 5)
    assert md.num_zero_length_rows == 2 and md.num_non_spec_rows == 4
    expect_matches_reference(md, step, tables)


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_whose_rows_all_drafted_nothing_keeps_its_spec_rows(device):
    """Drafts [0, 0], accepted [3, 1], num_spec 3: two spec rows of one token each, which read
    their state at column acc - 1 of their own S-column rows; no non-spec rows."""
    step = make_step([(1, 0), (1, 0)], 3, acc=[3, 1])
    tables = make_tables(2, 2, 4, rng=np.random.default_rng(5))
    _, md = issue_builder(step, tables, device)
    assert md.num_spec_decodes == 2 and md.num_spec_decode_tokens == 2
    assert md.num_decodes == 0 and md.num_prefills == 0 and md.num_non_spec_rows == 0
    assert as_np(md.spec_sequence_masks).tolist() == [True, True]
    assert as_np(md.spec_num_accepted).tolist() == [3, 1]
    for g in range(2):
        np.testing.assert_array_equal(as_np(md.spec_state_indices[g])[:2], tables[g])
    expect_matches_reference(md, step, tables)


@pytest.mark.parametrize("name", list(CASES))
def test_classification(name):
    rows, num_spec, expected = CASES[name]
    step = make_step(rows, num_spec)
    tables = make_tables(2, len(rows), num_spec + 2)
    _, md = run_builder(step, tables)
    counts = md.counts()
    for key, value in expected.items():
        assert counts[key] == value, (key, counts[key], value)
    expect_matches_reference(md, step, tables)


def test_plan_free_function_and_views_on_numpy():
    step = make_step([(2, 1), (7, -1), (2, 1)], 1, acc=[2, 1, 1])
    words = M.plan_words(8, 32)
    buf = np.full(words, -5, I32)
    M.plan(
        buf,
        step["qsl"],
        step["seq_lens"],
        num_draft_tokens=step["drafts"],
        num_accepted_tokens=step["acc"],
        num_computed_tokens=step["computed"],
        num_spec=1,
        max_rows=8,
        max_tokens=32,
    )
    view = M.PlanView(M._field_views(buf, 8, 32), buf[: len(M.HEADER_FIELDS)])
    np.testing.assert_array_equal(view.non_spec_token_indx, np.arange(2, 9))
    np.testing.assert_array_equal(view.spec_token_indx, [0, 1, 9, 10])
    np.testing.assert_array_equal(view.spec_query_start_loc, [0, 2, 4])
    np.testing.assert_array_equal(view.spec_num_accepted, [2, 1])
    np.testing.assert_array_equal(view.spec_source_column, [1, 0])
    np.testing.assert_array_equal(view.spec_sequence_masks, [True, False, True])
    np.testing.assert_array_equal(view.spec_request_index, [0, 2])
    assert view.num_spec_decodes == 2 and view.num_prefills == 1


# ---- every row reads its state where the previous step left it (metadata.md §2.1) ----------------


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_non_spec_row_reads_the_previous_steps_slot(lib):
    """Table [[11, 12, 13]], num_spec 2, a row without drafts (-1) whose previous step accepted 3:
    it writes slot 11 and reads slot 13."""
    table = np.array([[11, 12, 13]], I32)
    step = make_step([(1, -1)], 2, acc=[3])
    tables = [table] if lib == "numpy" else [torch.from_numpy(table)]
    _, md = run_builder(step, tables)
    assert md.num_spec_decodes == 0 and md.num_decodes == 1
    assert int(md.non_spec_state_indices[0, 0]) == 11
    assert int(md.non_spec_source_indices[0, 0]) == 13
    assert int(md.non_spec_source_column[0]) == 2
    expect_matches_reference(md, step, [table])


def test_requests_go_from_spec_to_non_spec_and_back():
    """One builder over steps where requests verify drafts, carry none, or all carry none; every
    step's sources are the slots the previous step's accepted counts point at."""
    rng = np.random.default_rng(8)
    tables = make_tables(2, 4, 5, rng=rng)
    b = M.Builder(tables, num_spec=2, max_rows=6, max_tokens=24, shadow=True)
    steps = [
        make_step([(3, 2), (3, 2), (2, 1), (3, 2)], 2, acc=[1, 1, 1, 1], padded_rows=4),
        make_step([(3, 2), (1, -1), (1, 0), (3, 2)], 2, acc=[3, 2, 1, 3]),  # mixed
        make_step([(1, 0), (1, -1), (1, 0), (1, -1)], 2, acc=[2, 1, 3, 3]),  # zero drafts
        make_step([(1, -1), (4, -1), (1, -1), (1, 0)], 2, acc=[1, 2, 1, 2]),  # prefill continues
        make_step([(3, 2), (3, 2), (3, 2), (3, 2)], 2, acc=[3, 2, 1, 2], padded_rows=5),
    ]
    for k, step in enumerate(steps):
        md = b.step(step["qsl"], step["seq_lens"], **step_args(step))
        expect_matches_reference(md, step, tables)
        ns = md.non_spec_request_index
        for g in range(2):
            for j, i in enumerate(ns):
                if i < 0:
                    continue
                assert md.non_spec_source_indices[g, j] == tables[g][i, step["acc"][i] - 1], k
                assert md.non_spec_state_indices[g, j] == tables[g][i, 0], k
    assert md.num_spec_decodes == 4


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_free_functions_write_exactly_the_reference_rows(data):
    """plan + state_rows into poisoned buffers (fresh random steps): the written rows equal the
    tests' own reference and nothing past them is touched."""
    step, tables = data.draw(random_steps())
    N = len(step["qsl"]) - 1
    R, T, G, S = N + 7, int(step["qsl"][-1]) + 2, len(tables), step["num_spec"] + 1
    poison = -777
    plan = np.full(M.plan_words(R, T), poison, I32)
    scalars = dict(num_spec=step["num_spec"], max_rows=R, max_tokens=T)
    M.plan(
        plan,
        step["qsl"],
        step["seq_lens"],
        mode=step["mode"],
        block_size=step["block_size"],
        pad_id=step["pad_id"],
        **step_args(step),
        **scalars,
    )
    spec = np.full((G, R, S), poison, I32)
    ns, src = np.full((G, R), poison, I32), np.full((G, R), poison, I32)
    err = np.zeros(1, I32)
    rows = M.state_rows(
        plan, tables, spec, ns, pad_id=step["pad_id"], error_count=err, non_spec_source_indices=src, **scalars
    )
    view = M.PlanView(M._field_views(plan, R, T), plan[: len(M.HEADER_FIELDS)])
    expected_errors = 0
    for g, table in enumerate(tables):
        ref = per_group_reference(step, table)
        expected_errors += ref["unreadable"]
        counts = view.counts()
        assert {k: counts[k] for k in ref["counts"]} == ref["counts"]
        n_spec, n_ns = ref["counts"]["spec_rows_written"], ref["counts"]["non_spec_rows_written"]
        np.testing.assert_array_equal(spec[g, :n_spec], ref["spec_state_indices"])
        np.testing.assert_array_equal(ns[g, :n_ns], ref["non_spec_state_indices"])
        np.testing.assert_array_equal(src[g, :n_ns], ref["non_spec_source_indices"])
        assert (spec[g, n_spec:] == poison).all()
        assert (ns[g, n_ns:] == poison).all() and (src[g, n_ns:] == poison).all()
    assert rows == expected_errors == int(err[0])


def test_bad_counts_and_sources_are_refused_before_anything_is_written():
    step = make_step([(3, 2), (1, -1)], 2)
    b = M.Builder(make_tables(1, 4, 4), num_spec=2, max_rows=4, max_tokens=16)
    before = [np.copy(x) for x in (b.host_plans[0], b.non_spec_state_indices, b.non_spec_source_indices)]
    kw = step_args(step)
    kw["num_accepted_tokens"] = np.array([1, 4], I32)  # a non-spec row's count is checked too
    with pytest.raises(ValueError, match=r"num_accepted_tokens\[1\] = 4 is outside \[1, S = 3\]"):
        b.step(step["qsl"], step["seq_lens"], **kw)
    for x, y in zip(before, (b.host_plans[0], b.non_spec_state_indices, b.non_spec_source_indices)):
        np.testing.assert_array_equal(x, y)
    plan = np.zeros(M.plan_words(4, 16), I32)
    M.plan(plan, step["qsl"], step["seq_lens"], num_spec=2, max_rows=4, max_tokens=16)
    spec, ns = np.full((1, 4, 3), -5, I32), np.full((1, 4), -5, I32)
    with pytest.raises(ValueError, match="non_spec_source_indices"):
        M.state_rows(
            plan,
            make_tables(1, 4, 4),
            spec,
            ns,
            num_spec=2,
            max_rows=4,
            max_tokens=16,
            non_spec_source_indices=np.zeros((1, 4), np.int64),
        )
    assert (spec == -5).all() and (ns == -5).all()


# ---- property test: shared + fused == independent per-group builds -------------------------------


@st.composite
def random_steps(draw, replay: Optional[bool] = False):
    """A random step and its tables. ``replay``: replay mode (True), not (False) or drawn (None);
    replay steps use mode "none", counts 0..S and tables from one column (one checkpoint slot per
    request) up to S + 2 columns."""
    replay = draw(st.booleans()) if replay is None else replay
    G = draw(st.integers(1, 6))
    S = draw(st.integers(1, 16))
    mode = "none" if replay else draw(st.sampled_from(["none", "align"]))
    N = draw(st.integers(0, 20))
    spec_allowed = draw(st.booleans()) or draw(st.booleans())
    zero_drafts = draw(st.booleans()) and draw(st.booleans())  # every spec row drafts 0
    rows = []
    for _ in range(N):
        kind = draw(
            st.sampled_from(["spec", "spec", "decode", "prefill", "zero"])
            if spec_allowed
            else st.sampled_from(["decode", "decode", "prefill", "zero"])
        )
        if kind == "spec":
            d = 0 if zero_drafts else draw(st.integers(0, S - 1))
            rows.append((draw(st.sampled_from([d + 1, d + 1, d + 1, 0, S])), d))
        else:
            rows.append(({"decode": 1, "prefill": draw(st.integers(2, 12)), "zero": 0}[kind], -1))
    T = np.array([t for t, _ in rows], I32)
    context = np.array(
        draw(st.lists(st.one_of(st.just(0), st.integers(1, 60)), min_size=N, max_size=N)), I32
    )  # 0: a fresh request
    padded = draw(st.one_of(st.none(), st.integers(N, N + 6)))
    step = dict(
        qsl=np.concatenate([[0], np.cumsum(T)]).astype(I32),
        seq_lens=(T + context).astype(I32),
        drafts=np.array([d for _, d in rows], I32),
        acc=np.array(draw(st.lists(st.integers(0 if replay else 1, S), min_size=N, max_size=N)), I32)
        if not (replay and draw(st.booleans()) and draw(st.booleans()))
        else None,
        computed=context if draw(st.booleans()) else None,
        num_spec=S - 1,
        mode=mode,
        block_size=draw(st.integers(1, 16)),
        padded_rows=padded,
        pad_id=draw(st.sampled_from([0, -1])),
        replay=replay,
    )
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    # Align mode sometimes runs past a table's last column; tables may differ in width and rows.
    tables = []
    for _ in range(G):
        if replay:
            cols = int(rng.integers(1, S + 3))
        else:
            cols = S + int(rng.integers(0, 3)) if mode == "none" else S + int(rng.integers(0, 6))
        rows = max(N + int(rng.integers(-2 if replay else 0, 3)), 0)
        tables.append(rng.integers(1, 1 << 20, size=(rows, cols)).astype(I32))
    return step, tables


def corrupt_after_each_step(b, corrupt):
    """Makes builder `b`'s fused pass wrong: its native builder calls `corrupt()` after each step,
    before the shadow check compares against the per-group builds."""
    real = b._native

    class Corrupting:
        def step(self, *args):
            out = real.step(*args)
            corrupt()
            return out

        def __getattr__(self, name):
            return getattr(real, name)

    b._native = Corrupting()


@settings(max_examples=150, deadline=None)
@given(random_steps())
def test_shared_fused_equals_per_group_builds(case):
    step, tables = case
    b, md = run_builder(step, tables)  # also runs the C++ shadow check
    expect_matches_reference(md, step, tables)
    expected_errors = sum(per_group_reference(step, t)["unreadable"] for t in tables)
    assert int(b.error_count[0]) == expected_errors


@settings(max_examples=80, deadline=None)
@given(random_steps(replay=None))
def test_package_step_reference_agrees_with_the_tests(case):
    """gdn.metadata.step_reference (the package's NumPy reference) equals the tests' own."""
    step, tables = case
    for table in tables:
        ours = per_group_reference(step, table)
        theirs = M.step_reference(
            step["qsl"],
            step["seq_lens"],
            table,
            num_draft_tokens=step["drafts"],
            num_accepted_tokens=step["acc"],
            num_computed_tokens=step["computed"],
            num_spec=step["num_spec"],
            mode=step["mode"],
            block_size=step["block_size"],
            padded_rows=step["padded_rows"],
            pad_id=step["pad_id"],
            replay=step["replay"],
        )
        assert theirs["counts"] == ours["counts"] and theirs["unreadable"] == ours["unreadable"]
        assert set(theirs) == set(ours)
        for name, value in ours.items():
            if name not in ("counts", "unreadable"):
                np.testing.assert_array_equal(theirs[name], value, err_msg=name)


# ---- padding, replays, bounds -------------------------------------------------------------------


@pytest.mark.parametrize("pad_id", [0, -1])
def test_padding_follows_the_contract(pad_id):
    step = make_step([(3, 2), (2, 1), (3, 2)], 2, acc=[2, 3, 1], padded_rows=6, pad_id=pad_id)
    tables = make_tables(3, 3, 4, lib=torch)
    b, md = run_builder(step, tables, max_rows=8)
    assert md.spec_rows == 6
    np.testing.assert_array_equal(md.spec_query_start_loc, [0, 3, 5, 8, 8, 8, 8])
    np.testing.assert_array_equal(md.spec_num_accepted, [2, 3, 1, 1, 1, 1])
    np.testing.assert_array_equal(md.spec_sequence_masks, [1, 1, 1, 0, 0, 0])
    assert (md.spec_state_indices[:, 3:] == pad_id).all()
    assert (md.non_spec_state_indices == pad_id).all()
    # Persistent, zero-initialised buffers: the rows past padded_rows were never written.
    assert (b.spec_state_indices[:, 6:] == 0).all()


def test_buffers_are_persistent_and_replays_give_the_new_rows():
    tables = make_tables(3, 10, 5, lib=torch)
    b = M.Builder(tables, num_spec=2, max_rows=10, max_tokens=40, shadow=True)
    ptrs = (b.spec_state_indices.data_ptr(), b.non_spec_state_indices.data_ptr())
    s1 = make_step([(3, 2)] * 7, 2, padded_rows=8)
    md1 = b.step(s1["qsl"], s1["seq_lens"], **step_args(s1))
    expect_matches_reference(md1, s1, tables)
    s2 = make_step([(1, 0), (3, 2)], 2, padded_rows=8, acc=[3, 2])
    md2 = b.step(s2["qsl"], s2["seq_lens"], **step_args(s2))
    expect_matches_reference(md2, s2, tables)
    assert (b.spec_state_indices.data_ptr(), b.non_spec_state_indices.data_ptr()) == ptrs


def test_columns_past_the_table_are_padded_and_reported():
    # vLLM #42084: align mode, many spec tokens. Table widths differ per group.
    step = make_step([(16, 15), (16, 15), (1, -1)], 15, mode="align", block_size=32, pad_id=-1)
    step["seq_lens"] = np.array([40, 20, 200], I32)  # starts 1, 0 and 6
    tables = [np.arange(3 * 16, dtype=I32).reshape(3, 16) + 1000 * g for g in range(2)]
    tables.append(np.arange(3 * 20, dtype=I32).reshape(3, 20) + 5000)
    b, md = run_builder(step, tables)
    assert int(b.error_count[0]) == 2  # request 0 in the two 16-column groups
    assert (md.spec_state_indices[0, 0] == -1).all() and (md.spec_state_indices[1, 0] == -1).all()
    np.testing.assert_array_equal(md.spec_state_indices[2, 0], 5000 + np.arange(1, 17))
    expect_matches_reference(md, step, tables)


def test_errors_name_the_argument_and_write_nothing():
    step = make_step([(3, 2), (1, -1)], 2)
    b = M.Builder(make_tables(1, 4, 4), num_spec=2, max_rows=4, max_tokens=16)
    before = b.host_plans[0].copy()
    bad = [
        (dict(num_draft_tokens=np.array([3, -1], I32)), "num_draft_tokens[0]"),
        (dict(num_accepted_tokens=np.array([0, 1], I32)), "num_accepted_tokens[0]"),
        (dict(num_draft_tokens=np.array([2], I32)), "num_draft_tokens"),
        (dict(padded_rows=1), "padded_rows"),
        (dict(padded_rows=5), "padded_rows"),
        (dict(num_computed_tokens=np.array([1, 2], np.float32)), "num_computed_tokens has dtype float32"),
    ]
    for override, needle in bad:
        kw = step_args(step)
        kw.update(override)
        with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            b.step(step["qsl"], step["seq_lens"], **kw)
        np.testing.assert_array_equal(b.host_plans[0], before)
    with pytest.raises(ValueError, match="query_start_loc"):
        b.step(np.array([1, 3, 4], I32), step["seq_lens"])
    with pytest.raises(ValueError, match="block_tables"):
        M.Builder([np.zeros((4, 4), np.int64)], num_spec=2, max_rows=4, max_tokens=16)
    with pytest.raises(ValueError, match="block_tables must hold"):
        M.Builder([np.zeros((4, 4), I32)] * 9, num_spec=2, max_rows=4, max_tokens=16)
    with pytest.raises(ValueError, match="mode"):
        M.Builder(make_tables(1, 4, 4), num_spec=2, max_rows=4, max_tokens=16, mode="prefix")


# ---- the builder object (a thin owner around gdn::metadata::Builder) ----------------------------


def test_prepare_then_launch_equals_step_on_the_cpu():
    rng = np.random.default_rng(21)
    tables = make_tables(3, 12, 6, rng=rng)
    a = M.Builder(tables, num_spec=2, max_rows=12, max_tokens=48)
    b = M.Builder(tables, num_spec=2, max_rows=12, max_tokens=48, shadow=True)
    for k in range(6):
        n = int(rng.integers(1, 9))
        rows = [(int(t), int(d)) for t, d in zip(rng.integers(0, 4, size=n), rng.integers(-1, 3, size=n))]
        rows = [(min(t, d + 1) if d >= 0 else t, d) for t, d in rows]
        step = make_step(rows, 2, acc=list(rng.integers(1, 4, size=n)), padded_rows=10)
        md_a = a.step(step["qsl"], step["seq_lens"], **step_args(step))
        md_b = b.prepare(step["qsl"], step["seq_lens"], **step_args(step))
        assert b.launch(10) == int(sum(per_group_reference(step, t)["unreadable"] for t in tables))
        b._check(
            None, step["qsl"], step["seq_lens"], step["drafts"], step["acc"], step["computed"], step["padded_rows"]
        )
        assert md_a.counts() == md_b.counts()
        for name in ("spec_state_indices", "non_spec_state_indices", "non_spec_source_indices"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        expect_matches_reference(md_b, step, tables)


def test_builder_arguments_are_checked_once():
    tables = make_tables(1, 4, 4)
    with pytest.raises(ValueError, match="staging must be 'pinned' or 'pageable'"):
        M.Builder(tables, num_spec=2, max_rows=4, max_tokens=16, staging="fast")
    with pytest.raises(ValueError, match="max_rows must be >= 1"):
        M.Builder(tables, num_spec=2, max_rows=0, max_tokens=16)
    b = M.Builder(tables, num_spec=2, max_rows=4, max_tokens=16)
    assert not hasattr(b, "time_step")  # the benchmark timer lives in benchmarks/cpp
    with pytest.raises(ValueError, match="launch_rows must be in"):
        b.launch(5)


# ---- the shadow check ----------------------------------------------------------------------------


def shadow_of(b: M.Builder, step, plan=None, spec=None, non_spec=None, source=None) -> str:
    return M.shadow_check(
        as_np(b.host_plans[0] if plan is None else plan),
        [as_np(t) for t in b.block_tables],
        as_np(b.spec_state_indices if spec is None else spec),
        as_np(b.non_spec_state_indices if non_spec is None else non_spec),
        step["qsl"],
        step["seq_lens"],
        num_draft_tokens=step["drafts"],
        num_accepted_tokens=step["acc"],
        num_computed_tokens=step["computed"],
        num_spec=b.num_spec,
        max_rows=b.max_rows,
        max_tokens=b.max_tokens,
        mode=step["mode"],
        block_size=step["block_size"],
        padded_rows=step["padded_rows"],
        pad_id=step["pad_id"],
        non_spec_source_indices=as_np(b.non_spec_source_indices if source is None else source),
    )


def poison_unused(b: M.Builder, md: M.StepMetadata, rng) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Copies of the buffers with every word outside the step's rows replaced by garbage."""
    plan, spec, ns, src = (
        as_np(x).copy()
        for x in (b.host_plans[0], b.spec_state_indices, b.non_spec_state_indices, b.non_spec_source_indices)
    )
    lay = M.layout(b.max_rows, b.max_tokens)
    keep = np.zeros(len(plan), bool)
    used = {
        "header": len(M.HEADER_FIELDS),
        "token_split": md.num_actual_tokens,
        "spec_query_start_loc": md.spec_rows + 1,
        "non_spec_query_start_loc": md.non_spec_rows + 1,
    }
    for f in ("spec_request", "spec_start", "spec_num_accepted", "spec_source_column"):
        used[f] = md.spec_rows
    for f in ("non_spec_request", "non_spec_start", "non_spec_source_column"):
        used[f] = md.non_spec_rows
    for f, n in used.items():
        keep[lay[f][0] : lay[f][0] + n] = True
    bool_start = lay["spec_sequence_masks"][0]
    garbage = rng.integers(-(2**31), 2**31 - 1, size=len(plan)).astype(I32)
    region = (~keep) & (np.arange(len(plan)) < bool_start)
    plan[region] = garbage[region]
    as_bytes = plan.view(np.uint8)
    for f, n in (("spec_sequence_masks", md.counts()["mask_rows_written"]), ("has_initial_state", md.non_spec_rows)):
        lo = lay[f][0] * 4
        hi = lo + 4 * ((lay[f][1] + 3) // 4)
        as_bytes[lo + n : hi] = rng.integers(0, 256, size=hi - lo - n)
    spec[:, md.spec_rows :] = rng.integers(-(2**31), 2**31 - 1, size=spec[:, md.spec_rows :].shape)
    for out in (ns, src):
        unused = out[:, md.non_spec_rows :]
        unused[...] = rng.integers(-(2**31), 2**31 - 1, size=unused.shape)
    return plan, spec, ns, src


def test_shadow_names_an_injected_mismatch_whatever_the_unused_rows_hold():
    rng = np.random.default_rng(11)
    step = make_step([(3, 2), (5, -1), (2, 1)], 2, padded_rows=5)
    tables = make_tables(3, 3, 4, rng=rng)
    b, md = run_builder(step, tables, max_rows=8)
    assert shadow_of(b, step) == ""
    plan, spec, ns, src = poison_unused(b, md, rng)
    assert shadow_of(b, step, plan, spec, ns, src) == ""  # garbage outside the rows: same verdict
    for poisoned in (False, True):
        p, s, n, r = (
            (plan.copy(), spec.copy(), ns.copy(), src.copy())
            if poisoned
            else (
                as_np(b.host_plans[0]).copy(),
                b.spec_state_indices.copy(),
                b.non_spec_state_indices.copy(),
                b.non_spec_source_indices.copy(),
            )
        )
        r[0, 0] += 3  # the source of group 0's live non-spec row
        msg = shadow_of(b, step, p, s, n, r)
        assert "group 0, field non_spec_source_indices, row 0" in msg, msg
        r[0, 0] -= 3
        s[2, 1, 2] += 1
        msg = shadow_of(b, step, p, s, n, r)
        assert "group 2, field spec_state_indices, row 1, column 2" in msg, msg
        assert f"shared/fused = {s[2, 1, 2]}, per-group = {s[2, 1, 2] - 1}" in msg, msg
        s[2, 1, 2] -= 1
        n[1, 4] = 77  # a padded row a replay reads
        assert "group 1, field non_spec_state_indices, row 4" in shadow_of(b, step, p, s, n, r)
        n[1, 4] = 0
        lay = M.layout(b.max_rows, b.max_tokens)
        p[lay["spec_num_accepted"][0] + 3] = 2  # a padded row must accept 1
        msg = shadow_of(b, step, p, s, n, r)
        assert "field spec_num_accepted, row 3: shared/fused = 2, per-group = 1" in msg, msg


def test_builder_shadow_switch_raises_on_a_mismatch(monkeypatch):
    step = make_step([(3, 2), (3, 2)], 2)
    tables = make_tables(2, 2, 3)
    b, _ = run_builder(step, tables)

    # Corrupt the fused pass: a native builder whose state rows land in a different buffer.
    def corrupt():
        b.spec_state_indices[1, 0, 0] += 1

    corrupt_after_each_step(b, corrupt)
    with pytest.raises(RuntimeError, match="group 1, field spec_state_indices, row 0, column 0"):
        b.step(step["qsl"], step["seq_lens"], **step_args(step))
    monkeypatch.setenv("GDN_METADATA_SHADOW", "1")
    assert M.Builder(tables, num_spec=2, max_rows=4, max_tokens=8).shadow


# ---- torch ops -----------------------------------------------------------------------------------


def op_case(device="cpu"):
    step = make_step([(3, 2), (1, -1), (2, 1)], 2, acc=[2, 2, 3], padded_rows=4)
    R, T, G = 6, 16, 3
    plan = torch.zeros(M.plan_words(R, T), dtype=torch.int32)
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    torch.ops.gdn.metadata_plan(
        plan,
        t(step["qsl"]),
        t(step["seq_lens"]),
        num_draft_tokens=t(step["drafts"]),
        num_accepted_tokens=t(step["acc"]),
        num_computed_tokens=t(step["computed"]),
        num_spec=2,
        max_rows=R,
        max_tokens=T,
        cache_mode="none",
        block_size=0,
        padded_rows=4,
        pad_id=0,
    )
    tables = [t(x).to(device) for x in make_tables(G, 3, 4)]
    return step, plan.to(device), tables, R, T, G


def test_torch_ops_match_the_reference_and_pass_opcheck():
    step, plan, tables, R, T, G = op_case()
    spec = torch.full((G, R, 3), -9, dtype=torch.int32)
    ns = torch.full((G, R), -9, dtype=torch.int32)
    src = torch.full((G, R), -9, dtype=torch.int32)
    err = torch.zeros(1, dtype=torch.int32)
    torch.ops.gdn.metadata_state_rows(
        plan,
        tables,
        spec,
        ns,
        num_spec=2,
        max_rows=R,
        max_tokens=T,
        pad_id=0,
        launch_rows=4,
        error_count=err,
        non_spec_source_indices=src,
    )
    for g in range(G):
        ref = per_group_reference(step, tables[g].numpy())
        np.testing.assert_array_equal(spec[g, :4].numpy(), ref["spec_state_indices"])
        np.testing.assert_array_equal(ns[g, :4].numpy(), ref["non_spec_state_indices"])
        np.testing.assert_array_equal(src[g, :4].numpy(), ref["non_spec_source_indices"])
    assert (spec[:, 4:] == -9).all() and (src[:, 4:] == -9).all()
    from torch.library import opcheck

    opcheck(
        torch.ops.gdn.metadata_state_rows.default,
        (plan, tables, spec, ns),
        dict(
            num_spec=2,
            max_rows=R,
            max_tokens=T,
            pad_id=0,
            launch_rows=4,
            num_accepted_tokens=None,
            error_count=err,
            non_spec_source_indices=src,
        ),
    )
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    opcheck(
        torch.ops.gdn.metadata_plan.default,
        (plan.clone(), t(step["qsl"]), t(step["seq_lens"])),
        dict(
            num_draft_tokens=t(step["drafts"]),
            num_accepted_tokens=t(step["acc"]),
            num_computed_tokens=None,
            num_spec=2,
            max_rows=R,
            max_tokens=T,
            cache_mode="align",
            block_size=4,
            padded_rows=None,
            pad_id=-1,
        ),
    )


# ---- decode_mtp fed straight from the builder ----------------------------------------------------


def decode_case(rng, device="cpu", K=16):
    H, HV, V, slots, num_spec = 1, 2, K, 64, 2
    S = num_spec + 1
    step = make_step([(3, 2), (4, -1), (2, 1), (1, 0)], num_spec, acc=[2, 1, 3, 1], padded_rows=6, pad_id=0)
    L = int(step["qsl"][-1])
    tables = [rng.permutation(np.arange(1, slots))[: 4 * 5].reshape(4, 5).astype(I32) for _ in range(3)]
    f = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(device)  # noqa: E731
    arrays = dict(
        mixed_qkv=f(L, 2 * H * K + HV * V), a=f(L, HV), b=f(L, HV), A_log=f(HV), dt_bias=f(HV), state=f(slots, HV, V, K)
    )
    return step, [torch.from_numpy(t).to(device) for t in tables], arrays, S


def test_decode_mtp_takes_the_builder_outputs_directly():
    rng = np.random.default_rng(5)
    step, tables, x, S = decode_case(rng)
    b, md = run_builder(step, tables, max_rows=8)
    tok = torch.as_tensor(md.spec_token_indx).long()
    for g in range(len(tables)):
        # Straight from the builder (padded rows carry no token and are skipped).
        state_a = x["state"].clone()
        out_a = torch.full((len(tok), 2, 16), float("nan"))
        gdn.decode_mtp(
            x["mixed_qkv"][tok],
            x["a"][tok],
            x["b"][tok],
            x["A_log"],
            x["dt_bias"],
            state_a,
            out=out_a,
            first_valid_slot=1,
            **md.decode_mtp_args(g),
        )
        # By hand, from the step: spec requests 0, 2, 3 read columns 0..S-1 of their table row.
        spec_req = [0, 2, 3]
        qlen = np.diff(step["qsl"])
        cu = torch.tensor(np.concatenate([[0], np.cumsum(qlen[spec_req])]), dtype=torch.int32)
        state_b = x["state"].clone()
        out_b = torch.full_like(out_a, float("nan"))
        gdn.decode_mtp(
            x["mixed_qkv"][tok],
            x["a"][tok],
            x["b"][tok],
            x["A_log"],
            x["dt_bias"],
            state_b,
            tables[g][spec_req, :S].contiguous(),
            cu,
            out_b,
            num_accepted_tokens=torch.tensor([2, 3, 1], dtype=torch.int32),
            first_valid_slot=1,
        )
        assert torch.equal(out_a, out_b) and torch.equal(state_a, state_b)
        assert not torch.isnan(out_a).any()


# ---- replay mode (replay.md §3): one checkpoint slot per request ---------------------------------


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_replay_mode_hand_checked(lib):
    """Spec rows: request 0 right after prefill (n = 0) and request 2 (n = 3); non-spec rows:
    request 1 (a decode without drafts, n = 2) and request 3 (zero-length, n = 1); padded to 5."""
    table = np.array([[11, 12, 13, 14], [21, 22, 23, 24], [31, 32, 33, 34], [41, 42, 43, 44]], I32)
    other = table + 100
    tables = [table, other] if lib == "numpy" else [torch.from_numpy(table), torch.from_numpy(other)]
    step = make_step([(3, 2), (1, -1), (2, 1), (0, -1)], 2, acc=[0, 2, 3, 1], padded_rows=5, pad_id=-1, replay=True)
    b, md = run_builder(step, tables, max_rows=7)
    assert md.replay == 1 and md.num_spec_decodes == 2
    np.testing.assert_array_equal(as_np(md.checkpoint_indices), [[11, 31, -1, -1, -1], [111, 131, -1, -1, -1]])
    np.testing.assert_array_equal(as_np(md.replay_counts), [0, 3, 0, 0, 0])
    np.testing.assert_array_equal(as_np(md.spec_num_accepted), [1, 3, 1, 1, 1])
    np.testing.assert_array_equal(as_np(md.non_spec_replay_counts), [2, 1, 0, 0, 0])
    np.testing.assert_array_equal(as_np(md.non_spec_source_column), [1, 0, 0, 0, 0])
    # Column 0 of a spec row is its checkpoint, no other column names a slot; non-spec rows read
    # and write their checkpoint.
    np.testing.assert_array_equal(as_np(md.spec_state_indices[:, :, 0]), as_np(md.checkpoint_indices))
    assert (as_np(md.spec_state_indices[:, :, 1:]) == -1).all()
    np.testing.assert_array_equal(as_np(md.non_spec_state_indices), [[21, 41, -1, -1, -1], [121, 141, -1, -1, -1]])
    np.testing.assert_array_equal(as_np(md.non_spec_source_indices), as_np(md.non_spec_state_indices))
    args = md.replay_args(1)
    np.testing.assert_array_equal(as_np(args["state_indices"]), [111, 131, -1, -1, -1])
    np.testing.assert_array_equal(as_np(args["cu_seqlens"]), [0, 3, 5, 5, 5, 5])
    np.testing.assert_array_equal(as_np(args["num_accepted_tokens"]), [0, 3, 0, 0, 0])
    assert int(b.error_count[0]) == 0
    expect_matches_reference(md, step, [as_np(t) for t in tables])


def test_replay_mode_needs_one_slot_per_request_only():
    """One-column tables (a pool of one checkpoint slot per request): nothing else is read in
    replay mode; the same step without replay cannot find its S columns."""
    tables = [np.array([[7], [8], [9]], I32) + 10 * g for g in range(3)]
    step = make_step([(3, 2), (1, -1), (3, 2)], 2, acc=[3, 2, 0], replay=True)
    b, md = run_builder(step, tables)
    assert int(b.error_count[0]) == 0
    np.testing.assert_array_equal(as_np(md.checkpoint_indices), [[7, 9], [17, 19], [27, 29]])
    np.testing.assert_array_equal(as_np(md.non_spec_source_indices), [[8], [18], [28]])
    step["replay"], step["acc"] = False, np.array([3, 2, 1], I32)
    b, md = run_builder(step, tables)
    assert int(b.error_count[0]) == 3 * 3


@settings(max_examples=120, deadline=None)
@given(random_steps(replay=True))
def test_replay_builder_equals_per_group_builds(case):
    """Fresh random replay steps (every group, padded or not, counts given or absent, tables
    from one column, some rows missing): the builder (with its C++ shadow check) equals the
    tests' own per-group reference, error count included."""
    step, tables = case
    b, md = run_builder(step, tables)
    expect_matches_reference(md, step, tables)
    assert int(b.error_count[0]) == sum(per_group_reference(step, t)["unreadable"] for t in tables)


@settings(max_examples=80, deadline=None)
@given(random_steps(replay=True))
def test_replay_free_functions_write_exactly_the_reference_rows(case):
    """plan + state_rows in replay mode into poisoned buffers: the written rows (checkpoints,
    spec rows, non-spec rows, replay counts) equal the reference and nothing past them is
    touched."""
    step, tables = case
    N = len(step["qsl"]) - 1
    R, T, G, S = N + 7, int(step["qsl"][-1]) + 2, len(tables), step["num_spec"] + 1
    poison = -777
    plan = np.full(M.plan_words(R, T), poison, I32)
    scalars = dict(num_spec=step["num_spec"], max_rows=R, max_tokens=T)
    M.plan(plan, step["qsl"], step["seq_lens"], pad_id=step["pad_id"], replay=True, **step_args(step), **scalars)
    spec = np.full((G, R, S), poison, I32)
    ns, src, ck = (np.full((G, R), poison, I32) for _ in range(3))
    err = np.zeros(1, I32)
    rows = M.state_rows(
        plan,
        tables,
        spec,
        ns,
        pad_id=step["pad_id"],
        error_count=err,
        non_spec_source_indices=src,
        replay=True,
        checkpoint_indices=ck,
        **scalars,
    )
    view = M.PlanView(M._field_views(plan, R, T), plan[: len(M.HEADER_FIELDS)])
    expected_errors = 0
    for g, table in enumerate(tables):
        ref = per_group_reference(step, table)
        expected_errors += ref["unreadable"]
        n_spec, n_ns = ref["counts"]["spec_rows_written"], ref["counts"]["non_spec_rows_written"]
        assert {k: view.counts()[k] for k in ref["counts"]} == ref["counts"]
        np.testing.assert_array_equal(view.replay_counts, ref["replay_counts"])
        np.testing.assert_array_equal(view.non_spec_replay_counts, ref["non_spec_replay_counts"])
        np.testing.assert_array_equal(ck[g, :n_spec], ref["checkpoint_indices"])
        np.testing.assert_array_equal(spec[g, :n_spec], ref["spec_state_indices"])
        np.testing.assert_array_equal(ns[g, :n_ns], ref["non_spec_state_indices"])
        np.testing.assert_array_equal(src[g, :n_ns], ref["non_spec_source_indices"])
        assert (ck[g, n_spec:] == poison).all() and (spec[g, n_spec:] == poison).all()
        assert (ns[g, n_ns:] == poison).all() and (src[g, n_ns:] == poison).all()
    lay = M.layout(R, T)
    for name, n in (("replay_counts", view.spec_rows), ("non_spec_replay_counts", view.non_spec_rows)):
        offset, length, _ = lay[name]
        assert (plan[offset + n : offset + length] == poison).all(), name
    assert rows == expected_errors == int(err[0])
    assert (
        M.shadow_check(
            plan,
            tables,
            spec,
            ns,
            step["qsl"],
            step["seq_lens"],
            pad_id=step["pad_id"],
            non_spec_source_indices=src,
            replay=True,
            checkpoint_indices=ck,
            **step_args(step),
            **scalars,
        )
        == ""
    )


def test_replay_errors_name_the_argument_and_write_nothing():
    tables = make_tables(2, 4, 4)
    with pytest.raises(
        ValueError,
        match=r"mode 'align' \(prefix caching\) cannot be combined with "
        r"replay",
    ):
        M.Builder(tables, num_spec=2, max_rows=4, max_tokens=16, mode="align", block_size=4, replay=True)
    step = make_step([(3, 2), (1, -1)], 2, acc=[0, 3], replay=True)
    plan = np.full(M.plan_words(4, 16), -5, I32)
    with pytest.raises(ValueError, match="mode 'align'"):
        M.plan(
            plan,
            step["qsl"],
            step["seq_lens"],
            num_spec=2,
            max_rows=4,
            max_tokens=16,
            mode="align",
            block_size=4,
            replay=True,
        )
    assert (plan == -5).all()
    b = M.Builder(tables, num_spec=2, max_rows=4, max_tokens=16, replay=True)
    b.step(step["qsl"], step["seq_lens"], **step_args(step))
    before = [
        np.copy(x)
        for x in (
            b.host_plans[0],
            b.checkpoint_indices,
            b.spec_state_indices,
            b.non_spec_state_indices,
            b.non_spec_source_indices,
        )
    ]
    for acc, needle in (
        ([4, 0], r"num_accepted_tokens\[0\] = 4 is outside \[0, S = 3\] \(replay"),
        ([0, -1], r"num_accepted_tokens\[1\] = -1 is outside \[0, S = 3\]"),
    ):
        kw = step_args(step)
        kw["num_accepted_tokens"] = np.array(acc, I32)
        with pytest.raises(ValueError, match=needle):
            b.step(step["qsl"], step["seq_lens"], **kw)
    for x, y in zip(
        before,
        (
            b.host_plans[0],
            b.checkpoint_indices,
            b.spec_state_indices,
            b.non_spec_state_indices,
            b.non_spec_source_indices,
        ),
    ):
        np.testing.assert_array_equal(x, y)
    # The state-row pass: the checkpoint output is required in replay mode and refused without
    # it; a plan of the other mode is refused on the CPU.
    M.plan(
        plan,
        step["qsl"],
        step["seq_lens"],
        num_accepted_tokens=step["acc"],
        num_draft_tokens=step["drafts"],
        num_spec=2,
        max_rows=4,
        max_tokens=16,
        replay=True,
    )
    spec, ns, ck = np.full((2, 4, 3), -5, I32), np.full((2, 4), -5, I32), np.full((2, 4), -5, I32)
    kw = dict(num_spec=2, max_rows=4, max_tokens=16)
    with pytest.raises(ValueError, match="checkpoint_indices is required in replay mode"):
        M.state_rows(plan, tables, spec, ns, replay=True, **kw)
    with pytest.raises(ValueError, match="checkpoint_indices"):
        M.state_rows(plan, tables, spec, ns, replay=True, checkpoint_indices=ck[:1], **kw)
    with pytest.raises(ValueError, match="checkpoint_indices is written only in replay mode"):
        M.state_rows(plan, tables, spec, ns, checkpoint_indices=ck, **kw)
    with pytest.raises(
        ValueError, match="plan made with header word replay = 1 but the state-row pass has replay = false"
    ):
        M.state_rows(plan, tables, spec, ns, **kw)
    assert (spec == -5).all() and (ns == -5).all() and (ck == -5).all()
    with pytest.raises(TypeError, match=r"^gdn\.metadata\.state_rows: checkpoint_indices must be"):
        M.state_rows(plan, tables, spec, ns, replay=True, checkpoint_indices=[[0]], **kw)
    plain = M.Builder(tables, num_spec=2, max_rows=4, max_tokens=16)
    md = plain.step(step["qsl"], step["seq_lens"])
    assert md.checkpoint_indices is None and md.replay_counts is None and md.replay == 0
    with pytest.raises(ValueError, match="replay_args needs a builder made with replay=True"):
        md.replay_args(0)


def test_replay_shadow_names_an_injected_mismatch():
    rng = np.random.default_rng(12)
    step = make_step([(3, 2), (1, -1), (2, 1)], 2, acc=[2, 3, 0], padded_rows=4, replay=True)
    tables = make_tables(3, 3, 1, rng=rng)
    b, md = run_builder(step, tables, max_rows=6)
    kw = dict(num_spec=2, max_rows=6, max_tokens=b.max_tokens, padded_rows=4, replay=True)

    def check(plan, ck):
        return M.shadow_check(
            plan,
            tables,
            b.spec_state_indices,
            b.non_spec_state_indices,
            step["qsl"],
            step["seq_lens"],
            num_draft_tokens=step["drafts"],
            num_accepted_tokens=step["acc"],
            num_computed_tokens=step["computed"],
            non_spec_source_indices=b.non_spec_source_indices,
            checkpoint_indices=ck,
            **kw,
        )

    plan, ck = b.host_plans[0].copy(), b.checkpoint_indices.copy()
    assert check(plan, ck) == ""
    ck[1, 1] += 1  # group 1, spec row 1 (request 2)
    msg = check(plan, ck)
    assert f"group 1, field checkpoint_indices, row 1: shared/fused = {ck[1, 1]}, per-group = {ck[1, 1] - 1}" in msg, (
        msg
    )
    ck[1, 1] -= 1
    ck[2, 3] = 99  # a padded row a replay reads
    assert "group 2, field checkpoint_indices, row 3" in check(plan, ck)
    ck[2, 3] = 0
    lay = M.layout(6, b.max_tokens)
    plan[lay["replay_counts"][0] + 1] = 1
    msg = check(plan, ck)
    assert "field replay_counts, row 1: shared/fused = 1, per-group = 0" in msg, msg
    plan[lay["replay_counts"][0] + 1] = 0
    plan[lay["non_spec_replay_counts"][0]] = 2
    assert "field non_spec_replay_counts, row 0: shared/fused = 2, per-group = 3" in check(plan, ck)
    plan[lay["non_spec_replay_counts"][0]] = 3
    assert check(plan, ck) == ""

    # The builder's shadow switch names a corrupted checkpoint too.
    def corrupt():
        b.checkpoint_indices[2, 0] += 1

    corrupt_after_each_step(b, corrupt)
    with pytest.raises(RuntimeError, match="group 2, field checkpoint_indices, row 0"):
        b.step(step["qsl"], step["seq_lens"], **step_args(step))


def test_replay_torch_ops_match_the_reference_and_pass_opcheck():
    step = make_step([(3, 2), (1, -1), (2, 1)], 2, acc=[0, 2, 3], padded_rows=4, replay=True)
    R, T, G = 6, 16, 3
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    plan = torch.zeros(M.plan_words(R, T), dtype=torch.int32)
    plan_kw = dict(
        num_draft_tokens=t(step["drafts"]),
        num_accepted_tokens=t(step["acc"]),
        num_computed_tokens=t(step["computed"]),
        num_spec=2,
        max_rows=R,
        max_tokens=T,
        cache_mode="none",
        block_size=0,
        padded_rows=4,
        pad_id=0,
        replay=True,
    )
    torch.ops.gdn.metadata_plan(plan, t(step["qsl"]), t(step["seq_lens"]), **plan_kw)
    tables = [t(x) for x in make_tables(G, 3, 2)]
    spec = torch.full((G, R, 3), -9, dtype=torch.int32)
    ns, src, ck = (torch.full((G, R), -9, dtype=torch.int32) for _ in range(3))
    err = torch.zeros(1, dtype=torch.int32)
    rows_kw = dict(
        num_spec=2,
        max_rows=R,
        max_tokens=T,
        pad_id=0,
        launch_rows=4,
        num_accepted_tokens=None,
        error_count=err,
        non_spec_source_indices=src,
        replay=True,
        checkpoint_indices=ck,
    )
    torch.ops.gdn.metadata_state_rows(plan, tables, spec, ns, **rows_kw)
    view = M.PlanView(M._field_views(plan.numpy(), R, T), plan.numpy()[: len(M.HEADER_FIELDS)])
    for g in range(G):
        ref = per_group_reference(step, tables[g].numpy())
        np.testing.assert_array_equal(ck[g, :4].numpy(), ref["checkpoint_indices"])
        np.testing.assert_array_equal(spec[g, :4].numpy(), ref["spec_state_indices"])
        np.testing.assert_array_equal(src[g, :4].numpy(), ref["non_spec_source_indices"])
        np.testing.assert_array_equal(view.replay_counts, ref["replay_counts"])
    assert (ck[:, 4:] == -9).all() and int(err[0]) == 0
    from torch.library import opcheck

    opcheck(torch.ops.gdn.metadata_state_rows.default, (plan, tables, spec, ns), rows_kw)
    opcheck(torch.ops.gdn.metadata_plan.default, (plan.clone(), t(step["qsl"]), t(step["seq_lens"])), plan_kw)


def test_decode_mtp_replay_takes_the_builder_outputs_directly():
    """decode_mtp_replay fed with replay_args(g) of a replay-mode builder equals the same call with
    checkpoint slots and replay counts written out by hand from the step."""
    rng = np.random.default_rng(9)
    H, HV, K, slots, num_spec = 1, 2, 16, 64, 2
    S = num_spec + 1
    # Spec rows: requests 0 (n = 2), 2 (n = 0: first step after prefill), 3 (n = 3); request 1
    # is a prefill (not a spec row). One checkpoint column per request.
    step = make_step([(3, 2), (4, -1), (2, 1), (1, 0)], num_spec, acc=[2, 1, 0, 3], padded_rows=6, replay=True)
    L = int(step["qsl"][-1])
    tables = [rng.permutation(np.arange(1, slots))[:4].reshape(4, 1).astype(I32) for _ in range(2)]
    f = lambda *s: torch.from_numpy(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    x = dict(
        mixed_qkv=f(L, 2 * H * K + HV * K), a=f(L, HV), b=f(L, HV), A_log=f(HV), dt_bias=f(HV), state=f(slots, HV, K, K)
    )
    window = gdn.ReplayWindow.allocate(slots, S, H=H, HV=HV, K=K, V=K, dtype=torch.float32)
    for w in (window.k, window.v, window.a, window.b):
        w.copy_(torch.from_numpy(rng.standard_normal(tuple(w.shape)).astype(np.float32)))
    window.len.fill_(S)
    b, md = run_builder(step, [torch.from_numpy(t) for t in tables], max_rows=8)
    tok = torch.as_tensor(md.spec_token_indx).long()
    spec_req = [0, 2, 3]
    qlen = np.diff(step["qsl"])
    for g in range(len(tables)):
        results = []
        for by_hand in (False, True):
            state, win = x["state"].clone(), {k: v.clone() for k, v in window.arrays().items()}
            out = torch.full((len(tok), HV, K), float("nan"))
            if by_hand:
                args = dict(
                    state_indices=torch.from_numpy(tables[g][spec_req, 0].copy()),
                    cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(qlen[spec_req])]), dtype=torch.int32),
                    num_accepted_tokens=torch.tensor([2, 0, 3], dtype=torch.int32),
                )
            else:
                args = md.replay_args(g)  # padded rows: null slot, no tokens, count 0
            gdn.decode_mtp_replay(
                x["mixed_qkv"][tok],
                x["a"][tok],
                x["b"][tok],
                x["A_log"],
                x["dt_bias"],
                state,
                out=out,
                **win,
                first_valid_slot=1,
                **args,
            )
            results.append((out, state, win))
        (out_a, state_a, win_a), (out_b, state_b, win_b) = results
        assert not torch.isnan(out_a).any()
        assert torch.equal(out_a, out_b) and torch.equal(state_a, state_b)
        assert all(torch.equal(win_a[k], win_b[k]) for k in win_a)
        assert not torch.equal(state_a, x["state"])  # the checkpoints moved on


# ---- CUDA ----------------------------------------------------------------------------------------


def cuda_step_args(step, accepted_on_device: bool):
    kw = step_args(step)
    if accepted_on_device and kw["num_accepted_tokens"] is not None:
        kw["num_accepted_tokens"] = torch.from_numpy(kw["num_accepted_tokens"]).cuda()
    return kw


@pytest.mark.gpu
@needs_cuda
@settings(max_examples=40, deadline=None)
@given(random_steps(), st.booleans(), st.sampled_from(["pinned", "pageable"]))
def test_cuda_builder_equals_per_group_builds(case, accepted_on_device, staging):
    step, tables = case
    dev_tables = [torch.from_numpy(t).cuda() for t in tables]
    N = len(step["qsl"]) - 1
    b = M.Builder(
        dev_tables,
        num_spec=step["num_spec"],
        max_rows=N + 8,
        max_tokens=int(step["qsl"][-1]) + 3,
        mode=step["mode"],
        block_size=step["block_size"],
        pad_id=step["pad_id"],
        shadow=True,
        staging=staging,
    )
    md = b.step(step["qsl"], step["seq_lens"], **cuda_step_args(step, accepted_on_device))
    torch.cuda.synchronize()
    assert md.spec_state_indices.is_cuda and md.spec_query_start_loc.is_cuda
    expect_matches_reference(md, step, tables)
    assert int(b.error_count[0]) == sum(per_group_reference(step, t)["unreadable"] for t in tables)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replay_with_new_inputs_gives_the_new_rows():
    rng = np.random.default_rng(3)
    G, S, B = 6, 5, 16
    tables_np = [rng.integers(1, 1 << 20, size=(B, 12)).astype(I32) for _ in range(G)]
    tables = [torch.from_numpy(t).cuda() for t in tables_np]
    b = M.Builder(tables, num_spec=S - 1, max_rows=32, max_tokens=32 * S, mode="align", block_size=8)
    acc_dev = torch.ones(B, dtype=torch.int32, device="cuda")
    first = make_step([(S, S - 1)] * B, S - 1, padded_rows=B, mode="align", block_size=8)
    b.prepare(first["qsl"], first["seq_lens"], **step_args(first))
    b.launch(B, num_accepted_tokens=acc_dev)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        b.launch(B, num_accepted_tokens=acc_dev)
    for replay in range(5):
        n = int(rng.integers(1, B + 1))
        rows = [(int(d) + 1, int(d)) for d in rng.integers(0, S, size=n)]
        acc = rng.integers(1, S + 1, size=n).astype(I32)
        step = make_step(rows, S - 1, acc=list(acc), padded_rows=B, mode="align", block_size=8)
        step["seq_lens"] = rng.integers(1, 50, size=n).astype(I32) + np.diff(step["qsl"])
        step["computed"] = None
        acc_dev[:n].copy_(torch.from_numpy(acc))
        kw = step_args(step)
        kw["num_accepted_tokens"] = None  # gathered on the device by the captured launch
        b.prepare(step["qsl"], step["seq_lens"], **kw)
        graph.replay()
        torch.cuda.synchronize()
        header = b.device_plan[: len(M.HEADER_FIELDS)].cpu().numpy()
        md = M.StepMetadata(b, M.PlanView(b._views, header))
        expect_matches_reference(md, step, tables_np)


@pytest.mark.gpu
@needs_cuda
def test_cuda_torch_op_is_one_launch_for_all_groups():
    step, plan, tables, R, T, G = op_case("cuda")
    spec = torch.full((G, R, 3), -9, dtype=torch.int32, device="cuda")
    ns = torch.full((G, R), -9, dtype=torch.int32, device="cuda")
    err = torch.zeros(1, dtype=torch.int32, device="cuda")
    src = torch.full((G, R), -9, dtype=torch.int32, device="cuda")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.ops.gdn.metadata_state_rows(
            plan,
            tables,
            spec,
            ns,
            num_spec=2,
            max_rows=R,
            max_tokens=T,
            pad_id=0,
            launch_rows=4,
            error_count=err,
            non_spec_source_indices=src,
        )
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "state_rows" in e.name]
    assert len(kernels) == 1, [e.name for e in prof.events()]
    for g in range(G):
        ref = per_group_reference(step, tables[g].cpu().numpy())
        np.testing.assert_array_equal(spec[g, :4].cpu().numpy(), ref["spec_state_indices"])
        np.testing.assert_array_equal(src[g, :4].cpu().numpy(), ref["non_spec_source_indices"])


@pytest.mark.gpu
@needs_cuda
def test_cuda_decode_mtp_takes_the_builder_outputs_directly():
    K = 128
    if gdn.can_use_decode_mtp("cuda", 1, 2, K, K, 3)[0] == "unsupported":
        pytest.skip("this build has no CUDA decode_mtp kernel for K = V = 128")
    rng = np.random.default_rng(6)
    step, tables, x, S = decode_case(rng, device="cuda", K=K)
    _, md = run_builder(step, tables, max_rows=8)
    tok = md.spec_token_indx.long()
    out = torch.full((len(tok), 2, K), float("nan"), device="cuda")
    state = x["state"].clone()
    gdn.decode_mtp(
        x["mixed_qkv"][tok],
        x["a"][tok],
        x["b"][tok],
        x["A_log"],
        x["dt_bias"],
        state,
        out=out,
        first_valid_slot=1,
        **md.decode_mtp_args(0),
    )
    # The same step on the CPU, from a CPU builder.
    cpu = {k: v.cpu() for k, v in x.items()}
    _, md_cpu = run_builder(step, [t.cpu() for t in tables], max_rows=8)
    out_cpu = torch.full((len(tok), 2, K), float("nan"))
    state_cpu = cpu["state"].clone()
    t = md_cpu.spec_token_indx.long()
    gdn.decode_mtp(
        cpu["mixed_qkv"][t],
        cpu["a"][t],
        cpu["b"][t],
        cpu["A_log"],
        cpu["dt_bias"],
        state_cpu,
        out=out_cpu,
        first_valid_slot=1,
        **md_cpu.decode_mtp_args(0),
    )
    torch.cuda.synchronize()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert not torch.isnan(out).any()
    assert rel(out.cpu().double(), out_cpu.double()) <= 1e-5
    assert rel(state.cpu().double(), state_cpu.double()) <= 1e-5


@pytest.mark.gpu
@needs_cuda
@settings(max_examples=30, deadline=None)
@given(random_steps(replay=True), st.booleans())
def test_cuda_replay_builder_equals_per_group_builds(case, counts_on_device):
    step, tables = case
    dev_tables = [torch.from_numpy(t).cuda() for t in tables]
    N = len(step["qsl"]) - 1
    b = M.Builder(
        dev_tables,
        num_spec=step["num_spec"],
        max_rows=N + 8,
        max_tokens=int(step["qsl"][-1]) + 3,
        pad_id=step["pad_id"],
        shadow=True,
        replay=True,
    )
    md = b.step(step["qsl"], step["seq_lens"], **cuda_step_args(step, counts_on_device))
    torch.cuda.synchronize()
    assert md.checkpoint_indices.is_cuda and md.replay_counts.is_cuda
    expect_matches_reference(md, step, tables)
    assert int(b.error_count[0]) == sum(per_group_reference(step, t)["unreadable"] for t in tables)


# ---- errors that name the argument ---------------------------------------------------------------


def _read_only(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_wrong_python_types_name_the_argument():
    step = make_step([(3, 2), (1, -1), (2, 1)], 2)
    buf = np.zeros(M.plan_words(8, 32), I32)
    kw = dict(num_spec=2, max_rows=8, max_tokens=32)
    with pytest.raises(
        TypeError,
        match=r"^gdn\.metadata\.plan: query_start_loc must be .*, "
        r"got a list of 4 items; wrap it in an array",
    ):
        M.plan(buf, step["qsl"].tolist(), step["seq_lens"], **kw)
    with pytest.raises(
        TypeError,
        match=r"^gdn\.metadata\.plan: plan must be a writable .*"
        r"read-only\); this argument is written to",
    ):
        M.plan(_read_only(buf), step["qsl"], step["seq_lens"], **kw)
    with pytest.raises(TypeError, match=r"^gdn\.metadata\.plan: mode must be a str, got int 1"):
        M.plan(buf, step["qsl"], step["seq_lens"], mode=1, **kw)
    M.plan(buf, step["qsl"], step["seq_lens"], **kw)
    tables = make_tables(2, 3, 4)
    spec, ns = np.zeros((2, 8, 3), I32), np.zeros((2, 8), I32)
    with pytest.raises(TypeError, match=r"block_tables must be a list of arrays .* pass \[table\]"):
        M.state_rows(buf, tables[0], spec, ns, **kw)
    with pytest.raises(
        TypeError,
        match=r"^gdn\.metadata\.state_rows: block_tables\[1\] must be "
        r"a writable .*, got a list of 3 items",
    ):
        M.state_rows(buf, [tables[0], tables[1].tolist()], spec, ns, **kw)
    with pytest.raises(
        TypeError,
        match=r"^gdn\.metadata\.state_rows: num_spec must be an int, "
        r"got str '2'",
    ):
        M.state_rows(buf, tables, spec, ns, **dict(kw, num_spec="2"))
    b = M.Builder(tables, num_spec=2, max_rows=8, max_tokens=32)
    with pytest.raises(
        TypeError,
        match=r"^gdn\.metadata\.Builder\.step: seq_lens must be .*, got "
        r"a list",
    ):
        b.step(step["qsl"], step["seq_lens"].tolist())


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_builder_step_takes_int64_and_read_only_host_inputs(lib):
    """NumPy's default int64 (and torch CPU int64) step inputs give the int32 inputs' rows, as
    decode_mtp accepts int64 indices; read-only inputs are accepted (the step only reads them); a
    value outside int32 is refused naming the argument."""
    step = make_step([(3, 2), (1, -1), (2, 1)], 2, padded_rows=4)
    tables = make_tables(2, 4, 5)
    args = step_args(step)
    want = M.Builder(tables, num_spec=2, max_rows=8, max_tokens=32)
    md = want.step(step["qsl"], step["seq_lens"], **args)
    expect_matches_reference(md, step, tables)

    def int64(a):
        a = a.astype(np.int64)
        return torch.from_numpy(a) if lib == "torch" else a

    for convert in (int64, _read_only, lambda a: _read_only(a.astype(np.int64))):
        b = M.Builder(tables, num_spec=2, max_rows=8, max_tokens=32, shadow=True)
        got = b.step(convert(step["qsl"]), convert(step["seq_lens"]), **step_args(step, convert))
        expect_matches_reference(got, step, tables)
        np.testing.assert_array_equal(b.spec_state_indices, want.spec_state_indices)
        np.testing.assert_array_equal(b.non_spec_state_indices, want.non_spec_state_indices)
        got = b.prepare(convert(step["qsl"]), convert(step["seq_lens"]), **step_args(step, convert))
        expect_matches_reference(got, step, tables)
    huge = step["seq_lens"].astype(np.int64)
    huge[1] = 2**31
    with pytest.raises(ValueError, match=r"^gdn\.metadata\.Builder\.step: seq_lens holds a value outside int32"):
        b.step(step["qsl"], huge, **args)
    with pytest.raises(ValueError, match=r"^query_start_loc has dtype float64; expected one of: int32$"):
        b.step(step["qsl"].astype(np.float64), step["seq_lens"], **args)


def test_read_only_buffer_errors_do_not_call_it_written():
    """An argument a function only reads but takes as a writable array (metadata.plan's inputs,
    the block tables) is refused as such, not as an argument that is written to."""
    step = make_step([(3, 2), (1, -1)], 2)
    buf = np.zeros(M.plan_words(8, 32), I32)
    kw = dict(num_spec=2, max_rows=8, max_tokens=32)
    with pytest.raises(TypeError, match=r"read-only\); it is only read, but this function takes it as a writable"):
        M.plan(buf, _read_only(step["qsl"]), step["seq_lens"], **kw)
    M.plan(buf, step["qsl"], step["seq_lens"], **kw)
    tables = make_tables(2, 3, 4)
    spec, ns = np.zeros((2, 8, 3), I32), np.zeros((2, 8), I32)
    with pytest.raises(TypeError, match=r"block_tables\[1\] must be a writable .*; it is only read"):
        M.state_rows(buf, [tables[0], _read_only(tables[1])], spec, ns, **kw)
