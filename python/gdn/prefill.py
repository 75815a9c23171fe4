"""prefill: many tokens of many requests through the GDN recurrence in one call (prompts and
chunked-prefill continuations), and its float64 reference :func:`prefill_reference`.

Contract: docs prefill.md §1. The per-token math is :func:`gdn.decode_mtp`'s.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ._common import Input, Output, calls_binding, traced_as_torch_op
from .decode_mtp import decode_mtp_reference

__all__ = ["prefill", "prefill_reference"]


@traced_as_torch_op
@calls_binding("prefill", stream_of="state")
def prefill(
    mixed_qkv: Input,
    a: Input,
    b: Input,
    A_log: Optional[Input],
    dt_bias: Optional[Input],
    state: Output,
    initial_state_indices: Input,
    final_state_indices: Input,
    cu_seqlens: Input,
    out: Output,
    *,
    z: Optional[Input] = None,
    norm_weight: Optional[Input] = None,
    scale: Optional[float] = None,
    l2_eps: float = 1e-6,
    norm_eps: float = 1e-6,
    gate: str = "silu",
    state_layout: str = "vk",
    first_valid_slot: int = 0,
    num_k_heads: int = 0,
    a_is_log_decay: bool = False,
    b_is_beta: bool = False,
    qk_l2_norm: bool = True,
    checkpoint_indices: Optional[Input] = None,
    checkpoint_every: int = 0,
    error_count: Optional[Output] = None,
    stream: Optional[int] = None,
) -> None:
    """GDN prefill: runs every request's tokens from the state in its initial slot, writes ``out``
    for every token, the state after the request's last token to its final slot and, optionally,
    checkpoints of the state every ``checkpoint_every`` tokens.

    For each of N requests and each value head the call runs the gated delta rule over the
    request's tokens, exactly as :func:`gdn.decode_mtp` run one token at a time would. Per token:
    q, k L2-normalised (``x * rsqrt(sum(x^2) + l2_eps)``), q times ``scale``;
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; with M the head's [V, K]
    state: ``M = exp(g) M``, ``M += beta (v - M k) k^T``, ``o = M q``; then
    ``out = o * rsqrt(mean(o^2) + norm_eps) * norm_weight * act(z)``. The options
    ``a_is_log_decay`` (g = a), ``b_is_beta`` (beta = b) and ``qk_l2_norm=False`` (no L2 norm)
    change what ``a``, ``b``, q and k hold.

    Sizes: L token rows, N requests (each any number of tokens), H key heads, HV value heads (a
    multiple of H), K key / V value head dims, C checkpoint columns. Arrays are any DLPack or
    buffer-protocol arrays (torch, NumPy, CuPy, JAX, ...), all on the device of ``state``.

    Arguments (dtypes: f32 = float32, bf16, f16; strides in elements):

    - ``mixed_qkv`` [L, 2*H*K + HV*V], f32/bf16/f16: post-conv q | k | v, head-major (the output of
      :func:`gdn.causal_conv1d_prefill`). Unit column stride, any row stride.
    - ``a``, ``b`` [L, HV], f32/bf16/f16: decay and beta pre-activations. Unit column stride, any
      row stride.
    - ``A_log``, ``dt_bias`` [HV], f32/bf16/f16, contiguous; None only with ``a_is_log_decay``.
    - ``state``: the slot pool, f32/bf16/f16, updated in place. ``state_layout="vk"`` (default):
      [slots, HV, V, K] (K contiguous, vLLM's layout); ``"kv"``: [slots, HV, K, V]. The inner three
      dims contiguous; the slot stride may be larger.
    - ``initial_state_indices`` [N], int32/int64, any stride: the slot each request's state is read
      from. A null id (below ``first_valid_slot``) starts from a zero state (a new request).
    - ``final_state_indices`` [N], int32/int64, any stride: the slot the state after the request's
      last token is written to; may equal the initial slot (in place). A null id writes no state.
    - ``cu_seqlens`` [N + 1], int32/int64, contiguous: request i owns token rows
      ``cu_seqlens[i]:cu_seqlens[i+1]`` (T_i tokens; 0 = a padded row, nothing read or written).
    - ``out`` [L, HV, V], f32/bf16/f16, contiguous: written, never read.
    - ``z`` [L, HV, V] or None, f32/bf16/f16, unit stride on V: the output gate input. Needs
      ``norm_weight``.
    - ``norm_weight`` [V] or None, f32/bf16/f16, contiguous: the RMSNorm weight (used as is, not
      1 + w). None: ``out = o`` (no norm, no gate).
    - ``scale``: q scale, None for K ** -0.5. ``l2_eps``, ``norm_eps``: the q/k L2-norm and RMSNorm
      epsilons.
    - ``gate``: activation of ``z``, ``"silu"`` (or ``"swish"``) or ``"sigmoid"``.
    - ``state_layout``: ``"vk"`` or ``"kv"``, as above.
    - ``first_valid_slot``: slot ids below it are null (default 0, so negative ids are null; vLLM
      passes 1).
    - ``num_k_heads``: H, checked against the ``mixed_qkv`` width; 0 derives it from the width.
    - ``a_is_log_decay``, ``b_is_beta``, ``qk_l2_norm``: as in :func:`gdn.decode_mtp`:
      ``a_is_log_decay=True`` reads ``a`` as the log-decay g itself (``A_log``, ``dt_bias`` unread,
      may be None), ``b_is_beta=True`` reads ``b`` as beta itself, ``qk_l2_norm=False`` uses q and
      k as given (q still times ``scale``). Both paths implement them.
    - ``checkpoint_indices`` [N, C] or None, int32/int64, any strides: with ``checkpoint_every`` =
      E > 0 (a positive multiple of 64), the state after token (j + 1) * E - 1 of request i
      (counted from its first row in this call) is written to slot ``checkpoint_indices[i, j]``
      (prefix caching at block boundaries, vLLM's "align" mode). Null ids are skipped; columns past
      the request's length are ignored; a request crossing more than C boundaries is refused.
    - ``checkpoint_every``: E above; 0 (default) without checkpoints.
    - ``error_count`` int32 [1] or None: on the GPU, incremented once per invalid request row.
    - ``stream``: CUDA stream handle for CUDA arrays; default torch's current stream for torch
      tensors, CuPy's for CuPy arrays, else the legacy default stream. Ignored on the CPU.

    Slots read and written, per request i with T_i > 0: the initial state is read completely
    before anything is written; the state stays float32 for the whole request and is rounded to
    the pool's dtype only where it is stored (checkpoints and the final slot). No other slot
    changes. Two requests writing one slot is the caller's bug; a request's final slot may be
    another request's initial slot only if the order of the two is irrelevant to the caller (it
    is undefined).

    Mutated: ``state`` (the final and checkpoint slots), ``out`` (the requests' token rows) and, on
    the GPU, ``error_count``. The other arguments are only read; nothing is returned.

    Errors. Every shape, dtype, stride and device mismatch raises ``ValueError`` naming the
    argument before anything runs (``checkpoint_every`` not a positive multiple of 64 with
    ``checkpoint_indices``, or set without it, included); a value the binding cannot take (a list,
    a read-only ``out``, a meta tensor, a string) raises ``TypeError`` naming the argument and what
    it got. A request row is invalid when its ``cu_seqlens`` range is not inside [0, L), a slot id
    (initial, final, or a checkpoint it reaches) is >= the pool's slot count, or it crosses more
    checkpoint boundaries than ``checkpoint_indices`` has columns. CPU (or host-visible index
    arrays): the whole call is validated first and an invalid row raises ``ValueError`` naming the
    row and the argument, before anything is written. GPU (indices in device memory, no host
    sync): an invalid row writes no state, its ``out`` rows are zero-filled and ``error_count``
    (when given) is incremented.

    Accuracy: all math runs in float32. On the CPU, with an fp32 pool, a request's outputs, final
    state and checkpoints equal :func:`gdn.decode_mtp` run one token at a time bit for bit; against
    :func:`prefill_reference` (float64) fp32 state and activations stay within 1e-4 relative L2 on
    ``out`` and every written state over a thousand tokens; 16-bit activations add the rounding of
    ``out``, a 16-bit pool the rounding of the stored states. The CUDA kernel (the chunked form of
    docs prefill.md §3) multiplies bf16 operands with float32 accumulation and keeps the state in
    float32: within 2e-2 relative L2 of the reference (about 5e-3 on random inputs). With more
    (request, value head) pairs than half the SMs and requests of 512 tokens or more on average
    (token budget / requests) it runs as one kernel and needs no workspace, where the device holds
    that kernel's shared memory (Hopper); otherwise in two or three launches
    with a device workspace of about 2 KB per token and value head (C++:
    ``cuda_api::prefill_workspace_bytes``), allocated stream-ordered for the call (by torch's
    allocator for the torch op).
    ``torch.ops.gdn.prefill`` is the same call as a torch custom op (all but ``stream``).
    """


def _f64(x):
    return None if x is None else np.asarray(x, dtype=np.float64)


def prefill_reference(
    mixed_qkv,
    a,
    b,
    A_log,
    dt_bias,
    state,
    initial_state_indices,
    final_state_indices,
    cu_seqlens,
    *,
    z=None,
    norm_weight=None,
    scale: Optional[float] = None,
    l2_eps=1e-6,
    norm_eps=1e-6,
    gate="silu",
    state_layout="vk",
    first_valid_slot=0,
    checkpoint_indices=None,
    checkpoint_every=0,
    a_is_log_decay=False,
    b_is_beta=False,
    qk_l2_norm=True,
):
    """Float64 reference of :func:`prefill`: each request's tokens go one at a time through
    :func:`gdn.reference.decode_mtp_reference` (the float64 decode step) from its initial state,
    the state never rounded. Takes NumPy-convertible host arrays and valid input; leaves the inputs
    untouched. Initial slots are read from ``state`` as given (requests must not read a slot
    another request writes).

    Returns ``(out [L, HV, V], new_state)`` as float64, ``new_state`` in the layout of ``state``;
    rows of ``out`` no request covers are NaN.
    """
    x, av, bv, zv = _f64(mixed_qkv), _f64(a), _f64(b), _f64(z)
    before = _f64(state)
    pool = before.copy()
    init = np.asarray(initial_state_indices, dtype=np.int64)
    fin = np.asarray(final_state_indices, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    ckpt = None if checkpoint_indices is None else np.asarray(checkpoint_indices, dtype=np.int64)
    HV, V = pool.shape[1], pool.shape[2] if state_layout == "vk" else pool.shape[3]
    out = np.full((x.shape[0], HV, V), np.nan)
    one_row = np.zeros((1, 1), np.int64)
    one_request = np.array([0, 1], np.int64)
    step = dict(
        norm_weight=norm_weight,
        scale=scale,
        l2_eps=l2_eps,
        norm_eps=norm_eps,
        gate=gate,
        state_layout=state_layout,
        a_is_log_decay=a_is_log_decay,
        b_is_beta=b_is_beta,
        qk_l2_norm=qk_l2_norm,
    )
    for i in range(init.shape[0]):
        b0, e0 = int(cu[i]), int(cu[i + 1])
        if e0 == b0:
            continue
        scratch = (before[init[i]] if init[i] >= first_valid_slot else np.zeros(before.shape[1:]))[None]
        for t in range(b0, e0):
            o, scratch = decode_mtp_reference(
                x[t : t + 1],
                av[t : t + 1],
                bv[t : t + 1],
                A_log,
                dt_bias,
                scratch,
                one_row,
                one_request,
                z=None if zv is None else zv[t : t + 1],
                **step,
            )
            out[t] = o[0]
            done = t - b0 + 1
            if ckpt is not None and checkpoint_every > 0 and done % checkpoint_every == 0:
                slot = ckpt[i, done // checkpoint_every - 1]
                if slot >= first_valid_slot:
                    pool[slot] = scratch[0]
        if fin[i] >= first_valid_slot:
            pool[fin[i]] = scratch[0]
    return out, pool
