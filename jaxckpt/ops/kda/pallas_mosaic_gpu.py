"""Kimi Delta Attention (KDA) on Pallas Mosaic GPU kernels (Hopper; `interpret=True` on CPU), exporting checkpoint
states from inside the state pass. The gate is computed in plain jnp (`xla.kda_gate`) before the kernels: the Triton
gate cumsum, the Mosaic GPU intra pass, the state pass (version 2 lanes kernel with the
sequence split by default), one gather of O. Pipeline, options and design: `jaxckpt/ops/common/README.md` ("Mosaic GPU
kernels") and `jaxckpt/ops/common/pallas_mosaic_gpu_delta.py`; the math and the gate in README.md beside this
file."""

from __future__ import annotations

import functools

import jax

from jaxckpt.ops.common import pallas_mosaic_gpu_delta
from jaxckpt.ops.common.delta_backend import gate_reason, run_checked
from jaxckpt.ops.kda.xla import kda_gate

_STATIC = ("scale", "use_qk_l2norm", "state_layout", "chunk_size", "interpret", "lower_bound",
           *pallas_mosaic_gpu_delta.TUNING_KEYS)


def supports(q, k, v, g, beta, *, chunk_size=64, interpret=False, cu_seqlens=None, **tuning) -> str | None:
    """None when `kda` can run these inputs and options, else the reason (for a fallback to XLA)."""
    return gate_reason(q, g, per_channel_decay=True) or pallas_mosaic_gpu_delta.supports(
        q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, cu_seqlens=cu_seqlens, **tuning)


@functools.partial(jax.jit, static_argnames=_STATIC)
def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64, interpret=False, A_log=None,
        dt_bias=None, lower_bound=None, **tuning):
    """Kimi Delta Attention: the gated delta rule with a log decay per token, value head and key channel.

    Arguments (the gate's A_log, dt_bias, lower_bound included), shapes and results as `jaxckpt.ops.kda.xla.kda`
    (packed rows; metadata may be traced and its values are trusted); the gate runs in plain jnp before the kernels.
    q, k, v in one 16-bit dtype, K and V in (64, 128). `chunk_size` 64; `interpret=True` runs the kernels on CPU;
    `tuning`: the fields of `jaxckpt.ops.DeltaPallasMosaicGpuConfig` (defaults in
    `pallas_mosaic_gpu_delta.default_tuning`). Unsupported shapes or options raise ValueError with the reason
    `supports` gives.
    """
    gate = functools.partial(kda_gate, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return run_checked(pallas_mosaic_gpu_delta.delta_rule_mosaic, supports, q, k, v, g, beta, per_channel_decay=True,
                       scale=scale, use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                       chunk_size=chunk_size, interpret=interpret, gate=gate, **tuning)
