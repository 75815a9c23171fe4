"""FLA-compatible forms of :func:`gdn.decode_mtp` and :func:`gdn.prefill`.

``fused_recurrent_gated_delta_rule`` and ``chunk_gated_delta_rule`` take the arguments of
flash-linear-attention's functions of those names (fla-core 0.6.0,
``fla.ops.gated_delta_rule``) and return what they return, ``(o, final_state)``, so that code
calling FLA switches with one import::

    from gdn.compat.fla import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

The gate and beta conventions map onto the kernels' input options, not onto rewritten inputs:
``g`` in log space (``use_gate_in_kernel=False``) is ``a`` with ``a_is_log_decay=True``; a raw
``g`` with ``use_gate_in_kernel=True`` is ``a`` with ``A_log`` and ``dt_bias`` as the model layer
uses them; ``beta`` after the sigmoid (``use_beta_sigmoid_in_kernel=False``) is ``b`` with
``b_is_beta=True``; ``use_qk_l2norm_in_kernel`` is ``qk_l2_norm`` (epsilon 1e-6 inside the square
root, as FLA's kernels add it). FLA's layout ``[N, HV, K, V]`` is libgdn's ``"kv"``;
``state_v_first=True`` (``[N, HV, V, K]``) is ``"vk"``, libgdn's fast CUDA layout. FLA fuses no
output norm: the calls run without ``norm_weight`` (``o`` is the core output).

Differences, all documented on each function:

- q, k and v are copied into one packed ``[L, 2*H*K + HV*V]`` array (libgdn reads the post-conv
  ``mixed_qkv`` row); the final state, as in FLA, is a freshly allocated float32 array (an
  ``initial_state`` given with ``output_final_state=True`` is copied into it).
- Per-channel decays (``gk``, ``gv``), per-element beta (``beta`` of ``v``'s rank) and context
  parallelism (``cp_context``) are not implemented: they raise ``NotImplementedError``.
- q and k stay float32 after the L2 norm and the softplus is exact; FLA's chunked path rounds the
  normalised q, k to the input dtype and its gate uses approximate exp2 / log2, so results agree to
  those roundings, not bit for bit.
- Forward only: the outputs carry no autograd graph.
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from .. import can_use_decode_mtp, decode_mtp, prefill

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]

_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# ---- argument mapping ----------------------------------------------------------------------------


def _options(kwargs: dict, state_v_first: bool, function: str) -> bool:
    """``state_v_first`` after FLA's deprecated spelling ``transpose_state_layout``; refuses any
    other unknown keyword (FLA swallows them into ``**kwargs``, where a typo would go unnoticed)."""
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError(f"{function}: pass state_v_first or transpose_state_layout, not both")
        state_v_first = bool(kwargs.pop("transpose_state_layout"))
    if "head_first" in kwargs:
        raise ValueError(f"{function}: head_first is not supported; inputs are [B, T, H, ...] as in FLA")
    if kwargs:
        raise TypeError(f"{function}: unexpected keyword argument(s) {sorted(kwargs)}")
    return state_v_first


def _dims(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, function: str) -> Tuple[int, int, int, int, int, int]:
    """(B, T, H, K, HV, V) from q, k [B, T, H, K] and v [B, T, HV, V]."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{function}: {name} must be a 4-d torch tensor [B, T, heads, dim]")
    if q.shape != k.shape:
        raise ValueError(f"{function}: q {list(q.shape)} and k {list(k.shape)} must have one shape [B, T, H, K]")
    B, T, H, K = q.shape
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"{function}: v {list(v.shape)} must be [B, T, HV, V] with q's B = {B}, T = {T}")
    HV, V = v.shape[2], v.shape[3]
    if H == 0 or HV % H != 0:
        raise ValueError(f"{function}: value heads HV = {HV} must be a multiple of the q/k heads H = {H}")
    return B, T, H, K, HV, V


def _activation(x: torch.Tensor, name: str, function: str) -> torch.Tensor:
    if x.dtype not in _ACTIVATION_DTYPES:
        raise ValueError(f"{function}: {name} has dtype {x.dtype}; libgdn takes float32, bfloat16 or float16")
    return x


