"""python -m gdn demo: speculative decoding with a tiny hybrid GDN language model, checked token for
token against plain greedy decoding of the same model, with requests coming and going.

A stream of requests with different prompt lengths runs on a batch of --requests rows: the first
requests take the rows, the others (--late-requests) wait in a queue. A request that has
generated its tokens leaves at once and frees its row, and with it its state blocks in every
KV-cache group; the next waiting request takes the row over at the next step. Every third late
request has a one-token prompt. The same random-weight model (vocab, embedding, a stack of GDN
layers split into KV-cache groups, final norm, lm_head) runs this workload twice:

1. plain greedy decoding: every step feeds one token per row (T = 1);
2. MTP-style speculation: a cheap drafter proposes num_spec tokens per request, the target verifies
   T = num_spec + 1 tokens per request in one step, and greedy acceptance keeps the drafts that
   match the target's own choices plus one token from the target.

Each step, every occupied row either prefills or decodes (plain: its last token; speculative: its
last token and its drafts, a spec row); free rows are zero-length rows. With --prefill calls (the
default) a request prefills its whole prompt in the step that admits it: a non-spec row of more
than one token, a prefill row. With --prefill token-by-token it feeds one prompt token per step
(T = 1, a non-spec row). A request's first generated token is the prediction after its last
prompt token. Every step builds its metadata with gdn.metadata (one shared plan + one pass
filling all groups' state rows) and runs, in every GDN layer, consuming the metadata as a
vLLM-style engine does:
- the step's prefill rows (non-spec rows of more than one token): one gdn.causal_conv1d_prefill
  and one gdn.prefill call for all of them, from non_spec_source_indices (initial slots; a null
  id where has_initial_state is False: a zero state) to non_spec_state_indices (final slots);
- the other rows: gdn.causal_conv1d_update and gdn.decode_mtp. Non-spec one-token rows are
  md.num_decodes decode rows, which read non_spec_source_indices, then prefill rows; one whose
  has_initial_state is False starts from a zero state (its destination blocks,
  non_spec_state_indices, are zeroed in every layer before the layers run).
State blocks hold garbage whenever a request gets them: at the start and after every request that
finishes, each run writes garbage from its own seeded RNG. A fresh request that the metadata sends
to a stale state therefore generates tokens that differ from run to run, and the check fails.

With --state-mode replay a third run decodes speculatively with gdn.decode_mtp_replay in place of
gdn.decode_mtp (one checkpoint block per request and layer, which replays the tokens the previous
step accepted); the demo then checks both speculative runs against plain decoding and prints the
GDN state each mode keeps per request and the verify time of each.

With --prefill calls a fourth run, plain greedy decoding with token-by-token prefill, is the
reference for the time to first token (from a request taking a row to its first token) and for
the prefill calls' tokens. The demo prints PASS when every request's generated tokens are
identical in every run with prefill calls and, on the CPU, also in the token-by-token run: there
gdn.prefill and gdn.causal_conv1d_prefill equal the token-by-token calls bit for bit (fp32
state). On CUDA gdn.prefill is a chunked kernel with bf16 operands (about 5e-3 relative error
against fp32), so greedy tokens may differ from token-by-token prefill where two logits nearly
tie: PASS then compares the runs that all prefill with the same calls (each request's prompt in
one call, whose result does not depend on the other requests of the batch), and the demo prints
how many requests also match token-by-token prefill. gdn.prefill on CUDA takes K = V = 128 only
(the demo's CUDA default; decode_mtp's CUDA kernel needs it too); with other head dims on CUDA
the demo says so and prefills token by token.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

EPILOG = """\
what is compared:
  Every run uses the same model and weights and the same workload. Greedy speculative decoding
  emits exactly the tokens plain greedy decoding emits, as long as a verified token is computed
  exactly as it would be when decoded alone: decode_mtp writes the state after every verify
  position and the conv update keeps the raw inputs so the next step continues from the accepted
  prefix (bit for bit on the CPU with fp32 state). The check is strict: token for token, every
  request. Prefill calls against token-by-token prefill: see "prefill" below.

rows taken over:
  Requests finish at different steps in each run, so rows change hands at different times and
  late requests land on different rows. The metadata alone says which non-spec rows start
  without a state (prefill rows with has_initial_state False; their non_spec_source_indices is
  the null block): the demo zeroes their destination blocks and reads those. Blocks a request
  gets hold the run's garbage, so any stale read shows up as a token difference.

time breakdown:
  metadata   host time of gdn.metadata's step (plan + state rows of all groups, one pass/launch)
  conv       gdn.causal_conv1d_update (all layers)       } CPU: wall time; CUDA: device time
  decode_mtp gdn.decode_mtp (all layers)                 } (CUDA events, also inside graphs)
  rest       everything else: the dense layers, the drafter, acceptance, zeroing fresh rows'
             blocks, host/device copies. The dense layers use int8-valued weights, bf16-valued
             inputs and float64 accumulation that never rounds, so batched GEMMs give the same
             bits for any batch shape and both runs do identical arithmetic
  prefill    gdn.prefill (all layers; gdn.causal_conv1d_prefill counts under conv)
  Rates count every generated token over the whole run, prefill steps included; all runs
  prefill the same prompts the same way (--prefill).

prefill:
  --prefill calls (default): each prompt runs whole in the step that admits it, through one
  gdn.causal_conv1d_prefill + one gdn.prefill call per layer for all of the step's prefill rows.
  A plain run with token-by-token prefill runs next to it; "first token" compares the two.
  CPU: the prefill calls equal token by token bit for bit, so PASS requires equal tokens.
  CUDA: the prefill kernel has bf16 operands (about 5e-3 relative error), so PASS compares the
  runs with prefill calls with each other and reports agreement with token by token.

examples:
  python -m gdn demo                          # CPU, default sizes, under a minute on 2 cores
  python -m gdn demo --device cuda --graphs   # GPU, verify step replayed from a CUDA graph
  python -m gdn demo --requests 16 --late-requests 32 --num-spec 2 --new-tokens 96
  python -m gdn demo --late-requests 0        # one batch of requests, no row changes hands
  python -m gdn demo --state-mode replay      # also replay verify: pool sizes and verify times
  python -m gdn demo --prefill token-by-token # prompts one token per step (the old path)
