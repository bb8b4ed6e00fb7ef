"""KDA's gate in plain jnp: the raw gate g [T, HV, K] to the per-channel log decay, run by every implementation of
`kda` before its kernels (the formulas and their float64 twin: `reference.kda_gate`; the rules:
`jaxckpt.plan.checks.check_kda_gate`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxckpt.plan.checks import check_kda_gate


def kda_gate(g, *, A_log=None, dt_bias=None, lower_bound=None):
    """Per-key-channel log decay fp32 [T, HV, K] from the raw gate g [T, HV, K] (formulas as `reference.kda_gate`).

    A_log None, lower_bound None:  g itself (dt_bias must be None)
    A_log [HV], lower_bound None:  -exp(A_log[h]) * softplus(g + dt_bias[h, c])      (released Kimi-Linear)
    lower_bound in [-5, 0):        lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h, c])), or
                                   lower_bound * sigmoid(g + dt_bias[h, c]) when A_log is None  (FLA "safe gate")
    dt_bias is [HV, K] or flat [HV * K]; None = 0. lower_bound is a static Python number.
    """
    for name, x in (("g", g), ("A_log", A_log), ("dt_bias", dt_bias)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name}: dtype must be floating point, got {x.dtype}")
    check_kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
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