def _packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, L: int, function: str) -> torch.Tensor:
    """q | k | v as libgdn's [L, 2*H*K + HV*V] row (one copy), in the dtype all three convert to
    exactly."""
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    _activation(torch.empty(0, dtype=dtype), "q, k, v (promoted)", function)
    return torch.cat([x.reshape(L, -1).to(dtype) for x in (q, k, v)], dim=1)


def _per_token(x: torch.Tensor, name: str, B: int, T: int, HV: int, L: int, v_rank: int, function: str) -> torch.Tensor:
    """g or beta [B, T, HV] as an [L, HV] view (a copy only where the strides need one)."""
    if x.dim() == v_rank:
        raise NotImplementedError(
            f"{function}: {name} of shape {list(x.shape)} (one value per value channel) is not "
            f"supported; libgdn takes one {name} per token and value head, [B, T, HV]"
        )
    if tuple(x.shape) != (B, T, HV):
        raise ValueError(f"{function}: {name} must be [B, T, HV] = {[B, T, HV]}, got {list(x.shape)}")
    return _activation(x, name, function).reshape(L, HV)


class _Gates(NamedTuple):
    """A libgdn call's gate arrays, in its argument order."""

    a: torch.Tensor
    b: torch.Tensor
    A_log: Optional[torch.Tensor]
    dt_bias: Optional[torch.Tensor]


def _gates(
    g: Optional[torch.Tensor],
    beta: Optional[torch.Tensor],
    *,
    use_gate_in_kernel: bool,
    A_log: Optional[torch.Tensor],
    dt_bias: Optional[torch.Tensor],
    use_beta_sigmoid_in_kernel: bool,
    allow_neg_eigval: bool,
    shape: Tuple[int, int, int, int],
    ref: torch.Tensor,
    function: str,
) -> Tuple["_Gates", Dict[str, bool]]:
    """(a, b, A_log, dt_bias; the input options) for FLA's gate arguments."""
    B, T, HV, L = shape
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{function}: allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True, as in FLA")
    device, f32 = ref.device, torch.float32
    if g is None:  # no decay: g = 0
        if use_gate_in_kernel:
            raise ValueError(f"{function}: use_gate_in_kernel=True needs g (the raw gate input)")
        a = torch.zeros(L, HV, device=device, dtype=f32)
    else:
        a = _per_token(g, "g", B, T, HV, L, 4, function)
    if use_gate_in_kernel:
        if A_log is None:
            raise ValueError(f"{function}: use_gate_in_kernel=True needs A_log")
        A_log = A_log.reshape(-1)
        dt_bias = torch.zeros(HV, device=device, dtype=f32) if dt_bias is None else dt_bias.reshape(-1)
    else:  # g is the log-decay itself; FLA ignores A_log and dt_bias then
        A_log = dt_bias = None
    if beta is None:  # FLA's default: ones (before its optional sigmoid)
        b = torch.ones(L, HV, device=device, dtype=f32)
    else:
        b = _per_token(beta, "beta", B, T, HV, L, 4, function)
    b_is_beta = not use_beta_sigmoid_in_kernel
    if allow_neg_eigval:  # beta = 2 sigmoid(beta): libgdn's kernels have no doubled-beta mode
        b, b_is_beta = 2.0 * torch.sigmoid(b.float()), True
    options = dict(a_is_log_decay=not use_gate_in_kernel, b_is_beta=b_is_beta)
    return _Gates(a, b, A_log, dt_bias), options


class _Call(NamedTuple):
    """An FLA call mapped onto libgdn's arguments."""

    dims: Tuple[int, int, int, int, int, int]  # B, T, H, K, HV, V
    N: int  # sequences
    cu: torch.Tensor  # cu_seqlens on the device
    mixed_qkv: torch.Tensor  # [L, 2*H*K + HV*V]
    gates: "_Gates"  # a, b, A_log, dt_bias
    keywords: Dict[str, Any]  # scale, l2_eps, state_layout and the input options


