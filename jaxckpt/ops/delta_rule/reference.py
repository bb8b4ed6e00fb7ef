"""Token-by-token float64 reference of the gated delta rule, shared by GDN (scalar decay) and KDA (per-channel decay).

Written for clarity, not speed: a Python loop over rows and tokens, numpy over heads. Every input is upcast to float64
before any arithmetic, so the result does not depend on the input dtype beyond the rounding of the inputs themselves.
The recurrence, the KDA gate and the meaning of initial, final and checkpoint states are in README.md beside this
file. `gated_delta_rule`, `kda` and `kda_gate` are the ground truth every implementation is tested against.
"""

from __future__ import annotations

import math

import numpy as np

from jaxckpt.plan.checks import check_kda_gate, delta_dims, to_float64
from jaxckpt.plan.conventions import check_state_layout, validate_checkpoints, validate_cu_seqlens

L2NORM_EPS = 1e-6


def l2norm(x: np.ndarray) -> np.ndarray:
    """x / sqrt(sum(x^2) + 1e-6) over the last axis, the eps inside the sqrt as in FLA and HF."""
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def check_delta_inputs(q, k, v, g, beta, *, per_channel_decay: bool):
    """Checks dtypes and shapes of the token inputs; returns float64 copies of (q, k, v, g, beta).

    g is [T, HV, K] when `per_channel_decay` (KDA), else [T, HV] (GDN).
    """
    q = to_float64(q, name="q")  # [T, H, K]
    k = to_float64(k, name="k")  # [T, H, K]
    v = to_float64(v, name="v")  # [T, HV, V]
    g = to_float64(g, name="g")  # [T, HV] or [T, HV, K]
    beta = to_float64(beta, name="beta")  # [T, HV]
    delta_dims(q, k, v, g, beta, per_channel_decay=per_channel_decay)
    return q, k, v, g, beta


def delta_rule_reference(q, k, v, g, beta, *, per_channel_decay: bool, scale=None, use_qk_l2norm=False,
                         initial_state=None, cu_seqlens=None, checkpoint_cu=None, checkpoint_offsets=None,
                         state_layout="kv"):
    """The gated delta rule, token by token, in float64.

    Per value head h (key head h // (HV // H)), per token t of a row:
        S <- diag(exp(g_t)) S;  u_t = beta_t (v_t - S^T k_t);  S <- S + k_t u_t^T;  o_t = S^T (scale q_t)
    with S [K, V] and g_t a scalar (GDN) or a K-vector (KDA, `per_channel_decay=True`).

    q, k        # [T, H, K]
    v           # [T, HV, V]
    g           # [T, HV] or [T, HV, K]: log decay (<= 0 expected, not enforced)
    beta        # [T, HV]
    initial_state: [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"); None = zeros.
    Returns (o [T, HV, V], final_state [N, HV, K, V] / [N, HV, V, K], checkpoint_states [M, HV, K, V] /
    [M, HV, V, K]), float64. Padding tokens (past cu_seqlens[-1]) and padded checkpoint entries give zeros.
    """
    q, k, v, g, beta = check_delta_inputs(q, k, v, g, beta, per_channel_decay=per_channel_decay)
    check_state_layout(state_layout)
    num_tokens, num_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    if scale is None:
        scale = head_k ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) \
            or not math.isfinite(scale):
        raise ValueError(f"scale: must be a finite real number, got {scale!r}")
    cu_seqlens = validate_cu_seqlens(cu_seqlens, num_tokens)
    checkpoint_cu, checkpoint_offsets = validate_checkpoints(checkpoint_cu, checkpoint_offsets, cu_seqlens)
    num_rows = cu_seqlens.size - 1

    kv_shape = (num_rows, num_v_heads, head_k, head_v)
    if initial_state is None:
        state = np.zeros(kv_shape)
    else:
        state = to_float64(initial_state, name="initial_state")
        expected = kv_shape if state_layout == "kv" else (num_rows, num_v_heads, head_v, head_k)
        if state.shape != expected:
            dims = "[N, HV, K, V]" if state_layout == "kv" else "[N, HV, V, K]"
            raise ValueError(f"initial_state: expected {dims} = {expected} for state_layout={state_layout!r}, "
                             f"got shape {state.shape}")
        if state_layout == "vk":
            state = state.swapaxes(-1, -2)

    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    group = num_v_heads // num_heads
    q = np.repeat(q, group, axis=1) * scale  # [T, HV, K]
    k = np.repeat(k, group, axis=1)  # [T, HV, K]
    decay = np.exp(g if per_channel_decay else g[:, :, None])  # [T, HV, K] or [T, HV, 1]

    o = np.zeros((num_tokens, num_v_heads, head_v))
    final_state = np.zeros(kv_shape)
    checkpoint_states = np.zeros((checkpoint_offsets.size, num_v_heads, head_k, head_v))
    for n in range(num_rows):
        bos, eos = int(cu_seqlens[n]), int(cu_seqlens[n + 1])
        entries = range(int(checkpoint_cu[n]), int(checkpoint_cu[n + 1]))
        entry_at = {int(checkpoint_offsets[m]): m for m in entries}
        s = state[n].copy()  # [HV, K, V]
        for t in range(bos, eos):
            s = decay[t][:, :, None] * s
            u = beta[t][:, None] * (v[t] - np.einsum("hkv,hk->hv", s, k[t]))  # [HV, V]
            s = s + k[t][:, :, None] * u[:, None, :]
            o[t] = np.einsum("hkv,hk->hv", s, q[t])
            if t + 1 - bos in entry_at:
                checkpoint_states[entry_at[t + 1 - bos]] = s
        final_state[n] = s
    if state_layout == "vk":
        final_state = final_state.swapaxes(-1, -2).copy()
        checkpoint_states = checkpoint_states.swapaxes(-1, -2).copy()
    return o, final_state, checkpoint_states


