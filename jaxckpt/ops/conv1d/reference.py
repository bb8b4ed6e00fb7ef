"""Causal depthwise conv1d in float64, token by token: the ground truth for every conv1d implementation."""

from __future__ import annotations

import numpy as np

from jaxckpt.plan.checks import conv_dims, to_float64
from jaxckpt.plan.conventions import validate_checkpoints, validate_cu_seqlens


def _silu(v: np.ndarray) -> np.ndarray:
    # exp(-|v|) never overflows; both branches are the exact logistic function.
    e = np.exp(-np.abs(v))
    return v * np.where(v >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


def causal_conv1d(x, weight, bias=None, *, activation="silu", initial_state=None, cu_seqlens=None,
                  checkpoint_cu=None, checkpoint_offsets=None):
    """Runs the causal depthwise conv of every row token by token in float64.

    x [T, D]; weight [D, W] with W in 2..4; bias [D] (None = 0); activation None or "silu" ("swish" = silu);
    initial_state [N, D, W - 1] raw inputs before each row, oldest first (None = zeros).

    Returns (y [T, D], final_state [N, D, W - 1], checkpoint_states [M, D, W - 1]) in float64: the states are the
    W - 1 raw inputs before the row end / before each checkpoint offset. Padding tokens past cu_seqlens[N] and
    padded checkpoint entries are zeros.
    """
    x = to_float64(x, name="x")  # [T, D]
    weight = to_float64(weight, name="weight")  # [D, W]
    bias = None if bias is None else to_float64(bias, name="bias")  # [D]
    num_tokens, dim, width = conv_dims(x, weight, bias, activation=activation)
    bias = np.zeros(dim) if bias is None else bias
    cu = validate_cu_seqlens(cu_seqlens, num_tokens)  # i32[N + 1]
    num_rows = cu.size - 1
    ccu, offsets = validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu)  # i32[N + 1], i32[M]
    state_shape = (num_rows, dim, width - 1)
    if initial_state is None:
        initial = np.zeros(state_shape)
    else:
        initial = to_float64(initial_state, name="initial_state")  # [N, D, W - 1]
        if initial.shape != state_shape:
            raise ValueError(f"initial_state: expected [N, D, W - 1] = {state_shape}, got shape {initial.shape}")

    y = np.zeros_like(x)
    final_state = np.zeros(state_shape)
    checkpoint_states = np.zeros((offsets.size, dim, width - 1))
    for n in range(num_rows):
        start, end = int(cu[n]), int(cu[n + 1])
        # history[i] is row position i - (W - 1): the incoming state covers the positions before the row start.
        history = np.concatenate([initial[n].T, x[start:end]])  # [W - 1 + len, D]
        for t in range(end - start):
            window = history[t:t + width]  # [W, D] oldest first
            y[start + t] = bias + np.sum(weight.T * window, axis=0)
        for m in range(ccu[n], ccu[n + 1]):
            p = int(offsets[m])
            checkpoint_states[m] = history[p:p + width - 1].T
        final_state[n] = history[end - start:].T
    if activation is not None:
        y = _silu(y)
    return y, final_state, checkpoint_states
