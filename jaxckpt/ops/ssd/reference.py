"""Mamba2 SSD in float64, token by token: the ground truth every SSD implementation is checked against."""

from __future__ import annotations

import numpy as np

from jaxckpt.plan.checks import check_dt_limit, check_ssd_state, ssd_dims, to_float64
from jaxckpt.plan.conventions import check_state_layout, validate_checkpoints, validate_cu_seqlens

# mamba_ssm's `_chunk_cumsum_fwd` returns dt itself above this threshold instead of softplus(dt).
_SOFTPLUS_THRESHOLD = 20.0


def _softplus(v: np.ndarray) -> np.ndarray:
    return np.where(v > _SOFTPLUS_THRESHOLD, v, np.log1p(np.exp(np.minimum(v, _SOFTPLUS_THRESHOLD))))


def _silu(v: np.ndarray) -> np.ndarray:
    # exp(-|v|) never overflows; both branches are the exact logistic function.
    e = np.exp(-np.abs(v))
    return v * np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def ssd(x, dt, A, B, C, *, D=None, dt_bias=None, z=None, dt_limit=None, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="vk"):
    """Runs the SSD recurrence of every row token by token in float64.

    x [T, H, P]; dt [T, H] raw (delta = softplus(dt + dt_bias), then clamped to dt_limit = (lo, hi) when given);
    A [H]; B, C [T, G, N] with G dividing H (head h reads group h // (H // G)); D [H] or [H, P] (None = 0);
    z [T, H, P] gate (y * silu(z)); initial_state [N_rows, H, P, N] ("vk") or [N_rows, H, N, P] ("kv"), None = zeros.

    Returns (y [T, H, P], final_state [N_rows, H, P, N], checkpoint_states [M, H, P, N]) in float64 (states
    [.., H, N, P] for "kv"). Padding tokens past cu_seqlens[N] and padded checkpoint entries are zeros.
    """
    check_state_layout(state_layout)
    x = to_float64(x, name="x")  # [T, H, P]
    dt = to_float64(dt, name="dt")  # [T, H]
    A = to_float64(A, name="A")  # [H]
    B = to_float64(B, name="B")  # [T, G, N]
    C = to_float64(C, name="C")  # [T, G, N]
    D = None if D is None else to_float64(D, name="D")  # [H] or [H, P]
    dt_bias = None if dt_bias is None else to_float64(dt_bias, name="dt_bias")  # [H]
    z = None if z is None else to_float64(z, name="z")  # [T, H, P]
    dims = ssd_dims(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z)
    num_tokens, num_heads, head_dim, num_groups, state_dim = dims
    D = np.zeros((num_heads, head_dim)) if D is None else np.broadcast_to(D.reshape(num_heads, -1),
                                                                          (num_heads, head_dim))
    dt_bias = np.zeros(num_heads) if dt_bias is None else dt_bias
    limit = check_dt_limit(dt_limit)
    cu = validate_cu_seqlens(cu_seqlens, num_tokens)  # i32[N + 1]
    num_rows = cu.size - 1
    ccu, offsets = validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu)  # i32[N + 1], i32[M]
    if initial_state is None:
        initial = np.zeros((num_rows, num_heads, head_dim, state_dim))
    else:
        initial = to_float64(initial_state, name="initial_state")
        check_ssd_state(initial, dims, num_rows, state_layout)
        if state_layout == "kv":
            initial = np.swapaxes(initial, -1, -2)

    delta = _softplus(dt + dt_bias)  # [T, H]
    if limit is not None:
        delta = np.clip(delta, *limit)
    decay = np.exp(delta * A)  # [T, H]
    B_heads = np.repeat(B, num_heads // num_groups, axis=1)  # [T, H, N]
    C_heads = np.repeat(C, num_heads // num_groups, axis=1)  # [T, H, N]

    y = np.zeros_like(x)
    final_state = np.zeros((num_rows, num_heads, head_dim, state_dim))
    checkpoint_states = np.zeros((offsets.size, num_heads, head_dim, state_dim))
    for n in range(num_rows):
        start, end = int(cu[n]), int(cu[n + 1])
        entry_at = {int(offsets[m]): m for m in range(ccu[n], ccu[n + 1])}
        state = initial[n].copy()  # [H, P, N]
        for t in range(start, end):
            if t - start in entry_at:
                checkpoint_states[entry_at[t - start]] = state
            update = (delta[t, :, None] * x[t])[:, :, None] * B_heads[t, :, None, :]  # [H, P, N]
            state = decay[t, :, None, None] * state + update
            y[t] = np.einsum("hpn,hn->hp", state, C_heads[t]) + D * x[t]
        final_state[n] = state
    if z is not None:
        y = y * _silu(z)
    if state_layout == "kv":
        final_state = np.swapaxes(final_state, -1, -2).copy()
        checkpoint_states = np.swapaxes(checkpoint_states, -1, -2).copy()
    return y, final_state, checkpoint_states
