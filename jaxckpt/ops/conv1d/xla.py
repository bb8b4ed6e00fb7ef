"""Causal depthwise conv1d in plain JAX (XLA): outputs, final states and prefill checkpoints in one vectorised pass.

Every token's window is a gather from `concat(incoming states, x)` with computed indices, so rows, short rows and
the incoming state need no per-token loop, and the final and checkpoint states are gathers of the raw inputs
(bitwise copies, kept in x's dtype). Works under `jax.jit` with traced `cu_seqlens` / checkpoint arrays and is
differentiable with `jax.grad`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxckpt.ops.common.xla_arrays import check_float, compute_dtype, packed_metadata
from jaxckpt.plan.checks import conv_dims
from jaxckpt.plan.layout import searchsorted


def checkpoint_rows(checkpoint_cu, num_checkpoints: int, num_rows: int):
    """(row i32[M] clipped into range, valid bool[M]) of each CSR entry; padded entries are not valid."""
    ids = jnp.arange(num_checkpoints, dtype=jnp.int32)
    rows = searchsorted(jnp, checkpoint_cu, ids, side="right").astype(jnp.int32) - 1
    return jnp.clip(rows, 0, num_rows - 1), ids < checkpoint_cu[-1]


def differentiable(**call) -> bool:
    """Plain jnp/lax: JAX differentiates through every call (`jaxckpt.ops.common.api` wraps the kernels that it
    cannot)."""
    return True


@functools.partial(jax.jit, static_argnames=("activation",))
def causal_conv1d(x, weight, bias=None, *, activation="silu", initial_state=None, cu_seqlens=None,
                  checkpoint_cu=None, checkpoint_offsets=None):
    """Causal depthwise conv of packed rows with final and checkpoint states, vectorised over tokens.

    x [T, D]; weight [D, W] with W in 2..4; bias [D] (None = 0); activation None or "silu" ("swish" = silu);
    initial_state [N, D, W - 1] raw inputs before each row, oldest first (None = zeros); cu_seqlens i32[N + 1]
    (None = one row); checkpoint_cu i32[N + 1] + checkpoint_offsets i32[M] (CSR, offsets in (0, row_len)).

    Returns (y [T, D] in x.dtype, final_state [N, D, W - 1], checkpoint_states [M, D, W - 1]); the states are the
    W - 1 raw inputs before the row end / checkpoint offset, in x.dtype (an initial_state of another dtype is cast).
    Padding tokens past cu_seqlens[N] and padded checkpoint entries are zeros. Metadata values are not checked here
    (callers run `jaxckpt.plan.conventions.validate_*` on concrete metadata).
    """
    x = check_float(x, name="x")  # [T, D]
    weight = check_float(weight, name="weight")  # [D, W]
    bias = None if bias is None else check_float(bias, name="bias")  # [D]
    num_tokens, dim, width = conv_dims(x, weight, bias, activation=activation)
    cu, ccu, offsets = packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens)
    num_rows = cu.shape[0] - 1
    num_ckpt = offsets.shape[0]
    hist = width - 1
    state_shape = (num_rows, dim, hist)
    if initial_state is None:
        initial = jnp.zeros(state_shape, x.dtype)
    else:
        initial = check_float(initial_state, name="initial_state")
        if initial.shape != state_shape:
            raise ValueError(f"initial_state: expected [N, D, W - 1] = {state_shape}, got shape {initial.shape}")
        initial = initial.astype(x.dtype)

    # source[n * (W - 1) + s] is slot s of row n's incoming state; source[N * (W - 1) + t] is token t.
    source = jnp.concatenate([jnp.swapaxes(initial, 1, 2).reshape(num_rows * hist, dim), x])  # [N*(W-1) + T, D]
    taps = jnp.arange(hist, dtype=jnp.int32)

    def history(row, end):
        """Source indices of the W - 1 raw inputs before row position `end` of `row`, oldest first."""
        rel = end[..., None] - hist + taps  # row positions, negative ones live in the incoming state
        return jnp.where(rel >= 0, num_rows * hist + cu[row][..., None] + rel, row[..., None] * hist + hist + rel)

    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    token_row = jnp.clip(searchsorted(jnp, cu, tokens, side="right").astype(jnp.int32) - 1, 0, num_rows - 1)
    window = jnp.concatenate([source[history(token_row, tokens - cu[token_row])], x[:, None]], axis=1)  # [T, W, D]
    cdt = compute_dtype(x.dtype)
    y = jnp.sum(window.astype(cdt) * weight.T.astype(cdt), axis=1)  # [T, D]
    if bias is not None:
        y = y + bias.astype(cdt)
    if activation is not None:
        y = jax.nn.silu(y)
    y = jnp.where((tokens < cu[-1])[:, None], y, 0).astype(x.dtype)

    rows = jnp.arange(num_rows, dtype=jnp.int32)
    final_state = jnp.swapaxes(source[history(rows, cu[1:] - cu[:-1])], 1, 2)  # [N, D, W - 1]
    ckpt_row, ckpt_valid = checkpoint_rows(ccu, num_ckpt, num_rows)
    checkpoint_states = jnp.swapaxes(source[history(ckpt_row, offsets)], 1, 2)  # [M, D, W - 1]
    checkpoint_states = jnp.where(ckpt_valid[:, None, None], checkpoint_states, 0).astype(x.dtype)
    return y, final_state, checkpoint_states
