"""Kimi Delta Attention (KDA) on Pallas Mosaic GPU kernels (Hopper; `interpret=True` on CPU), exporting checkpoint
states from inside the state pass. The gate is computed in plain jnp (`xla.kda_gate`) before the kernels: the Triton
gate cumsum, an intra pass (Triton by default, or Mosaic GPU), the state pass (version 2 lanes kernel with the
sequence split by default), one gather of O. Pipeline, options and design: `jaxckpt/ops/common/README.md` ("Mosaic GPU
kernels") and `jaxckpt/ops/common/pallas_mosaic_gpu_delta.py`; the math and the gate in README.md beside this
file."""

from __future__ import annotations

import functools

import jax

from jaxckpt.ops.common import pallas_mosaic_gpu_delta
from jaxckpt.ops.common.delta_chunk import check_static
from jaxckpt.ops.kda.xla import kda_gate

_STATIC = ("scale", "use_qk_l2norm", "state_layout", "chunk_size", "interpret", "lower_bound",
           *pallas_mosaic_gpu_delta.TUNING_KEYS)


def supports(q, k, v, g, beta, *, chunk_size=64, interpret=False, cu_seqlens=None, **tuning) -> str | None:
    """None when `kda` can run these inputs and options, else the reason (for a fallback to XLA)."""
    if g.ndim != 3 or g.shape[-1] != q.shape[-1]:
        return f"g: expected [T, HV, K] for KDA, got shape {g.shape}"
    return pallas_mosaic_gpu_delta.supports(q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret,
                                            cu_seqlens=cu_seqlens, **tuning)


@functools.partial(jax.jit, static_argnames=_STATIC)
def kda(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
        checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64, interpret=False, A_log=None,
        dt_bias=None, lower_bound=None, **tuning):
    """Kimi Delta Attention: the gated delta rule with a log decay per token, value head and key channel.

    q, k                # [T, H, K] bf16 or f16, K in (64, 128); optionally L2-normalized (`use_qk_l2norm`); q is
                        # multiplied by `scale` (a Python number, default K**-0.5)
    v                   # [T, HV, V] same dtype, V in (64, 128); HV a multiple of H, value head h reads key head
                        # h // (HV // H)
    g                   # [T, HV, K] raw gate, turned into the log decay by `kda_gate` (A_log, dt_bias, lower_bound)
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"), any float dtype; None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1], CSR with checkpoint_offsets i32[M] (offsets relative to the row start)
    The metadata arrays may be traced; their values are trusted (validate them with `jaxckpt.plan.conventions`).
    `chunk_size` 64; `interpret=True` runs the kernels on CPU; `tuning`: see
    `pallas_mosaic_gpu_delta.delta_rule_mosaic` (state, pieces, kda_score_parts, intra_inverse, state_terms,
    intra_num_warps, num_stages; defaults in `pallas_mosaic_gpu_delta.default_tuning`). Unsupported
    shapes or options raise ValueError with the reason `supports` gives.

    Returns (o [T, HV, V] in v.dtype, final_state fp32 [N, HV, K, V] or [N, HV, V, K], checkpoint_states fp32
    [M, HV, K, V] or [M, HV, V, K]); the checkpoint at offset p is the state after the row's first p tokens.
    Padding tokens and padded checkpoint entries give zeros.
    """
    check_static(q, k, v, g, beta, per_channel_decay=True, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method="in_chunk",
                 state_pass="sequential")
    reason = supports(q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, **tuning)
    if reason is not None:
        raise ValueError(reason)
    g = kda_gate(g, A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound)
    return pallas_mosaic_gpu_delta.delta_rule_mosaic(
        q, k, v, g, beta, per_channel_decay=True, scale=scale, use_qk_l2norm=use_qk_l2norm,
        initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
        checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, chunk_size=chunk_size,
        interpret=interpret, **tuning)
