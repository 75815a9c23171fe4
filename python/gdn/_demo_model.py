"""The model behind ``python -m gdn demo``: a tiny hybrid GDN language model with random weights,
its state caches (per layer pools, per KV-cache-group block tables) and the decode path that runs
plain decoding (T = 1) and speculative verification (T = num_spec + 1) through the same code.

Per token the model computes (pre-norm residual stack, no attention layers):

    h = embed[token]
    for each GDN layer:  h = h + out_proj( decode_mtp( conv( in_proj( rms_norm(h) ) ) ) )
    logits = lm_head( rms_norm(h) )

The GDN part of every layer runs batched over all requests and tokens of a step:
``gdn.causal_conv1d_update`` (conv state with speculative rollback) then ``gdn.decode_mtp`` (gated
delta rule with one state slot per verify position, gated RMSNorm). Slots come from the metadata
builder (``gdn.metadata``): one shared plan per step and one pass that fills every group's state
rows. Non-spec rows are consumed as a vLLM-style engine consumes them: the ``num_decodes``
leading rows read their state from ``non_spec_source_indices``; a prefill row whose
``has_initial_state`` is False starts from a zero state (its destination blocks are zeroed in
every layer, then read), any other prefill row reads its source.

Pool memory never holds zeros by accident: every block starts with garbage from a seeded RNG of
the run, and a finished request's blocks get that garbage again (as a real engine's freed memory
holds anything), so a fresh request handed a stale state reads garbage.

The dense layers (in/out projections, norms, lm_head) run batched over all token rows, yet give
bit-identical results for any batch shape: their arithmetic never rounds (see ``exact_linear``).
So a verified token and the same token decoded alone produce the same bits, and "speculative ==
plain" is a check of the GDN kernels and the metadata, not of rounding luck.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

import gdn

NULL_BLOCK = 0  # block 0 of every pool is the null block (vLLM convention): first_valid_slot = 1

#: A GDN layer's leading recurrence arguments: mixed_qkv, a, b, A_log, dt_bias and its state pool.
LayerInputs = Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class LayerCalls:
    """What a GDN layer's kernel calls take over some token rows (views of their in_proj
    outputs)."""

    mixed_qkv: torch.Tensor  # [L, conv_dim]: the conv's input and, in place, its output
    conv: Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # leading conv arguments: x, weight, conv state pool
    conv_options: Dict[str, Any]  # keywords of every conv call: state layout, null slot, error count
    ssm: LayerInputs
    ssm_options: Dict[str, Any]  # keywords of every recurrence call: z, norm weight, null slot, error count
    window: Optional[gdn.ReplayWindow]  # the layer's replay window; None without replay


@dataclass
class ModelConfig:
    vocab: int = 256
    hidden: int = 128
    layers: int = 4
    groups: int = 2
    H: int = 2  # key heads
    HV: int = 4  # value heads
    head_dim: int = 32  # K = V
    conv_width: int = 4
    layer_strength: float = 0.2  # scale of the GDN layers' residual contribution
    seed: int = 0

    @property
    def K(self) -> int:
        return self.head_dim

    @property
    def V(self) -> int:
        return self.head_dim

    @property
    def conv_dim(self) -> int:  # D = 2*H*K + HV*V
        return 2 * self.H * self.K + self.HV * self.V

    @property
    def proj_dim(self) -> int:  # in_proj output: [q|k|v (D) | z (HV*V) | b (HV) | a (HV)]
        return self.conv_dim + self.HV * self.V + 2 * self.HV

    def group_of(self, layer: int) -> int:
        return layer % self.groups

    def describe(self) -> str:
        return (
            f"vocab {self.vocab}, hidden {self.hidden}, {self.layers} GDN layers (H={self.H}, "
            f"HV={self.HV}, K=V={self.K}, conv width {self.conv_width}) in {self.groups} "
            f"KV-cache groups; int8-valued dense weights (exact float64 accumulation), fp32 "
            f"GDN parameters and state"
        )

    def check(self) -> None:
        if self.groups < 2 or self.groups > self.layers:
            raise ValueError(f"groups must be in [2, layers = {self.layers}], got {self.groups}")
        if self.HV % self.H:
            raise ValueError(f"value heads HV = {self.HV} must be a multiple of key heads H = {self.H}")
        for name, v in (("hidden", self.hidden), ("HV * head_dim", self.HV * self.head_dim)):
            if v > 2**11:
                raise ValueError(f"{name} = {v} exceeds 2048, the exact-accumulation bound of the dense layers")


# ---- dense arithmetic that does not depend on the batch shape --------------------------------------
#
# A GEMM may sum in a different order for a different number of rows. Here no order can matter:
# inputs are rounded to bf16 (8 significant bits), clamped to |x| <= 255 and flushed to zero below
# 2^LO; weights are integers in [-127, 127] times 2^-p. Every product is then a multiple of
# 2^(LO-7-p) below 2^(8+7-p) in magnitude, and any partial sum of K <= 2^MAX_LOG2_K products stays
# below 2^53 such units: it is exactly representable in float64, so every summation order gives
# the exact result. Casting that to float32 is deterministic.

_LINEAR_LO = -16  # inputs of a projection: flushed below 2^-16
_NORM_LO = -6  # inputs of an RMS norm: sum of squares needs 2 * (8 - LO) + log2(K) <= 39
MAX_LOG2_K = 11  # both bounds hold for K <= 2048


def _bounded_bf16(x: torch.Tensor, lo: int) -> torch.Tensor:
    x = x.clamp(-255.0, 255.0).to(torch.bfloat16).to(torch.float64)
    return torch.where(x.abs() < 2.0**lo, torch.zeros_like(x), x)


def exact_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [rows, K] (any float dtype) @ weight [K, out] (float64, int8-valued times 2^-p), exact in
    float64, returned as float32."""
    return (_bounded_bf16(x, _LINEAR_LO) @ weight).to(torch.float32)


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMS norm over the last dim with an exact sum of squares (float64 result)."""
    q = _bounded_bf16(x, _NORM_LO)
    mean_square = (q * q).sum(-1, keepdim=True) / q.shape[-1]
    return q * torch.rsqrt(mean_square + eps) * weight


def int8_weight(shape, std: float, g: torch.Generator) -> torch.Tensor:
    """Gaussian weights of standard deviation ~std, stored as int8 values times 2^-p (float64)."""
    p = math.floor(math.log2(127.0 / (4.0 * std)))
    w = torch.round(torch.randn(*shape, generator=g) * std * 2.0**p).clamp(-127, 127)
    return (w * 2.0**-p).to(torch.float64)


class TinyHybridGDN:
    """Random weights (seeded), on `device`: fp32 embedding, GDN parameters and state; dense
    projections int8-valued (float64 storage, exact accumulation)."""

    def __init__(self, cfg: ModelConfig, device: torch.device):
        cfg.check()
        self.cfg = cfg
        self.device = device
        g = torch.Generator().manual_seed(cfg.seed)

        def rnd(*shape, scale=1.0):
            return (scale * torch.randn(*shape, generator=g)).to(device)

        d, D = cfg.hidden, cfg.conv_dim
        self.embed = rnd(cfg.vocab, d)
        self.final_norm = torch.ones(d, dtype=torch.float64, device=device)
        self.lm_head = int8_weight((d, cfg.vocab), d**-0.5, g).to(device)
        self.layers = []
        for _ in range(cfg.layers):
            self.layers.append(
                dict(
                    norm=torch.ones(d, dtype=torch.float64, device=device),
                    in_proj=int8_weight((d, cfg.proj_dim), d**-0.5, g).to(device),
                    conv_w=rnd(D, cfg.conv_width, scale=0.5),
                    # Decay: A = exp(A_log) in [1, 8]; dt_bias around softplus^-1 of small steps.
                    A_log=torch.log(torch.empty(cfg.HV).uniform_(1.0, 8.0, generator=g)).to(device),
                    dt_bias=rnd(cfg.HV, scale=0.5) - 2.0,
                    gnorm=torch.ones(cfg.V, device=device),
                    out_proj=int8_weight((cfg.HV * cfg.V, d), cfg.layer_strength * (cfg.HV * cfg.V) ** -0.5, g).to(
                        device
                    ),
                )
            )

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return exact_linear(exact_rms_norm(h, self.final_norm), self.lm_head)

    def draft_next(self, tokens: torch.Tensor) -> torch.Tensor:
        """The drafter: the target's embedding -> final norm -> lm_head path without the GDN
        layers (a bigram model sharing the target's weights). Cheap and batched; its output only
        decides how many tokens get accepted, never which tokens are emitted."""
        return self.logits(self.embed[tokens]).argmax(-1)


class GDNCache:
    """State of one decoding run: per layer an SSM state pool [blocks, HV, V, K] and a conv pool
    ([blocks, D, W-1+num_spec] or its transpose), per KV-cache group a block table [rows, columns]
    (one row per batch row, owned by the request running there). Block 0 is the null block; each
    group hands every row its own random blocks.

    Every other block starts as garbage drawn from a generator seeded with `garbage_seed` (one
    draw per run, kept as the run's garbage bank), and :meth:`release` writes that garbage back
    into a finished request's blocks: nothing but the metadata tells a fresh request that its
    blocks hold no state for it."""

    def __init__(
        self,
        model: TinyHybridGDN,
        num_rows: int,
        num_spec: int,
        conv_layout: str,
        seed: int,
        replay: bool = False,
        garbage_seed: int = 0,
    ):
        cfg, dev = model.cfg, model.device
        self.cfg = cfg
        self.num_rows, self.num_spec, self.S, self.conv_layout = num_rows, num_spec, num_spec + 1, conv_layout
        self.num_blocks = 1 + num_rows * self.S
        lbuf = cfg.conv_width - 1 + num_spec
        conv_shape = (
            (self.num_blocks, cfg.conv_dim, lbuf)
            if conv_layout == "channels_major"
            else (self.num_blocks, lbuf, cfg.conv_dim)
        )
        self.ssm = [torch.zeros(self.num_blocks, cfg.HV, cfg.V, cfg.K, device=dev) for _ in range(cfg.layers)]
        self.conv = [torch.zeros(*conv_shape, device=dev) for _ in range(cfg.layers)]
        # Replay verify: a request's state lives in one checkpoint block (column 0 of its row)
        # plus, per layer, a window of its last step's raw k, v, a, b rows.
        self.windows = (
            [
                gdn.ReplayWindow.allocate(
                    self.num_blocks, self.S, H=cfg.H, HV=cfg.HV, K=cfg.K, V=cfg.V, dtype=torch.float32, device=dev
                )
                for _ in range(cfg.layers)
            ]
            if replay
            else None
        )
        g = torch.Generator().manual_seed(seed)
        # Tables wider than S (spare columns), so the builder must pick the right ones.
        cols = self.S + 2
        self.block_tables: List[torch.Tensor] = []
        for _ in range(cfg.groups):
            ids = torch.randperm(self.num_blocks - 1, generator=g)[: num_rows * self.S] + 1
            table = torch.full((num_rows, cols), -1, dtype=torch.int32)
            table[:, : self.S] = ids.view(num_rows, self.S).to(torch.int32)
            self.block_tables.append(table.to(dev))
        # The run's garbage: one random value per element of every pool (the null block stays
        # zero), standard normal; windows hold a full step of garbage tokens.
        rng = torch.Generator(device=dev).manual_seed(garbage_seed)
        garbage = lambda like: torch.randn(like.shape, generator=rng, device=dev)  # noqa: E731
        self._garbage_ssm = [garbage(p) for p in self.ssm]
        self._garbage_conv = [garbage(p) for p in self.conv]
        self._garbage_windows = (
            [{name: garbage(getattr(w, name)) for name in ("k", "v", "a", "b")} for w in self.windows]
            if self.windows is not None
            else None
        )
        live = torch.arange(1, self.num_blocks, device=dev)
        self.fill_garbage([live] * cfg.groups)

    def row_blocks(self, row: int) -> List[torch.Tensor]:
        """The blocks of batch row `row` in each group (its S columns)."""
        return [t[row, : self.S].long() for t in self.block_tables]

    def fill_garbage(self, blocks: List[torch.Tensor]) -> None:
        """Writes the run's garbage into `blocks` (one index tensor per group) of every layer:
        SSM and conv pools and, in replay mode, the window (k, v, a, b and a full length)."""
        for li in range(self.cfg.layers):
            b = blocks[self.cfg.group_of(li)]
            self.ssm[li].index_copy_(0, b, self._garbage_ssm[li].index_select(0, b))
            self.conv[li].index_copy_(0, b, self._garbage_conv[li].index_select(0, b))
            if self.windows is not None and self._garbage_windows is not None:
                w, bank = self.windows[li], self._garbage_windows[li]
                for name in ("k", "v", "a", "b"):
                    getattr(w, name)[b] = bank[name][b]
                w.len[b] = self.S

    def release(self, row: int) -> None:
        """A request finished on batch row `row`: its blocks in every group are free again, and
        hold garbage until the next request's state is written there."""
        self.fill_garbage(self.row_blocks(row))

    def zero_blocks(self, group: int, blocks: torch.Tensor) -> None:
        """A zero state in `blocks` (indices) of group `group`: the SSM and conv pools of every
        layer of the group. (A replay window needs no zeroing: a zero replay count reads none.)"""
        for li in range(self.cfg.layers):
            if self.cfg.group_of(li) == group:
                self.ssm[li].index_fill_(0, blocks, 0.0)
                self.conv[li].index_fill_(0, blocks, 0.0)


class Timer:
    """Time per category. Host regions use wall time; with `device_events` the GDN kernels are
    bracketed with CUDA events (resolved lazily), so their share is device time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.totals: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)  # kernel regions timed, per category
        self._pending: List = []

    @contextmanager
    def host(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] += time.perf_counter() - t0

    @contextmanager
    def kernel(self, name: str):
        self.calls[name] += 1
        if not self.cuda:
            with self.host(name):
                yield
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            yield
        finally:
            end.record()
            self._pending.append((name, start, end))

    def add_event_pairs(self, pairs) -> None:
        self._pending.extend(pairs)

    def resolve(self) -> None:
        if self._pending:
            torch.cuda.synchronize()
            for name, start, end in self._pending:
                self.totals[name] += start.elapsed_time(end) / 1000.0
            self._pending.clear()


@dataclass
class StepSlots:
    """Where a step's GDN kernels read and write, per group (device views into the metadata
    builder's persistent buffers)."""

    cu_seqlens: torch.Tensor  # [R + 1] token offsets of the rows
    state_indices: List[torch.Tensor]  # per group [R, S] (decode_mtp)
    conv_indices: List[torch.Tensor]  # per group [R] (column 0 of state_indices)
    num_accepted_tokens: Optional[torch.Tensor]  # [R] or None (all 1)
    # Replay verify (decode_mtp_replay): window tokens each row replays; the checkpoint block is
    # conv_indices' (column 0). None: write-every-token decode_mtp.
    replay_counts: Optional[torch.Tensor] = None
    # decode_mtp's accepted counts when they differ from the conv's (non-spec rows: 2, reading
    # column 1 of a [destination, source] row); None: num_accepted_tokens.
    decode_accepted: Optional[torch.Tensor] = None


@dataclass
class NonSpecRows:
    """Where a step's non-spec rows read and write, per group: ``destination`` is
    ``non_spec_state_indices``; ``source`` is ``non_spec_source_indices``, except for the fresh
    one-token rows (prefill rows without an initial state that run through decode_mtp), which read
    their zeroed destination. Fresh rows of more tokens keep the null source: the prefill calls
    start them from a zero state."""

    destination: List[torch.Tensor]
    source: List[torch.Tensor]
    fresh: np.ndarray  # positions (among the non-spec rows) of the zeroed fresh one-token rows
    query_start: np.ndarray  # [rows + 1] host copy of non_spec_query_start_loc
    has_initial_state: np.ndarray  # [rows] host copy

    def lengths(self) -> np.ndarray:
        return np.diff(self.query_start)

    def tables(self) -> List[torch.Tensor]:
        """Per group [rows, 2]: [destination, source]; with accepted count 2 decode_mtp reads
        column 1 and writes column 0."""
        return [torch.stack([d, s], 1) for d, s in zip(self.destination, self.source)]


class DecodePath:
    """Runs token rows through the model with persistent buffers (stable addresses, so the
    verify step can be captured in a CUDA graph)."""

    def __init__(self, model: TinyHybridGDN, cache: GDNCache, max_rows: int):
        cfg, dev = model.cfg, model.device
        self.model, self.cache, self.max_rows = model, cache, max_rows
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.h = torch.zeros(max_rows, cfg.hidden, device=dev)
        self.proj = torch.zeros(max_rows, cfg.proj_dim, device=dev)
        self.core = torch.zeros(max_rows, cfg.HV, cfg.V, device=dev)
        self.pred = torch.zeros(max_rows, dtype=torch.long, device=dev)
        self.twos = torch.full((max_rows,), 2, dtype=torch.int32, device=dev)
        self.fresh_rows = 0  # non-spec rows started from a zero state so far
        self.error_count = torch.zeros(1, dtype=torch.int32, device=dev) if dev.type == "cuda" else None

    def forward(self, rows: int, slots: StepSlots, timer: Optional[Timer], event_log=None) -> None:
        """Target forward over token rows [0, rows) of self.tokens; writes self.pred[:rows]
        (greedy next token after each row). `event_log`, when given, receives (name, start, end)
        CUDA events instead of `timer` (used while capturing a graph)."""
        decode_accepted = slots.num_accepted_tokens if slots.decode_accepted is None else slots.decode_accepted

        def gdn_part(li: int, layer, g: int, proj: torch.Tensor, core: torch.Tensor) -> None:
            self._gdn_layer(
                self._layer_calls(li, layer, proj),
                core,
                slots.cu_seqlens,
                slots.conv_indices[g],
                slots.state_indices[g],
                slots.num_accepted_tokens,
                decode_accepted,
                slots.replay_counts,
                timer,
                event_log,
            )

        self._run_layers(rows, gdn_part)

    def _run_layers(self, rows: int, gdn_part: Callable[[int, Any, int, torch.Tensor, torch.Tensor], None]) -> None:
        """The model over token rows [0, rows) of self.tokens, the greedy next token after each row
        to self.pred[:rows]: the embedding, then per layer its in_proj rows, ``gdn_part(layer
        index, layer, its group, in_proj rows, core)`` (writes the GDN core output to ``core``)
        and the residual out_proj."""
        m, cfg = self.model, self.model.cfg
        h, proj, core = self.h[:rows], self.proj[:rows], self.core[:rows]
        torch.index_select(m.embed, 0, self.tokens[:rows], out=h)
        for li, layer in enumerate(m.layers):
            proj.copy_(exact_linear(exact_rms_norm(h, layer["norm"]), layer["in_proj"]))
            gdn_part(li, layer, cfg.group_of(li), proj, core)
            h.add_(exact_linear(core.view(rows, cfg.HV * cfg.V), layer["out_proj"]))
        torch.argmax(m.logits(h), dim=-1, out=self.pred[:rows])

    def non_spec_rows(self, md, timer: Timer) -> NonSpecRows:
        """The step's non-spec rows as an engine following vLLM's split consumes them, from the
        metadata alone: the ``md.num_decodes`` leading rows are decodes and read
        ``non_spec_source_indices``; the rows after them are prefills. A prefill row whose
        ``has_initial_state`` is False starts from a zero state: with one token (it runs through
        decode_mtp) its destination blocks (``non_spec_state_indices``) are zeroed in every layer
        of each group before the layers run, and it reads them (the metadata gives it no
        source); with more tokens (a prefill call) it passes a null initial slot instead, so
        nothing is zeroed. Prefill rows with an initial state read their source."""
        n, host = md.non_spec_rows, md.host
        destination = [md.non_spec_state_indices[g][:n] for g in range(self.model.cfg.groups)]
        source = [md.non_spec_source_indices[g][:n] for g in range(self.model.cfg.groups)]
        if n == 0:
            empty = np.zeros(0, np.int64)
            return NonSpecRows(destination, source, empty, np.zeros(1, np.int64), np.zeros(0, bool))
        # Host copies of the plan (no device sync): query lengths and has_initial_state.
        qsl = np.asarray(host.non_spec_query_start_loc)[: n + 1].astype(np.int64)
        initial = np.asarray(host.has_initial_state)[:n].astype(bool)
        lengths = np.diff(qsl)
        prefill = np.arange(n) >= md.num_decodes
        fresh = np.flatnonzero(prefill & (lengths == 1) & ~initial)
        # Rows the prefill calls start from a null initial slot (no zeroing needed).
        self.fresh_rows += int(np.count_nonzero((lengths > 1) & ~initial))
        if len(fresh):
            with timer.host("zeroing"):
                rows = torch.from_numpy(fresh).to(destination[0].device)
                for g, (d, s) in enumerate(zip(destination, source)):
                    blocks = d.index_select(0, rows)
                    self.cache.zero_blocks(g, blocks.long())
                    source[g] = s.index_copy(0, rows, blocks)
            self.fresh_rows += len(fresh)
        return NonSpecRows(destination, source, fresh, qsl, initial)

    def _gdn_layer(
        self,
        calls: LayerCalls,
        out: torch.Tensor,
        cu_seqlens,
        column0,
        state_indices,
        conv_accepted,
        decode_accepted,
        replay_counts,
        timer: Optional[Timer],
        event_log=None,
    ) -> None:
        """A GDN layer's calls over its token rows: the conv update in place (conv state in each
        row's column-0 block), then decode_mtp over `state_indices` or, with `replay_counts`,
        replay verify with the column-0 block as the checkpoint; core output to `out`."""
        with self._region(timer, event_log, "conv"):
            # In place: the post-conv activations overwrite the raw q|k|v columns.
            gdn.causal_conv1d_update(
                *calls.conv,
                column0,
                cu_seqlens,
                calls.mixed_qkv,
                num_accepted_tokens=conv_accepted,
                **calls.conv_options,
            )
        if replay_counts is not None:
            assert calls.window is not None, "replay counts need a replay cache"
            with self._region(timer, event_log, "replay"):
                w = calls.window  # window_k, window_v, window_a, window_b, window_len
                gdn.decode_mtp_replay(
                    *calls.ssm,
                    column0,
                    cu_seqlens,
                    out,
                    w.k,
                    w.v,
                    w.a,
                    w.b,
                    w.len,
                    num_accepted_tokens=replay_counts,
                    **calls.ssm_options,
                )
        else:
            with self._region(timer, event_log, "decode_mtp"):
                gdn.decode_mtp(
                    *calls.ssm, state_indices, cu_seqlens, out, num_accepted_tokens=decode_accepted, **calls.ssm_options
                )

    def forward_mixed(self, rows: int, md, replay_counts, timer: Timer) -> None:
        """Target forward over a step mixing spec rows (T tokens), one-token non-spec rows (a
        request that drafted nothing this step, a decode, or a prompt fed token by token) and
        prefill rows (non-spec rows of more than one token: whole prompts), in request order (not
        captured in a graph). The GDN layers run each kind on its own gathered token rows, as an
        engine following vLLM's split does: spec rows read column acc - 1 of their state rows
        (decode_mtp does it); one-token non-spec rows read ``non_spec_source_indices`` (where the
        previous step left the state) and write ``non_spec_state_indices`` (column 0); prefill
        rows run one gdn.causal_conv1d_prefill and one gdn.prefill call per layer, from
        ``non_spec_source_indices`` (a null id when ``has_initial_state`` is False) to
        ``non_spec_state_indices``. With replay verify (`replay_counts`: a host array, tokens each
        request replays) the spec and one-token rows use their column-0 block as the
        checkpoint; the prefill calls write the state after the prompt to it (the window stays
        empty). Conv state lives in column 0 for every kind. Fresh one-token rows (see
        :meth:`non_spec_rows`) start from their zeroed destination and replay nothing."""
        cfg, dev = self.model.cfg, self.h.device
        kinds = []  # per kind of row: its token rows, offsets, counts and per-group slots
        if md.num_spec_decodes > 0:
            n = md.num_spec_decodes
            acc = md.spec_num_accepted[:n]
            requests = np.asarray(md.host.spec_request_index)[:n]
            tables = [md.spec_state_indices[g][:n] for g in range(cfg.groups)]
            kinds.append(
                dict(
                    kind="spec",
                    idx=md.spec_token_indx.long(),
                    cu=md.spec_query_start_loc[: n + 1],
                    tables=tables,
                    column0=[t[:, 0].contiguous() for t in tables],
                    conv_acc=acc,
                    decode_acc=acc,
                    replay=None
                    if replay_counts is None
                    else torch.from_numpy(replay_counts[requests].astype(np.int32)).to(dev),
                )
            )
        if md.non_spec_rows > 0 and md.num_non_spec_tokens > 0:
            kinds += self._non_spec_kinds(md, replay_counts, timer)

        def gdn_part(li: int, layer, g: int, proj: torch.Tensor, core: torch.Tensor) -> None:
            for k in kinds:
                # This kind's token rows, contiguous.
                calls = self._layer_calls(li, layer, proj.index_select(0, k["idx"]))
                out = torch.empty(len(k["idx"]), cfg.HV, cfg.V, device=dev)
                if k["kind"] == "prefill":
                    self._gdn_prefill_layer(
                        calls, out, k["cu"], k["conv_initial"][g], k["ssm_initial"][g], k["final"][g], timer
                    )
                else:
                    self._gdn_layer(
                        calls,
                        out,
                        k["cu"],
                        k["column0"][g],
                        k["tables"][g],
                        k["conv_acc"],
                        k["decode_acc"],
                        k["replay"],
                        timer,
                    )
                core.index_copy_(0, k["idx"], out)

        self._run_layers(rows, gdn_part)

    def _non_spec_kinds(self, md, replay_counts, timer: Timer) -> List[dict]:
        """The step's non-spec rows split into one-token rows (decode_mtp / replay) and prefill
        rows (more than one token: the prefill calls), each with its token rows and slots."""
        dev = self.h.device
        ns = self.non_spec_rows(md, timer)
        n = md.non_spec_rows
        lengths, qsl = ns.lengths(), ns.query_start
        tokens = md.non_spec_token_indx.long()  # the non-spec rows' token rows, in row order
        requests = np.asarray(md.host.non_spec_request_index)[:n]
        replay = None if replay_counts is None else replay_counts[requests].astype(np.int32)
        if replay is not None:
            replay[ns.fresh] = 0  # no state yet: nothing in the window to replay
        kinds = []
        one = np.flatnonzero(lengths == 1)
        if len(one):
            sel = torch.from_numpy(one).to(dev)
            acc = (md.non_spec_source_column[:n] + 1).to(torch.int32).index_select(0, sel)
            # A 1-token row of two columns reads column acc - 1 = 1 (the source) and writes
            # column 0 (the destination).
            kinds.append(
                dict(
                    kind="one",
                    idx=tokens.index_select(0, torch.from_numpy(qsl[one]).to(dev)),
                    cu=torch.arange(len(one) + 1, dtype=torch.int32, device=dev),
                    tables=[t.index_select(0, sel) for t in ns.tables()],
                    column0=[d.index_select(0, sel).contiguous() for d in ns.destination],
                    conv_acc=acc,
                    decode_acc=torch.full_like(acc, 2),
                    replay=None if replay is None else torch.from_numpy(replay[one]).to(dev),
                )
            )
        pre = np.flatnonzero(lengths > 1)
        if len(pre):
            initial = ns.has_initial_state[pre]
            # The conv prefill reads a request's history where causal_conv1d_update reads it with
            # an accepted count of 1, and the prefill call cannot replay a window first. The demo
            # prefills every prompt whole in the step that admits it, so its prefill rows are
            # fresh; a continuation would need its state in column 0 with nothing to replay.
            column = np.asarray(md.host.non_spec_source_column)[:n][pre]
            if np.any(initial & (column != 0)) or (replay is not None and np.any(initial & (replay[pre] != 0))):
                raise RuntimeError("a prefill row continues a state that is not in its column 0 (not in this demo)")
            sel = torch.from_numpy(pre).to(dev)
            has_initial = torch.from_numpy(initial).to(dev)
            null = torch.full((len(pre),), NULL_BLOCK, dtype=torch.int32, device=dev)
            final = [d.index_select(0, sel) for d in ns.destination]
            rows = np.concatenate([np.arange(qsl[j], qsl[j + 1]) for j in pre])
            kinds.append(
                dict(
                    kind="prefill",
                    idx=tokens.index_select(0, torch.from_numpy(rows).to(dev)),
                    cu=torch.from_numpy(np.concatenate([[0], np.cumsum(lengths[pre])]).astype(np.int32)).to(dev),
                    # SSM: non_spec_source_indices (a null id without an initial state);
                    # conv: its history lives in the destination block (column 0).
                    ssm_initial=[torch.where(has_initial, s.index_select(0, sel), null) for s in ns.source],
                    conv_initial=[torch.where(has_initial, f, null) for f in final],
                    final=final,
                )
            )
        return kinds

    def _gdn_prefill_layer(
        self,
        calls: LayerCalls,
        out: torch.Tensor,
        cu_seqlens,
        conv_initial,
        ssm_initial,
        final,
        timer: Optional[Timer],
    ) -> None:
        """A GDN layer's calls over the prefill rows' token rows: one gdn.causal_conv1d_prefill
        call in place (history from `conv_initial`, the last W - 1 inputs to `final`, where the
        next causal_conv1d_update reads them), then one gdn.prefill call from the states in
        `ssm_initial` (null: a zero state) to `final`; core output to `out`."""
        with self._region(timer, None, "conv"):
            gdn.causal_conv1d_prefill(
                *calls.conv, conv_initial, final, cu_seqlens, calls.mixed_qkv, **calls.conv_options
            )
        with self._region(timer, None, "prefill"):
            gdn.prefill(*calls.ssm, ssm_initial, final, cu_seqlens, out, **calls.ssm_options)

    def _layer_calls(self, li: int, layer, proj: torch.Tensor) -> LayerCalls:
        """GDN layer `li`'s call arguments over its in_proj output rows `proj` (views, in the
        column order in_proj writes them)."""
        cfg = self.model.cfg
        D, HVV = cfg.conv_dim, cfg.HV * cfg.V
        mixed_qkv = proj[:, :D]
        z = proj[:, D : D + HVV].unflatten(1, (cfg.HV, cfg.V))
        b = proj[:, D + HVV : D + HVV + cfg.HV]
        a = proj[:, D + HVV + cfg.HV :]
        null_and_errors = dict(first_valid_slot=NULL_BLOCK + 1, error_count=self.error_count)
        return LayerCalls(
            mixed_qkv=mixed_qkv,
            conv=(mixed_qkv, layer["conv_w"], self.cache.conv[li]),
            conv_options=dict(state_layout=self.cache.conv_layout, **null_and_errors),
            ssm=(mixed_qkv, a, b, layer["A_log"], layer["dt_bias"], self.cache.ssm[li]),
            ssm_options=dict(z=z, norm_weight=layer["gnorm"], **null_and_errors),
            window=None if self.cache.windows is None else self.cache.windows[li],
        )

    @staticmethod
    @contextmanager
    def _region(timer: Optional[Timer], event_log, name: str):
        if event_log is None:
            if timer is None:  # not timed (a graph capture without event support)
                yield
                return
            with timer.kernel(name):
                yield
            return
        start = torch.cuda.Event(enable_timing=True, external=True)
        end = torch.cuda.Event(enable_timing=True, external=True)
        start.record()
        yield
        end.record()
        event_log.append((name, start, end))

    def check_device_errors(self) -> None:
        if self.error_count is not None and int(self.error_count.item()) != 0:
            raise RuntimeError(f"GDN kernels reported {int(self.error_count.item())} invalid rows")


def tokens_per_second(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.0f} tok/s" if seconds > 0 else "n/a"


def fmt_seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


__all__ = [
    "ModelConfig",
    "TinyHybridGDN",
    "exact_linear",
    "exact_rms_norm",
    "GDNCache",
    "Timer",
    "StepSlots",
    "NonSpecRows",
    "DecodePath",
    "NULL_BLOCK",
    "tokens_per_second",
    "fmt_seconds",
]
