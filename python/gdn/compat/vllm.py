"""vLLM-compatible form of :func:`gdn.decode_mtp`.

``fused_gdn_decode_post_conv_mtp`` takes the arguments in the order of vLLM's
``_custom_ops.fused_gdn_decode_post_conv_mtp`` and follows its conventions: slot id 0 is vLLM's
reserved null block (ids <= 0 are null, i.e. ``first_valid_slot = 1``), the state pool is
``[slots, HV, V, K]`` (K contiguous), q/k are L2-normalised in the kernel with eps 1e-6, and the
filled ``out`` is returned.

Differences that only make results more exact or calls safer: the core output ``o`` enters the
gated RMSNorm in fp32 (vLLM rounds it to the output dtype first; ``vllm_numerics=True`` does the
same, for tests that compare against vLLM's reference at its tolerance); fp16 state and any activation dtype are
accepted; a request row with T > S, an accepted count outside [1, S] or a slot id past the pool is
treated as invalid (its state untouched, its output rows zero) instead of being read out of range.

CUDA-graph padding, as vLLM's kernel handles it: ``out`` may have more rows than ``mixed_qkv``, and
``mixed_qkv`` more rows than ``cu_seqlens[-1]`` tokens; every ``out`` row past the live tokens is
zeroed. :func:`gdn.decode_mtp` itself writes exactly the rows ``cu_seqlens`` covers and never
touches the others (a padded row there costs no write); this form adds the zeroing, an extra
fill of ``out``'s padded rows (on the device a masked fill, since ``cu_seqlens[-1]`` is only known
there).
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import ops as _ops  # noqa: F401  (registers torch.ops.gdn.decode_mtp)


def fused_gdn_decode_post_conv_mtp(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_accepted_tokens: Optional[torch.Tensor],
    state: torch.Tensor,
    output_gate: Optional[torch.Tensor],
    norm_weight: Optional[torch.Tensor],
    out: torch.Tensor,
    scale: float,
    norm_eps: float = 1e-5,
    output_gate_activation: str = "silu",
    vllm_numerics: bool = False,
) -> torch.Tensor:
    """Fused GDN verify step with vLLM's signature; updates ``state`` in place, returns ``out``.

    Args (vLLM names): ``mixed_qkv`` [L, 2*H*K + HV*V] post-conv activations (any row stride);
    ``a``, ``b`` [L, HV]; ``A_log``, ``dt_bias`` [HV]; ``state_indices`` [N, S] slot per verify
    position (<= 0: null); ``cu_seqlens`` [N + 1]; ``num_accepted_tokens`` [N] (1..S);
    ``state`` [slots, HV, V, K] pool; ``output_gate`` (z) [L, HV, V]; ``norm_weight`` [V];
    ``out`` [L_out >= L, HV, V] (rows past the live tokens are zeroed); ``scale`` (K ** -0.5);
    ``norm_eps`` (vLLM's layers use 1e-5, the default here; :func:`gdn.decode_mtp` defaults to
    1e-6); ``output_gate_activation`` "silu" or "sigmoid"; ``vllm_numerics``: round the core
    output to ``out``'s dtype before the norm, as vLLM does (default False keeps it fp32, more
    exact).
    """
    if output_gate is not None and norm_weight is None:
        raise ValueError("output_gate needs norm_weight (the gate is applied inside the gated RMSNorm)")
    L = mixed_qkv.shape[0]
    if out.dim() != 3 or out.shape[0] < L:
        raise ValueError(f"out must be [L_out >= L = {L} (rows of mixed_qkv), HV, V], got shape {list(out.shape)}")
    torch.ops.gdn.decode_mtp(
        mixed_qkv,
        a,
        b,
        A_log,
        dt_bias,
        state,
        state_indices,
        cu_seqlens,
        out[:L],
        z=output_gate,
        norm_weight=norm_weight,
        num_accepted_tokens=num_accepted_tokens,
        scale=float(scale),
        l2_eps=1e-6,
        norm_eps=float(norm_eps),
        gate=output_gate_activation,
        state_layout="vk",
        first_valid_slot=1,
        round_core_output=bool(vllm_numerics),
    )
    _zero_padded_rows(out, L, cu_seqlens)
    return out


def _zero_padded_rows(out: torch.Tensor, L: int, cu_seqlens: torch.Tensor) -> None:
    """Zeroes out's rows past the live tokens: [cu_seqlens[-1], L) and [L, L_out)."""
    if out.shape[0] > L:
        out[L:].zero_()
    if cu_seqlens.device.type == "cpu":
        out[int(cu_seqlens[-1]) : L].zero_()
    else:  # the live token count stays on the device: no synchronisation
        rows = torch.arange(L, device=out.device, dtype=cu_seqlens.dtype)
        out[:L].masked_fill_((rows >= cu_seqlens[-1]).view(L, 1, 1), 0)


__all__ = ["fused_gdn_decode_post_conv_mtp"]