def _map_call(fn, q, k, v, g, beta, *, scale, cu_seqlens, state_v_first, use_qk_l2norm_in_kernel, **gates) -> _Call:
    """Checks q, k, v and maps FLA's arguments (``gates``: use_gate_in_kernel, A_log, dt_bias,
    use_beta_sigmoid_in_kernel, allow_neg_eigval) onto a libgdn call's."""
    B, T, H, K, HV, V = _dims(q, k, v, fn)
    L = B * T
    N, cu = _sequences(cu_seqlens, B, T, q.device, fn)
    positional, options = _gates(g, beta, shape=(B, T, HV, L), ref=q, function=fn, **gates)
    keywords = dict(
        scale=scale,
        l2_eps=1e-6,
        state_layout="vk" if state_v_first else "kv",
        qk_l2_norm=bool(use_qk_l2norm_in_kernel),
        **options,
    )
    return _Call((B, T, H, K, HV, V), N, cu, _packed_qkv(q, k, v, L, fn), positional, keywords)


def _sequences(
    cu_seqlens: Optional[torch.Tensor], B: int, T: int, device: torch.device, function: str
) -> Tuple[int, torch.Tensor]:
    """(N, cu_seqlens on the device) for FLA's dense ([B, T]) or varlen (B = 1, cu_seqlens) form."""
    if cu_seqlens is None:
        return B, torch.arange(0, (B + 1) * T, T, device=device, dtype=torch.int64)[: B + 1]
    if B != 1:
        raise ValueError(f"{function}: with cu_seqlens the batch size must be 1 (packed sequences), got B = {B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{function}: cu_seqlens must be [N + 1], got shape {list(cu_seqlens.shape)}")
    return cu_seqlens.numel() - 1, cu_seqlens.to(device).contiguous()


def _state_shape(N: int, HV: int, K: int, V: int, state_v_first: bool) -> Tuple[int, int, int, int]:
    return (N, HV, V, K) if state_v_first else (N, HV, K, V)


def _check_initial(initial_state: torch.Tensor, shape: Tuple[int, ...], state_v_first: bool, function: str) -> None:
    if tuple(initial_state.shape) != shape:
        layout = "[N, HV, V, K] (state_v_first)" if state_v_first else "[N, HV, K, V]"
        raise ValueError(f"{function}: initial_state must be {layout} = {list(shape)}, got {list(initial_state.shape)}")


def _host_lengths(cu_seqlens: Optional[torch.Tensor], N: int, T: int) -> List[int]:
    """Tokens per sequence, on the host (reading a device cu_seqlens synchronises)."""
    if cu_seqlens is None:
        return [T] * N
    cu = [int(x) for x in cu_seqlens.tolist()]
    return [cu[i + 1] - cu[i] for i in range(N)]


# ---- fused recurrent ------------------------------------------------------------------------------


