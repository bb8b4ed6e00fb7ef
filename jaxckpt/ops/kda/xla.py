"""Kimi Delta Attention (KDA), chunk-parallel in plain jnp/lax: the portable implementation, differentiable,
jit-friendly with traced varlen and checkpoint metadata. The algorithm and its performance notes are in
`jaxckpt/ops/common/delta_chunk.py`; the math and the gate in README.md beside this file."""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from jaxckpt.ops.common.delta_chunk import check_static, chunked_delta_rule

LOWER_BOUND_RANGE = (-5.0, 0.0)
_STATIC = ("scale", "use_qk_l2norm", "state_layout", "chunk_size", "checkpoint_method", "lower_bound",
           "state_pass")


def _check_gate(g, *, A_log, dt_bias, lower_bound):
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise ValueError(f"g: dtype must be floating point, got {g.dtype}")
    if g.ndim != 3:
        raise ValueError(f"g: expected [T, HV, K], got shape {g.shape}")
    _, num_v_heads, head_k = g.shape
    if lower_bound is not None:
        low, high = LOWER_BOUND_RANGE
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, numbers.Real) \
                or not math.isfinite(lower_bound) or not low <= lower_bound < high:
            raise ValueError(f"lower_bound: must be a Python number in [{low:g}, {high:g}), got {lower_bound!r}")
    if A_log is None and lower_bound is None and dt_bias is not None:
        raise ValueError("dt_bias: only used with A_log or lower_bound; without them g is the log decay itself")
    if dt_bias is not None:
        if not jnp.issubdtype(dt_bias.dtype, jnp.floating):
            raise ValueError(f"dt_bias: dtype must be floating point, got {dt_bias.dtype}")
        if dt_bias.shape not in ((num_v_heads, head_k), (num_v_heads * head_k,)):
            raise ValueError(f"dt_bias: expected [HV, K] = {(num_v_heads, head_k)} or [HV * K] = "
                             f"({num_v_heads * head_k},), got shape {dt_bias.shape}")
    if A_log is not None:
        if not jnp.issubdtype(A_log.dtype, jnp.floating):
            raise ValueError(f"A_log: dtype must be floating point, got {A_log.dtype}")
        if A_log.shape != (num_v_heads,):
            raise ValueError(f"A_log: expected [HV] = ({num_v_heads},), got shape {A_log.shape}")


def kda_gate(g, *, A_log=None, dt_bias=None, lower_bound=None):
    """Per-key-channel log decay fp32 [T, HV, K] from the raw gate g [T, HV, K] (formulas as `reference.kda_gate`).

    A_log None, lower_bound None:  g itself (dt_bias must be None)
    A_log [HV], lower_bound None:  -exp(A_log[h]) * softplus(g + dt_bias[h, c])      (released Kimi-Linear)
    lower_bound in [-5, 0):        lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, c])), or
                                   lower_bound * sigmoid(g + dt_bias[h, c]) when A_log is None  (FLA "safe gate")
    dt_bias is [HV, K] or flat [HV * K]; None = 0. lower_bound is a static Python number.
    """
    _check_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    g = g.astype(jnp.float32)
    if A_log is None and lower_bound is None:
        return g
    x = g if dt_bias is None else g + dt_bias.astype(jnp.float32).reshape(g.shape[1:])
    if A_log is not None:
        rate = jnp.exp(A_log.astype(jnp.float32))[:, None]  # [HV, 1]
        if lower_bound is None:
            return -rate * jax.nn.softplus(x)
        x = rate * x
    return lower_bound * jax.nn.sigmoid(x)


def differentiable(**call) -> bool:
    """Plain jnp/lax: JAX differentiates through every call (`jaxckpt.ops.common.api` wraps the kernels that it
    cannot)."""
    return True


@functools.partial(jax.jit, static_argnames=_STATIC)
def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None,
        chunk_size=64, checkpoint_method="in_chunk", state_pass="associative"):
    """Kimi Delta Attention: the gated delta rule with a log decay per token, value head and key channel.

    Arguments, options, precision and results as `jaxckpt.ops.gdn.xla.gated_delta_rule`, except g [T, HV, K]: the raw
    gate, turned into the log decay by `kda_gate` (A_log [HV], dt_bias [HV, K] or [HV * K], lower_bound).
    """
    check_static(q, k, v, g, beta, per_channel_decay=True, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method=checkpoint_method,
                 state_pass=state_pass)
    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return chunked_delta_rule(q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                              initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                              checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                              chunk_size=chunk_size, checkpoint_method=checkpoint_method, state_pass=state_pass)
