"""The GDN layer's depthwise causal conv: :func:`causal_conv1d_update` for decode and speculative
verify, :func:`causal_conv1d_prefill` for whole requests (prefill and chunked-prefill
continuations), and their float64 NumPy references :func:`causal_conv1d_update_reference` and
:func:`causal_conv1d_prefill_reference`, for tests.

Math and buffer rule: docs gdn-math.md §2.2 and §3.3; prefill: docs prefill.md §2.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._common import Buffer, Output, calls_binding, traced_as_torch_op

__all__ = [
    "causal_conv1d_prefill",
    "causal_conv1d_prefill_reference",
    "causal_conv1d_update",
    "causal_conv1d_update_reference",
]


@traced_as_torch_op
@calls_binding("causal_conv1d_update", stream_of="conv_state")
def causal_conv1d_update(
    x: Buffer,
    weight: Buffer,
    conv_state: Output,
    conv_state_indices: Buffer,
    cu_seqlens: Buffer,
    out: Output,
    *,
    num_accepted_tokens: Optional[Buffer] = None,
    activation: str = "silu",
    state_layout: str = "channels_major",
    first_valid_slot: int = 0,
    error_count: Optional[Output] = None,
    stream: Optional[int] = None,
) -> None:
    """Depthwise causal conv1d (width W, no bias) with speculative rollback of the conv state:
    updates ``conv_state`` in place and writes ``out``.

    Arguments (N requests, L token rows, D channels; arrays of any DLPack / buffer-protocol kind,
    writable, all on the device of ``conv_state``):

    - ``x`` [L, D], f32/bf16/f16: raw (pre-conv) q|k|v inputs; request i owns rows
      ``cu_seqlens[i]:cu_seqlens[i+1]`` (T_i tokens). Unit column stride, any row stride.
    - ``weight`` [D, W], f32/bf16/f16: conv taps, ``weight[c, W-1]`` multiplies the current token.
    - ``conv_state``, f32/bf16/f16: the slot pool of raw-input histories, updated in place;
      ``state_layout="channels_major"`` (default): [slots, D, Lbuf]; ``"tokens_major"``:
      [slots, Lbuf, D], with Lbuf = W - 1 + num_spec. Inner two dims contiguous; the slot stride
      may be larger.
    - ``conv_state_indices`` [N], int32/int64: each request's slot (any stride, e.g.
      ``state_indices[:, 0]``).
    - ``cu_seqlens`` [N + 1], int32/int64: token offsets of the requests in the L rows.
    - ``out`` [L, D]: the activated conv output; may be ``x`` itself (in place).
    - ``num_accepted_tokens`` [N] or None (all 1), int32/int64: the previous step's accepted
      count acc; the window is read at buffer offset acc - 1, and the buffer is rewritten so that
      the next call's offset acc' - 1 sees exactly the last W - 1 accepted inputs.
    - ``activation``: ``"silu"`` (or ``"swish"``) or ``"none"``.
    - ``state_layout``: ``"channels_major"`` or ``"tokens_major"``, as above.
    - ``first_valid_slot``: slot ids below it are null (default 0; vLLM passes 1).
    - ``error_count`` int32 [1] or None: on the GPU, incremented once per invalid request row.
    - ``stream``: CUDA stream handle; default torch's current stream for torch tensors.

    Mutated: ``conv_state`` (the requests' slots), ``out`` (the requests' token rows) and, on the
    GPU, ``error_count``. Rows with T = 0, and rows whose slot is null, are skipped: neither the
    pool nor their ``out`` rows are written (with ``out is x`` those rows keep their raw input).

    Errors: shape, dtype, stride and device mismatches raise ``ValueError`` naming the argument;
    a value the binding cannot take (a list, a read-only array, a meta tensor) raises
    ``TypeError`` naming it. Host arrays: the whole call is validated first and an invalid row
    (T > num_spec + 1, acc outside [1, num_spec + 1], slot >= pool size, bad ``cu_seqlens``)
    raises ``ValueError`` naming the row, before anything is written. CUDA arrays: invalid rows
    write no state, get zero outputs and increment ``error_count`` when given.

    Accuracy: float32 math (taps in ascending order). The pool is exact: it stores the raw
    inputs, rounded to its dtype; ``out`` is within its own dtype's rounding (+ 2e-6) of
    :func:`causal_conv1d_update_reference`. One T-token call equals T one-token calls bit for bit.
    ``torch.ops.gdn.causal_conv1d_update`` is the same call as a torch op (all but ``stream``;
    there ``out`` must not be ``x``).
    """


def causal_conv1d_update_reference(
    x,
    weight,
    conv_state,
    conv_state_indices,
    cu_seqlens,
    *,
    num_accepted_tokens=None,
    activation="silu",
    state_layout="channels_major",
    first_valid_slot=0,
    state_dtype=None,
):
    """Float64 reference of :func:`causal_conv1d_update` (gdn-math.md §7, conv pre-step).

    Returns ``(out [L, D] float64, new_state float64)``; rows no valid request covers are NaN.
    ``state_dtype`` (a NumPy-compatible rounding function or None) models a 16-bit pool: raw inputs
    entering the buffer are passed through it, as the kernels store them.
    """
    xs = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    pool = np.asarray(conv_state, dtype=np.float64).copy()
    if state_layout == "tokens_major":
        pool = pool.transpose(0, 2, 1).copy()  # work in [slots, D, Lbuf]
    D, W = w.shape
    Lbuf = pool.shape[2]
    S = Lbuf - W + 2
    idx = np.asarray(conv_state_indices, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    N = idx.shape[0]
    acc = np.ones(N, np.int64) if num_accepted_tokens is None else np.asarray(num_accepted_tokens, np.int64)
    rnd = (lambda v: v) if state_dtype is None else state_dtype
    out = np.full(xs.shape, np.nan)
    for i in range(N):
        T = int(cu[i + 1] - cu[i])
        slot = int(idx[i])
        if T == 0 or slot < first_valid_slot:
            continue
        assert T <= S and 1 <= acc[i] <= S and slot < pool.shape[0], f"invalid row {i}"
        off = int(acc[i]) - 1
        hist = pool[slot, :, off : off + W - 1].copy()  # [D, W-1]
        new = xs[cu[i] : cu[i + 1]].T  # [D, T]
        frame = np.concatenate([hist, rnd(new)], axis=1)  # taps over stored values
        for t in range(T):
            s = (w[:, : W - 1] * frame[:, t : t + W - 1]).sum(1) + w[:, W - 1] * new[:, t]
            out[cu[i] + t] = s / (1.0 + np.exp(-s)) if activation in ("silu", "swish") else s
        pool[slot, :, : W - 2] = hist[:, 1:]
        pool[slot, :, W - 2 : W - 2 + T] = rnd(new)
    if state_layout == "tokens_major":
        pool = pool.transpose(0, 2, 1)
    return out, pool


@traced_as_torch_op
@calls_binding("causal_conv1d_prefill", stream_of="conv_state")
def causal_conv1d_prefill(
    x: Buffer,
    weight: Buffer,
    conv_state: Output,
    initial_state_indices: Buffer,
    final_state_indices: Buffer,
    cu_seqlens: Buffer,
    out: Output,
    *,
    activation: str = "silu",
    state_layout: str = "channels_major",
    first_valid_slot: int = 0,
    error_count: Optional[Output] = None,
    stream: Optional[int] = None,
) -> None:
    """Depthwise causal conv1d (width W, no bias) over whole requests, the prefill counterpart of
    :func:`causal_conv1d_update`: reads each request's history from its initial slot of
    ``conv_state``, writes ``out`` and each request's last W - 1 inputs to its final slot.

    Arguments (N requests, L token rows, D channels; arrays of any DLPack / buffer-protocol kind,
    writable, all on the device of ``conv_state``):

    - ``x`` [L, D], f32/bf16/f16: raw (pre-conv) q|k|v inputs; request i owns rows
      ``cu_seqlens[i]:cu_seqlens[i+1]`` (T_i tokens, any number; 0 = a padded row). Unit column
      stride, any row stride.
    - ``weight`` [D, W], f32/bf16/f16: conv taps, ``weight[c, W-1]`` multiplies the current token.
    - ``conv_state``, f32/bf16/f16: the slot pool of raw-input histories, as for
      :func:`causal_conv1d_update`: ``state_layout="channels_major"`` (default): [slots, D, Lbuf];
      ``"tokens_major"``: [slots, Lbuf, D], with Lbuf = W - 1 + num_spec >= W - 1. Inner two dims
      contiguous; the slot stride may be larger.
    - ``initial_state_indices`` [N], int32/int64, any stride: the slot each request's history is
      read from, at buffer columns 0 .. W - 2 (where :func:`causal_conv1d_update` reads it with an
      accepted count of 1). A null id (below ``first_valid_slot``) reads zeros: a new request.
    - ``final_state_indices`` [N], int32/int64, any stride: the slot each request's last W - 1
      inputs go to; may equal the initial slot (in place). A null id writes no state (the outputs
      are still produced).
    - ``cu_seqlens`` [N + 1], int32/int64, contiguous: token offsets of the requests in the L rows.
    - ``out`` [L, D], f32/bf16/f16: the activated conv output; may be ``x`` itself (in place).
    - ``activation``: ``"silu"`` (or ``"swish"``) or ``"none"``.
    - ``state_layout``: ``"channels_major"`` or ``"tokens_major"``, as above.
    - ``first_valid_slot``: slot ids below it are null (default 0, so negative ids are null; vLLM
      passes 1).
    - ``error_count`` int32 [1] or None: on the GPU, incremented once per invalid request row.
    - ``stream``: CUDA stream handle; default torch's current stream for torch tensors, CuPy's for
      CuPy arrays, else the legacy default stream. Ignored on the CPU.

    Per request and channel c, with H = W - 1, ``hist`` the initial slot's columns 0 .. H - 1
    (zeros for a null id) and ``F = [hist | s(x_0) .. s(x_{T-1})]``, where s(v) is v as the pool
    stores it (rounded to its dtype): ``out[t] = act(sum_{j<H} weight[c, j] * F[t + j] +
    weight[c, H] * x_t)`` in float32 (taps in ascending order); the final slot's columns
    0 .. H - 1 get ``F[T .. T + H - 1]`` (the last H inputs, history included when T < H) and its
    columns H .. Lbuf - 1 the initial slot's (zeros for a null id; untouched when the two slots
    are one). That is exactly the buffer T one-token :func:`causal_conv1d_update` calls leave: the
    next update (accepted count 1) continues from it as if every token had gone through it.

    Mutated: ``conv_state`` (the requests' final slots), ``out`` (the requests' token rows) and, on
    the GPU, ``error_count``. Rows no request covers are not written; nor, with ``out is x``, are
    the raw inputs of padded rows. Two requests writing one slot, or one request's final slot
    being another's initial slot, leave the order of their reads and writes undefined.

    Errors: shape, dtype, stride and device mismatches raise ``ValueError`` naming the argument;
    a value the binding cannot take (a list, a read-only array, a meta tensor) raises
    ``TypeError`` naming it. Host arrays: the whole call is validated first and an invalid row (a
    slot id >= the pool's slot count, a bad ``cu_seqlens`` range) raises ``ValueError`` naming the
    row and the argument, before anything is written. CUDA arrays: invalid rows write no state,
    get zero outputs and increment ``error_count`` when given.

    Accuracy: float32 math. The pool is exact (raw inputs rounded to its dtype); ``out`` is within
    its own dtype's rounding (+ 2e-6) of :func:`causal_conv1d_prefill_reference`. On the CPU a
    prefill equals one-token :func:`causal_conv1d_update` calls bit for bit (outputs and buffer);
    the CUDA kernel (tiles of tokens x channels, so long requests run at memory bandwidth) does
    too, against the CUDA update. ``torch.ops.gdn.causal_conv1d_prefill`` is the same call as a
    torch op (all but ``stream``; there ``out`` must not be ``x``).
    """


def causal_conv1d_prefill_reference(
    x,
    weight,
    conv_state,
    initial_state_indices,
    final_state_indices,
    cu_seqlens,
    *,
    activation="silu",
    state_layout="channels_major",
    first_valid_slot=0,
    state_dtype=None,
):
    """Float64 reference of :func:`causal_conv1d_prefill`, token by token.

    Returns ``(out [L, D] float64, new_state float64)``; rows no request covers are NaN. Initial
    slots are read from ``conv_state`` as given (requests must not read a slot another writes).
    ``state_dtype`` (a NumPy-compatible rounding function or None) models a 16-bit pool: raw
    inputs entering the buffer are passed through it, as the kernels store them.
    """
    xs = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    before = np.asarray(conv_state, dtype=np.float64)
    if state_layout == "tokens_major":
        before = before.transpose(0, 2, 1)  # work in [slots, D, Lbuf]
    pool = before.copy()
    D, W = w.shape
    H = W - 1
    init = np.asarray(initial_state_indices, dtype=np.int64)
    fin = np.asarray(final_state_indices, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    rnd = (lambda v: v) if state_dtype is None else state_dtype
    out = np.full(xs.shape, np.nan)
    for i in range(init.shape[0]):
        b, e = int(cu[i]), int(cu[i + 1])
        if e == b:
            continue
        assert 0 <= b <= e <= xs.shape[0], f"invalid row {i}"
        assert init[i] < pool.shape[0] and fin[i] < pool.shape[0], f"invalid row {i}"
        buf = before[init[i]] if init[i] >= first_valid_slot else np.zeros(before.shape[1:])
        window = buf[:, :H].copy()  # [D, H], oldest first
        for t in range(b, e):
            s = (w[:, :H] * window).sum(1) + w[:, H] * xs[t]
            out[t] = s / (1.0 + np.exp(-s)) if activation in ("silu", "swish") else s
            window = np.concatenate([window[:, 1:], rnd(xs[t])[:, None]], axis=1)
        if fin[i] >= first_valid_slot:
            pool[fin[i], :, :H] = window
            pool[fin[i], :, H:] = buf[:, H:]
    if state_layout == "tokens_major":
        pool = pool.transpose(0, 2, 1)
    return out, pool