def fused_recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: Optional[torch.Tensor] = None,
    gk: Optional[torch.Tensor] = None,
    gv: Optional[torch.Tensor] = None,
    beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    *,
    ssm_state_indices: Optional[torch.Tensor] = None,
    num_accepted_tokens: Optional[torch.Tensor] = None,
    **kwargs: Any,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``fused_recurrent_gated_delta_rule`` (fla-core 0.6.0) on :func:`gdn.decode_mtp`.

    Per sequence and value head, from the initial state (zeros without ``initial_state``), token by
    token: q, k L2-normalised when ``use_qk_l2norm_in_kernel`` (``x / sqrt(sum(x^2) + 1e-6)``), q
    times ``scale`` (default K ** -0.5); with S the head's state, ``S = exp(g) S``, then the
    delta-rule write with ``beta`` and the output ``o = S q`` from the updated state. Value head hv
    uses q/k head ``hv // (HV // H)``.

    Arguments (FLA's names, order and defaults):

    - ``q``, ``k`` [B, T, H, K]; ``v`` [B, T, HV, V] (HV a multiple of H); float32, bfloat16 or
      float16. With ``cu_seqlens``, B = 1 and the N sequences are packed along T.
    - ``g`` [B, T, HV] or None (no decay): the log-decay, or with ``use_gate_in_kernel=True`` the
      raw gate input, ``g = -exp(A_log) * softplus(g + dt_bias)``. ``gk``, ``gv`` (per-channel
      decays): not implemented, ``NotImplementedError``.
    - ``beta`` [B, T, HV] or None (ones): beta, or its logit with
      ``use_beta_sigmoid_in_kernel=True``; ``allow_neg_eigval=True`` doubles the sigmoid (computed
      here, in float32). A per-channel beta [B, T, HV, V] is not implemented.
    - ``scale``: q scale, None for K ** -0.5.
    - ``initial_state`` [N, HV, K, V] (``[N, HV, V, K]`` with ``state_v_first``) or None (zeros).
    - ``output_final_state``: return the state after each sequence's last token, a new float32
      array in the layout of ``initial_state``; else None.
    - ``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``, ``A_log`` [HV], ``dt_bias`` [HV] or None
      (zero), ``use_beta_sigmoid_in_kernel``, ``allow_neg_eigval``, ``state_v_first`` (also
      accepted under FLA's deprecated name ``transpose_state_layout``): as above.
    - ``cu_seqlens`` [N + 1] or None: sequence i owns tokens ``cu_seqlens[i]:cu_seqlens[i+1]`` of
      the packed T.

    Serving extension (keyword-only; not in FLA's GDN function, the semantics of its KDA kernel and
    of vLLM's copy): with ``ssm_state_indices``, ``initial_state`` is a slot pool
    [slots, HV, K, V] (``[slots, HV, V, K]`` with ``state_v_first``; float32, bfloat16 or
    float16) updated in place and returned as ``final_state``:

    - ``ssm_state_indices`` [N]: sequence i reads its state from slot ``ssm_state_indices[i]`` and
      writes the state after its last token there;
    - ``ssm_state_indices`` [N, S] with ``num_accepted_tokens`` [N] (or None, all 1): the
      spec-decode verify form of :func:`gdn.decode_mtp`: the state is read from column
      ``num_accepted_tokens[i] - 1`` and the state after token t is written to column t
      (T_i <= S). Negative slot ids are null: their writes are skipped (a null source slot is an
      error, as in :func:`gdn.decode_mtp`). In the [N] form every id must be a slot of the pool.

    Returns ``(o, final_state)``: ``o`` [B, T, HV, V] in v's dtype; ``final_state`` as above or None.

    Differences from FLA: q, k and v are copied into one packed array (libgdn's ``mixed_qkv``
    row), and ``initial_state`` into the new final state; the normalised q, k, the gates and the
    state stay float32 and the softplus is exact (FLA's gate uses approximate exp2 / log2), so the
    results agree to float32 rounding. With ``cu_seqlens`` on a GPU the sequence lengths are read on
    the host (one synchronisation; FLA's kernel needs none). On CUDA, sequences longer than the
    fused kernel's 16 tokens per call (:func:`gdn.can_use_decode_mtp`) run through
    :func:`gdn.prefill`'s chunked kernel (bfloat16 operands, float32 state: within 2e-2 relative L2
    instead of float32 rounding). Forward only.
    """
    fn = "fused_recurrent_gated_delta_rule"
    state_v_first = _options(kwargs, state_v_first, fn)
    if gk is not None or gv is not None:
        raise NotImplementedError(f"{fn}: per-channel decays gk / gv are not supported; pass g [B, T, HV]")
    call = _map_call(
        fn, q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
    )  # fmt: skip
    B, T, H, K, HV, V = call.dims
    L, N, cu, mixed_qkv, positional, common = B * T, call.N, call.cu, call.mixed_qkv, call.gates, call.keywords
    o = torch.empty_like(_activation(v, "v", fn))
    out = o.view(L, HV, V)

    if ssm_state_indices is not None and ssm_state_indices.dim() == 2:  # the verify form
        if initial_state is None:
            raise ValueError(f"{fn}: ssm_state_indices needs initial_state (the slot pool)")
        if ssm_state_indices.shape[0] != N:
            raise ValueError(f"{fn}: ssm_state_indices must have N = {N} rows, got {list(ssm_state_indices.shape)}")
        decode_mtp(
            mixed_qkv,
            *positional,
            initial_state,
            ssm_state_indices.contiguous(),
            cu,
            out,
            num_accepted_tokens=num_accepted_tokens,
            **common,
        )
        return o, initial_state
    if num_accepted_tokens is not None:
        raise ValueError(f"{fn}: num_accepted_tokens needs ssm_state_indices [N, S]")

    if ssm_state_indices is not None:  # [N]: one slot per sequence, read and written in place
        if initial_state is None:
            raise ValueError(f"{fn}: ssm_state_indices needs initial_state (the slot pool)")
        if tuple(ssm_state_indices.shape) != (N,):
            raise ValueError(
                f"{fn}: ssm_state_indices must be [N] = [{N}] or [N, S], got {list(ssm_state_indices.shape)}"
            )
        pool, slots = initial_state, ssm_state_indices.to(q.device)
    else:  # FLA's form: a new float32 final state, starting from initial_state or zeros
        shape = _state_shape(N, HV, K, V, state_v_first)
        if initial_state is not None:
            _check_initial(initial_state, shape, state_v_first, fn)
            pool = initial_state.to(device=q.device, dtype=torch.float32, copy=True).contiguous()
        else:
            pool = torch.zeros(shape, device=q.device, dtype=torch.float32)
        slots = torch.arange(N, device=q.device, dtype=torch.int64)
    _run_to_final_slots(mixed_qkv, positional, pool, slots, cu, out, _host_lengths(cu_seqlens, N, T), H, common)
    final = pool if (ssm_state_indices is not None or output_final_state) else None
    return o, final


def _run_to_final_slots(
    mixed_qkv: torch.Tensor,
    positional: _Gates,
    pool: torch.Tensor,
    slots: torch.Tensor,
    cu: torch.Tensor,
    out: torch.Tensor,
    lengths: List[int],
    H: int,
    common: Dict[str, Any],
) -> None:
    """Runs every sequence i from slot ``slots[i]`` of ``pool`` and writes its state after its last
    token back there: one :func:`gdn.decode_mtp` call whose table holds each sequence's slot only
    in the column of its last token (read from there too: accepted count = its length), or, where
    the fused kernel does not take that many columns, :func:`gdn.prefill`."""
    N = len(lengths)
    S = max(lengths, default=0)
    if S == 0:
        return
    _, HV, d2, d3 = pool.shape
    K, V = (d3, d2) if common["state_layout"] == "vk" else (d2, d3)
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(pool.dtype, "float32")
    path, _ = can_use_decode_mtp(pool.device, H, HV, K, V, S, dtype, state_layout=common["state_layout"])
    if path == "unsupported":
        prefill(mixed_qkv, *positional, pool, slots, slots, cu, out, **common)
        return
    last = torch.tensor([max(t, 1) for t in lengths], dtype=torch.int64)
    table = torch.full((N, S), -1, dtype=torch.int64)
    table.scatter_(1, (last - 1).view(N, 1), slots.to("cpu", torch.int64).view(N, 1))
    decode_mtp(
        mixed_qkv,
        *positional,
        pool,
        table.to(pool.device),
        cu,
        out,
        num_accepted_tokens=last.to(pool.device),
        **common,
    )


# ---- chunked ----------------------------------------------------------------------------------------


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    cu_seqlens_cpu: Optional[torch.Tensor] = None,
    chunk_indices: Optional[torch.Tensor] = None,
    cp_context: Any = None,
    *,
    use_gate_in_kernel: bool = False,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    chunk_size: int = 64,
    **kwargs: Any,
) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FLA's ``chunk_gated_delta_rule`` (fla-core 0.6.0) on :func:`gdn.prefill`.

    The same recurrence as :func:`fused_recurrent_gated_delta_rule` (per sequence and value head,
    from ``initial_state`` or zeros: decay ``exp(g)``, the delta-rule write with ``beta``, output
    from the updated state), for prompts: any number of tokens per sequence.

    Arguments (FLA's names, order and defaults; ``use_gate_in_kernel``, ``A_log``, ``dt_bias`` and
    ``chunk_size`` are keywords, as FLA reads them from ``**kwargs``):

    - ``q``, ``k`` [B, T, H, K]; ``v`` [B, T, HV, V]; float32, bfloat16 or float16.
    - ``g`` [B, T, HV]: the log-decay, or the raw gate input with ``use_gate_in_kernel=True``
      (``g = -exp(A_log) * softplus(g + dt_bias)``, ``A_log`` [HV] required, ``dt_bias`` [HV] or
      None for zero).
    - ``beta`` [B, T, HV]: beta, or its logit with ``use_beta_sigmoid_in_kernel=True``;
      ``allow_neg_eigval=True`` doubles the sigmoid (computed here, in float32).
    - ``scale``: q scale, None for K ** -0.5. ``use_qk_l2norm_in_kernel``: L2-normalise q and k
      (``x / sqrt(sum(x^2) + 1e-6)``).
    - ``initial_state`` [N, HV, K, V] (``[N, HV, V, K]`` with ``state_v_first``, also accepted as
      ``transpose_state_layout``) or None (zeros); ``output_final_state``: return the final state.
    - ``cu_seqlens`` [N + 1] or None: packed sequences (B = 1). ``cu_seqlens_cpu`` and
      ``chunk_indices`` are accepted and not needed (libgdn plans nothing on the host);
      ``chunk_size`` (16, 32 or 64) is checked and otherwise unused. ``cp_context`` (context
      parallelism): not implemented.

    Returns ``(o, final_state)``: ``o`` [B, T, HV, V] in q's dtype; ``final_state`` a new float32
    array [N, HV, K, V] (``[N, HV, V, K]`` with ``state_v_first``) or None.

    Differences from FLA: q, k and v are copied into one packed array (libgdn's ``mixed_qkv``
    row); with ``output_final_state`` the initial state is copied into the new final state, which
    is updated in place. On the CPU the recurrence runs token by token in float32 (normalised q, k
    kept float32, exact softplus); FLA's chunked kernel rounds the normalised q, k to the input
    dtype and multiplies bfloat16 operands, as libgdn's CUDA path does (within 2e-2 relative L2 of
    the float64 recurrence). The CUDA path takes FLA's in-kernel conventions
    (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``, ``use_qk_l2norm_in_kernel`` all True,
    as Qwen3-Next layers call it); the others raise ``ValueError`` there until its kernel reads the
    input options. Forward only.
    """
    fn = "chunk_gated_delta_rule"
    state_v_first = _options(kwargs, state_v_first, fn)
    if cp_context is not None:
        raise NotImplementedError(f"{fn}: context parallelism (cp_context) is not supported")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"{fn}: chunk_size must be 16, 32 or 64, got {chunk_size}")
    if g is None or beta is None:
        raise ValueError(f"{fn}: g and beta are required")
    call = _map_call(
        fn, q, k, v, g, beta, scale=scale, cu_seqlens=cu_seqlens, state_v_first=state_v_first,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_gate_in_kernel=use_gate_in_kernel, A_log=A_log,
        dt_bias=dt_bias, use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
    )  # fmt: skip
    B, T, H, K, HV, V = call.dims
    L, N = B * T, call.N
    o = torch.empty(v.shape, dtype=_activation(q, "q", fn).dtype, device=q.device)
    shape = _state_shape(N, HV, K, V, state_v_first)
    slots = torch.arange(N, device=q.device, dtype=torch.int64)
    null = torch.full((N,), -1, device=q.device, dtype=torch.int64)
    if initial_state is not None:
        _check_initial(initial_state, shape, state_v_first, fn)
    if output_final_state:  # a sequence without tokens keeps its initial state (or zeros)
        pool = (
            torch.zeros(shape, device=q.device, dtype=torch.float32)
            if initial_state is None
            else initial_state.to(device=q.device, dtype=torch.float32, copy=True).contiguous()
        )
    elif initial_state is not None and initial_state.dtype in _ACTIVATION_DTYPES:
        pool = initial_state.contiguous()  # only read: no final slot is written
    elif initial_state is not None:
        pool = initial_state.to(torch.float32)
    else:
        pool = torch.empty((1, *shape[1:]), device=q.device, dtype=torch.float32)  # never touched
    initial = slots if initial_state is not None else null
    final = slots if output_final_state else null
    prefill(call.mixed_qkv, *call.gates, pool, initial, final, call.cu, o.view(L, HV, V), **call.keywords)
    return o, pool if output_final_state else None
