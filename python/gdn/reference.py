"""Float64 NumPy reference of decode_mtp (docs gdn-math.md §7), for self-checks and users' tests.

Slow and obvious on purpose: loops over requests and tokens, vectorised over value heads.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def _f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def decode_mtp_reference(
    mixed_qkv, a, b, A_log, dt_bias, state, state_indices, cu_seqlens, *, z=None,
    norm_weight=None, num_accepted_tokens=None, scale: Optional[float] = None, l2_eps=1e-6,
    norm_eps=1e-6, gate="silu", state_layout="vk", first_valid_slot=0,
):
    """Returns (out [L, HV, V], new_state [slots, HV, ...] float64), leaving the inputs untouched.

    `state` uses the given layout ("vk": [slots, HV, V, K]; "kv": [slots, HV, K, V]). Rows of `out`
    that no request covers are NaN.
    """
    x = _f64(mixed_qkv)
    pool = _f64(state).copy()
    if state_layout == "kv":
        pool = pool.transpose(0, 1, 3, 2).copy()  # work in [slots, HV, V, K]
    _, HV, V, K = pool.shape
    H = (x.shape[1] - HV * V) // (2 * K)
    r = HV // H
    scale = K ** -0.5 if scale is None else scale
    idx = np.asarray(state_indices, dtype=np.int64)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    N, S = idx.shape
    acc = np.ones(N, np.int64) if num_accepted_tokens is None else np.asarray(num_accepted_tokens, np.int64)
    A = -np.exp(_f64(A_log))
    dtb = _f64(dt_bias)
    out = np.full((x.shape[0], HV, V), np.nan)
    kh = np.arange(HV) // r
    for i in range(N):
        T = int(cu[i + 1] - cu[i])
        if T == 0:
            continue
        M = pool[idx[i, acc[i] - 1]].copy()  # [HV, V, K], read before any write
        for t in range(T):
            row = x[cu[i] + t]
            q = row[: H * K].reshape(H, K)[kh]
            k = row[H * K: 2 * H * K].reshape(H, K)[kh]
            v = row[2 * H * K:].reshape(HV, V)
            q = q / np.sqrt((q * q).sum(-1, keepdims=True) + l2_eps) * scale
            k = k / np.sqrt((k * k).sum(-1, keepdims=True) + l2_eps)
            xa = _f64(a)[cu[i] + t] + dtb
            sp = np.where(xa > 20, xa, np.log1p(np.exp(np.minimum(xa, 20))))
            alpha = np.exp(A * sp)
            beta = 1.0 / (1.0 + np.exp(-_f64(b)[cu[i] + t]))
            M = M * alpha[:, None, None]
            u = np.einsum("hvk,hk->hv", M, k)
            delta = beta[:, None] * (v - u)
            M = M + delta[:, :, None] * k[:, None, :]
            o = np.einsum("hvk,hk->hv", M, q)
            if norm_weight is not None:
                o = o / np.sqrt((o * o).mean(-1, keepdims=True) + norm_eps) * _f64(norm_weight)
                if z is not None:
                    zz = _f64(z)[cu[i] + t]
                    o = o * (zz / (1 + np.exp(-zz)) if gate == "silu" else 1 / (1 + np.exp(-zz)))
            out[cu[i] + t] = o
            if idx[i, t] >= first_valid_slot:
                pool[idx[i, t]] = M
    if state_layout == "kv":
        pool = pool.transpose(0, 1, 3, 2)
    return out, pool
