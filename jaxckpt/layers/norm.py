"""RMSNorm and the gated RMSNorm of the recurrent layers' outputs (computed in fp32, cast back)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

_GATES = {"silu": jax.nn.silu, "sigmoid": jax.nn.sigmoid}


def _rms(x, eps: float):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight over the last axis; weight [dim] starts at ones."""

    def __init__(self, dim: int, *, eps: float = 1e-6, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones(dim, dtype))

    def __call__(self, x):  # [..., dim]
        return (_rms(x.astype(jnp.float32), self.eps) * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated RMSNorm over the last axis, weight [dim].

    norm_before_gate=True  (GDN, KDA):  rms_norm(x) * weight * gate(z)
    norm_before_gate=False (Mamba2):    rms_norm_grouped(x * gate(z)) * weight, groups of `group_size` channels
    """

    def __init__(self, dim: int, *, eps: float, gate: str = "silu", norm_before_gate: bool = True,
                 group_size: int | None = None, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        if gate not in _GATES:
            raise ValueError(f"gate: must be one of {sorted(_GATES)}, got {gate!r}")
        group_size = dim if group_size is None else group_size
        if dim % group_size:
            raise ValueError(f"group_size: must divide dim={dim}, got {group_size}")
        self.eps = eps
        self.gate = gate
        self.norm_before_gate = norm_before_gate
        self.group_size = group_size
        self.weight = nnx.Param(jnp.ones(dim, dtype))

    def __call__(self, x, z):  # [..., dim], gate z [..., dim]
        f32 = jnp.float32
        x32, gate = x.astype(f32), _GATES[self.gate](z.astype(f32))
        weight = self.weight[...].astype(f32)
        if self.norm_before_gate:
            return (_rms(x32, self.eps) * weight * gate).astype(x.dtype)
        y = x32 * gate
        grouped = y.reshape(*y.shape[:-1], -1, self.group_size)
        return (_rms(grouped, self.eps).reshape(y.shape) * weight).astype(x.dtype)