def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv"):
    """Gated delta rule with a scalar log decay per token and value head, in float64.

    q, k                # [T, H, K]; optionally L2-normalized here (`use_qk_l2norm`); q is multiplied by `scale`
                        # (default K**-0.5)
    v                   # [T, HV, V]; HV a multiple of H, value head h reads key head h // (HV // H)
    g                   # [T, HV] log decay (<= 0 expected, not enforced)
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"); None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1], CSR with checkpoint_offsets i32[M] (offsets relative to the row start)
    Inputs may be float16, bfloat16, float32 or float64; everything is computed in float64.

    Returns (o [T, HV, V], final_state [N, HV, K, V] or [N, HV, V, K], checkpoint_states [M, HV, K, V] or
    [M, HV, V, K]), float64 numpy. The checkpoint at offset p is the state after the row's first p tokens; padded
    checkpoint entries and padding tokens give zeros.
    """
    return delta_rule_reference(q, k, v, g, beta, per_channel_decay=False, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                                checkpoint_offsets=checkpoint_offsets, state_layout=state_layout)


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
    A_log, dt_bias = (None if x is None else to_float64(x, name=name)
                      for x, name in ((A_log, "A_log"), (dt_bias, "dt_bias")))
    check_kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    if A_log is None and lower_bound is None:
        return g
    _, num_v_heads, head_k = g.shape
    x = g if dt_bias is None else g + dt_bias.reshape(num_v_heads, head_k)
    if A_log is not None:
        rate = np.exp(A_log)[:, None]  # [HV, 1]
        if lower_bound is None:
            return -rate * _softplus(x)
        return lower_bound * _sigmoid(rate * x)
    return lower_bound * _sigmoid(x)


def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", A_log=None, dt_bias=None, lower_bound=None):
    """Kimi Delta Attention: the gated delta rule with a log decay per token, value head and key channel, in float64.

    Arguments and results as `gated_delta_rule`, except g [T, HV, K]: the raw gate, turned
    into the log decay by `kda_gate` (A_log [HV], dt_bias [HV, K] or [HV * K], lower_bound).
    """
    q, k, v, g, beta = check_delta_inputs(q, k, v, g, beta, per_channel_decay=True)
    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return delta_rule_reference(q, k, v, g, beta, per_channel_decay=True, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
                                checkpoint_offsets=checkpoint_offsets, state_layout=state_layout)
