"""Gated DeltaNet (GDN) as Pallas kernels for the Triton lowering (NVIDIA GPUs; `interpret=True` on CPU), exporting
checkpoint states from inside the sequential pass. The kernels and their design are in
`jaxckpt/ops/common/pallas_triton_delta.py`; the math in README.md beside this file."""

from __future__ import annotations

import functools

import jax

from jaxckpt.ops.common import pallas_triton_delta
from jaxckpt.ops.common.delta_backend import gate_reason, run_checked

_STATIC = ("scale", "use_qk_l2norm", "state_layout", "chunk_size", "interpret", *pallas_triton_delta.TUNING_KEYS)


def supports(q, k, v, g, beta, *, chunk_size=64, interpret=False, **tuning) -> str | None:
    """None when `gated_delta_rule` can run these inputs and options, else the reason (for a fallback to XLA)."""
    if tuning.get("kda_block_k") is not None:
        return "tuning: kda_block_k tunes KDA's intra pass; this is a GDN call"
    return gate_reason(q, g, per_channel_decay=False) or pallas_triton_delta.supports(
        q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, **tuning)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64, interpret=False,
                     **tuning):
    """Gated delta rule with a scalar log decay per token and value head, exporting checkpoint states.

    Arguments, shapes and results as `jaxckpt.ops.gdn.xla.gated_delta_rule` (packed rows; metadata may be traced and
    its values are trusted); q, k, v in fp32, bf16 or f16, K and V powers of two in [16, 256]. `chunk_size` in
    (16, 32, 64); `interpret=True` runs the kernels on CPU; `tuning`: the fields of
    `jaxckpt.ops.DeltaPallasTritonConfig`. Unsupported shapes or options raise ValueError with the reason `supports`
    gives. Padding tokens and padded checkpoint entries give zeros.
    """
    return run_checked(pallas_triton_delta.delta_rule, supports, q, k, v, g, beta, per_channel_decay=False,
                       scale=scale, use_qk_l2norm=use_qk_l2norm, initial_state=initial_state, cu_seqlens=cu_seqlens,
                       checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets, state_layout=state_layout,
                       chunk_size=chunk_size, interpret=interpret, **tuning)
