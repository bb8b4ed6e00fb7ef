"""Single-token recurrent steps for decode rows: one state update per row, no chunk machinery.

Each takes the tokens of rows that hold exactly one token (row n is token n) and returns (out, final_state fp32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxckpt.ops.delta_rule.chunk import L2NORM_EPS

_HIGHEST = jax.lax.Precision.HIGHEST


def _to_kv(state, state_layout):
    return state if state_layout == "kv" else jnp.swapaxes(state, -1, -2)


def delta_rule_step(q, k, v, g, beta, *, initial_state=None, scale=None, use_qk_l2norm=False, state_layout="kv"):
    """q, k [N, H, K]; v [N, HV, V]; g [N, HV] or [N, HV, K] log decay; beta [N, HV]; state [N, HV, K, V] ("kv")."""
    num_rows, num_heads, head_k = q.shape
    num_v_heads, head_v = v.shape[1:]
    f32 = jnp.float32
    out_dtype = v.dtype
    q, k, v, g, beta = (a.astype(f32) for a in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + L2NORM_EPS)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + L2NORM_EPS)
    group = num_v_heads // num_heads
    q = jnp.repeat(q, group, axis=1) * (head_k ** -0.5 if scale is None else scale)
    k = jnp.repeat(k, group, axis=1)
    state = (jnp.zeros((num_rows, num_v_heads, head_k, head_v), f32) if initial_state is None
             else _to_kv(initial_state.astype(f32), state_layout))
    decay = jnp.exp(g)[..., None] if g.ndim == 3 else jnp.exp(g)[..., None, None]
    state = state * decay
    u = beta[..., None] * (v - jnp.einsum("nhkv,nhk->nhv", state, k, precision=_HIGHEST))
    state = state + k[..., :, None] * u[..., None, :]
    out = jnp.einsum("nhkv,nhk->nhv", state, q, precision=_HIGHEST)
    return out.astype(out_dtype), _to_kv(state, state_layout)


def ssd_step(x, dt, B, C, *, A, initial_state=None, D=None, dt_bias=None, z=None, dt_limit=None, state_layout="vk"):
    """x [N, H, P]; dt [N, H] raw; B, C [N, G, Nst]; state [N, H, P, Nst] ("vk") or [N, H, Nst, P] ("kv")."""
    num_rows, num_heads, head_p = x.shape
    groups, state_n = B.shape[1:]
    f32 = jnp.float32
    x32, dt32, B32, C32 = (a.astype(f32) for a in (x, dt, B, C))
    dt32 = dt32 + (0.0 if dt_bias is None else dt_bias.astype(f32))
    delta = jnp.where(dt32 > 20.0, dt32, jax.nn.softplus(dt32))
    if dt_limit is not None:
        delta = jnp.clip(delta, dt_limit[0], dt_limit[1])
    heads_per_group = num_heads // groups
    B32 = jnp.repeat(B32, heads_per_group, axis=1)
    C32 = jnp.repeat(C32, heads_per_group, axis=1)
    state = jnp.zeros((num_rows, num_heads, head_p, state_n), f32) if initial_state is None else (
        initial_state.astype(f32) if state_layout == "vk" else jnp.swapaxes(initial_state.astype(f32), -1, -2))
    decay = jnp.exp(delta * A.astype(f32))
    state = state * decay[..., None, None] + (delta[..., None] * x32)[..., :, None] * B32[..., None, :]
    y = jnp.einsum("nhpk,nhk->nhp", state, C32, precision=_HIGHEST)
    if D is not None:
        y = y + (D.astype(f32)[:, None] if D.ndim == 1 else D.astype(f32)) * x32
    if z is not None:
        y = y * jax.nn.silu(z.astype(f32))
    out_state = state if state_layout == "vk" else jnp.swapaxes(state, -1, -2)
    return y.astype(x.dtype), out_state
