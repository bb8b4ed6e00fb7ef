"""Gated DeltaNet (GDN) as Pallas kernels for the Triton lowering (NVIDIA GPUs; `interpret=True` on CPU), exporting
checkpoint states from inside the sequential pass. The kernels and their design are in
`jaxckpt/ops/common/pallas_triton_delta.py`; the math in README.md beside this file."""

from __future__ import annotations

import functools

import jax

from jaxckpt.ops.common import pallas_triton_delta
from jaxckpt.ops.common.delta_chunk import check_static

_STATIC = ("scale", "use_qk_l2norm", "state_layout", "chunk_size", "interpret", *pallas_triton_delta.TUNING_KEYS)


def supports(q, k, v, g, beta, *, chunk_size=64, interpret=False, **tuning) -> str | None:
    """None when `gated_delta_rule` can run these inputs and options, else the reason (for a fallback to XLA)."""
    if g.ndim != 2:
        return f"g: expected [T, HV] for GDN, got shape {g.shape}"
    return pallas_triton_delta.supports(q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, **tuning)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_delta_rule(q, k, v, g, beta, *, scale=None, use_qk_l2norm=False, initial_state=None, cu_seqlens=None,
                     checkpoint_cu=None, checkpoint_offsets=None, state_layout="kv", chunk_size=64, interpret=False,
                     **tuning):
    """Gated delta rule with a scalar log decay per token and value head, exporting checkpoint states.

    q, k                # [T, H, K]; optionally L2-normalized (`use_qk_l2norm`); q is multiplied by `scale`
                        # (a Python number, default K**-0.5)
    v                   # [T, HV, V]; HV a multiple of H, value head h reads key head h // (HV // H)
    g                   # [T, HV] log decay (<= 0)
    beta                # [T, HV]
    initial_state       # [N, HV, K, V] ("kv") or [N, HV, V, K] ("vk"), any float dtype; None = zeros
    cu_seqlens          # i32[N + 1]; None = one row over all T tokens
    checkpoint_cu       # i32[N + 1], CSR with checkpoint_offsets i32[M] (offsets relative to the row start)
    The metadata arrays may be traced; their values are trusted (validate them with `jaxckpt.plan.conventions`).
    `chunk_size` in (16, 32, 64); `interpret=True` runs the kernels on CPU; `tuning`: see
    `pallas_triton_delta.delta_rule` (num_warps, num_stages, block_v, intra_num_warps, output_block_v, fuse_output).
    Unsupported shapes or options raise ValueError with the reason `supports` gives.

    Returns (o [T, HV, V] in v.dtype, final_state fp32 [N, HV, K, V] or [N, HV, V, K], checkpoint_states fp32
    [M, HV, K, V] or [M, HV, V, K]); the checkpoint at offset p is the state after the row's first p tokens.
    Padding tokens and padded checkpoint entries give zeros.
    """
    check_static(q, k, v, g, beta, per_channel_decay=False, scale=scale, initial_state=initial_state,
                 cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu, checkpoint_offsets=checkpoint_offsets,
                 state_layout=state_layout, chunk_size=chunk_size, checkpoint_method="in_chunk",
                 state_pass="sequential")
    reason = supports(q, k, v, g, beta, chunk_size=chunk_size, interpret=interpret, **tuning)
    if reason is not None:
        raise ValueError(reason)
    return pallas_triton_delta.delta_rule(
        q, k, v, g, beta, per_channel_decay=False, scale=scale, use_qk_l2norm=use_qk_l2norm,
        initial_state=initial_state, cu_seqlens=cu_seqlens, checkpoint_cu=checkpoint_cu,
        checkpoint_offsets=checkpoint_offsets, state_layout=state_layout, chunk_size=chunk_size,
        interpret=interpret, **tuning)
