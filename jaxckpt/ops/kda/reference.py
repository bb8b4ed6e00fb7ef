"""Float64 token-by-token reference of Kimi Delta Attention (KDA) and its gate: the ground truth every KDA
implementation is tested against. The math, gate, state layout and checkpoint semantics are in README.md beside
this file."""

from __future__ import annotations

import math

import numpy as np

from jaxckpt.ops.common.delta_reference import check_delta_inputs, delta_rule_reference, to_float64

LOWER_BOUND_RANGE = (-5.0, 0.0)


def _softplus(x):
    return np.logaddexp(0.0, x)


def _sigmoid(x):
    return np.exp(-np.logaddexp(0.0, -x))


def kda_gate(g, *, A_log=None, dt_bias=None, lower_bound=None):
    """Per-key-channel log decay [T, HV, K] (float64) from the raw gate g [T, HV, K].

    A_log None, lower_bound None:  g itself (dt_bias must be None: nothing would use it)
    A_log [HV], lower_bound None:  -exp(A_log[h]) * softplus(g + dt_bias[h, c])      (released Kimi-Linear)
    lower_bound in [-5, 0):        lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, c])), or
                                   lower_bound * sigmoid(g + dt_bias[h, c]) when A_log is None  (FLA "safe gate")
    dt_bias is [HV, K] or flat [HV * K] (vLLM's storage); None = 0.
    """
    g = to_float64(g, name="g")
    if g.ndim != 3:
        raise ValueError(f"g: expected [T, HV, K], got shape {g.shape}")
    _, num_v_heads, head_k = g.shape
    if lower_bound is not None:
        low, high = LOWER_BOUND_RANGE
        if isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float, np.integer, np.floating)) \
                or not math.isfinite(lower_bound) or not low <= lower_bound < high:
            raise ValueError(f"lower_bound: must be a number in [{low:g}, {high:g}), got {lower_bound!r}")
    if A_log is None and lower_bound is None:
        if dt_bias is not None:
            raise ValueError("dt_bias: only used with A_log or lower_bound; without them g is the log decay itself")
        return g
    if dt_bias is None:
        bias = np.zeros((num_v_heads, head_k))
    else:
        bias = to_float64(dt_bias, name="dt_bias")
        if bias.shape not in ((num_v_heads, head_k), (num_v_heads * head_k,)):
            raise ValueError(f"dt_bias: expected [HV, K] = {(num_v_heads, head_k)} or [HV * K] = "
                             f"({num_v_heads * head_k},), got shape {bias.shape}")
        bias = bias.reshape(num_v_heads, head_k)
    x = g + bias
    if A_log is not None:
        a_log = to_float64(A_log, name="A_log")
        if a_log.shape != (num_v_heads,):
            raise ValueError(f"A_log: expected [HV] = ({num_v_heads},), got shape {a_log.shape}")
        rate = np.exp(a_log)[:, None]  # [HV, 1]
        if lower_bound is None:
            return -rate * _softplus(x)
        return lower_bound * _sigmoid(rate * x)
    return lower_bound * _sigmoid(x)


def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None):
    """Kimi Delta Attention: the gated delta rule with a log decay per token, value head and key channel, in float64.

    Arguments and results as `jaxckpt.ops.gdn.reference.gated_delta_rule`, except g [T, HV, K]: the raw gate, turned
    into the log decay by `kda_gate` (A_log [HV], dt_bias [HV, K] or [HV * K], lower_bound).
    """
    q, k, v, g, beta = check_delta_inputs(q, k, v, g, beta, per_channel_decay=True)
    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return delta_rule_reference(q, k, v, g, beta, per_channel_decay=True, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                                checkpoint_offsets=checkpoint_offsets, state_layout=state_layout)
