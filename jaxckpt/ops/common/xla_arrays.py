"""Array helpers shared by the XLA implementations: compute dtype, float checks, static metadata checks."""

from __future__ import annotations

import jax.numpy as jnp

from jaxckpt.plan.checks import check_dt_limit, check_ssd_state, ssd_dims

FLOAT_DTYPES = tuple(jnp.dtype(d) for d in (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64))
# mamba_ssm's `_chunk_cumsum_fwd` returns dt itself above this threshold instead of softplus(dt).
SOFTPLUS_THRESHOLD = 20.0


def compute_dtype(dtype):
    """fp32 arithmetic for 16- and 32-bit inputs; float64 inputs stay float64 (exact gradient checks)."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def check_float(array, *, name: str):
    array = jnp.asarray(array)
    if array.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype must be float16, bfloat16, float32 or float64, got {array.dtype}")
    return array


def packed_metadata(cu_seqlens, checkpoint_cu, checkpoint_offsets, num_tokens: int):
    """Static checks of the row and checkpoint arrays (shapes and dtypes only: they may be traced).

    Returns (cu_seqlens i32[N + 1], checkpoint_cu i32[N + 1], checkpoint_offsets i32[M]); `cu_seqlens=None` is one
    row over all tokens, no checkpoint arrays is M = 0.
    """
    if cu_seqlens is None:
        cu = jnp.array([0, num_tokens], jnp.int32)
    else:
        cu = jnp.asarray(cu_seqlens)
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"cu_seqlens: expected i32[N + 1] with N >= 1, got shape {cu.shape}")
        if not jnp.issubdtype(cu.dtype, jnp.integer):
            raise ValueError(f"cu_seqlens: dtype must be an integer type, got {cu.dtype}")
        cu = cu.astype(jnp.int32)
    num_rows = cu.shape[0] - 1
    if checkpoint_cu is None and checkpoint_offsets is None:
        return cu, jnp.zeros(num_rows + 1, jnp.int32), jnp.zeros(0, jnp.int32)
    if checkpoint_cu is None or checkpoint_offsets is None:
        raise ValueError("checkpoint_cu and checkpoint_offsets: give both or neither")
    ccu = jnp.asarray(checkpoint_cu)
    offsets = jnp.asarray(checkpoint_offsets)
    if ccu.shape != (num_rows + 1,):
        raise ValueError(f"checkpoint_cu: expected i32[N + 1] = ({num_rows + 1},), got shape {ccu.shape}")
    if offsets.ndim != 1:
        raise ValueError(f"checkpoint_offsets: expected i32[M], got shape {offsets.shape}")
    for name, array in (("checkpoint_cu", ccu), ("checkpoint_offsets", offsets)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise ValueError(f"{name}: dtype must be an integer type, got {array.dtype}")
    return cu, ccu.astype(jnp.int32), offsets.astype(jnp.int32)


def check_ssd_inputs(x, dt, A, B, C, *, D=None, dt_bias=None, z=None):
    """Float checks and the shared SSD shape rules for the JAX implementations; returns the arrays and `SsdDims`."""
    x, dt, A, B, C = (check_float(a, name=n) for a, n in ((x, "x"), (dt, "dt"), (A, "A"), (B, "B"), (C, "C")))
    D, dt_bias, z = (None if a is None else check_float(a, name=n)
                     for a, n in ((D, "D"), (dt_bias, "dt_bias"), (z, "z")))
    return (x, dt, A, B, C, D, dt_bias, z), ssd_dims(x, dt, A, B, C, D=D, dt_bias=dt_bias, z=z)


def ssd_delta(dt, dt_bias, dt_limit, dtype):
    """SSD's step size [T, H] in `dtype`: clamp(softplus(dt + dt_bias), dt_limit), softplus as mamba_ssm's."""
    limit = check_dt_limit(dt_limit)
    raw = dt.astype(dtype) if dt_bias is None else dt.astype(dtype) + dt_bias.astype(dtype)
    # the clamp inside keeps exp (and its gradient) finite on the branch that `where` discards
    delta = jnp.where(raw > SOFTPLUS_THRESHOLD, raw, jnp.log1p(jnp.exp(jnp.minimum(raw, SOFTPLUS_THRESHOLD))))
    return delta if limit is None else jnp.clip(delta, *limit)


def ssd_initial_state(initial_state, dims, num_rows: int, state_layout: str, dtype):
    """The checked initial states as [N, H, P, N_state] ("vk", the kernels' layout) in `dtype`, or None."""
    if initial_state is None:
        return None
    init = check_float(initial_state, name="initial_state").astype(dtype)
    check_ssd_state(init, dims, num_rows, state_layout)
    return init.swapaxes(-1, -2) if state_layout == "kv" else init