"""


def _add_number(group, flag: str, default: Any, text: str, *, shown: Any = None, kind: type = int) -> None:
    """Adds the numeric option `flag` (an int, or a `kind`) to `group`, its help `text` followed by
    its default (or by `shown`, what a default of None means)."""
    shown = default if shown is None else shown
    group.add_argument(flag, type=kind, default=default, help=f"{text} (default: {shown})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gdn demo",
        description=__doc__,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the model and the GDN kernels run (default: cpu). cuda needs a "
        "CUDA build of gdn and a GPU; its decode_mtp kernel needs head dim 128",
    )
    run.add_argument(
        "--graphs",
        action="store_true",
        help="(cuda) capture the target's verify step once in a CUDA graph and "
        "replay it in every pure verify step (steps with prefilling rows or "
        "rows without drafts run eagerly); metadata is built before each "
        "replay into the builder's persistent buffers the graph reads",
    )
    run.add_argument(
        "--state-mode",
        choices=["write-all", "replay"],
        default="write-all",
        help="write-all: the verify step writes the state after every token to its "
        "own block (decode_mtp, S blocks per request and layer); replay: one "
        "checkpoint block per request and layer (decode_mtp_replay), run next "
        "to write-all for comparison (default: write-all)",
    )
    run.add_argument(
        "--prefill",
        choices=["calls", "token-by-token"],
        default="calls",
        help="calls: a request's whole prompt runs in the step that admits it, every step's "
        "prefill rows (non-spec rows of more than one token) through one "
        "gdn.causal_conv1d_prefill and one gdn.prefill call per layer, and a plain run that "
        "prefills token by token runs too, for the time to first token and the check; "
        "token-by-token: prompts go one token per step through causal_conv1d_update + "
        "decode_mtp, and no other run (default: calls)",
    )
    _add_number(run, "--seed", 0, "seed of the weights, the prompts, the block tables and the garbage in free blocks")
    run.add_argument("--no-progress", action="store_true", help="do not draw the progress bars")
    work = p.add_argument_group("workload")
    _add_number(work, "--requests", 8, "rows of the batch: requests decoded together, one per row")
    _add_number(
        work,
        "--late-requests",
        None,
        "requests waiting in a queue: each takes over the row of a finished request at the next step; every "
        "third has a one-token prompt; 0: no row changes hands",
        shown="as many as --requests",
    )
    _add_number(work, "--min-prompt", 4, "shortest prompt, in tokens")
    _add_number(work, "--max-prompt", 24, "longest prompt, in tokens; prompt lengths are spread over [min, max]")
    _add_number(work, "--new-tokens", 64, "tokens generated per request")
    _add_number(
        work,
        "--repeats",
        3,
        "runs of each mode: the first warms up (and is checked), the speed-up is the ratio of the median "
        "decode rates of the others",
    )
    _add_number(
        work,
        "--mixed-every",
        4,
        "every K-th step, a third of the decoding requests draft nothing (a plain one-token row next to the "
        "verify rows, as engines see when drafts run out); 0: never",
    )
    _add_number(
        work,
        "--num-spec",
        3,
        "draft tokens proposed per request and step; the target verifies T = num_spec + 1 tokens per request",
    )
    model = p.add_argument_group("model")
    _add_number(model, "--vocab", 256, "vocabulary size")
    _add_number(model, "--hidden", 128, "residual width, at most 2048")
    _add_number(model, "--layers", 4, "GDN layers")
    _add_number(
        model,
        "--groups",
        2,
        "KV-cache groups the layers are split into (layer l -> group l %% G), each with its own state pools "
        "and block table; >= 2",
    )
    _add_number(model, "--heads", 2, "key heads H")
    _add_number(model, "--value-heads", 4, "value heads HV, a multiple of H", shown="4, ratio 2")
    _add_number(
        model,
        "--head-dim",
        None,
        "K = V per head",
        shown="32 on cpu, 128 on cuda, which its decode_mtp kernel needs",
    )
    _add_number(
        model,
        "--layer-strength",
        0.2,
        "scale of the GDN layers' residual contribution; the drafter skips the layers, so a smaller value "
        "means more accepted drafts",
        kind=float,
    )
    model.add_argument(
        "--conv-layout",
        choices=["channels_major", "tokens_major"],
        default="channels_major",
        help="conv state buffer layout: [slots, D, W-1+num_spec] or [slots, W-1+num_spec, D] (default: channels_major)",
    )
    return p


# ---- progress -------------------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr (redrawn at most 10 times a second)."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, max(total, 1), enabled
        self.done, self._last = 0, 0.0
        self._tty = sys.stderr.isatty()

    def update(self, done: int, force: bool = False) -> None:
        self.done = min(done, self.total)
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last < 0.1:
            return
        self._last = now
        width = 30
        filled = int(width * self.done / self.total)
        bar = "#" * filled + "-" * (width - filled)
        line = f"{self.label:<13} [{bar}] {self.done}/{self.total} tokens"
        if self._tty:
            sys.stderr.write("\r" + line)
            sys.stderr.flush()
        elif force:  # not a terminal: only the final state, once
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self._tty:
            self.update(self.done, force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()
        elif self.enabled:
            self.update(self.done, force=True)


# ---- one decoding run -----------------------------------------------------------------------------


@dataclass
class RunStats:
    steps: int = 0
    prefill_steps: int = 0  # steps with prefilling rows
    verify_steps: int = 0  # speculative: every occupied row verifies drafts (verify_step)
    mixed_steps: int = 0  # speculative: spec rows next to non-spec rows (mixed_step)
    nodraft_steps: int = 0  # speculative: steps in which some decoding requests drafted nothing
    seconds: float = 0.0
    tokens: int = 0  # generated tokens, every request's first included
    drafted: int = 0
    accepted: int = 0
    recycled: int = 0  # rows taken over by a new request
    recycled_one_token: int = 0  # ... by one with a one-token prompt
    fresh_rows: int = 0  # non-spec rows the metadata started from a zero state
    breakdown: Dict[str, float] = field(default_factory=dict)
    calls: Dict[str, int] = field(default_factory=dict)
    ttft: List[float] = field(default_factory=list)  # per request: time to first token, seconds
    # Wall time and count of the steps of each kind ("plain"; "verify": pure verify steps,
    # "mixed": steps with prefilling rows or rows without drafts), scheduling included.
    step_time: Dict[str, List[float]] = field(default_factory=dict)

    def timed_step(self, kind: str, seconds: float) -> None:
        t = self.step_time.setdefault(kind, [0.0, 0])
        t[0] += seconds
        t[1] += 1

    def per_step(self, kind: str) -> str:
        from gdn._demo_model import fmt_seconds

        seconds, n = self.step_time.get(kind, (0.0, 0))
        return fmt_seconds(seconds / n) if n else "n/a"


class Engine:
    """One decoding run on its own `cache` (a GDNCache: one block-table row per batch row, its
    sizes and its state mode are the run's), with its metadata builder and decode path; prompts
    up to `max_prompt` tokens prefill in one step."""

    def __init__(self, model, cache, max_prompt: int = 1):
        import torch

        import gdn
        from gdn._demo_model import NULL_BLOCK, DecodePath

        self.torch = torch
        num_rows, num_spec, replay = cache.num_rows, cache.num_spec, cache.windows is not None
        self.model, self.N, self.num_spec, self.T = model, num_rows, num_spec, num_spec + 1
        self.cache = cache
        self.replay = replay
        # A step feeds T tokens per row, or a whole prompt to a row that prefills it in one step.
        self.max_tokens = num_rows * max(self.T, max_prompt)
        # The metadata builder: persistent buffers for all groups, one plan + one pass per step.
        # In replay mode it also gives each spec row's checkpoint block per group and the window
        # tokens each row replays (its accepted counts are the replay counts then).
        self.builder = gdn.metadata.Builder(
            self.cache.block_tables,
            num_spec=num_spec,
            max_rows=num_rows,
            max_tokens=self.max_tokens,
            pad_id=NULL_BLOCK,
            replay=replay,
        )
        self.path = DecodePath(model, self.cache, self.max_tokens)
        self.graph = None
        self.graph_events: List = []
        self.graph_note = ""
        self.graph_slots = None

    def _host(self, values) -> np.ndarray:
        return np.asarray(values, dtype=np.int32)

    def release(self, row: int) -> None:
        """The request on `row` finished: its blocks are free and hold garbage from now on."""
        self.cache.release(row)

    def non_spec_step(self, feed: Sequence[Optional[List[int]]], context: Sequence[int], timer):
        """One step of non-spec rows: row i feeds the tokens feed[i] (None: a zero-length row) on
        top of context[i] tokens already in its state: one token (a decode, or a prompt fed token
        by token) or a whole prompt (a prefill row, run through the prefill calls). Returns the
        greedy next token after the last token of every row that fed any (None elsewhere)."""
        from gdn._demo_model import StepSlots

        torch = self.torch
        T = [0 if t is None else len(t) for t in feed]
        qsl = self._host(np.concatenate([[0], np.cumsum(T)]))
        with timer.host("metadata"):
            md = self.builder.step(qsl, self._host(np.add(context, T)), num_computed_tokens=self._host(context))
        rows = int(qsl[-1])
        if rows == 0:
            return [None] * len(feed)
        active = [x for t in feed if t is not None for x in t]
        self.path.tokens[:rows].copy_(torch.tensor(active, dtype=torch.long))
        if max(T) > 1:
            # Prefill rows next to one-token rows: each kind runs on its own gathered rows.
            self.path.forward_mixed(rows, md, None, timer)
        else:
            # All rows are one-token non-spec rows here: row j of the non-spec fields is batch
            # row j. Decode rows read non_spec_source_indices, fresh rows their zeroed destination.
            ns = self.path.non_spec_rows(md, timer)
            slots = StepSlots(
                cu_seqlens=md.non_spec_query_start_loc,
                state_indices=ns.tables(),
                conv_indices=ns.destination,
                num_accepted_tokens=None,
                decode_accepted=self.path.twos[: md.non_spec_rows],
            )
            self.path.forward(rows, slots, timer)
        pred = self.path.pred[:rows].tolist()
        return [None if t is None else pred[int(qsl[i + 1]) - 1] for i, t in enumerate(feed)]

    def _spec_slots(self, md):
        from gdn._demo_model import StepSlots

        G = self.model.cfg.groups
        # The conv state lives in column 0 of each request's row; in replay mode that block is the
        # request's checkpoint, which the builder gives per group (checkpoint_indices) with the
        # window tokens each row replays (replay_counts; padded rows 0).
        return StepSlots(
            cu_seqlens=md.spec_query_start_loc,
            state_indices=[md.spec_state_indices[g] for g in range(G)],
            conv_indices=[
                md.checkpoint_indices[g] if self.replay else md.spec_state_indices[g][:, 0] for g in range(G)
            ],
            num_accepted_tokens=md.spec_num_accepted,
            replay_counts=md.replay_counts if self.replay else None,
        )

    def _counts(self, acc: np.ndarray, replay_n: Optional[np.ndarray], live: np.ndarray) -> np.ndarray:
        """The builder's num_accepted_tokens: the accepted counts (1..S), or in replay mode the
        window tokens each request replays (0..S, 0 right after prefill); rows not live: 1 / 0."""
        if self.replay:
            assert replay_n is not None, "replay mode needs the replay counts"
            return self._host(np.where(live, replay_n, 0))
        return self._host(np.where(live, acc, 1))

    def verify_step(
        self,
        live: List[int],
        tokens,
        acc: np.ndarray,
        context: np.ndarray,
        timer,
        replay_n: Optional[np.ndarray] = None,
    ):
        """One verify step: live rows (indices, in order) each verify T tokens (`tokens`
        [len(live), T] on the device: last token + drafts); with replay verify, row i first
        replays replay_n[i] tokens of its window. Other rows are zero-length rows. Returns the
        target's greedy choice after every verified position, [len(live), T] on the host."""
        N, T = self.N, self.T
        is_live = np.zeros(N, bool)
        is_live[live] = True
        q = np.where(is_live, T, 0)
        qsl = self._host(np.concatenate([[0], np.cumsum(q)]))
        with timer.host("metadata"):
            # Padded to the full batch, so every step has the same shapes (what a graph needs).
            md = self.builder.step(
                qsl,
                self._host(context + q),
                num_draft_tokens=self._host(np.where(is_live, self.num_spec, -1)),
                num_accepted_tokens=self._counts(acc, replay_n, is_live),
                num_computed_tokens=self._host(context),
                padded_rows=N,
            )
        # Spec row j is the j-th live row; its tokens are rows j*T .. j*T+T-1 (free rows are
        # zero-length rows, so the spec token order is the step's token order).
        assert md.num_spec_decodes == len(live) and md.num_spec_decode_tokens == len(live) * T
        assert list(md.host.spec_request_index[: len(live)].tolist()) == list(live)
        rows = len(live) * T
        self.path.tokens[:rows].copy_(tokens.reshape(-1))
        if self.graph is not None:
            self.graph.replay()
        else:
            self.path.forward(rows, self._spec_slots(md), timer)
        pred = self.path.pred[:rows].view(len(live), T).cpu().numpy()
        if self.graph is not None and self.graph_events:
            try:  # events recorded inside the graph
                times = [(name, start.elapsed_time(end) / 1000.0) for name, start, end in self.graph_events]
            except RuntimeError:
                self.graph_events = []
                self.graph_note = "kernel times unreadable from the graph's events (counted in 'rest')"
            else:
                for name, seconds in times:
                    timer.totals[name] += seconds
                    timer.calls[name] += 1
        return pred

    def mixed_step(
        self,
        live: List[int],
        tokens: Dict[int, List[int]],
        acc: np.ndarray,
        context: np.ndarray,
        timer,
        replay_n: np.ndarray,
        prefill_rows: Sequence[int] = (),
    ) -> Dict[int, List[int]]:
        """A step in which some live rows verify drafts (T tokens) and others feed prompt tokens
        (`prefill_rows`: one token, or a whole prompt) or one token without drafts (a step may
        have no spec rows at all). vLLM's rules classify the step: the rows without drafts become
        non-spec rows, which read their state from where the previous step left it
        (``non_spec_source_indices``) or, as prefill rows without an initial state, start from a
        zero state; those of more than one token run through the prefill calls. Runs eagerly.
        Returns, per live row, the target's greedy choice after each of its tokens."""
        N = self.N
        q = np.zeros(N, np.int64)
        drafts = np.full(N, -1, np.int64)
        for i in live:
            q[i] = len(tokens[i])
            if len(tokens[i]) > 1 and i not in prefill_rows:
                drafts[i] = len(tokens[i]) - 1
        qsl = self._host(np.concatenate([[0], np.cumsum(q)]))
        live_mask = q > 0
        with timer.host("metadata"):
            md = self.builder.step(
                qsl,
                self._host(context + q),
                num_draft_tokens=self._host(drafts),
                num_accepted_tokens=self._counts(acc, replay_n, live_mask),
                num_computed_tokens=self._host(context),
            )
        rows = int(qsl[-1])
        flat = [t for i in range(N) for t in tokens.get(i, [])]
        self.path.tokens[:rows].copy_(self.torch.tensor(flat, dtype=self.torch.long))
        replay_counts = None
        if self.replay:  # the builder's replay counts of both kinds of rows, back in request order
            replay_counts = np.zeros(N, np.int32)
            h = md.host
            replay_counts[np.asarray(h.spec_request_index)[: md.num_spec_decodes]] = np.asarray(h.replay_counts)[
                : md.num_spec_decodes
            ]
            replay_counts[np.asarray(h.non_spec_request_index)[: md.num_non_spec_rows]] = np.asarray(
                h.non_spec_replay_counts
            )[: md.num_non_spec_rows]
        self.path.forward_mixed(rows, md, replay_counts, timer)
        pred = self.path.pred[:rows].cpu().numpy()
        return {i: pred[qsl[i] : qsl[i + 1]].tolist() for i in live}

    def capture_verify_graph(self, context: np.ndarray) -> str:
        """Captures the target's verify forward over the full padded batch in a CUDA graph. The
        capture-time metadata has no live rows (every row padded, nothing to read or write), so
        the warm-up run leaves the caches untouched. Returns how the verify step is timed."""
        from gdn._demo_model import Timer

        torch = self.torch
        N, T = self.N, self.T
        md = self.builder.step(
            self._host(np.zeros(N + 1)),
            self._host(context),
            num_draft_tokens=self._host(np.full(N, -1)),
            num_computed_tokens=self._host(context),
            padded_rows=N,
        )
        slots = self._spec_slots(md)  # full-capacity views: the same addresses every step
        assert int(slots.cu_seqlens.numel()) == N + 1
        rows = N * T
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.path.forward(rows, slots, Timer(torch.device("cuda")))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for timed in (True, False):
            try:
                graph = torch.cuda.CUDAGraph()
                events: List[Any] = []
                with torch.cuda.graph(graph):
                    self.path.forward(rows, slots, None, event_log=events if timed else None)
                self.graph, self.graph_events = graph, events
                self.graph_note = (
                    "conv / decode_mtp times from CUDA events inside the graph"
                    if timed
                    else "kernel times unavailable inside the graph (counted in 'rest')"
                )
                return self.graph_note
            except (RuntimeError, TypeError):
                if not timed:
                    raise
                torch.cuda.synchronize()
        return ""


class Scheduler:
    """The batch rows and the queue of waiting requests. Each row holds at most one request; a
    request prefills (its whole prompt in the step that admits it with `whole_prompts`, else
    one prompt token per step) and then decodes until it has generated `new_tokens`; it then
    leaves its row at once, and the next waiting request takes the row over at the next step
    (:meth:`admit`). Records each request's time to first token: from the start of the step
    that gives it a row to the end of the step that emits its first token."""

    def __init__(self, prompts: List[List[int]], rows: int, new_tokens: int, whole_prompts: bool = False):
        self.prompts, self.new_tokens, self.whole_prompts = prompts, new_tokens, whole_prompts
        self.admitted_at: List[float] = [0.0] * len(prompts)
        self.ttft: List[float] = [float("nan")] * len(prompts)
        self.waiting = deque(range(len(prompts)))
        self.request: List[Optional[int]] = [None] * rows  # the request on each row
        self.used = [False] * rows
        self.fed = [0] * len(prompts)  # prompt tokens in each request's state
        self.out: List[List[int]] = [[] for _ in prompts]
        self.context = np.zeros(rows, np.int64)  # tokens of the row's request in its state
        self.recycled = self.recycled_one_token = 0

    def admit(self) -> List[int]:
        """Gives free rows, in row order, to the waiting requests; returns the rows filled."""
        filled = []
        now = time.perf_counter()
        for r, q in enumerate(self.request):
            if q is None and self.waiting:
                q = self.waiting.popleft()
                self.request[r] = q
                self.admitted_at[q] = now
                self.context[r] = 0
                if self.used[r]:
                    self.recycled += 1
                    self.recycled_one_token += len(self.prompts[q]) == 1
                self.used[r] = True
                filled.append(r)
        return filled

    def occupied(self) -> List[int]:
        return [r for r, q in enumerate(self.request) if q is not None]

    def on(self, row: int) -> int:
        """The request on an occupied row."""
        q = self.request[row]
        assert q is not None, f"row {row} is free"
        return q

    def prefilling(self, row: int) -> bool:
        q = self.on(row)
        return self.fed[q] < len(self.prompts[q])

    def next_token(self, row: int) -> int:
        """The token the row feeds next: its next prompt token, else its last generated one."""
        q = self.on(row)
        return self.prompts[q][self.fed[q]] if self.prefilling(row) else self.out[q][-1]

    def next_tokens(self, row: int) -> List[int]:
        """The tokens the row feeds next: the rest of its prompt (`whole_prompts`) or its next
        prompt token while it prefills, else its last generated token."""
        q = self.on(row)
        if self.prefilling(row) and self.whole_prompts:
            return list(self.prompts[q][self.fed[q] :])
        return [self.next_token(row)]

    def prefilled(self, row: int, pred: int, fed: int = 1) -> None:
        """The row fed `fed` prompt tokens; `pred` is the target's choice after the last of them,
        the request's first generated token when that was its last prompt token."""
        q = self.on(row)
        self.fed[q] += fed
        self.context[row] += fed
        if self.fed[q] == len(self.prompts[q]):
            self.out[q].append(int(pred))
            self.ttft[q] = time.perf_counter() - self.admitted_at[q]

    def decoded(self, row: int, fed: int, emitted: Sequence[int]) -> None:
        """The row's request now has `fed` more tokens in its state and emitted `emitted`."""
        out = self.out[self.on(row)]
        self.context[row] += fed
        out.extend(int(t) for t in emitted[: self.new_tokens - len(out)])

    def retire(self, engine: "Engine") -> None:
        """Frees the rows of the requests that are done (their blocks then hold garbage)."""
        for r, q in enumerate(self.request):
            if q is not None and len(self.out[q]) >= self.new_tokens:
                engine.release(r)
                self.request[r] = None

    def done(self) -> bool:
        return not self.waiting and all(q is None for q in self.request)

    def generated(self) -> int:
        return sum(len(o) for o in self.out)


def _garbage_seed(args, run: int) -> int:
    """Seed of the garbage in free blocks: one per run (0 plain, 1 speculative, 2 replay, 3 plain
    with token-by-token prefill next to prefill calls)."""
    return 1_000_003 * args.seed + 7919 * (run + 1)


def run_plain(
    model, prompts, args, progress, prefill_calls: bool = False, garbage_run: int = 0
) -> Tuple[List[List[int]], RunStats]:
    """Plain greedy decoding of the workload: every occupied row feeds one token per step, or,
    with `prefill_calls`, a row that prefills feeds its whole prompt in the step that admits it
    (the prefill calls)."""
    from gdn._demo_model import GDNCache, Timer

    stats = RunStats()
    B = args.requests
    # The T = 1 pools of plain decoding.
    cache = GDNCache(model, B, 0, args.conv_layout, args.seed + 1, garbage_seed=_garbage_seed(args, garbage_run))
    engine = Engine(model, cache, max_prompt=max(map(len, prompts)) if prefill_calls else 1)
    sched = Scheduler(prompts, B, args.new_tokens, whole_prompts=prefill_calls)
    _sync(model)
    timer = Timer(model.device)
    t0 = time.perf_counter()
    while not sched.done():
        t_step = time.perf_counter()
        sched.admit()
        rows = sched.occupied()
        prefilling = [sched.prefilling(r) for r in rows]
        feed: List[Optional[List[int]]] = [None] * B
        for r in rows:
            feed[r] = sched.next_tokens(r)
        pred = engine.non_spec_step(feed, sched.context.tolist(), timer)
        for r, pre in zip(rows, prefilling):
            fed = feed[r]
            if pre and fed is not None:
                sched.prefilled(r, pred[r], len(fed))
            else:
                sched.decoded(r, 1, [pred[r]])
        sched.retire(engine)
        stats.steps += 1
        stats.prefill_steps += any(prefilling)
        stats.timed_step("plain", time.perf_counter() - t_step)
        progress.update(sched.generated())
    _finish_run(model, engine, sched, timer, stats, t0)
    return sched.out, stats


def run_speculative(
    model, prompts, args, progress, replay: bool = False, prefill_calls: bool = False
) -> Tuple[List[List[int]], RunStats, str]:
    """MTP-style speculative decoding of the workload. Steps in which every occupied row decodes
    with drafts are pure verify steps (verify_step, the CUDA graph with --graphs); steps with
    prefilling rows or rows without drafts run spec and non-spec rows together (mixed_step).
    With `prefill_calls` a prefilling row feeds its whole prompt in the step that admits it."""
    import torch

    from gdn._demo_model import GDNCache, Timer

    stats = RunStats()
    B, ns = args.requests, args.num_spec
    garbage_seed = _garbage_seed(args, 2 if replay else 1)
    cache = GDNCache(model, B, ns, args.conv_layout, args.seed + 2, replay=replay, garbage_seed=garbage_seed)
    engine = Engine(model, cache, max_prompt=max(map(len, prompts)) if prefill_calls else 1)
    sched = Scheduler(prompts, B, args.new_tokens, whole_prompts=prefill_calls)
    if args.graphs:
        engine.capture_verify_graph(sched.context)
    _sync(model)
    timer = Timer(model.device)
    acc = np.ones(B, np.int64)  # accepted count of each row's last step
    replay_n = np.zeros(B, np.int64)  # replay verify: window tokens each row replays
    t0 = time.perf_counter()
    while not sched.done():
        t_step = time.perf_counter()
        for r in sched.admit():  # a fresh request: state in column 0 (none yet), empty window
            acc[r], replay_n[r] = 1, 0
        rows = sched.occupied()
        pre = [r for r in rows if sched.prefilling(r)]
        dec = [r for r in rows if not sched.prefilling(r)]
        # Every few steps some requests draft nothing (one plain token): the step mixes spec and
        # non-spec rows, and those requests go from spec to non-spec and back.
        plain = (
            [r for r in dec if (stats.steps + r) % 3 == 0]
            if args.mixed_every and stats.steps % args.mixed_every == args.mixed_every - 1
            else []
        )
        if pre or plain:
            with timer.host("drafter"):
                tok = {r: sched.next_tokens(r) for r in rows}
                spec_rows = [r for r in dec if r not in plain]
                if spec_rows:
                    cur = torch.tensor([tok[r][0] for r in spec_rows], dtype=torch.long, device=model.device)
                    drafted = [cur]
                    for _ in range(ns):
                        drafted.append(model.draft_next(drafted[-1]))
                    for r, t in zip(spec_rows, torch.stack(drafted, 1).cpu().tolist()):
                        tok[r] = [int(x) for x in t]
            pred_map = engine.mixed_step(rows, tok, acc, sched.context, timer, replay_n, prefill_rows=pre)
            with timer.host("acceptance"):
                for r in pre:
                    sched.prefilled(r, pred_map[r][-1], len(tok[r]))
                    # One prompt token went through the decode path: it is in the state and the
                    # replay window. A whole prompt went through the prefill calls: the state
                    # after it is in column 0 (the checkpoint), the window is empty.
                    acc[r] = 1
                    replay_n[r] = 1 if len(tok[r]) == 1 else 0
                for r in dec:
                    d, p = tok[r][1:], pred_map[r]
                    n = 0
                    while n < len(d) and d[n] == p[n]:
                        n += 1
                    sched.decoded(r, n + 1, list(d[:n]) + [p[n]])
                    stats.drafted += len(d)
                    stats.accepted += n
                    acc[r] = replay_n[r] = n + 1
            stats.prefill_steps += bool(pre)
            stats.nodraft_steps += bool(plain)
            stats.mixed_steps += bool(spec_rows)
            kind = "mixed"
        else:
            with timer.host("drafter"):
                last = torch.tensor([sched.next_token(r) for r in dec], dtype=torch.long, device=model.device)
                tokens = torch.empty(len(dec), ns + 1, dtype=torch.long, device=model.device)
                tokens[:, 0] = last
                for j in range(ns):
                    tokens[:, j + 1] = model.draft_next(tokens[:, j])
            pred = engine.verify_step(dec, tokens, acc, sched.context, timer, replay_n)
            with timer.host("acceptance"):
                drafts = tokens[:, 1:].cpu().numpy()
                for k, r in enumerate(dec):
                    n = 0
                    while n < ns and drafts[k, n] == pred[k, n]:
                        n += 1
                    sched.decoded(r, n + 1, [int(t) for t in drafts[k, :n]] + [int(pred[k, n])])
                    stats.drafted += ns
                    stats.accepted += n
                    acc[r] = n + 1
                    replay_n[r] = n + 1  # the fed tokens it accepted: last token + n drafts
            stats.verify_steps += 1
            kind = "verify"
        sched.retire(engine)
        stats.steps += 1
        stats.timed_step(kind, time.perf_counter() - t_step)
        progress.update(sched.generated())
    _finish_run(model, engine, sched, timer, stats, t0)
    return sched.out, stats, engine.graph_note


def _sync(model) -> None:
    if model.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def _finish_run(model, engine, sched: Scheduler, timer, stats: RunStats, t0: float) -> None:
    """Closes a run started at `t0`: waits for the device, records time, tokens and rows taken
    over, raises on device-side errors, folds the timer's breakdown."""
    _sync(model)
    stats.seconds = time.perf_counter() - t0
    stats.tokens = sched.generated()
    stats.recycled, stats.recycled_one_token = sched.recycled, sched.recycled_one_token
    stats.fresh_rows = engine.path.fresh_rows
    stats.ttft = list(sched.ttft)
    engine.path.check_device_errors()
    timer.resolve()
    stats.breakdown = dict(timer.totals)
    stats.calls = dict(timer.calls)


def make_prompts(n: int, lo: int, hi: int, vocab: int, seed: int) -> List[List[int]]:
    rng = np.random.default_rng(seed)
    lengths = np.linspace(lo, hi, n).round().astype(int) if n > 1 else np.array([hi])
    rng.shuffle(lengths)
    return [rng.integers(0, vocab, size=int(L)).tolist() for L in lengths]


def make_workload(rows: int, late: int, lo: int, hi: int, vocab: int, seed: int) -> List[List[int]]:
    """The prompts of the first `rows` requests, then of the `late` ones waiting in the queue:
    every third late request (the 1st, 4th, ...) has a one-token prompt, the others are spread
    over [lo, hi] like the first ones."""
    late_prompts = make_prompts(late, lo, hi, vocab, seed + 1) if late else []
    for k in range(0, late, 3):
        late_prompts[k] = late_prompts[k][:1]
    return make_prompts(rows, lo, hi, vocab, seed) + late_prompts


def breakdown_line(stats: RunStats) -> str:
    total = stats.seconds
    b = stats.breakdown
    verify = "replay" if "replay" in b else "decode_mtp"
    parts = [(name, b.get(name, 0.0)) for name in ("metadata", "conv", verify)]
    if "prefill" in b:
        parts.append(("prefill", b["prefill"]))
    rest = max(total - sum(v for _, v in parts), 0.0)
    line = " | ".join(f"{name} {100 * v / total:.1f} %" for name, v in parts)
    extra = [(n, b[n]) for n in ("drafter", "acceptance", "zeroing") if n in b]
    inside = ", ".join(f"{n} {100 * v / total:.1f} %" for n, v in extra)
    return f"{line} | rest {100 * rest / total:.1f} %" + (
        f" (dense layers and copies; of which {inside})" if inside else " (dense layers and copies)"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    try:
        import torch
    except ImportError:
        print("python -m gdn demo needs torch (pip install torch)", file=sys.stderr)
        return 2
    import gdn
    from gdn._demo_model import ModelConfig, TinyHybridGDN, fmt_seconds, tokens_per_second

    if args.device == "cuda":
        if not (torch.cuda.is_available() and gdn._C.built_with_cuda and gdn.cuda_device_count() > 0):
            print(
                "--device cuda needs a GPU and a CUDA build of gdn "
                f"(torch sees {torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                f"GPUs; gdn built with CUDA: {gdn._C.built_with_cuda})",
                file=sys.stderr,
            )
            return 2
        ok, why = gdn.cuda_kernels_available(torch.cuda.current_device())
        if not ok:
            print(f"--device cuda: {why}", file=sys.stderr)
            return 2
    elif args.graphs:
        print("--graphs needs --device cuda", file=sys.stderr)
        return 2
    if args.min_prompt < 1 or args.max_prompt < args.min_prompt:
        print("need 1 <= --min-prompt <= --max-prompt", file=sys.stderr)
        return 2
    if args.new_tokens < 1 or args.requests < 1 or args.num_spec < 1:
        print("--new-tokens, --requests and --num-spec must be >= 1", file=sys.stderr)
        return 2
    if args.late_requests is not None and args.late_requests < 0:
        print("--late-requests must be >= 0", file=sys.stderr)
        return 2
    head_dim = args.head_dim or (128 if args.device == "cuda" else 32)
    cfg = ModelConfig(
        vocab=args.vocab,
        hidden=args.hidden,
        layers=args.layers,
        groups=args.groups,
        H=args.heads,
        HV=args.value_heads,
        head_dim=head_dim,
        layer_strength=args.layer_strength,
        seed=args.seed,
    )
    device = torch.device(args.device)
    try:
        model = TinyHybridGDN(cfg, device)
    except ValueError as e:
        print(f"invalid model: {e}", file=sys.stderr)
        return 2
    if args.device == "cuda":
        path, why = gdn.can_use_decode_mtp("cuda", H=cfg.H, HV=cfg.HV, K=cfg.K, V=cfg.V, S=args.num_spec + 1)
        if path == "unsupported":
            print(f"decode_mtp cannot run this model on CUDA: {why}", file=sys.stderr)
            return 2
    prefill_calls, prefill_why = prefill_path(args, cfg)
    late = args.requests if args.late_requests is None else args.late_requests
    prompts = make_workload(args.requests, late, args.min_prompt, args.max_prompt, cfg.vocab, args.seed)
    new = args.new_tokens
    T = args.num_spec + 1
    R = len(prompts)
    one_token = sum(len(p) == 1 for p in prompts[args.requests :])

    where = (
        f"cuda ({torch.cuda.get_device_name(device)}), CUDA graphs {'on' if args.graphs else 'off'}"
        if args.device == "cuda"
        else f"cpu ({torch.get_num_threads()} threads)"
    )
    print(
        "gdn demo: speculative decoding with a tiny hybrid GDN language model (random weights), "
        "requests coming and going"
    )
    print(f"  device      : {where}")
    print(f"  model       : {cfg.describe()}")
    print(
        f"  workload    : {R} requests on {args.requests} rows, prompts "
        f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, {new} new tokens each, greedy"
    )
    if prefill_calls:
        exactness = (
            "on the CPU bit for bit equal to token-by-token prefill (fp32 state), so the check asks for its tokens too"
            if args.device == "cpu"
            else "on CUDA a chunked kernel with bf16 operands (about 5e-3 relative error against "
            "fp32), so its tokens are compared with token-by-token prefill but not required equal"
        )
        print(
            f"  prefill     : whole prompts in the step that admits them: per layer one "
            f"gdn.causal_conv1d_prefill + one gdn.prefill call over the step's prefill rows "
            f"(non-spec rows of more than one token; one-token prompts go through the decode "
            f"path); {exactness}; a plain run prefilling token by token runs too"
        )
    else:
        print(f"  prefill     : token by token (one prompt token per step through the decode path, T = 1){prefill_why}")
    if late:
        print(
            f"  rows        : {late} requests wait in a queue; a finished request frees its row "
            f"(its blocks in all {cfg.groups} groups get garbage) and the next one takes it "
            f"over at the next step; {one_token} of the late prompts are one token long"
        )
    print(
        f"  speculation : drafter = the target's embedding -> lm_head path without the GDN "
        f"layers; num_spec {args.num_spec}, T = {T} tokens verified per request and step"
    )
    print(
        f"  per step    : gdn.metadata (1 plan + 1 state-row pass for {cfg.groups} groups), then per "
        f"layer gdn.causal_conv1d_update ({args.conv_layout}) + gdn.decode_mtp over the one-token "
        f"and verify rows; rows without an initial state (has_initial_state False) start from "
        f"zeroed blocks (one-token rows) or a null initial slot (prefill calls)"
    )
    sys.stdout.flush()

    show = not args.no_progress
    total = R * new
    pc = prefill_calls
    bar = Progress("plain greedy", total, show)
    plain, ps = run_plain(model, prompts, args, bar, prefill_calls=pc)
    bar.close()
    bar = Progress("speculative", total, show)
    spec, ss, graph_note = run_speculative(model, prompts, args, bar, prefill_calls=pc)
    bar.close()
    replay = args.state_mode == "replay"
    if replay:
        bar = Progress("speculative, replay", total, show)
        spec_rp, rs, _ = run_speculative(model, prompts, args, bar, replay=True, prefill_calls=pc)
        bar.close()
    if pc:  # the reference: plain greedy decoding, prompts fed token by token
        bar = Progress("plain, token by token", total, show)
        tbt, ts = run_plain(model, prompts, args, bar, prefill_calls=False, garbage_run=3)
        bar.close()
    # Timed repeats after the warm-up run above (single runs swing widely with machine load);
    # every repeat must generate the same tokens again.
    plain_rates, spec_rates, replay_rates = [], [], []
    ttft: Dict[str, List[List[float]]] = {"plain": [], "speculative": [], "token-by-token": []}
    for _ in range(max(args.repeats, 1) - 1):
        again, st = run_plain(model, prompts, args, Progress("plain greedy", total, False), prefill_calls=pc)
        plain_rates.append(st.tokens / st.seconds)
        ttft["plain"].append(st.ttft)
        same = again == plain
        again, st, _ = run_speculative(model, prompts, args, Progress("speculative", total, False), prefill_calls=pc)
        spec_rates.append(st.tokens / st.seconds)
        ttft["speculative"].append(st.ttft)
        same = same and again == spec
        if replay:
            again, st, _ = run_speculative(
                model, prompts, args, Progress("speculative", total, False), replay=True, prefill_calls=pc
            )
            replay_rates.append(st.tokens / st.seconds)
            same = same and again == spec_rp
        if pc:
            again, st = run_plain(model, prompts, args, Progress("plain", total, False), garbage_run=3)
            ttft["token-by-token"].append(st.ttft)
            same = same and again == tbt
        if not same:
            print("FAIL (a repeated run generated different tokens)")
            return 1
    if not ttft["plain"]:  # no timed repeats: the warm-up runs' times
        ttft = {"plain": [ps.ttft], "speculative": [ss.ttft], "token-by-token": [ts.ttft] if pc else []}

    def who(i: int) -> str:
        if i < args.requests:
            return f"request {i}"
        return f"request {i} (late{', one-token prompt' if len(prompts[i]) == 1 else ''})"

    def differences(name: str, tokens: List[List[int]]) -> List[str]:
        lines = []
        for i, (a, b) in enumerate(zip(plain, tokens)):
            if a != b:
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                lines.append(
                    f"{name} {who(i)}: first difference at generated token {k} "
                    f"(plain {a[k : k + 4]}, {name} {b[k : k + 4]})"
                )
        return lines

    mismatches = []
    runs = [("speculative", spec)] + ([("replay", spec_rp)] if replay else [])
    for name, tokens in runs:
        mismatches += differences(name, tokens)
    # Prefill calls against token by token (plain greedy both): required equal on the CPU, where
    # the two paths are bit-exact; on CUDA the prefill kernel's bf16 operands may flip a token.
    tbt_differences = differences("token-by-token", tbt) if pc else []

    print()
    print(
        f"plain greedy : {ps.steps} steps ({ps.prefill_steps} with prefilling rows), "
        f"{ps.tokens} tokens generated in {fmt_seconds(ps.seconds)} = "
        f"{tokens_per_second(ps.tokens, ps.seconds)}"
    )
    if pc:
        print(
            f"token by token: {ts.steps} steps ({ts.prefill_steps} with prefilling rows), "
            f"{ts.tokens} tokens generated in {fmt_seconds(ts.seconds)} = "
            f"{tokens_per_second(ts.tokens, ts.seconds)} (plain greedy, prompts fed one token per step)"
        )
    if plain_rates:
        speedup = float(np.median(spec_rates)) / float(np.median(plain_rates))
        how = f"median of {len(plain_rates)} timed runs after a warm-up"
    else:
        speedup = (
            (ss.tokens / ss.seconds) / (ps.tokens / ps.seconds) if ss.seconds > 0 and ps.seconds > 0 else float("nan")
        )
        how = "one run, not warmed up"
    print(
        f"speculative  : {ss.steps} steps ({ss.verify_steps} pure verify, {ss.prefill_steps} "
        f"with prefilling rows), {ss.tokens} tokens generated in {fmt_seconds(ss.seconds)} = "
        f"{tokens_per_second(ss.tokens, ss.seconds)}"
    )
    print(f"speed-up     : {speedup:.2f}x plain decoding ({how}; same workload and scheduling, prefill steps included)")
    print(
        f"step time    : plain {ps.per_step('plain')} per step; speculative "
        f"{ss.per_step('verify')} per pure verify step, {ss.per_step('mixed')} per step with "
        f"prefilling rows or rows without drafts (warm-up runs)"
    )
    if ps.recycled:
        print(
            f"recycled     : {ps.recycled} rows taken over by new requests "
            f"({ps.recycled_one_token} with one-token prompts); {R} requests ran on "
            f"{args.requests} rows"
        )
    else:
        print(f"recycled     : no row changed hands ({R} requests on {args.requests} rows)")
    fresh = (
        [("plain", ps.fresh_rows), ("speculative", ss.fresh_rows)]
        + ([("replay", rs.fresh_rows)] if replay else [])
        + ([("token-by-token", ts.fresh_rows)] if pc else [])
    )
    if all(n == R for _, n in fresh):
        print(
            f"fresh rows   : in every run the metadata started all {R} requests from a zero "
            f"state (prefill rows with has_initial_state False: a null initial slot for the "
            f"prefill calls, zeroed blocks for one-token rows)"
        )
    else:
        per_run = ", ".join(f"{name} {n}" for name, n in fresh)
        print(
            f"fresh rows   : rows the metadata started from a zero state (has_initial_state "
            f"False), per run: {per_run} (for {R} requests)"
        )
    if ss.mixed_steps:
        print(
            f"mixed steps  : {ss.mixed_steps} of {ss.steps} steps had spec rows next to non-spec "
            f"rows (prefilling requests or requests without drafts; {ss.nodraft_steps} steps had "
            f"requests without drafts, reading non_spec_source_indices)"
        )
    rate = ss.accepted / ss.drafted if ss.drafted else 0.0
    print(
        f"acceptance   : {ss.accepted} of {ss.drafted} drafts accepted ({100 * rate:.1f} %); "
        f"{1 + ss.accepted / max(ss.drafted / args.num_spec, 1):.2f} tokens per request per "
        f"verify step (at most {T})"
    )
    print(f"time, speculative: {breakdown_line(ss)}")
    if graph_note:
        print(f"              ({graph_note})")
    print(f"time, plain      : {breakdown_line(ps)}")
    if pc:
        print(f"time, token by token: {breakdown_line(ts)}")
    print(ttft_report(ttft, pc, timed=bool(plain_rates)))
    if replay:
        print()
        print(replay_report(cfg, args, ss, rs, spec_rates, replay_rates))
    exact = args.device == "cpu"
    failed = mismatches + (tbt_differences if exact else [])
    if failed:
        print(f"check: {len(failed)} runs x requests differ from plain greedy decoding:")
        for m in failed:
            print("  " + m)
        print(
            "FAIL (speculative != plain decoding)"
            if mismatches
            else "FAIL (prefill calls != token-by-token prefill; the CPU paths are bit-exact)"
        )
        return 1
    both = " in both state modes" if replay else ""
    how = " (all runs with prefill calls)" if pc else ""
    print(
        f"check: all {R} requests generated exactly the plain greedy tokens{both}{how} "
        f"({sum(len(s) for s in spec)} tokens compared per run, token for token)"
    )
    if not pc:
        print("PASS (speculative == plain decoding)")
        return 0
    if exact:
        print(
            f"check: prefill calls generated exactly the tokens of token-by-token prefill, all {R} "
            f"requests (CPU: the two paths are bit-exact, fp32 state)"
        )
        print("PASS (speculative == plain decoding), prefill calls == token-by-token prefill")
        return 0
    agree = R - len(tbt_differences)
    print(
        f"check: {agree} of {R} requests generated exactly the tokens of token-by-token prefill "
        f"(not required on CUDA: the prefill kernel uses bf16 operands, about 5e-3 relative error, "
        f"so a near-tie of two logits may flip a greedy token)"
    )
    for m in tbt_differences:
        print("  " + m)
    print("PASS (speculative == plain decoding), all runs with prefill calls (token by token: compared, not required)")
    return 0


def prefill_path(args, cfg) -> Tuple[bool, str]:
    """Whether the runs prefill with the prefill calls, and why not where --prefill calls cannot:
    on CUDA gdn.prefill takes K = V = 128 only (the CPU path any K, V)."""
    if args.prefill != "calls":
        return False, ""
    if args.device == "cuda" and (cfg.K != 128 or cfg.V != 128):
        return False, (
            f" (--prefill calls: gdn.prefill on CUDA needs K = V = 128, this model has K = V = "
            f"{cfg.K}, so prompts are prefilled token by token)"
        )
    return True, ""


def ttft_report(ttft: Dict[str, List[List[float]]], prefill_calls: bool, timed: bool) -> str:
    """Time to first token, from a request taking a row to its first token: median and max over
    the requests of a run, each the median over the timed runs (the warm-up run without them)."""
    from gdn._demo_model import fmt_seconds

    def summary(runs: List[List[float]]) -> Tuple[float, float]:
        return float(np.median([np.median(r) for r in runs])), float(np.median([np.max(r) for r in runs]))

    how = f"median of {len(ttft['plain'])} timed runs after a warm-up" if timed else "one run, not warmed up"
    lines = []
    p_med, p_max = summary(ttft["plain"])
    s_med, s_max = summary(ttft["speculative"])
    label = "prefill calls" if prefill_calls else "token by token"
    lines.append(
        f"first token  : plain greedy, {label}: median {fmt_seconds(p_med)}, max {fmt_seconds(p_max)} "
        f"per request (from taking a row to its first token; {how})"
    )
    if prefill_calls and ttft["token-by-token"]:
        t_med, t_max = summary(ttft["token-by-token"])
        lines.append(
            f"               plain greedy, token by token: median {fmt_seconds(t_med)}, max "
            f"{fmt_seconds(t_max)} -> prefill calls give the first token {t_med / p_med:.1f}x sooner "
            f"(median), {t_max / p_max:.1f}x (max)"
        )
    lines.append(f"               speculative, {label}: median {fmt_seconds(s_med)}, max {fmt_seconds(s_max)}")
    return "\n".join(lines)


def replay_report(cfg, args, ws: RunStats, rs: RunStats, ws_rates, rs_rates) -> str:
    """Pool per request and layer, and verify time, of write-every-token and replay verify."""
    S = args.num_spec + 1
    state = cfg.HV * cfg.V * cfg.K * 4  # fp32 state
    window = S * (cfg.H * cfg.K + cfg.HV * cfg.V + 2 * cfg.HV) * 4 + 4  # fp32 activations
    kib = lambda b: f"{b / 1024:.1f} KiB"  # noqa: E731
    t_w = ws.breakdown.get("decode_mtp", 0.0) / max(ws.calls.get("decode_mtp", 0), 1)
    t_r = rs.breakdown.get("replay", 0.0) / max(rs.calls.get("replay", 0), 1)
    lines = [
        "state modes (per request and GDN layer):",
        f"  write-all : {S} states = {kib(S * state)}; verify kernel {1e6 * t_w:.1f} us per layer call",
        f"  replay    : 1 state + window of {S} tokens = {kib(state)} + {kib(window)} = "
        f"{kib(state + window)}; verify kernel {1e6 * t_r:.1f} us per layer call",
        f"  pool      : replay keeps {100 * (state + window) / (S * state):.0f} % of write-all's bytes",
    ]
    if ws_rates and rs_rates:
        ratio = float(np.median(rs_rates)) / float(np.median(ws_rates))
        lines.append(
            f"  decode    : replay at {ratio:.2f}x write-all's token rate (median of {len(rs_rates)} timed runs)"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
